//! llama.cpp's "K-quant" super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each), the types of the
//! common `Q4_K_M` / `Q5_K_M` / `Q6_K` GGUF files: the reference dequantize (formats-spec §3.4,
//! ggml's `dequantize_row_q*_K`, with the same f32 operations, so every value is the one
//! llama.cpp computes) and simple quantizers for synthetic models.
//!
//! Layouts (bytes of one 256-weight super-block):
//! - `Q4_K` (144): `d: f16`, `dmin: f16`, `scales[12]` (eight 6-bit scales and eight 6-bit mins,
//!   packed as [`scale_min`] reads them), `qs[128]`. Chunk `c` (64 weights) uses `qs[32c..32c+32]`:
//!   low nibbles are weights `64c + l` (sub-block `2c`), high nibbles `64c + 32 + l` (sub-block
//!   `2c + 1`); weight = `(d·sc)·q − dmin·m`.
//! - `Q5_K` (176): as Q4_K with `qh[32]` before `qs`: bit `2c` of `qh[l]` is the fifth bit of
//!   weight `64c + l`, bit `2c + 1` that of weight `64c + 32 + l`.
//! - `Q6_K` (210): `ql[128]`, `qh[64]`, `scales[16]` (i8), `d: f16` (last). Sixteen sub-blocks of
//!   16 weights; weight = `(d·scale)·(q − 32)`, q six bits (layout in `dequantize_q6_k`).
//!
//! Exactness: `d·sc` (an f16 times a 6- or 8-bit integer) and `dmin·m` are exact in f32, and so
//! is their product with `q`, so each weight is one f32 rounding of the exact
//! `d·sc·q − dmin·m` (Q6_K: no rounding at all). Any implementation that rounds once there
//! (a fused multiply-add, or the product then the subtraction) gets the same bits.

use crate::{DType, QuantError};
use half::f16;

/// Weights per super-block.
pub const QK_K: usize = 256;

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes `b` (spec §3.4).
pub fn scale_min(j: usize, b: &[u8]) -> (u8, u8) {
    if j < 4 {
        (b[j] & 63, b[j + 4] & 63)
    } else {
        (
            (b[j + 4] & 0x0f) | ((b[j - 4] >> 6) << 4),
            (b[j + 4] >> 4) | ((b[j] >> 6) << 4),
        )
    }
}

/// The f16 at byte `at` of super-block `block`, refused when not finite.
fn f16_at(dtype: DType, block: usize, b: &[u8], at: usize) -> Result<f32, QuantError> {
    crate::checked_scale(dtype, block, [b[at], b[at + 1]])
}

/// Q4_K or Q5_K (as `dtype` says; Q5_K adds its `qh` bits) super-blocks into `out` (whole blocks, sizes
/// checked by the caller).
pub(crate) fn dequantize_q45_k(
    dtype: DType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), QuantError> {
    let bb = dtype.layout().block_bytes as usize;
    let five = dtype == DType::Q5_K;
    for (blk, (o, c)) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(bb))
        .enumerate()
    {
        let d = f16_at(dtype, blk, c, 0)?;
        let dmin = f16_at(dtype, blk, c, 2)?;
        let scales = &c[4..16];
        let (qh, qs) = if five {
            (&c[16..48], &c[48..176])
        } else {
            (&c[16..16], &c[16..144])
        };
        for chunk in 0..4 {
            for half in 0..2 {
                let j = 2 * chunk + half;
                let (sc, m) = scale_min(j, scales);
                let d1 = d * sc as f32;
                let m1 = dmin * m as f32;
                for l in 0..32 {
                    let byte = qs[32 * chunk + l];
                    let mut q = if half == 0 { byte & 0x0f } else { byte >> 4 };
                    if five {
                        q |= ((qh[l] >> j) & 1) << 4;
                    }
                    o[64 * chunk + 32 * half + l] = d1 * q as f32 - m1;
                }
            }
        }
    }
    Ok(())
}

/// Q6_K super-blocks into `out`. Per half `h` (128 weights): `ql[64h..]`, `qh[32h..]`,
/// `scales[8h..]`; for `l` in 0..32, weights `l`, `l + 32`, `l + 64`, `l + 96` of the half take
/// the low nibble of `ql[l]`, the low nibble of `ql[l + 32]`, the high nibble of `ql[l]` and the
/// high nibble of `ql[l + 32]`, with bits 0-1, 2-3, 4-5, 6-7 of `qh[l]` on top; weight `e` of
/// the half is scaled by `scales[e / 16]`.
pub(crate) fn dequantize_q6_k(bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    for (blk, (o, c)) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(210))
        .enumerate()
    {
        let d = f16_at(DType::Q6_K, blk, c, 208)?;
        for h in 0..2 {
            let ql = &c[64 * h..64 * h + 64];
            let qh = &c[128 + 32 * h..128 + 32 * h + 32];
            let sc = &c[192 + 8 * h..192 + 8 * h + 8];
            let o = &mut o[128 * h..128 * h + 128];
            for l in 0..32 {
                let q = [
                    (ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let e = l + 32 * k;
                    o[e] = d * (sc[e / 16] as i8) as f32 * (q as i32 - 32) as f32;
                }
            }
        }
    }
    Ok(())
}

/// Round to the nearest integer in `lo..=hi` (NaN to `lo`).
fn nearest(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

/// Quantise `src` (whole super-blocks) to Q4_K (`levels` 15) or Q5_K (31): per sub-block of 32
/// an affine range `[min, max]` (min <= 0 <= max), its step and offset as 6-bit multiples of
/// the super-block's f16 `d` and `dmin`. Simpler than llama.cpp's search, for synthetic weights:
/// approximate, with no error bound (a sub-block whose range is small beside the super-block's
/// largest can be off by several of its steps).
pub(crate) fn quantize_q45_k(dtype: DType, src: &[f32]) -> Vec<u8> {
    assert!(
        src.len().is_multiple_of(QK_K),
        "K-quants need whole super-blocks"
    );
    let five = dtype == DType::Q5_K;
    let levels = if five { 31.0 } else { 15.0 };
    let mut out = Vec::with_capacity(src.len() / QK_K * dtype.layout().block_bytes as usize);
    for blk in src.chunks_exact(QK_K) {
        let mut steps = [0f32; 8];
        let mut mins = [0f32; 8];
        for (j, sub) in blk.chunks_exact(32).enumerate() {
            let lo = sub.iter().fold(0f32, |m, v| m.min(*v));
            let hi = sub.iter().fold(0f32, |m, v| m.max(*v));
            steps[j] = (hi - lo) / levels;
            mins[j] = -lo;
        }
        let d = f16::from_f32(steps.iter().fold(0f32, |m, v| m.max(*v)) / 63.0);
        let dmin = f16::from_f32(mins.iter().fold(0f32, |m, v| m.max(*v)) / 63.0);
        let (df, dminf) = (d.to_f32(), dmin.to_f32());
        let six = |v: f32, unit: f32| {
            if unit > 0.0 {
                nearest(v / unit, 0, 63) as u8
            } else {
                0
            }
        };
        let sc: [u8; 8] = std::array::from_fn(|j| six(steps[j], df));
        // The offset rounded up, so the sub-block's smallest value stays reachable.
        let m: [u8; 8] = std::array::from_fn(|j| {
            if dminf > 0.0 {
                ((mins[j] / dminf).ceil() as i32).clamp(0, 63) as u8
            } else {
                0
            }
        });
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
        }
        let q: Vec<u8> = blk
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let j = i / 32;
                let d1 = df * sc[j] as f32;
                let m1 = dminf * m[j] as f32;
                if d1 > 0.0 {
                    nearest((v + m1) / d1, 0, levels as i32) as u8
                } else {
                    0
                }
            })
            .collect();
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        out.extend_from_slice(&packed);
        if five {
            let mut qh = [0u8; 32];
            for (i, q) in q.iter().enumerate() {
                let (chunk, half, l) = (i / 64, (i / 32) % 2, i % 32);
                qh[l] |= (q >> 4) << (2 * chunk + half);
            }
            out.extend_from_slice(&qh);
        }
        for chunk in 0..4 {
            for l in 0..32 {
                out.push((q[64 * chunk + l] & 0x0f) | ((q[64 * chunk + 32 + l] & 0x0f) << 4));
            }
        }
    }
    out
}

/// Quantise `src` (whole super-blocks) to Q6_K: per sub-block of 16 a signed step (its value of
/// largest magnitude maps to -32), as an i8 multiple of the super-block's f16 `d`.
pub(crate) fn quantize_q6_k(src: &[f32]) -> Vec<u8> {
    assert!(
        src.len().is_multiple_of(QK_K),
        "K-quants need whole super-blocks"
    );
    let mut out = Vec::with_capacity(src.len() / QK_K * 210);
    for blk in src.chunks_exact(QK_K) {
        let steps: [f32; 16] = std::array::from_fn(|s| {
            let sub = &blk[16 * s..16 * s + 16];
            let max = sub
                .iter()
                .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
            max / -32.0
        });
        let amax = steps.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0);
        let df = d.to_f32();
        let sc: [i8; 16] = std::array::from_fn(|s| {
            if df > 0.0 {
                nearest(steps[s] / df, -128, 127) as i8
            } else {
                0
            }
        });
        let q: Vec<u8> = blk
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let unit = df * sc[i / 16] as f32;
                let q = if unit != 0.0 {
                    nearest(v / unit, -32, 31)
                } else {
                    0
                };
                (q + 32) as u8
            })
            .collect();
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for h in 0..2 {
            for l in 0..32 {
                let e = |k: usize| q[128 * h + l + 32 * k];
                ql[64 * h + l] = (e(0) & 0x0f) | ((e(2) & 0x0f) << 4);
                ql[64 * h + l + 32] = (e(1) & 0x0f) | ((e(3) & 0x0f) << 4);
                qh[32 * h + l] =
                    (e(0) >> 4) | ((e(1) >> 4) << 2) | ((e(2) >> 4) << 4) | ((e(3) >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|s| *s as u8));
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::{dequantize, encode_float, DType, QuantError};

    /// A Q4_K block built field by field: d = 0.5, dmin = 0.25, sub-block j has scale j + 1 and
    /// min 2j (j >= 4 exercises the split 6-bit packing: scale 5..8 and min 8..14 need bit 4
    /// or 5 only where the spec puts it), nibble of weight i = i mod 16.
    #[test]
    fn q4_k_hand_computed_block() {
        let sc = [1u8, 2, 3, 4, 5, 6, 7, 48];
        let m = [0u8, 2, 4, 6, 8, 10, 12, 63];
        let mut b = vec![0x00, 0x38, 0x00, 0x34]; // f16 0.5, 0.25
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
        }
        b.extend(packed);
        for c in 0..4 {
            for l in 0..32 {
                let lo = ((64 * c + l) % 16) as u8;
                let hi = ((64 * c + 32 + l) % 16) as u8;
                b.push(lo | (hi << 4));
            }
        }
        assert_eq!(b.len(), 144);
        let mut out = vec![0f32; 256];
        dequantize(DType::Q4_K, &b, &mut out).unwrap();
        for (i, v) in out.iter().enumerate() {
            let j = i / 32;
            let want = 0.5 * sc[j] as f32 * (i % 16) as f32 - 0.25 * m[j] as f32;
            assert_eq!(*v, want, "weight {i}");
        }
        // Spot values: weight 0 = 0; weight 255 (sub-block 7, nibble 15) = 0.5·48·15 − 0.25·63.
        assert_eq!(out[255], 360.0 - 15.75);
    }

    /// Q5_K: the Q4_K fields plus the fifth bits; weight i has q = i mod 32.
    #[test]
    fn q5_k_hand_computed_block() {
        let mut b = vec![0x00, 0x3c, 0x00, 0x3c]; // d = dmin = 1
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = 1; // scales 0..4 = 1; 4..8 get 1 from the low nibbles below
            packed[j + 4] = 3; // mins 0..4 = 3, 4..8 = 0
            packed[j + 8] = 1;
        }
        b.extend(packed);
        let q = |i: usize| (i % 32) as u8;
        let mut qh = [0u8; 32];
        for i in 0..256 {
            let (c, half, l) = (i / 64, (i / 32) % 2, i % 32);
            qh[l] |= (q(i) >> 4) << (2 * c + half);
        }
        b.extend(qh);
        for c in 0..4 {
            for l in 0..32 {
                b.push((q(64 * c + l) & 15) | ((q(64 * c + 32 + l) & 15) << 4));
            }
        }
        assert_eq!(b.len(), 176);
        let mut out = vec![0f32; 256];
        dequantize(DType::Q5_K, &b, &mut out).unwrap();
        for (i, v) in out.iter().enumerate() {
            let m = if i / 32 < 4 { 3.0 } else { 0.0 };
            assert_eq!(*v, q(i) as f32 - m, "weight {i}");
        }
    }

    /// Q6_K: weight e of half h has q = (e + 7h) mod 64 and sub-block scale s − 8 (signed).
    #[test]
    fn q6_k_hand_computed_block() {
        let q = |h: usize, e: usize| ((e + 7 * h) % 64) as u8;
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for h in 0..2 {
            for l in 0..32 {
                ql[64 * h + l] = (q(h, l) & 15) | ((q(h, l + 64) & 15) << 4);
                ql[64 * h + l + 32] = (q(h, l + 32) & 15) | ((q(h, l + 96) & 15) << 4);
                qh[32 * h + l] = (q(h, l) >> 4)
                    | ((q(h, l + 32) >> 4) << 2)
                    | ((q(h, l + 64) >> 4) << 4)
                    | ((q(h, l + 96) >> 4) << 6);
            }
        }
        let mut b = ql.to_vec();
        b.extend(qh);
        b.extend((0..16).map(|s| (s as i8 - 8) as u8));
        b.extend([0x00, 0x38]); // d = 0.5, last
        let mut out = vec![0f32; 256];
        dequantize(DType::Q6_K, &b, &mut out).unwrap();
        for (i, v) in out.iter().enumerate() {
            let (h, e) = (i / 128, i % 128);
            let scale = (i / 16) as f32 - 8.0;
            assert_eq!(*v, 0.5 * scale * (q(h, e) as f32 - 32.0), "weight {i}");
        }
    }

    #[test]
    fn k_quants_round_trip_within_a_step_and_refuse_bad_blocks() {
        let src: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 29) as f32 - 13.3) * 0.07 * (1.0 + (i / 32) as f32 * 0.1))
            .collect();
        for (dtype, levels) in [
            (DType::Q4_K, 15.0),
            (DType::Q5_K, 31.0),
            (DType::Q6_K, 63.0),
        ] {
            let bytes = encode_float(dtype, &src);
            assert_eq!(bytes.len() as u64, dtype.byte_size(512).unwrap());
            let mut out = vec![0f32; 512];
            dequantize(dtype, &bytes, &mut out).unwrap();
            for (sub_s, sub_o) in src.chunks(16).zip(out.chunks(16)) {
                let lo = sub_s.iter().fold(0f32, |m, v| m.min(*v));
                let hi = sub_s.iter().fold(0f32, |m, v| m.max(*v));
                // One step of the sub-block's range, plus the 6-bit rounding of its scale.
                let tol = (hi - lo) / levels * 1.6 + 0.02;
                for (a, b) in sub_s.iter().zip(sub_o) {
                    assert!((a - b).abs() <= tol, "{dtype:?}: {a} vs {b} (tol {tol})");
                }
            }
            // A NaN scale names its super-block.
            let mut bad = bytes.clone();
            let at =
                dtype.layout().block_bytes as usize + if dtype == DType::Q6_K { 208 } else { 0 };
            bad[at..at + 2].copy_from_slice(&[0x00, 0x7e]);
            let e = dequantize(dtype, &bad, &mut out).unwrap_err();
            assert!(
                matches!(e, QuantError::NonFiniteScale { block: 1, .. }),
                "{e}"
            );
            // Not whole super-blocks.
            let mut short = vec![0f32; 128];
            assert!(matches!(
                dequantize(dtype, &bytes[..bytes.len() / 4], &mut short),
                Err(QuantError::NotWholeBlocks { .. })
            ));
        }
    }

    /// Blocks encoded from per-weight levels that never repeat within a sub-block's pattern
    /// (so a swapped nibble, a wrong `qh` bit or a wrong sub-block scale changes some value),
    /// packed by the spec's byte-level description (§3.4, written here in the encoding
    /// direction), then decoded: every weight is `d·sc·q − dmin·m` rounded once (Q6_K:
    /// `d·S·(q − 32)` exactly).
    #[test]
    fn non_repeating_levels_decode_to_the_spec_values() {
        let (d, dmin) = (0.0625f32, 0.03125f32);
        let sc: Vec<u8> = (0..8).map(|j| (j * 9 + 5) % 64).collect();
        let m: Vec<u8> = (0..8).map(|j| (j * 23 + 3) % 64).collect();
        let mut scales = [0u8; 12];
        for j in 0..4 {
            // Bytes 0-3: scales 0-3 and bits 4-5 of scales 4-7 on top; bytes 4-7 the same for
            // the mins; bytes 8-11: bits 0-3 of scale 4+j low, of min 4+j high.
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            scales[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
        }
        for dtype in [DType::Q4_K, DType::Q5_K] {
            let five = dtype == DType::Q5_K;
            let q: Vec<u8> = (0..256)
                .map(|i| if five { (i * 11 + i / 32) % 32 } else { (i * 7 + i / 64) % 16 } as u8)
                .collect();
            let (mut qh, mut qs) = ([0u8; 32], [0u8; 128]);
            for (e, &v) in q.iter().enumerate() {
                let (c, w) = (e / 64, e % 64);
                let (l, high) = (w % 32, w >= 32);
                qs[32 * c + l] |= (v & 15) << if high { 4 } else { 0 };
                qh[l] |= (v >> 4) << (2 * c + high as usize);
            }
            let mut blk = half::f16::from_f32(d).to_le_bytes().to_vec();
            blk.extend(half::f16::from_f32(dmin).to_le_bytes());
            blk.extend(scales);
            if five {
                blk.extend(qh);
            }
            blk.extend(qs);
            let mut out = [0f32; 256];
            dequantize(dtype, &blk, &mut out).unwrap();
            for (e, y) in out.iter().enumerate() {
                let j = e / 32;
                let want =
                    (d as f64 * sc[j] as f64 * q[e] as f64 - dmin as f64 * m[j] as f64) as f32;
                assert_eq!(
                    y.to_bits(),
                    want.to_bits(),
                    "{dtype:?} weight {e}: {y} vs {want}"
                );
            }
        }
        // Q6_K: halves of 128; quadrant k of a half takes ql[l] (k even) or ql[l + 32] (k odd),
        // low nibble for k < 2, and qh[l] bits 2k..2k+2; int8 scale per 16 weights; d last.
        let q: Vec<u8> = (0..256).map(|i| ((i * 13 + i / 16) % 64) as u8).collect();
        let sc6: Vec<i8> = (0..16).map(|s| ((s * 29) % 127) as i8 - 63).collect();
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for (e, &v) in q.iter().enumerate() {
            let (h, w) = (e / 128, e % 128);
            let (k, l) = (w / 32, w % 32);
            ql[64 * h + l + 32 * (k % 2)] |= (v & 15) << if k >= 2 { 4 } else { 0 };
            qh[32 * h + l] |= (v >> 4) << (2 * k);
        }
        let mut blk = ql.to_vec();
        blk.extend(qh);
        blk.extend(sc6.iter().map(|&v| v as u8));
        blk.extend(half::f16::from_f32(d).to_le_bytes());
        let mut out = [0f32; 256];
        dequantize(DType::Q6_K, &blk, &mut out).unwrap();
        for (e, y) in out.iter().enumerate() {
            let want = d * sc6[e / 16] as f32 * (q[e] as i32 - 32) as f32;
            assert_eq!(*y, want, "Q6_K weight {e}");
        }
    }
}
