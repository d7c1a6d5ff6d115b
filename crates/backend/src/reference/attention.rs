//! Causal grouped-query attention of one query token over the cached positions (formats-spec §1.4.6).
//!
//! Causality is structural: the caller passes only the keys/values of positions `0..=p`, so no
//! mask is needed. Query head `j` reads KV head `j / G`, `G = Hq / Hkv` (consecutive blocks of G
//! query heads share one KV head). Scores, softmax and the weighted sum of values are computed in
//! f64 and rounded once; each head is computed by one thread.

use rayon::prelude::*;

/// Head counts and width of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    /// Hq.
    pub num_heads: usize,
    /// Hkv; must divide Hq.
    pub num_kv_heads: usize,
    /// D.
    pub head_dim: usize,
}

impl AttnDims {
    /// The KV head query head `j` reads.
    pub fn kv_head_of(&self, j: usize) -> usize {
        j / (self.num_heads / self.num_kv_heads)
    }
}

/// `out[j·D..(j+1)·D] = Σ_m softmax_m(q_j · k[m, g] / sqrt(D)) · v[m, g]`, `g = j / G`.
///
/// Shapes: `q` `[Hq·D]` (post q-norm and RoPE); `keys`, `values` `[n, Hkv·D]` for the `n >= 1`
/// visible positions; `out` `[Hq·D]`.
pub fn attention<'a>(
    dims: &AttnDims,
    q: &[f32],
    keys: &'a [f32],
    values: &'a [f32],
    out: &mut [f32],
) {
    let (hq, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let row = hkv * d;
    assert!(
        hkv > 0 && hq.is_multiple_of(hkv) && d > 0,
        "attention dims {dims:?}"
    );
    assert!(
        q.len() == hq * d && out.len() == hq * d,
        "attention q/out length"
    );
    assert!(
        keys.len() == values.len() && keys.len().is_multiple_of(row) && !keys.is_empty(),
        "attention needs whole, non-empty [n, Hkv*D] keys and values"
    );
    let n = keys.len() / row;
    let scale = 1.0 / (d as f64).sqrt();
    out.par_chunks_mut(d).enumerate().for_each(|(j, o)| {
        let g = dims.kv_head_of(j);
        let qj = &q[j * d..(j + 1) * d];
        // Head g of position m in a [n, Hkv*D] cache.
        let head = |cache: &'a [f32], m: usize| &cache[m * row + g * d..m * row + (g + 1) * d];
        // scores[m] = q_j · k[m, g] / sqrt(D), in f64.
        let scores: Vec<f64> = (0..n)
            .map(|m| super::ops::dot_f64(qj, head(keys, m)) * scale)
            .collect();
        let max = scores.iter().fold(f64::NEG_INFINITY, |a, b| a.max(*b));
        let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        let mut acc = vec![0f64; d]; // [D]
        for (m, e) in exps.iter().enumerate() {
            let p = e / sum;
            for (a, v) in acc.iter_mut().zip(head(values, m)) {
                *a += p * *v as f64;
            }
        }
        for (o, a) in o.iter_mut().zip(&acc) {
            *o = *a as f32;
        }
    });
}
