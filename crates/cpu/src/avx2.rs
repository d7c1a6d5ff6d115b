//! The quantised products in AVX2 + FMA (chosen at run time by `matmul::row_dots`): Q4_0, the
//! K-quants and MLX's affine groups, four tokens per pass over a row (each run of 32 weights decoded once for all
//! four; 8 accumulators and 4 weight vectors fit the 16 registers). The same lanes, roundings
//! and order as `matmul::generic`, so the same bits: every decoded weight is the exact value
//! (or, for Q4_K / Q5_K, the one rounding of the exact `d·sc·q − dmin·m`, as a fused
//! multiply-add gives it), and element `j` of a run goes into lane `j mod 16`, `j` before
//! `j + 16`.

use crate::blocks::{bf16_bits, k4_scale_min, scale};
use crate::matmul::{lane_sum, BLOCK};
use std::arch::x86_64::*;

/// One storage type as the AVX2 kernel decodes it.
pub(crate) trait Decode {
    /// Bytes per block.
    const BYTES: usize;
    /// Runs of 32 weights per block.
    const RUNS: usize;
    /// Weights `32·run..32·run + 32` of `block` as four vectors of 8.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `block` is `BYTES` long and `run < RUNS`.
    unsafe fn decode(block: &[u8], run: usize) -> [__m256; 4];
}

/// Four vectors of 8 floats from 32 small unsigned bytes: `f(q)` of each, in order.
#[inline(always)]
unsafe fn widen(q: __m256i, f: impl Fn(__m256) -> __m256) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(q);
    let hi = _mm256_extracti128_si256(q, 1);
    let g = |v: __m128i| f(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    [
        g(lo),
        g(_mm_srli_si128(lo, 8)),
        g(hi),
        g(_mm_srli_si128(hi, 8)),
    ]
}

/// The 32 bytes at `p`.
///
/// # Safety
/// `p` must point to 32 readable bytes.
#[inline(always)]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// Bits `shift..shift + 8` of every byte of `v`, masked to `mask`.
#[inline(always)]
unsafe fn bits(v: __m256i, shift: usize, mask: u8) -> __m256i {
    let s = _mm_cvtsi32_si128(shift as i32);
    _mm256_and_si256(_mm256_srl_epi16(v, s), _mm256_set1_epi8(mask as i8))
}

pub(crate) struct Q4;
impl Decode for Q4 {
    const BYTES: usize = 18;
    const RUNS: usize = 1;
    /// `(q - 8)·d`, exact in f32: `q·d - 8d` in one rounding.
    #[inline(always)]
    unsafe fn decode(block: &[u8], _run: usize) -> [__m256; 4] {
        let d = _mm256_set1_ps(scale(block));
        // SAFETY: a block is 18 bytes; bytes 2..18 are the 16 nibble pairs.
        let q = unsafe { _mm_loadu_si128(block.as_ptr().add(2) as *const __m128i) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, mask); // elements 0..16
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask); // elements 16..32
        let minus_8d = _mm256_mul_ps(d, _mm256_set1_ps(-8.0));
        let f =
            |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, minus_8d);
        [
            f(lo),
            f(_mm_srli_si128(lo, 8)),
            f(hi),
            f(_mm_srli_si128(hi, 8)),
        ]
    }
}

/// Q4_K (`FIVE` false) and Q5_K: run `r` is the low (`r` even) or high nibbles of the 32 bytes
/// of chunk `r / 2`, plus (Q5_K) bit `r` of each `qh` byte as the fifth bit.
pub(crate) struct K45<const FIVE: bool>;
impl<const FIVE: bool> Decode for K45<FIVE> {
    const BYTES: usize = if FIVE { 176 } else { 144 };
    const RUNS: usize = 8;
    #[inline(always)]
    unsafe fn decode(block: &[u8], run: usize) -> [__m256; 4] {
        let (sc, m) = k4_scale_min(&block[4..16], run);
        let step = _mm256_set1_ps(scale(block) * sc);
        let minus_offset = _mm256_set1_ps(-(scale(&block[2..]) * m));
        let qs_at = if FIVE { 48 } else { 16 } + 32 * (run / 2);
        // SAFETY: `qs_at + 32 <= BYTES` for `run < 8`.
        let mut q = unsafe { bits(load32(block.as_ptr().add(qs_at)), 4 * (run % 2), 0x0f) };
        if FIVE {
            // SAFETY: bytes 16..48 are `qh`.
            let h = unsafe { bits(load32(block.as_ptr().add(16)), run, 0x01) };
            q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
        }
        // SAFETY: AVX2 and FMA are enabled in the caller.
        unsafe { widen(q, |v| _mm256_fmadd_ps(v, step, minus_offset)) }
    }
}

/// Q6_K: run `r` is quarter `k = r mod 4` of half `h = r / 4`; its first 16 weights take
/// scale `2k` of the half, the next 16 scale `2k + 1`; weight = `(d·scale)·(q − 32)`, exact.
pub(crate) struct Q6K;
impl Decode for Q6K {
    const BYTES: usize = 210;
    const RUNS: usize = 8;
    #[inline(always)]
    unsafe fn decode(block: &[u8], run: usize) -> [__m256; 4] {
        let d = scale(&block[208..]);
        let (h, k) = (run / 4, run % 4);
        // SAFETY: `ql` runs are inside bytes 0..128 and `qh` inside 128..192.
        let (ql, qh) = unsafe {
            (
                load32(block.as_ptr().add(64 * h + 32 * (k % 2))),
                load32(block.as_ptr().add(128 + 32 * h)),
            )
        };
        // SAFETY: AVX2 is enabled in the caller.
        let q = unsafe {
            _mm256_or_si256(
                bits(ql, 4 * (k / 2), 0x0f),
                _mm256_slli_epi16(bits(qh, 2 * k, 0x03), 4),
            )
        };
        let s = |i: usize| _mm256_set1_ps(d * (block[192 + 8 * h + 2 * k + i] as i8) as f32);
        let (s0, s1) = (s(0), s(1));
        let minus_32 = _mm256_set1_ps(-32.0);
        // SAFETY: AVX2 is enabled in the caller.
        let w = unsafe { widen(q, |v| _mm256_add_ps(v, minus_32)) };
        [
            _mm256_mul_ps(w[0], s0),
            _mm256_mul_ps(w[1], s0),
            _mm256_mul_ps(w[2], s1),
            _mm256_mul_ps(w[3], s1),
        ]
    }
}

/// An MLX block's bf16 scale and bias, broadcast.
///
/// # Safety
/// AVX must be available (as in every `Decode::decode`).
#[inline(always)]
unsafe fn mlx_scale_bias(block: &[u8]) -> (__m256, __m256) {
    (
        _mm256_set1_ps(bf16_bits(block, 0)),
        _mm256_set1_ps(bf16_bits(block, 2)),
    )
}

/// MLX's affine 4-bit groups of 64 (`MLX_A4`): run `r` is payload bytes `16r..16r + 16`, whose
/// low and high nibbles are weights `2b` and `2b + 1`; weight = `q·scale + bias`. `q·scale` is
/// exact in f32 (4 bits times bf16's 8), so the fused multiply-add rounds once where the
/// portable product then sum does: the same bits.
pub(crate) struct MlxA4;
impl Decode for MlxA4 {
    const BYTES: usize = 36;
    const RUNS: usize = 2;
    #[inline(always)]
    unsafe fn decode(block: &[u8], run: usize) -> [__m256; 4] {
        // SAFETY: AVX2 is enabled in the caller.
        let (s, b) = unsafe { mlx_scale_bias(block) };
        // SAFETY: `4 + 16·run + 16 <= 36` for `run < 2`.
        let q = unsafe { _mm_loadu_si128(block.as_ptr().add(4 + 16 * run) as *const __m128i) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        // Interleaved back into weight order: weights 0..16, then 16..32.
        let (first, second) = (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
        let f = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), s, b);
        [
            f(first),
            f(_mm_srli_si128(first, 8)),
            f(second),
            f(_mm_srli_si128(second, 8)),
        ]
    }
}

/// MLX's affine 8-bit groups of 64 (`MLX_A8`): run `r` is payload bytes `32r..32r + 32`;
/// weight = `q·scale + bias`, one rounding (as [`MlxA4`]).
pub(crate) struct MlxA8;
impl Decode for MlxA8 {
    const BYTES: usize = 68;
    const RUNS: usize = 2;
    #[inline(always)]
    unsafe fn decode(block: &[u8], run: usize) -> [__m256; 4] {
        // SAFETY: AVX2 is enabled in the caller.
        let (s, b) = unsafe { mlx_scale_bias(block) };
        // SAFETY: `4 + 32·run + 32 <= 68` for `run < 2`; AVX2 and FMA are enabled in the caller.
        unsafe {
            let q = load32(block.as_ptr().add(4 + 32 * run));
            widen(q, |v| _mm256_fmadd_ps(v, s, b))
        }
    }
}

/// `out[t] = row · x[t]` for every token vector `t` of `x` (`[out.len(), cols]`).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `row` must be `cols / (32·D::RUNS)` whole `D` blocks and
/// `x` at least `out.len() * cols` values.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dots<D: Decode>(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    let mut t = 0;
    while t + 4 <= out.len() {
        let xs = std::array::from_fn(|i| &x[(t + i) * cols..(t + i + 1) * cols]);
        // SAFETY: the features are enabled here; the caller guarantees the shapes.
        out[t..t + 4].copy_from_slice(&unsafe { tile::<D, 4>(row, xs) });
        t += 4;
    }
    while t < out.len() {
        // SAFETY: as above.
        out[t] = unsafe { tile::<D, 1>(row, [&x[t * cols..(t + 1) * cols]]) }[0];
        t += 1;
    }
}

/// `row · xs[k]` for `N` token vectors. Lanes 0..8 and 8..16 of a token's sums are
/// `acc[k][0]` and `acc[k][1]`; elements 0..16 of a run go in first, then 16..32, each a
/// fused multiply-add.
#[inline(always)]
unsafe fn tile<D: Decode, const N: usize>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for (b, block) in row.chunks_exact(D::BYTES).enumerate() {
        for run in 0..D::RUNS {
            // SAFETY: AVX2 is enabled in the caller; `block` is one whole block.
            let w = unsafe { D::decode(block, run) };
            let at = (b * D::RUNS + run) * BLOCK;
            for k in 0..N {
                let x = &xs[k][at..at + BLOCK];
                // SAFETY: `x` is one 32-element run: each load reads 8 floats inside it.
                let xv: [__m256; 4] =
                    std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
                for i in 0..2 {
                    acc[k][i] = _mm256_fmadd_ps(w[i], xv[i], acc[k][i]);
                    acc[k][i] = _mm256_fmadd_ps(w[2 + i], xv[2 + i], acc[k][i]);
                }
            }
        }
    }
    acc.map(|a| {
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 floats: two stores of 8.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a[1]);
        }
        lane_sum(&lanes)
    })
}
