//! Lavapipe tests of the matvec family against the scalar references in `matvec.rs`.

use super::matvec::*;
use crate::context::Context;
use crate::numerics::Numerics;
use crate::state::RunState;
use crate::tensor::{pack_i8, quantize_acts_ref, F32Matrix, Q4Matrix, QuantActs};
use crate::testing::{assert_close, dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};

/// Odd shapes on purpose: 1 row, rows not a multiple of 8, cols = 32, non-power-of-two rows;
/// rows of 1 to 32 blocks at every lane count (2, 4, 8, 16 and 32 lanes).
const SHAPES: &[(usize, usize)] = &[
    (1, 32),
    (7, 64),
    (13, 96),
    (100, 256),
    (257, 160),
    (1000, 512),
    (37, 992),
    (33, 1024),
    (11, 224),
];

#[test]
fn lanes_per_row_keeps_the_real_shapes_at_32() {
    // The real models' rows (2048 and 4096 columns: 64 and 128 blocks) keep the 32 lanes
    // measured on the H200; shorter rows a lane per block (at least 2).
    let short = [
        (1, 2),
        (2, 2),
        (3, 4),
        (7, 8),
        (8, 8),
        (9, 16),
        (17, 32),
        (31, 32),
    ];
    for (bpr, lanes) in short.into_iter().chain([(32, 32), (64, 32), (128, 32)]) {
        assert_eq!(lanes_per_row(bpr), lanes, "{bpr} blocks");
        assert!(LANES.contains(&lanes));
    }
}

/// Upload int8 activations computed by the reference quantiser (so the matvec is tested alone).
fn upload_acts(ctx: &Context, x: &[f32]) -> (QuantActs, Vec<i8>, Vec<[f32; 2]>) {
    let (q, s) = quantize_acts_ref(x);
    let a = QuantActs::new(ctx, "x", x.len()).unwrap();
    ctx.write(&a.q, 0, bytemuck::cast_slice(&pack_i8(&q)));
    ctx.write(&a.s, 0, bytemuck::cast_slice(&s));
    (a, q, s)
}

fn run_q4(ctx: &Context, w: &Q4Matrix, x: Act<'_>, rows: usize) -> Vec<f32> {
    run_q4_r(ctx, w, x, rows, f32_rows_per_team(rows as u32))
}

fn run_q4_r(ctx: &Context, w: &Q4Matrix, x: Act<'_>, rows: usize, rpt: u32) -> Vec<f32> {
    let k = MatvecKernel::new(ctx).unwrap();
    let state = RunState::default().buffer(ctx).unwrap();
    let y = ctx.storage("y", rows as u64 * 4).unwrap();
    // NaN-fill so a row the kernel forgets to write fails the comparison.
    ctx.write(&y, 0, &vec![0xFF; rows * 4]);
    let b = k.bind_q4_with(ctx, w, x, &y, &state, rpt).unwrap();
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    ctx.read_f32(&y, rows).unwrap()
}

#[test]
fn q4_int8_matches_reference() {
    let Some(ctx) = gpu("q4_int8_matches_reference") else {
        return;
    };
    let mut r = rng(1);
    for &(rows, cols) in SHAPES {
        let wb = rand_q4_0(&mut r, rows, cols);
        let x = rand_f32(&mut r, cols, -1.0, 1.0);
        let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
        let (a, q, s) = upload_acts(&ctx, &x);
        let got = run_q4(&ctx, &w, Act::Int8(&a), rows);
        // Two rows per team: each row's dots and sums are those of one row per team.
        let two = run_q4_r(&ctx, &w, Act::Int8(&a), rows, 2);
        assert_eq!(
            bits(&two),
            bits(&got),
            "q4 i8 [{rows}, {cols}] two rows per team"
        );
        let want = matvec_q4_i8_ref(&wb, rows, cols, &q, &s);
        // Same integer dot products; only the f32 accumulation order differs.
        assert_close(&got, &want, 1e-4, 1e-4, &format!("q4 i8 [{rows}, {cols}]"));
        // And the int8 path stays close to the exact product over dequantised weights.
        let exact = matvec_f32_ref(&dequant_q4_0(&wb, rows, cols), rows, cols, &x);
        assert_close(
            &got,
            &exact,
            0.02,
            0.02,
            &format!("q4 i8 vs exact [{rows}, {cols}]"),
        );
    }
}

#[test]
fn q4_f32_matches_reference() {
    let Some(ctx) = gpu("q4_f32_matches_reference") else {
        return;
    };
    let mut r = rng(2);
    for &(rows, cols) in SHAPES {
        let wb = rand_q4_0(&mut r, rows, cols);
        // Activations of mixed magnitudes (1e-3..1e3) so every nibble position and lane scale of
        // the conversion-free dequantisation is exercised far from 1.0.
        let x: Vec<f32> = rand_f32(&mut r, cols, -1.0, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi((i % 7) as i32 - 3))
            .collect();
        let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let deq = dequant_q4_0(&wb, rows, cols);
        let want = matvec_f32_ref(&deq, rows, cols, &x);
        // f32 rounding only: bound by the row's Σ|w x| (not the result, which may cancel).
        let mag = matvec_f32_ref(
            &deq.iter().map(|v| v.abs()).collect::<Vec<_>>(),
            rows,
            cols,
            &x.iter().map(|v| v.abs()).collect::<Vec<_>>(),
        );
        for rpt in F32_ROWS_PER_TEAM {
            let got = run_q4_r(&ctx, &w, Act::F32(&xb), rows, rpt);
            for i in 0..rows {
                let err = (got[i] - want[i]).abs();
                assert!(
                    err <= 1e-6 * mag[i],
                    "q4 f32 [{rows}, {cols}] r{rpt} row {i}: got {}, want {}, |w||x| {}",
                    got[i],
                    want[i],
                    mag[i]
                );
            }
        }
    }
}

#[test]
fn q4_split_across_bindings_and_source_parts() {
    let Some(ctx) = gpu("q4_split_across_bindings_and_source_parts") else {
        return;
    };
    let mut r = rng(3);
    let (rows, cols) = (300, 128);
    // 4 blocks of 16 bytes per row: at most 20 rows per binding, rounded to groups of 6 rows.
    let small = ctx.with_max_binding_bytes(20 * 4 * 16);
    let wb = rand_q4_0(&mut r, rows, cols);
    // The source arrives in several pieces (as Hugging Face per-expert tensors do).
    let (a, b) = wb.split_at(120 * 4 * 18);
    let w = Q4Matrix::upload(&small, "w", rows, cols, 6, &[a, b]).unwrap();
    assert_eq!(w.parts.len(), 17, "300 rows in parts of 18");
    assert!(w
        .parts
        .iter()
        .all(|p| p.rows % 6 == 0 && p.qs.size() <= 20 * 4 * 16));
    let x = rand_f32(&mut r, cols, -2.0, 2.0);
    let (acts, q, s) = upload_acts(&small, &x);
    let got = run_q4(&small, &w, Act::Int8(&acts), rows);
    let want = matvec_q4_i8_ref(&wb, rows, cols, &q, &s);
    assert_close(&got, &want, 1e-4, 1e-4, "split q4 i8");
}

#[test]
fn q4_upload_rejects_bad_input() {
    let Some(ctx) = gpu("q4_upload_rejects_bad_input") else {
        return;
    };
    let mut r = rng(4);
    let wb = rand_q4_0(&mut r, 4, 64);
    assert!(Q4Matrix::upload(&ctx, "w", 4, 64, 1, &[&wb[..wb.len() - 18]]).is_err());
    assert!(Q4Matrix::upload(&ctx, "w", 4, 48, 1, &[&wb]).is_err());
    assert!(Q4Matrix::upload(&ctx, "w", 4, 64, 3, &[&wb]).is_err());
    let mut nan = wb.clone();
    nan[18..20].copy_from_slice(&half::f16::NAN.to_le_bytes());
    let e = Q4Matrix::upload(&ctx, "w", 4, 64, 1, &[&nan]).unwrap_err();
    assert!(e.to_string().contains("block 1"), "{e}");
    // One row of 2 blocks needs 32 bytes: a 16-byte binding limit cannot hold it.
    assert!(Q4Matrix::upload(&ctx.with_max_binding_bytes(16), "w", 4, 64, 1, &[&wb]).is_err());
    let w = Q4Matrix::upload(&ctx, "w", 4, 64, 1, &[&wb]).unwrap();
    let k = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let a = QuantActs::new(&ctx, "x", 32).unwrap();
    let y = ctx.storage("y", 16).unwrap();
    assert!(
        k.bind_q4(&ctx, &w, Act::Int8(&a), &y, &state).is_err(),
        "32 activations for 64 columns"
    );
    let a = QuantActs::new(&ctx, "x", 64).unwrap();
    let y = ctx.storage("y", 12).unwrap();
    assert!(
        k.bind_q4(&ctx, &w, Act::Int8(&a), &y, &state).is_err(),
        "3-row output for 4 rows"
    );
}

#[test]
fn f32_matvec_matches_reference_and_splits() {
    let Some(ctx) = gpu("f32_matvec_matches_reference_and_splits") else {
        return;
    };
    let mut r = rng(5);
    let k = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    // Narrow kernel (8 rows x 32 lanes) below 2048 columns, (7, 1000): lanes ending on both
    // sides of the 2 x 32 stride; wide (a row per workgroup) from 2048: (128, 2048) the router,
    // (3, 4100) 1025 vec4 per row, an odd tail past the 2 x 256 stride.
    let shapes = [
        (1, 4),
        (5, 36),
        (128, 256),
        (77, 100),
        (128, 2048),
        (3, 4100),
        (7, 1000),
    ];
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        // The fourth case runs with 3 rows per binding.
        let c = if i == 3 {
            ctx.with_max_binding_bytes(3 * 400)
        } else {
            (*ctx).clone()
        };
        let w = rand_f32(&mut r, rows * cols, -0.5, 0.5);
        let x = rand_f32(&mut r, cols, -1.0, 1.0);
        let m = F32Matrix::upload(&c, "router", rows, cols, &w).unwrap();
        assert_eq!(m.parts.len(), if i == 3 { 26 } else { 1 });
        let xb = c.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let y = c.storage("y", rows as u64 * 4).unwrap();
        c.write(&y, 0, &vec![0xFF; rows * 4]);
        let b = k.bind_f32(&c, &m, &xb, &y, &state).unwrap();
        c.run_pass(|p| k.record(p, &b)).unwrap();
        let got = c.read_f32(&y, rows).unwrap();
        assert_close(
            &got,
            &matvec_f32_ref(&w, rows, cols, &x),
            1e-5,
            1e-5,
            &format!("f32 [{rows}, {cols}]"),
        );
    }
    assert!(
        F32Matrix::upload(&ctx, "bad", 2, 6, &[0.5; 12]).is_err(),
        "cols % 4 != 0"
    );
}

#[test]
fn quantize_matches_reference() {
    let Some(ctx) = gpu("quantize_matches_reference") else {
        return;
    };
    let mut r = rng(6);
    let k = QuantizeKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for n in [32, 96, 2048, 64 * 32 + 32 * 3] {
        let mut x = rand_f32(&mut r, n, -3.0, 3.0);
        // An all-zero block must quantise to zeros with d = 0, not NaN.
        x[..32].fill(0.0);
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let a = QuantActs::new(&ctx, "xq", n).unwrap();
        let b = k.bind(&ctx, &xb, &a, &state).unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let words = ctx.read_u32(&a.q, n / 4).unwrap();
        let got_q: Vec<i8> = words
            .iter()
            .flat_map(|w| w.to_le_bytes().map(|b| b as i8))
            .collect();
        let got_s: Vec<[f32; 2]> =
            bytemuck::pod_collect_to_vec(&ctx.read(&a.s, 0, n as u64 / 32 * 8).unwrap());
        let (want_q, want_s) = quantize_acts_ref(&x);
        // GPU division may differ by an ulp, which can move a value sitting on .5 by one step.
        let off = got_q.iter().zip(&want_q).filter(|(g, w)| g != w).count();
        assert!(
            got_q
                .iter()
                .zip(&want_q)
                .all(|(g, w)| (*g as i32 - *w as i32).abs() <= 1),
            "n={n}"
        );
        assert!(off <= n / 256 + 1, "n={n}: {off} quantised values differ");
        assert_eq!(got_s[0], [0.0, 0.0]);
        for (b, (g, w)) in got_s.iter().zip(&want_s).enumerate() {
            assert!(
                (g[0] - w[0]).abs() <= 1e-6 * w[0].abs(),
                "n={n} block {b}: d {g:?} vs {w:?}"
            );
            // d * sum uses the GPU's own ints, so recompute it from them.
            let sum: i32 = got_q[b * 32..(b + 1) * 32].iter().map(|v| *v as i32).sum();
            assert!(
                (g[1] - g[0] * sum as f32).abs() <= 1e-5 * g[0] * 32.0 * 127.0,
                "n={n} block {b}"
            );
        }
    }
}

#[test]
fn done_state_makes_matvec_a_no_op() {
    let Some(ctx) = gpu("done_state_makes_matvec_a_no_op") else {
        return;
    };
    let mut r = rng(7);
    let wb = rand_q4_0(&mut r, 16, 64);
    let w = Q4Matrix::upload(&ctx, "w", 16, 64, 1, &[&wb]).unwrap();
    let x = ctx
        .storage_init("x", bytemuck::cast_slice(&rand_f32(&mut r, 64, -1.0, 1.0)))
        .unwrap();
    let k = MatvecKernel::new(&ctx).unwrap();
    let state = RunState {
        done: 1,
        ..Default::default()
    }
    .buffer(&ctx)
    .unwrap();
    let y = ctx
        .storage_init("y", bytemuck::cast_slice(&[7.5f32; 16]))
        .unwrap();
    let b = k.bind_q4(&ctx, &w, Act::F32(&x), &y, &state).unwrap();
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    assert_eq!(ctx.read_f32(&y, 16).unwrap(), vec![7.5f32; 16]);
}

/// `|error| <= tol * Σ|w||x|` per row: f32 rounding bounded by the row's magnitude, not by a
/// result that may cancel.
pub(super) fn assert_rows(got: &[f32], want: &[f32], deq: &[f32], x: &[f32], tol: f32, what: &str) {
    let cols = x.len();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let mag: f32 = deq[i * cols..(i + 1) * cols]
            .iter()
            .zip(x)
            .map(|(a, b)| (a * b).abs())
            .sum();
        assert!(
            (g - w).abs() <= tol * mag + 1e-30,
            "{what}: row {i}: got {g}, want {w}, |w||x| {mag}"
        );
    }
}

/// The qkv form that warms another matrix into L2 (`--tune warm=1`, kernels/warm.rs) writes the
/// norm-on-load form's bits, whatever the warmed matrix (several warm workgroups, an odd size);
/// a split matrix is a clear error.
#[test]
fn f32_norm_on_load_matches_reference_and_publishes_the_norm() {
    let Some(ctx) = gpu("f32_norm_on_load_matches_reference_and_publishes_the_norm") else {
        return;
    };
    let mut r = rng(13);
    let k = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    // Narrow (8 rows x 32 lanes) and wide (a row per workgroup, the router) forms.
    for &(rows, cols) in &[(16, 64), (7, 100), (128, 2048), (3, 4096)] {
        let wm = rand_f32(&mut r, rows * cols, -0.5, 0.5);
        let m = F32Matrix::upload(&ctx, "router", rows, cols, &wm).unwrap();
        let h = rand_f32(&mut r, cols, -8.0, 8.0);
        let nw = rand_f32(&mut r, cols, 0.5, 1.5);
        let (_, xn) = crate::kernels::norm::rmsnorm_ref(&h, None, &nw, 1e-6);
        let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
        let wbuf = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
        let xn_out = ctx.storage("xn", cols as u64 * 4).unwrap();
        let y = ctx.storage("y", rows as u64 * 4).unwrap();
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        ctx.write(&xn_out, 0, &vec![0xFF; cols * 4]);
        let input = NormInput {
            h: &hb,
            weight: &wbuf,
            eps: 1e-6,
        };
        let b = k
            .bind_f32_norm(&ctx, &m, input, &xn_out, &y, &state)
            .unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        let want = matvec_f32_ref(&wm, rows, cols, &xn);
        assert_rows(
            &got,
            &want,
            &wm,
            &xn,
            2e-6,
            &format!("f32 norm [{rows}, {cols}]"),
        );
        let pub_xn = ctx.read_f32(&xn_out, cols).unwrap();
        assert_close(
            &pub_xn,
            &xn,
            1e-6,
            1e-5,
            &format!("published norm [{cols}]"),
        );
    }
}

#[test]
fn q4_f32_past_the_staging_limit_uses_the_unstaged_form() {
    let Some(ctx) = gpu("q4_f32_past_the_staging_limit_uses_the_unstaged_form") else {
        return;
    };
    let mut r = rng(14);
    let (rows, cols) = (9, 4160);
    let wb = rand_q4_0(&mut r, rows, cols);
    let x = rand_f32(&mut r, cols, -1.0, 1.0);
    let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
    let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
    let deq = dequant_q4_0(&wb, rows, cols);
    let got = run_q4(&ctx, &w, Act::F32(&xb), rows);
    let want = matvec_f32_ref(&deq, rows, cols, &x);
    assert_rows(&got, &want, &deq, &x, 2e-6, "unstaged [9, 4160]");
    // The fused residual add has no unstaged form: a clear error.
    let k = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let y = ctx.storage("y", rows as u64 * 4).unwrap();
    let e = k.bind_q4_acc(&ctx, &w, &xb, &y, &state).err().unwrap();
    assert!(e.to_string().contains("4096"), "{e}");
}

#[test]
fn q4_with_folded_router_matches_reference() {
    use crate::kernels::router_fold::RouterFoldKernel;
    let Some(ctx) = gpu("q4_with_folded_router_matches_reference") else {
        return;
    };
    let k = MatvecKernel::new(&ctx).unwrap();
    let fk = RouterFoldKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let mut r = rng(15);
    // (H = o rows, Q = o cols, E): odd expert counts, rows not a multiple of 8, Q != H.
    // Q = 1024: a row of 32 blocks at 32 lanes, the others at 8.
    for &(hd, q, e) in &[
        (32, 32, 1),
        (40, 64, 5),
        (96, 160, 16),
        (4096, 32, 2),
        (48, 1024, 3),
    ] {
        let wb = rand_q4_0(&mut r, hd, q);
        let att = rand_f32(&mut r, q, -1.0, 1.0);
        let h = rand_f32(&mut r, hd, -2.0, 2.0);
        let wr = rand_f32(&mut r, e * hd, -1.0, 1.0);
        let wn = rand_f32(&mut r, hd, 0.5, 1.5);
        let o = Q4Matrix::upload(&ctx, "o", hd, q, 1, &[&wb]).unwrap();
        let router = F32Matrix::upload(&ctx, "router", e, hd, &wr).unwrap();
        let up = |v: &[f32]| ctx.storage_init("v", bytemuck::cast_slice(v)).unwrap();
        let (att_b, h_b, wn_b) = (up(&att), up(&h), up(&wn));
        let fold = fk.fold(&ctx, &o, &router, &wn_b).unwrap();
        let a_b = ctx.storage("a", hd as u64 * 4).unwrap();
        let z_b = ctx.storage("z", e as u64 * 4).unwrap();
        // NaN-fill so an output the kernel forgets fails the comparison.
        ctx.write(&a_b, 0, &vec![0xFF; hd * 4]);
        ctx.write(&z_b, 0, &vec![0xFF; e * 4]);
        let b = k
            .bind_q4_router(&ctx, &o, &att_b, &h_b, &fold, e as u32, &a_b, &z_b, &state)
            .unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let deq = dequant_q4_0(&wb, hd, q);
        let a = ctx.read_f32(&a_b, hd).unwrap();
        let a_ref = matvec_f32_ref(&deq, hd, q, &att);
        assert_rows(&a, &a_ref, &deq, &att, 2e-6, &format!("o [{hd}, {q}]"));
        // z against the unfolded product: Wr diag(w) (h + Wo att), in f64.
        let z = ctx.read_f32(&z_b, e).unwrap();
        let z_ref: Vec<f32> = (0..e)
            .map(|ei| {
                (0..hd)
                    .map(|i| {
                        wr[ei * hd + i] as f64 * wn[i] as f64 * (h[i] as f64 + a_ref[i] as f64)
                    })
                    .sum::<f64>() as f32
            })
            .collect();
        assert_close(&z, &z_ref, 1e-3, 1e-4, &format!("z E{e} [{hd}, {q}]"));
    }
    // A fold of the wrong size is refused.
    let o = Q4Matrix::upload(&ctx, "o", 32, 32, 1, &[&rand_q4_0(&mut r, 32, 32)]).unwrap();
    let small = ctx.storage("fold", 4 * 64 * 4 - 4).unwrap();
    let v = ctx.storage("v", 32 * 4).unwrap();
    let err = k
        .bind_q4_router(&ctx, &o, &v, &v, &small, 4, &v, &v, &state)
        .err()
        .expect("short fold");
    assert!(err.to_string().contains("fold"), "{err}");
}

/// The bfp24 forms ([`crate::numerics::Numerics::Bfp24`]) against the same matvec over the
/// host's bfp24 simulation of the input, in f64: each block's integer dot is exact, so what is
/// left is one rounding per block and the f32 sum over blocks. The input has an all-zero block,
/// a block below 2^-100 (flushed to zero), blocks at and just under a power of two, and mixed
/// magnitudes.
#[test]
fn q4_bfp24_forms_match_the_bfp_simulation() {
    use crate::kernels::router_fold::RouterFoldKernel;
    use crate::numerics::{effective_acts, BfpActs};
    let Some(ctx) = gpu("q4_bfp24_forms_match_the_bfp_simulation") else {
        return;
    };
    let k = MatvecKernel::with_numerics(&ctx, Numerics::Bfp24).unwrap();
    let quant = crate::kernels::matvec::BfpQuantKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let mut r = rng(21);
    let input = |r: &mut _, cols: usize| -> Vec<f32> {
        let mut x: Vec<f32> = rand_f32(r, cols, -1.0, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi((i % 7) as i32 - 3))
            .collect();
        let edge: [fn(usize) -> f32; 4] = [
            |_| 0.0,
            |j| 1e-35 * (j as f32 - 16.0),
            |j| if j % 2 == 0 { 4.0 } else { -4.0 },
            |j| 7.99999 - j as f32 * 0.5,
        ];
        for (b, f) in edge.iter().enumerate() {
            if (b + 1) * 32 <= cols {
                for j in 0..32 {
                    x[b * 32 + j] = f(j);
                }
            }
        }
        x
    };
    let check = |got: &[f32], deq: &[f32], x: &[f32], add: Option<&[f32]>, what: &str| {
        let cols = x.len();
        let xh = effective_acts(Numerics::Bfp24, x);
        for (i, g) in got.iter().enumerate() {
            let row = &deq[i * cols..(i + 1) * cols];
            let want: f64 = row.iter().zip(&xh).map(|(a, b)| *a as f64 * b).sum::<f64>()
                + add.map_or(0.0, |a| a[i] as f64);
            let mag: f64 = row
                .iter()
                .zip(&xh)
                .map(|(a, b)| (*a as f64 * b).abs())
                .sum::<f64>()
                + add.map_or(0.0, |a| a[i].abs() as f64);
            assert!(
                (*g as f64 - want).abs() <= 2e-6 * mag + 1e-30,
                "{what}: row {i}: got {g}, want {want}, |w||x| {mag}"
            );
        }
    };
    for &(rows, cols) in SHAPES.iter().chain(&[(64, 4096), (300, 2048)]) {
        let wb = rand_q4_0(&mut r, rows, cols);
        let deq = dequant_q4_0(&wb, rows, cols);
        let w = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
        let x = input(&mut r, cols);
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let y = ctx.storage("y", rows as u64 * 4).unwrap();
        for rpt in F32_ROWS_PER_TEAM {
            ctx.write(&y, 0, &vec![0xFF; rows * 4]);
            let b = k
                .bind_q4_with(&ctx, &w, Act::F32(&xb), &y, &state, rpt)
                .unwrap();
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            let got = ctx.read_f32(&y, rows).unwrap();
            check(
                &got,
                &deq,
                &x,
                None,
                &format!("plain [{rows}, {cols}] r{rpt}"),
            );
        }
        // y += m · x.
        let y0 = rand_f32(&mut r, rows, -5.0, 5.0);
        ctx.write(&y, 0, bytemuck::cast_slice(&y0));
        let b = k.bind_q4_acc(&ctx, &w, &xb, &y, &state).unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        check(&got, &deq, &x, Some(&y0), &format!("acc [{rows}, {cols}]"));
        // y = m · rmsnorm(h): the simulation quantises the host's norm, which may differ from
        // the GPU's in the last bit of a value (one mantissa step, within the bound).
        let h = rand_f32(&mut r, cols, -30.0, 30.0);
        let nw = rand_f32(&mut r, cols, 0.5, 1.5);
        let (_, xn) = crate::kernels::norm::rmsnorm_ref(&h, None, &nw, 1e-6);
        let up = |v: &[f32]| ctx.storage_init("v", bytemuck::cast_slice(v)).unwrap();
        let (hb, wbuf) = (up(&h), up(&nw));
        let norm = NormInput {
            h: &hb,
            weight: &wbuf,
            eps: 1e-6,
        };
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        let b = k.bind_q4_norm(&ctx, &w, norm, &y, &state).unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        check(&got, &deq, &xn, None, &format!("norm [{rows}, {cols}]"));
        // The same blocks converted once into global memory (`--tune head=3`), then read by
        // the block-per-lane matvec with no staging.
        let xq = BfpActs::new(&ctx, "xq", cols as u32).unwrap();
        let qb = quant.bind(&ctx, norm, &xq, &state).unwrap();
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        let b = k.bind_q4(&ctx, &w, Act::Bfp(&xq), &y, &state).unwrap();
        ctx.run_pass(|p| {
            quant.record(p, &qb);
            k.record(p, &b);
        })
        .unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        check(&got, &deq, &xn, None, &format!("global [{rows}, {cols}]"));
        // `--tune head=4`: two rows per team, the same bits.
        ctx.write(&y, 0, &vec![0xFF; rows * 4]);
        let b = k
            .bind_q4_with(&ctx, &w, Act::Bfp(&xq), &y, &state, 2)
            .unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let two = ctx.read_f32(&y, rows).unwrap();
        assert_eq!(
            bits(&two),
            bits(&got),
            "global [{rows}, {cols}] two rows per team"
        );
    }
    // The o-proj form with the folded router's workgroups: the matrix rows in bfp24.
    let fk = RouterFoldKernel::new(&ctx).unwrap();
    let (hd, q, e) = (96, 160, 5);
    let wb = rand_q4_0(&mut r, hd, q);
    let o = Q4Matrix::upload(&ctx, "o", hd, q, 1, &[&wb]).unwrap();
    let router =
        F32Matrix::upload(&ctx, "router", e, hd, &rand_f32(&mut r, e * hd, -1.0, 1.0)).unwrap();
    let att = input(&mut r, q);
    let up = |v: &[f32]| ctx.storage_init("v", bytemuck::cast_slice(v)).unwrap();
    let (att_b, h_b, wn_b) = (
        up(&att),
        up(&rand_f32(&mut r, hd, -2.0, 2.0)),
        up(&rand_f32(&mut r, hd, 0.5, 1.5)),
    );
    let fold = fk.fold(&ctx, &o, &router, &wn_b).unwrap();
    let a_b = ctx.storage("a", hd as u64 * 4).unwrap();
    let z_b = ctx.storage("z", e as u64 * 4).unwrap();
    ctx.write(&a_b, 0, &vec![0xFF; hd * 4]);
    let b = k
        .bind_q4_router(&ctx, &o, &att_b, &h_b, &fold, e as u32, &a_b, &z_b, &state)
        .unwrap();
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    let got = ctx.read_f32(&a_b, hd).unwrap();
    check(&got, &dequant_q4_0(&wb, hd, q), &att, None, "router form");
}

/// The f32 bit patterns of `v` (NaN-safe equality of two outputs).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
