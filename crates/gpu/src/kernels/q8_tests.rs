//! Tests of the byte forms ([`QForm::Q8_0`], ggml's Q8_0 blocks, [`QForm::Affine8`], MLX's
//! 8-bit groups, and [`QForm::Q6K`], ggml's Q6_K super-blocks) and of the K form
//! ([`QForm::Q4K`], ggml's Q4_K; `tensor.rs` module docs): the repacking against the reference
//! decoder, the upload's refusals, and every kernel that reads the forms, each against the
//! reference on random blocks (every level, scales and biases of either sign) at the real and
//! odd shapes (the K-quants at those whose rows are whole super-blocks).

use super::embed::EmbedKernel;
use super::matmul::{MatmulArgs, MatmulInput, MatmulKernel, Tile};
use super::matvec::{matvec_f32_ref, Act, MatvecKernel, NormInput, F32_ROWS_PER_TEAM};
use crate::numerics::Numerics;
use crate::state::RunState;
use crate::tensor::{
    repack_mlx_a8, repack_q4_k, repack_q5_k, repack_q6_k, repack_q8_0, Q4Matrix, QForm,
};
use crate::testing::{dequant, gpu, rand_f32, rand_mlx_a8, rand_q4_0, rand_q6_k, rand_q8_0, rng};
use nibble_quant::DType;

/// The weights the byte form holds, decoded on the host from the repacked words as the
/// kernels read them: byte `j` of a block's 8 words is element `j`, stored as `q + 128`.
fn decode_q8(qs: &[u32], scales: &[u16]) -> Vec<f32> {
    let mut out = Vec::with_capacity(qs.len() * 4);
    for (blk, w) in qs.chunks_exact(8).enumerate() {
        let d = half::f16::from_bits(scales[blk]).to_f32();
        for byte in w.iter().flat_map(|x| x.to_le_bytes()) {
            out.push((byte as i32 - 128) as f32 * d);
        }
    }
    out
}

/// The weights the 6-bit form holds, decoded on the host from the repacked words as the
/// kernels read them (qform.rs `Q6_PAYLOAD`): seven words per block, element `j`'s low four
/// bits in Q4_0's nibble order, its top two at bits `8 (e % 4) + 2 (e / 4)` of word
/// `4 + j / 16` (`e = j % 16`), and the halves' i8 sub-scales in bytes 0 and 1 of word 6.
fn decode_q6(qs: &[u32], scales: &[u16]) -> Vec<f32> {
    let mut out = Vec::with_capacity(qs.len() * 32 / 7);
    for (blk, w) in qs.chunks_exact(7).enumerate() {
        let d = half::f16::from_bits(scales[blk]).to_f32();
        let nib: Vec<u8> = w[..4].iter().flat_map(|x| x.to_le_bytes()).collect();
        for j in 0..32 {
            let low = ((nib[j % 16] >> (4 * (j / 16))) & 0xF) as i32;
            let e = j % 16;
            let top = ((w[4 + j / 16] >> (8 * (e % 4) + 2 * (e / 4))) & 3) as i32;
            let sc = (w[6] >> (8 * (j / 16))) as u8 as i8 as f32;
            out.push(d * (sc * (low + 16 * top - 32) as f32));
        }
    }
    out
}

/// The byte forms with their file dtype and random bytes for `[rows, cols]`.
const FORMS: [(QForm, DType); 5] = [
    (QForm::Q8_0, DType::Q8_0),
    (QForm::Affine8, DType::MLX_A8),
    (QForm::Q6K, DType::Q6_K),
    (QForm::Q4K, DType::Q4_K),
    (QForm::Q5K, DType::Q5_K),
];

fn rand_bytes(r: &mut impl rand::Rng, dt: DType, rows: usize, cols: usize) -> Vec<u8> {
    let form = FORMS.iter().find(|f| f.1 == dt).expect("a tested form").0;
    crate::testing::rand_form(r, form, rows, cols).0
}

/// Whether `dt` stores rows of `cols` weights (the K-quants: whole super-blocks of 256).
fn fits(dt: DType, cols: usize) -> bool {
    !matches!(dt, DType::Q6_K | DType::Q4_K | DType::Q5_K) || cols % 256 == 0
}

/// Per row, the scale of the rounding of the kernels' sums: `Σ |w x|` for Q8_0 and Q6_K; for MLX's
/// groups, whose dot the kernels take as `s Σ (q - 128) x + (b + 128 s) Σ x`, those terms'
/// magnitudes (`Σ |w x|` may cancel below them).
pub(super) fn mag_of(dt: DType, bytes: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    if let DType::Q4_K | DType::Q5_K = dt {
        // The kernels take a block's dot as `c0 Σ (q - off) x + c1 Σ x` with `c0 = d sc`,
        // `c1 = off c0 - dmin m` (`off` 8 for Q4_K's nibbles, 16 for Q5_K's levels): those
        // terms' magnitudes.
        let (spr, bb, off) = match dt {
            DType::Q4_K => (cols / 256, 144, 8.0),
            _ => (cols / 256, 176, 16.0),
        };
        return (0..rows)
            .map(|r| {
                (0..spr * 8)
                    .map(|j| {
                        let o = (r * spr + j / 8) * bb;
                        let d = half::f16::from_le_bytes([bytes[o], bytes[o + 1]]).to_f32();
                        let dm = half::f16::from_le_bytes([bytes[o + 2], bytes[o + 3]]).to_f32();
                        let (sc, m) =
                            nibble_quant::kquants::scale_min(j % 8, &bytes[o + 4..o + 16]);
                        let c0 = d * sc as f32;
                        let coef = off * c0.abs() + (off * c0 - dm * m as f32).abs();
                        coef * x[j * 32..j * 32 + 32].iter().map(|v| v.abs()).sum::<f32>()
                    })
                    .sum()
            })
            .collect();
    }
    if dt != DType::MLX_A8 {
        let deq = dequant(dt, bytes, rows, cols);
        return (0..rows)
            .map(|r| {
                let row = &deq[r * cols..(r + 1) * cols];
                row.iter().zip(x).map(|(w, v)| (w * v).abs()).sum()
            })
            .collect();
    }
    let gpr = cols / 64;
    (0..rows)
        .map(|r| {
            (0..gpr)
                .map(|g| {
                    let o = (r * gpr + g) * 68;
                    let s = half::bf16::from_le_bytes([bytes[o], bytes[o + 1]]).to_f32();
                    let b = half::bf16::from_le_bytes([bytes[o + 2], bytes[o + 3]]).to_f32();
                    let coef = 128.0 * s.abs() + (b + 128.0 * s).abs();
                    coef * x[g * 64..g * 64 + 64].iter().map(|v| v.abs()).sum::<f32>()
                })
                .sum()
        })
        .collect()
}

pub(super) fn assert_within(got: &[f32], want: &[f32], mag: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        assert!(
            (g - w).abs() <= tol * m + 1e-30,
            "{what}: row {i}: got {g}, want {w}, bound {}",
            tol * m
        );
    }
}

#[test]
fn q8_repack_decodes_to_the_reference_weights() {
    let mut r = rng(81);
    for (rows, cols) in [(1usize, 32usize), (3, 96), (17, 2048)] {
        let bytes = rand_q8_0(&mut r, rows, cols);
        let (qs, scales) = repack_q8_0(bytes.chunks_exact(34)).unwrap();
        assert_eq!(qs.len(), rows * cols / 4, "eight words per block of 32");
        let got = decode_q8(&qs, &scales);
        let want = dequant(DType::Q8_0, &bytes, rows, cols);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {cols}]"
        );
    }
    // The first non-finite scale is named.
    let mut bytes = rand_q8_0(&mut r, 2, 64);
    bytes[3 * 34..3 * 34 + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
    assert_eq!(repack_q8_0(bytes.chunks_exact(34)).err(), Some(3));
}

#[test]
fn q8_upload_refuses_lying_sizes_and_nan_scales() {
    let Some(ctx) = gpu("q8_upload_refuses_lying_sizes_and_nan_scales") else {
        return;
    };
    let mut r = rng(82);
    let bytes = rand_q8_0(&mut r, 4, 128);
    let ok = Q4Matrix::upload_dtype(&ctx, "w", DType::Q8_0, 4, 128, 1, &[&bytes]).unwrap();
    assert_eq!(ok.form(), Some(QForm::Q8_0));
    ok.check_layout("w").unwrap();
    assert_eq!(
        ok.bytes(),
        4 * 4 * 32 + 4 * 4 * 2,
        "32 payload bytes and an f16 per block"
    );
    let err = |e: crate::context::GpuError| e.to_string();
    let short = Q4Matrix::upload_dtype(
        &ctx,
        "w",
        DType::Q8_0,
        4,
        128,
        1,
        &[&bytes[..bytes.len() - 34]],
    );
    assert!(err(short.unwrap_err()).contains("34-byte blocks"));
    let mut nan = bytes.clone();
    nan[5 * 34..5 * 34 + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
    let bad = Q4Matrix::upload_dtype(&ctx, "w", DType::Q8_0, 4, 128, 1, &[&nan]).unwrap_err();
    // A data error, not a shape one: the message says so.
    assert!(matches!(bad, crate::context::GpuError::Data(_)), "{bad}");
    assert_eq!(
        err(bad),
        "bad model data: w: block 5 has a non-finite scale"
    );
    // Parts split at the binding limit hold twice the bytes per row of Q4_0's.
    let small = ctx.with_max_binding_bytes(3 * 4 * 32);
    let split = Q4Matrix::upload_dtype(&small, "w", DType::Q8_0, 4, 128, 1, &[&bytes]).unwrap();
    assert_eq!(split.parts.len(), 2);
    split.check_layout("split").unwrap();
}

#[test]
fn q8_matvec_forms_match_the_reference() {
    let Some(ctx) = gpu("q8_matvec_forms_match_the_reference") else {
        return;
    };
    let mut r = rng(83);
    let state = RunState::default().buffer(&ctx).unwrap();
    for (form, dt) in FORMS {
        let k = MatvecKernel::with_form(&ctx, Numerics::F32, false, form).unwrap();
        let late = MatvecKernel::with_form(&ctx, Numerics::F32, true, form).unwrap();
        for &(rows, cols) in &[
            (1usize, 64usize),
            (13, 192),
            (300, 2048),
            (9000, 64),
            (5, 4096),
            (13, 768),
            (9000, 256),
        ] {
            if !fits(dt, cols) {
                continue;
            }
            let wb = rand_bytes(&mut r, dt, rows, cols);
            let deq = dequant(dt, &wb, rows, cols);
            let w = Q4Matrix::upload_dtype(&ctx, "w", dt, rows, cols, 1, &[&wb]).unwrap();
            let x = rand_f32(&mut r, cols, -2.0, 2.0);
            matvec_every_form(
                &ctx,
                &mut r,
                (&k, &late, &state),
                (&w, &deq),
                &x,
                |x| mag_of(dt, &wb, rows, cols, x),
                &format!("{form:?}"),
            );
        }
    }
    // Forms are never mixed: a Q4_0 matrix in the byte kernel, a byte one in the Q4_0 kernel,
    // and the bfp24 numerics with the byte form are clear errors.
    let y = ctx.storage("y", 4 * 4).unwrap();
    let x = ctx
        .storage_init("x", bytemuck::cast_slice(&[0.5f32; 64]))
        .unwrap();
    let q4 = Q4Matrix::upload(&ctx, "q", 4, 64, 1, &[&rand_q4_0(&mut r, 4, 64)]).unwrap();
    let k = MatvecKernel::with_form(&ctx, Numerics::F32, false, QForm::Q8_0).unwrap();
    let e = k
        .bind_q4(&ctx, &q4, Act::F32(&x), &y, &state)
        .err()
        .unwrap();
    assert!(e.to_string().contains("reads Q8_0"), "{e}");
    let q8 = Q4Matrix::upload_dtype(
        &ctx,
        "b",
        DType::Q8_0,
        4,
        64,
        1,
        &[&rand_q8_0(&mut r, 4, 64)],
    )
    .unwrap();
    let plain = MatvecKernel::new(&ctx).unwrap();
    assert!(plain.bind_q4(&ctx, &q8, Act::F32(&x), &y, &state).is_err());
    assert!(MatvecKernel::with_form(&ctx, Numerics::Bfp24, false, QForm::Q8_0).is_err());
    // The two byte forms are not one: a Q8_0 matrix in the MLX 8-bit kernel is refused.
    let a8 = MatvecKernel::with_form(&ctx, Numerics::F32, false, QForm::Affine8).unwrap();
    assert!(a8.bind_q4(&ctx, &q8, Act::F32(&x), &y, &state).is_err());
}

#[test]
fn embedding_reads_q8_tables_exactly_across_parts() {
    let Some(ctx) = gpu("embedding_reads_q8_tables_exactly_across_parts") else {
        return;
    };
    let mut r = rng(84);
    for (form, dt) in FORMS {
        let k = EmbedKernel::new_for(&ctx, form).unwrap();
        for (vocab, hidden, limit) in [
            (50usize, 192usize, None),
            (50, 256, None),
            (301, 2048, Some(7 * 64 * 32)),
        ] {
            if !fits(dt, hidden) {
                continue;
            }
            let table = rand_bytes(&mut r, dt, vocab, hidden);
            embedding_rows_exact(&ctx, &k, (form, dt), &table, (vocab, hidden), limit);
        }
        let q4 = Q4Matrix::upload(&ctx, "q", 4, 64, 1, &[&rand_q4_0(&mut r, 4, 64)]).unwrap();
        let h = ctx.storage("h", 64 * 4).unwrap();
        let state = RunState::default().buffer(&ctx).unwrap();
        assert!(k.bind(&ctx, &q4, &h, &state).is_err());
    }
}

/// `k` (an embedding kernel of `form`) looks up rows 0, V / 3 and V - 1 of `table` (`dt`,
/// `[V, H]` = `shape`) bit for bit as the reference dequantises them, with the table split in
/// parts of at most `limit` bytes per binding where given: every form's `q d` or `s q + b`
/// (`s q` exact) rounds as the reference does.
pub(super) fn embedding_rows_exact(
    ctx: &crate::context::Context,
    k: &EmbedKernel,
    (form, dt): (QForm, DType),
    table: &[u8],
    (vocab, hidden): (usize, usize),
    limit: Option<u64>,
) {
    let c = match limit {
        Some(l) => ctx.with_max_binding_bytes(l),
        None => ctx.clone(),
    };
    let m = Q4Matrix::upload_dtype(&c, "embd", dt, vocab, hidden, 1, &[table]).unwrap();
    if let Some(l) = limit {
        // Rows per part: the binding limit over a row's payload bytes.
        let per = l as usize / (hidden / 32 * form.block_bytes() as usize);
        assert_eq!(m.parts.len(), vocab.div_ceil(per), "{form:?} V={vocab}");
    }
    let full = dequant(dt, table, vocab, hidden);
    let h = ctx.storage("h", hidden as u64 * 4).unwrap();
    for token in [0, vocab as u32 / 3, vocab as u32 - 1] {
        let state = RunState {
            token,
            ..Default::default()
        }
        .buffer(&c)
        .unwrap();
        c.write(&h, 0, &vec![0xFF; hidden * 4]);
        let b = k.bind(&c, &m, &h, &state).unwrap();
        c.run_pass(|p| k.record(p, &b)).unwrap();
        let want = &full[token as usize * hidden..(token as usize + 1) * hidden];
        let got = c.read_f32(&h, hidden).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{form:?} V={vocab} token {token}"
        );
    }
}

/// The multi-column matmul (multi-stream decode, the column prefill) on byte-form matrices:
/// every tile that serves the column count, plain and accumulating; columns are independent.
#[test]
fn q8_matmul_matches_the_reference_for_every_tile() {
    let Some(ctx) = gpu("q8_matmul_matches_the_reference_for_every_tile") else {
        return;
    };
    let mut r = rng(85);
    let k = MatmulKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for (form, dt) in FORMS {
        for &(rows, cols) in &[(13usize, 192usize), (13, 768), (300, 2048)] {
            if !fits(dt, cols) {
                continue;
            }
            let wb = rand_bytes(&mut r, dt, rows, cols);
            let mag = |xc: &[f32]| mag_of(dt, &wb, rows, cols, xc);
            let what = format!("{form:?}");
            matmul_every_tile(
                &ctx,
                &mut r,
                (&k, &state),
                dt,
                &wb,
                (rows, cols),
                mag,
                &what,
            );
        }
    }
}

/// The matvec kernel `k` and its late-scaled twin `late` on the uploaded matrix `w` (`deq`:
/// its weights as the reference reads them) against the reference for the input `x`: the
/// plain product at every rows-per-team, the accumulating `y += m x` into random outputs, and
/// both norm-on-load forms over a random `h` and norm weight; `mag(x)` is each row's magnitude
/// of the rounding for the input `x`. Shared with the 4-bit affine form's test
/// (affine_tests.rs).
pub(super) fn matvec_every_form(
    ctx: &crate::context::Context,
    r: &mut impl rand::Rng,
    (k, late, state): (&MatvecKernel, &MatvecKernel, &wgpu::Buffer),
    (w, deq): (&Q4Matrix, &[f32]),
    x: &[f32],
    mag: impl Fn(&[f32]) -> Vec<f32>,
    what: &str,
) {
    let (rows, cols) = (w.rows as usize, w.cols as usize);
    let xb = ctx.storage_init("x", bytemuck::cast_slice(x)).unwrap();
    let want = matvec_f32_ref(deq, rows, cols, x);
    let m = mag(x);
    let y = ctx.storage("y", rows as u64 * 4).unwrap();
    for rpt in F32_ROWS_PER_TEAM {
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        let b = k
            .bind_q4_with(ctx, w, Act::F32(&xb), &y, state, rpt)
            .unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        assert_within(
            &got,
            &want,
            &m,
            2e-6,
            &format!("{what} [{rows}, {cols}] r{rpt}"),
        );
    }
    // y += m · x.
    let y0 = rand_f32(r, rows, -1.0, 1.0);
    ctx.write(&y, 0, bytemuck::cast_slice(&y0));
    let b = k.bind_q4_acc(ctx, w, &xb, &y, state).unwrap();
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    let got = ctx.read_f32(&y, rows).unwrap();
    let want_acc: Vec<f32> = want.iter().zip(&y0).map(|(a, b)| a + b).collect();
    let mag_acc: Vec<f32> = m.iter().zip(&y0).map(|(m, b)| m + b.abs()).collect();
    let acc = format!("{what} acc [{rows}, {cols}]");
    assert_within(&got, &want_acc, &mag_acc, 2e-6, &acc);
    // The norm-on-load forms, plain and late-scaled.
    let h = rand_f32(r, cols, -30.0, 30.0);
    let nw = rand_f32(r, cols, 0.5, 1.5);
    let (_, xn) = crate::kernels::norm::rmsnorm_ref(&h, None, &nw, 1e-6);
    let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
    let wbuf = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
    let input = NormInput {
        h: &hb,
        weight: &wbuf,
        eps: 1e-6,
    };
    let want = matvec_f32_ref(deq, rows, cols, &xn);
    let m = mag(&xn);
    for (kern, form) in [(k, "norm"), (late, "late norm")] {
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        let b = kern.bind_q4_norm(ctx, w, input, &y, state).unwrap();
        ctx.run_pass(|p| kern.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        let what = format!("{what} {form} [{rows}, {cols}]");
        assert_within(&got, &want, &m, 4e-6, &what);
    }
}

/// The matmul on the `[rows, cols]` matrix of file type `dt` held in `wb`, against the
/// reference for 1, 3 and 8 columns through every tile that serves them, plain and
/// accumulating into random outputs; `mag(x)` is each row's magnitude of the rounding for one
/// column `x`. Shared with the 4-bit affine form's test (affine_tests.rs).
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_every_tile(
    ctx: &crate::context::Context,
    r: &mut impl rand::Rng,
    (k, state): (&MatmulKernel, &wgpu::Buffer),
    dt: DType,
    wb: &[u8],
    (rows, cols): (usize, usize),
    mag: impl Fn(&[f32]) -> Vec<f32>,
    what: &str,
) {
    let deq = dequant(dt, wb, rows, cols);
    let w = Q4Matrix::upload_dtype(ctx, "w", dt, rows, cols, 1, &[wb]).unwrap();
    let nbmax = 8usize;
    let x = rand_f32(r, nbmax * cols, -2.0, 2.0);
    let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
    for nb in [1u32, 3, 8] {
        let n = nb as usize;
        let y = ctx.storage("y", (n * rows * 4) as u64).unwrap();
        for tile in Tile::all().filter(|t| t.cols >= nb) {
            for acc in [false, true] {
                let y0 = rand_f32(r, n * rows, -1.0, 1.0);
                ctx.write(&y, 0, bytemuck::cast_slice(&y0));
                let a = MatmulArgs {
                    m: &w,
                    input: match acc {
                        true => MatmulInput::Acc(&xb),
                        false => MatmulInput::Plain(&xb),
                    },
                    nb,
                    y: &y,
                    y_stride: rows as u32,
                    state,
                };
                let b = k.bind_tiled(ctx, &a, tile).unwrap();
                ctx.run_pass(|p| k.record(p, &b)).unwrap();
                let got = ctx.read_f32(&y, n * rows).unwrap();
                for c in 0..n {
                    let xc = &x[c * cols..(c + 1) * cols];
                    let mut want = matvec_f32_ref(&deq, rows, cols, xc);
                    let mut m = mag(xc);
                    if acc {
                        for i in 0..rows {
                            want[i] += y0[c * rows + i];
                            m[i] += y0[c * rows + i].abs();
                        }
                    }
                    assert_within(
                        &got[c * rows..(c + 1) * rows],
                        &want,
                        &m,
                        2e-6,
                        &format!("{what} [{rows}, {cols}] nb {nb} {tile:?} acc {acc} column {c}"),
                    );
                }
            }
        }
    }
}

#[test]
fn mlx8_repack_decodes_to_the_reference_weights() {
    let mut r = rng(86);
    for (rows, cols) in [(1usize, 64usize), (3, 192), (17, 2048)] {
        let bytes = rand_mlx_a8(&mut r, rows, cols);
        let (qs, words) = repack_mlx_a8(bytes.chunks_exact(68)).unwrap();
        assert_eq!(qs.len(), rows * cols / 4, "eight words per block of 32");
        assert_eq!(words.len(), rows * cols / 64, "one scale word per group");
        let got: Vec<f32> = qs
            .chunks_exact(16)
            .zip(&words)
            .flat_map(|(q, &v)| {
                let (s, b) = (f32::from_bits(v << 16), f32::from_bits(v & 0xFFFF_0000));
                q.iter()
                    .flat_map(|w| w.to_le_bytes())
                    .map(move |u| u as f32 * s + b)
                    .collect::<Vec<_>>()
            })
            .collect();
        let want = dequant(DType::MLX_A8, &bytes, rows, cols);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {cols}]"
        );
    }
    let mut bytes = rand_mlx_a8(&mut r, 2, 128);
    bytes[3 * 68 + 2..3 * 68 + 4].copy_from_slice(&0x7F80u16.to_le_bytes());
    assert_eq!(repack_mlx_a8(bytes.chunks_exact(68)).err(), Some(3));
}

#[test]
fn q6_k_repack_decodes_to_the_reference_weights() {
    let mut r = rng(87);
    for (rows, cols) in [(1usize, 256usize), (3, 768), (17, 2048)] {
        let bytes = rand_q6_k(&mut r, rows, cols);
        let (qs, scales) = repack_q6_k(bytes.chunks_exact(210)).unwrap();
        assert_eq!(
            qs.len(),
            rows * cols / 32 * 7,
            "seven words per block of 32"
        );
        assert_eq!(
            scales.len(),
            rows * cols / 32,
            "the super-block's d per block"
        );
        let got = decode_q6(&qs, &scales);
        let want = dequant(DType::Q6_K, &bytes, rows, cols);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {cols}]"
        );
    }
    // The first non-finite d is named (by super-block).
    let mut bytes = rand_q6_k(&mut r, 2, 512);
    bytes[2 * 210 + 208..2 * 210 + 210].copy_from_slice(&0x7C00u16.to_le_bytes());
    assert_eq!(repack_q6_k(bytes.chunks_exact(210)).err(), Some(2));
}

#[test]
fn q6_k_upload_refuses_lying_sizes_and_nan_scales() {
    let Some(ctx) = gpu("q6_k_upload_refuses_lying_sizes_and_nan_scales") else {
        return;
    };
    let mut r = rng(88);
    let bytes = rand_q6_k(&mut r, 4, 512);
    let ok = Q4Matrix::upload_dtype(&ctx, "w", DType::Q6_K, 4, 512, 1, &[&bytes]).unwrap();
    assert_eq!(ok.form(), Some(QForm::Q6K));
    ok.check_layout("w").unwrap();
    assert_eq!(
        ok.bytes(),
        4 * 16 * 28 + 4 * 16 * 2,
        "28 payload bytes and an f16 per block"
    );
    let err = |e: crate::context::GpuError| e.to_string();
    let short = Q4Matrix::upload_dtype(
        &ctx,
        "w",
        DType::Q6_K,
        4,
        512,
        1,
        &[&bytes[..bytes.len() - 210]],
    );
    assert!(err(short.unwrap_err()).contains("210-byte super-blocks"));
    let narrow = Q4Matrix::upload_dtype(&ctx, "w", DType::Q6_K, 8, 128, 1, &[&bytes[..4 * 210]]);
    assert!(err(narrow.unwrap_err()).contains("cols % 256"));
    let mut nan = bytes.clone();
    nan[5 * 210 + 208..5 * 210 + 210].copy_from_slice(&0x7E00u16.to_le_bytes());
    let bad = Q4Matrix::upload_dtype(&ctx, "w", DType::Q6_K, 4, 512, 1, &[&nan]);
    assert!(err(bad.unwrap_err()).contains("super-block 5"));
    let small = ctx.with_max_binding_bytes(3 * 16 * 32);
    let split = Q4Matrix::upload_dtype(&small, "w", DType::Q6_K, 4, 512, 1, &[&bytes]).unwrap();
    assert_eq!(split.parts.len(), 2);
    split.check_layout("split").unwrap();
    // A Q6_K matrix in a Q8_0 kernel is refused: the forms differ in the payload's bits.
    let state = RunState::default().buffer(&ctx).unwrap();
    let y = ctx.storage("y", 4 * 4).unwrap();
    let x = ctx
        .storage_init("x", bytemuck::cast_slice(&[0.5f32; 512]))
        .unwrap();
    let q8 = MatvecKernel::with_form(&ctx, Numerics::F32, false, QForm::Q8_0).unwrap();
    let e = q8
        .bind_q4(&ctx, &ok, Act::F32(&x), &y, &state)
        .err()
        .unwrap();
    assert!(e.to_string().contains("Q6_K"), "{e}");
}

/// Block `blk`'s `(d sc, -dmin m)` from the K-quants' scale words as the kernels read them
/// (tensor.rs `Q4_SB_K`).
fn k_sb(words: &[u32], blk: usize) -> (f32, f32) {
    let (x, y) = (words[2 * (blk / 2)], words[2 * (blk / 2) + 1]);
    let d = half::f16::from_bits(x as u16).to_f32();
    let dmin = half::f16::from_bits((x >> 16) as u16).to_f32();
    let sm = y >> (12 * (blk % 2));
    (d * (sm & 63) as f32, -(dmin * ((sm >> 6) & 63) as f32))
}

#[test]
fn q4_k_repack_decodes_to_the_reference_weights() {
    let mut r = rng(89);
    for (rows, cols) in [(1usize, 256usize), (3, 768), (17, 2048)] {
        let bytes = crate::testing::rand_q4_k(&mut r, rows, cols);
        let (qs, words) = repack_q4_k(bytes.chunks_exact(144)).unwrap();
        assert_eq!(qs.len(), rows * cols / 8, "four words per block of 32");
        assert_eq!(
            words.len(),
            rows * cols / 32,
            "two words per pair of blocks"
        );
        // As the kernels read them (tensor.rs `Q4_SB_K`): (d sc) q - dmin m, one rounding.
        let got: Vec<f32> = qs
            .chunks_exact(4)
            .enumerate()
            .flat_map(|(blk, q)| {
                let (s, b) = k_sb(&words, blk);
                let bytes: Vec<u8> = q.iter().flat_map(|w| w.to_le_bytes()).collect();
                (0..32)
                    .map(|e| {
                        let n = (bytes[e % 16] >> (4 * (e / 16))) & 0xF;
                        s.mul_add(n as f32, b)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let want = dequant(DType::Q4_K, &bytes, rows, cols);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {cols}]"
        );
    }
    // The first non-finite d or dmin is named (by super-block).
    for at in [0, 2] {
        let mut bytes = crate::testing::rand_q4_k(&mut r, 2, 512);
        bytes[3 * 144 + at..3 * 144 + at + 2].copy_from_slice(&0x7C00u16.to_le_bytes());
        assert_eq!(repack_q4_k(bytes.chunks_exact(144)).err(), Some(3));
    }
}

#[test]
fn q5_k_repack_decodes_to_the_reference_weights() {
    let mut r = rng(91);
    for (rows, cols) in [(1usize, 256usize), (3, 768), (17, 2048)] {
        let bytes = crate::testing::rand_q5_k(&mut r, rows, cols);
        let (qs, words) = repack_q5_k(bytes.chunks_exact(176)).unwrap();
        assert_eq!(qs.len(), rows * cols / 32 * 5, "five words per block of 32");
        assert_eq!(
            words.len(),
            rows * cols / 32,
            "two words per pair of blocks"
        );
        // As the kernels read them (tensor.rs `Q4_SB_K`; qform.rs `Q5_PAYLOAD`: element j's
        // low bits in Q4_0's nibble order, its fifth bit at bit 8 (j % 4) + 4 (j / 16) + (j % 16)
        // / 4 of word 4): (d sc) q - dmin m, one rounding.
        let got: Vec<f32> = qs
            .chunks_exact(5)
            .enumerate()
            .flat_map(|(blk, q)| {
                let (s, b) = k_sb(&words, blk);
                let nib: Vec<u8> = q[..4].iter().flat_map(|w| w.to_le_bytes()).collect();
                (0..32)
                    .map(|j| {
                        let low = (nib[j % 16] >> (4 * (j / 16))) & 0xF;
                        let at = 8 * (j % 4) + 4 * (j / 16) + (j % 16) / 4;
                        let l = low as u32 | ((q[4] >> at) & 1) << 4;
                        s.mul_add(l as f32, b)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let want = dequant(DType::Q5_K, &bytes, rows, cols);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {cols}]"
        );
    }
    // The first non-finite d or dmin is named (by super-block).
    for at in [0, 2] {
        let mut bytes = crate::testing::rand_q5_k(&mut r, 2, 512);
        bytes[3 * 176 + at..3 * 176 + at + 2].copy_from_slice(&0x7C00u16.to_le_bytes());
        assert_eq!(repack_q5_k(bytes.chunks_exact(176)).err(), Some(3));
    }
}
