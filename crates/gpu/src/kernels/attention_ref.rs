//! Scalar references of the attention kernels (f64 where it matters), for the lavapipe tests and
//! the trace comparisons: the q/k norm + RoPE and single-query GQA attention over a cache.

use super::{rope, AttentionParams};

/// Scalar reference of the q/k norm + RoPE done inside the chunk kernel: returns (roped q `[Hq*D]`, roped k `[Hkv*D]`) from the
/// raw fused `qkv`. Norm in f64; angle `f32(pos) * inv_freq` rounded in f32 as HF does, then
/// cos/sin in f64.
pub fn rope_ref(
    p: &AttentionParams,
    qkv: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    pos: u32,
) -> (Vec<f32>, Vec<f32>) {
    let d = p.head_dim as usize;
    let half = d / 2;
    // The kernels' convention: plain rotated q and k, YaRN's attention factor in the score
    // scale (`attention_ref`).
    let freqs = rope(p).inv_freq;
    let head = |x: &[f32], w: &[f32]| -> Vec<f32> {
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + p.eps as f64).sqrt();
        let y: Vec<f64> = x
            .iter()
            .zip(w)
            .map(|(v, w)| *v as f64 * r * *w as f64)
            .collect();
        let mut out = vec![0f32; d];
        for i in 0..half {
            let a = (pos as f32 * freqs[i]) as f64;
            let (s, c) = a.sin_cos();
            out[i] = (y[i] * c - y[i + half] * s) as f32;
            out[i + half] = (y[i + half] * c + y[i] * s) as f32;
        }
        out
    };
    let (hq, hkv) = (p.heads as usize, p.kv_heads as usize);
    let q = (0..hq)
        .flat_map(|j| head(&qkv[j * d..(j + 1) * d], q_norm))
        .collect();
    let k = (0..hkv)
        .flat_map(|j| head(&qkv[(hq + j) * d..(hq + j + 1) * d], k_norm))
        .collect();
    (q, k)
}

/// Scalar reference of single-query GQA attention at `pos` (f64 softmax): `q [Hq*D]`,
/// caches `[ctx, Hkv, D]`, output `[Hq*D]`.
pub fn attention_ref(
    p: &AttentionParams,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos: u32,
) -> Vec<f32> {
    let (d, hkv, g) = (p.head_dim as usize, p.kv_heads as usize, p.group() as usize);
    let n = pos as usize + 1;
    let af = f64::from(rope(p).attention_factor);
    let mut out = vec![0f32; p.heads as usize * d];
    for j in 0..p.heads as usize {
        let kvh = j / g;
        let qj = &q[j * d..(j + 1) * d];
        let row = |t: usize| (t * hkv + kvh) * d;
        let s: Vec<f64> = (0..n)
            .map(|t| {
                let k = &k_cache[row(t)..row(t) + d];
                qj.iter()
                    .zip(k)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * af
                    * af
                    / (d as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        let l: f64 = e.iter().sum();
        for i in 0..d {
            let acc: f64 = (0..n).map(|t| e[t] * v_cache[row(t) + i] as f64).sum();
            out[j * d + i] = (acc / l) as f32;
        }
    }
    out
}
