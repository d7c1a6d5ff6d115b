//! The decode step's kernels, buffers and bindings built like `DecodePlan` builds them (same
//! buffer chaining: qkv matvec -> attention -> o matvec -> add+norm -> router -> MoE -> h), but
//! with per-layer weights and KV caches as `layers` GPU copies and one bind group per layer, so
//! each kernel can be timed alone and the whole step can be recorded too.

use crate::fixtures::{copies, f32_copies, no_parts, q4_copies, rand_buf};
use nibble_gpu::context::{Context, Result};
use nibble_gpu::kernels::argmax::{ArgmaxArgs, ArgmaxBinding, ArgmaxKernel};
use nibble_gpu::kernels::attention::{
    AttentionBinding, AttentionBuffers, AttentionKernel, AttentionParams, AttentionScratch,
    AttnForm, ChunkShape, Combine, FUSED_MAX_CHUNKS,
};
use nibble_gpu::kernels::embed::{EmbedBinding, EmbedKernel};
use nibble_gpu::kernels::matvec::{
    Act, BfpQuantBinding, BfpQuantKernel, MatvecBinding, MatvecKernel, NormInput, QuantizeKernel,
};
use nibble_gpu::kernels::moe::{
    F32Tuning, MoeBinding, MoeBuffers, MoeFolded, MoeKernel, MoeParams, Routing,
};
use nibble_gpu::kernels::norm::{RmsNormArgs, RmsNormBinding, RmsNormKernel};
use nibble_gpu::kernels::qkv_attention::{
    QkvAttentionBinding, QkvAttentionBuffers, QkvAttentionKernel,
};
use nibble_gpu::numerics::BfpActs;
use nibble_gpu::state::RunState;
use nibble_gpu::tensor::{Q4Matrix, QuantActs};
use nibble_gpu::Numerics;
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::kv_cache::CacheType;
use rand::Rng;

/// An f32 activation `[n]` and its quantised copy in every [`Numerics`] form (ALL order).
pub struct ActSet {
    pub f: wgpu::Buffer,
    q: Vec<Option<QuantActs>>,
}

fn ix(n: Numerics) -> usize {
    Numerics::ALL.iter().position(|m| *m == n).unwrap_or(0)
}

impl ActSet {
    /// Random values in ±1, quantised on the GPU into every form.
    fn new(
        ctx: &Context,
        quant: &QuantizeKernel,
        rng: &mut impl Rng,
        n: usize,
        st: &wgpu::Buffer,
    ) -> Result<ActSet> {
        let f = rand_buf(ctx, "bench.act", rng, n, -1.0, 1.0)?;
        let q = Numerics::ALL
            .into_iter()
            .map(|nm| QuantActs::for_numerics(ctx, "bench.act", n, nm))
            .collect::<Result<Vec<_>>>()?;
        for qa in q.iter().flatten() {
            let b = quant.bind(ctx, &f, qa, st)?;
            ctx.run_pass(|p| quant.record(p, &b))?;
        }
        Ok(ActSet { f, q })
    }

    pub fn act(&self, n: Numerics) -> Act<'_> {
        match &self.q[ix(n)] {
            Some(q) => Act::Int8(q),
            None => Act::F32(&self.f),
        }
    }

    pub fn quant(&self, n: Numerics) -> Option<&QuantActs> {
        self.q[ix(n)].as_ref()
    }
}

/// MoE bindings of one numerics form, one per routing slot.
pub struct MoeSet {
    pub kernel: MoeKernel,
    /// gate/up + down, as the plan records them.
    pub full: Vec<MoeBinding>,
    /// gate/up alone and down alone (`None` if the kernel refuses a matrix without parts).
    pub split: Option<(Vec<MoeBinding>, Vec<MoeBinding>)>,
    /// The single-token plan's form (router folded into the o-proj, kernels/router_fold.rs):
    /// gate/up normalising `h + a` on load and routing on `z / rms(h + a)`, then down; and
    /// that gate/up alone. `None` where the kernel has no folded form (the int8 numerics).
    pub folded: Option<(Vec<MoeBinding>, Vec<MoeBinding>)>,
}

/// Everything one decode step uses (shapes from `cfg`; `L` = `layers` copies).
pub struct Bench {
    pub ctx: Context,
    pub numerics: Numerics,
    pub layers: usize,
    pub state: wgpu::Buffer,
    pub matvec: MatvecKernel,
    pub quantize: QuantizeKernel,
    pub norm: RmsNormKernel,
    pub embed: EmbedKernel,
    pub argmax: ArgmaxKernel,
    pub attn: AttentionKernel,
    /// `[H]` normalised hidden (+ quantised), `[Q]` attention out, `[K*I]` expert hidden.
    pub xn: ActSet,
    pub att: ActSet,
    pub moe_h: ActSet,
    /// `[Q + 2 KV]`, `[H]`, `[V]` outputs.
    pub qkv_out: wgpu::Buffer,
    pub a: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    /// Weights per layer (>= L copies) and shared (experts, head / embedding table).
    pub qkv_w: Vec<Q4Matrix>,
    pub o_w: Vec<Q4Matrix>,
    pub head_w: Q4Matrix,
    /// Bindings per layer in the plan's numerics.
    pub qkv_b: Vec<MatvecBinding>,
    /// The qkv matvec as the f32 plan binds it: RMSNorm of the residual stream on load (empty
    /// for the int8 numerics, whose plan keeps a norm dispatch).
    pub qkv_nol_b: Vec<MatvecBinding>,
    pub o_b: Vec<MatvecBinding>,
    pub router_b: Vec<MatvecBinding>,
    pub attn_b: Vec<AttentionBinding>,
    /// One chunk per kv head while it fits (256 positions): single dispatch, 4 workgroups.
    pub attn_one: AttentionKernel,
    pub attn_one_b: Vec<AttentionBinding>,
    /// Other splits and tiles: (label, kernel, scratch, bindings).
    pub attn_many: Vec<(
        &'static str,
        AttentionKernel,
        AttentionScratch,
        Vec<AttentionBinding>,
    )>,
    /// The qkv + attention dispatch (the f32 plan's form below position 256, Vulkan) whole
    /// and cut short (ablations): (label, kernel, bindings per layer copy).
    pub qkv_attn: Vec<(&'static str, QkvAttentionKernel, Vec<QkvAttentionBinding>)>,
    pub head_b: MatvecBinding,
    /// The lm_head of `--tune head=3`: rmsnorm(h) converted to bfp24 once, then the matvec
    /// reading those blocks (f32 plans only); the last binding is head=4's matvec (two rows
    /// per team, the plan's default).
    pub head_bfp: Option<(
        BfpQuantKernel,
        BfpQuantBinding,
        MatvecBinding,
        MatvecBinding,
    )>,
    /// rmsnorm(+quant), add+rmsnorm(+quant), plain rmsnorm.
    pub norm_b: [RmsNormBinding; 3],
    pub embed_b: EmbedBinding,
    pub argmax_b: ArgmaxBinding,
    /// One per numerics form (ALL order); routing slots with random logits.
    pub moe: Vec<MoeSet>,
    /// The staged f32 MoE built with other work splits (`--moe-tunings`), for a sweep.
    pub moe_tuned: Vec<(F32Tuning, MoeSet)>,
    /// The plan's MoE binding reading the router output (for the whole step).
    pub moe_step: MoeBinding,
    _keep: Vec<wgpu::Buffer>,
    _scratch: AttentionScratch,
    _scratch_one: AttentionScratch,
}

impl Bench {
    /// Build it all; `ctx_len` KV rows, `max_calls` the most argmax calls per pass. Dense
    /// per-layer matrices get at least `min_copies` copies (`layers`, or 1 for `--hot`) and enough to span `working_set` bytes
    /// (small ones like the 1 MB router would otherwise stay in L2 across 48 copies).
    pub fn new(
        ctx: &Context,
        cfg: &Qwen3MoeConfig,
        numerics: Numerics,
        (ctx_len, max_calls, working_set, min_copies): (usize, u32, u64, usize),
        moe_tunings: &[F32Tuning],
        rng: &mut impl Rng,
    ) -> anyhow::Result<Bench> {
        let l = cfg.num_layers;
        let n_copies =
            |bytes: usize| (working_set.div_ceil(bytes as u64) as usize).clamp(min_copies, 1024);
        let (h, q, kv) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let (e, k, i, v) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.vocab_size,
        );
        let state = RunState::default().buffer(ctx)?;
        let st = &state;
        let quantize = QuantizeKernel::new(ctx)?;
        let f32s = |label: &str, n: usize| ctx.storage(label, n as u64 * 4);
        let hbuf = rand_buf(ctx, "h", rng, h, -1.0, 1.0)?;
        let xn = ActSet::new(ctx, &quantize, rng, h, st)?;
        let att = ActSet::new(ctx, &quantize, rng, q, st)?;
        let moe_h = ActSet::new(ctx, &quantize, rng, k * i, st)?;
        let (qkv_out, a) = (
            rand_buf(ctx, "qkv", rng, q + 2 * kv, -1.0, 1.0)?,
            f32s("a", h)?,
        );
        let (router_out, logits) = (f32s("router", e)?, f32s("logits", v)?);
        // KB_MATVEC=bfp24: the int4 x f32 matvec rows multiply in bfp24 (the product forms
        // compared side by side; the default keeps f32). The norm-on-load form scales late, as
        // the plan's does (`Tune::late_norm`), so the "as plan" row is the plan's kernel;
        // KB_LATE_NORM=0 gives the norm-first form.
        let mv = std::env::var("KB_MATVEC").unwrap_or_else(|_| "f32".into());
        let mv = mv.parse::<Numerics>().unwrap_or(Numerics::F32);
        let late = std::env::var("KB_LATE_NORM").map_or(true, |v| v != "0");
        let matvec = MatvecKernel::with_options(ctx, mv, late)?;
        let qkv_w = q4_copies(ctx, rng, (q + 2 * kv, h, 1), n_copies((q + 2 * kv) * h / 2))?;
        let o_w = q4_copies(ctx, rng, (h, q, 1), n_copies(h * q / 2))?;
        let router_w = f32_copies(ctx, rng, e, h, 0.05, n_copies(e * h * 4))?;
        let head_w = q4_copies(ctx, rng, (v, h, 1), 1)?.remove(0);
        let x = xn.act(numerics);
        let qkv_b = qkv_w
            .iter()
            .map(|m| matvec.bind_q4(ctx, m, x, &qkv_out, st))
            .collect::<Result<Vec<_>>>()?;
        let norm_w = rand_buf(ctx, "norm_w", rng, h, 0.5, 1.5)?;
        let nol = NormInput {
            h: &hbuf,
            weight: &norm_w,
            eps: cfg.rms_norm_eps,
        };
        let head_bfp = match numerics {
            Numerics::F32 => {
                let qk = BfpQuantKernel::new(ctx)?;
                let xb = BfpActs::new(ctx, "bench.xb", h as u32)?;
                let qb = qk.bind(ctx, nol, &xb, st)?;
                let mb = matvec.bind_q4(ctx, &head_w, Act::Bfp(&xb), &logits, st)?;
                let mb2 = matvec.bind_q4_with(ctx, &head_w, Act::Bfp(&xb), &logits, st, 2)?;
                Some((qk, qb, mb, mb2))
            }
            _ => None,
        };
        let qkv_nol_b = match numerics {
            Numerics::F32 => qkv_w
                .iter()
                .map(|m| matvec.bind_q4_norm(ctx, m, nol, &qkv_out, st))
                .collect::<Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        let o_b = o_w
            .iter()
            .map(|m| matvec.bind_q4(ctx, m, att.act(numerics), &a, st))
            .collect::<Result<Vec<_>>>()?;
        let router_b = router_w
            .iter()
            .map(|m| matvec.bind_f32(ctx, m, &xn.f, &router_out, st))
            .collect::<Result<Vec<_>>>()?;
        let head_b = matvec.bind_q4(ctx, &head_w, x, &logits, st)?;
        // Run the head once so argmax sees real logits.
        ctx.run_pass(|p| matvec.record(p, &head_b))?;

        let attn = AttentionKernel::new(
            ctx,
            AttentionParams::from_config(cfg, ctx_len, CacheType::F32)?,
        )?;
        let scratch = attn.scratch(ctx)?;
        let d = cfg.head_dim;
        let (q_norm, k_norm) = (
            rand_buf(ctx, "q_norm", rng, d, 0.5, 1.5)?,
            rand_buf(ctx, "k_norm", rng, d, 0.5, 1.5)?,
        );
        // One cache per layer (`--hot`: one for all, read from L2 once warm).
        let k_cache = copies(
            ctx,
            rand_buf(ctx, "k_cache", rng, ctx_len * kv, -1.0, 1.0)?,
            min_copies,
        )?;
        let v_cache = copies(
            ctx,
            rand_buf(ctx, "v_cache", rng, ctx_len * kv, -1.0, 1.0)?,
            min_copies,
        )?;
        let bind_attn = |attn: &AttentionKernel, scratch: &AttentionScratch| {
            (0..l)
                .map(|j| {
                    let bufs = AttentionBuffers {
                        state: st,
                        qkv: &qkv_out,
                        q_norm: &q_norm,
                        k_norm: &k_norm,
                        k_cache: &k_cache[j % k_cache.len()],
                        v_cache: &v_cache[j % v_cache.len()],
                        out: &att.f,
                        out_q: att.quant(numerics),
                    };
                    attn.bind(ctx, &bufs, scratch)
                })
                .collect::<Result<Vec<_>>>()
        };
        let attn_b = bind_attn(&attn, &scratch)?;
        // One chunk per kv head up to 256 positions (no combine): the alternative split.
        let attn_one = AttentionKernel::with_split(
            ctx,
            AttentionParams::from_config(cfg, ctx_len, CacheType::F32)?,
            Some((1, 256)),
        )?;
        let scratch_one = attn_one.scratch(ctx)?;
        let attn_one_b = bind_attn(&attn_one, &scratch_one)?;
        // Other splits and tiles (the default aims at 1024 workgroups, 256 chunks per kv head
        // at Qwen3's 4 kv heads, tiles of 2 loads per thread): 128 and 512 chunks per kv head,
        // tiles of 4 and 8 loads per thread.
        // The combine as its own dispatch or fused into the chunks (the default on Vulkan).
        let mut attn_many = Vec::new();
        let other = match attn.combine() {
            Combine::Fused => ("combine dispatch", Combine::Dispatch),
            Combine::Dispatch => ("combine fused", Combine::Fused),
        };
        let dflt = (attn.combine(), FUSED_MAX_CHUNKS);
        let tiles = |tile_loads| ChunkShape {
            tile_loads,
            ..ChunkShape::default()
        };
        let stream = |tile_loads, v_rows| ChunkShape {
            form: AttnForm::Stream,
            tile_loads,
            v_rows,
        };
        // The streamed form (attention_stream.wgsl) at the default split and at fewer, longer
        // chunks (256 and 128 workgroups: 64 and 32 chunks per kv head at Qwen3's shapes), with
        // key blocks of 4 and 8 loads per thread and V batches of 4 and 8 rows; the tiled form at
        // 256 workgroups with 8 loads per thread (BENCHMARKS run 174's best) beside them.
        for (label, over, shape, (merge, fused_max)) in [
            (other.0, None, tiles(2), (other.1, FUSED_MAX_CHUNKS)),
            (
                "combine fused, any chunk count",
                None,
                tiles(2),
                (Combine::Fused, u32::MAX),
            ),
            ("128 chunks/kv head", Some((128u32, 256u32)), tiles(2), dflt),
            ("512 chunks/kv head", Some((512, 256)), tiles(2), dflt),
            ("tiles of 4 loads/thread", None, tiles(4), dflt),
            ("tiles of 8 loads/thread", None, tiles(8), dflt),
            (
                "64 chunks/kv head, tiles of 8",
                Some((64, 256)),
                tiles(8),
                dflt,
            ),
            ("streamed 8/4", None, stream(8, 4), dflt),
            (
                "streamed 8/4, 64 chunks/kv head",
                Some((64, 256)),
                stream(8, 4),
                dflt,
            ),
            (
                "streamed 8/4, 32 chunks/kv head",
                Some((32, 256)),
                stream(8, 4),
                dflt,
            ),
            (
                "streamed 4/4, 64 chunks/kv head",
                Some((64, 256)),
                stream(4, 4),
                dflt,
            ),
            (
                "streamed 8/8, 64 chunks/kv head",
                Some((64, 256)),
                stream(8, 8),
                dflt,
            ),
            (
                "streamed 8/8, 32 chunks/kv head",
                Some((32, 256)),
                stream(8, 8),
                dflt,
            ),
        ] {
            let params = AttentionParams::from_config(cfg, ctx_len, CacheType::F32)?;
            let Ok(k) = AttentionKernel::with_shape(ctx, params, over, shape) else {
                continue; // e.g. a tile past this device's workgroup memory
            };
            let k = k.with_combine(merge).with_fused_max_chunks(fused_max);
            let sc = k.scratch(ctx)?;
            let b = bind_attn(&k, &sc)?;
            attn_many.push((label, k, sc, b));
        }

        // The qkv + attention dispatch as the plan builds it (4 rows per team at Qwen3's qkv),
        // and cut after the matvec and its arrival count, after the norm + RoPE + KV write,
        // after the scores, after the softmax.
        let qkv_arrive = ctx.storage("qkv_attention.arrive", cfg.num_kv_heads as u64 * 4)?;
        let mut qkv_attn = Vec::new();
        // "loop": the score row's loads as a runtime loop over groups of 8 vec4 (fewer
        // registers than the written-out row: does the tail's register count slow the kernel?).
        let (g, d4) = (cfg.num_heads / cfg.num_kv_heads, cfg.head_dim / 4);
        let score_loop = {
            let mut b = String::from("for (var d0 = 0u; d0 < D4; d0 += 8u) {\n");
            for i in 0..8 {
                b += &format!("let k{i} = k_cache[row + d0 + {i}u];\n");
            }
            for i in 0..8 {
                for j in 0..g {
                    b += &format!("s{j} += dot(nol_xs[{}u + d0 + {i}u], k{i});\n", j * d4);
                }
            }
            b + "}\n"
        };
        let cut = |mark: &'static str| {
            let score_loop = score_loop.clone();
            move |s: String| match mark {
                "" => s,
                "loop" if d4 % 8 == 0 => {
                    let (a, rest) = s.split_once("//@SCORE_BEGIN").unwrap_or((&s, ""));
                    let (_, b) = rest.split_once("//@SCORE_END").unwrap_or(("", rest));
                    format!("{a}{score_loop}{b}")
                }
                "loop" => s,
                m => s.replace(m, "return;"),
            }
        };
        for (label, mark) in [
            ("", ""),
            (" (score row as a loop of 8-load groups)", "loop"),
            (" (matvec + arrival count only)", "//@STOP_START"),
            (" (cut after norm+rope+kv write)", "//@STOP_ROPE"),
            (" (cut after scores)", "//@STOP_SCORES"),
            (" (cut after softmax)", "//@STOP_SOFTMAX"),
        ] {
            if numerics != Numerics::F32 {
                break;
            }
            let params = AttentionParams::from_config(cfg, ctx_len, CacheType::F32)?;
            let rpt = matvec.rows_per_team((q + 2 * kv) as u32);
            let Some(k) =
                QkvAttentionKernel::with_source_edit(ctx, params, rpt, late, 256, &cut(mark))?
            else {
                break;
            };
            let binds = qkv_w
                .iter()
                .zip(k_cache.iter().cycle().zip(v_cache.iter().cycle()))
                .map(|(m, (kc, vc))| {
                    k.bind(
                        ctx,
                        &QkvAttentionBuffers {
                            m,
                            x: nol,
                            qkv: &qkv_out,
                            q_norm: &q_norm,
                            k_norm: &k_norm,
                            k_cache: kc,
                            v_cache: vc,
                            out: &att.f,
                            arrive: &qkv_arrive,
                            state: st,
                        },
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            qkv_attn.push((label, k, binds));
        }

        let norm = RmsNormKernel::new(ctx)?;
        let w = rand_buf(ctx, "norm_w", rng, h, 0.5, 1.5)?;
        let nb = |add: Option<&wgpu::Buffer>, quant: Option<&QuantActs>| {
            let args = RmsNormArgs {
                h: &hbuf,
                add,
                weight: &w,
                out: &xn.f,
                quant,
                n: h as u32,
                eps: cfg.rms_norm_eps,
            };
            norm.bind(ctx, &args, st)
        };
        let norm_b = [
            nb(None, xn.quant(numerics))?,
            nb(Some(&a), xn.quant(numerics))?,
            nb(None, None)?,
        ];
        let embed = EmbedKernel::new(ctx)?;
        let embed_b = embed.bind(ctx, &head_w, &hbuf, st)?;
        let argmax = ArgmaxKernel::new(ctx)?;
        let out_tokens = ctx.storage("out_tokens", max_calls as u64 * 4)?;
        let argmax_b = argmax.bind(
            ctx,
            &ArgmaxArgs {
                logits: &logits,
                n: v as u32,
                state: st,
                out_tokens: &out_tokens,
                max_steps: max_calls,
                eos: &[],
            },
        )?;

        // MoE: one copy of the experts, `l` routing slots (random logits and an initial route
        // of distinct experts) so consecutive calls read different experts, as layers do.
        let mp = MoeParams::from_config(cfg)?;
        let gate = q4_copies(ctx, rng, (e * i, h, i), 1)?.remove(0);
        let up = q4_copies(ctx, rng, (e * i, h, i), 1)?.remove(0);
        let down = q4_copies(ctx, rng, (e * h, i, h), 1)?.remove(0);
        let (none_gu, none_d) = (
            no_parts((e * i) as u32, h as u32),
            no_parts((e * h) as u32, i as u32),
        );
        let mut slots = Vec::new();
        for _ in 0..min_copies {
            let lg = rand_buf(ctx, "moe.logits", rng, e, -2.0, 2.0)?;
            let mut ids: Vec<u32> = (0..e as u32).collect();
            for j in 0..k {
                ids.swap(j, rng.random_range(j..e));
            }
            let mut route: Vec<u32> = ids[..k].to_vec();
            route.extend((0..k).map(|_| (1.0 / k as f32).to_bits()));
            slots.push((
                lg,
                ctx.storage_init("moe.route", bytemuck::cast_slice(&route))?,
            ));
        }
        let route_step = ctx.storage("moe.route", 8 * k as u64)?;
        let set = |kernel: MoeKernel, nm: Numerics| -> Result<MoeSet> {
            let bind = |lg: &wgpu::Buffer,
                        route: &wgpu::Buffer,
                        g: &Q4Matrix,
                        u: &Q4Matrix,
                        dn: &Q4Matrix| {
                let b = MoeBuffers {
                    state: st,
                    logits: lg,
                    route,
                    x: xn.act(nm),
                    gate: g,
                    up: u,
                    down: dn,
                    h: &moe_h.f,
                    h_q: moe_h.quant(nm),
                    out: &hbuf,
                    residual: true,
                };
                kernel.bind(ctx, &b, Routing::Fused)
            };
            let full = slots
                .iter()
                .map(|(lg, r)| bind(lg, r, &gate, &up, &down))
                .collect::<Result<Vec<_>>>()?;
            // `MoeKernel::record` records gate/up and down together; binding the other side's
            // matrices with no parts (0 dispatches) times each alone. Should `bind` start
            // rejecting empty matrices, only the combined row is reported.
            let split = (|| -> Result<_> {
                let gu = slots
                    .iter()
                    .map(|(lg, r)| bind(lg, r, &gate, &up, &none_d))
                    .collect::<Result<Vec<_>>>()?;
                let dn = slots
                    .iter()
                    .map(|(lg, r)| bind(lg, r, &none_gu, &none_gu, &down))
                    .collect::<Result<Vec<_>>>()?;
                Ok((gu, dn))
            })()
            .ok();
            // The folded form publishes its normalised input and logits (diagnostics): its
            // `logits` is written, so the slot's logits go in as `z` only.
            let (xn_out, lg_out) = (f32s("moe.xn_out", h)?, f32s("moe.lg_out", e)?);
            let folded = (|| -> Result<_> {
                let bind = |lg: &wgpu::Buffer, route: &wgpu::Buffer, dn: &Q4Matrix| {
                    let b = MoeBuffers {
                        state: st,
                        logits: &lg_out,
                        route,
                        x: xn.act(nm),
                        gate: &gate,
                        up: &up,
                        down: dn,
                        h: &moe_h.f,
                        h_q: moe_h.quant(nm),
                        out: &hbuf,
                        residual: true,
                    };
                    let f = MoeFolded {
                        a: &a,
                        norm_w: &norm_w,
                        eps: cfg.rms_norm_eps,
                        z: lg,
                        xn_out: &xn_out,
                        warm: None,
                        warm_down: None,
                    };
                    kernel.bind_folded(ctx, &b, &f)
                };
                let both = (slots.iter())
                    .map(|(lg, r)| bind(lg, r, &down))
                    .collect::<Result<Vec<_>>>()?;
                let gu = (slots.iter())
                    .map(|(lg, r)| bind(lg, r, &none_d))
                    .collect::<Result<Vec<_>>>()?;
                Ok((both, gu))
            })()
            .ok();
            Ok(MoeSet {
                kernel,
                full,
                split,
                folded,
            })
        };
        let moe = Numerics::ALL
            .into_iter()
            .map(|nm| set(MoeKernel::with_numerics(ctx, mp, nm)?, nm))
            .collect::<Result<Vec<_>>>()?;
        let moe_tuned = moe_tunings
            .iter()
            .map(|t| {
                let kernel = MoeKernel::with_f32_tuning(ctx, mp, Numerics::F32, *t)?;
                Ok((*t, set(kernel, Numerics::F32)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let moe_step = {
            let s = &moe[ix(numerics)];
            let b = MoeBuffers {
                state: st,
                logits: &router_out,
                route: &route_step,
                x: xn.act(numerics),
                gate: &gate,
                up: &up,
                down: &down,
                h: &moe_h.f,
                h_q: moe_h.quant(numerics),
                out: &hbuf,
                residual: true,
            };
            s.kernel.bind(ctx, &b, Routing::Fused)?
        };
        let mut keep = vec![q_norm, k_norm, w, out_tokens, route_step, hbuf, router_out];
        keep.extend(k_cache);
        keep.extend(v_cache);
        keep.extend(slots.into_iter().flat_map(|(a, b)| [a, b]));
        Ok(Bench {
            ctx: ctx.clone(),
            numerics,
            layers: l,
            state,
            matvec,
            quantize,
            norm,
            embed,
            argmax,
            attn,
            xn,
            att,
            moe_h,
            qkv_out,
            a,
            logits,
            qkv_w,
            o_w,
            head_w,
            qkv_b,
            qkv_nol_b,
            o_b,
            router_b,
            attn_b,
            attn_one,
            attn_one_b,
            attn_many,
            qkv_attn,
            head_b,
            head_bfp,
            norm_b,
            embed_b,
            argmax_b,
            moe,
            moe_tuned,
            moe_step,
            _keep: keep,
            _scratch: scratch,
            _scratch_one: scratch_one,
        })
    }

    /// Queue a state write: run at `pos`, token 1, not done, step 0.
    pub fn set_state(&self, pos: u32) {
        let s = RunState {
            pos,
            token: 1,
            done: 0,
            step: 0,
        };
        self.ctx.write(&self.state, 0, bytemuck::bytes_of(&s));
    }

    /// Record one whole decode step at `pos` exactly as `DecodePlan::record_step` does.
    pub fn record_step(&self, pass: &mut wgpu::ComputePass<'_>, pos: u32) {
        let moe = &self.moe[ix(self.numerics)].kernel;
        self.embed.record(pass, &self.embed_b);
        for j in 0..self.layers {
            self.norm.record(pass, &self.norm_b[0]);
            self.matvec.record(pass, &self.qkv_b[j % self.qkv_b.len()]);
            self.attn.record(pass, &self.attn_b[j], pos);
            self.matvec.record(pass, &self.o_b[j % self.o_b.len()]);
            self.norm.record(pass, &self.norm_b[1]);
            self.matvec
                .record(pass, &self.router_b[j % self.router_b.len()]);
            moe.record(pass, &self.ctx, &self.moe_step);
        }
        self.norm.record(pass, &self.norm_b[0]);
        self.matvec.record(pass, &self.head_b);
        self.argmax.record(pass, &self.argmax_b);
    }

    pub fn moe_set(&self, n: Numerics) -> &MoeSet {
        &self.moe[ix(n)]
    }
}
