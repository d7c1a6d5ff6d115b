//! Lavapipe tests of the attention kernels against the scalar references in `attention.rs`.

use super::*;
use crate::tensor::quantize_acts_ref;
use crate::testing::{assert_close, cache_bytes, gpu, rand_f32, read_cache, rng};

/// Host copies of everything one attention step reads, plus the GPU buffers holding them.
struct Case {
    p: AttentionParams,
    qkv: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    /// Split override (target chunks per kv head, chunk cap) for [`AttentionKernel::with_split`].
    split: Option<(u32, u32)>,
    /// Cache loads per thread per tile ([`AttentionKernel::with_split_tile`]).
    tile_loads: u32,
    /// The chunk body's form and the streamed form's V rows per batch ([`ChunkShape`]).
    form: AttnForm,
    v_rows: u32,
    /// Where the partials merge ([`AttentionKernel::with_combine`]) and up to how many chunks
    /// per kv head the fused form serves ([`AttentionKernel::with_fused_max_chunks`]).
    merge: Combine,
    fused_max: u32,
    /// Record the step this many times, clearing the output between (the fused combine's
    /// arrival counters must be back at zero after each dispatch).
    repeats: u32,
}

impl Case {
    fn new(p: AttentionParams, seed: u64) -> Case {
        let mut r = rng(seed);
        let d = p.head_dim as usize;
        let qkv_len = (p.heads + 2 * p.kv_heads) as usize * d;
        let cache = p.ctx as usize * p.kv_heads as usize * d;
        // The host copies hold what a cache of the type holds.
        let mut cached = |lo, hi| {
            let mut v = rand_f32(&mut r, cache, lo, hi);
            p.cache.round_all(&mut v);
            v
        };
        let (k_cache, v_cache) = (cached(-1.5, 1.5), cached(-1.0, 1.0));
        Case {
            p,
            qkv: rand_f32(&mut r, qkv_len, -2.0, 2.0),
            q_norm: rand_f32(&mut r, d, 0.5, 1.5),
            k_norm: rand_f32(&mut r, d, 0.5, 1.5),
            k_cache,
            v_cache,
            split: None,
            tile_loads: TILE_LOADS,
            form: AttnForm::Tiles,
            v_rows: V_ROWS,
            merge: Combine::Dispatch,
            fused_max: FUSED_MAX_CHUNKS,
            repeats: 1,
        }
    }
}

struct Outputs {
    qkv: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    out: Vec<f32>,
    /// (packed i8 words, (d, d*Σq) per block) when the int8 output was requested.
    out_q: Option<(Vec<u32>, Vec<[f32; 2]>)>,
    /// Dispatches the step recorded ([`AttentionKernel::dispatches`]).
    dispatches: u32,
}

/// The kernel `c` asks for (compiled: a lavapipe compile takes ~1 s, so tests that run many
/// steps of one shape build it once and hand it to [`check_case_with`]).
fn kernel(ctx: &Context, c: &Case) -> AttentionKernel {
    let shape = ChunkShape {
        form: c.form,
        tile_loads: c.tile_loads,
        v_rows: c.v_rows,
    };
    AttentionKernel::with_shape(ctx, c.p, c.split, shape).expect("kernel")
}

/// Upload `c`, run one step at `pos` (optionally with the done flag set), read everything back.
fn run(ctx: &Context, c: &Case, pos: u32, pos_bound: u32, done: bool, quant: bool) -> Outputs {
    run_with(ctx, &kernel(ctx, c), c, (pos, pos_bound), done, quant)
}

/// [`run`] on the compiled `k` (built for `c`'s params, split and shape), merging as `c` says.
fn run_with(
    ctx: &Context,
    k: &AttentionKernel,
    c: &Case,
    (pos, pos_bound): (u32, u32),
    done: bool,
    quant: bool,
) -> Outputs {
    let k = k
        .clone()
        .with_combine(c.merge)
        .with_fused_max_chunks(c.fused_max);
    let f = |label: &str, v: &[f32]| {
        ctx.storage_init(label, bytemuck::cast_slice(v))
            .expect("buffer")
    };
    let state = ctx
        .storage_init("state", bytemuck::cast_slice(&[pos, 0, done as u32, 0]))
        .expect("state");
    let qkv = f("qkv", &c.qkv);
    let (qn, kn) = (f("q_norm", &c.q_norm), f("k_norm", &c.k_norm));
    let cache = |label: &str, v: &[f32]| {
        ctx.storage_init(label, &cache_bytes(c.p.cache, v))
            .expect("cache")
    };
    let (kc, vc) = (cache("k_cache", &c.k_cache), cache("v_cache", &c.v_cache));
    let n_out = (c.p.heads * c.p.head_dim) as usize;
    let out = ctx.storage("out", n_out as u64 * 4).expect("out");
    let out_q = quant.then(|| QuantActs::new(ctx, "out_q", n_out).expect("out_q"));
    let scratch = k.scratch(ctx).expect("scratch");
    let bufs = AttentionBuffers {
        state: &state,
        qkv: &qkv,
        q_norm: &qn,
        k_norm: &kn,
        k_cache: &kc,
        v_cache: &vc,
        out: &out,
        out_q: out_q.as_ref(),
    };
    let b = k.bind(ctx, &bufs, &scratch).expect("bind");
    let dispatches = k.dispatches(&b, pos_bound);
    for r in 0..c.repeats {
        if r > 0 {
            // A stale output must not pass for a fresh one.
            ctx.write(&out, 0, bytemuck::cast_slice(&vec![f32::NAN; n_out]));
            // The step wrote row pos; put the original cache back so the step repeats exactly.
            ctx.write(&kc, 0, &cache_bytes(c.p.cache, &c.k_cache));
            ctx.write(&vc, 0, &cache_bytes(c.p.cache, &c.v_cache));
        }
        ctx.run_pass(|pass| k.record(pass, &b, pos_bound))
            .expect("run");
    }
    Outputs {
        qkv: ctx.read_f32(&qkv, c.qkv.len()).unwrap(),
        k_cache: read_cache(ctx, c.p.cache, &kc, c.k_cache.len()),
        v_cache: read_cache(ctx, c.p.cache, &vc, c.v_cache.len()),
        out: ctx.read_f32(&out, n_out).unwrap(),
        out_q: out_q.map(|q| {
            let words = ctx.read_u32(&q.q, n_out / 4).unwrap();
            let s: Vec<f32> = ctx.read_f32(&q.s, n_out / 16).unwrap();
            (words, s.chunks(2).map(|c| [c[0], c[1]]).collect())
        }),
        dispatches,
    }
}

pub(crate) fn params(
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    ctx: u32,
    chunk: u32,
) -> AttentionParams {
    AttentionParams {
        heads,
        kv_heads,
        head_dim,
        ctx,
        chunk,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        eps: 1e-6,
        cache: nibble_model::kv_cache::CacheType::F32,
    }
}

/// Full step at `pos`: qkv untouched, k/v cache rows, attention output; error vs the f64
/// references. Tolerance: f32 kernels vs f64 references, 2e-5 absolute + 1e-4 relative.
/// Returns the dispatches the step took.
fn check_step(ctx: &Context, p: AttentionParams, pos: u32, pos_bound: u32, seed: u64) -> u32 {
    check_step_split(ctx, p, None, pos, pos_bound, seed)
}

/// [`check_step`] with the split's (target chunks per kv head, chunk cap) overridden.
fn check_step_split(
    ctx: &Context,
    p: AttentionParams,
    split: Option<(u32, u32)>,
    pos: u32,
    pos_bound: u32,
    seed: u64,
) -> u32 {
    check_step_tile(ctx, p, split, TILE_LOADS, (pos, pos_bound), seed)
}

/// [`check_step_split`] with `tile_loads` cache loads per thread per tile.
fn check_step_tile(
    ctx: &Context,
    p: AttentionParams,
    split: Option<(u32, u32)>,
    tile_loads: u32,
    (pos, pos_bound): (u32, u32),
    seed: u64,
) -> u32 {
    let mut c = Case::new(p, seed);
    c.split = split;
    c.tile_loads = tile_loads;
    check_case(ctx, c, (pos, pos_bound))
}

/// The checks of [`check_step`] for a prepared case.
fn check_case(ctx: &Context, c: Case, at: (u32, u32)) -> u32 {
    check_case_with(ctx, &kernel(ctx, &c), c, at)
}

/// [`check_case`] on the compiled `k` (see [`run_with`]).
fn check_case_with(
    ctx: &Context,
    k: &AttentionKernel,
    c: Case,
    (pos, pos_bound): (u32, u32),
) -> u32 {
    let p = c.p;
    let o = run_with(ctx, k, &c, (pos, pos_bound), false, false);
    let what = format!("{p:?} pos {pos}");
    let (hq, hkv, d) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let (q_want, mut k_want) = rope_ref(&p, &c.qkv, &c.q_norm, &c.k_norm, pos);
    // An f16 cache holds the rounded row: the GPU's k may round to the neighbouring half where
    // the f32 value sits near a boundary (one f16 step, 2^-11 relative), v rounds alike.
    p.cache.round_all(&mut k_want);
    let (abs, rel) = match p.cache {
        CacheType::F32 => (2e-5, 1e-4),
        CacheType::F16 => (2e-5, 1e-3),
    };
    let mut v_want = c.qkv[(hq + hkv) * d..].to_vec();
    p.cache.round_all(&mut v_want);
    // The kernels norm and rope in workgroup memory: qkv stays raw (the trace reads it).
    assert_eq!(o.qkv, c.qkv, "{what}: qkv changed");
    let row = pos as usize * hkv * d..(pos as usize + 1) * hkv * d;
    assert_close(
        &o.k_cache[row.clone()],
        &k_want,
        abs,
        rel,
        &format!("{what}: k cache row"),
    );
    assert_eq!(o.v_cache[row.clone()], v_want, "{what}: v cache row");
    // Every other cache row is untouched.
    for (name, got, orig) in [("k", &o.k_cache, &c.k_cache), ("v", &o.v_cache, &c.v_cache)] {
        assert_eq!(
            got[..row.start],
            orig[..row.start],
            "{what}: {name} rows before pos"
        );
        assert_eq!(
            got[row.end..],
            orig[row.end..],
            "{what}: {name} rows after pos"
        );
    }
    // Attention over the reference q and the GPU's cache (row pos checked above) pins the
    // in-kernel q norm + RoPE and the attention itself.
    let want = attention_ref(&p, &q_want, &o.k_cache, &o.v_cache, pos);
    assert_close(&o.out, &want, 2e-5, 1e-4, &format!("{what}: attention out"));
    // And the chain from raw inputs matches the reference chain (q/k from the rope reference).
    let mut kc = c.k_cache.clone();
    kc[row.clone()].copy_from_slice(&k_want);
    let mut vc = c.v_cache.clone();
    vc[row].copy_from_slice(&v_want);
    let chain = attention_ref(&p, &q_want, &kc, &vc, pos);
    assert_close(
        &o.out,
        &chain,
        5e-5,
        2e-4 + rel,
        &format!("{what}: chained out"),
    );
    o.dispatches
}

#[test]
fn attention_small_gqa_4_2_d32_chunk16() {
    let Some(ctx) = gpu("attention_small_gqa_4_2_d32_chunk16") else {
        return;
    };
    let p = params(4, 2, 32, 512, 16);
    // 0 and 1: first chunk; 15/16: chunk boundary; 37, 300: several chunks.
    for (i, pos) in [0u32, 1, 15, 16, 37, 300].into_iter().enumerate() {
        check_step(&ctx, p, pos, pos, 10 + i as u64);
    }
}

/// The one-dispatch `single` variant (bound within the minimum chunk) and the chunk + combine
/// pair, at positions 0, 1, chunk - 1, chunk and several chunks + 1: G = 3 with odd head counts
/// and D/2 not a multiple of 4, G = 5 with one kv head, G = 1, G = 3 at D = 64, and G = 64 > WG/2
/// (the q/k norm reduction takes two passes of heads).
#[test]
fn attention_single_and_chunked_positions() {
    let Some(ctx) = gpu("attention_single_and_chunked_positions") else {
        return;
    };
    // (heads, kv_heads, head_dim, ctx, chunk)
    let shapes = [
        (6, 2, 36, 100, 7),
        (5, 1, 20, 64, 5),
        (3, 3, 8, 40, 4),
        (12, 4, 64, 96, 16),
        (64, 1, 4, 40, 4),
    ];
    for (i, (hq, hkv, d, n, chunk)) in shapes.into_iter().enumerate() {
        let p = params(hq, hkv, d, n, chunk);
        for (j, pos) in [0, 1, chunk - 1, chunk, 3 * chunk + 1]
            .into_iter()
            .enumerate()
        {
            let seed = 200 + 20 * i as u64 + 2 * j as u64;
            let tight = check_step(&ctx, p, pos, pos, seed);
            let want = if pos < chunk { 1 } else { 2 };
            assert_eq!(tight, want, "{p:?} pos {pos}: dispatches");
            // A loose bound takes the chunk + combine pair even when pos is in the first chunk.
            let loose = check_step(&ctx, p, pos, n - 1, seed + 1);
            assert_eq!(loose, 2, "{p:?} pos {pos} bound {}: dispatches", n - 1);
        }
    }
}

/// The fused combine (the last chunk workgroup of each kv head merges the partials) against
/// the reference at one chunk, a few and many (split overrides: up to 69 chunks per kv head),
/// with tight and loose bounds: always one dispatch (the chunk limit lifted). Each step runs three times on one scratch
/// with the output cleared between, so an arrival counter left non-zero fails the later runs.
#[test]
fn attention_fused_combine_matches_reference() {
    let Some(ctx) = gpu("attention_fused_combine_matches_reference") else {
        return;
    };
    // (heads, kv_heads, head_dim, ctx, chunk, split override)
    let shapes = [
        (6, 2, 36, 100, 7, None),
        (5, 1, 20, 64, 5, None),
        (64, 1, 4, 40, 4, None),
        (32, 4, 128, 384, 16, None),
        (8, 2, 32, 1100, 4, Some((64, 16))),
    ];
    for (i, (hq, hkv, d, n, chunk, split)) in shapes.into_iter().enumerate() {
        let p = params(hq, hkv, d, n, chunk);
        for (j, pos) in [0, chunk - 1, chunk, 3 * chunk + 1, n / 2, n - 1]
            .into_iter()
            .enumerate()
        {
            for (k, bound) in [pos, n - 1].into_iter().enumerate() {
                let mut c = Case::new(p, 500 + 40 * i as u64 + 4 * j as u64 + k as u64);
                c.split = split;
                c.merge = Combine::Fused;
                // Every chunk count of these shapes (up to 69 per kv head) on the fused form.
                c.fused_max = u32::MAX;
                c.repeats = 3;
                let disp = check_case(&ctx, c, (pos, bound));
                assert_eq!(disp, 1, "{p:?} pos {pos} bound {bound}: dispatches");
            }
        }
    }
    // Past the fused form's chunk limit the pair of dispatches takes over (and agrees).
    let p = params(6, 2, 36, 100, 7);
    for (pos, want) in [(6u32, 1u32), (7, 1), (13, 1), (14, 2), (99, 2)] {
        let mut c = Case::new(p, 700 + pos as u64);
        c.merge = Combine::Fused;
        c.fused_max = 2;
        assert_eq!(
            check_case(&ctx, c, (pos, pos)),
            want,
            "pos {pos}: dispatches"
        );
    }
}

/// An f16 cache (`CacheType::F16`): the step writes row pos as halves (k within one f16 step of
/// the rounded reference, v exactly the rounded raw v), reads every row, its own included, as
/// the cache holds it, and leaves the other rows alone; over the single, chunk + combine and
/// fused forms, prefetched and staged tiles, one to many chunks.
#[test]
fn attention_f16_cache_matches_reference() {
    let Some(ctx) = gpu("attention_f16_cache_matches_reference") else {
        return;
    };
    // (heads, kv_heads, head_dim, ctx, chunk, split override, tile loads)
    let shapes = [
        (6, 2, 36, 100, 7, None, TILE_LOADS),
        (32, 4, 128, 384, 16, None, TILE_LOADS),
        (8, 2, 32, 1100, 4, Some((64, 16)), 4),
    ];
    for (i, (hq, hkv, d, n, chunk, split, loads)) in shapes.into_iter().enumerate() {
        let p = AttentionParams {
            cache: CacheType::F16,
            ..params(hq, hkv, d, n, chunk)
        };
        for (j, pos) in [0, chunk - 1, chunk, 3 * chunk + 1, n - 1]
            .into_iter()
            .enumerate()
        {
            for (k, merge) in [Combine::Dispatch, Combine::Fused].into_iter().enumerate() {
                let mut c = Case::new(p, 900 + 40 * i as u64 + 4 * j as u64 + k as u64);
                c.split = split;
                c.tile_loads = loads;
                c.merge = merge;
                c.fused_max = u32::MAX;
                c.repeats = 2;
                check_case(&ctx, c, (pos, pos));
            }
        }
    }
}

#[test]
fn attention_qwen3_shape_32_4_d128() {
    let Some(ctx) = gpu("attention_qwen3_shape_32_4_d128") else {
        return;
    };
    let p = params(32, 4, 128, 384, 64);
    for (i, pos) in [0u32, 1, 37, 300].into_iter().enumerate() {
        check_step(&ctx, p, pos, pos, 20 + i as u64);
    }
    // A loose bound dispatches chunks past pos; they must exit without touching anything.
    check_step(&ctx, p, 37, 383, 30);
}

#[test]
fn attention_odd_group_and_chunk() {
    let Some(ctx) = gpu("attention_odd_group_and_chunk") else {
        return;
    };
    // G = 3 (not a power of two), D = 36, chunk 7, last position of the cache.
    let p = params(6, 2, 36, 100, 7);
    for (i, pos) in [0u32, 6, 7, 50, 99].into_iter().enumerate() {
        check_step(&ctx, p, pos, pos, 40 + i as u64);
    }
}

#[test]
fn attention_long_context_many_chunks() {
    let Some(ctx) = gpu("attention_long_context_many_chunks") else {
        return;
    };
    // 2048 positions in 32 chunks of 64 with the real GQA ratio (reduced head count).
    let p = params(8, 1, 128, 2048, 64);
    check_step(&ctx, p, 2047, 2047, 50);
}

/// The default split at Qwen3-30B-A3B's attention shape is the one measured (BENCHMARKS run
/// 25): 1024 workgroups, i.e. 256 chunks per kv head, 16-position chunks up to 4096 positions.
#[test]
fn attention_default_split_at_qwen3_shape() {
    let Some(ctx) = gpu("attention_default_split_at_qwen3_shape") else {
        return;
    };
    let k = AttentionKernel::new(&ctx, params(32, 4, 128, 8192, 16)).expect("kernel");
    let s = k.split();
    assert_eq!((s.target, s.min, s.tile), (256, 16, 16));
    assert_eq!(
        [64u32, 4096, 4097, 8192].map(|n| (s.chunk_len(n), s.chunks(n))),
        [(16, 4), (16, 256), (32, 129), (32, 256)]
    );
}

#[test]
fn attention_wider_tiles_match_reference() {
    let Some(ctx) = gpu("attention_wider_tiles_match_reference") else {
        return;
    };
    // G = 4, D = 32 (64-thread workgroups): 1, 4 and 8 loads per thread give tiles of 8, 32 and
    // 64 rows; one long chunk per kv head (target 1, cap 256) walks several tiles, the last one
    // partial, with the owning position in the first, a middle or the last tile.
    let p = params(8, 2, 32, 300, 16);
    for (i, loads) in [1u32, 4, 8].into_iter().enumerate() {
        for (j, pos) in [0u32, 9, 31, 32, 100, 255].into_iter().enumerate() {
            let seed = 70 + 10 * i as u64 + j as u64;
            check_step_tile(&ctx, p, Some((1, 256)), loads, (pos, pos), seed);
        }
        // And the default split (chunks + combine) at a long position.
        check_step_tile(&ctx, p, None, loads, (299, 299), 90 + i as u64);
    }
    // The real head shape: 4 loads per thread, a tile of 32 rows.
    let q = params(32, 4, 128, 200, 16);
    check_step_tile(&ctx, q, Some((1, 256)), 4, (150, 150), 95);
    assert!(AttentionKernel::with_split_tile(&ctx, p, None, 0).is_err());
    assert!(AttentionKernel::with_split_tile(&ctx, p, None, 17).is_err());
}

/// The V phase's two forms: where tiles of rows do not come in fours (`SC4` false: a 21-row tile at
/// D = 24, G = 2) the probabilities are read one by one, elsewhere four per load (every other
/// test's shapes); both against the scalar reference, over one chunk and over chunks + combine.
#[test]
fn attention_scalar_probability_loads_match_reference() {
    let Some(ctx) = gpu("attention_scalar_probability_loads_match_reference") else {
        return;
    };
    let p = params(4, 2, 24, 300, 16);
    let k = AttentionKernel::new(&ctx, p).unwrap();
    let split = k.split();
    assert_ne!(
        split.tile % 4,
        0,
        "this shape must take the one-by-one form"
    );
    for (j, pos) in [0u32, 20, 150, 299].into_iter().enumerate() {
        check_step_tile(&ctx, p, None, TILE_LOADS, (pos, pos), 110 + j as u64);
    }
    check_step_tile(&ctx, p, Some((1, 256)), TILE_LOADS, (100, 100), 115);
}

/// The split's host-side arithmetic: every position's chunks cover it exactly once, fit the
/// partial slots, and never exceed the dispatch bound of any larger position bound.
#[test]
fn attention_split_bounds_hold_for_every_position() {
    for split in [
        Split {
            target: 8,
            min: 4,
            max: 128,
            tile: 64,
            ctx: 1100,
        },
        Split {
            target: 128,
            min: 16,
            max: 256,
            tile: 16,
            ctx: 40960,
        },
        // The default at Qwen3's shapes (1024 workgroups over 4 kv heads), 16- and 32-row tiles.
        Split {
            target: 256,
            min: 16,
            max: 256,
            tile: 16,
            ctx: 40960,
        },
        Split {
            target: 256,
            min: 16,
            max: 256,
            tile: 32,
            ctx: 40960,
        },
        Split {
            target: 3,
            min: 7,
            max: 56,
            tile: 56,
            ctx: 500,
        },
        Split {
            target: 1,
            min: 5,
            max: 5,
            tile: 4,
            ctx: 33,
        },
    ] {
        let slots = split.slots();
        for n in 1..=split.ctx {
            let (len, nc) = (split.chunk_len(n), split.chunks(n));
            assert!(
                len >= split.min && len <= split.max,
                "{split:?} n {n}: len {len}"
            );
            assert!(
                (nc - 1) * len < n && nc * len >= n,
                "{split:?} n {n}: {nc} x {len}"
            );
            assert!(nc <= slots, "{split:?} n {n}: {nc} chunks > {slots} slots");
            for nb in [n, n + 1, n + 17, split.ctx] {
                let b = split.chunks_bound(nb.min(split.ctx));
                assert!(nc <= b, "{split:?} n {n} bound {nb}: {nc} > {b}");
            }
        }
    }
}

#[test]
fn attention_split_geometry_edges() {
    let Some(ctx) = gpu("attention_split_geometry_edges") else {
        return;
    };
    // G = 4, D = 32: 64-thread workgroups, tiles of 16 rows. Target 8 chunks per kv head, cap
    // 128: chunks of 4 up to n = 32, 3 x 16 at n = 33, 8 x 64 at n = 512, 80-long (5 tiles) at
    // n = 513, 8 x 128 at n = 1024, past the target (capped, 9 chunks) at n = 1025, a partial
    // last tile at n = 1100.
    let p = params(8, 2, 32, 1100, 4);
    let k = AttentionKernel::with_split(&ctx, p, Some((8, 128))).expect("kernel");
    let s = k.split();
    assert_eq!(
        [31u32, 32, 33, 511, 512, 513, 1024, 1025, 1100].map(|n| (s.chunk_len(n), s.chunks(n))),
        [
            (4, 8),
            (4, 8),
            (16, 3),
            (64, 8),
            (64, 8),
            (80, 7),
            (128, 8),
            (128, 9),
            (128, 9)
        ]
    );
    for (i, pos) in [30u32, 31, 32, 511, 512, 1024, 1099]
        .into_iter()
        .enumerate()
    {
        check_step_split(&ctx, p, Some((8, 128)), pos, pos, 80 + i as u64);
    }
    // A loose bound dispatches more chunks than the position uses; the rest must exit.
    check_step_split(&ctx, p, Some((8, 128)), 40, 1099, 90);
    // Qwen3 head dim with G = 16: two outputs per thread in the V sum, tiles of 16, chunks of
    // 16 / 32 / 64 (cap) and the default split too.
    let p = params(16, 1, 128, 400, 16);
    for (i, pos) in [63u32, 64, 250, 399].into_iter().enumerate() {
        check_step_split(&ctx, p, Some((4, 64)), pos, pos, 100 + i as u64);
    }
    check_step(&ctx, p, 399, 399, 110);
}

#[test]
fn attention_int8_output() {
    let Some(ctx) = gpu("attention_int8_output") else {
        return;
    };
    let p = params(32, 4, 128, 384, 64);
    // Position 0 would take the one-dispatch variant for an f32 output; the int8 copy needs the
    // combine, so both positions take two dispatches.
    for (pos, seed) in [(0u32, 60u64), (300, 61)] {
        check_int8_step(&ctx, p, pos, seed);
    }
}

/// One step with the int8 output: the f32 output matches the reference, the int8 copy matches
/// the quantisation reference of that output.
fn check_int8_step(ctx: &Context, p: AttentionParams, pos: u32, seed: u64) {
    let c = Case::new(p, seed);
    let o = run(ctx, &c, pos, pos, false, true);
    assert_eq!(
        o.dispatches, 2,
        "pos {pos}: int8 output without the combine"
    );
    let (q_roped, _) = rope_ref(&p, &c.qkv, &c.q_norm, &c.k_norm, pos);
    let want = attention_ref(&p, &q_roped, &o.k_cache, &o.v_cache, pos);
    assert_close(&o.out, &want, 2e-5, 1e-4, &format!("pos {pos}: f32 out"));
    let (words, scales) = o.out_q.expect("int8 output");
    let (q_want, s_want) = quantize_acts_ref(&o.out);
    for (b, (got, want)) in scales.iter().zip(&s_want).enumerate() {
        assert!(
            (got[0] - want[0]).abs() <= 1e-6 * want[0].abs(),
            "block {b} scale {got:?} vs {want:?}"
        );
    }
    let mut worst = 0f32;
    for (i, qw) in q_want.iter().enumerate() {
        let got = (words[i / 4] >> (8 * (i % 4))) as u8 as i8;
        // Round-half cases may land one step apart (1/d is computed on the GPU).
        assert!(
            (got as i32 - *qw as i32).abs() <= 1,
            "element {i}: q {got} vs {qw}"
        );
        let deq = got as f32 * scales[i / 32][0];
        worst = worst.max((deq - o.out[i]).abs() / scales[i / 32][0]);
    }
    // Each dequantised value is within half a step (plus rounding) of the f32 output.
    assert!(worst <= 0.5 + 1e-3, "int8 output off by {worst} steps");
    let sums_ok = scales.iter().enumerate().all(|(b, s)| {
        let sum: i32 = (0..32)
            .map(|j| (words[(b * 32 + j) / 4] >> (8 * (j % 4))) as u8 as i8 as i32)
            .sum();
        (s[1] - s[0] * sum as f32).abs() <= 1e-5 * s[0].abs() * 32.0 * 127.0
    });
    assert!(
        sums_ok,
        "block sums (d * Σq) do not match the packed values"
    );
}

#[test]
fn attention_done_flag_skips_everything() {
    let Some(ctx) = gpu("attention_done_flag_skips_everything") else {
        return;
    };
    let p = params(4, 2, 32, 64, 16);
    let c = Case::new(p, 70);
    // Bound 5: the single variant; bound 63: chunk + combine (pos 40 spans three chunks).
    for (pos, bound, dispatches) in [(5, 5, 1), (5, 63, 2), (40, 40, 2)] {
        let o = run(&ctx, &c, pos, bound, true, false);
        assert_eq!(o.dispatches, dispatches, "pos {pos} bound {bound}");
        assert_eq!(o.qkv, c.qkv, "qkv changed although done");
        assert_eq!(o.k_cache, c.k_cache, "k cache changed although done");
        assert_eq!(o.v_cache, c.v_cache, "v cache changed although done");
        assert!(
            o.out.iter().all(|v| *v == 0.0),
            "output written although done (pos {pos} bound {bound})"
        );
    }
}

#[test]
fn attention_rejects_bad_shapes() {
    let Some(ctx) = gpu("attention_rejects_bad_shapes") else {
        return;
    };
    for bad in [
        params(5, 2, 32, 64, 16),
        params(4, 2, 30, 64, 16),
        params(4, 2, 32, 0, 16),
    ] {
        let e = AttentionKernel::new(&ctx, bad).expect_err("bad shape accepted");
        assert!(matches!(e, GpuError::Shape(_)), "{bad:?}: {e}");
    }
    // A cache too small for ctx is refused at bind time.
    let p = params(4, 2, 32, 64, 16);
    let k = AttentionKernel::new(&ctx, p).unwrap();
    let small = ctx.storage("small", 64).unwrap();
    let ok = ctx.storage("ok", 1 << 16).unwrap();
    let scratch = k.scratch(&ctx).unwrap();
    let bufs = AttentionBuffers {
        state: &ok,
        qkv: &ok,
        q_norm: &ok,
        k_norm: &ok,
        k_cache: &small,
        v_cache: &ok,
        out: &ok,
        out_q: None,
    };
    let e = k
        .bind(&ctx, &bufs, &scratch)
        .expect_err("small cache accepted");
    assert!(e.to_string().contains("k_cache"), "{e}");
}

#[path = "attention_stream_tests.rs"]
mod stream;
