//! Lavapipe tests of the f32-activation MoE kernels (the staged forms, and the unstaged ones past
//! `STAGE_BUDGET`) against the scalar references in `moe.rs`, on the cases of moe_tests.rs.
//!
//! Tolerances: f32 accumulation (block dots, lane sums, team sums) against f64 references, bounded
//! by F32_TOL times the sum of |weight * activation| of each output (the scale of its rounding
//! error; a wrong block, scale or staged slot costs ~1e-2 of it). h = silu(g) * u carries the g
//! and u errors through |silu'(g)| <= 1.1 and |silu(g)|.

use super::tests::{params, Case};
use super::*;
use crate::testing::{assert_close, gpu};

pub(super) const F32_TOL: f64 = 4e-6;

struct F32Outputs {
    staged: (bool, bool),
    route: Vec<u32>,
    h: Vec<f32>,
    out: Vec<f32>,
}

/// Run one MoE block with f32 activations and the work split `tune`.
fn run_f32(
    ctx: &Context,
    c: &Case,
    tune: F32Tuning,
    routing: Routing,
    residual: bool,
    max_binding: Option<u64>,
    done: bool,
) -> F32Outputs {
    // The kernel on the full context (its slot-group scratch would not fit a test's tiny
    // binding limit), the weights split on the limited one.
    let kern_ctx = ctx;
    let ctx = match max_binding {
        Some(b) => ctx.with_max_binding_bytes(b),
        None => ctx.clone(),
    };
    let p = c.p;
    let (e, k, h, i) = (
        p.experts as usize,
        p.top_k as usize,
        p.hidden as usize,
        p.inter as usize,
    );
    let kern = MoeKernel::with_forms(kern_ctx, p, Numerics::F32, tune, (c.form, c.down_form))
        .expect("kernel");
    assert_eq!(
        kern.down_split(),
        tune.split_for(c.down_form, p.top_k),
        "{tune:?}: slot groups fell back"
    );
    let state = ctx
        .storage_init("state", bytemuck::cast_slice(&[3u32, 0, done as u32, 0]))
        .unwrap();
    let logits = ctx
        .storage_init("logits", bytemuck::cast_slice(&c.logits))
        .unwrap();
    let route = ctx.storage("route", 8 * k as u64).unwrap();
    let x = ctx.storage_init("x", bytemuck::cast_slice(&c.x)).unwrap();
    let dt = c.dtype();
    let gate = Q4Matrix::upload_dtype(&ctx, "gate", dt, e * i, h, i, &[&c.gate]).unwrap();
    let up = Q4Matrix::upload_dtype(&ctx, "up", dt, e * i, h, i, &[&c.up]).unwrap();
    let ddt = c.down_dtype();
    let down = Q4Matrix::upload_dtype(&ctx, "down", ddt, e * h, i, h, &[&c.down]).unwrap();
    if max_binding.is_some() {
        assert!(
            gate.parts.len() > 1 && down.parts.len() > 1,
            "test meant to split the weights"
        );
    }
    let hbuf = ctx.storage("h", (k * i * 4) as u64).unwrap();
    let out = ctx
        .storage_init("out", bytemuck::cast_slice(&c.residual))
        .unwrap();
    let bufs = MoeBuffers {
        state: &state,
        logits: &logits,
        route: &route,
        x: Act::F32(&x),
        gate: &gate,
        up: &up,
        down: &down,
        h: &hbuf,
        h_q: None,
        out: &out,
        residual,
    };
    let b = kern.bind(&ctx, &bufs, routing).expect("bind");
    // Twice, out reset in between: the down slot groups' counters must be back at 0 after a
    // dispatch, or the second run stores nothing.
    for _ in 0..2 {
        ctx.write(&out, 0, bytemuck::cast_slice(&c.residual));
        ctx.run_pass(|pass| kern.record(pass, &ctx, &b))
            .expect("run");
    }
    F32Outputs {
        staged: kern.f32_staged(),
        route: ctx.read_u32(&route, 2 * k).unwrap(),
        h: ctx.read_f32(&hbuf, k * i).unwrap(),
        out: ctx.read_f32(&out, h).unwrap(),
    }
}

/// `Σ_j w_j x_j` and `Σ_j |w_j x_j|` in f64.
pub(super) fn dot_and_scale(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(d, s), (a, b)| {
        let t = *a as f64 * *b as f64;
        (d + t, s + t.abs())
    })
}

/// Everything one f32 run must satisfy; returns whether (gate/up, down) were the staged kernels.
fn check_f32(
    ctx: &Context,
    c: &Case,
    tune: F32Tuning,
    routing: Routing,
    residual: bool,
    max_binding: Option<u64>,
) -> (bool, bool) {
    let p = c.p;
    let what = format!("f32 {p:?} {tune:?} {routing:?} residual {residual} split {max_binding:?}");
    let o = run_f32(ctx, c, tune, routing, residual, max_binding, false);
    let t = Token {
        logits: &c.logits,
        x: &c.x,
        residual: &c.residual,
    };
    let r = check_token(c, &t, (&o.route, &o.h, &o.out), residual, &what);
    eprintln!(
        "{what}: staged {:?}, worst error / tolerance: h {:.3}, out {:.3}",
        o.staged, r.worst_h, r.worst_out
    );
    o.staged
}

/// One token's inputs: router logits `[E]`, x `[H]`, the residual before the block `[H]`.
pub(super) struct Token<'a> {
    pub(super) logits: &'a [f32],
    pub(super) x: &'a [f32],
    pub(super) residual: &'a [f32],
}

/// What [`check_token`] found: the worst error / tolerance of h and out.
pub(super) struct Checked {
    pub(super) worst_h: f64,
    pub(super) worst_out: f64,
}

/// Check one token's kernel outputs (route `[2K]`, h `[K*I]`, out `[H]`) against the f64
/// references with the weights of `c`.
pub(super) fn check_token(
    c: &Case,
    t: &Token<'_>,
    (route, got_h, got_out): (&[u32], &[f32], &[f32]),
    residual: bool,
    what: &str,
) -> Checked {
    let p = c.p;
    let (k, h, i) = (p.top_k as usize, p.hidden as usize, p.inter as usize);
    let (ids, w) = router_ref(t.logits, k, p.norm_topk_prob);
    assert_eq!(route[..k], ids, "{what}: expert ids");
    let got_w: Vec<f32> = route[k..2 * k].iter().map(|b| f32::from_bits(*b)).collect();
    assert_close(&got_w, &w, 1e-7, 1e-5, &format!("{what}: route weights"));

    // gate/up: per row g, u and their error scales.
    let mut worst_h = 0f64;
    for (s, &e) in ids.iter().enumerate() {
        let wg = c.expert_w(&c.gate, e, p.inter, p.hidden);
        let wu = c.expert_w(&c.up, e, p.inter, p.hidden);
        for r in 0..i {
            let (g, sg) = dot_and_scale(&wg[r * h..(r + 1) * h], t.x);
            let (u, su) = dot_and_scale(&wu[r * h..(r + 1) * h], t.x);
            let silu = g / (1.0 + (-g).exp());
            let want = silu * u;
            // The rounding scale of h: 1.1 |u| Σ|wg x| + |silu(g)| Σ|wu x|.
            let tol = F32_TOL * (1.1 * u.abs() * sg + silu.abs() * su) + 1e-6 * want.abs();
            let got = got_h[s * i + r] as f64;
            let err = (got - want).abs();
            assert!(
                err <= tol,
                "{what}: h[{s}, {r}] {got} vs {want} (tol {tol:e})"
            );
            worst_h = worst_h.max(err / tol);
        }
    }

    // down + combine against the reference fed the kernel's own h.
    let base = if residual {
        t.residual.to_vec()
    } else {
        vec![0.0; h]
    };
    let wd: Vec<Vec<f32>> = ids
        .iter()
        .map(|&e| c.expert_w(&c.down, e, p.hidden, p.inter))
        .collect();
    let mut worst_y = 0f64;
    for r in 0..h {
        let (mut y, mut scale) = (base[r] as f64, 0f64);
        for (s, wd) in wd.iter().enumerate() {
            let (d, sd) = dot_and_scale(&wd[r * i..(r + 1) * i], &got_h[s * i..(s + 1) * i]);
            y += w[s] as f64 * d;
            scale += w[s].abs() as f64 * sd;
        }
        let tol = F32_TOL * scale + 1e-7 * y.abs();
        let err = (got_out[r] as f64 - y).abs();
        assert!(
            err <= tol,
            "{what}: out[{r}] {} vs {y} (tol {tol:e})",
            got_out[r]
        );
        worst_y = worst_y.max(err / tol);
    }
    Checked {
        worst_h,
        worst_out: worst_y,
    }
}

pub(super) fn tuning(gate_up_lanes: u32, down_lanes: u32, down_rows: u32) -> F32Tuning {
    F32Tuning {
        gate_up_lanes,
        down_lanes,
        down_rows,
        ..F32Tuning::DEFAULT
    }
}

/// `t` with two gate/up rows per team.
pub(super) fn rows2(t: F32Tuning) -> F32Tuning {
    F32Tuning {
        gate_up_rows: 2,
        ..t
    }
}

/// `t` with `down_split` down slot groups for a down of any form (the byte forms' too).
pub(super) fn split(t: F32Tuning, down_split: u32) -> F32Tuning {
    F32Tuning {
        down_split,
        down_split_wide: down_split,
        ..t
    }
}

#[test]
fn moe_f32_staged_odd_shapes_every_lane_count() {
    let Some(ctx) = gpu("moe_f32_staged_odd_shapes_every_lane_count") else {
        return;
    };
    // Blocks per row below, at and off multiples of the lanes: H = 96 / 160 / 288 (3, 5, 9
    // blocks), I = 32 / 96 / 160; K * I / 32 items for down from 1 to 18.
    // Down slot groups: K = 1 and 3 keep one, K = 6 two, K = 8 up to eight.
    let shapes = [
        params(5, 1, 96, 32, false),
        params(6, 6, 96, 96, true),
        params(24, 3, 160, 32, false),
        params(8, 3, 288, 160, true),
        params(12, 8, 96, 64, true),
    ];
    let all = [
        split(tuning(8, 8, 1), 1),
        split(tuning(16, 32, 2), 8),
        split(tuning(32, 64, 4), 2),
        split(tuning(64, 16, 1), 4),
        split(tuning(256, 256, 2), 8),
        split(tuning(16, 32, 4), 4),
        // Two gate/up rows per team: 32 rows per workgroup at 16 lanes (every I here), 64 at
        // 8 lanes (I = 64 only; the others fall back to one row).
        rows2(split(tuning(16, 16, 1), 4)),
        rows2(split(tuning(8, 32, 2), 2)),
    ];
    for (n, p) in shapes.into_iter().enumerate() {
        let c = Case::new(p, 60 + n as u64);
        for (j, t) in all.into_iter().enumerate() {
            let staged = check_f32(&ctx, &c, t, Routing::Fused, j % 2 == 0, None);
            assert_eq!(staged, (true, true), "{p:?} {t:?}: not the staged kernels");
            let k = MoeKernel::with_f32_tuning(&ctx, p, Numerics::F32, t).unwrap();
            let fits = p.inter % (256 / t.gate_up_lanes * t.gate_up_rows) == 0;
            let want = if fits { t.gate_up_rows } else { 1 };
            assert_eq!(k.gate_up_rows(), want, "{p:?} {t:?}: gate/up rows per team");
        }
        let staged = check_f32(&ctx, &c, F32Tuning::DEFAULT, Routing::Separate, false, None);
        assert_eq!(staged, (true, true), "{p:?}: not the staged kernels");
    }
}

#[test]
fn moe_f32_real_shape() {
    let Some(ctx) = gpu("moe_f32_real_shape") else {
        return;
    };
    // Qwen3-30B-A3B: E = 128, K = 8, H = 2048, I = 768 (h staged whole: 24 KiB).
    let c = Case::new(params(128, 8, 2048, 768, true), 70);
    for (t, routing, residual) in [
        (F32Tuning::DEFAULT, Routing::Fused, true),
        (split(tuning(8, 32, 2), 8), Routing::Separate, false),
        (split(F32Tuning::DEFAULT, 1), Routing::Fused, false),
        (rows2(F32Tuning::DEFAULT), Routing::Fused, true),
        (rows2(F32Tuning::DEFAULT), Routing::Separate, false),
    ] {
        let staged = check_f32(&ctx, &c, t, routing, residual, None);
        assert_eq!(staged, (true, true), "real shape, {t:?}: not staged");
    }
}

/// The affine (MLX) form through every staged form of the single-token path, at the real shape
/// and at an odd one, weights split across bindings too.
#[test]
fn moe_f32_affine_experts() {
    let Some(ctx) = gpu("moe_f32_affine_experts") else {
        return;
    };
    let c = Case::new_affine(params(128, 8, 2048, 768, true), 77);
    for (t, routing, residual) in [
        (F32Tuning::DEFAULT, Routing::Fused, true),
        (split(tuning(8, 32, 2), 8), Routing::Separate, false),
        (split(F32Tuning::DEFAULT, 1), Routing::Fused, false),
        (rows2(F32Tuning::DEFAULT), Routing::Fused, true),
    ] {
        let staged = check_f32(&ctx, &c, t, routing, residual, None);
        assert_eq!(staged, (true, true), "affine, {t:?}: not staged");
    }
    let odd = Case::new_affine(params(6, 3, 192, 128, false), 78);
    check_f32(&ctx, &odd, F32Tuning::DEFAULT, Routing::Fused, true, None);
    check_f32(
        &ctx,
        &odd,
        tuning(8, 16, 1),
        Routing::Separate,
        false,
        Some(64 * 1024),
    );
    // The quantised numerics read Q4_0 only: no affine kernel for them.
    assert!(MoeKernel::with_form(
        &ctx,
        odd.p,
        Numerics::Int8,
        F32Tuning::DEFAULT,
        QForm::Affine4
    )
    .is_err());
}

#[test]
fn moe_f32_ties_and_split_weights() {
    let Some(ctx) = gpu("moe_f32_ties_and_split_weights") else {
        return;
    };
    let mut c = Case::new(params(16, 4, 64, 64, true), 80);
    // Experts 3, 7, 9, 12 share the top logit: the route is [3, 7, 9, 12].
    for e in [12, 9, 7, 3] {
        c.logits[e] = 5.0;
    }
    let o = run_f32(
        &ctx,
        &c,
        F32Tuning::DEFAULT,
        Routing::Fused,
        false,
        None,
        false,
    );
    assert_eq!(o.route[..4], [3, 7, 9, 12]);
    // Parts of 3 experts each (0-2, 3-5, ..., 15): each of 3, 7, 9 and 12 in a part of its own.
    let limit = 3 * 64 * 2 * 16 + 100;
    // A kernel whose slot-group scratch would pass the binding limit keeps one group.
    let small = ctx.with_max_binding_bytes(limit);
    let k = MoeKernel::with_f32_tuning(&small, c.p, Numerics::F32, F32Tuning::DEFAULT).unwrap();
    assert_eq!(k.down_split(), 1, "scratch past the binding limit");
    for routing in [Routing::Fused, Routing::Separate] {
        for (t, residual) in [
            (F32Tuning::DEFAULT, true),
            (split(tuning(32, 16, 2), 2), false),
        ] {
            check_f32(&ctx, &c, t, routing, residual, Some(limit));
        }
    }
}

#[test]
fn moe_f32_unstaged_past_the_budget() {
    let Some(ctx) = gpu("moe_f32_unstaged_past_the_budget") else {
        return;
    };
    // Slot groups would stage a quarter of that h, but their scratch (8 KiB) does not fit a
    // 4 KiB binding: one group, so the unstaged down (not a staging past the budget).
    let small = ctx.with_max_binding_bytes(4096);
    let p = params(16, 8, 64, 1024, true);
    let k = MoeKernel::with_f32_tuning(&small, p, Numerics::F32, F32Tuning::DEFAULT).unwrap();
    assert_eq!((k.f32_staged(), k.down_split()), ((true, false), 1));
    // K * I = 8192 floats (32 KiB) of h (with one down slot group), then H = 8192 floats of
    // x: past STAGE_BUDGET, the unstaged kernels run, and still match.
    for (p, staged) in [
        (params(16, 8, 64, 1024, true), (true, false)),
        (params(4, 2, 8192, 32, false), (false, true)),
    ] {
        let c = Case::new(p, 90);
        for (routing, residual) in [(Routing::Fused, true), (Routing::Separate, false)] {
            // One down slot group: all of h staged (slot groups stage a quarter and fit).
            let one = split(F32Tuning::DEFAULT, 1);
            let got = check_f32(&ctx, &c, one, routing, residual, None);
            assert_eq!(got, staged, "{p:?}");
        }
    }
}

#[test]
fn moe_f32_done_flag_and_bad_lanes() {
    let Some(ctx) = gpu("moe_f32_done_flag_and_bad_lanes") else {
        return;
    };
    let c = Case::new(params(16, 4, 64, 64, true), 100);
    for routing in [Routing::Fused, Routing::Separate] {
        let o = run_f32(&ctx, &c, F32Tuning::DEFAULT, routing, true, None, true);
        assert_eq!(o.out, c.residual, "residual changed although done");
        assert!(
            o.route.iter().all(|v| *v == 0),
            "route written although done"
        );
        assert!(o.h.iter().all(|v| *v == 0.0), "h written although done");
    }
    // The quantised numerics keep the unstaged kernels.
    for n in [Numerics::Int8, Numerics::PreciseInt8] {
        let k = MoeKernel::with_numerics(&ctx, c.p, n).unwrap();
        assert_eq!(k.f32_staged(), (false, false), "{n}");
    }
    // The shapes' default lanes: 8 per row of under 16 blocks (the small models), the
    // measured defaults at the real shape (H 2048 = 64 blocks, I 768 = 24).
    let t = F32Tuning::for_context(&ctx);
    let lanes = |h, i| {
        let s = F32Tuning::for_shapes(&ctx, &params(128, 8, h, i, true));
        assert_eq!(
            s,
            F32Tuning {
                gate_up_lanes: s.gate_up_lanes,
                down_lanes: s.down_lanes,
                ..t
            }
        );
        (s.gate_up_lanes, s.down_lanes)
    };
    assert_eq!(lanes(2048, 768), (t.gate_up_lanes, t.down_lanes));
    assert_eq!(lanes(256, 256), (8, 8));
    assert_eq!(lanes(512, 480), (16, 8));
    assert_eq!(lanes(480, 512), (8, 16));
    for bad in [
        tuning(4, 32, 1),
        tuning(16, 512, 1),
        tuning(12, 32, 1),
        tuning(16, 0, 1),
        tuning(16, 32, 3),
        tuning(16, 32, 0),
        split(F32Tuning::DEFAULT, 3),
        split(F32Tuning::DEFAULT, 0),
        split(F32Tuning::DEFAULT, 16),
    ] {
        let e = MoeKernel::with_f32_tuning(&ctx, c.p, Numerics::F32, bad)
            .expect_err("bad tuning accepted");
        assert!(e.to_string().contains("rows per team"), "{bad:?}: {e}");
    }
}

/// The byte form (Q8_0) through every staged form of the single-token path, at the real shape
/// and at an odd one, weights split across bindings too; the quantised numerics refuse it.
/// MLX's 8-bit groups, Q6_K and Q4_K at the real shape.
#[test]
fn moe_f32_q8_experts() {
    let Some(ctx) = gpu("moe_f32_q8_experts") else {
        return;
    };
    let c = Case::new_q8(params(128, 8, 2048, 768, true), 79);
    for (t, routing, residual) in [
        (F32Tuning::DEFAULT, Routing::Fused, true),
        (split(tuning(8, 32, 2), 8), Routing::Separate, false),
        (rows2(F32Tuning::DEFAULT), Routing::Fused, true),
    ] {
        let staged = check_f32(&ctx, &c, t, routing, residual, None);
        assert_eq!(staged, (true, true), "Q8_0, {t:?}: not staged");
    }
    // MLX's 8-bit groups at the real shape.
    let a8 = Case::new_a8(params(128, 8, 2048, 768, true), 81);
    let staged = check_f32(&ctx, &a8, F32Tuning::DEFAULT, Routing::Fused, true, None);
    assert_eq!(staged, (true, true), "MLX_A8: not staged");
    // Q6_K at the real shape, whole and split across bindings.
    let q6 = Case::new_form(params(128, 8, 2048, 768, true), 82, QForm::Q6K, 0x6C);
    let staged = check_f32(&ctx, &q6, F32Tuning::DEFAULT, Routing::Fused, true, None);
    assert_eq!(staged, (true, true), "Q6_K: not staged");
    check_f32(
        &ctx,
        &q6,
        split(tuning(8, 32, 2), 8),
        Routing::Separate,
        false,
        Some(8 << 20),
    );
    // Q4_K at the real shape.
    let q4k = Case::new_form(params(128, 8, 2048, 768, true), 83, QForm::Q4K, 0x4C);
    let staged = check_f32(&ctx, &q4k, F32Tuning::DEFAULT, Routing::Fused, true, None);
    assert_eq!(staged, (true, true), "Q4_K: not staged");
    check_f32(
        &ctx,
        &q4k,
        split(tuning(8, 32, 2), 8),
        Routing::Separate,
        false,
        Some(4 << 20),
    );
    // Q5_K at the real shape.
    let q5k = Case::new_form(params(128, 8, 2048, 768, true), 85, QForm::Q5K, 0x5C);
    let staged = check_f32(&ctx, &q5k, F32Tuning::DEFAULT, Routing::Fused, true, None);
    assert_eq!(staged, (true, true), "Q5_K: not staged");
    // A `Q4_K_M` layer at the real shape: gate and up Q4_K, down Q6_K, whole and split.
    let km = Case::new_forms(
        params(128, 8, 2048, 768, true),
        84,
        (QForm::Q4K, QForm::Q6K),
        0x4D,
    );
    let staged = check_f32(&ctx, &km, F32Tuning::DEFAULT, Routing::Fused, true, None);
    assert_eq!(staged, (true, true), "Q4_K + Q6_K: not staged");
    check_f32(
        &ctx,
        &km,
        split(tuning(8, 32, 2), 8),
        Routing::Separate,
        false,
        Some(8 << 20),
    );
    // A kernel for one pair refuses a layer of another by name.
    let one =
        MoeKernel::with_form(&ctx, km.p, Numerics::F32, F32Tuning::DEFAULT, QForm::Q4K).unwrap();
    let (e, h, i) = (
        km.p.experts as usize,
        km.p.hidden as usize,
        km.p.inter as usize,
    );
    let up = |dt, b: &[u8], rows, cols, per| {
        Q4Matrix::upload_dtype(&ctx, "w", dt, rows, cols, per, &[b]).unwrap()
    };
    let (g, u) = (
        up(km.dtype(), &km.gate, e * i, h, i),
        up(km.dtype(), &km.up, e * i, h, i),
    );
    let d = up(km.down_dtype(), &km.down, e * h, i, h);
    let buf = |n: usize| ctx.storage("b", n as u64 * 4).unwrap();
    let (state, logits, route, x, hb, out) = (buf(4), buf(e), buf(16), buf(h), buf(8 * i), buf(h));
    let bufs = MoeBuffers {
        state: &state,
        logits: &logits,
        route: &route,
        x: Act::F32(&x),
        gate: &g,
        up: &u,
        down: &d,
        h: &hb,
        h_q: None,
        out: &out,
        residual: true,
    };
    let err = one
        .bind(&ctx, &bufs, Routing::Fused)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("MoE down") && err.contains("Q6_K"), "{err}");
    let set = MoeSet::new(
        &ctx,
        km.p,
        Numerics::F32,
        F32Tuning::DEFAULT,
        &[
            (QForm::Q4K, QForm::Q4K),
            (QForm::Q4K, QForm::Q6K),
            (QForm::Q4K, QForm::Q4K),
        ],
    )
    .unwrap();
    assert_eq!(set.len(), 2, "one kernel per distinct pair");
    // The byte form's down takes its own slot groups (8 by default), the nibble form's 4.
    assert_eq!(set.down_splits(), "Q4_K 4, Q6_K 8");
    let four = F32Tuning {
        down_split_wide: 4,
        ..F32Tuning::DEFAULT
    };
    let set4 = MoeSet::new(
        &ctx,
        km.p,
        Numerics::F32,
        four,
        &[(QForm::Q4K, QForm::Q4K), (QForm::Q4K, QForm::Q6K)],
    );
    assert_eq!(set4.unwrap().down_splits(), "4");
    assert!(set.bind(&ctx, &bufs, Routing::Fused).is_ok());
    let odd = Case::new_q8(params(6, 3, 192, 128, false), 80);
    check_f32(&ctx, &odd, F32Tuning::DEFAULT, Routing::Fused, true, None);
    check_f32(
        &ctx,
        &odd,
        tuning(8, 16, 1),
        Routing::Separate,
        false,
        Some(96 * 1024),
    );
    assert!(
        MoeKernel::with_form(&ctx, odd.p, Numerics::Int8, F32Tuning::DEFAULT, QForm::Q8_0).is_err()
    );
}

/// `gate_up_folded_warm`'s loads per thread cover every sector of one expert's down blocks and
/// scales in each block form (bytes take a sector per block, nibbles half of one; Q4_K's scale
/// words twice the others').
#[test]
fn down_warm_covers_every_sector_of_each_form() {
    let p = params(128, 8, 2048, 768, true);
    for form in QForm::ALL {
        let blocks = (p.hidden * p.inter / 32) as u64;
        let scales = blocks.div_ceil(2) * form.scale_word_bytes();
        let sectors = (blocks * form.block_bytes()).div_ceil(32) + scales.div_ceil(32);
        for nx in [1u32, 4, 16] {
            let loads = down_warm_loads(&p, nx, form) as u64;
            assert!(loads * WG as u64 * nx as u64 >= sectors, "{form:?} nx {nx}");
            // And not much more: one load round past the sectors at most.
            assert!(
                ((loads - 1) * WG as u64 * nx as u64) < sectors,
                "{form:?} nx {nx}"
            );
        }
    }
}
