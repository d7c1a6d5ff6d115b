//! The decode plan: every activation buffer, the KV cache and every bind group of one sequence,
//! created once, and the recording of decode steps into one compute pass.
//!
//! One step (token at `state.pos`) is, per layer, in the folded plan (f32 activations, the
//! default): `qkv = Wqkv rmsnorm(h)` (the norm computed on load by every workgroup) · attention
//! (q/k norm + rope + KV write + chunks, and a combine once there are several chunks -> `att`) ·
//! `a = Wo att` with, in the same dispatch, the router's pre-norm logits `z = fold [att | h]`
//! (kernels/router_fold.rs: the router needs no dispatch of its own) · MoE (gate/up normalises
//! `h + a` on load, routes on `z / rms(h + a)`; down writes `h = (h + a) + Σ w_k expert_k`); then
//! `logits = Whead rmsnorm(h)` · argmax (advances the state). That is 5-6 dispatches per layer + 4
//! ([`DecodePlan::dispatches_per_step`]). The fused plan (f32, when the MoE kernels are not the
//! staged ones) has the router dispatch instead: `h += Wo att` · `router = Wr rmsnorm(h)` (also
//! publishing `xn`) · MoE.
//! The int8 numerics keep the unfused form (their norms also quantise): `rmsnorm(h) -> xq` ·
//! qkv · attention · `a = Wo att_q` · `rmsnorm(h += a) -> xn, xq` · router · MoE, and a final norm.
//!
//! A run of N greedy steps is N such steps recorded back to back in ONE pass and ONE submit:
//! each step reads the token the previous step's argmax wrote into the state buffer, and after
//! EOS (or the request's last step) the state's `done` flag turns every later dispatch into a
//! no-op. Single-step calls record the same step without argmax and read the logits back instead.
//!
//! A greedy request of n steps is recorded in such runs, each its own command buffer, with run
//! k+1 submitted before the host waits for run k: see [`crate::stream`].
//!
//! Prefill records the prompt in chunks of up to [`PREFILL_CHUNK`] tokens, each chunk ONE pass
//! and ONE submit: the tokens' steps back to back (an `advance` dispatch between two tokens moves
//! the state to the next prompt id), the lm_head only after the last prompt token, and one
//! logits readback per prompt. Each token is still its own set of matvec dispatches (weights are
//! read once per token, not once per chunk): a batched-matmul prefill is future work.
//!
//! Activation numerics ([`Numerics`]): the producers (rmsnorm, attention combine, MoE gate/up)
//! always write f32 and, for the int8 forms, also the quantised copy the next Q4 matvec reads.
//!
//! Buffer lifetimes: everything here lives as long as the plan; the KV cache row `p` is written
//! only by the attention kernel of the step at position `p`.

use crate::context::{Context, Result};
use crate::kernels::advance::{AdvanceBinding, AdvanceKernel};
use crate::kernels::argmax::{ArgmaxArgs, ArgmaxBinding, ArgmaxKernel};
use crate::kernels::attention::{
    AttentionBinding, AttentionBuffers, AttentionKernel, AttentionParams, AttentionScratch, Combine,
};
use crate::kernels::embed::{EmbedBinding, EmbedKernel};
use crate::kernels::matmul::{MatmulArgs, MatmulInput, MatmulKernel};
use crate::kernels::matvec::{
    Act, BfpQuantKernel, MatvecBinding, MatvecKernel, NormInput, NORM_ON_LOAD_MAX,
};
use crate::kernels::moe::{
    MoeBinding, MoeBuffers, MoeFolded, MoeKernel, MoeParams, MoeSet, Routing,
};
use crate::kernels::norm::{RmsNormArgs, RmsNormBinding, RmsNormKernel};
use crate::kernels::qkv_attention::{QkvAttentionBinding, QkvAttentionBuffers, QkvAttentionKernel};
use crate::kernels::router_fold::RouterFoldKernel;
use crate::kernels::sample::{SampleArgs, SampleBinding, SampleKernel};
use crate::numerics::{BfpActs, Numerics};
use crate::state::RunState;
use crate::tensor::{Q4Matrix, QForm, QuantActs};
use crate::tune::Tune;
use crate::weights::{GpuWeights, HeadRef, Matrix};
use nibble_backend::DeviceSampling;
use nibble_model::kv_cache::CacheType;

/// How a recorded step ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The logits only (read back by the host).
    Logits,
    /// The on-GPU argmax, which advances the run state.
    Argmax,
    /// The on-GPU sampler (kernels/sample.rs), which advances the run state likewise.
    Sample,
}

/// Choices fixed when the plan is built.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// KV-cache positions.
    pub context_len: usize,
    /// The KV cache's element type.
    pub cache: CacheType,
    /// Most steps one folded run may record.
    pub max_run: u32,
    pub routing: Routing,
    /// Most EOS ids a run may stop on.
    pub max_eos: usize,
    /// The activation form of every int4 matvec (dense and MoE).
    pub numerics: Numerics,
    /// Fold the router into the o-proj dispatch where the kernels allow (router_fold.rs; on by
    /// default, off only for comparisons).
    pub fold_router: bool,
    /// Where the attention merges its chunks (`None`: [`Combine::for_context`]).
    pub attention_combine: Option<Combine>,
    /// Work-split overrides (comparisons; the default changes nothing).
    pub tune: Tune,
}

/// Prompt tokens recorded per prefill command buffer.
pub const PREFILL_CHUNK: usize = 64;

/// Activation buffers of one step (shapes with H hidden, Q = Hq*D, KV = Hkv*D).
struct Acts {
    state: wgpu::Buffer,
    /// `[H]` residual stream.
    h: wgpu::Buffer,
    /// `[H]` normalised hidden (f32) and its int8 copy (none for f32 numerics).
    xn: wgpu::Buffer,
    xq: Option<QuantActs>,
    /// `[Q + 2 KV]`.
    qkv: wgpu::Buffer,
    /// `[Q]` attention output and its int8 copy.
    att: wgpu::Buffer,
    att_q: Option<QuantActs>,
    /// `[H]` o-proj output.
    a: wgpu::Buffer,
    /// `[E]` router logits, `[E]` the folded router's pre-norm logits, `[2K]` route, `[K*I]`
    /// expert hidden (f32, int8).
    router: wgpu::Buffer,
    z: wgpu::Buffer,
    route: wgpu::Buffer,
    moe_h: wgpu::Buffer,
    moe_hq: Option<QuantActs>,
    /// `[V]`.
    logits: wgpu::Buffer,
    /// `[V]` host-mappable: the logits of a one-step run (plan_logits.rs).
    logits_rb: wgpu::Buffer,
    /// `[max(context_len, max_run)]`: the id of a request's step `s` (any request fits, as
    /// it has at most `context_len` steps).
    out_tokens: wgpu::Buffer,
    /// `[PREFILL_CHUNK]` the prefill chunk's token ids.
    prompt: wgpu::Buffer,
    /// Per layer `[ctx, Hkv, D]` f32.
    k_cache: Vec<wgpu::Buffer>,
    v_cache: Vec<wgpu::Buffer>,
    scratch: AttentionScratch,
}

/// One layer's bindings. Fused plan (f32 numerics, the default): `qkv` normalises `h` on load
/// (no `norm1` dispatch), `o` adds into `h` (the residual), `router` normalises `h` on load and
/// publishes `xn` for the MoE (no `norm2` dispatch). Unfused (int8 numerics, whose producers
/// also quantise): norm1 · qkv · attention · o -> `a` · norm2 (h += a) · router · MoE.
struct LayerBinding {
    norm1: Option<RmsNormBinding>,
    qkv: MatvecBinding,
    attn: AttentionBinding,
    /// qkv and attention in one dispatch on the plan's own cache (kernels/qkv_attention.rs),
    /// for steps below its position bound; None where the kernel is not built.
    qkv_attn: Option<QkvAttentionBinding>,
    o: MatvecBinding,
    norm2: Option<RmsNormBinding>,
    /// None in the folded plan (the o-proj dispatch computes the router's logits).
    router: Option<MatvecBinding>,
    moe: MoeBinding,
    /// Diagnostics only (the fused plan's trace): the standalone `rmsnorm(h) -> xn`.
    trace_norm1: RmsNormBinding,
}

struct Kernels {
    matvec: MatvecKernel,
    norm: RmsNormKernel,
    embed: EmbedKernel,
    argmax: ArgmaxKernel,
    sample: SampleKernel,
    attn: AttentionKernel,
    moe: MoeSet,
    advance: AdvanceKernel,
    matmul: MatmulKernel,
    /// The bfp24 matvecs of the lm_head under `--tune head=2`.
    head_bfp: Option<MatvecKernel>,
    /// The bfp24 conversion before the lm_head under `--tune head=3|4` (4 the default).
    head_quant: Option<BfpQuantKernel>,
    /// The qkv + attention dispatch (fused plan, Vulkan; only under `--tune qkv_attn=N`).
    qkv_attn: Option<QkvAttentionKernel>,
}

/// One layer's diagnostics: `h [H]` after the layer and its expert ids `[K]`, best first.
pub type LayerTrace = (Vec<f32>, Vec<u32>);

/// A model's weights plus everything needed to decode one sequence on the GPU.
pub struct DecodePlan {
    pub ctx: Context,
    pub weights: GpuWeights,
    pub opts: PlanOptions,
    k: Kernels,
    acts: Acts,
    embed: EmbedBinding,
    layers: Vec<LayerBinding>,
    /// `rmsnorm(h) -> xn` before the head: recorded only by the unfused plan (the fused head
    /// normalises on load); the trace uses it in both.
    final_norm: RmsNormBinding,
    fused: bool,
    /// The router folded into the o-proj (per layer `[E, Q + H]` f32, router_fold.rs); empty
    /// when not folded.
    folds: Vec<wgpu::Buffer>,
    head: HeadBinding,
    argmax: ArgmaxBinding,
    /// The GPU sampler over the same logits, state and `out_tokens` (sampled requests).
    sample: SampleBinding,
    advance: AdvanceBinding,
    /// `[slot][layer]` attention bindings on the multi-stream KV slots (plan_slots.rs): a
    /// lone stream decodes here in place. Empty until [`DecodePlan::bind_slots`].
    slot_attn: Vec<Vec<AttentionBinding>>,
    /// `[slot][layer]` the qkv + attention bindings on those slots (empty without the form).
    slot_qkv_attn: Vec<Vec<QkvAttentionBinding>>,
    /// `[Hkv]` the qkv + attention form's arrival counters, shared by every layer and slot.
    qkv_arrive: Option<wgpu::Buffer>,
    /// The next one-step logits run, recorded ahead (plan_logits.rs).
    prepared: logits::Prepared,
    /// Layers whose qkv warms the o-proj, whose down warms the next qkv, whose gate/up warms
    /// its experts' down (`--tune warm`).
    warmed: (usize, usize, usize),
}

/// The form of an activation a Q4 matvec reads: the quantised copy when there is one.
fn act<'a>(xq: &'a Option<QuantActs>, xf: &'a wgpu::Buffer) -> Act<'a> {
    match xq {
        Some(q) => Act::Int8(q),
        None => Act::F32(xf),
    }
}

/// Bind a matvec whatever the matrix form: Q4 reads the activation in the plan's numerics
/// form, F32 the f32 one.
fn bind_matrix(
    ctx: &Context,
    k: &MatvecKernel,
    m: &Matrix,
    x: (&Option<QuantActs>, &wgpu::Buffer),
    y: &wgpu::Buffer,
    state: &wgpu::Buffer,
) -> Result<MatvecBinding> {
    match m {
        Matrix::Q4(m) => k.bind_q4(ctx, m, act(x.0, x.1), y, state),
        Matrix::F32(m) => k.bind_f32(ctx, m, x.1, y, state),
    }
}

impl DecodePlan {
    /// Allocate the activations and KV cache and create every bind group once.
    pub fn new(
        ctx: &Context,
        weights: GpuWeights,
        opts: PlanOptions,
    ) -> anyhow::Result<DecodePlan> {
        let cfg = weights.cfg.clone();
        anyhow::ensure!(opts.max_run > 0, "a run needs at least one step");
        let ap = AttentionParams::from_config(&cfg, opts.context_len, opts.cache)?;
        let mp = MoeParams::from_config(&cfg)?;
        for (key, v) in [
            ("late_norm", opts.tune.late_norm),
            ("moe_late_norm", opts.tune.moe_late_norm),
        ] {
            anyhow::ensure!(
                v.unwrap_or(0) <= 1,
                "tune {key} must be 0 or 1, not {}",
                v.unwrap_or(0)
            );
        }
        // Unset: 4 (run 104: tg128 337.0 / 336.4 against head=3's 336.1 / 335.1; run 67 chose 3
        // over the matmul, 323.5 / 323.4 against 322.4 / 322.3).
        // A head of another form than Q4_0 (MLX's affine one, a K-quant file's Q6_K) takes the
        // f32 norm-on-load matvec unless a form is asked for: the bfp24 forms read Q4_0 only
        // (asked for, they fail at binding with the reason).
        let forms = weights.forms();
        let head_q4_0 = match weights.head() {
            HeadRef::Q4(m) => m.form() == Some(QForm::Q4_0),
            HeadRef::F32(_) => false,
        };
        let head_form = match (opts.tune.head, head_q4_0) {
            (None, false) => 1,
            (h, _) => h.unwrap_or(crate::tune::DEFAULT_HEAD),
        };
        anyhow::ensure!(
            head_form <= 4,
            "tune head must be 0, 1, 2, 3 or 4, not {head_form}"
        );
        let mut k = Kernels {
            matvec: MatvecKernel::with_forms(
                ctx,
                opts.numerics,
                opts.tune.late_norm.unwrap_or(1) != 0,
                &forms,
            )?
            .with_rows_per_team(
                cfg.q_dim() as u32 + 2 * cfg.kv_dim() as u32,
                opts.tune.qkv_rows,
            )
            .with_rows_per_team(cfg.hidden_size as u32, opts.tune.o_rows)
            .with_pair_forms(opts.tune.qkv_pair.unwrap_or(1) != 0),
            norm: RmsNormKernel::new(ctx)?,
            embed: EmbedKernel::new_for(ctx, weights.embed.one_form("token_embd")?)?,
            argmax: ArgmaxKernel::new(ctx)?,
            sample: SampleKernel::new(ctx)?,
            attn: opts.tune.attention(
                ctx,
                ap,
                opts.attention_combine.unwrap_or(Combine::for_context(ctx)),
            )?,
            moe: MoeSet::new(
                ctx,
                mp,
                opts.numerics,
                opts.tune.moe(ctx, &mp),
                &weights.moe_forms(),
            )?,
            advance: AdvanceKernel::new(ctx)?,
            matmul: MatmulKernel::new(ctx)?,
            head_bfp: match head_form {
                2 => Some(MatvecKernel::with_numerics(ctx, Numerics::Bfp24)?),
                _ => None,
            },
            head_quant: match head_form {
                3 | 4 => Some(BfpQuantKernel::new(ctx)?),
                _ => None,
            },
            qkv_attn: None,
        };
        let nq = opts.numerics;
        let quant = |label: &str, n: usize| QuantActs::for_numerics(ctx, label, n, nq);
        let (h, q, kv) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let f32s = |label: &str, n: usize| ctx.storage(label, n as u64 * 4);
        let cache_bytes = ap.cache_bytes();
        let acts = Acts {
            state: RunState::default().buffer(ctx)?,
            h: f32s("h", h)?,
            xn: f32s("xn", h)?,
            xq: quant("xq", h)?,
            qkv: f32s("qkv", q + 2 * kv)?,
            att: f32s("att", q)?,
            att_q: quant("att_q", q)?,
            a: f32s("a", h)?,
            router: f32s("router", cfg.num_experts)?,
            z: f32s("z", cfg.num_experts)?,
            route: ctx.storage("route", 8 * cfg.num_experts_per_tok as u64)?,
            moe_h: f32s("moe_h", cfg.num_experts_per_tok * cfg.moe_intermediate_size)?,
            moe_hq: quant(
                "moe_hq",
                cfg.num_experts_per_tok * cfg.moe_intermediate_size,
            )?,
            logits: f32s("logits", cfg.vocab_size)?,
            logits_rb: ctx.readback_buffer("logits.readback", cfg.vocab_size as u64 * 4),
            out_tokens: ctx.storage(
                "out_tokens",
                opts.context_len.max(opts.max_run as usize) as u64 * 4,
            )?,
            prompt: ctx.storage("prompt", PREFILL_CHUNK as u64 * 4)?,
            k_cache: (0..cfg.num_layers)
                .map(|_| ctx.storage("k_cache", cache_bytes))
                .collect::<Result<_>>()?,
            v_cache: (0..cfg.num_layers)
                .map(|_| ctx.storage("v_cache", cache_bytes))
                .collect::<Result<_>>()?,
            scratch: k.attn.scratch(ctx)?,
        };
        let a = &acts;
        let st = &a.state;
        let (n, eps) = (h as u32, cfg.rms_norm_eps);
        let norm = |add: Option<&wgpu::Buffer>, w: &wgpu::Buffer| {
            let args = RmsNormArgs {
                h: &a.h,
                add,
                weight: w,
                out: &a.xn,
                quant: a.xq.as_ref(),
                n,
                eps,
            };
            k.norm.bind(ctx, &args, st)
        };
        // Norms fused into their consumers where every consumer reads f32 (see LayerBinding).
        let fused = !nq.quantized()
            && cfg.hidden_size as u32 <= NORM_ON_LOAD_MAX
            && cfg.q_dim() as u32 <= NORM_ON_LOAD_MAX
            && weights.layers.iter().all(|lw| {
                matches!(lw.qkv, Matrix::Q4(_))
                    && matches!(lw.o, Matrix::Q4(_))
                    && matches!(&lw.router, Matrix::F32(m) if m.parts.len() == 1)
            })
            && matches!(weights.head(), HeadRef::Q4(_));
        // The router folded into the o-proj where the MoE has the folded forms and every o-proj
        // and router is one binding.
        let folds = if fused
            && opts.fold_router
            && opts.routing == Routing::Fused
            && k.moe.can_fold()
            && weights.layers.iter().all(|lw| {
                matches!(&lw.o, Matrix::Q4(m) if m.parts.len() == 1 && m.cols <= NORM_ON_LOAD_MAX)
            }) {
            let fk = RouterFoldKernel::new(ctx)?;
            weights
                .layers
                .iter()
                .map(|lw| match (&lw.o, &lw.router) {
                    (Matrix::Q4(o), Matrix::F32(r)) => Ok(fk.fold(ctx, o, r, &lw.ffn_norm)?),
                    _ => anyhow::bail!("router fold: unexpected matrix forms"),
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        fn nol<'b>(h: &'b wgpu::Buffer, weight: &'b wgpu::Buffer, eps: f32) -> NormInput<'b> {
            NormInput { h, weight, eps }
        }
        // The qkv + attention dispatch where asked for (`--tune qkv_attn=N`; off by default,
        // slower on the H200), the plan is fused and every qkv is one binding.
        let max_attn = opts.tune.qkv_attn.unwrap_or(0);
        if fused
            && max_attn > 0
            && weights
                .layers
                .iter()
                .all(|lw| matches!(&lw.qkv, Matrix::Q4(m) if m.parts.len() == 1))
        {
            let rpt = k.matvec.rows_per_team((q + 2 * kv) as u32);
            let late = opts.tune.late_norm.unwrap_or(1) != 0;
            k.qkv_attn = QkvAttentionKernel::new(ctx, ap, rpt, late, max_attn)?;
        }
        let qkv_arrive = match &k.qkv_attn {
            Some(qk) => Some(qk.arrivals(ctx)?),
            None => None,
        };
        let warm = opts.tune.warm.unwrap_or(crate::tune::DEFAULT_WARM);
        anyhow::ensure!(
            warm <= 7,
            "tune warm must be 0..=7 (a bit mask), not {warm}"
        );
        let sink = crate::kernels::warm::sink(ctx)?;
        // The part a warm workgroup reads: a matrix of one binding.
        fn one_part(m: &Matrix) -> Option<&crate::tensor::Q4Part> {
            match m {
                Matrix::Q4(m) if m.parts.len() == 1 => Some(&m.parts[0]),
                _ => None,
            }
        }
        // The largest part of a stacked qkv (a `Q4_K_M` file's q and k in Q4_K, v in Q6_K:
        // q and k are 85% of its bytes), warmed by the layer before.
        fn main_part(m: &Matrix) -> Option<&crate::tensor::Q4Part> {
            match m {
                Matrix::Q4(m) => m.parts.iter().max_by_key(|p| p.qs.size()),
                _ => None,
            }
        }
        let mut warmed = (0, 0, 0);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, lw) in weights.layers.iter().enumerate() {
            let attn_bufs = AttentionBuffers {
                state: st,
                qkv: &a.qkv,
                q_norm: &lw.q_norm,
                k_norm: &lw.k_norm,
                k_cache: &a.k_cache[l],
                v_cache: &a.v_cache[l],
                out: &a.att,
                out_q: a.att_q.as_ref(),
            };
            let moe_bufs = MoeBuffers {
                state: st,
                logits: &a.router,
                route: &a.route,
                x: act(&a.xq, &a.xn),
                gate: &lw.gate,
                up: &lw.up,
                down: &lw.down,
                h: &a.moe_h,
                h_q: a.moe_hq.as_ref(),
                out: &a.h,
                residual: true,
            };
            let attn = k.attn.bind(ctx, &attn_bufs, &a.scratch)?;
            let qkv_attn = match (&k.qkv_attn, &qkv_arrive, &lw.qkv) {
                (Some(qk), Some(arrive), Matrix::Q4(m)) => Some(qk.bind(
                    ctx,
                    &QkvAttentionBuffers {
                        m,
                        x: nol(&a.h, &lw.attn_norm, eps),
                        qkv: &a.qkv,
                        q_norm: &lw.q_norm,
                        k_norm: &lw.k_norm,
                        k_cache: &a.k_cache[l],
                        v_cache: &a.v_cache[l],
                        out: &a.att,
                        arrive,
                        state: st,
                    },
                )?),
                _ => None,
            };
            let trace_norm1 = norm(None, &lw.attn_norm)?;
            let qkv_norm = |qkv: &Q4Matrix| {
                k.matvec
                    .bind_q4_norm(ctx, qkv, nol(&a.h, &lw.attn_norm, eps), &a.qkv, st)
            };
            if let (Some(fold), Matrix::Q4(qkv), Matrix::Q4(o)) = (folds.get(l), &lw.qkv, &lw.o) {
                // L2 warming (`--tune warm`): the down reads the next layer's qkv, the qkv
                // this layer's o-proj.
                let next_qkv = weights.layers.get(l + 1).and_then(|n| main_part(&n.qkv));
                let folded = MoeFolded {
                    a: &a.a,
                    norm_w: &lw.ffn_norm,
                    eps,
                    z: &a.z,
                    xn_out: &a.xn,
                    warm: next_qkv.filter(|_| warm & 2 != 0).map(|p| (p, &sink)),
                    warm_down: (warm & 4 != 0).then_some(&sink),
                };
                warmed.1 += folded.warm.is_some() as usize;
                let moe = k.moe.bind_folded(ctx, &moe_bufs, &folded)?;
                warmed.2 += moe.warms_down() as usize;
                let e = cfg.num_experts as u32;
                let qkv_b = match one_part(&lw.o).filter(|_| warm & 1 != 0) {
                    Some(op) => {
                        warmed.0 += 1;
                        k.matvec.bind_q4_norm_warm(
                            ctx,
                            qkv,
                            nol(&a.h, &lw.attn_norm, eps),
                            &a.qkv,
                            st,
                            (op, &sink),
                        )?
                    }
                    None => qkv_norm(qkv)?,
                };
                layers.push(LayerBinding {
                    norm1: None,
                    qkv: qkv_b,
                    attn,
                    qkv_attn,
                    o: k.matvec
                        .bind_q4_router(ctx, o, &a.att, &a.h, fold, e, &a.a, &a.z, st)?,
                    norm2: None,
                    router: None,
                    moe,
                    trace_norm1,
                });
                continue;
            }
            let moe = k.moe.bind(ctx, &moe_bufs, opts.routing)?;
            layers.push(match (fused, &lw.qkv, &lw.o, &lw.router) {
                (true, Matrix::Q4(qkv), Matrix::Q4(o), Matrix::F32(router)) => LayerBinding {
                    norm1: None,
                    qkv: qkv_norm(qkv)?,
                    attn,
                    qkv_attn,
                    o: k.matvec.bind_q4_acc(ctx, o, &a.att, &a.h, st)?,
                    norm2: None,
                    router: Some(k.matvec.bind_f32_norm(
                        ctx,
                        router,
                        nol(&a.h, &lw.ffn_norm, eps),
                        &a.xn,
                        &a.router,
                        st,
                    )?),
                    moe,
                    trace_norm1,
                },
                _ => LayerBinding {
                    norm1: Some(norm(None, &lw.attn_norm)?),
                    qkv: bind_matrix(ctx, &k.matvec, &lw.qkv, (&a.xq, &a.xn), &a.qkv, st)?,
                    attn,
                    qkv_attn,
                    o: bind_matrix(ctx, &k.matvec, &lw.o, (&a.att_q, &a.att), &a.a, st)?,
                    norm2: Some(norm(Some(&a.a), &lw.ffn_norm)?),
                    router: Some(bind_matrix(
                        ctx,
                        &k.matvec,
                        &lw.router,
                        (&a.xq, &a.xn),
                        &a.router,
                        st,
                    )?),
                    moe,
                    trace_norm1,
                },
            });
        }
        let embed = k.embed.bind(ctx, &weights.embed, &a.h, st)?;
        let final_norm = norm(None, &weights.out_norm)?;
        let head = match weights.head() {
            HeadRef::Q4(m) if fused && head_form != 0 => {
                let x = nol(&a.h, &weights.out_norm, eps);
                match (&k.head_bfp, &k.head_quant) {
                    (Some(hk), _) => HeadBinding::Bfp(hk.bind_q4_norm(ctx, m, x, &a.logits, st)?),
                    (_, Some(qk)) => {
                        // The bind groups keep the blocks' buffers alive.
                        let xb = BfpActs::new(ctx, "head.xb", m.cols)?;
                        let q = qk.bind(ctx, x, &xb, st)?;
                        // head=4: two rows per team (each activation block serves both).
                        let rows = if head_form == 4 { 2 } else { 1 };
                        let mv =
                            k.matvec
                                .bind_q4_with(ctx, m, Act::Bfp(&xb), &a.logits, st, rows)?;
                        HeadBinding::BfpGlobal(q, mv, rows)
                    }
                    _ => HeadBinding::Matvec(k.matvec.bind_q4_norm(ctx, m, x, &a.logits, st)?),
                }
            }
            HeadRef::Q4(m) if fused => HeadBinding::Matmul(k.matmul.bind(
                ctx,
                &MatmulArgs {
                    m,
                    input: MatmulInput::Norm(nol(&a.h, &weights.out_norm, eps)),
                    nb: 1,
                    y: &a.logits,
                    y_stride: cfg.vocab_size as u32,
                    state: st,
                },
            )?),
            HeadRef::Q4(m) => {
                HeadBinding::Matvec(k.matvec.bind_q4(ctx, m, act(&a.xq, &a.xn), &a.logits, st)?)
            }
            HeadRef::F32(m) => {
                HeadBinding::Matvec(k.matvec.bind_f32(ctx, m, &a.xn, &a.logits, st)?)
            }
        };
        let placeholder_eos = vec![u32::MAX; opts.max_eos.max(1)];
        let argmax = k.argmax.bind(
            ctx,
            &ArgmaxArgs {
                logits: &a.logits,
                n: cfg.vocab_size as u32,
                state: st,
                out_tokens: &a.out_tokens,
                max_steps: opts.max_run,
                eos: &placeholder_eos,
            },
        )?;
        let (run_params, eos) = argmax.run_buffers();
        let sample = k.sample.bind(
            ctx,
            &SampleArgs {
                logits: &a.logits,
                n: cfg.vocab_size as u32,
                cap: (a.out_tokens.size() / 4).min(u32::MAX as u64) as u32,
                state: st,
                out_tokens: &a.out_tokens,
                run_params,
                eos,
            },
        )?;
        let advance = k.advance.bind(ctx, st, &a.prompt)?;
        Ok(DecodePlan {
            ctx: ctx.clone(),
            weights,
            opts,
            k,
            acts,
            embed,
            layers,
            final_norm,
            fused,
            folds,
            head,
            argmax,
            sample,
            advance,
            slot_attn: Vec::new(),
            slot_qkv_attn: Vec::new(),
            qkv_arrive,
            prepared: Default::default(),
            warmed,
        })
    }

    fn set_state(&self, token: u32, pos: usize) {
        let s = RunState {
            pos: pos as u32,
            token,
            done: 0,
            step: 0,
        };
        self.ctx.write(&self.acts.state, 0, bytemuck::bytes_of(&s));
    }

    /// Process `tokens` at positions `pos..pos + len` and return the last token's logits `[V]`:
    /// one pass and one submit per [`PREFILL_CHUNK`] tokens, one logits readback. The caller
    /// guarantees every token `< V`, `tokens` non-empty and `pos + len <= context_len`.
    pub fn prefill_logits(&self, tokens: &[u32], pos: usize) -> Result<Vec<f32>> {
        let n = tokens.len();
        for (c, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            let p0 = pos + c * PREFILL_CHUNK;
            let last_chunk = p0 + chunk.len() == pos + n;
            self.ctx
                .write(&self.acts.prompt, 0, bytemuck::cast_slice(chunk));
            self.set_state(chunk[0], p0);
            self.ctx.run_pass(|p| {
                for i in 0..chunk.len() {
                    if i > 0 {
                        self.k.advance.record(p, &self.advance);
                    }
                    self.record_layers(p, (p0 + i) as u32);
                }
                if last_chunk {
                    if !self.fused {
                        self.k.norm.record(p, &self.final_norm);
                    }
                    self.record_head(p);
                }
            })?;
        }
        self.ctx
            .read_f32(&self.acts.logits, self.weights.cfg.vocab_size)
    }

    /// The greedy stream's access (`stream.rs`): write the argmax's run length and EOS ids
    /// and the state for a request starting with `token` at `pos`.
    pub(crate) fn start_greedy(&self, token: u32, pos: usize, n: u32, eos: &[u32]) -> Result<()> {
        self.argmax.set_run(&self.ctx, n, eos)?;
        self.set_state(token, pos);
        Ok(())
    }

    /// The sampled stream's access (`stream.rs`), besides [`Self::start_greedy`]: the
    /// sampler's settings, penalty counts and draws for `n` steps.
    pub(crate) fn start_sampled(&self, n: u32, spec: &DeviceSampling<'_>) -> Result<()> {
        self.sample.set_request(&self.ctx, spec, n as usize)
    }

    /// Record one decode step that picks its next token on the GPU (`pick` Argmax or Sample)
    /// at a position `<= pos_bound`, on the plan's cache or on multi-stream KV slot `slot`
    /// ([`DecodePlan::bind_slots`]).
    pub(crate) fn record_greedy_step(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pos_bound: u32,
        slot: Option<usize>,
        pick: Pick,
    ) {
        self.record_step_marked(pass, pos_bound, pick, slot, &mut |_, _| {});
    }

    /// The run-state buffer and `out_tokens` (`[max(context_len, max_run)]` u32).
    pub(crate) fn greedy_buffers(&self) -> (&wgpu::Buffer, &wgpu::Buffer) {
        (&self.acts.state, &self.acts.out_tokens)
    }

    /// The per-layer KV caches `[ctx, Hkv, D]` (K, V) of the sequence: the batched prefill
    /// writes them too.
    pub(crate) fn kv_caches(&self) -> (&[wgpu::Buffer], &[wgpu::Buffer]) {
        (&self.acts.k_cache, &self.acts.v_cache)
    }

    /// The KV caches' element type.
    pub(crate) fn cache_type(&self) -> CacheType {
        self.k.attn.params().cache
    }

    /// Bytes of one layer's key (or value) cache.
    pub(crate) fn cache_bytes(&self) -> u64 {
        self.k.attn.params().cache_bytes()
    }
}

#[path = "plan_head.rs"]
mod head;
#[path = "plan_record.rs"]
mod record;
use head::HeadBinding;
#[path = "plan_info.rs"]
mod info;
#[path = "plan_logits.rs"]
mod logits;
#[path = "plan_slots.rs"]
mod slots;
#[path = "plan_trace.rs"]
mod trace;
