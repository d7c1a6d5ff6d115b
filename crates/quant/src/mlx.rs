//! MLX's affine quantisation (formats-spec §4.1; `mx.quantize`, mode "affine", group 64) in the
//! block layout nibble keeps it in.
//!
//! An MLX checkpoint stores a quantised `[out, in]` matrix as three tensors: the packed integers
//! (`U32`, eight 4-bit or four 8-bit values per word, first element in the least-significant
//! bits), and one bf16 `scale` and one bf16 `bias` per group of 64 consecutive inputs;
//! weight = `scale·q + bias` with `q` unsigned. Scales may be negative (the quantiser anchors a
//! group on whichever of its min and max is larger in magnitude), so nothing here assumes a sign.
//!
//! Three separate arrays do not fit nibble's one-dtype-per-row [`crate::DType`] model, so the
//! loader interleaves them once into blocks ([`repack_row`]), and every consumer walks blocks as
//! it does for Q4_0:
//! - `MLX_A4` (36 bytes per 64 weights): `scale: bf16`, `bias: bf16`, then 32 bytes where byte `b`
//!   holds weight `2b` in its low nibble and weight `2b + 1` in its high nibble (MLX's own order:
//!   the little-endian words' bytes copied as they are).
//! - `MLX_A8` (68 bytes per 64 weights): `scale: bf16`, `bias: bf16`, then 64 bytes, byte `b` =
//!   weight `b` (MLX's 8-bit router, spec §4.3).
//!
//! Exactness: each weight is `f32(scale)·q` rounded once, plus `f32(bias)` rounded once (two
//! f32 operations, never fused), so an implementation that does the same gets the same bits.

use crate::{DType, QuantError};
use half::bf16;

/// Weights per MLX group (the only group size nibble reads; mlx-lm's default).
pub const GROUP: usize = 64;

/// Bytes of the two bf16 values (scale, bias) that start every block.
const HEAD: usize = 4;

/// The bf16 at byte `at` of block `block`, refused when not finite (a NaN scale or bias would
/// silently poison every product it touches).
fn bf16_at(dtype: DType, block: usize, b: &[u8], at: usize) -> Result<f32, QuantError> {
    let v = bf16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    if !v.is_finite() {
        return Err(QuantError::NonFiniteScale {
            dtype,
            block: block as u64,
            scale: v,
        });
    }
    Ok(v)
}

/// The `q` of weight `j` (0..64) of a block's payload `p` (the bytes after the head).
#[inline(always)]
pub fn level(dtype: DType, p: &[u8], j: usize) -> u8 {
    if dtype == DType::MLX_A4 {
        (p[j / 2] >> (4 * (j % 2))) & 15
    } else {
        p[j]
    }
}

/// Whole blocks of `MLX_A4` or `MLX_A8` into `out` (sizes checked by the caller).
pub(crate) fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let bb = dtype.layout().block_bytes as usize;
    for (blk, (o, c)) in out
        .chunks_exact_mut(GROUP)
        .zip(bytes.chunks_exact(bb))
        .enumerate()
    {
        let s = bf16_at(dtype, blk, c, 0)?;
        let b = bf16_at(dtype, blk, c, 2)?;
        for (j, v) in o.iter_mut().enumerate() {
            *v = level(dtype, &c[HEAD..], j) as f32 * s + b;
        }
    }
    Ok(())
}

/// Bits per stored integer of an MLX dtype.
pub const fn bits(dtype: DType) -> Option<u32> {
    match dtype {
        DType::MLX_A4 => Some(4),
        DType::MLX_A8 => Some(8),
        _ => None,
    }
}

/// Interleave one row as an MLX checkpoint stores it into `dtype`'s blocks in `out`: `packed`
/// is the row's U32 words as bytes (`cols·bits/8` of them), `scales` and `biases` its bf16
/// values (`cols/64` each, as bytes). An error if the lengths disagree.
pub fn repack_row(
    dtype: DType,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    out: &mut [u8],
) -> Result<(), String> {
    let bits = bits(dtype).ok_or_else(|| format!("{dtype:?} is not an MLX type"))? as usize;
    let groups = scales.len() / 2;
    let payload = GROUP * bits / 8;
    if scales.len() != biases.len()
        || !scales.len().is_multiple_of(2)
        || packed.len() != groups * payload
        || out.len() != groups * (HEAD + payload)
    {
        return Err(format!(
            "an MLX row of {} packed bytes, {} scale bytes and {} bias bytes does not make \
             whole {bits}-bit groups of {GROUP} (into {} bytes)",
            packed.len(),
            scales.len(),
            biases.len(),
            out.len()
        ));
    }
    for (g, blk) in out.chunks_exact_mut(HEAD + payload).enumerate() {
        blk[0..2].copy_from_slice(&scales[2 * g..2 * g + 2]);
        blk[2..4].copy_from_slice(&biases[2 * g..2 * g + 2]);
        blk[HEAD..].copy_from_slice(&packed[g * payload..(g + 1) * payload]);
    }
    Ok(())
}

/// Quantise `src` (a multiple of 64 long) with mlx's affine rule (spec §4.1: anchor on the
/// larger-magnitude extreme, scale nudged so the anchor is exact), in `dtype`'s blocks. Not
/// bit-identical to mlx-lm's output for the same floats: this rounds half away from zero and
/// picks levels against the bf16-rounded scale and bias, where MLX rounds half to even against
/// its f32 ones; a level may differ by one where a value sits on a rounding boundary.
pub fn quantize(dtype: DType, src: &[f32]) -> Vec<u8> {
    let bits = bits(dtype).expect("an MLX type");
    assert!(src.len().is_multiple_of(GROUP), "MLX needs whole groups");
    let n = ((1u32 << bits) - 1) as f32;
    let mut out = Vec::with_capacity(src.len() / GROUP * dtype.layout().block_bytes as usize);
    for g in src.chunks_exact(GROUP) {
        let (mn, mx) = g
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                (a.min(v), b.max(v))
            });
        let s = ((mx - mn) / n).max(1e-7);
        let (anchor, mut scale) = if mn.abs() > mx.abs() {
            (mn, s)
        } else {
            (mx, -s)
        };
        let q0 = (anchor / scale).round();
        let bias = if q0 != 0.0 {
            scale = anchor / q0;
            anchor
        } else {
            0.0
        };
        // Stored in bf16, as MLX stores them for a bf16 model; the levels are chosen against
        // the stored values, so the rounding of scale and bias does not add to the error.
        let (sb, bb) = (bf16::from_f32(scale), bf16::from_f32(bias));
        let (sf, bf) = (sb.to_f32(), bb.to_f32());
        out.extend_from_slice(&sb.to_le_bytes());
        out.extend_from_slice(&bb.to_le_bytes());
        let q: Vec<u8> = g
            .iter()
            .map(|&v| ((v - bf) / sf).round().clamp(0.0, n) as u8)
            .collect();
        if bits == 4 {
            out.extend(q.chunks_exact(2).map(|p| p[0] | (p[1] << 4)));
        } else {
            out.extend_from_slice(&q);
        }
    }
    out
}

/// The inverse of [`repack_row`] for one row of blocks: (packed bytes, scale bytes, bias
/// bytes) as an MLX checkpoint stores them (the synthetic-model writer's path).
pub fn unpack_row(dtype: DType, blocks: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let bb = dtype.layout().block_bytes as usize;
    let (mut p, mut s, mut b) = (vec![], vec![], vec![]);
    for c in blocks.chunks_exact(bb) {
        s.extend_from_slice(&c[0..2]);
        b.extend_from_slice(&c[2..4]);
        p.extend_from_slice(&c[HEAD..]);
    }
    (p, s, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequantize as deq;

    /// A hand-made MLX row of 64 weights: words as MLX packs them, scale -0.5, bias 2.0.
    #[test]
    fn a4_block_from_u32_words_decodes_by_hand() {
        // q of element i = (i * 7) % 16; word w holds elements 8w..8w+8, element 8w+k at bits 4k.
        let q: Vec<u32> = (0..64).map(|i| (i * 7) % 16).collect();
        let words: Vec<u8> = q
            .chunks(8)
            .flat_map(|c| {
                c.iter()
                    .enumerate()
                    .fold(0u32, |w, (k, &v)| w | (v << (4 * k)))
                    .to_le_bytes()
            })
            .collect();
        let scales = bf16::from_f32(-0.5).to_le_bytes();
        let biases = bf16::from_f32(2.0).to_le_bytes();
        let mut blk = [0u8; 36];
        repack_row(DType::MLX_A4, &words, &scales, &biases, &mut blk).unwrap();
        let mut out = [0f32; 64];
        deq(DType::MLX_A4, &blk, &mut out).unwrap();
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, q[i] as f32 * -0.5 + 2.0, "element {i}");
        }
        // Element 1 = 7 → -1.5; element 9 = 63 % 16 = 15 → -5.5.
        assert_eq!((out[1], out[9]), (-1.5, -5.5));
        let (p, s, b) = unpack_row(DType::MLX_A4, &blk);
        assert_eq!(
            (p, s.as_slice(), b.as_slice()),
            (words, &scales[..], &biases[..])
        );
    }

    #[test]
    fn a8_block_decodes_by_hand() {
        let q: Vec<u8> = (0..64).map(|i| (i * 37 % 256) as u8).collect();
        let mut blk = [0u8; 68];
        repack_row(
            DType::MLX_A8,
            &q,
            &bf16::from_f32(0.25).to_le_bytes(),
            &bf16::from_f32(-3.0).to_le_bytes(),
            &mut blk,
        )
        .unwrap();
        let mut out = [0f32; 64];
        deq(DType::MLX_A8, &blk, &mut out).unwrap();
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, q[i] as f32 * 0.25 - 3.0);
        }
    }

    #[test]
    fn quantize_round_trips_within_half_a_step_and_hits_the_anchor() {
        let src: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 29) as f32 - 11.3) * 0.07 + if i < 64 { 0.9 } else { 0.0 })
            .collect();
        for dtype in [DType::MLX_A4, DType::MLX_A8] {
            let n = ((1 << bits(dtype).unwrap()) - 1) as f32;
            let bytes = quantize(dtype, &src);
            let mut out = vec![0f32; src.len()];
            deq(dtype, &bytes, &mut out).unwrap();
            let bb = dtype.layout().block_bytes as usize;
            for ((gs, go), blk) in src.chunks(64).zip(out.chunks(64)).zip(bytes.chunks(bb)) {
                let (mn, mx) = gs
                    .iter()
                    .fold((9f32, -9f32), |(a, b), &v| (a.min(v), b.max(v)));
                // The anchor (the larger-magnitude extreme) is the stored bias.
                let anchor = if mn.abs() > mx.abs() { mn } else { mx };
                let bias = bf16::from_le_bytes([blk[2], blk[3]]);
                assert_eq!(bias, bf16::from_f32(anchor), "{dtype:?} anchor");
                let step = (mx - mn) / n;
                for (a, b) in gs.iter().zip(go) {
                    // Half a step, plus bf16's rounding of scale (x up to n) and bias.
                    let tol = step * 0.5 + (mx.abs().max(mn.abs()) + step * n) * 2f32.powi(-8);
                    assert!((a - b).abs() <= tol, "{dtype:?} {a} vs {b} (tol {tol})");
                }
            }
        }
    }

    #[test]
    fn bad_rows_and_scales_are_errors() {
        let mut out = [0u8; 36];
        assert!(repack_row(DType::MLX_A4, &[0; 31], &[0; 2], &[0; 2], &mut out).is_err());
        assert!(repack_row(DType::MLX_A4, &[0; 32], &[0; 2], &[0; 4], &mut out).is_err());
        assert!(repack_row(DType::MLX_A4, &[0; 32], &[0; 2], &[0; 2], &mut out[..35]).is_err());
        assert!(repack_row(DType::Q4_0, &[0; 32], &[0; 2], &[0; 2], &mut out).is_err());
        for at in [0, 2] {
            let mut blk = quantize(DType::MLX_A4, &[0.5; 64]);
            blk[at..at + 2].copy_from_slice(&bf16::NAN.to_le_bytes());
            let mut out = [0f32; 64];
            let e = deq(DType::MLX_A4, &blk, &mut out).unwrap_err();
            assert!(
                matches!(e, QuantError::NonFiniteScale { block: 0, .. }),
                "{e}"
            );
        }
    }
}
