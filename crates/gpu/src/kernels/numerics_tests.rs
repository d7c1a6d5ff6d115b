//! Lavapipe tests of every activation variant ([`Numerics`]) of the int4 kernels: the dense Q4
//! matvec (+ the quantiser that produces its input) and the MoE gate/up and down.
//!
//! Each variant is checked twice: tightly against a scalar reference fed exactly the activation
//! values the kernel reads (the quantised copy read back from the GPU, itself checked against the
//! host simulation `numerics::effective_acts`), and loosely against pure f32, with the bound of
//! that variant (f32 1e-5, precise int8 2e-4, int8 0.1 relative L2: one outlier block), printed.

use super::matvec::*;
use super::moe::*;
use crate::context::Context;
use crate::numerics::{dequant_acts, effective_acts, Act, Numerics};
use crate::state::RunState;
use crate::tensor::{Q4Matrix, QuantActs};
use crate::testing::{dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};

/// Relative L2 error of `got` against `want`.
fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let e: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).powi(2))
        .sum();
    let n: f64 = want.iter().map(|b| b * b).sum();
    (e / n).sqrt()
}

/// Bound of the relative L2 error against pure f32 per variant.
fn f32_bound(n: Numerics) -> f64 {
    match n {
        // bfp24 activations are f32 in memory; the kernels built by `new` read them as f32
        // (matvec_tests checks the bfp24 matvec forms).
        Numerics::F32 | Numerics::Bfp24 => 1e-5,
        Numerics::PreciseInt8 => 2e-4,
        Numerics::Int8 => 0.1,
    }
}

/// `y = W x` in f64 over dequantised `w [rows, cols]`, plus `Σ|W||x|` per row (the scale of
/// the f32 accumulation error).
fn matvec_ref(w: &[f32], cols: usize, x: &[f64]) -> (Vec<f64>, Vec<f64>) {
    w.chunks(cols)
        .map(|r| {
            let y = r.iter().zip(x).map(|(a, b)| *a as f64 * b).sum::<f64>();
            let s = r
                .iter()
                .zip(x)
                .map(|(a, b)| (*a as f64 * b).abs())
                .sum::<f64>();
            (y, s)
        })
        .unzip()
}

/// The activation `x` on the GPU in the form `n` (int8 forms through the GPU quantiser), and
/// the values the kernels will read, decoded from the GPU copy.
struct GpuAct {
    f: wgpu::Buffer,
    q: Option<QuantActs>,
    eff: Vec<f64>,
}

impl GpuAct {
    fn new(ctx: &Context, n: Numerics, x: &[f32], state: &wgpu::Buffer) -> GpuAct {
        let f = ctx.storage_init("x", bytemuck::cast_slice(x)).unwrap();
        let q = QuantActs::for_numerics(ctx, "xq", x.len(), n).unwrap();
        let eff = match &q {
            None => x.iter().map(|v| *v as f64).collect(),
            Some(q) => {
                let k = QuantizeKernel::new(ctx).unwrap();
                let b = k.bind(ctx, &f, q, state).unwrap();
                ctx.run_pass(|p| k.record(p, &b)).unwrap();
                let words = ctx.read_u32(&q.q, (q.q.size() / 4) as usize).unwrap();
                let s = ctx.read_f32(&q.s, (q.s.size() / 4) as usize).unwrap();
                let got = dequant_acts(q.precise, &words, &s);
                check_quantised(n, x, &got);
                got
            }
        };
        GpuAct { f, q, eff }
    }

    fn act(&self) -> Act<'_> {
        match &self.q {
            Some(q) => Act::Int8(q),
            None => Act::F32(&self.f),
        }
    }
}

/// The GPU quantisation equals the host simulation: exactly up to one rounding step of the
/// low part (precise: |err| <= 1e-4 of the block max, far below plain int8's 4e-3), or one
/// step of `d` (plain; ties may round differently).
fn check_quantised(n: Numerics, x: &[f32], got: &[f64]) {
    let want = effective_acts(n, x);
    for (b, (g, w)) in got.chunks(32).zip(want.chunks(32)).enumerate() {
        let amax = x[b * 32..b * 32 + 32]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs())) as f64;
        let tol = match n {
            Numerics::PreciseInt8 => 1e-4 * amax,
            _ => amax / 127.0 * 1.0001,
        };
        for (j, (g, w)) in g.iter().zip(w).enumerate() {
            assert!((g - w).abs() <= tol, "{n}: block {b} elt {j}: {g} vs {w}");
        }
        // Against x itself: the variant's quantisation error bound.
        let bound = match n {
            Numerics::PreciseInt8 => amax / 127.0 / 127.0,
            _ => amax / 127.0,
        };
        for (j, g) in g.iter().enumerate() {
            let v = x[b * 32 + j] as f64;
            assert!(
                (g - v).abs() <= bound,
                "{n}: block {b} elt {j}: {g} vs x {v}"
            );
        }
    }
}

fn state(ctx: &Context) -> wgpu::Buffer {
    RunState::default().buffer(ctx).unwrap()
}

#[test]
fn q4_matvec_every_numerics_matches_its_reference_and_f32() {
    let Some(ctx) = gpu("q4_matvec_every_numerics_matches_its_reference_and_f32") else {
        return;
    };
    let k = MatvecKernel::new(&ctx).unwrap();
    let st = state(&ctx);
    for (si, &(rows, cols)) in [(1, 32), (7, 64), (33, 96), (300, 256)].iter().enumerate() {
        let mut r = rng(100 + si as u64);
        let wb = rand_q4_0(&mut r, rows, cols);
        let w = dequant_q4_0(&wb, rows, cols);
        let mut x = rand_f32(&mut r, cols, -2.0, 2.0);
        x[cols / 2] = 9.0; // an outlier raises its block's scale
        let wm = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
        let xf: Vec<f64> = x.iter().map(|v| *v as f64).collect();
        let (pure, _) = matvec_ref(&w, cols, &xf);
        for n in Numerics::ALL {
            let a = GpuAct::new(&ctx, n, &x, &st);
            let y = ctx.storage("y", rows as u64 * 4).unwrap();
            let b = k.bind_q4(&ctx, &wm, a.act(), &y, &st).unwrap();
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            let got = ctx.read_f32(&y, rows).unwrap();
            let (want, scale) = matvec_ref(&w, cols, &a.eff);
            for i in 0..rows {
                let err = (got[i] as f64 - want[i]).abs();
                assert!(
                    err <= 2e-6 * scale[i] + 1e-7,
                    "{n} [{rows}, {cols}] row {i}: {} vs {} (scale {})",
                    got[i],
                    want[i],
                    scale[i]
                );
            }
            let e = rel_l2(&got, &pure);
            eprintln!("{n} [{rows}, {cols}]: rel L2 vs pure f32 {e:e}");
            assert!(e <= f32_bound(n), "{n} [{rows}, {cols}]: {e}");
        }
    }
}

/// One MoE case run with numerics `n` and `routing`; checks everything against references.
fn moe_case(ctx: &Context, p: MoeParams, n: Numerics, routing: Routing, seed: u64) {
    let mut r = rng(seed);
    let (e, k, h, i) = (
        p.experts as usize,
        p.top_k as usize,
        p.hidden as usize,
        p.inter as usize,
    );
    let logits = rand_f32(&mut r, e, -4.0, 4.0);
    let x = rand_f32(&mut r, h, -2.0, 2.0);
    let (gb, ub, db) = (
        rand_q4_0(&mut r, e * i, h),
        rand_q4_0(&mut r, e * i, h),
        rand_q4_0(&mut r, e * h, i),
    );
    let st = state(ctx);
    let kern = MoeKernel::with_numerics(ctx, p, n).unwrap();
    let a = GpuAct::new(ctx, n, &x, &st);
    let lbuf = ctx
        .storage_init("logits", bytemuck::cast_slice(&logits))
        .unwrap();
    let route = ctx.storage("route", 8 * k as u64).unwrap();
    let up = |b: &[u8], rows, cols, per| Q4Matrix::upload(ctx, "w", rows, cols, per, &[b]).unwrap();
    let (gate, upm, down) = (
        up(&gb, e * i, h, i),
        up(&ub, e * i, h, i),
        up(&db, e * h, i, h),
    );
    let hbuf = ctx.storage("h", (k * i * 4) as u64).unwrap();
    let h_q = QuantActs::for_numerics(ctx, "h_q", k * i, n).unwrap();
    let out = ctx.storage("out", h as u64 * 4).unwrap();
    let bufs = MoeBuffers {
        state: &st,
        logits: &lbuf,
        route: &route,
        x: a.act(),
        gate: &gate,
        up: &upm,
        down: &down,
        h: &hbuf,
        h_q: h_q.as_ref(),
        out: &out,
        residual: false,
    };
    let b = kern.bind(ctx, &bufs, routing).unwrap();
    ctx.run_pass(|pass| kern.record(pass, ctx, &b)).unwrap();
    let what = format!("{n} {routing:?} {p:?}");

    let (ids, w) = router_ref(&logits, k, p.norm_topk_prob);
    assert_eq!(ctx.read_u32(&route, k).unwrap(), ids, "{what}: ids");
    let expert = |bytes: &[u8], e: u32, rows: usize, cols: usize| {
        let sz = rows * cols / 32 * 18;
        dequant_q4_0(&bytes[e as usize * sz..(e as usize + 1) * sz], rows, cols)
    };
    let xe: Vec<f32> = a.eff.iter().map(|v| *v as f32).collect();
    let (mut h_want, mut h_pure) = (Vec::new(), Vec::new());
    for &id in &ids {
        let (wg, wu) = (expert(&gb, id, i, h), expert(&ub, id, i, h));
        h_want.extend(gate_up_ref(&wg, &wu, &xe));
        h_pure.extend(gate_up_ref(&wg, &wu, &x));
    }
    let h_got = ctx.read_f32(&hbuf, k * i).unwrap();
    let hmax = h_want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (j, (g, w)) in h_got.iter().zip(&h_want).enumerate() {
        assert!(
            (g - w).abs() <= 2e-5 * hmax + 1e-4 * w.abs(),
            "{what}: h[{j}] {g} vs {w}"
        );
    }
    // The down kernel's input: the GPU's quantised h (checked against the simulation) or h.
    let h_eff: Vec<f32> = match &h_q {
        None => h_got.clone(),
        Some(q) => {
            let words = ctx.read_u32(&q.q, (q.q.size() / 4) as usize).unwrap();
            let s = ctx.read_f32(&q.s, (q.s.size() / 4) as usize).unwrap();
            let got = dequant_acts(q.precise, &words, &s);
            check_quantised(n, &h_got, &got);
            got.iter().map(|v| *v as f32).collect()
        }
    };
    let wd: Vec<Vec<f32>> = ids.iter().map(|&id| expert(&db, id, h, i)).collect();
    let wd_refs: Vec<&[f32]> = wd.iter().map(|v| v.as_slice()).collect();
    let y_want = down_ref(&wd_refs, &h_eff.chunks(i).collect::<Vec<_>>(), &w, h);
    let y_pure = down_ref(&wd_refs, &h_pure.chunks(i).collect::<Vec<_>>(), &w, h);
    let y_got = ctx.read_f32(&out, h).unwrap();
    let ymax = y_want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (j, (g, w)) in y_got.iter().zip(&y_want).enumerate() {
        assert!(
            (g - w).abs() <= 2e-5 * ymax + 1e-4 * w.abs(),
            "{what}: out[{j}] {g} vs {w}"
        );
    }
    let pure: Vec<f64> = y_pure.iter().map(|v| *v as f64).collect();
    let e = rel_l2(&y_got, &pure);
    eprintln!("{what}: rel L2 vs pure f32 {e:e}");
    assert!(e <= 2.0 * f32_bound(n), "{what}: {e}");
}

#[test]
fn moe_every_numerics_matches_its_reference_and_f32() {
    let Some(ctx) = gpu("moe_every_numerics_matches_its_reference_and_f32") else {
        return;
    };
    let shapes = [
        (16, 4, 64, 64, true),
        (8, 3, 96, 32, false),
        (5, 1, 32, 96, true),
    ];
    for (si, (experts, top_k, hidden, inter, norm_topk_prob)) in shapes.into_iter().enumerate() {
        let p = MoeParams {
            experts,
            top_k,
            hidden,
            inter,
            norm_topk_prob,
        };
        for n in Numerics::ALL {
            for routing in [Routing::Fused, Routing::Separate] {
                moe_case(&ctx, p, n, routing, 300 + si as u64);
            }
        }
    }
}

#[test]
fn moe_refuses_activations_of_another_numerics() {
    let Some(ctx) = gpu("moe_refuses_activations_of_another_numerics") else {
        return;
    };
    let p = MoeParams {
        experts: 4,
        top_k: 2,
        hidden: 32,
        inter: 32,
        norm_topk_prob: true,
    };
    let mut r = rng(9);
    let wb = rand_q4_0(&mut r, 4 * 32, 32);
    let w = Q4Matrix::upload(&ctx, "w", 128, 32, 32, &[&wb]).unwrap();
    let buf = ctx.storage("buf", 4096).unwrap();
    let plain = QuantActs::for_numerics(&ctx, "x", 32, Numerics::Int8)
        .unwrap()
        .unwrap();
    let hq = QuantActs::for_numerics(&ctx, "h", 64, Numerics::Int8)
        .unwrap()
        .unwrap();
    let kern = MoeKernel::with_numerics(&ctx, p, Numerics::PreciseInt8).unwrap();
    let bufs = MoeBuffers {
        state: &buf,
        logits: &buf,
        route: &buf,
        x: Act::Int8(&plain),
        gate: &w,
        up: &w,
        down: &w,
        h: &buf,
        h_q: Some(&hq),
        out: &buf,
        residual: true,
    };
    let e = kern
        .bind(&ctx, &bufs, Routing::Fused)
        .expect_err("plain int8 accepted");
    assert!(e.to_string().contains("precise-int8"), "{e}");
    let f32_kern = MoeKernel::with_numerics(&ctx, p, Numerics::F32).unwrap();
    let bufs = MoeBuffers {
        x: Act::F32(&buf),
        ..bufs
    };
    assert!(
        f32_kern.bind(&ctx, &bufs, Routing::Fused).is_err(),
        "h_q given to f32"
    );
    let bufs = MoeBuffers { h_q: None, ..bufs };
    f32_kern.bind(&ctx, &bufs, Routing::Fused).unwrap();
}
