//! Lavapipe tests of the prefill GEMM's dense forms against an f64 reference over the dequantised
//! weights: odd shapes, both tile heights, a split matrix, rows past `dims.m` left alone, the
//! `+=` form, the f32 form with K in splits, and shape errors. The expert forms are tested through the MoE
//! (moe_prefill_tests.rs).

use super::*;
use crate::testing::{dequant, dequant_q4_0, gpu, rand_f32, rand_mlx_a4, rand_q4_0, rng};
use nibble_quant::DType;

/// `(tokens, rows, cols)`: one token and one row; rows not a multiple of the 128-row tile;
/// tokens not a multiple of either tile height; the 2048-input rows of the real qkv; many tiles.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 32),
    (5, 130, 64),
    (37, 200, 96),
    (64, 128, 2048),
    (130, 384, 128),
];

/// Padding rows past `m` in X and Y, and padding columns past the rows in Y: never written.
const PAD_ROWS: usize = 3;
const PAD_COLS: usize = 5;

fn dims(ctx: &Context, m: usize) -> wgpu::Buffer {
    ctx.uniform("dims", bytemuck::cast_slice(&[m as u32, 0, 0, 0]))
        .unwrap()
}

/// A dense form's arguments: X and Y of `rows` token rows, Y rows `stride` apart.
fn dense_args<'a>(
    form: GemmForm,
    w: GemmWeights<'a>,
    (x, y): (&'a wgpu::Buffer, &'a wgpu::Buffer),
    stride: usize,
    rows: usize,
    d: &'a wgpu::Buffer,
) -> GemmArgs<'a> {
    GemmArgs {
        form,
        w,
        x,
        y,
        y_stride: stride as u32,
        x_rows: rows as u32,
        y_rows: rows as u32,
        dims: Some(d),
        plan: None,
        rows_per_expert: 0,
        max_tiles: 0,
    }
}

/// Reference `Y [m, rows]` in f64 and `Σ|w||x|` per output (the scale of f32 rounding).
fn reference(deq: &[f32], rows: usize, cols: usize, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0f64; m * rows];
    let mut mag = vec![0f64; m * rows];
    for t in 0..m {
        for r in 0..rows {
            for c in 0..cols {
                let p = deq[r * cols + c] as f64 * x[t * cols + c] as f64;
                y[t * rows + r] += p;
                mag[t * rows + r] += p.abs();
            }
        }
    }
    (y, mag)
}

/// Run a dense GEMM over `m` tokens with `tm` tokens per thread into a Y pre-filled with
/// `init` (`[m + PAD_ROWS, rows + PAD_COLS]`); returns Y.
#[allow(clippy::too_many_arguments)]
fn run_dense(
    ctx: &Context,
    k: &GemmKernel,
    w: GemmWeights<'_>,
    x: &[f32],
    m: usize,
    tm: u32,
    acc: bool,
    init: &[f32],
) -> Vec<f32> {
    let (r, c) = w.shape();
    let (rows, cols) = (r as usize, c as usize);
    let form = match (w, acc) {
        (GemmWeights::F32(_), _) => GemmForm::DenseF32,
        (_, true) => GemmForm::DenseAcc,
        _ => GemmForm::Dense,
    };
    let stride = rows + PAD_COLS;
    let xb = ctx.storage_init("x", bytemuck::cast_slice(x)).unwrap();
    let y = ctx.storage_init("y", bytemuck::cast_slice(init)).unwrap();
    let d = dims(ctx, m);
    let b = k
        .bind(
            ctx,
            &GemmArgs {
                form,
                w,
                x: &xb,
                y: &y,
                y_stride: stride as u32,
                x_rows: (x.len() / cols) as u32,
                y_rows: (m + PAD_ROWS) as u32,
                dims: Some(&d),
                plan: None,
                rows_per_expert: 0,
                max_tiles: 0,
            },
            tm,
        )
        .unwrap();
    assert_eq!(b.dispatch_count(), w.parts().unwrap().len());
    ctx.run_pass(|p| k.record(p, &b, m as u32)).unwrap();
    ctx.read_f32(&y, (m + PAD_ROWS) * stride).unwrap()
}

/// Y against the reference within 1e-5 of Σ|w||x| (f32 sums of up to 2048 products in order),
/// `base` added first (the `+=` form), and every padding element still equal to `init`.
fn check(
    got: &[f32],
    init: &[f32],
    want: &(Vec<f64>, Vec<f64>),
    base: bool,
    rows: usize,
    m: usize,
    what: &str,
) {
    let stride = rows + PAD_COLS;
    for t in 0..m + PAD_ROWS {
        for c in 0..stride {
            let i = t * stride + c;
            if t < m && c < rows {
                let b = if base { init[i] as f64 } else { 0.0 };
                let w = want.0[t * rows + c] + b;
                let err = (got[i] as f64 - w).abs();
                assert!(
                    err <= 1e-5 * want.1[t * rows + c] + 1e-6 * b.abs(),
                    "{what}: token {t} row {c}: got {}, want {w}",
                    got[i]
                );
            } else {
                assert_eq!(
                    got[i].to_bits(),
                    init[i].to_bits(),
                    "{what}: token {t} column {c} past the output was written"
                );
            }
        }
    }
}

#[test]
fn gemm_dense_matches_reference() {
    let Some(ctx) = gpu("gemm_dense_matches_reference") else {
        return;
    };
    let ks = test_kernels(&ctx);
    let mut r = rng(71);
    for &(m, rows, cols) in SHAPES {
        let wb = rand_q4_0(&mut r, rows, cols);
        let deq = dequant_q4_0(&wb, rows, cols);
        let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
        let wf = F32Matrix::upload(&ctx, "wf", rows, cols, &deq).unwrap();
        // X holds PAD_ROWS more tokens than dims.m: they must not be read into Y.
        let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
        let want = reference(&deq, rows, cols, &x, m);
        let stride = rows + PAD_COLS;
        for (tm, (ki, k)) in [2, 4]
            .into_iter()
            .flat_map(|tm| ks.iter().enumerate().map(move |k| (tm, k)))
        {
            let init = vec![f32::NAN; (m + PAD_ROWS) * stride];
            let got = run_dense(&ctx, k, GemmWeights::Q4(&w), &x, m, tm, false, &init);
            let what = format!("dense m {m} [{rows}, {cols}] tm {tm} kernel {ki}");
            check(&got, &init, &want, false, rows, m, &what);
            // The same weights as an f32 matrix (the router's form).
            let got = run_dense(&ctx, k, GemmWeights::F32(&wf), &x, m, tm, false, &init);
            check(&got, &init, &want, false, rows, m, &format!("f32 {what}"));
            let init = rand_f32(&mut r, (m + PAD_ROWS) * stride, -2.0, 2.0);
            let got = run_dense(&ctx, k, GemmWeights::Q4(&w), &x, m, tm, true, &init);
            check(
                &got,
                &init,
                &want,
                true,
                rows,
                m,
                &format!("dense+= m {m} [{rows}, {cols}] tm {tm} kernel {ki}"),
            );
        }
    }
}

/// The affine (MLX) form's weights (`fma(s, q, b)`, tensor.rs) against the same reference: `=`
/// and `+=`, both tile heights, odd token and row counts, a split matrix, on every kernel the
/// device has ([`test_kernels_for`]); each kernel refuses a matrix of the other form by name.
#[test]
fn gemm_affine_dense_matches_reference() {
    let Some(ctx) = gpu("gemm_affine_dense_matches_reference") else {
        return;
    };
    let ks = test_kernels_for(&ctx, QForm::Affine4);
    let small = ctx.with_max_binding_bytes(20 * 2 * 16);
    let mut r = rng(75);
    let whole: &Context = &ctx;
    for (m, rows, cols, c) in [
        (1, 1, 64, whole),
        (37, 200, 192, whole),
        (64, 130, 2048, whole),
        (45, 300, 128, &small),
    ] {
        let wb = rand_mlx_a4(&mut r, rows, cols);
        let deq = dequant(DType::MLX_A4, &wb, rows, cols);
        let w = Q4Matrix::upload_dtype(c, "w", DType::MLX_A4, rows, cols, 1, &[&wb]).unwrap();
        assert!(c.max_binding_bytes() == whole.max_binding_bytes() || w.parts.len() > 1);
        let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
        let want = reference(&deq, rows, cols, &x, m);
        let stride = rows + PAD_COLS;
        for (tm, (ki, k)) in [2, 4]
            .into_iter()
            .flat_map(|tm| ks.iter().enumerate().map(move |k| (tm, k)))
        {
            let what = format!(
                "affine m {m} [{rows}, {cols}] tm {tm} parts {} kernel {ki}",
                w.parts.len()
            );
            let init = vec![f32::NAN; (m + PAD_ROWS) * stride];
            let got = run_dense(&ctx, k, GemmWeights::Q4(&w), &x, m, tm, false, &init);
            check(&got, &init, &want, false, rows, m, &what);
            let init = rand_f32(&mut r, (m + PAD_ROWS) * stride, -2.0, 2.0);
            let got = run_dense(&ctx, k, GemmWeights::Q4(&w), &x, m, tm, true, &init);
            check(&got, &init, &want, true, rows, m, &format!("+= {what}"));
        }
    }
    // A kernel made for one form reads the other's matrix too, with that form's pipeline
    // (per part: tensor.rs), and gets the reference.
    let (m, rows, cols) = (5, 4, 64);
    let (ba, b0) = (
        rand_mlx_a4(&mut r, rows, cols),
        rand_q4_0(&mut r, rows, cols),
    );
    let wa = Q4Matrix::upload_dtype(&ctx, "wa", DType::MLX_A4, rows, cols, 1, &[&ba]).unwrap();
    let w0 = Q4Matrix::upload(&ctx, "w0", rows, cols, 1, &[&b0]).unwrap();
    let q4_0 = GemmKernel::new(&ctx).unwrap();
    let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
    let init = vec![f32::NAN; (m + PAD_ROWS) * (rows + PAD_COLS)];
    for (kern, w, dt, b) in [
        (&ks[0], &w0, DType::Q4_0, &b0),
        (&q4_0, &wa, DType::MLX_A4, &ba),
    ] {
        let want = reference(&dequant(dt, b, rows, cols), rows, cols, &x, m);
        let got = run_dense(&ctx, kern, GemmWeights::Q4(w), &x, m, 2, false, &init);
        check(
            &got,
            &init,
            &want,
            false,
            rows,
            m,
            &format!("{dt:?} in another's kernel"),
        );
    }
}

/// The byte form (Q8_0, f32 fmas only: `with_form` keeps it off the matrix units) against the
/// same reference: `=` and `+=`, both tile heights, odd shapes, a split matrix; a kernel made
/// for Q4_0 (on matrix units where the device has them) reads a Q8_0 matrix on f32 fmas.
#[test]
fn gemm_q8_dense_matches_reference() {
    let Some(ctx) = gpu("gemm_q8_dense_matches_reference") else {
        return;
    };
    let ks = test_kernels_for(&ctx, QForm::Q8_0);
    assert!(
        ks.len() == 1 && !ks[0].coop(),
        "the byte form runs on f32 fmas"
    );
    let small = ctx.with_max_binding_bytes(20 * 3 * 32);
    let mut r = rng(77);
    let whole: &Context = &ctx;
    for (m, rows, cols, c) in [
        (1, 1, 32, whole),
        (37, 200, 96, whole),
        (64, 130, 2048, whole),
        (45, 300, 96, &small),
    ] {
        let wb = crate::testing::rand_q8_0(&mut r, rows, cols);
        let deq = dequant(DType::Q8_0, &wb, rows, cols);
        let w = Q4Matrix::upload_dtype(c, "w", DType::Q8_0, rows, cols, 1, &[&wb]).unwrap();
        assert!(c.max_binding_bytes() == whole.max_binding_bytes() || w.parts.len() > 1);
        let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
        let want = reference(&deq, rows, cols, &x, m);
        let stride = rows + PAD_COLS;
        for tm in [2, 4] {
            let what = format!(
                "Q8_0 m {m} [{rows}, {cols}] tm {tm} parts {}",
                w.parts.len()
            );
            let init = vec![f32::NAN; (m + PAD_ROWS) * stride];
            let got = run_dense(&ctx, &ks[0], GemmWeights::Q4(&w), &x, m, tm, false, &init);
            check(&got, &init, &want, false, rows, m, &what);
            let init = rand_f32(&mut r, (m + PAD_ROWS) * stride, -2.0, 2.0);
            let got = run_dense(&ctx, &ks[0], GemmWeights::Q4(&w), &x, m, tm, true, &init);
            check(&got, &init, &want, true, rows, m, &format!("+= {what}"));
        }
    }
    let (m, rows, cols) = (5, 4, 64);
    let b8 = crate::testing::rand_q8_0(&mut r, rows, cols);
    let w8 = Q4Matrix::upload_dtype(&ctx, "w8", DType::Q8_0, rows, cols, 1, &[&b8]).unwrap();
    let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
    let init = vec![f32::NAN; (m + PAD_ROWS) * (rows + PAD_COLS)];
    let want = reference(&dequant(DType::Q8_0, &b8, rows, cols), rows, cols, &x, m);
    let q4_0 = GemmKernel::new(&ctx).unwrap();
    let got = run_dense(&ctx, &q4_0, GemmWeights::Q4(&w8), &x, m, 2, false, &init);
    check(&got, &init, &want, false, rows, m, "Q8_0 in a Q4_0 kernel");
}

/// A matrix split over 15 bindings gives the same Y as the reference (one dispatch per part,
/// each writing its own row range).
#[test]
fn gemm_split_matrix_matches_reference() {
    let Some(ctx) = gpu("gemm_split_matrix_matches_reference") else {
        return;
    };
    let mut r = rng(72);
    let (m, rows, cols) = (45, 300, 128);
    let small = ctx.with_max_binding_bytes(20 * 4 * 16);
    let k = GemmKernel::new(&small).unwrap();
    let wb = rand_q4_0(&mut r, rows, cols);
    let deq = dequant_q4_0(&wb, rows, cols);
    let w = Q4Matrix::upload(&small, "w", rows, cols, 1, &[&wb]).unwrap();
    assert_eq!(w.parts.len(), 15);
    let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
    let want = reference(&deq, rows, cols, &x, m);
    let init = vec![f32::NAN; (m + PAD_ROWS) * (rows + PAD_COLS)];
    let got = run_dense(&ctx, &k, GemmWeights::Q4(&w), &x, m, 4, false, &init);
    check(&got, &init, &want, false, rows, m, "split");
    let wf = F32Matrix::upload(&small, "wf", rows, cols, &deq).unwrap();
    assert!(wf.parts.len() > 1);
    let got = run_dense(&ctx, &k, GemmWeights::F32(&wf), &x, m, 2, false, &init);
    check(&got, &init, &want, false, rows, m, "split f32");
}

#[test]
fn gemm_rejects_bad_shapes() {
    let Some(ctx) = gpu("gemm_rejects_bad_shapes") else {
        return;
    };
    let k = GemmKernel::new(&ctx).unwrap();
    let mut r = rng(73);
    let wb = rand_q4_0(&mut r, 64, 64);
    let w = Q4Matrix::upload(&ctx, "w", 64, 64, 1, &[&wb]).unwrap();
    let x = ctx.storage("x", 4 * 64 * 4).unwrap();
    let y = ctx.storage("y", 4 * 64 * 4).unwrap();
    let d = dims(&ctx, 4);
    let args = |x_rows: u32, y_rows: u32, stride: u32, with_dims: bool| GemmArgs {
        form: GemmForm::Dense,
        w: GemmWeights::Q4(&w),
        x: &x,
        y: &y,
        y_stride: stride,
        x_rows,
        y_rows,
        dims: with_dims.then_some(&d),
        plan: None,
        rows_per_expert: 0,
        max_tiles: 0,
    };
    assert!(k.bind(&ctx, &args(4, 4, 64, true), 4).is_ok());
    for (a, tm, what) in [
        (args(5, 4, 64, true), 4, "X too small"),
        (args(4, 5, 64, true), 4, "Y too small"),
        (args(4, 4, 63, true), 4, "stride below the rows"),
        (args(4, 4, 64, false), 4, "no dims"),
        (args(4, 4, 64, true), 3, "3 tokens per thread"),
        (args(0, 4, 64, true), 4, "zero rows"),
    ] {
        assert!(k.bind(&ctx, &a, tm).is_err(), "{what} was accepted");
    }
    let gu = GemmArgs {
        form: GemmForm::GateUp,
        ..args(4, 4, 64, true)
    };
    assert!(
        k.bind(&ctx, &gu, 4).is_err(),
        "gate_up without a plan was accepted"
    );
}

/// The f32 form with K in splits (the router, `bind_split`): each split's partial sums land in
/// its own block of Y rows, and their sum in split order matches the reference; rows past the
/// chunk in every block stay untouched. Odd split counts, both tile heights, K not a multiple of
/// the splits; and the splits `bind_split` refuses.
#[test]
fn gemm_f32_k_splits_match_reference() {
    let Some(ctx) = gpu("gemm_f32_k_splits_match_reference") else {
        return;
    };
    let k = GemmKernel::new(&ctx).unwrap();
    let mut r = rng(74);
    for (m, rows, cols, want_splits, tm) in [
        (37usize, 130usize, 2048usize, 16u32, 2u32),
        (5, 128, 224, 3, 4),
        (70, 20, 96, 16, 4),
    ] {
        let bpr = (cols / 32) as u32;
        let splits = k_splits(bpr, want_splits);
        assert!(splits > 1 && splits <= want_splits.min(bpr));
        let deq = rand_f32(&mut r, rows * cols, -1.0, 1.0);
        let wf = F32Matrix::upload(&ctx, "wf", rows, cols, &deq).unwrap();
        let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
        let want = reference(&deq, rows, cols, &x, m);
        let (yr, stride) = (m + PAD_ROWS, rows + PAD_COLS);
        let init = vec![f32::NAN; splits as usize * yr * stride];
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let y = ctx.storage_init("y", bytemuck::cast_slice(&init)).unwrap();
        let d = dims(&ctx, m);
        let a = dense_args(
            GemmForm::DenseF32,
            GemmWeights::F32(&wf),
            (&xb, &y),
            stride,
            yr,
            &d,
        );
        let b = k.bind_split(&ctx, &a, tm, splits).unwrap();
        ctx.run_pass(|p| k.record(p, &b, m as u32)).unwrap();
        let got = ctx.read_f32(&y, init.len()).unwrap();
        let block = yr * stride;
        let sum: Vec<f32> = (0..block)
            .map(|i| (1..splits as usize).fold(got[i], |v, z| v + got[z * block + i]))
            .collect();
        let what = format!("f32 m {m} [{rows}, {cols}] in {splits} K splits, tm {tm}");
        check(&sum, &init[..block], &want, false, rows, m, &what);
        for z in 0..splits as usize {
            for i in 0..block {
                let (t, c) = (i / stride, i % stride);
                assert_eq!(
                    t < m && c < rows,
                    !got[z * block + i].is_nan(),
                    "{what}: split {z} token {t} column {c}"
                );
            }
        }
        // Refused: a split count that leaves a slice empty or is not the one `k_splits` gives,
        // a Y without room for every split, and splits of an int4 form.
        let uneven = (1..=bpr).find(|&s| k_splits(bpr, s) != s);
        if let Some(s) = uneven {
            assert!(k.bind_split(&ctx, &a, tm, s).is_err(), "{what}: {s} splits");
        }
        assert!(k.bind_split(&ctx, &a, tm, 0).is_err(), "{what}: 0 splits");
        let small = ctx
            .storage("y", ((splits as usize - 1) * block) as u64 * 4)
            .unwrap();
        let short = GemmArgs { y: &small, ..a };
        assert!(
            k.bind_split(&ctx, &short, tm, splits).is_err(),
            "{what}: Y without room for the last split"
        );
    }
    let wb = rand_q4_0(&mut r, 64, 64);
    let w = Q4Matrix::upload(&ctx, "w", 64, 64, 1, &[&wb]).unwrap();
    let (x, y, d) = (
        ctx.storage("x", 4 * 64 * 4).unwrap(),
        ctx.storage("y", 2 * 4 * 64 * 4).unwrap(),
        dims(&ctx, 4),
    );
    let q4 = dense_args(GemmForm::DenseAcc, GemmWeights::Q4(&w), (&x, &y), 64, 4, &d);
    assert!(k.bind_split(&ctx, &q4, 4, 1).is_ok());
    assert!(
        k.bind_split(&ctx, &q4, 4, 2).is_err(),
        "the += form split its K"
    );
}

/// The int4 `=` form in K splits (a short chunk's qkv and o-proj), summed by the reduce kernel
/// (`=` and `+=` into Y): the reference within the usual bound, Y rows past the chunk and
/// columns past the outputs untouched.
#[test]
fn gemm_q4_k_splits_and_reduce_match_reference() {
    let Some(ctx) = gpu("gemm_q4_k_splits_and_reduce_match_reference") else {
        return;
    };
    use crate::kernels::gemm_reduce::{GemmReduceArgs, GemmReduceKernel};
    let red = GemmReduceKernel::new(&ctx).unwrap();
    let mut r = rng(75);
    for (m, rows, cols, want_splits, form, stacked) in [
        (37usize, 300usize, 256usize, 8u32, QForm::Q4_0, false),
        (3, 130, 2048, 4, QForm::Q4_0, false),
        (37, 300, 256, 8, QForm::Affine4, false),
        (25, 5120, 2048, 8, QForm::Affine4, false),
        (37, 300, 256, 8, QForm::Q8_0, false),
        (25, 5120, 2048, 8, QForm::Q8_0, false),
        (37, 300, 256, 8, QForm::Affine8, false),
        (37, 300, 512, 8, QForm::Q6K, false),
        (25, 5120, 2048, 8, QForm::Q6K, false),
        (37, 300, 512, 8, QForm::Q4K, false),
        (25, 5120, 2048, 8, QForm::Q4K, false),
        (37, 300, 512, 8, QForm::Q5K, false),
        (25, 5120, 2048, 8, QForm::Q5K, false),
        // A `Q4_K_M` qkv (q and k Q4_K, v Q6_K: two parts of two forms), 2 tokens too.
        (25, 5120, 2048, 8, QForm::Q6K, true),
        (2, 5120, 2048, 8, QForm::Q6K, true),
    ] {
        // Every block form (at the real qkv's shape too); stacked: the last 512 rows in
        // `form` under Q4_K ones.
        let pieces = match stacked {
            true => vec![(QForm::Q4K, rows - 512), (form, 512)],
            false => vec![(form, rows)],
        };
        let forms: Vec<QForm> = pieces.iter().map(|p| p.0).collect();
        let ks = test_kernels_for_forms(&ctx, &forms);
        let bpr = (cols / 32) as u32;
        let splits = k_splits(bpr, want_splits);
        assert!(splits > 1);
        let (w, deq) = crate::testing::rand_stack(&ctx, &mut r, &pieces, cols);
        assert_eq!(w.form().is_none(), stacked);
        let x = rand_f32(&mut r, (m + PAD_ROWS) * cols, -1.0, 1.0);
        let want = reference(&deq, rows, cols, &x, m);
        let (yr, stride) = (m + PAD_ROWS, rows + PAD_COLS);
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let part = ctx
            .storage("part", (splits as usize * yr * stride) as u64 * 4)
            .unwrap();
        let d = dims(&ctx, m);
        let a = dense_args(
            GemmForm::Dense,
            GemmWeights::Q4(&w),
            (&xb, &part),
            stride,
            yr,
            &d,
        );
        for (acc, (ki, k)) in [false, true]
            .into_iter()
            .flat_map(|acc| ks.iter().enumerate().map(move |k| (acc, k)))
        {
            // The partials start as NaN for every kernel, so each must write all of its own.
            ctx.write(
                &part,
                0,
                bytemuck::cast_slice(&vec![f32::NAN; splits as usize * yr * stride]),
            );
            let b = k.bind_split(&ctx, &a, 2, splits).unwrap();
            let init = rand_f32(&mut r, yr * stride, -2.0, 2.0);
            let y = ctx.storage_init("y", bytemuck::cast_slice(&init)).unwrap();
            let rb = red
                .bind(
                    &ctx,
                    &GemmReduceArgs {
                        part: &part,
                        y: &y,
                        y_rows: yr as u32,
                        n: rows as u32,
                        ys: stride as u32,
                        splits,
                        prows: yr as u32,
                        acc,
                        dims: &d,
                    },
                )
                .unwrap();
            ctx.run_pass(|p| {
                k.record(p, &b, m as u32);
                red.record(p, &rb, m as u32);
            })
            .unwrap();
            let got = ctx.read_f32(&y, yr * stride).unwrap();
            let what = format!(
                "q4 m {m} [{rows}, {cols}] in {splits} K splits, acc {acc}, kernel {ki}, {forms:?}"
            );
            check(&got, &init, &want, acc, rows, m, &what);
        }
        // The reduce refuses a part buffer without room for its splits.
        let y = ctx.storage("y", (yr * stride) as u64 * 4).unwrap();
        let bad = GemmReduceArgs {
            part: &part,
            y: &y,
            y_rows: yr as u32,
            n: rows as u32,
            ys: stride as u32,
            splits: splits + 1,
            prows: yr as u32,
            acc: false,
            dims: &d,
        };
        assert!(
            red.bind(&ctx, &bad).is_err(),
            "{what}: too many splits",
            what = rows
        );
        let wide = GemmReduceArgs {
            splits,
            n: stride as u32 + 1,
            ..bad
        };
        assert!(red.bind(&ctx, &wide).is_err(), "columns past the stride");
    }
}

/// Diagnostic (ignored; run on a device where the matrix-unit kernel is chosen to see what it
/// reads): one-hot weights (row r picks input `r % 32` of block `r / 128 % 2`) times inputs that
/// encode their own (token, input) index, so each wrong output names the element it came from.
#[test]
#[ignore]
fn gemm_onehot_probe() {
    let Some(ctx) = gpu("gemm_onehot_probe") else {
        return;
    };
    let k = GemmKernel::new(&ctx).unwrap();
    eprintln!("gemm_onehot_probe: matrix units {}", k.coop());
    let (m, rows, cols) = (32usize, 256usize, 64usize);
    let mut wb = Vec::new();
    for r in 0..rows {
        let (hot_blk, hot) = ((r / 128) % 2, r % 32);
        for blk in 0..cols / 32 {
            wb.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
            for j in 0..16 {
                let lo = if blk == hot_blk && hot == j { 9u8 } else { 8 };
                let hi = if blk == hot_blk && hot == j + 16 {
                    9u8
                } else {
                    8
                };
                wb.push(lo | (hi << 4));
            }
        }
    }
    let deq = dequant_q4_0(&wb, rows, cols);
    let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
    let x: Vec<f32> = (0..(m + PAD_ROWS) * cols)
        .map(|i| ((i / cols) * 64 + i % cols) as f32 / 4096.0)
        .collect();
    let want = reference(&deq, rows, cols, &x, m);
    let stride = rows + PAD_COLS;
    let mut bad = 0;
    for tm in [2, 4] {
        let init = vec![f32::NAN; (m + PAD_ROWS) * stride];
        let got = run_dense(&ctx, &k, GemmWeights::Q4(&w), &x, m, tm, false, &init);
        let mut first = Vec::new();
        let mut n = 0;
        for t in 0..m {
            for r in 0..rows {
                let g = got[t * stride + r];
                let wv = want.0[t * rows + r] as f32;
                if g != wv {
                    n += 1;
                    if first.len() < 8 {
                        let code = g * 4096.0;
                        first.push(format!(
                            "(t {t}, row {r}) got {g} = token {} input {} (want {wv})",
                            (code / 64.0).floor(),
                            code % 64.0
                        ));
                    }
                }
            }
        }
        eprintln!(
            "gemm_onehot_probe tm {tm}: {n} of {} wrong: {}",
            m * rows,
            first.join("; ")
        );
        bad += n;
    }
    assert_eq!(bad, 0);
}

/// The kernels the tests run: the default, and where the int4 forms run on matrix units the
/// double-buffered one too (the prefill's default; `GemmKernel::new` alone is single-buffered).
/// The kernels for weights of the block form `form`: the default, and where the device has
/// matrix units for the form also their double-buffered form and the f32 kernel.
pub(crate) fn test_kernels_for(ctx: &Context, form: QForm) -> Vec<GemmKernel> {
    test_kernels_for_forms(ctx, &[form])
}

/// [`test_kernels_for`] with kernels reading any of `forms` (a model of several).
pub(crate) fn test_kernels_for_forms(ctx: &Context, forms: &[QForm]) -> Vec<GemmKernel> {
    let mut ks = vec![GemmKernel::with_forms(ctx, true, forms).unwrap()];
    if ks[0].coop() {
        let k = GemmKernel::with_forms(ctx, true, forms).unwrap();
        ks.push(k.with_double_buffer(ctx, true).unwrap());
        ks.push(GemmKernel::with_forms(ctx, false, forms).unwrap());
    }
    ks
}

pub(crate) fn test_kernels(ctx: &Context) -> Vec<GemmKernel> {
    let mut ks = vec![GemmKernel::new(ctx).unwrap()];
    if ks[0].coop() {
        ks.push(
            GemmKernel::new(ctx)
                .unwrap()
                .with_double_buffer(ctx, true)
                .unwrap(),
        );
    }
    ks
}
