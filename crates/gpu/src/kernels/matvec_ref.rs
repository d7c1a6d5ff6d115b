//! Scalar references of the matvec kernels (kernel tests compare against them), in f64.

use crate::tensor::BLOCK;

/// Scalar reference of the Q4 x int8 matvec: exactly the integer arithmetic of the kernel, in f64.
/// `w` is ggml Q4_0 `[rows, cols]`, `(q, s)` from [`crate::tensor::quantize_acts_ref`].
pub fn matvec_q4_i8_ref(w: &[u8], rows: usize, cols: usize, q: &[i8], s: &[[f32; 2]]) -> Vec<f32> {
    let bpr = cols / BLOCK;
    (0..rows)
        .map(|r| {
            let mut acc = 0f64;
            for b in 0..bpr {
                let blk = &w[(r * bpr + b) * 18..(r * bpr + b + 1) * 18];
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                let mut dot = 0i64;
                for j in 0..16 {
                    dot += (blk[2 + j] & 15) as i64 * q[b * 32 + j] as i64;
                    dot += (blk[2 + j] >> 4) as i64 * q[b * 32 + j + 16] as i64;
                }
                acc += d * (s[b][0] as f64 * dot as f64 - 8.0 * s[b][1] as f64);
            }
            acc as f32
        })
        .collect()
}

/// Scalar reference of an f32 matvec over already-dequantised weights `[rows, cols]`, in f64.
pub fn matvec_f32_ref(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}
