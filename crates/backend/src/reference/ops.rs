//! Scalar building blocks of the reference forward pass: dot, matvec, RMSNorm, RoPE, softmax, SiLU.
//!
//! Numerics (the oracle's contract, so that a fast backend knows what it is compared with):
//! - activations are f32 vectors; every reduction (dot product, sum of squares, softmax sum)
//!   accumulates in f64 in index order and is rounded to f32 once at the end;
//! - weights are decoded row by row with `nibble_quant::dequantize` into an f32 scratch, never
//!   the whole tensor;
//! - parallel loops give each output element to exactly one thread, which computes it in a fixed
//!   order, so results are bit-identical whatever the thread count.

use anyhow::{ensure, Context};
use nibble_model::rope::RopeTable;
use nibble_model::weights::Weight;
use rayon::prelude::*;

/// `Σ a[i]·b[i]`, accumulated in f64 in index order.
pub fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    let mut acc = 0f64;
    for (x, y) in a.iter().zip(b) {
        acc += *x as f64 * *y as f64;
    }
    acc
}

/// `out[r] = Σ_i W[row0 + r, i] · x[i]` for `r < out.len()`, where `W` is `w` viewed as
/// `[rows, cols]` (leading dims flattened, so expert `e` of an `[E, I, H]` tensor starts at row
/// `e·I`). Rows are decoded on the fly; only the requested rows are touched.
pub fn matvec(w: &Weight<'_>, row0: usize, x: &[f32], out: &mut [f32]) -> anyhow::Result<()> {
    let cols = *w.shape.last().context("matvec on a 0-d tensor")?;
    ensure!(
        cols == x.len(),
        "matvec: tensor rows have {cols} elements but the input has {}",
        x.len()
    );
    let rows = w.elements().checked_div(cols).unwrap_or(0);
    ensure!(
        row0.checked_add(out.len()).is_some_and(|end| end <= rows),
        "matvec: rows {row0}..{} requested from a tensor of {rows} rows",
        row0.saturating_add(out.len())
    );
    // Rows are cheap (a few thousand elements); batching a few per task keeps rayon's overhead small.
    out.par_iter_mut()
        .enumerate()
        .with_min_len(8)
        .try_for_each_init(
            || vec![0f32; cols], // [cols] decoded row
            |row, (r, o)| -> anyhow::Result<()> {
                nibble_quant::dequantize(w.dtype, w.row(row0 + r), row)?;
                *o = dot_f64(row, x) as f32;
                Ok(())
            },
        )
}

/// RMSNorm (formats-spec §1.5): `out[i] = w[i] · x[i] / sqrt(mean(x²) + eps)`, in f64.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == w.len() && x.len() == out.len() && !x.is_empty(),
        "rmsnorm lengths"
    );
    let ss = dot_f64(x, x);
    let inv = 1.0 / (ss / x.len() as f64 + eps as f64).sqrt();
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = (*wi as f64 * *xi as f64 * inv) as f32;
    }
}

/// In-place RMSNorm of each `w.len()`-long chunk of `x` with the shared weight `w` (the per-head
/// q/k norm: one `[D]` weight for every head).
pub fn rmsnorm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    assert!(
        x.len().is_multiple_of(w.len()),
        "rmsnorm_heads: not whole heads"
    );
    let mut tmp = vec![0f32; w.len()]; // [D]
    for head in x.chunks_exact_mut(w.len()) {
        rmsnorm(head, w, eps, &mut tmp);
        head.copy_from_slice(&tmp);
    }
}

/// Rotate one head vector `x` `[D]` in place at position `pos` (rotate-half / NeoX pairing:
/// element `i` with `i + D/2`, formats-spec §1.6) by `rope`'s frequencies, then scale it by its
/// attention factor (YaRN's; 1 otherwise), as transformers scales its cos and sin. The angle
/// `pos · f_i` is exact in f64.
pub fn rope_head(x: &mut [f32], rope: &RopeTable, pos: usize) {
    let half = rope.inv_freq.len();
    assert_eq!(x.len(), 2 * half, "rope: head of the wrong length");
    let af = f64::from(rope.attention_factor);
    for (i, f) in rope.inv_freq.iter().enumerate() {
        let angle = pos as f64 * *f as f64;
        let (s, c) = angle.sin_cos();
        let (a, b) = (x[i] as f64, x[i + half] as f64);
        x[i] = ((a * c - b * s) * af) as f32;
        x[i + half] = ((b * c + a * s) * af) as f32;
    }
}

/// RoPE on every `D`-long head of `x` (`D = 2·rope.inv_freq.len()`).
pub fn rope_heads(x: &mut [f32], rope: &RopeTable, pos: usize) {
    for head in x.chunks_exact_mut(2 * rope.inv_freq.len()) {
        rope_head(head, rope, pos);
    }
}

/// Softmax in f64 (max subtracted first), each probability rounded to f32 once.
pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64));
    let exps: Vec<f64> = x.iter().map(|v| (*v as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}

/// `silu(z) = z / (1 + e^(−z))` in f64.
pub fn silu_f64(z: f64) -> f64 {
    z / (1.0 + (-z).exp())
}

/// [`silu_f64`] rounded to f32.
pub fn silu(z: f32) -> f32 {
    silu_f64(z as f64) as f32
}
