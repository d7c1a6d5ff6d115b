//! Lavapipe tests of the multi-column attention against the scalar references (`rope_ref`,
//! `attention_ref`) and, for prefill, against the single-token kernel run token by token.

use super::super::tests::params;
use super::super::{
    attention_ref, rope_ref, AttentionBuffers, AttentionParams, AttnForm, ChunkShape, Combine,
};
use super::*;
use crate::columns::{self, Col};
use crate::testing::{assert_close, gpu, rand_f32, rng};

/// Host copies of everything one multi-column step reads.
struct ColsCase {
    p: AttentionParams,
    /// Columns the buffers hold (>= the columns recorded).
    columns: u32,
    slots: u32,
    /// `[columns, Q + 2 KV]` raw q|k|v.
    qkv: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    /// `[slots, ctx, Hkv, D]`.
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    /// The column states (idle past them).
    cols: Vec<Col>,
}

impl ColsCase {
    fn new(p: AttentionParams, columns: u32, slots: u32, cols: Vec<Col>, seed: u64) -> ColsCase {
        let mut r = rng(seed);
        let d = p.head_dim as usize;
        let qkv_len = columns as usize * (p.heads + 2 * p.kv_heads) as usize * d;
        let cache = slots as usize * p.ctx as usize * p.kv_heads as usize * d;
        ColsCase {
            p,
            columns,
            slots,
            qkv: rand_f32(&mut r, qkv_len, -2.0, 2.0),
            q_norm: rand_f32(&mut r, d, 0.5, 1.5),
            k_norm: rand_f32(&mut r, d, 0.5, 1.5),
            k_cache: rand_f32(&mut r, cache, -1.5, 1.5),
            v_cache: rand_f32(&mut r, cache, -1.0, 1.0),
            cols,
        }
    }

    /// Column c's raw q|k|v.
    fn qkv_of(&self, c: usize) -> &[f32] {
        let n = (self.p.heads + 2 * self.p.kv_heads) as usize * self.p.head_dim as usize;
        &self.qkv[c * n..(c + 1) * n]
    }

    /// Elements of one slot's cache region.
    fn slot_len(&self) -> usize {
        (self.p.ctx * self.p.kv_heads * self.p.head_dim) as usize
    }

    /// Element range of cache row `pos` of `slot`.
    fn row(&self, slot: u32, pos: u32) -> std::ops::Range<usize> {
        let w = (self.p.kv_heads * self.p.head_dim) as usize;
        let r = (slot * self.p.ctx + pos) as usize;
        r * w..(r + 1) * w
    }
}

struct ColsOutputs {
    qkv: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    /// `[columns, Hq*D]`, NaN-filled before the run.
    out: Vec<f32>,
    dispatches: u32,
}

/// Upload `c`, record columns `0..nb` in `mode` (state.done set when `done`), read back.
fn run_cols(
    ctx: &Context,
    k: &AttentionKernel,
    c: &ColsCase,
    mode: ColumnMode,
    pos_bound: u32,
    nb: u32,
    done: bool,
) -> ColsOutputs {
    let f = |label: &str, v: &[f32]| {
        ctx.storage_init(label, bytemuck::cast_slice(v))
            .expect("buffer")
    };
    let state = ctx
        .storage_init("state", bytemuck::cast_slice(&[0u32, 0, done as u32, 0]))
        .expect("state");
    let cols = columns::buffer(ctx, &c.cols).expect("cols");
    let qkv = f("qkv", &c.qkv);
    let (qn, kn) = (f("q_norm", &c.q_norm), f("k_norm", &c.k_norm));
    let (kc, vc) = (f("k_cache", &c.k_cache), f("v_cache", &c.v_cache));
    let n_out = (c.columns * c.p.heads * c.p.head_dim) as usize;
    let out = f("out", &vec![f32::NAN; n_out]);
    let scratch = k.scratch_cols(ctx, c.columns).expect("scratch");
    let bufs = AttentionColsBuffers {
        state: &state,
        cols: &cols,
        qkv: &qkv,
        q_norm: &qn,
        k_norm: &kn,
        k_cache: &kc,
        v_cache: &vc,
        out: &out,
        columns: c.columns,
        slots: c.slots,
        mode,
    };
    let b = k.bind_cols(ctx, &bufs, &scratch).expect("bind");
    assert_eq!((b.mode(), b.columns()), (mode, c.columns));
    let mut rec = Ok(());
    ctx.run_pass(|pass| rec = k.record_cols(pass, &b, pos_bound, nb))
        .expect("run");
    rec.expect("record");
    ColsOutputs {
        qkv: ctx.read_f32(&qkv, c.qkv.len()).unwrap(),
        k_cache: ctx.read_f32(&kc, c.k_cache.len()).unwrap(),
        v_cache: ctx.read_f32(&vc, c.v_cache.len()).unwrap(),
        out: ctx.read_f32(&out, n_out).unwrap(),
        dispatches: k.dispatches_cols(&b, pos_bound),
    }
}

/// Whether column `j` of the first `nb` runs (active, slot in range).
fn live(c: &ColsCase, j: usize, nb: u32) -> bool {
    j < nb as usize && j < c.cols.len() && c.cols[j].done == 0 && c.cols[j].slot < c.slots
}

/// Independent mode: every live column's k/v row and output match the references (from its own
/// qkv, slot and position); every other cache row, skipped columns' outputs included, is
/// untouched. Returns the dispatches.
fn check_independent(ctx: &Context, k: &AttentionKernel, c: &ColsCase, bound: u32, nb: u32) -> u32 {
    let o = run_cols(ctx, k, c, ColumnMode::Independent, bound, nb, false);
    let p = &c.p;
    let (hq, hkv, d) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    assert_eq!(o.qkv, c.qkv, "qkv changed");
    let (mut k_want, mut v_want) = (c.k_cache.clone(), c.v_cache.clone());
    let mut written = Vec::new();
    for j in (0..c.columns as usize).filter(|j| live(c, *j, nb)) {
        let col = c.cols[j];
        let what = format!("{p:?} nb {nb} bound {bound} column {j} {col:?}");
        let (q, kr) = rope_ref(p, c.qkv_of(j), &c.q_norm, &c.k_norm, col.pos);
        let row = c.row(col.slot, col.pos);
        assert_close(
            &o.k_cache[row.clone()],
            &kr,
            2e-5,
            1e-4,
            &format!("{what}: k row"),
        );
        assert_eq!(
            o.v_cache[row.clone()],
            c.qkv_of(j)[(hq + hkv) * d..],
            "{what}: v row"
        );
        // The GPU's k row (checked above) stands in the expected cache, exact elsewhere.
        k_want[row.clone()].copy_from_slice(&o.k_cache[row.clone()]);
        v_want[row.clone()].copy_from_slice(&c.qkv_of(j)[(hq + hkv) * d..]);
        written.push((j, q, kr, row));
    }
    assert_eq!(
        o.k_cache, k_want,
        "{p:?} nb {nb}: k cache outside the new rows"
    );
    assert_eq!(
        o.v_cache, v_want,
        "{p:?} nb {nb}: v cache outside the new rows"
    );
    let out_len = hq * d;
    let region = |v: &[f32], slot: u32| {
        let s = slot as usize * c.slot_len();
        v[s..s + c.slot_len()].to_vec()
    };
    for (j, q, kr, row) in written {
        let col = c.cols[j];
        let what = format!("{p:?} nb {nb} bound {bound} column {j} {col:?}");
        let got = &o.out[j * out_len..(j + 1) * out_len];
        let (kc, vc) = (region(&o.k_cache, col.slot), region(&o.v_cache, col.slot));
        let want = attention_ref(p, &q, &kc, &vc, col.pos);
        assert_close(got, &want, 2e-5, 1e-4, &format!("{what}: out"));
        // And the chain from the raw inputs (the reference k row in the original cache).
        let (mut kc, vc) = (c.k_cache.clone(), v_want.clone());
        kc[row].copy_from_slice(&kr);
        let chain = attention_ref(
            p,
            &q,
            &region(&kc, col.slot),
            &region(&vc, col.slot),
            col.pos,
        );
        assert_close(got, &chain, 5e-5, 2e-4, &format!("{what}: chained out"));
    }
    for j in (0..c.columns as usize).filter(|j| !live(c, *j, nb)) {
        assert!(
            o.out[j * out_len..(j + 1) * out_len]
                .iter()
                .all(|v| v.is_nan()),
            "{p:?} nb {nb}: skipped column {j} wrote its output"
        );
    }
    o.dispatches
}

/// One prefill step: `nb` columns of slot `slot` (of `slots`) at positions `p0 + c`, recorded
/// with position bound `bound`.
#[derive(Debug, Clone, Copy)]
struct Prefill {
    slots: u32,
    slot: u32,
    p0: u32,
    nb: u32,
    bound: u32,
}

/// Prefill mode: column c's output and the final cache match the single-token kernel run token
/// by token (same kernel, a binding of the slot's region), the output also the references;
/// other slots untouched. Returns the dispatches.
fn check_prefill(
    ctx: &Context,
    k: &AttentionKernel,
    p: AttentionParams,
    f: Prefill,
    seed: u64,
) -> u32 {
    let Prefill {
        slots,
        slot,
        p0,
        nb,
        bound,
    } = f;
    let cols: Vec<Col> = (0..nb).map(|j| Col::active(7 + j, p0 + j, slot)).collect();
    let c = ColsCase::new(p, nb, slots, cols, seed);
    let o = run_cols(ctx, k, &c, ColumnMode::Prefill, bound, nb, false);
    let what = format!("{p:?} prefill slot {slot}/{slots} p0 {p0} nb {nb} bound {bound}");
    assert_eq!(o.qkv, c.qkv, "{what}: qkv changed");
    let (hq, hkv, d) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let seq = token_by_token(ctx, k, &c, slot, p0, nb);
    let s = slot as usize * c.slot_len()..(slot as usize + 1) * c.slot_len();
    assert_close(
        &o.k_cache[s.clone()],
        &seq.k_cache,
        1e-6,
        1e-6,
        &format!("{what}: k"),
    );
    assert_eq!(o.v_cache[s.clone()], seq.v_cache[..], "{what}: v cache");
    for (name, got, orig) in [("k", &o.k_cache, &c.k_cache), ("v", &o.v_cache, &c.v_cache)] {
        assert_eq!(
            got[..s.start],
            orig[..s.start],
            "{what}: {name} slots before"
        );
        assert_eq!(got[s.end..], orig[s.end..], "{what}: {name} slots after");
    }
    let (kc, vc) = (&o.k_cache[s.clone()], &o.v_cache[s]);
    for j in 0..nb as usize {
        let got = &o.out[j * hq * d..(j + 1) * hq * d];
        let pos = p0 + j as u32;
        let col = format!("{what}: column {j}");
        assert_close(
            got,
            &seq.out[j],
            1e-6,
            1e-6,
            &format!("{col} vs token by token"),
        );
        let (q, kr) = rope_ref(&p, c.qkv_of(j), &c.q_norm, &c.k_norm, pos);
        let row = c.row(0, pos);
        assert_close(&kc[row.clone()], &kr, 2e-5, 1e-4, &format!("{col}: k row"));
        assert_eq!(vc[row], c.qkv_of(j)[(hq + hkv) * d..], "{col}: v row");
        let want = attention_ref(&p, &q, kc, vc, pos);
        assert_close(got, &want, 2e-5, 1e-4, &format!("{col}: out"));
    }
    o.dispatches
}

struct Sequential {
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    out: Vec<Vec<f32>>,
}

/// The single-token kernel over slot `slot`'s region of `c`'s caches, one token at a time at
/// positions `p0..p0 + nb` (tight position bound, as the decode plan records it).
fn token_by_token(
    ctx: &Context,
    k: &AttentionKernel,
    c: &ColsCase,
    slot: u32,
    p0: u32,
    nb: u32,
) -> Sequential {
    let f = |label: &str, v: &[f32]| {
        ctx.storage_init(label, bytemuck::cast_slice(v))
            .expect("buffer")
    };
    let s = slot as usize * c.slot_len()..(slot as usize + 1) * c.slot_len();
    let state = ctx.storage("state", 16).expect("state");
    let qkv = f("qkv", c.qkv_of(0));
    let (qn, kn) = (f("q_norm", &c.q_norm), f("k_norm", &c.k_norm));
    let (kc, vc) = (
        f("k_cache", &c.k_cache[s.clone()]),
        f("v_cache", &c.v_cache[s]),
    );
    let n_out = (c.p.heads * c.p.head_dim) as usize;
    let out = ctx.storage("out", n_out as u64 * 4).expect("out");
    let scratch = k.scratch(ctx).expect("scratch");
    let bufs = AttentionBuffers {
        state: &state,
        qkv: &qkv,
        q_norm: &qn,
        k_norm: &kn,
        k_cache: &kc,
        v_cache: &vc,
        out: &out,
        out_q: None,
    };
    let b = k.bind(ctx, &bufs, &scratch).expect("bind");
    let mut outs = Vec::new();
    for j in 0..nb {
        let pos = p0 + j;
        ctx.write(&state, 0, bytemuck::cast_slice(&[pos, 0, 0, 0]));
        ctx.write(&qkv, 0, bytemuck::cast_slice(c.qkv_of(j as usize)));
        ctx.run_pass(|pass| k.record(pass, &b, pos)).expect("run");
        outs.push(ctx.read_f32(&out, n_out).unwrap());
    }
    Sequential {
        k_cache: ctx.read_f32(&kc, c.slot_len()).unwrap(),
        v_cache: ctx.read_f32(&vc, c.slot_len()).unwrap(),
        out: outs,
    }
}

#[test]
fn attention_cols_independent_slots_and_positions() {
    let Some(ctx) = gpu("attention_cols_independent_slots_and_positions") else {
        return;
    };
    // G = 2, D = 32, chunk 16, 8 slots of 64 rows; live columns have distinct slots (the
    // mode's contract).
    let p = params(4, 2, 32, 64, 16);
    for merge in [Combine::Dispatch, Combine::Fused] {
        independent_slots_and_positions(&ctx, p, merge, ChunkShape::default());
    }
}

/// [`attention_cols_independent_slots_and_positions`] with the chunks merged as `merge` (the
/// fused form serves every position of this 4-chunk cache in one dispatch).
fn independent_slots_and_positions(
    ctx: &Context,
    p: AttentionParams,
    merge: Combine,
    shape: ChunkShape,
) {
    let k = AttentionKernel::with_shape(ctx, p, None, shape)
        .expect("kernel")
        .with_combine(merge);
    let a = Col::active;
    let cases: [(u32, Vec<Col>); 4] = [
        // nb = 1 at position 0 in slot 2.
        (1, vec![a(1, 0, 2)]),
        // nb = 2: position 0 and a three-chunk position, other slots.
        (2, vec![a(1, 0, 4), a(2, 37, 0)]),
        // nb = 3 with the middle column done.
        (
            3,
            vec![
                a(1, 15, 1),
                Col {
                    done: 1,
                    ..a(2, 20, 3)
                },
                a(3, 16, 3),
            ],
        ),
        // nb = 8: chunk edges, the last cache row, one done column, one slot out of range.
        (
            8,
            vec![
                a(1, 63, 0),
                a(2, 1, 1),
                Col {
                    done: 1,
                    ..a(3, 5, 2)
                },
                a(4, 31, 2),
                a(5, 32, 3),
                a(6, 0, 9),
                a(7, 47, 4),
                a(8, 9, 5),
            ],
        ),
    ];
    for (i, (nb, cols)) in cases.into_iter().enumerate() {
        let c = ColsCase::new(p, nb, 8, cols, 300 + i as u64);
        let max = c.cols.iter().map(|c| c.pos).max().unwrap_or(0);
        let tight = check_independent(ctx, &k, &c, max, nb);
        let two = if merge == Combine::Fused { 1 } else { 2 };
        assert_eq!(tight, if max < 16 { 1 } else { two }, "nb {nb}: dispatches");
        // A loose bound: chunks past every position exit without touching anything.
        assert_eq!(check_independent(ctx, &k, &c, 63, nb), two);
    }
    // Fewer columns recorded than the buffers hold: the rest stay untouched.
    let cols = (0..6).map(|j| a(j, 3 * j + 2, 7 - j)).collect();
    let c = ColsCase::new(p, 6, 8, cols, 320);
    check_independent(ctx, &k, &c, 40, 4);
}

#[test]
fn attention_cols_prefill_matches_token_by_token() {
    let Some(ctx) = gpu("attention_cols_prefill_matches_token_by_token") else {
        return;
    };
    let p = params(4, 2, 32, 64, 16);
    for merge in [Combine::Dispatch, Combine::Fused] {
        prefill_matches_token_by_token(&ctx, p, merge, ChunkShape::default());
    }
}

/// The column forms (independent columns, prefill) on the streamed chunk body
/// (`AttnForm::Stream`), both merges: the body is shared, the column offsets are the forms'.
#[test]
fn attention_cols_streamed_form() {
    let Some(ctx) = gpu("attention_cols_streamed_form") else {
        return;
    };
    let p = params(4, 2, 32, 64, 16);
    let shape = ChunkShape {
        form: AttnForm::Stream,
        tile_loads: 4,
        v_rows: 3,
    };
    for merge in [Combine::Dispatch, Combine::Fused] {
        independent_slots_and_positions(&ctx, p, merge, shape);
        prefill_matches_token_by_token(&ctx, p, merge, shape);
    }
}

/// [`attention_cols_prefill_matches_token_by_token`] with the chunks merged as `merge` (fused:
/// the KV write and one attention dispatch at every bound of this 4-chunk cache).
fn prefill_matches_token_by_token(
    ctx: &Context,
    p: AttentionParams,
    merge: Combine,
    shape: ChunkShape,
) {
    let k = AttentionKernel::with_shape(ctx, p, None, shape)
        .expect("kernel")
        .with_combine(merge);
    // (slots, slot, p0, nb, bound): nb 1, 2, 3, 8 from position 0 (one chunk: KV write +
    // single), across the chunk edge, deep into the cache, and up to the last row.
    for (i, (slots, slot, p0, nb, bound, dispatches)) in [
        (1, 0, 0, 1, 0, 2),
        (2, 1, 0, 8, 7, 2),
        (3, 1, 14, 2, 15, 2),
        (3, 2, 14, 3, 16, 3),
        (2, 0, 40, 8, 47, 3),
        (4, 3, 56, 8, 63, 3),
        (2, 1, 3, 8, 63, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let f = Prefill {
            slots,
            slot,
            p0,
            nb,
            bound,
        };
        let got = check_prefill(ctx, &k, p, f, 400 + i as u64);
        let want = if merge == Combine::Fused {
            2
        } else {
            dispatches
        };
        assert_eq!(
            got, want,
            "{merge:?} p0 {p0} nb {nb} bound {bound}: dispatches"
        );
    }
}

/// Odd shapes (as the single-token tests use): G = 3 with D/2 not a multiple of 4, G = 5 with
/// one kv head, G = 1, G = 3 at D = 64, G = 64 (the norm reduction in two passes), in both
/// modes at positions 0, chunk - 1, chunk and several chunks + 1.
#[test]
fn attention_cols_odd_shapes_both_modes() {
    let Some(ctx) = gpu("attention_cols_odd_shapes_both_modes") else {
        return;
    };
    let shapes = [
        (6, 2, 36, 100, 7),
        (5, 1, 20, 64, 5),
        (3, 3, 8, 40, 4),
        (12, 4, 64, 96, 16),
        (64, 1, 4, 40, 4),
    ];
    for (i, (hq, hkv, d, n, chunk)) in shapes.into_iter().enumerate() {
        let p = params(hq, hkv, d, n, chunk);
        let k = AttentionKernel::new(&ctx, p).expect("kernel");
        let seed = 500 + 10 * i as u64;
        let cols = [0, chunk - 1, chunk, 3 * chunk + 1]
            .iter()
            .enumerate()
            .map(|(j, pos)| Col::active(j as u32, *pos, 3 - j as u32))
            .collect();
        let c = ColsCase::new(p, 4, 4, cols, seed);
        check_independent(&ctx, &k, &c, 3 * chunk + 1, 4);
        check_independent(&ctx, &k, &c, n - 1, 3);
        let f = |slots, slot, p0, nb, bound| Prefill {
            slots,
            slot,
            p0,
            nb,
            bound,
        };
        check_prefill(&ctx, &k, p, f(2, 1, chunk - 2, 3, chunk + 1), seed + 1);
        check_prefill(&ctx, &k, p, f(1, 0, 0, 2, 1), seed + 2);
    }
}

#[test]
fn attention_cols_qwen3_shape_and_long_split() {
    let Some(ctx) = gpu("attention_cols_qwen3_shape_and_long_split") else {
        return;
    };
    let p = params(32, 4, 128, 384, 64);
    let k = AttentionKernel::new(&ctx, p).expect("kernel");
    let cols = vec![
        Col::active(1, 300, 1),
        Col::active(2, 0, 0),
        Col::active(3, 64, 2),
    ];
    let c = ColsCase::new(p, 3, 3, cols, 600);
    check_independent(&ctx, &k, &c, 300, 3);
    let f = Prefill {
        slots: 2,
        slot: 1,
        p0: 60,
        nb: 8,
        bound: 67,
    };
    check_prefill(&ctx, &k, p, f, 601);
    // The long-context split with a small cache (target 8 chunks per kv head, cap 128): chunks
    // of 4, 16, 64 and 128 for the columns' positions in one dispatch.
    // Both merges (fused: the last of up to 8 chunks per column and kv head merges).
    let p = params(8, 2, 32, 1100, 4);
    for merge in [Combine::Dispatch, Combine::Fused] {
        let k = AttentionKernel::with_split(&ctx, p, Some((8, 128)))
            .expect("kernel")
            .with_combine(merge);
        let cols = vec![
            Col::active(1, 31, 0),
            Col::active(2, 40, 1),
            Col::active(3, 511, 2),
            Col::active(4, 1099, 3),
        ];
        let c = ColsCase::new(p, 4, 4, cols, 610);
        let want = if merge == Combine::Fused { 1 } else { 2 };
        assert_eq!(check_independent(&ctx, &k, &c, 1099, 4), want, "{merge:?}");
        let f = Prefill {
            slots: 1,
            slot: 0,
            p0: 1020,
            nb: 8,
            bound: 1027,
        };
        check_prefill(&ctx, &k, p, f, 611);
    }
}

#[test]
fn attention_cols_state_done_skips_everything() {
    let Some(ctx) = gpu("attention_cols_state_done_skips_everything") else {
        return;
    };
    let p = params(4, 2, 32, 64, 16);
    let k = AttentionKernel::new(&ctx, p).expect("kernel");
    let cols = vec![Col::active(1, 5, 0), Col::active(2, 40, 1)];
    let c = ColsCase::new(p, 2, 2, cols, 700);
    for mode in [ColumnMode::Independent, ColumnMode::Prefill] {
        for bound in [5, 63] {
            let o = run_cols(&ctx, &k, &c, mode, bound, 2, true);
            assert_eq!(
                o.k_cache, c.k_cache,
                "{mode:?} bound {bound}: k cache changed"
            );
            assert_eq!(
                o.v_cache, c.v_cache,
                "{mode:?} bound {bound}: v cache changed"
            );
            assert!(
                o.out.iter().all(|v| v.is_nan()),
                "{mode:?} bound {bound}: output written although done"
            );
        }
    }
}

#[test]
fn attention_cols_rejects_bad_input() {
    let Some(ctx) = gpu("attention_cols_rejects_bad_input") else {
        return;
    };
    let p = params(4, 2, 32, 64, 16);
    let k = AttentionKernel::new(&ctx, p).expect("kernel");
    // 0, or more than a grid dimension holds (the prefill plan binds one column per token).
    for n in [0, 65536] {
        let e = k.scratch_cols(&ctx, n).expect_err("bad column count");
        assert!(e.to_string().contains("columns"), "{e}");
    }
    let big = ctx.storage("big", 1 << 18).unwrap();
    let cols = columns::buffer(&ctx, &[Col::active(0, 3, 0)]).unwrap();
    let small_cache = ctx.storage("small", 64 * 2 * 32 * 4).unwrap();
    let tiny = ctx.storage("tiny", 128).unwrap();
    let scratch2 = k.scratch_cols(&ctx, 2).unwrap();
    let good = AttentionColsBuffers {
        state: &big,
        cols: &cols,
        qkv: &big,
        q_norm: &big,
        k_norm: &big,
        k_cache: &big,
        v_cache: &big,
        out: &big,
        columns: 2,
        slots: 2,
        mode: ColumnMode::Independent,
    };
    let bad = [
        ("columns", AttentionColsBuffers { columns: 3, ..good }),
        ("columns", AttentionColsBuffers { columns: 0, ..good }),
        ("slot", AttentionColsBuffers { slots: 0, ..good }),
        // One slot's worth of cache for two slots.
        (
            "k_cache",
            AttentionColsBuffers {
                k_cache: &small_cache,
                ..good
            },
        ),
        (
            "v_cache",
            AttentionColsBuffers {
                v_cache: &small_cache,
                mode: ColumnMode::Prefill,
                ..good
            },
        ),
        // 8 columns of 32 bytes need 256.
        (
            "cols",
            AttentionColsBuffers {
                cols: &tiny,
                ..good
            },
        ),
    ];
    for (what, b) in bad {
        let e = k
            .bind_cols(&ctx, &b, &scratch2)
            .expect_err("bad buffers accepted");
        assert!(e.to_string().contains(what), "{what}: {e}");
    }
    // A scratch of fewer columns than the buffers.
    let scratch1 = k.scratch_cols(&ctx, 1).unwrap();
    let e = k
        .bind_cols(&ctx, &good, &scratch1)
        .expect_err("small scratch");
    assert!(e.to_string().contains("scratch"), "{e}");
    // Recording more columns than bound, or none, is an error and records nothing.
    let b = k.bind_cols(&ctx, &good, &scratch2).expect("bind");
    for nb in [0, 3] {
        let mut rec = Ok(());
        ctx.run_pass(|pass| rec = k.record_cols(pass, &b, 10, nb))
            .unwrap();
        let e = rec.expect_err("bad nb accepted");
        assert!(e.to_string().contains("columns"), "nb {nb}: {e}");
    }
    // The chunk module runs unchecked, so another kernel's scratch (a shorter cache: fewer
    // chunks, smaller partials) is refused, and so is recording a binding with a kernel of
    // other shapes (its grid would not fit the bound pipelines).
    let few = AttentionKernel::new(&ctx, params(4, 2, 32, 16, 16)).expect("kernel");
    let few_scratch = few.scratch_cols(&ctx, 2).unwrap();
    let e = k
        .bind_cols(&ctx, &good, &few_scratch)
        .expect_err("another kernel's smaller scratch");
    assert!(e.to_string().contains("part_o"), "{e}");
    let other = AttentionKernel::new(&ctx, params(8, 4, 32, 64, 16)).expect("kernel");
    let mut rec = Ok(());
    ctx.run_pass(|pass| rec = other.record_cols(pass, &b, 10, 1))
        .unwrap();
    let e = rec.expect_err("another kernel's binding recorded");
    assert!(e.to_string().contains("recorded by a kernel"), "{e}");
    let prefill = AttentionColsBuffers {
        mode: ColumnMode::Prefill,
        ..good
    };
    let kw = k.bind_kv_write(&ctx, &prefill).expect("kv write");
    let mut rec = Ok(());
    ctx.run_pass(|pass| rec = other.record_kv_write(pass, &kw, 1))
        .unwrap();
    let e = rec.expect_err("another kernel's kv write recorded");
    assert!(e.to_string().contains("recorded by a kernel"), "{e}");
}
