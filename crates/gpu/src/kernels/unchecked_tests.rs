//! Bad-input tests of the binders of kernels compiled without runtime bounds checks
//! (`Context::module_unchecked`): their safety rests on the host's shape and size checks at
//! bind time, so each lie a caller could tell through public fields must be refused there.

use super::matvec::*;
use crate::state::RunState;
use crate::tensor::Q4Matrix;
use crate::testing::{gpu, rand_f32, rand_q4_0, rng};

/// The int4 x f32 forms run without runtime bounds checks, so their binders must refuse a
/// Q4Matrix whose public fields lie about its buffers (too small, gaps, wrong row count).
#[test]
fn q4_f32_binders_refuse_lying_matrices() {
    let Some(ctx) = gpu("q4_f32_binders_refuse_lying_matrices") else {
        return;
    };
    let mut r = rng(5);
    let (rows, cols) = (8usize, 64usize);
    let wb = rand_q4_0(&mut r, rows, cols);
    let k = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let x = ctx
        .storage_init(
            "x",
            bytemuck::cast_slice(&rand_f32(&mut r, cols, -1.0, 1.0)),
        )
        .unwrap();
    let wn = ctx
        .storage_init("w", bytemuck::cast_slice(&vec![1.0f32; cols]))
        .unwrap();
    let y = ctx.storage("y", rows as u64 * 4).unwrap();
    let nol = || NormInput {
        h: &x,
        weight: &wn,
        eps: 1e-6,
    };
    let honest = || Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
    assert!(k.bind_q4(&ctx, &honest(), Act::F32(&x), &y, &state).is_ok());
    assert!(k.bind_q4_norm(&ctx, &honest(), nol(), &y, &state).is_ok());
    type Lie<'a> = Box<dyn Fn(&mut Q4Matrix) + 'a>;
    let lies: [(&str, Lie); 5] = [
        (
            "qs too small",
            Box::new(|m| m.parts[0].qs = ctx.storage("q", 64).unwrap()),
        ),
        (
            "scales too small",
            Box::new(|m| m.parts[0].scales = ctx.storage("s", 4).unwrap()),
        ),
        (
            "part with more rows than its buffers",
            Box::new(|m| m.parts[0].rows = 16),
        ),
        (
            "parts end before the rows",
            Box::new(|m| m.parts[0].rows = 4),
        ),
        ("cols not a multiple of 32", Box::new(|m| m.cols = 48)),
    ];
    for (what, lie) in lies {
        let mut m = honest();
        lie(&mut m);
        let e = k
            .bind_q4(&ctx, &m, Act::F32(&x), &y, &state)
            .err()
            .unwrap_or_else(|| panic!("{what}: bind_q4 accepted it"));
        assert!(e.to_string().contains("Q4 matrix"), "{what}: {e}");
        assert!(
            k.bind_q4_norm(&ctx, &m, nol(), &y, &state).is_err(),
            "{what}: norm form"
        );
        let h = ctx.storage("h", rows as u64 * 4).unwrap();
        let fold = ctx.storage("fold", 4 * (rows + cols) as u64 * 4).unwrap();
        let z = ctx.storage("z", 16).unwrap();
        let router = k.bind_q4_router(&ctx, &m, &x, &h, &fold, 4, &y, &z, &state);
        assert!(router.is_err(), "{what}: router form");
    }
}
