//! Tests of the affine int4 form (MLX checkpoints' `MLX_A4` groups; `tensor.rs` module docs):
//! the repacking against the reference decoder, the upload's refusals, and the embedding,
//! matvec and matmul kernels, each against the reference on random groups (the matvec and
//! matmul checks are q8_tests.rs's, shared).

use super::embed::EmbedKernel;
use super::matmul::MatmulKernel;
use super::matvec::{Act, MatvecKernel};
use super::q8_tests::matvec_every_form;
use crate::numerics::Numerics;
use crate::state::RunState;
use crate::tensor::{repack_mlx_a4, Q4Matrix, QForm};
use crate::testing::{dequant, gpu, rand_f32, rand_mlx_a4, rand_q4_0, rng};
use nibble_quant::DType;

/// The weights the affine form holds, decoded on the host from the repacked words exactly as
/// the kernels read them: Q4_0 nibble order per block, `(scale, bias)` per pair of blocks.
fn decode_affine(qs: &[u32], words: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(qs.len() * 8);
    for (blk, w) in qs.chunks_exact(4).enumerate() {
        let v = words[blk / 2];
        let s = f32::from_bits(v << 16);
        let b = f32::from_bits(v & 0xFFFF_0000);
        let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut vals = [0f32; 32];
        for (j, byte) in bytes.iter().enumerate() {
            vals[j] = s * (byte & 0xF) as f32 + b;
            vals[j + 16] = s * (byte >> 4) as f32 + b;
        }
        out.extend_from_slice(&vals);
    }
    out
}

#[test]
fn mlx_repack_decodes_to_the_reference_weights() {
    let mut r = rng(71);
    for (rows, cols) in [(1usize, 64usize), (3, 128), (17, 2048)] {
        let bytes = rand_mlx_a4(&mut r, rows, cols);
        let (qs, words) = repack_mlx_a4(bytes.chunks_exact(36)).unwrap();
        assert_eq!(qs.len(), rows * cols / 8, "four words per block of 32");
        assert_eq!(words.len(), rows * cols / 64, "one scale word per group");
        let got = decode_affine(&qs, &words);
        let want = dequant(DType::MLX_A4, &bytes, rows, cols);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {cols}]"
        );
    }
}

#[test]
fn mlx_repack_names_the_first_non_finite_group() {
    let mut r = rng(72);
    for (byte, val) in [(0usize, 0x7FC0u16), (2, 0x7F80)] {
        let mut bytes = rand_mlx_a4(&mut r, 2, 128);
        // Group 2's scale (NaN) or bias (+inf).
        bytes[2 * 36 + byte..2 * 36 + byte + 2].copy_from_slice(&val.to_le_bytes());
        assert_eq!(repack_mlx_a4(bytes.chunks_exact(36)).err(), Some(2));
    }
}

#[test]
fn mlx_upload_refuses_bad_shapes_and_lying_sizes() {
    let Some(ctx) = gpu("mlx_upload_refuses_bad_shapes_and_lying_sizes") else {
        return;
    };
    let mut r = rng(73);
    let bytes = rand_mlx_a4(&mut r, 4, 128);
    let ok = Q4Matrix::upload_dtype(&ctx, "w", DType::MLX_A4, 4, 128, 1, &[&bytes]).unwrap();
    assert_eq!(ok.form(), Some(QForm::Affine4));
    ok.check_layout("w").unwrap();
    let err = |e: crate::context::GpuError| e.to_string();
    let short = Q4Matrix::upload_dtype(
        &ctx,
        "w",
        DType::MLX_A4,
        4,
        128,
        1,
        &[&bytes[..bytes.len() - 36]],
    );
    assert!(err(short.unwrap_err()).contains("36-byte groups"));
    let narrow =
        Q4Matrix::upload_dtype(&ctx, "w", DType::MLX_A4, 8, 32, 1, &[&bytes[..8 * 36 / 2]]);
    assert!(err(narrow.unwrap_err()).contains("cols % 64"));
    let q8 = Q4Matrix::upload_dtype(&ctx, "w", DType::Q8_0, 4, 128, 1, &[&bytes]);
    assert!(err(q8.unwrap_err()).contains("Q8_0"));
    let mut nan = bytes.clone();
    nan[36..38].copy_from_slice(&0x7FC0u16.to_le_bytes());
    let bad = Q4Matrix::upload_dtype(&ctx, "w", DType::MLX_A4, 4, 128, 1, &[&nan]);
    assert!(err(bad.unwrap_err()).contains("group 1"));
}

#[test]
fn embedding_reads_affine_tables_exactly_across_parts() {
    let Some(ctx) = gpu("embedding_reads_affine_tables_exactly_across_parts") else {
        return;
    };
    let mut r = rng(74);
    let k = EmbedKernel::new_for(&ctx, QForm::Affine4).unwrap();
    for (vocab, hidden, limit) in [(50usize, 64usize, None), (301, 2048, Some(7 * 64 * 16))] {
        let table = rand_mlx_a4(&mut r, vocab, hidden);
        let form = (QForm::Affine4, DType::MLX_A4);
        super::q8_tests::embedding_rows_exact(&ctx, &k, form, &table, (vocab, hidden), limit);
    }
    // A kernel of one form refuses a table of the other.
    let q4 = Q4Matrix::upload(&ctx, "q", 4, 64, 1, &[&rand_q4_0(&mut r, 4, 64)]).unwrap();
    let h = ctx.storage("h", 64 * 4).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    assert!(k.bind(&ctx, &q4, &h, &state).is_err());
    let aff = Q4Matrix::upload_dtype(
        &ctx,
        "a",
        DType::MLX_A4,
        4,
        64,
        1,
        &[&rand_mlx_a4(&mut r, 4, 64)],
    )
    .unwrap();
    assert!(EmbedKernel::new(&ctx)
        .unwrap()
        .bind(&ctx, &aff, &h, &state)
        .is_err());
}

/// The rounding bound of the affine dot per row: the kernels sum `s (q - 8) x` and
/// `(b + 8 s) x` terms, so the bound is their magnitudes' sum, not `Σ |w x|` (which may cancel).
fn affine_mag(bytes: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    let gpr = cols / 64;
    (0..rows)
        .map(|r| {
            (0..gpr)
                .map(|g| {
                    let o = (r * gpr + g) * 36;
                    let s = half::bf16::from_le_bytes([bytes[o], bytes[o + 1]]).to_f32();
                    let b = half::bf16::from_le_bytes([bytes[o + 2], bytes[o + 3]]).to_f32();
                    let coef = 8.0 * s.abs() + (b + 8.0 * s).abs();
                    coef * x[g * 64..g * 64 + 64].iter().map(|v| v.abs()).sum::<f32>()
                })
                .sum()
        })
        .collect()
}

#[test]
fn affine_matvec_forms_match_the_reference() {
    let Some(ctx) = gpu("affine_matvec_forms_match_the_reference") else {
        return;
    };
    let mut r = rng(75);
    let k = MatvecKernel::with_form(&ctx, Numerics::F32, false, QForm::Affine4).unwrap();
    let late = MatvecKernel::with_form(&ctx, Numerics::F32, true, QForm::Affine4).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for &(rows, cols) in &[
        (1usize, 64usize),
        (13, 128),
        (300, 2048),
        (9000, 64),
        (5, 4096),
    ] {
        let wb = rand_mlx_a4(&mut r, rows, cols);
        let deq = dequant(DType::MLX_A4, &wb, rows, cols);
        let w = Q4Matrix::upload_dtype(&ctx, "w", DType::MLX_A4, rows, cols, 1, &[&wb]).unwrap();
        // Mixed magnitudes, so the Σ x term is far from the dot's.
        let x: Vec<f32> = rand_f32(&mut r, cols, -1.0, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi((i % 5) as i32 - 2))
            .collect();
        matvec_every_form(
            &ctx,
            &mut r,
            (&k, &late, &state),
            (&w, &deq),
            &x,
            |x| affine_mag(&wb, rows, cols, x),
            "affine",
        );
    }
    // Forms are never mixed: a Q4_0 matrix in the affine kernel, an affine one in the Q4_0
    // kernel, and the bfp24 numerics with the affine form are clear errors.
    let y = ctx.storage("y", 4 * 4).unwrap();
    let x = ctx
        .storage_init("x", bytemuck::cast_slice(&[0.5f32; 64]))
        .unwrap();
    let q4 = Q4Matrix::upload(&ctx, "q", 4, 64, 1, &[&rand_q4_0(&mut r, 4, 64)]).unwrap();
    assert!(k.bind_q4(&ctx, &q4, Act::F32(&x), &y, &state).is_err());
    let aff = Q4Matrix::upload_dtype(
        &ctx,
        "a",
        DType::MLX_A4,
        4,
        64,
        1,
        &[&rand_mlx_a4(&mut r, 4, 64)],
    )
    .unwrap();
    let plain = MatvecKernel::new(&ctx).unwrap();
    assert!(plain.bind_q4(&ctx, &aff, Act::F32(&x), &y, &state).is_err());
    assert!(MatvecKernel::with_form(&ctx, Numerics::Bfp24, false, QForm::Affine4).is_err());
}

/// The multi-column matmul (multi-stream decode, the column prefill) on affine matrices: every
/// tile that serves the column count, plain and accumulating; columns are independent.
#[test]
fn affine_matmul_matches_the_reference_for_every_tile() {
    let Some(ctx) = gpu("affine_matmul_matches_the_reference_for_every_tile") else {
        return;
    };
    let mut r = rng(76);
    let k = MatmulKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for &(rows, cols) in &[(13usize, 128usize), (300, 2048)] {
        let wb = rand_mlx_a4(&mut r, rows, cols);
        let mag = |xc: &[f32]| affine_mag(&wb, rows, cols, xc);
        let (dt, shape) = (DType::MLX_A4, (rows, cols));
        super::q8_tests::matmul_every_tile(
            &ctx,
            &mut r,
            (&k, &state),
            dt,
            &wb,
            shape,
            mag,
            "MLX_A4",
        );
    }
}
