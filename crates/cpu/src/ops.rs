//! The small per-token operations of the CPU backend's forward pass: RMSNorm, RoPE, causal
//! attention over the f32 KV cache, routing. All in f32 except where noted; the cost of a token
//! is in the weight products ([`crate::matmul`]), not here.

use crate::matmul::dot;
use nibble_model::rope::RopeTable;
use rayon::prelude::*;

/// `out = w ⊙ x / sqrt(mean(x²) + eps)`; the sum of squares in f64 (cheap, and it keeps the
/// norm's scale as exact as the oracle's).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let inv = (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32;
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// [`rmsnorm`] in place on every `w.len()`-long head of `x` (the per-head q/k norm).
pub fn rmsnorm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    let mut tmp = vec![0f32; w.len()]; // [D]
    for head in x.chunks_exact_mut(w.len()) {
        rmsnorm(head, w, eps, &mut tmp);
        head.copy_from_slice(&tmp);
    }
}

/// `(cos, sin)` of the RoPE angles `pos · f_i` for `i < D/2` (`rope.inv_freq` `[D/2]`), both
/// times YaRN's attention factor (1 otherwise), as transformers scales them; the angle and its
/// sine in f64, so a position deep in the context loses nothing to f32 rounding.
pub fn rope_angles(rope: &RopeTable, pos: usize) -> Vec<(f32, f32)> {
    let af = f64::from(rope.attention_factor);
    rope.inv_freq
        .iter()
        .map(|f| {
            let (s, c) = (pos as f64 * *f as f64).sin_cos();
            ((c * af) as f32, (s * af) as f32)
        })
        .collect()
}

/// Rotate every `2·angles.len()`-long head of `x` in place (rotate-half pairing: element `i`
/// with `i + D/2`, formats-spec §1.6).
pub fn rope_heads(x: &mut [f32], angles: &[(f32, f32)]) {
    let half = angles.len();
    for head in x.chunks_exact_mut(2 * half) {
        let (a, b) = head.split_at_mut(half);
        for ((ai, bi), (c, s)) in a.iter_mut().zip(b.iter_mut()).zip(angles) {
            let (x0, x1) = (*ai, *bi);
            *ai = x0 * c - x1 * s;
            *bi = x1 * c + x0 * s;
        }
    }
}

/// Head counts and width of one attention layer.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    /// Hq
    pub q: usize,
    /// Hkv (divides Hq)
    pub kv: usize,
    /// D
    pub dim: usize,
}

/// An element of a KV cache the attention reads: f32, or a half (an f16 cache).
pub trait Cached: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    /// `q · k` as [`dot`] sums it (`buf`: scratch for the halves widened to f32).
    fn dot(q: &[f32], k: &[Self], buf: &mut Vec<f32>) -> f32;
}

impl Cached for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn dot(q: &[f32], k: &[f32], _: &mut Vec<f32>) -> f32 {
        dot(q, k)
    }
}

impl Cached for half::f16 {
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn dot(q: &[f32], k: &[half::f16], buf: &mut Vec<f32>) -> f32 {
        buf.clear();
        buf.extend(k.iter().map(|x| x.to_f32()));
        dot(q, buf)
    }
}

/// GQA attention of `n` query tokens, token `t` over `views[t]`: the keys and values
/// `[m_t, Hkv·D]` of the positions it sees (its own cache up to and including its position,
/// so causality is in the views, not a mask). `q` `[n, Hq·D]` (normed and rotated); returns
/// `[n, Hq·D]`. One parallel task per (token, head); query head `j` reads kv head
/// `j / (Hq / Hkv)`.
pub fn attention<T: Cached>(h: Heads, q: &[f32], views: &[(&[T], &[T])]) -> Vec<f32> {
    let (d, row) = (h.dim, h.kv * h.dim);
    let group = h.q / h.kv;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; q.len()]; // [n, Hq·D]
    out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
        let (t, j) = (i / h.q, i % h.q);
        let (keys, values) = views[t];
        let visible = keys.len() / row;
        let g = j / group;
        let qj = &q[i * d..(i + 1) * d];
        // Head g of cached position m.
        let head = |m: usize| m * row + g * d..m * row + (g + 1) * d;
        let mut kbuf = Vec::new(); // [D] a key row as f32, for a cache of halves
        let mut scores: Vec<f32> = (0..visible)
            .map(|m| T::dot(qj, &keys[head(m)], &mut kbuf) * scale)
            .collect(); // [visible]
        let max = scores.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        for (m, p) in scores.iter().enumerate() {
            let p = p * inv;
            for (a, v) in o.iter_mut().zip(&values[head(m)]) {
                *a += p * v.to_f32();
            }
        }
    });
    out
}

/// Softmax of the router logits, then the `k` best experts (ties to the lower id) and their
/// weights, renormalised to sum 1 when `renormalise` (Qwen3's `norm_topk_prob`).
pub fn route(logits: &[f32], k: usize, renormalise: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
    let exps: Vec<f64> = logits
        .iter()
        .map(|l| (*l as f64 - max as f64).exp())
        .collect(); // in f64 from the subtraction on, as the oracle
    let sum: f64 = exps.iter().sum();
    let probs: Vec<f32> = exps.iter().map(|e| (e / sum) as f32).collect();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Stable: equal probabilities keep the lower expert id first.
    order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
    order.truncate(k);
    let kept: f64 = order.iter().map(|e| probs[*e] as f64).sum();
    order
        .into_iter()
        .map(|e| {
            let p = probs[e];
            let w = if renormalise {
                (p as f64 / kept) as f32
            } else {
                p
            };
            (e, w)
        })
        .collect()
}

/// `silu(g) · u`.
pub fn swiglu(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}
