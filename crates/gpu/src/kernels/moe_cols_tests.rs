//! Lavapipe tests of the MoE block over columns (moe_cols.rs): every active column's route, h
//! and out must be bit-identical to the single-column kernel run on that column alone, and
//! close to the f64 references of moe_f32_tests.rs; a done column's route, h (NaN-filled before
//! the run) and out (its residual) must come back untouched. The union gate/up is also checked
//! bit for bit against the per-column form, with columns forced to share experts (at the same
//! or different ranks), to choose disjoint ones, and with done columns between live ones.

use super::super::f32_tests::{check_token, rows2, split, tuning, Token};
use super::super::tests::{params, Case};
use super::super::{F32Tuning, MoeBuffers, MoeParams, Routing};
use super::*;
use crate::columns::{self, Col};
use crate::numerics::{Act, Numerics};
use crate::testing::{gpu, rand_f32, rng};

/// Bits written into route and h before a run: a NaN as f32, an impossible expert id as u32.
const FILL: u32 = 0x7fc0_dead;

/// One column's inputs: router logits `[E]`, x `[H]`, residual `[H]`, and whether it is done.
struct ColIn {
    logits: Vec<f32>,
    x: Vec<f32>,
    residual: Vec<f32>,
    done: bool,
}

impl ColIn {
    fn token(&self) -> Token<'_> {
        Token {
            logits: &self.logits,
            x: &self.x,
            residual: &self.residual,
        }
    }
}

/// `nb` columns of random inputs; the columns listed in `done` are done.
fn columns_of(p: &MoeParams, nb: usize, seed: u64, done: &[usize]) -> Vec<ColIn> {
    let mut r = rng(seed);
    (0..nb)
        .map(|c| ColIn {
            logits: rand_f32(&mut r, p.experts as usize, -4.0, 4.0),
            x: rand_f32(&mut r, p.hidden as usize, -2.0, 2.0),
            residual: rand_f32(&mut r, p.hidden as usize, -1.0, 1.0),
            done: done.contains(&c),
        })
        .collect()
}

/// The stacked expert weights of a case on the GPU.
struct Weights {
    gate: Q4Matrix,
    up: Q4Matrix,
    down: Q4Matrix,
}

fn upload(ctx: &Context, c: &Case) -> Weights {
    let p = c.p;
    let (e, h, i) = (p.experts as usize, p.hidden as usize, p.inter as usize);
    Weights {
        gate: Q4Matrix::upload(ctx, "gate", e * i, h, i, &[&c.gate]).unwrap(),
        up: Q4Matrix::upload(ctx, "up", e * i, h, i, &[&c.up]).unwrap(),
        down: Q4Matrix::upload(ctx, "down", e * h, i, h, &[&c.down]).unwrap(),
    }
}

/// Route `[nb, 2K]`, h `[nb, K*I]`, out `[nb, H]` of one run.
struct Outs {
    route: Vec<u32>,
    h: Vec<f32>,
    out: Vec<f32>,
}

/// The MoE block over `cols` in one pass; route and h start as [`FILL`], out as the residuals
/// (also when `residual` is off, so a done column's out shows it was left alone).
fn run_cols(ctx: &Context, kern: &MoeKernel, w: &Weights, cols: &[ColIn], residual: bool) -> Outs {
    run_cols_with(ctx, kern, w, cols, residual, None)
}

/// As [`run_cols`] with the form chosen (`None`: [`MoeKernel::bind_cols`]'s).
fn run_cols_with(
    ctx: &Context,
    kern: &MoeKernel,
    w: &Weights,
    cols: &[ColIn],
    residual: bool,
    form: Option<ColsForm>,
) -> Outs {
    let p = kern.params;
    let nb = cols.len();
    let (k, h, i) = (p.top_k as usize, p.hidden as usize, p.inter as usize);
    let cat = |f: &dyn Fn(&ColIn) -> &[f32]| -> Vec<f32> {
        cols.iter().flat_map(|c| f(c).iter().copied()).collect()
    };
    let logits = ctx
        .storage_init("logits", bytemuck::cast_slice(&cat(&|c| &c.logits)))
        .unwrap();
    let x = ctx
        .storage_init("x", bytemuck::cast_slice(&cat(&|c| &c.x)))
        .unwrap();
    let out = ctx
        .storage_init("out", bytemuck::cast_slice(&cat(&|c| &c.residual)))
        .unwrap();
    let route = ctx
        .storage_init("route", bytemuck::cast_slice(&vec![FILL; nb * 2 * k]))
        .unwrap();
    let hbuf = ctx
        .storage_init("h", bytemuck::cast_slice(&vec![FILL; nb * k * i]))
        .unwrap();
    let state = ctx
        .storage_init("state", bytemuck::cast_slice(&[3u32, 0, 0, 0]))
        .unwrap();
    let col_state: Vec<Col> = cols
        .iter()
        .enumerate()
        .map(|(n, c)| Col {
            done: c.done as u32,
            ..Col::active(n as u32 + 1, 3 + n as u32, n as u32)
        })
        .collect();
    let col_buf = columns::buffer(ctx, &col_state).unwrap();
    let bufs = MoeColsBuffers {
        state: &state,
        cols: &col_buf,
        nb: nb as u32,
        logits: &logits,
        route: &route,
        x: &x,
        gate: &w.gate,
        up: &w.up,
        down: &w.down,
        h: &hbuf,
        out: &out,
        residual,
    };
    let b = match form {
        Some(f) => kern.bind_cols_with(ctx, &bufs, f),
        None => kern.bind_cols(ctx, &bufs),
    }
    .expect("bind_cols");
    assert_eq!(
        b.dispatch_count(),
        w.gate.parts.len() + w.down.parts.len(),
        "one dispatch per weight part and stage"
    );
    // Twice, out reset in between: the down slot groups' counters must be back at 0.
    let residuals = cat(&|c| &c.residual);
    for _ in 0..2 {
        ctx.write(&out, 0, bytemuck::cast_slice(&residuals));
        ctx.run_pass(|pass| kern.record_cols(pass, ctx, &b))
            .expect("run");
    }
    Outs {
        route: ctx.read_u32(&route, nb * 2 * k).unwrap(),
        h: ctx.read_f32(&hbuf, nb * k * i).unwrap(),
        out: ctx.read_f32(&out, nb * h).unwrap(),
    }
}

/// The single-column kernel (fused routing) on one column's inputs.
fn run_single(ctx: &Context, kern: &MoeKernel, w: &Weights, col: &ColIn, residual: bool) -> Outs {
    let p = kern.params;
    let (k, h, i) = (p.top_k as usize, p.hidden as usize, p.inter as usize);
    let state = ctx
        .storage_init("state", bytemuck::cast_slice(&[3u32, 0, 0, 0]))
        .unwrap();
    let logits = ctx
        .storage_init("logits", bytemuck::cast_slice(&col.logits))
        .unwrap();
    let x = ctx.storage_init("x", bytemuck::cast_slice(&col.x)).unwrap();
    let out = ctx
        .storage_init("out", bytemuck::cast_slice(&col.residual))
        .unwrap();
    let route = ctx.storage("route", 8 * k as u64).unwrap();
    let hbuf = ctx.storage("h", (k * i * 4) as u64).unwrap();
    let bufs = MoeBuffers {
        state: &state,
        logits: &logits,
        route: &route,
        x: Act::F32(&x),
        gate: &w.gate,
        up: &w.up,
        down: &w.down,
        h: &hbuf,
        h_q: None,
        out: &out,
        residual,
    };
    let b = kern.bind(ctx, &bufs, Routing::Fused).expect("bind");
    ctx.run_pass(|pass| kern.record(pass, ctx, &b))
        .expect("run");
    Outs {
        route: ctx.read_u32(&route, 2 * k).unwrap(),
        h: ctx.read_f32(&hbuf, k * i).unwrap(),
        out: ctx.read_f32(&out, h).unwrap(),
    }
}

/// Run `cols` through the column kernels and check every column: active ones against the f64
/// references and (bit for bit) the single-column kernel, done ones untouched.
fn check_cols(
    ctx: &Context,
    c: &Case,
    kern: &MoeKernel,
    w: &Weights,
    cols: &[ColIn],
    residual: bool,
    what: &str,
) {
    let p = c.p;
    let (k, h, i) = (p.top_k as usize, p.hidden as usize, p.inter as usize);
    let o = run_cols(ctx, kern, w, cols, residual);
    let (mut worst_h, mut worst_out) = (0f64, 0f64);
    for (n, col) in cols.iter().enumerate() {
        let what = format!("{what} column {n}/{}", cols.len());
        let route = &o.route[n * 2 * k..(n + 1) * 2 * k];
        let hc = &o.h[n * k * i..(n + 1) * k * i];
        let out = &o.out[n * h..(n + 1) * h];
        if col.done {
            assert!(
                route.iter().all(|v| *v == FILL),
                "{what}: done, route written"
            );
            assert!(
                hc.iter().all(|v| v.to_bits() == FILL),
                "{what}: done, h written"
            );
            assert_eq!(out, &col.residual[..], "{what}: done, out changed");
            continue;
        }
        let r = check_token(c, &col.token(), (route, hc, out), residual, &what);
        worst_h = worst_h.max(r.worst_h);
        worst_out = worst_out.max(r.worst_out);
        let s = run_single(ctx, kern, w, col, residual);
        assert_eq!(route, &s.route[..], "{what}: route vs single column");
        assert_same(hc, &s.h, &format!("{what}: h vs single column"));
        assert_same(out, &s.out, &format!("{what}: out vs single column"));
    }
    eprintln!("{what}: worst error / tolerance vs f64: h {worst_h:.3}, out {worst_out:.3}");
}

/// `a` and `b` hold the same f32 bits.
fn assert_same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (j, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{j}]: {x} vs {y}");
    }
}

#[test]
fn moe_cols_match_single_column_odd_shapes() {
    let Some(ctx) = gpu("moe_cols_match_single_column_odd_shapes") else {
        return;
    };
    // Blocks per row off the lane counts (H = 96 / 160 / 288, I = 32 / 96 / 160), K = 1..8
    // (down slot groups: 1 for K = 1 and 3, 2 for K = 6, up to 8 for K = 8).
    let shapes = [
        params(5, 1, 96, 32, false),
        params(6, 6, 96, 96, true),
        params(24, 3, 160, 32, false),
        params(8, 3, 288, 160, true),
        params(12, 8, 96, 64, true),
    ];
    let tunes = [
        F32Tuning::DEFAULT,
        split(tuning(8, 64, 4), 8),
        split(tuning(32, 16, 2), 1),
        rows2(F32Tuning::DEFAULT),
    ];
    // (nb, done columns): one column, two, three with the middle one done, eight with two done.
    let runs: [(usize, &[usize]); 4] = [(1, &[]), (2, &[]), (3, &[1]), (8, &[0, 5])];
    for (n, p) in shapes.into_iter().enumerate() {
        let c = Case::new(p, 200 + n as u64);
        let w = upload(&ctx, &c);
        for (j, t) in tunes.into_iter().enumerate() {
            let kern = MoeKernel::with_f32_tuning(&ctx, p, Numerics::F32, t).unwrap();
            assert!(kern.supports_cols(), "{p:?} {t:?}");
            for (m, (nb, done)) in runs.into_iter().enumerate() {
                let cols = columns_of(&p, nb, 300 + (n * 16 + j * 4 + m) as u64, done);
                let residual = (j + m) % 2 == 0;
                let what = format!("{p:?} {t:?} nb {nb} residual {residual}");
                check_cols(&ctx, &c, &kern, &w, &cols, residual, &what);
            }
        }
    }
}

/// The forms with at least one union stage (the default reads per column).
fn union_forms() -> [ColsForm; 3] {
    let stage = |gate_up, down| ColsForm { gate_up, down };
    [
        ColsForm::UNION,
        stage(ColsRead::Union, ColsRead::PerColumn),
        stage(ColsRead::PerColumn, ColsRead::Union),
    ]
}

/// How forced routes relate across columns.
#[derive(Debug, Clone, Copy)]
enum Overlap {
    /// Every column chooses the same experts in the same order.
    Same,
    /// The same experts, each column's ranks rotated by its index.
    Rotated,
    /// Column c chooses c K / 2 .. c K / 2 + K (mod E): neighbours share half, at other ranks.
    Half,
    /// Column c chooses c K .. c K + K (mod E), in reverse: disjoint while nb K <= E.
    Disjoint,
}

/// The experts (rank order) column `c` is forced to choose under `o`.
fn forced_ids(o: Overlap, p: &MoeParams, c: usize) -> Vec<u32> {
    let (e, k) = (p.experts as usize, p.top_k as usize);
    let ids = |f: &dyn Fn(usize) -> usize| (0..k).map(|j| (f(j) % e) as u32).collect();
    match o {
        Overlap::Same => ids(&|j| 3 * j + 1),
        Overlap::Rotated => ids(&|j| 3 * ((j + c) % k) + 1),
        Overlap::Half => ids(&|j| c * k.div_ceil(2) + j),
        Overlap::Disjoint => ids(&|j| c * k + k - 1 - j),
    }
}

/// Overwrite each column's logits so it chooses [`forced_ids`] (the other logits stay random,
/// below the forced ones) and check the reference router agrees.
fn force_routes(o: Overlap, p: &MoeParams, cols: &mut [ColIn]) {
    let k = p.top_k as usize;
    for (c, col) in cols.iter_mut().enumerate() {
        let want = forced_ids(o, p, c);
        for (j, e) in want.iter().enumerate() {
            col.logits[*e as usize] = 6.0 - 0.25 * j as f32 + 0.01 * c as f32;
        }
        assert_eq!(router_ids(&col.logits, k), want, "{o:?} column {c}");
    }
}

#[test]
fn moe_cols_union_shared_rotated_disjoint_experts() {
    let Some(ctx) = gpu("moe_cols_union_shared_rotated_disjoint_experts") else {
        return;
    };
    // Blocks per row off the lane counts (NB = 3, 5), K even and odd.
    let shapes = [params(16, 4, 96, 64, true), params(12, 3, 160, 96, false)];
    // The union down reproduces the per-column kernel with one down slot group.
    let tunes = [
        split(F32Tuning::DEFAULT, 1),
        split(tuning(8, 64, 4), 1),
        rows2(split(F32Tuning::DEFAULT, 1)),
    ];
    let runs: [(usize, &[usize]); 3] = [(1, &[]), (3, &[1]), (8, &[2, 5])];
    let overlaps = [
        Overlap::Same,
        Overlap::Rotated,
        Overlap::Half,
        Overlap::Disjoint,
    ];
    for (n, p) in shapes.into_iter().enumerate() {
        let c = Case::new(p, 240 + n as u64);
        let w = upload(&ctx, &c);
        for (j, t) in tunes.into_iter().enumerate() {
            let kern = MoeKernel::with_f32_tuning(&ctx, p, Numerics::F32, t).unwrap();
            assert!(kern.cols_union_down(), "{p:?} {t:?}");
            for (m, (nb, done)) in runs.into_iter().enumerate() {
                for (q, o) in overlaps.into_iter().enumerate() {
                    let seed = 400 + (n * 64 + j * 16 + m * 4 + q) as u64;
                    let mut cols = columns_of(&p, nb, seed, done);
                    force_routes(o, &p, &mut cols);
                    let residual = (j + m + q) % 2 == 0;
                    let what = format!("{p:?} {t:?} nb {nb} {o:?} residual {residual}");
                    check_cols(&ctx, &c, &kern, &w, &cols, residual, &what);
                    // Every form writes the default's (per column) bits everywhere.
                    let a = run_cols(&ctx, &kern, &w, &cols, residual);
                    for f in union_forms() {
                        let b = run_cols_with(&ctx, &kern, &w, &cols, residual, Some(f));
                        let what = format!("{what}: default vs {f:?}");
                        assert_eq!(a.route, b.route, "{what}: route");
                        assert_same(&a.h, &b.h, &format!("{what}: h"));
                        assert_same(&a.out, &b.out, &format!("{what}: out"));
                    }
                }
            }
        }
    }
}

#[test]
fn moe_cols_real_shape() {
    let Some(ctx) = gpu("moe_cols_real_shape") else {
        return;
    };
    // Qwen3-30B-A3B: E = 128, K = 8, H = 2048, I = 768.
    let p = params(128, 8, 2048, 768, true);
    let c = Case::new(p, 210);
    let w = upload(&ctx, &c);
    let kern = MoeKernel::with_numerics(&ctx, p, Numerics::F32).unwrap();
    assert!(kern.supports_cols());
    // One down slot group: the union down's kernel (the default splits down on Vulkan).
    let one =
        MoeKernel::with_f32_tuning(&ctx, p, Numerics::F32, split(F32Tuning::DEFAULT, 1)).unwrap();
    assert!(one.supports_cols() && one.cols_union_down());
    let cols = columns_of(&p, 8, 211, &[6]);
    check_cols(&ctx, &c, &kern, &w, &cols, true, "real shape nb 8");
    let cols = columns_of(&p, 3, 212, &[]);
    check_cols(&ctx, &c, &kern, &w, &cols, false, "real shape nb 3");
    // Eight columns over the same experts at rotated ranks, one done: each union expert serves
    // seven columns.
    let mut cols = columns_of(&p, 8, 213, &[3]);
    force_routes(Overlap::Rotated, &p, &mut cols);
    check_cols(&ctx, &c, &kern, &w, &cols, true, "real shape nb 8 rotated");
    // Both stages union: the default (per column) form's bits, on the
    // rotated columns (8 union experts) and on three random ones with the middle one done.
    let random = columns_of(&p, 3, 214, &[1]);
    for (cols, what) in [(&cols, "rotated nb 8"), (&random, "random nb 3")] {
        check_cols(
            &ctx,
            &c,
            &one,
            &w,
            cols,
            true,
            &format!("one slot group {what}"),
        );
        let a = run_cols(&ctx, &one, &w, cols, true);
        let b = run_cols_with(&ctx, &one, &w, cols, true, Some(ColsForm::UNION));
        assert_eq!(a.route, b.route, "real shape {what}: route");
        assert_same(&a.h, &b.h, &format!("real shape {what}: h"));
        assert_same(&a.out, &b.out, &format!("real shape {what}: out"));
    }
}

#[test]
fn moe_cols_shared_and_disjoint_experts_split_weights() {
    let Some(ctx) = gpu("moe_cols_shared_and_disjoint_experts_split_weights") else {
        return;
    };
    let p = params(16, 4, 64, 64, true);
    let c = Case::new(p, 220);
    let mut cols = columns_of(&p, 8, 221, &[3]);
    // Columns 0-2 choose experts 4c..4c+3 (disjoint; the top logits in a shuffled order);
    // columns 4-7 share the route of column 4 (same logits, own x and residual), with a tie at
    // the top going to the lower expert.
    for (n, col) in cols.iter_mut().enumerate().take(3) {
        for (j, e) in [2, 0, 3, 1].into_iter().enumerate() {
            col.logits[4 * n + e] = 6.0 + j as f32 * 0.5;
        }
    }
    cols[4].logits[11] = 7.0;
    cols[4].logits[5] = 7.0;
    let shared = cols[4].logits.clone();
    for col in &mut cols[5..] {
        col.logits.clone_from(&shared);
    }
    let k = p.top_k as usize;
    for (n, col) in cols.iter().enumerate().take(3) {
        let b = 4 * n as u32;
        assert_eq!(router_ids(&col.logits, k), [b + 1, b + 3, b, b + 2]);
    }
    assert_eq!(router_ids(&shared, k)[..2], [5, 11]);
    // One down slot group: the union forms reproduce its bits (checked below).
    let kern =
        MoeKernel::with_f32_tuning(&ctx, p, Numerics::F32, split(F32Tuning::DEFAULT, 1)).unwrap();
    let grouped = MoeKernel::with_numerics(&ctx, p, Numerics::F32).unwrap();
    let w = upload(&ctx, &c);
    check_cols(&ctx, &c, &kern, &w, &cols, true, "shared/disjoint");
    // Parts of 3 experts each (the activations stay whole, on the unsplit context): every
    // column's experts spread over several parts.
    let split = ctx.with_max_binding_bytes(3 * 64 * 2 * 16 + 100);
    let ws = upload(&split, &c);
    assert!(ws.gate.parts.len() > 1 && ws.down.parts.len() > 1);
    for residual in [true, false] {
        check_cols(&ctx, &c, &kern, &ws, &cols, residual, "split weights");
        check_cols(
            &ctx,
            &c,
            &grouped,
            &ws,
            &cols,
            residual,
            "split weights, slot groups",
        );
        // Every form, split: the default form's bits (the union down walks each part's experts).
        let a = run_cols(&ctx, &kern, &ws, &cols, residual);
        for f in union_forms() {
            let b = run_cols_with(&ctx, &kern, &ws, &cols, residual, Some(f));
            let what = format!("split weights residual {residual} {f:?}");
            assert_eq!(a.route, b.route, "{what}: route");
            assert_same(&a.h, &b.h, &format!("{what}: h"));
            assert_same(&a.out, &b.out, &format!("{what}: out"));
        }
    }
    // The split run routes as the whole-weight run (part 0 alone writes the route).
    let a = run_cols(&ctx, &kern, &w, &cols, true);
    let b = run_cols(&ctx, &kern, &ws, &cols, true);
    assert_eq!(a.route, b.route);
    assert_eq!(a.route.len(), cols.len() * 2 * k);
}

/// Expert ids of the f64 router reference.
fn router_ids(logits: &[f32], k: usize) -> Vec<u32> {
    super::super::router_ref(logits, k, true).0
}

#[test]
fn moe_cols_done_state_and_errors() {
    let Some(ctx) = gpu("moe_cols_done_state_and_errors") else {
        return;
    };
    let p = params(16, 4, 64, 64, true);
    let c = Case::new(p, 230);
    let w = upload(&ctx, &c);
    let kern = MoeKernel::with_numerics(&ctx, p, Numerics::F32).unwrap();
    // Every column done: nothing is written.
    let cols = columns_of(&p, 4, 231, &[0, 1, 2, 3]);
    let o = run_cols(&ctx, &kern, &w, &cols, true);
    assert!(o.route.iter().all(|v| *v == FILL));
    assert!(o.h.iter().all(|v| v.to_bits() == FILL));
    let res: Vec<f32> = cols.iter().flat_map(|c| c.residual.clone()).collect();
    assert_eq!(o.out, res);

    // Shape errors.
    let (k, h, i) = (4u64, 64u64, 64u64);
    let buf = |n: u64| ctx.storage("b", n * 4).unwrap();
    let (state, logits, route, x, hb, out) = (
        buf(4),
        buf(2 * 16),
        buf(2 * 2 * k),
        buf(2 * h),
        buf(2 * k * i),
        buf(2 * h),
    );
    let col_buf = columns::buffer(&ctx, &[Col::active(1, 0, 0); 2]).unwrap();
    // Gate/up one expert short.
    let (ne, ni) = (p.experts as usize, p.inter as usize);
    let short_bytes = (ne - 1) * ni * (h as usize / 32) * 18;
    let short = Q4Matrix::upload(
        &ctx,
        "short",
        (ne - 1) * ni,
        h as usize,
        ni,
        &[&c.gate[..short_bytes]],
    )
    .unwrap();
    let good = MoeColsBuffers {
        state: &state,
        cols: &col_buf,
        nb: 2,
        logits: &logits,
        route: &route,
        x: &x,
        gate: &w.gate,
        up: &w.up,
        down: &w.down,
        h: &hb,
        out: &out,
        residual: true,
    };
    kern.bind_cols(&ctx, &good).expect("good buffers");
    let small = buf(2 * h - 1);
    let route_short = buf(2 * 2 * k - 1);
    let cols9 = ctx.storage("cols9", 9 * 32).unwrap();
    let bad = [
        // A column buffer that holds 9: still more than the kernels serve.
        (
            MoeColsBuffers {
                nb: 9,
                cols: &cols9,
                ..good
            },
            "at most 8",
        ),
        (MoeColsBuffers { nb: 0, ..good }, "0 columns"),
        (MoeColsBuffers { nb: 9, ..good }, "9 columns"),
        (MoeColsBuffers { nb: 3, ..good }, "logits [nb, E]"),
        (MoeColsBuffers { x: &small, ..good }, "x [nb, H]"),
        (
            MoeColsBuffers {
                out: &small,
                ..good
            },
            "out [nb, H]",
        ),
        (MoeColsBuffers { h: &small, ..good }, "h [nb, K*I]"),
        (
            MoeColsBuffers {
                route: &route_short,
                ..good
            },
            "route [nb, 2K]",
        ),
        (
            MoeColsBuffers {
                gate: &short,
                ..good
            },
            "MoE gate",
        ),
        (MoeColsBuffers { up: &short, ..good }, "MoE up"),
        (
            MoeColsBuffers {
                cols: &state,
                ..good
            },
            "column buffer",
        ),
    ];
    for (n, (b, want)) in bad.iter().enumerate() {
        let e = kern.bind_cols(&ctx, b).expect_err("bad buffers accepted");
        assert!(e.to_string().contains(want), "bad {n}: {e} (want '{want}')");
    }
    // The int8 numerics, and f32 past the staging budget, have no column form.
    for n in [Numerics::Int8, Numerics::PreciseInt8] {
        let k8 = MoeKernel::with_numerics(&ctx, p, n).unwrap();
        assert!(!k8.supports_cols());
        let e = k8.bind_cols(&ctx, &good).expect_err("int8 columns");
        assert!(e.to_string().contains("f32 activations"), "{n}: {e}");
    }
    // (32 KiB of h: staged only in slot groups.)
    let big = params(16, 8, 64, 1024, true);
    let one = split(F32Tuning::DEFAULT, 1);
    let kb = MoeKernel::with_f32_tuning(&ctx, big, Numerics::F32, one).unwrap();
    assert_eq!(kb.f32_staged(), (true, false));
    assert!(!kb.supports_cols());
    let kg = MoeKernel::with_numerics(&ctx, big, Numerics::F32).unwrap();
    assert_eq!((kg.f32_staged(), kg.down_split()), ((true, true), 4));
}

#[test]
fn moe_cols_union_down_staging_and_fallback() {
    // The real shape stages 3 experts and 4 h slots in the union down (the doc's numbers).
    let real = params(128, 8, 2048, 768, true);
    assert_eq!(down_union_staging(&real, 32, STAGE_BUDGET), Some((3, 4)));
    // Wide experts: one expert's rows (20 KiB) and one h slot (16 KiB) exceed the budget.
    let wide = params(4, 1, 64, 4096, true);
    assert_eq!(down_union_staging(&wide, 32, STAGE_BUDGET), None);
    let Some(ctx) = gpu("moe_cols_union_down_staging_and_fallback") else {
        return;
    };
    // Such a kernel has the column forms with the per-column down only: bind_cols works, the
    // union down is refused with a clear error.
    let kern = MoeKernel::with_numerics(&ctx, wide, Numerics::F32).unwrap();
    assert!(kern.supports_cols() && !kern.cols_union_down());
    let c = Case::new(wide, 250);
    let w = upload(&ctx, &c);
    let cols = columns_of(&wide, 2, 251, &[]);
    check_cols(&ctx, &c, &kern, &w, &cols, true, "wide experts");
    let err = {
        let x = ctx.storage("x", 2 * 64 * 4).unwrap();
        let logits = ctx.storage("logits", 2 * 4 * 4).unwrap();
        let route = ctx.storage("route", 2 * 2 * 4).unwrap();
        let hb = ctx.storage("h", 2 * 4096 * 4).unwrap();
        let state = ctx.storage("state", 16).unwrap();
        let col_buf = columns::buffer(&ctx, &[Col::active(1, 0, 0); 2]).unwrap();
        let b = MoeColsBuffers {
            state: &state,
            cols: &col_buf,
            nb: 2,
            logits: &logits,
            route: &route,
            x: &x,
            gate: &w.gate,
            up: &w.up,
            down: &w.down,
            h: &hb,
            out: &x,
            residual: true,
        };
        kern.bind_cols_with(&ctx, &b, ColsForm::UNION)
            .expect_err("union down past the budget")
    };
    assert!(err.to_string().contains("no union down kernel"), "{err}");
}
