//! The CPU backend (`--backend cpu`): a Qwen3-MoE forward pass for machines without a GPU, as
//! fast as the cores and the memory bus allow while keeping the oracle's greedy tokens.
//!
//! What makes it fast against the oracle (`nibble_backend::RefBackend`, which decodes every row
//! into a scratch and sums in f64 one token at a time):
//! - the weights stay packed (Q4_0 as stored) and are decoded 32 at a time in registers, inside
//!   f32 products compiled for the CPU's vector unit ([`matmul`]);
//! - a prompt goes through each layer in chunks of up to [`PREFILL_CHUNK`] tokens: every weight
//!   row is read once per chunk, and each chosen expert once for all the chunk's tokens that
//!   chose it;
//! - each layer costs six fork-joins (q/k/v together, the attention, the o-proj, the router, the
//!   gate/up of every chosen expert together, their down rows together);
//! - concurrent sequences (`streams.rs`, the server's requests) share each forward pass.
//!
//! Numerics: f32 activations and sums (see [`matmul`]); the KV cache is f32 by default, or halves
//! with `CacheType::F16` (half the memory; each value the f16 the oracle's and the GPU's caches
//! hold, widened to f32 as the attention reads it). A token gives the
//! same bits whether it was prefilled in a chunk or decoded alone, and whatever the thread count.
//! Parity with the oracle is tested like the GPU's: identical greedy ids for 128 tokens, logits
//! cosine >= 0.99999.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocks;
pub mod matmul;
pub mod ops;
mod streams;
#[cfg(test)]
mod tests;

use anyhow::{ensure, Context, Result};
use matmul::{decode_row, Job};
use nibble_backend::reference::check;
use nibble_backend::{Backend, RowSink, StepTrace};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::kv_cache::CacheType;
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use ops::Heads;
use std::sync::Arc;

/// Most prompt tokens taken through a layer together: large enough that a chunk's tokens share
/// most chosen experts (256 tokens x 8 of 128 experts: ~16 tokens per expert), small enough that
/// its activations (~55 MB at Qwen3-30B-A3B's shapes, the MoE step's peak) stay modest.
pub const PREFILL_CHUNK: usize = 256;

/// Tokens per chunk when every token's logits are wanted ([`Backend::prefill_rows`]): a
/// chunk's rows are held at once (`[64, V]` f32, 39 MB for Qwen3's vocabulary).
pub const ROWS_CHUNK: usize = 64;

/// The per-layer vectors, decoded once at start-up.
struct LayerNorms {
    attn: Vec<f32>, // [H]
    ffn: Vec<f32>,  // [H]
    q: Vec<f32>,    // [D]
    k: Vec<f32>,    // [D]
}

/// One layer's cached keys or values `[context_len, Hkv·D]`, in the cache's type.
enum Rows {
    F32(Vec<f32>),
    /// Halves ([`nibble_model::kv_cache::to_f16`]): half the memory, the values the oracle's f16
    /// cache holds.
    F16(Vec<half::f16>),
}

impl Rows {
    fn new(kind: CacheType, n: usize) -> Result<Rows> {
        // `n` zeros, failing cleanly when the memory is not there.
        fn zeros<T: Clone>(n: usize, zero: T, kind: CacheType) -> Result<Vec<T>> {
            let mut v = Vec::new();
            v.try_reserve_exact(n)
                .with_context(|| format!("allocating a {n}-element {kind} KV cache"))?;
            v.resize(n, zero);
            Ok(v)
        }
        Ok(match kind {
            CacheType::F32 => Rows::F32(zeros(n, 0f32, kind)?),
            CacheType::F16 => Rows::F16(zeros(n, half::f16::ZERO, kind)?),
        })
    }

    /// Store `src` at element `at`, each value as the cache's type holds it.
    fn put(&mut self, at: usize, src: &[f32]) {
        match self {
            Rows::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            Rows::F16(v) => {
                for (d, s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = nibble_model::kv_cache::to_f16(*s);
                }
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Rows::F32(v) => v.len() * 4,
            Rows::F16(v) => v.len() * 2,
        }
    }

    fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Rows::F32(v) => Some(v),
            Rows::F16(_) => None,
        }
    }

    fn as_f16(&self) -> Option<&[half::f16]> {
        match self {
            Rows::F16(v) => Some(v),
            Rows::F32(_) => None,
        }
    }
}

/// One sequence's KV cache, every layer's rows of one [`CacheType`].
struct Cache {
    /// Per layer `[context_len, Hkv·D]`.
    keys: Vec<Rows>,
    /// Per layer `[context_len, Hkv·D]`.
    values: Vec<Rows>,
}

impl Cache {
    fn new(cfg: &Qwen3MoeConfig, context_len: usize, kind: CacheType) -> Result<Cache> {
        let layer = || -> Result<Rows> {
            let n = context_len
                .checked_mul(cfg.kv_dim())
                .context("KV cache size overflows")?;
            Rows::new(kind, n)
        };
        Ok(Cache {
            keys: (0..cfg.num_layers)
                .map(|_| layer())
                .collect::<Result<_>>()?,
            values: (0..cfg.num_layers)
                .map(|_| layer())
                .collect::<Result<_>>()?,
        })
    }
}

/// Where a token of a forward pass goes: which KV cache ([`MAIN`] or a stream's) and position.
#[derive(Debug, Clone, Copy)]
struct Place {
    cache: usize,
    pos: usize,
}

/// The main sequence's cache (`prefill`/`step`); stream `s` uses cache `1 + s`.
const MAIN: usize = 0;

/// The CPU backend: the main sequence and up to `streams` independent ones (`streams.rs`), each
/// with a KV cache of `context_len` positions.
pub struct CpuBackend {
    source: Arc<dyn WeightSource>,
    cfg: Qwen3MoeConfig,
    context_len: usize,
    /// Tokens in the main sequence's cache.
    pos: usize,
    /// How cached keys and values are rounded (the oracle's rounding for the same type).
    cache_type: CacheType,
    /// `caches[MAIN]`, then one per stream slot, allocated when the slot is first used.
    caches: Vec<Option<Cache>>,
    streams: streams::Streams,
    /// The rotation: `[D/2]` inverse frequencies (f32, as Hugging Face holds them) and YaRN's
    /// attention factor.
    rope: nibble_model::rope::RopeTable,
    norms: Vec<LayerNorms>,
    out_norm: Vec<f32>, // [H]
    /// Set during [`Backend::trace_step`] only: the one token's named intermediates.
    trace: Option<StepTrace>,
}

/// Append `values` to the trace (if tracing) under the oracle's name: `l{layer}.{name}`, or
/// `name` without a layer. Only ever set for a one-token forward pass.
fn emit(trace: &mut Option<StepTrace>, layer: Option<usize>, name: &str, values: &[f32]) {
    if let Some(t) = trace {
        let name = match layer {
            Some(l) => format!("l{l}.{name}"),
            None => name.to_string(),
        };
        t.push((name, values.to_vec()));
    }
}

impl CpuBackend {
    /// Check the config and every tensor of `source` once, decode the norm weights and allocate
    /// the KV cache for `context_len` positions (at most the model's `max_context()`).
    pub fn new(source: Arc<dyn WeightSource>, context_len: usize) -> Result<Self> {
        Self::with_streams(source, context_len, 0)
    }

    /// [`CpuBackend::new`] with a multi-stream path of `streams` sequences (at most
    /// `streams::MAX_STREAMS`), each with a cache of `context_len` positions.
    pub fn with_streams(
        source: Arc<dyn WeightSource>,
        context_len: usize,
        streams: usize,
    ) -> Result<Self> {
        Self::with_cache(source, context_len, streams, CacheType::default())
    }

    /// [`CpuBackend::with_streams`] with KV caches of type `cache_type`.
    pub fn with_cache(
        source: Arc<dyn WeightSource>,
        context_len: usize,
        streams: usize,
        cache_type: CacheType,
    ) -> Result<Self> {
        ensure!(
            streams <= streams::MAX_STREAMS,
            "at most {} streams, not {streams}",
            streams::MAX_STREAMS
        );
        let cfg = source.config().clone();
        cfg.validate().context("invalid model config")?;
        ensure!(context_len > 0, "the context length must be at least 1");
        ensure!(
            context_len <= cfg.max_context(),
            "a context of {context_len} positions exceeds the model's context ({})",
            cfg.max_context()
        );
        check::check_all(source.as_ref(), &cfg)?;
        let vector = |key: TensorKey| -> Result<Vec<f32>> {
            let w = source.weight(key)?;
            let mut out = vec![0f32; w.elements()];
            nibble_quant::dequantize(w.dtype, w.row(0), &mut out)
                .with_context(|| format!("decoding {key:?}"))?;
            Ok(out)
        };
        let norms = (0..cfg.num_layers)
            .map(|l| {
                let v = |t| vector(TensorKey::Layer(l, t));
                Ok(LayerNorms {
                    attn: v(LayerTensor::AttnNorm)?,
                    ffn: v(LayerTensor::FfnNorm)?,
                    q: v(LayerTensor::QNorm)?,
                    k: v(LayerTensor::KNorm)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut caches = vec![Some(Cache::new(&cfg, context_len, cache_type)?)];
        caches.resize_with(1 + streams, || None);
        let rope = cfg.rope();
        Ok(CpuBackend {
            out_norm: vector(TensorKey::OutputNorm)?,
            source,
            cfg,
            context_len,
            pos: 0,
            cache_type,
            caches,
            streams: streams::Streams::new(streams),
            rope,
            norms,
            trace: None,
        })
    }

    /// Run `tokens` through every layer, token `i` at `places[i]` (its KV rows written there;
    /// it attends to its cache's positions up to its own), and return the logits `[V]` of the
    /// tokens listed in `logits_of`, in that order.
    fn forward(
        &mut self,
        tokens: &[u32],
        places: &[Place],
        logits_of: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let src = Arc::clone(&self.source);
        let w = |key: TensorKey| src.weight(key);
        let (hd, n) = (self.cfg.hidden_size, tokens.len());
        let mut h = vec![0f32; n * hd]; // [n, H] residual stream
        let embd = w(TensorKey::TokenEmbd)?;
        for (t, tok) in tokens.iter().enumerate() {
            decode_row(&embd, *tok as usize, &mut h[t * hd..(t + 1) * hd])
                .context("the token embedding")?;
        }
        emit(&mut self.trace, None, "embd", &h);
        for l in 0..self.cfg.num_layers {
            let lw = |t: LayerTensor| w(TensorKey::Layer(l, t));
            self.attention_block(l, places, &mut h, &lw)
                .with_context(|| format!("layer {l} attention"))?;
            self.moe_block(l, &mut h, &lw)
                .with_context(|| format!("layer {l} experts"))?;
            emit(&mut self.trace, Some(l), "h", &h);
        }
        if logits_of.is_empty() {
            return Ok(Vec::new());
        }
        let mut x = vec![0f32; logits_of.len() * hd]; // [m, H]
        for (xt, t) in x.chunks_exact_mut(hd).zip(logits_of) {
            ops::rmsnorm(
                &h[t * hd..(t + 1) * hd],
                &self.out_norm,
                self.cfg.rms_norm_eps,
                xt,
            );
        }
        emit(&mut self.trace, None, "final_norm", &x);
        let head = w(if self.cfg.tie_word_embeddings {
            TensorKey::TokenEmbd
        } else {
            TensorKey::Output
        })?;
        let job = Job {
            w: &head,
            row0: 0,
            rows: self.cfg.vocab_size,
            x: &x,
            n: logits_of.len(),
        };
        let out = matmul::run(&[job]).context("lm_head")?;
        let all = token_major(&out[0], logits_of.len()); // [m, V]
        emit(&mut self.trace, None, "logits", &all);
        Ok(all
            .chunks_exact(self.cfg.vocab_size)
            .map(|c| c.to_vec())
            .collect())
    }

    /// `h += Wo · attention(rope(qnorm(Wq·a)), cache + rope(knorm(Wk·a)), Wv·a)`, `a = norm(h)`,
    /// for the `n` tokens of `h` (`[n, H]`) at `places`.
    /// Bytes of the KV caches allocated so far (the main sequence's, and each stream slot's
    /// once used).
    pub fn kv_cache_bytes(&self) -> usize {
        self.caches
            .iter()
            .flatten()
            .flat_map(|c| c.keys.iter().chain(&c.values))
            .map(Rows::bytes)
            .sum()
    }

    /// Each token's view of its cache in layer `l`: the keys and values up to and including its
    /// own position, as `get` reads the rows (the backend's cache type).
    fn views<'s, T>(
        &'s self,
        l: usize,
        places: &[Place],
        get: fn(&Rows) -> Option<&[T]>,
    ) -> Result<Vec<(&'s [T], &'s [T])>> {
        let kvd = self.cfg.kv_dim();
        places
            .iter()
            .map(|p| {
                let c = self.caches[p.cache]
                    .as_ref()
                    .context("a KV cache that was never allocated")?;
                let visible = (p.pos + 1) * kvd;
                let rows = |r: &'s Rows| -> Result<&'s [T]> {
                    let all = get(r).context("a KV cache of another type")?;
                    Ok(&all[..visible])
                };
                Ok((rows(&c.keys[l])?, rows(&c.values[l])?))
            })
            .collect()
    }

    fn attention_block<'a>(
        &mut self,
        l: usize,
        places: &[Place],
        h: &mut [f32],
        lw: &impl Fn(LayerTensor) -> Result<Weight<'a>>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (hd, eps, qd, kvd) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.q_dim(), cfg.kv_dim());
        let n = h.len() / hd;
        let norms = &self.norms[l];
        let mut a = vec![0f32; n * hd]; // [n, H]
        for (ht, at) in h.chunks_exact(hd).zip(a.chunks_exact_mut(hd)) {
            ops::rmsnorm(ht, &norms.attn, eps, at);
        }
        emit(&mut self.trace, Some(l), "attn_norm", &a);
        let (wq, wk, wv) = (
            lw(LayerTensor::AttnQ)?,
            lw(LayerTensor::AttnK)?,
            lw(LayerTensor::AttnV)?,
        );
        let job = |w, rows| Job {
            w,
            row0: 0,
            rows,
            x: &a,
            n,
        };
        let outs = matmul::run(&[job(&wq, qd), job(&wk, kvd), job(&wv, kvd)])?;
        let mut q = token_major(&outs[0], n); // [n, Hq·D]
        let mut k = token_major(&outs[1], n); // [n, Hkv·D]
        let v = token_major(&outs[2], n); // [n, Hkv·D]
        for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
            emit(&mut self.trace, Some(l), name, x);
        }
        for (t, place) in places.iter().enumerate() {
            let angles = ops::rope_angles(&self.rope, place.pos);
            let qt = &mut q[t * qd..(t + 1) * qd];
            ops::rmsnorm_heads(qt, &norms.q, eps);
            emit(&mut self.trace, Some(l), "q_normed", qt);
            ops::rope_heads(qt, &angles);
            let cache = self.caches[place.cache]
                .as_mut()
                .context("a KV cache that was never allocated")?;
            let kt = &mut k[t * kvd..(t + 1) * kvd];
            ops::rmsnorm_heads(kt, &norms.k, eps);
            emit(&mut self.trace, Some(l), "k_normed", kt);
            ops::rope_heads(kt, &angles);
            emit(&mut self.trace, Some(l), "q_rope", qt);
            emit(&mut self.trace, Some(l), "k_rope", kt);
            // The trace saw the exact k; the cache holds it as its type does, as the oracle's.
            cache.keys[l].put(place.pos * kvd, kt);
            cache.values[l].put(place.pos * kvd, &v[t * kvd..(t + 1) * kvd]);
        }
        let heads = Heads {
            q: cfg.num_heads,
            kv: cfg.num_kv_heads,
            dim: cfg.head_dim,
        };
        let att = match self.cache_type {
            CacheType::F32 => ops::attention(heads, &q, &self.views(l, places, Rows::as_f32)?),
            CacheType::F16 => ops::attention(heads, &q, &self.views(l, places, Rows::as_f16)?),
        }; // [n, Hq·D]
        emit(&mut self.trace, Some(l), "attn", &att);
        let wo = lw(LayerTensor::AttnOut)?;
        let o = matmul::run(&[Job {
            w: &wo,
            row0: 0,
            rows: hd,
            x: &att,
            n,
        }])?;
        emit(&mut self.trace, Some(l), "attn_out", &token_major(&o[0], n));
        add_token_major(h, &o[0], n);
        emit(&mut self.trace, Some(l), "h_attn", h);
        Ok(())
    }

    /// `h += Σ_k w_k · down_k(silu(gate_k · b) ⊙ (up_k · b))`, `b = norm(h)`, over each token's
    /// top-k experts (formats-spec §1.7). Tokens are grouped by expert, so an expert's rows are
    /// read once for every token of the chunk that chose it.
    fn moe_block<'a>(
        &mut self,
        l: usize,
        h: &mut [f32],
        lw: &impl Fn(LayerTensor) -> Result<Weight<'a>>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (hd, inner, e_count) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
        let n = h.len() / hd;
        let mut b = vec![0f32; n * hd]; // [n, H]
        for (ht, bt) in h.chunks_exact(hd).zip(b.chunks_exact_mut(hd)) {
            ops::rmsnorm(ht, &self.norms[l].ffn, cfg.rms_norm_eps, bt);
        }
        emit(&mut self.trace, Some(l), "ffn_norm", &b);
        let router = lw(LayerTensor::Router)?;
        let logits = matmul::run(&[Job {
            w: &router,
            row0: 0,
            rows: e_count,
            x: &b,
            n,
        }])?;
        let logits = token_major(&logits[0], n); // [n, E]
        let routes: Vec<Vec<(usize, f32)>> = logits
            .chunks_exact(e_count)
            .map(|lg| ops::route(lg, cfg.num_experts_per_tok, cfg.norm_topk_prob))
            .collect();
        if self.trace.is_some() {
            emit(&mut self.trace, Some(l), "router_logits", &logits);
            let ids: Vec<f32> = routes[0].iter().map(|(e, _)| *e as f32).collect();
            let weights: Vec<f32> = routes[0].iter().map(|(_, w)| *w).collect();
            emit(&mut self.trace, Some(l), "moe_experts", &ids);
            emit(&mut self.trace, Some(l), "moe_weights", &weights);
        }

        // Per used expert: the tokens that chose it, in token order, and their inputs [n_e, H].
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); e_count];
        for (t, r) in routes.iter().enumerate() {
            for (e, _) in r {
                members[*e].push(t);
            }
        }
        let used: Vec<usize> = (0..e_count).filter(|e| !members[*e].is_empty()).collect();
        let inputs: Vec<Vec<f32>> = used
            .iter()
            .map(|e| {
                members[*e]
                    .iter()
                    .flat_map(|t| &b[t * hd..(t + 1) * hd])
                    .copied()
                    .collect()
            })
            .collect();
        let (gate, up, down) = (
            lw(LayerTensor::ExpGate)?,
            lw(LayerTensor::ExpUp)?,
            lw(LayerTensor::ExpDown)?,
        );
        let mut jobs = Vec::with_capacity(2 * used.len());
        for (e, x) in used.iter().zip(&inputs) {
            for w in [&gate, &up] {
                jobs.push(Job {
                    w,
                    row0: e * inner,
                    rows: inner,
                    x,
                    n: members[*e].len(),
                });
            }
        }
        let gu = matmul::run(&jobs)?;
        // act[e] [n_e, I] = silu(gate) ⊙ up, token-major for the down products.
        let acts: Vec<Vec<f32>> = gu
            .chunks_exact(2)
            .zip(&used)
            .map(|(pair, e)| {
                let ne = members[*e].len();
                let (g, u) = (token_major(&pair[0], ne), token_major(&pair[1], ne));
                g.iter().zip(&u).map(|(g, u)| ops::swiglu(*g, *u)).collect()
            })
            .collect();
        let jobs: Vec<Job> = used
            .iter()
            .zip(&acts)
            .map(|(e, x)| Job {
                w: &down,
                row0: e * hd,
                rows: hd,
                x,
                n: members[*e].len(),
            })
            .collect();
        let ys = matmul::run(&jobs)?; // per used expert [H, n_e]

        // Combine each token's experts in its routing order (best first).
        let slot_of: Vec<usize> = {
            let mut s = vec![usize::MAX; e_count];
            for (i, e) in used.iter().enumerate() {
                s[*e] = i;
            }
            s
        };
        let mut seen = vec![0usize; e_count]; // tokens of expert e already placed
        let mut rank = vec![Vec::new(); n]; // rank[t][k] = column of token t in its k-th expert's y
        for (t, r) in routes.iter().enumerate() {
            for (e, _) in r {
                rank[t].push(seen[*e]);
                seen[*e] += 1;
            }
        }
        for (t, r) in routes.iter().enumerate() {
            let ht = &mut h[t * hd..(t + 1) * hd];
            let mut out = vec![0f32; hd]; // [H]
            for ((e, wt), col) in r.iter().zip(&rank[t]) {
                let y = &ys[slot_of[*e]];
                let ne = members[*e].len();
                for (row, o) in out.iter_mut().enumerate() {
                    *o += wt * y[row * ne + col];
                }
            }
            emit(&mut self.trace, Some(l), "moe_out", &out);
            for (hi, o) in ht.iter_mut().zip(&out) {
                *hi += o;
            }
        }
        Ok(())
    }
}

impl CpuBackend {
    /// Feed `tokens` (checked: ids in the vocabulary, room in the context) to cache `cache` from
    /// position `start`, in chunks of [`PREFILL_CHUNK`]; the last token's logits. With `rows =
    /// (from, row)`, the logits of every token from index `from` on go to `row` instead
    /// ([`Backend::prefill_rows`]) and the result is empty: chunks of [`ROWS_CHUNK`] then, as
    /// each chunk's logits are held at once.
    fn prefill_cache(
        &mut self,
        cache: usize,
        start: usize,
        tokens: &[u32],
        mut rows: Option<(usize, &mut RowSink<'_>)>,
    ) -> Result<Vec<f32>> {
        let size = if rows.is_some() {
            ROWS_CHUNK
        } else {
            PREFILL_CHUNK
        };
        let mut logits = Vec::new();
        let chunks = tokens.len().div_ceil(size);
        for (i, chunk) in tokens.chunks(size).enumerate() {
            let first = start + i * size;
            let places: Vec<Place> = (0..chunk.len())
                .map(|t| Place {
                    cache,
                    pos: first + t,
                })
                .collect();
            let all: Vec<usize> = (0..chunk.len()).collect();
            let wanted = match &rows {
                Some((from, _)) => from.saturating_sub(i * size).min(chunk.len()),
                None => 0,
            };
            let last: &[usize] = match (&rows, i + 1 == chunks) {
                (Some(_), _) => &all[wanted..],
                (None, true) => &all[chunk.len() - 1..],
                (None, false) => &[],
            };
            let mut out = self.forward(chunk, &places, last)?;
            match rows.as_mut() {
                Some((_, row)) => {
                    for (j, l) in out.iter().enumerate() {
                        row(i * size + wanted + j, l)?;
                    }
                }
                None => logits = out.pop().unwrap_or_default(),
            }
        }
        Ok(logits)
    }

    /// Token ids in the vocabulary, `n` more positions in a cache holding `pos`.
    fn check_tokens(&self, tokens: &[u32], pos: usize) -> Result<()> {
        nibble_backend::check_prompt(self.cfg.vocab_size, tokens, pos, self.context_len)
    }
}

/// `[rows, n]` (a matmul job's output) to `[n, rows]`.
fn token_major(out: &[f32], n: usize) -> Vec<f32> {
    if n == 1 {
        return out.to_vec();
    }
    let rows = out.len() / n;
    let mut t = vec![0f32; out.len()];
    for (r, vals) in out.chunks_exact(n).enumerate() {
        for (i, v) in vals.iter().enumerate() {
            t[i * rows + r] = *v;
        }
    }
    t
}

/// `h[t, r] += out[r, t]` (`h` `[n, rows]`, `out` `[rows, n]`).
fn add_token_major(h: &mut [f32], out: &[f32], n: usize) {
    let rows = h.len() / n;
    for (r, vals) in out.chunks_exact(n).enumerate() {
        for (i, v) in vals.iter().enumerate() {
            h[i * rows + r] += v;
        }
    }
}

impl Backend for CpuBackend {
    /// `cpu (<Q4_0 kernel>, <threads> threads)`.
    fn name(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            matmul::q4_kernel(),
            rayon::current_num_threads()
        )
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

    fn truncate(&mut self, pos: usize) -> Result<()> {
        ensure!(
            pos <= self.pos,
            "cannot truncate to {pos}: only {} positions are cached",
            self.pos
        );
        self.pos = pos;
        Ok(())
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let start = self.pos;
        self.check_tokens(tokens, start)?;
        // A failed call appends nothing: the rows it wrote are past the position.
        let logits = self.prefill_cache(MAIN, start, tokens, None)?;
        self.pos = start + tokens.len();
        Ok(logits)
    }

    fn prefill_rows(&mut self, tokens: &[u32], from: usize, row: &mut RowSink<'_>) -> Result<()> {
        let start = self.pos;
        self.check_tokens(tokens, start)?;
        self.prefill_cache(MAIN, start, tokens, Some((from, row)))?;
        self.pos = start + tokens.len();
        Ok(())
    }

    /// The oracle's intermediates of one step under its names, all but `router_probs` (the
    /// routing keeps its softmax to itself). Appends the token as `step` does.
    fn trace_step(&mut self, token: u32) -> Result<Option<StepTrace>> {
        let pos = self.pos;
        self.check_tokens(&[token], pos)?;
        self.trace = Some(Vec::new());
        let place = Place { cache: MAIN, pos };
        let run = self.forward(&[token], &[place], &[0]);
        let trace = self.trace.take();
        run?;
        self.pos = pos + 1;
        Ok(trace)
    }

    fn max_streams(&self) -> usize {
        self.streams.len()
    }

    fn stream_prefill(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.streams_prefill(slot, start, tokens, None)
    }

    fn stream_prefill_rows(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
        row: &mut RowSink<'_>,
    ) -> Result<()> {
        self.streams_prefill(slot, start, tokens, Some((0, row)))?;
        Ok(())
    }

    fn streams_decode_greedy(
        &mut self,
        tokens: &[Option<u32>],
        n: usize,
        eos: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        self.streams_run(Some(tokens), n, eos)?;
        Ok(self
            .streams_take()
            .unwrap_or_else(|| vec![Vec::new(); self.streams.len()]))
    }

    fn streams_queue(
        &mut self,
        restart: Option<&[Option<u32>]>,
        n: usize,
        eos: &[u32],
    ) -> Result<usize> {
        self.streams_run(restart, n, eos)
    }

    fn streams_collect(&mut self) -> Result<Option<Vec<Vec<u32>>>> {
        Ok(self.streams_take())
    }

    fn streams_end(&mut self, slot: usize) -> Result<()> {
        self.streams_stop(slot)
    }

    fn streams_step(&mut self, tokens: &[Option<u32>]) -> Result<Vec<Option<Vec<f32>>>> {
        self.streams_logits(tokens)
    }

    /// A plain parallel read of 1 GiB (summed as u64 words, every core), best of 5: what the
    /// memory bus gives a streaming read, against which `bench` puts the decode's weight rate.
    fn read_bandwidth_gbps(&mut self) -> Result<Option<f64>> {
        Ok(Some(read_gbps(1 << 30, 5)?))
    }
}

/// See [`CpuBackend::read_bandwidth_gbps`].
fn read_gbps(bytes: usize, reps: usize) -> Result<f64> {
    use rayon::prelude::*;
    let words = bytes / 8;
    let mut buf: Vec<u64> = Vec::new();
    buf.try_reserve_exact(words)
        .context("allocating the bandwidth probe's buffer")?;
    buf.extend((0..words as u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = std::time::Instant::now();
        let sum = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, w| a.wrapping_add(*w)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / best / 1e9)
}
