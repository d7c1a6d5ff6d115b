//! Bad-input tests of the binders of kernels compiled without runtime bounds checks
//! (`Context::module_unchecked`): their safety rests on the host's shape and size checks at
//! bind time, so each lie a caller could tell through public fields must be refused there.

use super::matmul::{MatmulArgs, MatmulInput, MatmulKernel};
use super::matvec::*;
use crate::state::RunState;
use crate::tensor::Q4Matrix;
use crate::testing::{gpu, rand_f32, rand_q4_0, rng};

/// The int4 x f32 forms (matvec and the multi-column matmul) run without runtime bounds
/// checks, so their binders must refuse a Q4Matrix whose public fields lie about its buffers (too small, gaps, wrong row count).
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
    // The multi-column matmul (one column here: X and Y hold one).
    let mm = MatmulKernel::new(&ctx).unwrap();
    let mm_bind = |m: &Q4Matrix, input: MatmulInput<'_>| {
        let a = MatmulArgs {
            m,
            input,
            nb: 1,
            y: &y,
            y_stride: rows as u32,
            state: &state,
        };
        mm.bind(&ctx, &a).map(|_| ())
    };
    for input in [
        MatmulInput::Plain(&x),
        MatmulInput::Acc(&x),
        MatmulInput::Norm(nol()),
    ] {
        assert!(mm_bind(&honest(), input).is_ok());
    }
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
        for input in [
            MatmulInput::Plain(&x),
            MatmulInput::Acc(&x),
            MatmulInput::Norm(nol()),
        ] {
            let e = mm_bind(&m, input).err();
            let e = e.unwrap_or_else(|| panic!("{what}: matmul accepted it"));
            assert!(e.to_string().contains("Q4 matrix"), "{what}: matmul: {e}");
        }
    }
}

/// The prefill GEMMs run without runtime bounds checks: their binder must refuse a lying
/// weight matrix (int4 or the f32 router) and a plan layout whose expert offsets would overlap
/// the tiles.
#[test]
fn gemm_binder_refuses_lying_matrices_and_plans() {
    use super::gemm::{GemmArgs, GemmForm, GemmKernel, GemmWeights, PlanLayout};
    let Some(ctx) = gpu("gemm_binder_refuses_lying_matrices_and_plans") else {
        return;
    };
    let k = GemmKernel::new(&ctx).unwrap();
    let mut r = rng(74);
    // 4 experts of 16 rows x 64 inputs.
    let wb = rand_q4_0(&mut r, 64, 64);
    let honest = || Q4Matrix::upload(&ctx, "w", 64, 64, 16, &[&wb]).unwrap();
    let x = ctx.storage("x", 8 * 64 * 4).unwrap();
    let y = ctx.storage("y", 8 * 64 * 4).unwrap();
    let dims = ctx
        .uniform("dims", bytemuck::cast_slice(&[4u32, 0, 0, 0]))
        .unwrap();
    let plan = ctx.storage("plan", 64 * 4).unwrap();
    let good = PlanLayout {
        k: 2,
        off: 1,
        tiles: 6,
        list: 16,
    };
    let dense = |w| GemmArgs {
        form: GemmForm::Dense,
        w: GemmWeights::Q4(w),
        x: &x,
        y: &y,
        y_stride: 64,
        x_rows: 4,
        y_rows: 4,
        dims: Some(&dims),
        plan: None,
        rows_per_expert: 0,
        max_tiles: 0,
    };
    let down = |w, pl| GemmArgs {
        form: GemmForm::Down,
        plan: Some((&plan, pl)),
        rows_per_expert: 16,
        max_tiles: 4,
        x_rows: 8,
        y_rows: 8,
        ..dense(w)
    };
    let m = honest();
    assert!(k.bind(&ctx, &dense(&m), 4).is_ok());
    assert!(k.bind(&ctx, &down(&m, good), 4).is_ok());
    // Offsets of 4 experts need words 1..=5: tiles at 5 would overlap the last.
    let overlap = PlanLayout { tiles: 5, ..good };
    let e = k
        .bind(&ctx, &down(&m, overlap), 4)
        .err()
        .expect("overlapping plan accepted");
    assert!(e.to_string().contains("plan layout"), "{e}");
    let mut lying = honest();
    lying.parts[0].scales = ctx.storage("s", 8).unwrap();
    for a in [dense(&lying), down(&lying, good)] {
        let e = k.bind(&ctx, &a, 4).err().expect("lying matrix accepted");
        assert!(e.to_string().contains("Q4 matrix"), "{e}");
    }
    // The f32 router GEMM: an honest matrix binds, one whose part claims more rows than its
    // buffer holds does not.
    let router = || crate::tensor::F32Matrix::upload(&ctx, "r", 64, 64, &[0.25; 64 * 64]).unwrap();
    let f32_dense = |w| GemmArgs {
        form: GemmForm::DenseF32,
        w: GemmWeights::F32(w),
        ..dense(&m)
    };
    let honest_router = router();
    assert!(k.bind(&ctx, &f32_dense(&honest_router), 4).is_ok());
    let mut lying = router();
    lying.parts[0].w = ctx.storage("w", 64 * 4).unwrap();
    let e = k.bind(&ctx, &f32_dense(&lying), 4).err();
    let e = e.expect("lying f32 matrix accepted");
    assert!(e.to_string().contains("f32 matrix"), "{e}");
}

/// A plan layout whose u32 sums would wrap (list + y_rows past u32::MAX) is refused, not
/// accepted through an overflowed check.
#[test]
fn gemm_binder_refuses_a_plan_layout_that_wraps() {
    use super::gemm::{GemmArgs, GemmForm, GemmKernel, GemmWeights, PlanLayout};
    let Some(ctx) = gpu("gemm_binder_refuses_a_plan_layout_that_wraps") else {
        return;
    };
    let k = GemmKernel::new(&ctx).unwrap();
    let wb = rand_q4_0(&mut rng(75), 64, 64);
    let m = Q4Matrix::upload(&ctx, "w", 64, 64, 16, &[&wb]).unwrap();
    let x = ctx.storage("x", 256 * 64 * 4).unwrap();
    let y = ctx.storage("y", 256 * 64 * 4).unwrap();
    let plan = ctx.storage("plan", 16).unwrap();
    let wrapping = PlanLayout {
        k: 8,
        off: 1,
        tiles: 200,
        list: 0xFFFF_FF00,
    };
    let a = GemmArgs {
        form: GemmForm::Down,
        w: GemmWeights::Q4(&m),
        x: &x,
        y: &y,
        y_stride: 64,
        x_rows: 256,
        y_rows: 256,
        dims: None,
        plan: Some((&plan, wrapping)),
        rows_per_expert: 16,
        max_tiles: 4,
    };
    assert!(
        k.bind(&ctx, &a, 4).is_err(),
        "wrapping plan layout accepted"
    );
    let zero_k = PlanLayout {
        k: 0,
        off: 1,
        tiles: 6,
        list: 16,
    };
    let plan = ctx.storage("plan", 4 * (16 + 256)).unwrap();
    let a = GemmArgs {
        plan: Some((&plan, zero_k)),
        ..a
    };
    assert!(k.bind(&ctx, &a, 4).is_err(), "K = 0 accepted");
}
