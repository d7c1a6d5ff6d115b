//! Lavapipe tests of the qkv + attention dispatch: against the scalar references (matvec,
//! q/k norm + RoPE, attention) and against the two dispatches it replaces (the norm-on-load
//! matvec and the chunk attention), whose bits the projection and the cache row must keep.

use super::*;
use crate::kernels::attention::{attention_ref, rope_ref};
use crate::kernels::attention::{AttentionBuffers, AttentionKernel, Combine};
use crate::kernels::matvec::{f32_rows_per_team, MatvecKernel};
use crate::kernels::norm::rmsnorm_ref;
use crate::numerics::Numerics;
use crate::testing::{
    assert_close, cache_bytes, dequant_q4_0, gpu, rand_f32, rand_q4_0, read_cache, rng,
};
use nibble_model::kv_cache::CacheType;

/// One layer's inputs on the host and the GPU.
struct Layer {
    p: AttentionParams,
    hidden: usize,
    deq: Vec<f32>,
    m: Q4Matrix,
    h: Vec<f32>,
    norm_w: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
}

fn params(heads: u32, kv_heads: u32, head_dim: u32, ctx: u32) -> AttentionParams {
    AttentionParams {
        heads,
        kv_heads,
        head_dim,
        ctx,
        chunk: 16,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        eps: 1e-6,
        cache: nibble_model::kv_cache::CacheType::F32,
    }
}

impl Layer {
    fn new(ctx: &Context, p: AttentionParams, hidden: usize, seed: u64) -> Layer {
        let mut r = rng(seed);
        let rows = ((p.heads + 2 * p.kv_heads) * p.head_dim) as usize;
        let wb = rand_q4_0(&mut r, rows, hidden);
        let cache = (p.ctx * p.kv_heads * p.head_dim) as usize;
        let d = p.head_dim as usize;
        // The host copies hold what a cache of the type holds.
        let cached = |v: Vec<f32>| {
            let mut v = v;
            p.cache.round_all(&mut v);
            v
        };
        Layer {
            p,
            hidden,
            deq: dequant_q4_0(&wb, rows, hidden),
            m: Q4Matrix::upload(ctx, "qkv.w", rows, hidden, 1, &[&wb]).unwrap(),
            // A residual stream far from unit scale (the norm must bring it back).
            h: rand_f32(&mut r, hidden, -20.0, 20.0),
            norm_w: rand_f32(&mut r, hidden, 0.5, 1.5),
            q_norm: rand_f32(&mut r, d, 0.5, 1.5),
            k_norm: rand_f32(&mut r, d, 0.5, 1.5),
            k_cache: cached(rand_f32(&mut r, cache, -1.5, 1.5)),
            v_cache: cached(rand_f32(&mut r, cache, -1.0, 1.0)),
        }
    }

    fn rows(&self) -> usize {
        self.deq.len() / self.hidden
    }
}

/// What one step left behind.
struct Out {
    qkv: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    att: Vec<f32>,
}

/// GPU copies of a layer's buffers, fresh per step.
struct Bufs {
    state: wgpu::Buffer,
    h: wgpu::Buffer,
    norm_w: wgpu::Buffer,
    q_norm: wgpu::Buffer,
    k_norm: wgpu::Buffer,
    k_cache: wgpu::Buffer,
    v_cache: wgpu::Buffer,
    qkv: wgpu::Buffer,
    att: wgpu::Buffer,
}

impl Bufs {
    fn new(ctx: &Context, l: &Layer, pos: u32, done: bool) -> Bufs {
        let f = |label: &str, v: &[f32]| ctx.storage_init(label, bytemuck::cast_slice(v)).unwrap();
        let c =
            |label: &str, v: &[f32]| ctx.storage_init(label, &cache_bytes(l.p.cache, v)).unwrap();
        let n_att = (l.p.heads * l.p.head_dim) as usize;
        Bufs {
            state: ctx
                .storage_init("state", bytemuck::cast_slice(&[pos, 0, done as u32, 0]))
                .unwrap(),
            h: f("h", &l.h),
            norm_w: f("norm_w", &l.norm_w),
            q_norm: f("q_norm", &l.q_norm),
            k_norm: f("k_norm", &l.k_norm),
            k_cache: c("k_cache", &l.k_cache),
            v_cache: c("v_cache", &l.v_cache),
            qkv: f("qkv", &vec![f32::NAN; l.rows()]),
            att: f("att", &vec![f32::NAN; n_att]),
        }
    }

    fn read(&self, ctx: &Context, l: &Layer) -> Out {
        Out {
            qkv: ctx.read_f32(&self.qkv, l.rows()).unwrap(),
            k_cache: read_cache(ctx, l.p.cache, &self.k_cache, l.k_cache.len()),
            v_cache: read_cache(ctx, l.p.cache, &self.v_cache, l.v_cache.len()),
            att: ctx
                .read_f32(&self.att, (l.p.heads * l.p.head_dim) as usize)
                .unwrap(),
        }
    }

    fn norm_input(&self) -> NormInput<'_> {
        NormInput {
            h: &self.h,
            weight: &self.norm_w,
            eps: 1e-6,
        }
    }
}

/// The fused step at `pos`, `repeats` times on the same arrival counters (the cache restored
/// and the outputs poisoned in between: the counters must be back at zero after each).
fn run_fused(
    ctx: &Context,
    k: &QkvAttentionKernel,
    l: &Layer,
    pos: u32,
    done: bool,
    repeats: u32,
) -> Out {
    let b = Bufs::new(ctx, l, pos, done);
    let arrive = k.arrivals(ctx).unwrap();
    let binding = k
        .bind(
            ctx,
            &QkvAttentionBuffers {
                m: &l.m,
                x: b.norm_input(),
                qkv: &b.qkv,
                q_norm: &b.q_norm,
                k_norm: &b.k_norm,
                k_cache: &b.k_cache,
                v_cache: &b.v_cache,
                out: &b.att,
                arrive: &arrive,
                state: &b.state,
            },
        )
        .unwrap();
    for r in 0..repeats {
        if r > 0 {
            ctx.write(&b.k_cache, 0, &cache_bytes(l.p.cache, &l.k_cache));
            ctx.write(&b.v_cache, 0, &cache_bytes(l.p.cache, &l.v_cache));
            ctx.write(&b.qkv, 0, bytemuck::cast_slice(&vec![f32::NAN; l.rows()]));
            let n_att = (l.p.heads * l.p.head_dim) as usize;
            ctx.write(&b.att, 0, bytemuck::cast_slice(&vec![f32::NAN; n_att]));
        }
        ctx.run_pass(|pass| k.record(pass, &binding)).unwrap();
    }
    let counts = ctx.read_u32(&arrive, l.p.kv_heads as usize).unwrap();
    assert!(
        counts.iter().all(|c| *c == 0),
        "arrival counters {counts:?}"
    );
    b.read(ctx, l)
}

/// The kernels of one shape: the fused one and the two it replaces (the norm-on-load matvec,
/// late norm, `r` rows per team, and the chunk attention), compiled once.
struct Kernels {
    fused: QkvAttentionKernel,
    mv: MatvecKernel,
    attn: AttentionKernel,
}

impl Kernels {
    fn new(ctx: &Context, l: &Layer, r: u32, max_positions: u32) -> Kernels {
        let p = l.p;
        Kernels {
            fused: QkvAttentionKernel::new(ctx, p, r, true, max_positions)
                .unwrap()
                .unwrap_or_else(|| panic!("{p:?}: no fused form on a device that publishes")),
            mv: MatvecKernel::with_options(ctx, Numerics::F32, true)
                .unwrap()
                .with_rows_per_team(l.rows() as u32, Some(r)),
            attn: AttentionKernel::new(ctx, p)
                .unwrap()
                .with_combine(Combine::for_context(ctx)),
        }
    }
}

/// The two dispatches the fused one replaces.
fn run_separate(ctx: &Context, ks: &Kernels, l: &Layer, pos: u32) -> Out {
    let b = Bufs::new(ctx, l, pos, false);
    let (mv, ak) = (&ks.mv, &ks.attn);
    let mb = mv
        .bind_q4_norm(ctx, &l.m, b.norm_input(), &b.qkv, &b.state)
        .unwrap();
    let scratch = ak.scratch(ctx).unwrap();
    let ab = ak
        .bind(
            ctx,
            &AttentionBuffers {
                state: &b.state,
                qkv: &b.qkv,
                q_norm: &b.q_norm,
                k_norm: &b.k_norm,
                k_cache: &b.k_cache,
                v_cache: &b.v_cache,
                out: &b.att,
                out_q: None,
            },
            &scratch,
        )
        .unwrap();
    ctx.run_pass(|pass| {
        mv.record(pass, &mb);
        ak.record(pass, &ab, pos);
    })
    .unwrap();
    b.read(ctx, l)
}

/// Every check of one step at `pos` (the kernels' rows per team `r`).
fn check(ctx: &Context, ks: &Kernels, l: &Layer, r: u32, pos: u32) {
    let p = l.p;
    let what = format!("{p:?} hidden {} rows/team {r} pos {pos}", l.hidden);
    assert!(ks.fused.serves(pos), "{what}: bound");
    let got = run_fused(ctx, &ks.fused, l, pos, false, 2);
    let sep = run_separate(ctx, ks, l, pos);
    // The projection is the matvec's, bit for bit, and matches the reference.
    assert_eq!(got.qkv, sep.qkv, "{what}: qkv against the matvec");
    let (_, xn) = rmsnorm_ref(&l.h, None, &l.norm_w, 1e-6);
    let rows = l.rows();
    let want_qkv: Vec<f32> = (0..rows)
        .map(|i| {
            let w = &l.deq[i * l.hidden..(i + 1) * l.hidden];
            w.iter()
                .zip(&xn)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect();
    assert_close(&got.qkv, &want_qkv, 1e-4, 1e-4, &format!("{what}: qkv"));
    // The cache row is the chunk kernel's (same code), and nothing else moved.
    assert_eq!(
        got.k_cache, sep.k_cache,
        "{what}: k cache against the chunk kernel"
    );
    assert_eq!(
        got.v_cache, sep.v_cache,
        "{what}: v cache against the chunk kernel"
    );
    let (hq, hkv, d) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let (q_want, mut k_want) = rope_ref(&p, &got.qkv, &l.q_norm, &l.k_norm, pos);
    // An f16 cache holds rounded rows: k within one f16 step of the rounded reference.
    p.cache.round_all(&mut k_want);
    let rel = match p.cache {
        CacheType::F32 => 1e-4,
        CacheType::F16 => 1e-3,
    };
    let mut v_want = got.qkv[(hq + hkv) * d..].to_vec();
    p.cache.round_all(&mut v_want);
    let row = pos as usize * hkv * d..(pos as usize + 1) * hkv * d;
    assert_close(
        &got.k_cache[row.clone()],
        &k_want,
        2e-5,
        rel,
        &format!("{what}: k row"),
    );
    assert_eq!(got.v_cache[row.clone()], v_want, "{what}: v row");
    assert_eq!(
        got.k_cache[..row.start],
        l.k_cache[..row.start],
        "{what}: k before"
    );
    assert_eq!(
        got.k_cache[row.end..],
        l.k_cache[row.end..],
        "{what}: k after"
    );
    assert_eq!(
        got.v_cache[..row.start],
        l.v_cache[..row.start],
        "{what}: v before"
    );
    assert_eq!(
        got.v_cache[row.end..],
        l.v_cache[row.end..],
        "{what}: v after"
    );
    // The output against the f64 reference over the written cache, and the chunk kernel.
    let want = attention_ref(&p, &q_want, &got.k_cache, &got.v_cache, pos);
    assert_close(&got.att, &want, 2e-5, 1e-4, &format!("{what}: attention"));
    assert_close(
        &got.att,
        &sep.att,
        2e-5,
        1e-4,
        &format!("{what}: against the chunks"),
    );
}

#[test]
fn qkv_attention_matches_references_and_the_two_dispatches() {
    let Some(ctx) = gpu("qkv_attention_matches_references_and_the_two_dispatches") else {
        return;
    };
    if !ctx.publishes_across_workgroups() {
        eprintln!("skipped: the device cannot publish across workgroups (not Vulkan)");
        return;
    }
    // (heads, kv heads, head dim, hidden, cache rows): the tiny model's shape (G 2), Qwen3's
    // heads at a small hidden (G 8, 4 rows per team), an odd group (G 3, D 24) and G 1.
    let shapes = [
        (4, 2, 32, 64, 300),
        (32, 4, 128, 256, 270),
        (6, 2, 24, 96, 80),
        (8, 8, 16, 32, 40),
    ];
    for (i, &(hq, hkv, d, hidden, cache)) in shapes.iter().enumerate() {
        let l = Layer::new(&ctx, params(hq, hkv, d, cache), hidden, 40 + i as u64);
        let r = f32_rows_per_team(l.rows() as u32);
        let ks = Kernels::new(&ctx, &l, r, MEASURED_MAX_POSITIONS);
        let last = (cache - 1).min(MEASURED_MAX_POSITIONS - 1);
        assert_eq!(ks.fused.max_positions(), last + 1);
        for pos in [0, 1, 6, 37, last] {
            check(&ctx, &ks, &l, r, pos);
        }
    }
    // An f16 cache: the same bits as the chunk kernel's f16 form (row pos written as halves,
    // read back through them), at Qwen3's heads.
    let f16 = AttentionParams {
        cache: CacheType::F16,
        ..params(32, 4, 128, 270)
    };
    let l = Layer::new(&ctx, f16, 256, 60);
    let r = f32_rows_per_team(l.rows() as u32);
    let ks = Kernels::new(&ctx, &l, r, MEASURED_MAX_POSITIONS);
    for pos in [0, 5, 200] {
        check(&ctx, &ks, &l, r, pos);
    }
    // Every rows-per-team form whose workgroups stay within one head (8 r divides D).
    let l = Layer::new(&ctx, params(32, 4, 128, 64), 128, 50);
    for r in [1, 2] {
        check(&ctx, &Kernels::new(&ctx, &l, r, 64), &l, r, 21);
    }
}

#[test]
fn qkv_attention_done_flag_bound_and_unsupported_shapes() {
    let Some(ctx) = gpu("qkv_attention_done_flag_bound_and_unsupported_shapes") else {
        return;
    };
    if !ctx.publishes_across_workgroups() {
        eprintln!("skipped: the device cannot publish across workgroups (not Vulkan)");
        return;
    }
    let p = params(4, 2, 32, 64);
    let l = Layer::new(&ctx, p, 64, 60);
    let k = QkvAttentionKernel::new(&ctx, p, 1, true, 16)
        .unwrap()
        .unwrap();
    assert_eq!(k.max_positions(), 16);
    assert!(k.serves(15) && !k.serves(16));
    // Done: a no-op that leaves the counters at zero (run_fused checks them).
    let got = run_fused(&ctx, &k, &l, 5, true, 1);
    assert!(
        got.att.iter().all(|v| v.is_nan()),
        "done flag: output written"
    );
    assert!(got.qkv.iter().all(|v| v.is_nan()), "done flag: qkv written");
    assert_eq!(got.k_cache, l.k_cache, "done flag: cache written");
    // The bound never passes the cache.
    let k = QkvAttentionKernel::new(&ctx, p, 1, true, 1000)
        .unwrap()
        .unwrap();
    assert_eq!(k.max_positions(), 64);
    // Rows of one workgroup across two kv heads (8 rows per workgroup, D 20): no fused form.
    assert!(
        QkvAttentionKernel::new(&ctx, params(4, 2, 20, 64), 1, true, 16)
            .unwrap()
            .is_none()
    );
    // Bad arguments are errors.
    assert!(QkvAttentionKernel::new(&ctx, p, 3, true, 16).is_err());
    assert!(QkvAttentionKernel::new(&ctx, p, 1, true, 0).is_err());
    // A matrix of the wrong shape or buffers too small: clear errors at binding.
    let b = Bufs::new(&ctx, &l, 0, false);
    let arrive = k.arrivals(&ctx).unwrap();
    let other = Layer::new(&ctx, params(4, 1, 32, 64), 64, 61);
    let short = ctx.storage("short", 4).unwrap();
    let bufs = QkvAttentionBuffers {
        m: &other.m,
        x: b.norm_input(),
        qkv: &b.qkv,
        q_norm: &b.q_norm,
        k_norm: &b.k_norm,
        k_cache: &b.k_cache,
        v_cache: &b.v_cache,
        out: &b.att,
        arrive: &arrive,
        state: &b.state,
    };
    let e = k.bind(&ctx, &bufs).unwrap_err().to_string();
    assert!(e.contains("rows"), "{e}");
    let e = k
        .bind(
            &ctx,
            &QkvAttentionBuffers {
                m: &l.m,
                k_cache: &short,
                ..bufs
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("k_cache"), "{e}");
}
