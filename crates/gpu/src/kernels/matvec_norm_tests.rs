//! Lavapipe tests of the norm-on-load matvec (matvec_norm.rs: the decode's qkv, `y = m ·
//! rmsnorm(h)`) against the scalar references: plain, late-scaled and with the residual add,
//! and warming another matrix into L2 without changing a bit (a matrix of several parts too).
//! Stacks of two forms are in mixed_tests.rs.

use super::matvec::*;
use super::matvec_tests::assert_rows;
use crate::numerics::Numerics;
use crate::state::RunState;
use crate::tensor::Q4Matrix;
use crate::testing::{dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};

#[test]
fn q4_norm_warm_writes_the_norm_forms_bits() {
    let Some(ctx) = gpu("q4_norm_warm_writes_the_norm_forms_bits") else {
        return;
    };
    let mut r = rng(31);
    let state = RunState::default().buffer(&ctx).unwrap();
    let sink = crate::kernels::warm::sink(&ctx).unwrap();
    for late in [false, true] {
        let k = MatvecKernel::with_options(&ctx, Numerics::F32, late).unwrap();
        for &(rows, cols, wrows, wcols) in
            &[(13, 96, 7, 64), (300, 2048, 700, 2048), (40, 64, 3, 32)]
        {
            let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&rand_q4_0(&mut r, rows, cols)])
                .unwrap();
            let warm = Q4Matrix::upload(
                &ctx,
                "warm",
                wrows,
                wcols,
                1,
                &[&rand_q4_0(&mut r, wrows, wcols)],
            )
            .unwrap();
            let h = ctx
                .storage_init(
                    "h",
                    bytemuck::cast_slice(&rand_f32(&mut r, cols, -30.0, 30.0)),
                )
                .unwrap();
            let nw = ctx
                .storage_init(
                    "nw",
                    bytemuck::cast_slice(&rand_f32(&mut r, cols, 0.5, 1.5)),
                )
                .unwrap();
            let input = NormInput {
                h: &h,
                weight: &nw,
                eps: 1e-6,
            };
            if wrows == 700 {
                // 700 x 64 blocks and scales: 25200 sectors, several warm workgroups.
                assert!(crate::kernels::warm::workgroups(&warm.parts[0]) >= 13);
            }
            let y = ctx.storage("y", rows as u64 * 4).unwrap();
            let mut outs = Vec::new();
            for warmed in [false, true] {
                ctx.write(&y, 0, &vec![0xFF; rows * 4]);
                let b = if warmed {
                    k.bind_q4_norm_warm(&ctx, &w, input, &y, &state, (&warm.parts[0], &sink))
                } else {
                    k.bind_q4_norm(&ctx, &w, input, &y, &state)
                }
                .unwrap();
                ctx.run_pass(|p| k.record(p, &b)).unwrap();
                outs.push(ctx.read_f32(&y, rows).unwrap());
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(outs[0].iter().all(|v| v.is_finite()));
            assert_eq!(
                bits(&outs[0]),
                bits(&outs[1]),
                "[{rows}, {cols}] late {late}"
            );
        }
    }
    // A matrix of several bindings: its first dispatch warms, every part's rows come out with
    // the bits of the whole matrix's.
    let k = MatvecKernel::new(&ctx).unwrap();
    let wb = rand_q4_0(&mut r, 300, 64);
    let split = Q4Matrix::upload(
        &ctx.with_max_binding_bytes(20 * 4 * 16),
        "w",
        300,
        64,
        1,
        &[&wb],
    )
    .unwrap();
    assert!(split.parts.len() > 1);
    let whole = Q4Matrix::upload(&ctx, "w", 300, 64, 1, &[&wb]).unwrap();
    let h = ctx
        .storage_init("h", bytemuck::cast_slice(&rand_f32(&mut r, 64, -3.0, 3.0)))
        .unwrap();
    let nw = ctx
        .storage_init("nw", bytemuck::cast_slice(&rand_f32(&mut r, 64, 0.5, 1.5)))
        .unwrap();
    let y = ctx.storage("y", 300 * 4).unwrap();
    let input = NormInput {
        h: &h,
        weight: &nw,
        eps: 1e-6,
    };
    let mut outs = Vec::new();
    for (m, warmed) in [(&whole, false), (&split, false), (&split, true)] {
        ctx.write(&y, 0, &vec![0xFF; 300 * 4]);
        let b = if warmed {
            k.bind_q4_norm_warm(&ctx, m, input, &y, &state, (&whole.parts[0], &sink))
        } else {
            k.bind_q4_norm(&ctx, m, input, &y, &state)
        }
        .unwrap();
        assert_eq!(b.dispatch_count(), m.parts.len());
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, 300).unwrap();
        assert!(got.iter().all(|v| v.is_finite() && *v != 0.0));
        outs.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
    assert_eq!(outs[0], outs[1], "split");
    assert_eq!(outs[0], outs[2], "split, warmed");
}

#[test]
fn q4_norm_on_load_and_residual_add_match_reference() {
    let Some(ctx) = gpu("q4_norm_on_load_and_residual_add_match_reference") else {
        return;
    };
    let mut r = rng(12);
    let k = MatvecKernel::new(&ctx).unwrap();
    // The late-norm form (`--tune late_norm=1`): the same product, the scale applied last.
    let late = MatvecKernel::with_options(&ctx, Numerics::F32, true).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    // cols up to the 4096 shared-memory limit; rows hitting 1, 2 and 4 rows per team.
    for &(rows, cols) in &[
        (3, 32),
        (13, 96),
        (300, 2048),
        (9000, 64),
        (33000, 32),
        (5, 4096),
    ] {
        let wb = rand_q4_0(&mut r, rows, cols);
        let deq = dequant_q4_0(&wb, rows, cols);
        let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
        // A residual stream far from unit scale (the norm must bring it back).
        let h: Vec<f32> = rand_f32(&mut r, cols, -30.0, 30.0);
        let nw = rand_f32(&mut r, cols, 0.5, 1.5);
        let eps = 1e-6;
        let (_, xn) = crate::kernels::norm::rmsnorm_ref(&h, None, &nw, eps);
        let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
        let wbuf = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
        let y = ctx.storage("y", rows as u64 * 4).unwrap();
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        let input = NormInput {
            h: &hb,
            weight: &wbuf,
            eps,
        };
        let want = matvec_f32_ref(&deq, rows, cols, &xn);
        for (kern, form) in [(&k, "norm"), (&late, "late norm")] {
            ctx.write(&y, 0, &vec![0xFF; rows * 4]);
            let b = kern.bind_q4_norm(&ctx, &w, input, &y, &state).unwrap();
            ctx.run_pass(|p| kern.record(p, &b)).unwrap();
            let got = ctx.read_f32(&y, rows).unwrap();
            assert_rows(
                &got,
                &want,
                &deq,
                &xn,
                2e-6,
                &format!("{form} [{rows}, {cols}]"),
            );
        }

        // y += m · x on top of a random y.
        let x = rand_f32(&mut r, cols, -1.0, 1.0);
        let y0 = rand_f32(&mut r, rows, -5.0, 5.0);
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        ctx.write(&y, 0, bytemuck::cast_slice(&y0));
        let b = k.bind_q4_acc(&ctx, &w, &xb, &y, &state).unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        let mv = matvec_f32_ref(&deq, rows, cols, &x);
        let want: Vec<f32> = mv.iter().zip(&y0).map(|(a, b)| a + b).collect();
        for i in 0..rows {
            let tol = 1e-6 * (y0[i].abs() + mv[i].abs() + 1.0);
            assert!(
                (got[i] - want[i]).abs() <= tol.max(2e-6 * cols as f32 / 32.0),
                "acc [{rows}, {cols}] row {i}: got {}, want {}",
                got[i],
                want[i]
            );
        }
    }
    // Past the shared-memory copy: a clear error, no dispatch.
    let wb = rand_q4_0(&mut r, 1, 4128);
    let w = Q4Matrix::upload(&ctx, "w", 1, 4128, 1, &[&wb]).unwrap();
    let hb = ctx.storage("h", 4128 * 4).unwrap();
    let y = ctx.storage("y", 4).unwrap();
    let input = NormInput {
        h: &hb,
        weight: &hb,
        eps: 1e-6,
    };
    let e = k.bind_q4_norm(&ctx, &w, input, &y, &state).err().unwrap();
    assert!(e.to_string().contains("4096"), "{e}");
}
