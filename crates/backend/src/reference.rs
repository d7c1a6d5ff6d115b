//! The oracle: a plain, scalar Qwen3-MoE forward pass (formats-spec §1.4) behind [`Backend`].
//!
//! Deliberately simple and shares no code with any fast path, so that agreement means something:
//! weights are decoded row by row as they are used (never the whole model), activations are f32,
//! every reduction accumulates in f64 (see [`ops`]). Prompt tokens are processed one at a time in
//! order, each through every layer: with a KV cache that is exactly the causal batched forward,
//! and it keeps prefill and step bit-identical. Rayon splits only over independent output
//! elements, so the result does not depend on the thread count.
//!
//! Every intermediate has a name; with [`RefBackend::set_trace`] a hook sees each one as it is
//! produced (see [`TRACE_NAMES`]), so a parity tool can name the first op where a backend diverges.

pub mod attention;
pub mod check;
pub mod kv;
pub mod moe;
pub mod ops;

use crate::{Backend, StepTrace};
use anyhow::{ensure, Context};
use attention::{attention, AttnDims};
use kv::KvCache;
use moe::{moe_combine, route_logits, ExpertWeights};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::kv_cache::CacheType;
use nibble_model::rope::RopeTable;
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use ops::{matvec, rmsnorm, rmsnorm_heads, rope_heads};
use std::sync::{Arc, Mutex};

/// Trace hook: `(position, name, values)` for every named intermediate of every token.
pub type TraceFn = Box<dyn FnMut(usize, &str, &[f32]) + Send>;

/// Names the trace hook sees, in order; per-layer ones are prefixed `l{layer}.` (e.g.
/// `l3.attn_out`). `moe_experts` carries the chosen expert ids as f32, best first.
pub const TRACE_NAMES: &[&str] = &[
    "embd",
    "attn_norm",
    "q",
    "k",
    "v",
    "q_normed",
    "k_normed",
    "q_rope",
    "k_rope",
    "attn",
    "attn_out",
    "h_attn",
    "ffn_norm",
    "router_logits",
    "router_probs",
    "moe_experts",
    "moe_weights",
    "moe_out",
    "h",
    "final_norm",
    "logits",
];

/// The reference backend: one sequence, a KV cache for `context_len` positions (f32 values
/// rounded as its [`CacheType`] holds them).
pub struct RefBackend {
    source: Arc<dyn WeightSource>,
    cfg: Qwen3MoeConfig,
    context_len: usize,
    /// Tokens in the KV cache.
    pos: usize,
    kv: KvCache,
    /// The rotation: `[D/2]` inverse frequencies and YaRN's attention factor.
    rope: RopeTable,
    trace: Option<TraceFn>,
}

impl RefBackend {
    /// Check the config and every tensor of `source` once, then allocate the KV cache for
    /// `context_len` positions (at most the model's [`Qwen3MoeConfig::max_context`]) of the
    /// default [`CacheType`] (f32, as the fast backends' default).
    pub fn new(source: Arc<dyn WeightSource>, context_len: usize) -> anyhow::Result<Self> {
        Self::with_cache(source, context_len, CacheType::default())
    }

    /// [`RefBackend::new`] with a KV cache of type `cache` (`F32`: transformers' numerics).
    pub fn with_cache(
        source: Arc<dyn WeightSource>,
        context_len: usize,
        cache: CacheType,
    ) -> anyhow::Result<Self> {
        let cfg = source.config().clone();
        cfg.validate().context("invalid model config")?;
        ensure!(context_len > 0, "the context length must be at least 1");
        ensure!(
            context_len <= cfg.max_context(),
            "a context of {context_len} positions exceeds the model's context ({})",
            cfg.max_context()
        );
        check::check_all(source.as_ref(), &cfg)?;
        let kv = KvCache::new(cfg.num_layers, context_len, cfg.kv_dim(), cache)?;
        Ok(RefBackend {
            rope: cfg.rope(),
            source,
            cfg,
            context_len,
            pos: 0,
            kv,
            trace: None,
        })
    }

    /// Install (or remove, with `None`) the trace hook.
    pub fn set_trace(&mut self, trace: Option<TraceFn>) {
        self.trace = trace;
    }

    /// Send `values` to the trace hook as `l{layer}.{name}` (or just `name` without a layer).
    fn emit(&mut self, pos: usize, layer: Option<usize>, name: &str, values: &[f32]) {
        if let Some(t) = self.trace.as_mut() {
            match layer {
                Some(l) => t(pos, &format!("l{l}.{name}"), values),
                None => t(pos, name, values),
            }
        }
    }

    /// Run `token` at position `pos` through every layer, writing its KV slots; return the
    /// logits `[V]` when `want_logits` (the lm_head is skipped for non-final prompt tokens).
    fn forward(&mut self, token: u32, pos: usize, want_logits: bool) -> anyhow::Result<Vec<f32>> {
        let src = Arc::clone(&self.source);
        let cfg = self.cfg.clone();
        let w = |key: TensorKey| check::fetch(src.as_ref(), &cfg, key);
        let (h_dim, eps) = (cfg.hidden_size, cfg.rms_norm_eps);

        let mut h = vec![0f32; h_dim]; // [H] residual stream
        let embd = w(TensorKey::TokenEmbd)?;
        nibble_quant::dequantize(embd.dtype, embd.row(token as usize), &mut h)
            .context("decoding the token embedding")?;
        self.emit(pos, None, "embd", &h);

        for l in 0..cfg.num_layers {
            let lw = |t: LayerTensor| w(TensorKey::Layer(l, t));
            self.attention_block(l, pos, &mut h, &lw)?;
            self.moe_block(l, pos, &mut h, &lw)?;
            self.emit(pos, Some(l), "h", &h);
        }
        if !want_logits {
            return Ok(Vec::new());
        }
        let mut x = vec![0f32; h_dim]; // [H]
        rmsnorm(
            &h,
            &vector(&w(TensorKey::OutputNorm)?, || "the output norm".into())?,
            eps,
            &mut x,
        );
        self.emit(pos, None, "final_norm", &x);
        let head = if cfg.tie_word_embeddings {
            TensorKey::TokenEmbd
        } else {
            TensorKey::Output
        };
        let mut logits = vec![0f32; cfg.vocab_size]; // [V]
        matvec(&w(head)?, 0, &x, &mut logits).context("lm_head")?;
        self.emit(pos, None, "logits", &logits);
        Ok(logits)
    }

    /// `h += Wo · attention(rope(qnorm(Wq·a)), cache + rope(knorm(Wk·a)), Wv·a)`, a = norm(h).
    fn attention_block<'a>(
        &mut self,
        l: usize,
        pos: usize,
        h: &mut [f32],
        lw: &impl Fn(LayerTensor) -> anyhow::Result<Weight<'a>>,
    ) -> anyhow::Result<()> {
        let cfg = &self.cfg;
        let (eps, q_dim, kv_dim) = (cfg.rms_norm_eps, cfg.q_dim(), cfg.kv_dim());
        let dims = AttnDims {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let mut a = vec![0f32; h.len()]; // [H]
        rmsnorm(
            h,
            &vector(&lw(LayerTensor::AttnNorm)?, || {
                format!("layer {l} attn norm")
            })?,
            eps,
            &mut a,
        );
        self.emit(pos, Some(l), "attn_norm", &a);

        let mut q = vec![0f32; q_dim]; // [Hq*D]
        let mut k = vec![0f32; kv_dim]; // [Hkv*D]
        let mut v = vec![0f32; kv_dim]; // [Hkv*D]
        matvec(&lw(LayerTensor::AttnQ)?, 0, &a, &mut q).context("attn q")?;
        matvec(&lw(LayerTensor::AttnK)?, 0, &a, &mut k).context("attn k")?;
        matvec(&lw(LayerTensor::AttnV)?, 0, &a, &mut v).context("attn v")?;
        self.emit(pos, Some(l), "q", &q);
        self.emit(pos, Some(l), "k", &k);
        self.emit(pos, Some(l), "v", &v);

        // Per-head QK-norm with one [D] weight shared by all heads, then RoPE (§1.4.3-4).
        rmsnorm_heads(
            &mut q,
            &vector(&lw(LayerTensor::QNorm)?, || format!("layer {l} q norm"))?,
            eps,
        );
        rmsnorm_heads(
            &mut k,
            &vector(&lw(LayerTensor::KNorm)?, || format!("layer {l} k norm"))?,
            eps,
        );
        self.emit(pos, Some(l), "q_normed", &q);
        self.emit(pos, Some(l), "k_normed", &k);
        rope_heads(&mut q, &self.rope, pos);
        rope_heads(&mut k, &self.rope, pos);
        self.emit(pos, Some(l), "q_rope", &q);
        self.emit(pos, Some(l), "k_rope", &k);

        self.kv.write(l, pos, &k, &v)?;
        let (keys, values) = self.kv.layer(l, pos + 1);
        let mut o = vec![0f32; q_dim]; // [Hq*D] heads concatenated in order
        attention(&dims, &q, keys, values, &mut o);
        self.emit(pos, Some(l), "attn", &o);

        let mut out = vec![0f32; h.len()]; // [H]
        matvec(&lw(LayerTensor::AttnOut)?, 0, &o, &mut out).context("attn output")?;
        self.emit(pos, Some(l), "attn_out", &out);
        for (hi, oi) in h.iter_mut().zip(&out) {
            *hi += oi;
        }
        self.emit(pos, Some(l), "h_attn", h);
        Ok(())
    }

    /// `h += MoE(norm(h))` (§1.7).
    fn moe_block<'a>(
        &mut self,
        l: usize,
        pos: usize,
        h: &mut [f32],
        lw: &impl Fn(LayerTensor) -> anyhow::Result<Weight<'a>>,
    ) -> anyhow::Result<()> {
        let (eps, e, k, renorm) = (
            self.cfg.rms_norm_eps,
            self.cfg.num_experts,
            self.cfg.num_experts_per_tok,
            self.cfg.norm_topk_prob,
        );
        let mut b = vec![0f32; h.len()]; // [H]
        rmsnorm(
            h,
            &vector(&lw(LayerTensor::FfnNorm)?, || format!("layer {l} ffn norm"))?,
            eps,
            &mut b,
        );
        self.emit(pos, Some(l), "ffn_norm", &b);

        let mut logits = vec![0f32; e]; // [E]
        matvec(&lw(LayerTensor::Router)?, 0, &b, &mut logits).context("router")?;
        self.emit(pos, Some(l), "router_logits", &logits);
        let (probs, routing) = route_logits(&logits, k, renorm);
        self.emit(pos, Some(l), "router_probs", &probs);
        if self.trace.is_some() {
            let ids: Vec<f32> = routing.experts.iter().map(|x| *x as f32).collect();
            self.emit(pos, Some(l), "moe_experts", &ids);
            self.emit(pos, Some(l), "moe_weights", &routing.weights);
        }

        let experts = ExpertWeights {
            gate: lw(LayerTensor::ExpGate)?,
            up: lw(LayerTensor::ExpUp)?,
            down: lw(LayerTensor::ExpDown)?,
        };
        let mut out = vec![0f32; h.len()]; // [H]
        moe_combine(&experts, &routing, &b, &mut out).context("experts")?;
        self.emit(pos, Some(l), "moe_out", &out);
        for (hi, oi) in h.iter_mut().zip(&out) {
            *hi += oi;
        }
        Ok(())
    }
}

/// Decode a 1-d tensor (a norm weight, named by `what` in errors) to f32.
fn vector(w: &Weight<'_>, what: impl FnOnce() -> String) -> anyhow::Result<Vec<f32>> {
    let mut out = vec![0f32; w.elements()];
    nibble_quant::dequantize(w.dtype, w.row(0), &mut out)
        .with_context(|| format!("decoding the {} weight", what()))?;
    Ok(out)
}

impl Backend for RefBackend {
    fn name(&self) -> String {
        "ref".to_string()
    }

    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }

    fn context_len(&self) -> usize {
        self.context_len
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn truncate(&mut self, pos: usize) -> anyhow::Result<()> {
        ensure!(
            pos <= self.pos,
            "cannot truncate to {pos}: only {} positions are cached",
            self.pos
        );
        self.pos = pos;
        Ok(())
    }

    fn prefill(&mut self, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        let start = self.pos;
        crate::check_prompt(self.cfg.vocab_size, tokens, start, self.context_len)?;
        let mut logits = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            let last = i + 1 == tokens.len();
            match self.forward(*t, start + i, last) {
                Ok(l) => logits = l,
                Err(e) => {
                    // A failed call appends nothing: the partly written slots are stale.
                    self.pos = start;
                    return Err(e);
                }
            }
            self.pos = start + i + 1;
        }
        Ok(logits)
    }

    /// Every intermediate the trace hook sees for this token (all of [`TRACE_NAMES`]; the
    /// lm_head ones included). An installed hook is suspended for the call.
    fn trace_step(&mut self, token: u32) -> anyhow::Result<Option<StepTrace>> {
        let sink: Arc<Mutex<StepTrace>> = Arc::default();
        let s = Arc::clone(&sink);
        let user = self.trace.replace(Box::new(move |_, name, v| {
            // A poisoned sink only happens after a panic in this very closure; drop the value.
            if let Ok(mut g) = s.lock() {
                g.push((name.to_string(), v.to_vec()));
            }
        }));
        let r = self.step(token);
        self.trace = user;
        r?;
        let out = std::mem::take(
            &mut *sink
                .lock()
                .map_err(|_| anyhow::anyhow!("trace sink poisoned"))?,
        );
        Ok(Some(out))
    }
}
