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
    let mut qs = Vec::new();
    let mut scales = Vec::new();
    for (i, b) in blocks.enumerate() {
        let d = f16::from_le_bytes([b[0], b[1]]);
        if !d.is_finite() {
            return Err(i);
        }
        scales.push(d.to_bits());
        qs.extend(
            b[2..18]
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
        );
    }
    if scales.len() % 2 == 1 {
        scales.push(0);
    }
    Ok((qs, scales))
}

/// Repack ggml Q8_0 blocks into (`qs` words: 8 per block, each byte `q + 128`; f16 scale bits
/// padded to an even count). Errors with the index of the first block whose scale is not
/// finite.
pub fn repack_q8_0<'a>(
    blocks: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u16>), usize> {
    let mut qs = Vec::new();
    let mut scales = Vec::new();
    for (i, b) in blocks.enumerate() {
        let d = f16::from_le_bytes([b[0], b[1]]);
        if !d.is_finite() {
            return Err(i);
        }
        scales.push(d.to_bits());
        // XOR 0x80 turns each two's-complement byte q into q + 128 (offset binary).
        qs.extend(
            b[2..34]
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ 0x8080_8080),
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
pub fn repack_mlx_a8<'a>(
    groups: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    use rayon::prelude::*;
    let groups: Vec<&[u8]> = groups.collect();
    let mut qs = vec![0u32; groups.len() * 16];
    let mut words = vec![0u32; groups.len()];
    let bad = qs
        .par_chunks_mut(16)
        .zip(words.par_iter_mut())
        .zip(groups.par_iter())
        .enumerate()
        .filter_map(|(i, ((q, word), g))| {
            let s = u16::from_le_bytes([g[0], g[1]]);
            let b = u16::from_le_bytes([g[2], g[3]]);
            if !half::bf16::from_bits(s).is_finite() || !half::bf16::from_bits(b).is_finite() {
                return Some(i);
            }
            *word = s as u32 | (b as u32) << 16;
            for (out, w) in q.iter_mut().zip(g[4..68].chunks_exact(4)) {
                *out = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            }
            None
        })
        .min();
    match bad {
        Some(i) => Err(i),
        None => Ok((qs, words)),
    }
}

/// Repack `MLX_A4` groups (bf16 scale, bf16 bias, byte `b` = elements `2b` low and `2b + 1`
/// high) into the affine form's (`qs` words, scale words): per group two Q4_0-ordered blocks
/// and one word `scale | bias << 16`. Errors with the index of the first group whose scale or
/// bias is not finite. Groups are repacked in parallel, without allocating per group (the
/// full-size model's 17 GB took about a minute one group at a time).
pub fn repack_mlx_a4<'a>(
    groups: impl Iterator<Item = &'a [u8]>,
) -> std::result::Result<(Vec<u32>, Vec<u32>), usize> {
    use rayon::prelude::*;
    let groups: Vec<&[u8]> = groups.collect();
    let mut qs = vec![0u32; groups.len() * 8];
    let mut words = vec![0u32; groups.len()];
    let bad = qs
        .par_chunks_mut(8)
        .zip(words.par_iter_mut())
        .zip(groups.par_iter())
        .enumerate()
        .filter_map(|(i, ((q, word), g))| {
            let s = u16::from_le_bytes([g[0], g[1]]);
            let b = u16::from_le_bytes([g[2], g[3]]);
            if !half::bf16::from_bits(s).is_finite() || !half::bf16::from_bits(b).is_finite() {
                return Some(i);
            }
            *word = s as u32 | (b as u32) << 16;
            // Element e's nibble; block k's byte j = elements 32k + j (low), 32k + j + 16 (high).
            let nib = |e: usize| ((g[4 + e / 2] >> (4 * (e % 2))) & 0xF) as u32;
            for (w, out) in q.iter_mut().enumerate() {
                let (e0, j0) = (32 * (w / 4), 4 * (w % 4));
                *out = (0..4)
                    .map(|k| (nib(e0 + j0 + k) | nib(e0 + j0 + k + 16) << 4) << (8 * k))
                    .fold(0, |a, v| a | v);
            }
            None
        })
        .min();
    match bad {
        Some(i) => Err(i),
        None => Ok((qs, words)),
    }
}
