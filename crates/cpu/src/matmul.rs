//! Quantised matrix products on the CPU: `Y = W · X` for a few token vectors at once, the weights
//! decoded block by block in registers (never a decoded copy of a row or tensor in memory; only
//! [`decode_row`], the embedding lookup, writes a row out).
//!
//! One [`Job`] is a range of rows of one weight tensor applied to `n` token vectors; a call runs
//! any number of jobs as ONE parallel loop over chunks of rows, so the three attention
//! projections, or the gate and up products of every chosen expert, cost one fork-join.
//!
//! Numerics: each run of 32 elements is decoded to the f32 weights the oracle sees, bit for bit
//! (`blocks.rs`; e.g. `(q - 8)·d` is exact in f32), and multiplied into 16 f32 lane sums per token, element `j` of
//! a block into lane `j mod 16` (`j` before `j + 16`), blocks in order, each step one fused
//! multiply-add; the lanes are summed pairwise at the end. A token's result does not depend on
//! how many tokens share the call or on the thread count, so a prompt's batched prefill and
//! token-by-token decode give the same bits, and the AVX2 kernels (Q4_0 and the K-quants, four
//! tokens per pass over a row; `avx2.rs`) the same bits as the portable one.

use crate::blocks::{Bf16, Block, MlxA4, MlxA8, F16, F32, Q4, Q4K, Q5K, Q6K, Q8};
use anyhow::{bail, ensure, Result};
use nibble_model::weights::Weight;
use nibble_quant::DType;
use rayon::prelude::*;

/// Elements per block: every dtype is walked in blocks of 32 (rows must be whole blocks).
pub const BLOCK: usize = 32;

/// Rows per parallel task: enough work (~9 KiB of Q4_0 weights at 2048 columns) to amortise a
/// task, few enough that a 128-row router or 8 experts' down rows still spread over the cores.
const TASK_ROWS: usize = 8;

/// Rows `row0..row0 + rows` of `w` (viewed as `[rows_total, cols]`) times each of the `n`
/// vectors of `x` (`[n, cols]`, token-major).
pub struct Job<'a> {
    pub w: &'a Weight<'a>,
    pub row0: usize,
    pub rows: usize,
    /// `[n, cols]`
    pub x: &'a [f32],
    pub n: usize,
}

/// Run every job; returns, per job, its output `[rows, n]` (row-major: the `n` token results of
/// row 0, then of row 1, ...). Errors on shape mismatches and on a non-finite block scale.
pub fn run(jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>> {
    for j in jobs {
        let cols = *j.w.shape.last().unwrap_or(&0);
        ensure!(
            cols > 0 && cols.is_multiple_of(BLOCK),
            "a {cols}-column tensor is not whole blocks of {BLOCK}"
        );
        ensure!(
            j.x.len() == j.n * cols,
            "{} input values for {} vectors of {cols}",
            j.x.len(),
            j.n
        );
        let total = j.w.elements() / cols;
        ensure!(
            j.row0.checked_add(j.rows).is_some_and(|e| e <= total),
            "rows {}..{} of a {total}-row tensor",
            j.row0,
            j.row0.saturating_add(j.rows)
        );
    }
    let mut outs: Vec<Vec<f32>> = jobs.iter().map(|j| vec![0f32; j.rows * j.n]).collect();
    // (job, first row within the job, output [rows, n] of this task)
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (ji, (job, out)) in jobs.iter().zip(outs.iter_mut()).enumerate() {
        if job.n == 0 {
            continue;
        }
        for (c, chunk) in out.chunks_mut(TASK_ROWS * job.n).enumerate() {
            tasks.push((ji, c * TASK_ROWS, chunk));
        }
    }
    tasks
        .into_par_iter()
        .try_for_each(|(ji, r, out)| rows(&jobs[ji], r, out))?;
    Ok(outs)
}

/// Rows `r..` of one job into `out` (`[out.len() / n, n]`).
fn rows(job: &Job<'_>, r: usize, out: &mut [f32]) -> Result<()> {
    let cols = *job.w.shape.last().unwrap_or(&0);
    for (i, o) in out.chunks_exact_mut(job.n).enumerate() {
        let row = job.w.row(job.row0 + r + i);
        row_dots(job.w.dtype, row, job.x, cols, o)?;
    }
    Ok(())
}

/// Which kernel this CPU runs for Q4_0 and the K-quants (for `--verbose` and the backend's name).
pub fn q4_kernel() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        return "AVX2+FMA, 4 tokens per pass";
    }
    "portable, 4 tokens per pass"
}

/// `out[t] = row · x[t]` for every token vector `t` of `x` (`[out.len(), cols]`).
fn row_dots(dtype: DType, row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) -> Result<()> {
    match dtype {
        #[cfg(target_arch = "x86_64")]
        DType::Q4_0 if has_avx2() => avx2_dots::<Q4, crate::avx2::Q4>(row, x, cols, out),
        DType::Q4_0 => portable_dots::<Q4>(row, x, cols, out),
        DType::Q8_0 => {
            check_len::<Q8>(row, cols)?;
            generic::<Q8>(row, x, cols, out);
            scales_finite::<Q8>(row, out)
        }
        DType::F32 => {
            check_len::<F32>(row, cols)?;
            generic::<F32>(row, x, cols, out);
            Ok(())
        }
        DType::F16 => {
            check_len::<F16>(row, cols)?;
            generic::<F16>(row, x, cols, out);
            Ok(())
        }
        DType::BF16 => {
            check_len::<Bf16>(row, cols)?;
            generic::<Bf16>(row, x, cols, out);
            Ok(())
        }
        #[cfg(target_arch = "x86_64")]
        DType::Q4_K if has_avx2() => avx2_dots::<Q4K, crate::avx2::K45<false>>(row, x, cols, out),
        #[cfg(target_arch = "x86_64")]
        DType::Q5_K if has_avx2() => avx2_dots::<Q5K, crate::avx2::K45<true>>(row, x, cols, out),
        #[cfg(target_arch = "x86_64")]
        DType::Q6_K if has_avx2() => avx2_dots::<Q6K, crate::avx2::Q6K>(row, x, cols, out),
        DType::Q4_K => portable_dots::<Q4K>(row, x, cols, out),
        DType::Q5_K => portable_dots::<Q5K>(row, x, cols, out),
        DType::Q6_K => portable_dots::<Q6K>(row, x, cols, out),
        #[cfg(target_arch = "x86_64")]
        DType::MLX_A4 if has_avx2() => avx2_dots::<MlxA4, crate::avx2::MlxA4>(row, x, cols, out),
        #[cfg(target_arch = "x86_64")]
        DType::MLX_A8 if has_avx2() => avx2_dots::<MlxA8, crate::avx2::MlxA8>(row, x, cols, out),
        DType::MLX_A4 => portable_dots::<MlxA4>(row, x, cols, out),
        DType::MLX_A8 => portable_dots::<MlxA8>(row, x, cols, out),
    }
}

/// Whether this CPU runs the AVX2 + FMA kernels (detected once, then cached by std).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// The products of a type with an AVX2 kernel (`D`, the same bits as `B`'s portable one),
/// then the scales' check.
#[cfg(target_arch = "x86_64")]
fn avx2_dots<B: Block, D: crate::avx2::Decode>(
    row: &[u8],
    x: &[f32],
    cols: usize,
    out: &mut [f32],
) -> Result<()> {
    check_len::<B>(row, cols)?;
    debug_assert_eq!((B::BYTES, B::ELEMS), (D::BYTES, D::RUNS * BLOCK));
    // SAFETY: `has_avx2()` held where this is called; the row is whole blocks for `cols`
    // elements (checked above) and `x` holds `out.len()` rows of `cols` (checked by `run`).
    unsafe { crate::avx2::dots::<D>(row, x, cols, out) };
    scales_finite::<B>(row, out)
}

/// The portable products, then the scales' check.
fn portable_dots<B: Block>(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) -> Result<()> {
    check_len::<B>(row, cols)?;
    generic::<B>(row, x, cols, out);
    scales_finite::<B>(row, out)
}

/// The row is whole blocks of `cols` elements.
fn check_len<B: Block>(row: &[u8], cols: usize) -> Result<()> {
    ensure!(
        cols.is_multiple_of(B::ELEMS) && row.len() == cols / B::ELEMS * B::BYTES,
        "a row of {} bytes for {cols} {} elements",
        row.len(),
        B::NAME
    );
    Ok(())
}

/// A non-finite block scale makes every product with its row non-finite (`(q - 8)·d` is then
/// NaN or infinite, and NaN and infinity survive any sum), so the scales are scanned only when
/// a result is not finite: the hot loop carries no check. An error names the first bad block.
fn scales_finite<B: Block>(row: &[u8], out: &[f32]) -> Result<()> {
    if out.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    if let Some(b) = row
        .chunks_exact(B::BYTES)
        .position(|bytes| !B::finite(bytes))
    {
        bail!("block {b} of a {} row has a non-finite scale", B::NAME);
    }
    Ok(())
}

/// The portable products, one token at a time: 16 lane sums (element `j` of every block into
/// lane `j mod 16`: `j` first, then `j + 16`), each step a fused multiply-add, lanes summed by
/// [`lane_sum`]. Compiled per instruction set (hardware FMA on AVX2+FMA and NEON; elsewhere
/// `mul_add` is a slower library call with the same result), so every version gives the same
/// bits as `avx2::dots`.
#[multiversion::multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn generic<B: Block>(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    // Up to four tokens per pass over the row, so each run of 32 weights is decoded once for
    // all of them (a K-quant run costs more to decode than its products).
    let mut t = 0;
    while t < out.len() {
        let n = (out.len() - t).min(4);
        let mut acc = [[0f32; 16]; 4];
        for (b, bytes) in row.chunks_exact(B::BYTES).enumerate() {
            for sub in 0..B::ELEMS / BLOCK {
                let w = B::decode(bytes, sub);
                let at = b * B::ELEMS + sub * BLOCK;
                for (k, acc) in acc.iter_mut().enumerate().take(n) {
                    let xb: &[f32; BLOCK] = x[(t + k) * cols + at..][..BLOCK]
                        .try_into()
                        .expect("32-element runs");
                    for j in 0..16 {
                        acc[j] = w[j].mul_add(xb[j], acc[j]);
                    }
                    for j in 0..16 {
                        acc[j] = w[16 + j].mul_add(xb[16 + j], acc[j]);
                    }
                }
            }
        }
        for (o, acc) in out[t..t + n].iter_mut().zip(&acc) {
            *o = lane_sum(acc);
        }
        t += n;
    }
}

/// Pairwise sum of 16 lanes in a fixed order.
#[inline(always)]
pub(crate) fn lane_sum(a: &[f32; 16]) -> f32 {
    let mut s = *a;
    for width in [8, 4, 2, 1] {
        for j in 0..width {
            s[j] += s[j + width];
        }
    }
    s[0]
}

/// `Σ a[i]·b[i]` with the lane order of the matrix products (`a.len()` a multiple of 16, or the
/// tail summed after the lanes): the attention's dot products.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ai = a.chunks_exact(16);
    let mut bi = b.chunks_exact(16);
    for (x, y) in (&mut ai).zip(&mut bi) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    let tail: f32 = ai
        .remainder()
        .iter()
        .zip(bi.remainder())
        .map(|(x, y)| x * y)
        .sum();
    lane_sum(&acc) + tail
}

/// Decode row `r` of `w` whole (the embedding lookup): `out.len()` = the row's columns.
pub fn decode_row(w: &Weight<'_>, r: usize, out: &mut [f32]) -> Result<()> {
    let cols = *w.shape.last().unwrap_or(&0);
    let rows = w.elements().checked_div(cols).unwrap_or(0);
    ensure!(r < rows, "row {r} of a {rows}-row tensor");
    ensure!(out.len() == cols, "a {cols}-column row into {}", out.len());
    let row = w.row(r);
    match w.dtype {
        DType::Q4_0 => decode_blocks::<Q4>(row, out),
        DType::Q8_0 => decode_blocks::<Q8>(row, out),
        DType::F32 => decode_blocks::<F32>(row, out),
        DType::F16 => decode_blocks::<F16>(row, out),
        DType::BF16 => decode_blocks::<Bf16>(row, out),
        DType::Q4_K => decode_blocks::<Q4K>(row, out),
        DType::Q5_K => decode_blocks::<Q5K>(row, out),
        DType::Q6_K => decode_blocks::<Q6K>(row, out),
        DType::MLX_A4 => decode_blocks::<MlxA4>(row, out),
        DType::MLX_A8 => decode_blocks::<MlxA8>(row, out),
    }
}

fn decode_blocks<B: Block>(row: &[u8], out: &mut [f32]) -> Result<()> {
    ensure!(
        out.len().is_multiple_of(B::ELEMS) && row.len() == out.len() / B::ELEMS * B::BYTES,
        "a row of {} bytes for {} {} elements",
        row.len(),
        out.len(),
        B::NAME
    );
    for (b, (bytes, o)) in row
        .chunks_exact(B::BYTES)
        .zip(out.chunks_exact_mut(B::ELEMS))
        .enumerate()
    {
        if !B::finite(bytes) {
            bail!("block {b} of a {} row has a non-finite scale", B::NAME);
        }
        for (sub, o) in o.chunks_exact_mut(BLOCK).enumerate() {
            o.copy_from_slice(&B::decode(bytes, sub));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::scale;
    use half::f16;

    /// The AVX2 kernels and the portable ones give the same bits (so a model decodes the same
    /// on any x86 CPU), for Q4_0, every K-quant and MLX's types, on random block bytes (every
    /// bit pattern of the packed scales and quants; finite f16 or bf16 scales), including odd token counts (the
    /// four-token tiles' remainder).
    #[test]
    fn avx2_and_portable_products_agree_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            use crate::avx2::{Decode, K45};
            use crate::blocks::{Q4K, Q5K, Q6K};
            // The scales' encoding: f16 (ggml's types) or bf16 (MLX's).
            type Enc = fn(f32) -> [u8; 2];
            let f16s: Enc = |v| f16::from_f32(v).to_le_bytes();
            let bf16s: Enc = |v| half::bf16::from_f32(v).to_le_bytes();
            fn check<B: Block, D: Decode>(scales: &[usize], cols: usize, enc: Enc) {
                let mut seed = 0x2545_f491_4f6c_dd1du64;
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let mut row: Vec<u8> = (0..cols / B::ELEMS * B::BYTES)
                    .map(|_| next() as u8)
                    .collect();
                for blk in row.chunks_exact_mut(B::BYTES) {
                    for &at in scales {
                        let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                        blk[at..at + 2].copy_from_slice(&enc(v));
                    }
                }
                for n in [1usize, 2, 3, 4, 5, 9] {
                    let x: Vec<f32> = (0..n * cols)
                        .map(|i| ((i * 13) % 17) as f32 * 0.37 - 2.9)
                        .collect();
                    let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                    generic::<B>(&row, &x, cols, &mut a);
                    // SAFETY: AVX2 and FMA were detected; `row` is whole blocks of `cols` and
                    // `x` n rows of `cols`.
                    unsafe { crate::avx2::dots::<D>(&row, &x, cols, &mut b) };
                    assert!(
                        a.iter().all(|v| *v != 0.0 && v.is_finite()),
                        "{}: {a:?}",
                        B::NAME
                    );
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&b), "{}: {n} tokens", B::NAME);
                }
            }
            check::<Q4, crate::avx2::Q4>(&[0], 96, f16s);
            check::<Q4K, K45<false>>(&[0, 2], 512, f16s);
            check::<Q5K, K45<true>>(&[0, 2], 512, f16s);
            check::<Q6K, crate::avx2::Q6K>(&[208], 512, f16s);
            check::<MlxA4, crate::avx2::MlxA4>(&[0, 2], 192, bf16s);
            check::<MlxA8, crate::avx2::MlxA8>(&[0, 2], 192, bf16s);
        }
    }

    /// The branchless scale conversion equals the library's for every finite f16 and is NaN for
    /// the others.
    #[test]
    fn scale_conversion_is_exact_for_every_f16() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = scale(&h.to_le_bytes());
            if want.is_finite() {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            } else {
                assert!(got.is_nan(), "{h:#06x}: {got}");
            }
        }
    }

    /// A NaN or infinite block scale is an error naming the block, whatever the other blocks,
    /// the inputs (zeros included) or the weights (a nibble of 8, whose weight is 0·d) are; an
    /// infinite input with finite scales is not (its result is passed on).
    #[test]
    fn non_finite_scales_are_errors_and_non_finite_inputs_are_not() {
        let cols = 96;
        let vals: Vec<f32> = (0..cols).map(|i| ((i * 37) % 23) as f32 - 11.3).collect();
        let good = nibble_quant::encode_float(DType::Q4_0, &vals);
        for (bits, block, nibbles_8, x0) in [
            (0x7c00u16, 1usize, false, 1f32),
            (0xfc00, 2, true, 1.0),
            (0x7e00, 0, true, 0.0),
            (0x7e01, 1, false, 0.0),
        ] {
            let mut row = good.clone();
            row[18 * block..18 * block + 2].copy_from_slice(&bits.to_le_bytes());
            if nibbles_8 {
                row[18 * block + 2..18 * block + 18].fill(0x88);
            }
            for n in [1usize, 5] {
                let x = vec![x0; n * cols];
                let mut o = vec![0f32; n];
                let e = row_dots(DType::Q4_0, &row, &x, cols, &mut o).unwrap_err();
                let want = format!("block {block} of a Q4_0 row");
                assert!(e.to_string().contains(&want), "{bits:#x}: {e}");
                let mut o = vec![0f32; n];
                generic::<Q4>(&row, &x, cols, &mut o);
                assert!(
                    o.iter().all(|v| !v.is_finite()),
                    "{bits:#x} portable: {o:?}"
                );
            }
        }
        // Q8_0: a NaN scale over a block of zero weights (0·NaN is NaN too).
        let mut q8 = nibble_quant::encode_float(DType::Q8_0, &vals);
        q8[34..36].copy_from_slice(&0x7e00u16.to_le_bytes());
        q8[36..68].fill(0);
        let mut o = [0f32; 2];
        let e = row_dots(DType::Q8_0, &q8, &vec![0.5f32; 2 * cols], cols, &mut o).unwrap_err();
        assert!(e.to_string().contains("block 1 of a Q8_0 row"), "{e}");
        let mut x = vec![1f32; cols];
        x[5] = f32::INFINITY;
        let mut o = [0f32; 1];
        row_dots(DType::Q4_0, &good, &x, cols, &mut o).unwrap();
        assert!(!o[0].is_finite());
    }
}
