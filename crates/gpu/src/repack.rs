//! The upload's repacking of each file block type into its GPU form (`tensor.rs` module docs
//! describe the forms): plain loops over the file's blocks, each returning the `qs` words and
//! the scale words (or f16 scale bits) a [`crate::tensor::Q4Matrix`] part uploads, or the
//! index of the first block whose scale is not finite.

use half::f16;

/// Repack ggml Q4_0 blocks into (`qs` words, f16 scale bits padded to an even count).
/// Errors with the index of the first block whose scale is not finite.
pub fn repack_q4_0<'a>(
    blocks: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u16>), usize> {
    repack_f16_blocks(blocks, 16, 0)
}

/// Repack ggml Q8_0 blocks into (`qs` words: 8 per block, each byte `q + 128`; f16 scale bits
/// padded to an even count). Errors with the index of the first block whose scale is not
/// finite.
pub fn repack_q8_0<'a>(
    blocks: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u16>), usize> {
    // XOR 0x80 turns each two's-complement byte q into q + 128 (offset binary).
    repack_f16_blocks(blocks, 32, 0x8080_8080)
}

/// ggml blocks of an f16 scale and `payload` bytes: the payload's little-endian words xored
/// with `xor`, and the scale bits padded to an even count.
fn repack_f16_blocks<'a>(
    blocks: impl Iterator<Item = &'a [u8]>,
    payload: usize,
    xor: u32,
) -> std::result::Result<(Vec<u32>, Vec<u16>), usize> {
    let mut qs = Vec::new();
    let mut scales = Vec::new();
    for (i, b) in blocks.enumerate() {
        let d = f16::from_le_bytes([b[0], b[1]]);
        if !d.is_finite() {
            return Err(i);
        }
        scales.push(d.to_bits());
        qs.extend(
            b[2..2 + payload]
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ xor),
        );
    }
    if scales.len() % 2 == 1 {
        scales.push(0);
    }
    Ok((qs, scales))
}

/// Repack `MLX_A8` groups (bf16 scale, bf16 bias, byte `j` = element `j`) into the
/// [`QForm::Affine8`] form's (`qs` words, scale words): per group its 64 bytes as two blocks of
/// 8 words (the levels as they are) and one word `scale | bias << 16`. Errors with the index of
/// the first group whose scale or bias is not finite.
///
/// [`QForm::Affine8`]: crate::tensor::QForm::Affine8
pub fn repack_mlx_a8<'a>(
    groups: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    repack_mlx_groups(groups, 16, |p, q| {
        for (out, w) in q.iter_mut().zip(p.chunks_exact(4)) {
            *out = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        }
    })
}

/// Repack `MLX_A4` groups (bf16 scale, bf16 bias, byte `b` = elements `2b` low and `2b + 1`
/// high) into the affine form's (`qs` words, scale words): per group two Q4_0-ordered blocks
/// and one word `scale | bias << 16`. Errors with the index of the first group whose scale or
/// bias is not finite.
pub fn repack_mlx_a4<'a>(
    groups: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    repack_mlx_groups(groups, 8, |p, q| {
        // Element e's nibble; block k's byte j = elements 32k + j (low), 32k + j + 16 (high).
        let nib = |e: usize| ((p[e / 2] >> (4 * (e % 2))) & 0xF) as u32;
        for (w, out) in q.iter_mut().enumerate() {
            let (e0, j0) = (32 * (w / 4), 4 * (w % 4));
            *out = (0..4)
                .map(|k| (nib(e0 + j0 + k) | nib(e0 + j0 + k + 16) << 4) << (8 * k))
                .fold(0, |a, v| a | v);
        }
    })
}

/// MLX groups (bf16 scale, bf16 bias, payload) into `words` `qs` words each, written by
/// `payload(group's payload bytes, its words)`, and one scale word `scale | bias << 16` per
/// group; the index of the first group with a non-finite scale or bias is the error. Groups
/// are repacked in parallel, without allocating per group (the full-size model's 17 GB took
/// about a minute one group at a time).
fn repack_mlx_groups<'a>(
    groups: impl Iterator<Item = &'a [u8]>,
    words: usize,
    payload: impl Fn(&[u8], &mut [u32]) + Sync,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    repack_supers(groups, words, 1, |g, q, word| {
        let s = u16::from_le_bytes([g[0], g[1]]);
        let b = u16::from_le_bytes([g[2], g[3]]);
        if !half::bf16::from_bits(s).is_finite() || !half::bf16::from_bits(b).is_finite() {
            return false;
        }
        word[0] = s as u32 | (b as u32) << 16;
        payload(&g[4..], q);
        true
    })
}

/// Repack ggml Q6_K super-blocks (210 bytes: `ql[128]`, `qh[64]`, sixteen i8 scales, f16 `d`)
/// into the [`QForm::Q6K`] form's (`qs` words: 56 per super-block, its eight blocks of 32 in
/// order; f16 scale bits: the super-block's `d` once per block). Block `b`'s seven words:
/// Q4_0's nibble words of its levels' low four bits, the top two bits of elements 0-15 (word
/// 4) and 16-31 (word 5), element `e` (of the 16) at bits `8 (e % 4) + 2 (e / 4)`, and
/// sub-scales `2b` and `2b + 1` in bytes 0 and 1 of word 6 (qform.rs `Q6_PAYLOAD`).
/// Super-blocks are repacked in parallel; the index of the first one whose `d` is not finite is
/// the error.
///
/// [`QForm::Q6K`]: crate::tensor::QForm::Q6K
pub fn repack_q6_k<'a>(
    supers: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u16>), usize> {
    repack_supers(supers, 56, 8, |c, q, d| {
        let dv = f16::from_le_bytes([c[208], c[209]]);
        if !dv.is_finite() {
            return false;
        }
        d.fill(dv.to_bits());
        // The reference decoder's order (nibble_quant kquants): element `128 h + 32 k + l`
        // takes nibble `k / 2` of `ql[64 h + l + 32 (k % 2)]` and bits `2k, 2k + 1` of
        // `qh[32 h + l]` on top.
        let level = |e: usize| {
            let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
            let ql = c[64 * h + l + 32 * (k % 2)] >> (4 * (k / 2)) & 0xF;
            let qh = (c[128 + 32 * h + l] >> (2 * k)) & 3;
            (ql | qh << 4) as u32
        };
        for (b, out) in q.chunks_exact_mut(7).enumerate() {
            let lv = |j: usize| level(32 * b + j);
            for (k, word) in out[..4].iter_mut().enumerate() {
                *word = (0..4)
                    .map(|t| ((lv(4 * k + t) & 0xF) | (lv(16 + 4 * k + t) & 0xF) << 4) << (8 * t))
                    .fold(0, |a, v| a | v);
            }
            for half in 0..2 {
                out[4 + half] = (0..16)
                    .map(|e| (lv(16 * half + e) >> 4) << (8 * (e % 4) + 2 * (e / 4)))
                    .fold(0, |a, v| a | v);
            }
            out[6] = c[192 + 2 * b] as u32 | (c[192 + 2 * b + 1] as u32) << 8;
        }
        true
    })
}

/// Repack ggml Q4_K super-blocks (144 bytes: f16 `d`, f16 `dmin`, twelve bytes of 6-bit scales
/// and mins, `qs[128]`) into the [`QForm::Q4K`] form's (`qs` words: 32 per super-block, its
/// eight blocks of 32 in Q4_0's nibble order; scale words: 8 per super-block, two per pair of
/// blocks, `d | dmin << 16` then the pair's `sc | m << 6` at bits 0 and 12). Block `b`'s element
/// `e` is nibble `b % 2` of `qs[32 (b / 2) + e]`. Super-blocks are repacked in parallel; the
/// index of the first whose `d` or `dmin` is not finite is the error.
///
/// [`QForm::Q4K`]: crate::tensor::QForm::Q4K
pub fn repack_q4_k<'a>(
    supers: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    repack_supers(supers, 32, 8, |c, q, w| {
        if !k_scale_words(c, w) {
            return false;
        }
        let nib = |b: usize, e: usize| ((c[16 + 32 * (b / 2) + e] >> (4 * (b % 2))) & 0xF) as u32;
        for (k, out) in q.iter_mut().enumerate() {
            let (b, j0) = (k / 4, 4 * (k % 4));
            *out = (0..4)
                .map(|t| (nib(b, j0 + t) | nib(b, j0 + t + 16) << 4) << (8 * t))
                .fold(0, |a, v| a | v);
        }
        true
    })
}

/// Repack ggml Q5_K super-blocks (176 bytes: as Q4_K's with `qh[32]` before `qs[128]`) into
/// the [`QForm::Q5K`] form's (`qs` words: 40 per super-block, its eight blocks of 32 in order,
/// five words each: Q4_0's nibble words of the levels' low four bits, then a word of their fifth
/// bits, element `16 half + 4k + t` at bit `8t + 4 half + k`; scale words as Q4_K's). The level
/// of element `l` of block `b` is nibble `b % 2` of `qs[32 (b / 2) + l]` with bit `b` of `qh[l]`
/// on top (the reference decoder's order). Super-blocks are repacked in parallel; the index of
/// the first whose `d` or `dmin` is not finite is the error.
///
/// [`QForm::Q5K`]: crate::tensor::QForm::Q5K
pub fn repack_q5_k<'a>(
    supers: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    repack_supers(supers, 40, 8, |c, q, w| {
        if !k_scale_words(c, w) {
            return false;
        }
        let nib = |b: usize, l: usize| ((c[48 + 32 * (b / 2) + l] >> (4 * (b % 2))) & 0xF) as u32;
        let fifth = |b: usize, l: usize| ((c[16 + l] >> b) & 1) as u32;
        for (b, out) in q.chunks_exact_mut(5).enumerate() {
            for (k, word) in out[..4].iter_mut().enumerate() {
                *word = (0..4)
                    .map(|t| (nib(b, 4 * k + t) | nib(b, 4 * k + t + 16) << 4) << (8 * t))
                    .fold(0, |a, v| a | v);
            }
            // Element `16 half + 4k + t` at bit `8t + 4 half + k` (qform.rs `Q5_PAYLOAD`).
            out[4] = (0..32)
                .map(|l| fifth(b, l) << (8 * (l % 4) + 4 * (l / 16) + (l % 16) / 4))
                .fold(0, |a, v| a | v);
        }
        true
    })
}

/// The K-quants' scale words of one super-block `c` (Q4_K or Q5_K: f16 `d`, f16 `dmin`, twelve
/// bytes of 6-bit scales and mins) into `w` (eight u32: per pair of blocks `d | dmin << 16`,
/// then the pair's `sc | m << 6` at bits 0 and 12); false when `d` or `dmin` is not finite.
fn k_scale_words(c: &[u8], w: &mut [u32]) -> bool {
    let (d, dmin) = (
        u16::from_le_bytes([c[0], c[1]]),
        u16::from_le_bytes([c[2], c[3]]),
    );
    if !f16::from_bits(d).is_finite() || !f16::from_bits(dmin).is_finite() {
        return false;
    }
    let sm = |j: usize| {
        let (sc, m) = nibble_quant::kquants::scale_min(j, &c[4..16]);
        sc as u32 | (m as u32) << 6
    };
    for p in 0..4 {
        w[2 * p] = d as u32 | (dmin as u32) << 16;
        w[2 * p + 1] = sm(2 * p) | sm(2 * p + 1) << 12;
    }
    true
}

/// K-quant super-blocks (or MLX groups) into `qwords` `qs` words and `swords` scale words (or
/// f16 bits) each,
/// written by `f(super-block bytes, its qs words, its scale words)`, which returns false for a
/// super-block with a non-finite scale; the index of the first such is the error. Super-blocks
/// are repacked in parallel, without allocating per super-block.
fn repack_supers<'a, S: Copy + Default + Send + Sync>(
    supers: impl Iterator<Item = &'a [u8]>,
    qwords: usize,
    swords: usize,
    f: impl Fn(&[u8], &mut [u32], &mut [S]) -> bool + Sync,
) -> std::result::Result<(Vec<u32>, Vec<S>), usize> {
    use rayon::prelude::*;
    let supers: Vec<&[u8]> = supers.collect();
    let mut qs = vec![0u32; supers.len() * qwords];
    let mut scales = vec![S::default(); supers.len() * swords];
    let bad = qs
        .par_chunks_mut(qwords)
        .zip(scales.par_chunks_mut(swords))
        .zip(supers.par_iter())
        .enumerate()
        .filter_map(|(i, ((q, s), c))| (!f(c, q, s)).then_some(i))
        .min();
    match bad {
        Some(i) => Err(i),
        None => Ok((qs, scales)),
    }
}
