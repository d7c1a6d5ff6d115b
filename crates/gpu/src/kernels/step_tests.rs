//! Lavapipe tests of rmsnorm, embedding lookup and argmax against their scalar references.

use super::argmax::*;
use super::embed::*;
use super::norm::*;
use crate::numerics::quantize_precise_ref;
use crate::state::RunState;
use crate::tensor::{quantize_acts_ref, Q4Matrix, QuantActs};
use crate::testing::{assert_close, dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};

#[test]
fn rmsnorm_variants_match_reference() {
    let Some(ctx) = gpu("rmsnorm_variants_match_reference") else {
        return;
    };
    let mut r = rng(10);
    let k = RmsNormKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for n in [32usize, 64, 96, 2048, 4000] {
        for (add, quant) in [(false, false), (true, false), (false, true), (true, true)] {
            // n = 4000 is not a multiple of 32: only the unquantised variants apply.
            if quant && n % 32 != 0 {
                continue;
            }
            let h0 = rand_f32(&mut r, n, -2.0, 2.0);
            let res = rand_f32(&mut r, n, -1.0, 1.0);
            let w = rand_f32(&mut r, n, 0.5, 1.5);
            let eps = 1e-6;
            let hb = ctx.storage_init("h", bytemuck::cast_slice(&h0)).unwrap();
            let rb = ctx.storage_init("r", bytemuck::cast_slice(&res)).unwrap();
            let wb = ctx.storage_init("w", bytemuck::cast_slice(&w)).unwrap();
            let out = ctx.storage("y", n as u64 * 4).unwrap();
            let qa = if n % 32 == 0 {
                Some(QuantActs::new(&ctx, "yq", n).unwrap())
            } else {
                None
            };
            let args = RmsNormArgs {
                h: &hb,
                add: add.then_some(&rb),
                weight: &wb,
                out: &out,
                quant: if quant { qa.as_ref() } else { None },
                n: n as u32,
                eps,
            };
            let b = k.bind(&ctx, &args, &state).unwrap();
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            let (want_h, want_y) = rmsnorm_ref(&h0, add.then_some(&res[..]), &w, eps);
            let what = format!("n={n} add={add} quant={quant}");
            assert_close(&ctx.read_f32(&hb, n).unwrap(), &want_h, 0.0, 0.0, &what);
            let y = ctx.read_f32(&out, n).unwrap();
            assert_close(&y, &want_y, 1e-5, 1e-5, &what);
            if quant {
                let qa = qa.as_ref().unwrap();
                let words = ctx.read_u32(&qa.q, n / 4).unwrap();
                let got: Vec<i8> = words
                    .iter()
                    .flat_map(|w| w.to_le_bytes().map(|b| b as i8))
                    .collect();
                // Quantising the GPU's own y must agree to one step (rounding at exact halves).
                let (want_q, want_s) = quantize_acts_ref(&y);
                assert!(
                    got.iter()
                        .zip(&want_q)
                        .all(|(g, w)| (*g as i32 - *w as i32).abs() <= 1),
                    "{what}"
                );
                let s: Vec<[f32; 2]> =
                    bytemuck::pod_collect_to_vec(&ctx.read(&qa.s, 0, n as u64 / 4).unwrap());
                for (g, w) in s.iter().zip(&want_s) {
                    assert!(
                        (g[0] - w[0]).abs() <= 1e-6 * w[0],
                        "{what}: d {g:?} vs {w:?}"
                    );
                }
            }
        }
    }
}

/// Precise int8 output of the fused kernel (four threads per block): the GPU's hi/lo parts and
/// scales equal the host simulation of quantising the GPU's own y (lo may differ by one step at
/// an exact rounding tie), with outlier blocks and an all-zero block.
#[test]
fn rmsnorm_precise_quantisation_matches_simulation() {
    let Some(ctx) = gpu("rmsnorm_precise_quantisation_matches_simulation") else {
        return;
    };
    let mut r = rng(11);
    let k = RmsNormKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for n in [32usize, 96, 2048, 2080, 4096 + 32] {
        for add in [false, true] {
            let mut h0 = rand_f32(&mut r, n, -2.0, 2.0);
            h0[n / 3] = 60.0; // an outlier block
            let res = rand_f32(&mut r, n, -1.0, 1.0);
            let mut w = rand_f32(&mut r, n, 0.5, 1.5);
            if n >= 64 {
                w[32..64].iter_mut().for_each(|v| *v = 0.0); // a zero block: d = 0
            }
            let hb = ctx.storage_init("h", bytemuck::cast_slice(&h0)).unwrap();
            let rb = ctx.storage_init("r", bytemuck::cast_slice(&res)).unwrap();
            let wb = ctx.storage_init("w", bytemuck::cast_slice(&w)).unwrap();
            let out = ctx.storage("y", n as u64 * 4).unwrap();
            let qa = QuantActs::with_layout(&ctx, "yq", n, true).unwrap();
            let args = RmsNormArgs {
                h: &hb,
                add: add.then_some(&rb),
                weight: &wb,
                out: &out,
                quant: Some(&qa),
                n: n as u32,
                eps: 1e-6,
            };
            let b = k.bind(&ctx, &args, &state).unwrap();
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            let what = format!("precise n={n} add={add}");
            let (want_h, want_y) = rmsnorm_ref(&h0, add.then_some(&res[..]), &w, 1e-6);
            assert_close(&ctx.read_f32(&hb, n).unwrap(), &want_h, 0.0, 0.0, &what);
            let y = ctx.read_f32(&out, n).unwrap();
            assert_close(&y, &want_y, 1e-5, 1e-5, &what);
            let q = ctx.read_u32(&qa.q, n / 2).unwrap();
            let s = ctx.read_f32(&qa.s, n / 8).unwrap();
            let byte = |w: u32, j: usize| (w >> (8 * (j % 4))) as u8 as i8;
            // The simulation divides exactly; WGSL's division is only within 2.5 ulp (the H200
            // gave d1 one ulp off), and the residuals `y - hi * d1` may or may not be fused by
            // the driver (Vulkan allows either, even for an explicit `fma`). So the scales are
            // checked to within those roundings, the bytes to within one step at a rounding
            // boundary, and the property the form exists for exactly: every element is
            // `hi d1 + lo d2` to within half a d2 step.
            for (bi, (hi, lo, d1, d2)) in quantize_precise_ref(&y).into_iter().enumerate() {
                let (ghi, glo) = (&q[bi * 16..bi * 16 + 8], &q[bi * 16 + 8..bi * 16 + 16]);
                let sb = &s[bi * 4..bi * 4 + 4];
                // d1 = amax / 127: the division's few ulps.
                let tol1 = 4.0 * f32::EPSILON * d1.abs();
                assert!(
                    (sb[0] - d1).abs() <= tol1,
                    "{what}: block {bi} d1 {} vs {d1}",
                    sb[0]
                );
                // Rounding hi * d1 (or d1 itself) moves a residual by a few 2^-24 amax, i.e.
                // 2^-24 x 254 of the largest residual (about d1 / 2): d2 within 1024 ulps.
                let tol2 = 1024.0 * f32::EPSILON * d2.abs();
                assert!(
                    (sb[2] - d2).abs() <= tol2,
                    "{what}: block {bi} d2 {} vs {d2}",
                    sb[2]
                );
                for j in 0..32 {
                    let (gh, gl) = (byte(ghi[j / 4], j), byte(glo[j / 4], j));
                    assert!(
                        (gh as i32 - hi[j] as i32).abs() <= 1,
                        "{what}: block {bi} hi[{j}]"
                    );
                    assert!(
                        (gl as i32 - lo[j] as i32).abs() <= 1,
                        "{what}: block {bi} lo[{j}]"
                    );
                    let v = y[bi * 32 + j] as f64;
                    let back = gh as f64 * sb[0] as f64 + gl as f64 * sb[2] as f64;
                    assert!(
                        (v - back).abs() <= 0.501 * sb[2] as f64 + 1e-6 * v.abs(),
                        "{what}: block {bi} element {j}: {v} rebuilt as {back}"
                    );
                }
                let sum = |ws: &[u32]| (0..32).map(|j| byte(ws[j / 4], j) as i32).sum::<i32>();
                assert_eq!(sb[1], sum(ghi) as f32, "{what}: block {bi} sum hi");
                assert_eq!(sb[3], sum(glo) as f32, "{what}: block {bi} sum lo");
                if n >= 64 && bi == 1 {
                    assert_eq!((sb[0], sb[1], sb[2]), (0.0, 0.0, 0.0), "{what}: zero block");
                }
            }
        }
    }
}

#[test]
fn rmsnorm_rejects_bad_shapes() {
    let Some(ctx) = gpu("rmsnorm_rejects_bad_shapes") else {
        return;
    };
    let k = RmsNormKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let b64 = ctx.storage("b", 256).unwrap();
    let b32 = ctx.storage("s", 128).unwrap();
    let q = QuantActs::new(&ctx, "q", 32).unwrap();
    let base = RmsNormArgs {
        h: &b64,
        add: None,
        weight: &b64,
        out: &b64,
        quant: None,
        n: 64,
        eps: 1e-6,
    };
    assert!(k.bind(&ctx, &base, &state).is_ok());
    assert!(k
        .bind(&ctx, &RmsNormArgs { out: &b32, ..base }, &state)
        .is_err());
    assert!(k
        .bind(
            &ctx,
            &RmsNormArgs {
                quant: Some(&q),
                ..base
            },
            &state
        )
        .is_err());
    assert!(k
        .bind(
            &ctx,
            &RmsNormArgs {
                eps: f32::NAN,
                ..base
            },
            &state
        )
        .is_err());
}

#[test]
fn embedding_reads_token_from_state_across_parts() {
    let Some(ctx) = gpu("embedding_reads_token_from_state_across_parts") else {
        return;
    };
    let mut r = rng(11);
    let k = EmbedKernel::new(&ctx).unwrap();
    for (vocab, hidden, limit) in [
        (50usize, 32usize, None),
        (1000, 96, None),
        (301, 2048, Some(7 * 64 * 16)),
    ] {
        let c = match limit {
            Some(l) => ctx.with_max_binding_bytes(l),
            None => (*ctx).clone(),
        };
        let table = rand_q4_0(&mut r, vocab, hidden);
        let m = Q4Matrix::upload(&c, "embd", vocab, hidden, 1, &[&table]).unwrap();
        if limit.is_some() {
            assert_eq!(m.parts.len(), 301usize.div_ceil(7));
        }
        let full = dequant_q4_0(&table, vocab, hidden);
        let h = ctx.storage("h", hidden as u64 * 4).unwrap();
        for token in [0, vocab as u32 / 3, vocab as u32 - 1] {
            let state = RunState {
                token,
                pos: 5,
                ..Default::default()
            }
            .buffer(&c)
            .unwrap();
            c.write(&h, 0, &vec![0xFF; hidden * 4]);
            let b = k.bind(&c, &m, &h, &state).unwrap();
            c.run_pass(|p| k.record(p, &b)).unwrap();
            let want = &full[token as usize * hidden..(token as usize + 1) * hidden];
            assert_close(
                &c.read_f32(&h, hidden).unwrap(),
                want,
                0.0,
                0.0,
                &format!("V={vocab} token {token}"),
            );
        }
        // An out-of-range id writes nothing (and reads nothing out of bounds).
        let state = RunState {
            token: vocab as u32,
            ..Default::default()
        }
        .buffer(&c)
        .unwrap();
        c.write(&h, 0, bytemuck::cast_slice(&vec![3.25f32; hidden]));
        let b = k.bind(&c, &m, &h, &state).unwrap();
        c.run_pass(|p| k.record(p, &b)).unwrap();
        assert_eq!(c.read_f32(&h, hidden).unwrap(), vec![3.25f32; hidden]);
    }
}

/// Run one argmax on `logits` from `state0`; returns (new state, out_tokens).
fn run_argmax(
    ctx: &crate::Context,
    logits: &[f32],
    state0: RunState,
    max_steps: u32,
    eos: &[u32],
) -> (RunState, Vec<u32>) {
    let k = ArgmaxKernel::new(ctx).unwrap();
    let lb = ctx
        .storage_init("logits", bytemuck::cast_slice(logits))
        .unwrap();
    let state = state0.buffer(ctx).unwrap();
    let out = ctx
        .storage_init(
            "out",
            bytemuck::cast_slice(&vec![u32::MAX; max_steps as usize]),
        )
        .unwrap();
    let args = ArgmaxArgs {
        logits: &lb,
        n: logits.len() as u32,
        state: &state,
        out_tokens: &out,
        max_steps,
        eos,
    };
    let b = k.bind(ctx, &args).unwrap();
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    (
        RunState::read(ctx, &state).unwrap(),
        ctx.read_u32(&out, max_steps as usize).unwrap(),
    )
}

#[test]
fn argmax_matches_reference_with_ties_and_nan() {
    let Some(ctx) = gpu("argmax_matches_reference_with_ties_and_nan") else {
        return;
    };
    let mut r = rng(12);
    let s0 = RunState {
        pos: 10,
        token: 1,
        done: 0,
        step: 2,
    };
    for n in [1usize, 7, 2048, 2049, 5000, 151_936] {
        let mut x = rand_f32(&mut r, n, -30.0, 30.0);
        let want_plain = argmax_ref(&x);
        let (s, out) = run_argmax(&ctx, &x, s0, 8, &[]);
        assert_eq!(s.token, want_plain, "n={n}");
        assert_eq!(out[2], want_plain, "n={n}: out_tokens[step]");
        assert_eq!(out[0], u32::MAX, "other slots untouched");
        assert_eq!((s.pos, s.step, s.done), (11, 3, 0), "n={n}");
        if n < 7 {
            continue;
        }
        // Ties: the same maximum at several indices (in different workgroups) -> the lowest.
        let top = 100.0;
        let idx = [n - 1, n / 2, n / 3 + 1];
        for i in idx {
            x[i] = top;
        }
        // NaN must never win, wherever it sits.
        x[0] = f32::NAN;
        x[n / 5] = f32::NAN;
        let (s, _) = run_argmax(&ctx, &x, s0, 8, &[]);
        assert_eq!(s.token, argmax_ref(&x), "n={n} ties");
        assert_eq!(s.token as usize, *idx.iter().min().unwrap(), "n={n} ties");
    }
    // Degenerate rows, as nibble_backend::argmax decides them.
    for (x, want) in [
        (vec![f32::NAN; 3], 0),
        (vec![f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY], 1),
        (vec![-0.0, 0.0], 0),
        (vec![-5.0, f32::INFINITY, f32::INFINITY], 1),
    ] {
        assert_eq!(argmax_ref(&x), want, "{x:?}");
        assert_eq!(run_argmax(&ctx, &x, s0, 8, &[]).0.token, want, "{x:?}");
    }
}

#[test]
fn argmax_sets_done_on_eos_and_last_step() {
    let Some(ctx) = gpu("argmax_sets_done_on_eos_and_last_step") else {
        return;
    };
    let mut r = rng(13);
    let mut x = rand_f32(&mut r, 3000, -1.0, 1.0);
    x[1234] = 9.0;
    let s0 = RunState {
        pos: 0,
        token: 5,
        done: 0,
        step: 0,
    };
    assert_eq!(run_argmax(&ctx, &x, s0, 4, &[7, 1234]).0.done, 1, "EOS");
    assert_eq!(run_argmax(&ctx, &x, s0, 4, &[7]).0.done, 0, "not EOS");
    let s3 = RunState { step: 3, ..s0 };
    let (s, out) = run_argmax(&ctx, &x, s3, 4, &[7]);
    assert_eq!(
        (s.done, s.step, out[3]),
        (1, 4, 1234),
        "last step of the run"
    );
    // Once done, the kernel changes nothing.
    let sd = RunState { done: 1, ..s0 };
    let (s, out) = run_argmax(&ctx, &x, sd, 4, &[]);
    assert_eq!(s, sd);
    assert_eq!(out, vec![u32::MAX; 4]);
}
