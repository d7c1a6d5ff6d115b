//! Lavapipe tests of the multi-column int4 x f32 matmul: every form against an f64 reference over
//! the dequantised weights, column by column against the single-vector matvec, split matrices,
//! the done flag and shape errors.

use super::matmul::*;
use super::matvec::{MatvecKernel, NormInput};
use crate::context::Context;
use crate::numerics::Act;
use crate::state::RunState;
use crate::tensor::Q4Matrix;
use crate::testing::{dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};
use rand::Rng;

/// Odd shapes on purpose: 1 row, rows not a multiple of 8, cols = 32, the 4096-column norm
/// limit (8 staged chunks at 8 columns), a last chunk cut short (96 columns), many rows of few
/// blocks, and a tall matrix (the tall tile the lm_head gets, rows not a multiple of its 128).
const SHAPES: &[(usize, usize)] = &[
    (1, 32),
    (7, 64),
    (13, 96),
    (300, 2048),
    (9000, 64),
    (5, 4096),
    (32800, 96),
];

/// Elements of padding between Y's columns, so a write past a column's rows shows up.
const PAD: usize = 3;

/// `n` values in (-1, 1) scaled by 10^-3..10^3 (cycling), so every nibble lane of the
/// conversion-free dequantisation is exercised far from 1.0.
fn mixed(r: &mut impl Rng, n: usize) -> Vec<f32> {
    rand_f32(r, n, -1.0, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 10f32.powi((i % 7) as i32 - 3))
        .collect()
}

/// A NaN-filled `Y [nb, rows + PAD]` (NaN fails every comparison, so an unwritten row shows).
fn nan_y(ctx: &Context, nb: usize, rows: usize) -> wgpu::Buffer {
    let y = ctx.storage("y", (nb * (rows + PAD)) as u64 * 4).unwrap();
    ctx.write(&y, 0, &vec![0xFF; nb * (rows + PAD) * 4]);
    y
}

/// Run one matmul and return `Y [nb, rows + PAD]`.
fn run(ctx: &Context, k: &MatmulKernel, a: &MatmulArgs<'_>, tile: Option<Tile>) -> Vec<f32> {
    let b = match tile {
        Some(t) => k.bind_tiled(ctx, a, t),
        None => k.bind(ctx, a),
    }
    .unwrap();
    assert_eq!(b.dispatch_count(), a.m.parts.len());
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    ctx.read_f32(a.y, a.nb as usize * a.y_stride as usize)
        .unwrap()
}

/// `Σ_j |w[row, j]| |x[j]|` per row: the scale of the f32 rounding error of a row's dot product
/// (not the result, which may cancel).
fn magnitudes(deq: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    (0..rows)
        .map(|i| {
            deq[i * cols..(i + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| (a * b).abs())
                .sum()
        })
        .collect()
}

/// Column `b` of `got` (`[nb, rows + PAD]`) against `want[b]` within `tol * Σ|w||x|` plus
/// `rel * |want|`, and the padding after each column untouched (still NaN).
fn assert_cols(
    got: &[f32],
    want: &[Vec<f32>],
    mags: &[Vec<f32>],
    rows: usize,
    tol: f32,
    rel: f32,
    what: &str,
) {
    for (b, (w, mag)) in want.iter().zip(mags).enumerate() {
        let col = &got[b * (rows + PAD)..b * (rows + PAD) + rows];
        for i in 0..rows {
            let err = (col[i] - w[i]).abs();
            assert!(
                err <= tol * mag[i] + rel * w[i].abs(),
                "{what}: column {b} row {i}: got {}, want {}, |w||x| {}",
                col[i],
                w[i],
                mag[i]
            );
        }
        let pad = &got[b * (rows + PAD) + rows..(b + 1) * (rows + PAD)];
        assert!(
            pad.iter().all(|v| v.is_nan()),
            "{what}: column {b} wrote past its rows"
        );
    }
}

/// The matmul against the matvec of one column: `|a - b| <= 1e-6 Σ|w||x|` per row. Both run
/// the same f32 operations in the same order, but the driver may contract them into fma
/// differently per shader, so equal bits cannot be asked for; relative to the row's magnitude
/// (the scale of f32 rounding, not a result that may cancel) they agree to ~1e-7.
fn assert_matches_matvec(mm: &[f32], mv: &[f32], mag: &[f32], what: &str) {
    for (i, ((a, b), m)) in mm.iter().zip(mv).zip(mag).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * m,
            "{what}: row {i}: matmul {a}, matvec {b}, |w||x| {m}"
        );
    }
}

/// One random weight matrix with its dequantised copy.
struct Weights {
    rows: usize,
    cols: usize,
    deq: Vec<f32>,
    m: Q4Matrix,
}

fn weights(ctx: &Context, r: &mut impl Rng, rows: usize, cols: usize) -> Weights {
    let wb = rand_q4_0(r, rows, cols);
    Weights {
        rows,
        cols,
        deq: dequant_q4_0(&wb, rows, cols),
        m: Q4Matrix::upload(ctx, "w", rows, cols, 1, &[&wb]).unwrap(),
    }
}

/// Plain matmul of the first `nb` of 8 columns for every `nb`: against the f64 reference and,
/// column by column, against the matvec. `tiles`: run every compiled tile, not only the chosen.
fn check_plain(
    ctx: &Context,
    k: &MatmulKernel,
    mv: &MatvecKernel,
    w: &Weights,
    seed: u64,
    tiles: bool,
) {
    let mut r = rng(seed);
    let (rows, cols) = (w.rows, w.cols);
    let state = RunState::default().buffer(ctx).unwrap();
    let x = mixed(&mut r, 8 * cols);
    let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
    let xcols: Vec<&[f32]> = x.chunks_exact(cols).collect();
    let want: Vec<Vec<f32>> = xcols
        .iter()
        .map(|xc| super::matvec::matvec_f32_ref(&w.deq, rows, cols, xc))
        .collect();
    let mags: Vec<Vec<f32>> = xcols
        .iter()
        .map(|xc| magnitudes(&w.deq, rows, cols, xc))
        .collect();
    // The single-vector matvec of each column.
    let mvs: Vec<Vec<f32>> = xcols
        .iter()
        .map(|xc| {
            let xcb = ctx.storage_init("xc", bytemuck::cast_slice(xc)).unwrap();
            let y = ctx.storage("yc", rows as u64 * 4).unwrap();
            let b = mv.bind_q4(ctx, &w.m, Act::F32(&xcb), &y, &state).unwrap();
            ctx.run_pass(|p| mv.record(p, &b)).unwrap();
            ctx.read_f32(&y, rows).unwrap()
        })
        .collect();
    for nb in 1..=8u32 {
        let y = nan_y(ctx, nb as usize, rows);
        let a = MatmulArgs {
            m: &w.m,
            input: MatmulInput::Plain(&xb),
            nb,
            y: &y,
            y_stride: (rows + PAD) as u32,
            state: &state,
        };
        let chosen = [None];
        let all: Vec<Option<Tile>> = Tile::all().filter(|t| t.cols >= nb).map(Some).collect();
        for tile in if tiles { &all[..] } else { &chosen[..] } {
            ctx.write(&y, 0, &vec![0xFF; nb as usize * (rows + PAD) * 4]);
            let got = run(ctx, k, &a, *tile);
            let what = format!("plain [{rows}, {cols}] nb {nb} {tile:?}");
            let n = nb as usize;
            assert_cols(&got, &want[..n], &mags[..n], rows, 1e-6, 0.0, &what);
            for (b, mvc) in mvs[..n].iter().enumerate() {
                let col = &got[b * (rows + PAD)..b * (rows + PAD) + rows];
                let what = format!("{what} column {b} vs matvec");
                assert_matches_matvec(col, mvc, &mags[b], &what);
            }
        }
    }
}

#[test]
fn matmul_plain_matches_reference_and_matvec() {
    let Some(ctx) = gpu("matmul_plain_matches_reference_and_matvec") else {
        return;
    };
    let k = MatmulKernel::new(&ctx).unwrap();
    let mv = MatvecKernel::new(&ctx).unwrap();
    let mut r = rng(21);
    for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
        let w = weights(&ctx, &mut r, rows, cols);
        // Every compiled tile on the small shapes (lavapipe time), the chosen one on all.
        check_plain(
            &ctx,
            &k,
            &mv,
            &w,
            100 + i as u64,
            rows != 300 && rows < 32768,
        );
    }
}

#[test]
fn matmul_acc_matches_reference_and_matvec() {
    let Some(ctx) = gpu("matmul_acc_matches_reference_and_matvec") else {
        return;
    };
    let k = MatmulKernel::new(&ctx).unwrap();
    let mv = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let mut r = rng(22);
    for &(rows, cols) in SHAPES {
        let w = weights(&ctx, &mut r, rows, cols);
        let x = mixed(&mut r, 8 * cols);
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        // The residual stream Y starts random, the padding NaN.
        let y0: Vec<f32> = (0..8)
            .flat_map(|_| {
                let mut c = rand_f32(&mut r, rows, -5.0, 5.0);
                c.extend([f32::NAN; PAD]);
                c
            })
            .collect();
        let xcols: Vec<&[f32]> = x.chunks_exact(cols).collect();
        let mut want = Vec::new();
        let mut mags = Vec::new();
        let mut mvs = Vec::new();
        for (b, xc) in xcols.iter().enumerate() {
            let y0c = &y0[b * (rows + PAD)..b * (rows + PAD) + rows];
            let prod = super::matvec::matvec_f32_ref(&w.deq, rows, cols, xc);
            want.push(prod.iter().zip(y0c).map(|(p, y)| p + y).collect::<Vec<_>>());
            mags.push(magnitudes(&w.deq, rows, cols, xc));
            let xcb = ctx.storage_init("xc", bytemuck::cast_slice(xc)).unwrap();
            let yc = ctx.storage_init("yc", bytemuck::cast_slice(y0c)).unwrap();
            let bd = mv.bind_q4_acc(&ctx, &w.m, &xcb, &yc, &state).unwrap();
            ctx.run_pass(|p| mv.record(p, &bd)).unwrap();
            mvs.push(ctx.read_f32(&yc, rows).unwrap());
        }
        for nb in 1..=8u32 {
            let n = nb as usize;
            let y = ctx
                .storage_init("y", bytemuck::cast_slice(&y0[..n * (rows + PAD)]))
                .unwrap();
            let a = MatmulArgs {
                m: &w.m,
                input: MatmulInput::Acc(&xb),
                nb,
                y: &y,
                y_stride: (rows + PAD) as u32,
                state: &state,
            };
            let got = run(&ctx, &k, &a, None);
            let what = format!("acc [{rows}, {cols}] nb {nb}");
            // The product's rounding plus one rounding of the sum.
            assert_cols(&got, &want[..n], &mags[..n], rows, 1e-6, 1e-6, &what);
            for (b, mvc) in mvs[..n].iter().enumerate() {
                let col = &got[b * (rows + PAD)..b * (rows + PAD) + rows];
                let what = format!("{what} column {b} vs matvec");
                assert_matches_matvec(col, mvc, &mags[b], &what);
            }
        }
    }
}

#[test]
fn matmul_norm_on_load_matches_reference_and_matvec() {
    let Some(ctx) = gpu("matmul_norm_on_load_matches_reference_and_matvec") else {
        return;
    };
    let k = MatmulKernel::new(&ctx).unwrap();
    let mv = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let mut r = rng(23);
    let eps = 1e-6;
    for &(rows, cols) in SHAPES {
        let w = weights(&ctx, &mut r, rows, cols);
        // Residual streams far from unit scale, each column at its own scale (1e-2..1e2), so a
        // column normalised by another's rms shows.
        let h: Vec<f32> = (0..8)
            .flat_map(|b| {
                let s = 10f32.powi(b % 5 - 2);
                rand_f32(&mut r, cols, -30.0, 30.0)
                    .into_iter()
                    .map(move |v| v * s)
            })
            .collect();
        let nw = rand_f32(&mut r, cols, 0.5, 1.5);
        let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
        let nwb = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
        let mut want = Vec::new();
        let mut mags = Vec::new();
        let mut mvs = Vec::new();
        for hc in h.chunks_exact(cols) {
            let (_, xn) = crate::kernels::norm::rmsnorm_ref(hc, None, &nw, eps);
            want.push(super::matvec::matvec_f32_ref(&w.deq, rows, cols, &xn));
            mags.push(magnitudes(&w.deq, rows, cols, &xn));
            let hcb = ctx.storage_init("hc", bytemuck::cast_slice(hc)).unwrap();
            let yc = ctx.storage("yc", rows as u64 * 4).unwrap();
            let input = NormInput {
                h: &hcb,
                weight: &nwb,
                eps,
            };
            let bd = mv.bind_q4_norm(&ctx, &w.m, input, &yc, &state).unwrap();
            ctx.run_pass(|p| mv.record(p, &bd)).unwrap();
            mvs.push(ctx.read_f32(&yc, rows).unwrap());
        }
        for nb in 1..=8u32 {
            let n = nb as usize;
            let y = nan_y(&ctx, n, rows);
            let a = MatmulArgs {
                m: &w.m,
                input: MatmulInput::Norm(NormInput {
                    h: &hb,
                    weight: &nwb,
                    eps,
                }),
                nb,
                y: &y,
                y_stride: (rows + PAD) as u32,
                state: &state,
            };
            let got = run(&ctx, &k, &a, None);
            let what = format!("norm [{rows}, {cols}] nb {nb}");
            // The normalised input carries its own f32 rounding (as in the matvec test).
            assert_cols(&got, &want[..n], &mags[..n], rows, 2e-6, 0.0, &what);
            for (b, mvc) in mvs[..n].iter().enumerate() {
                let col = &got[b * (rows + PAD)..b * (rows + PAD) + rows];
                let what = format!("{what} column {b} vs matvec");
                assert_matches_matvec(col, mvc, &mags[b], &what);
            }
        }
    }
}

#[test]
fn matmul_split_across_bindings() {
    let Some(ctx) = gpu("matmul_split_across_bindings") else {
        return;
    };
    let mut r = rng(24);
    let (rows, cols) = (300, 128);
    // 4 blocks of 16 bytes per row: 20 rows per binding, 15 parts.
    let small = ctx.with_max_binding_bytes(20 * 4 * 16);
    // Only the matrix is split; X, H and Y (bigger than the lowered limit) live on `ctx`, the
    // same device.
    let k = MatmulKernel::new(&small).unwrap();
    let state = RunState::default().buffer(&small).unwrap();
    let wb = rand_q4_0(&mut r, rows, cols);
    let deq = dequant_q4_0(&wb, rows, cols);
    let whole = Q4Matrix::upload(&ctx, "w", rows, cols, 1, &[&wb]).unwrap();
    let split = Q4Matrix::upload(&small, "w", rows, cols, 1, &[&wb]).unwrap();
    assert_eq!(split.parts.len(), 15);
    let nb = 5u32;
    let x = mixed(&mut r, nb as usize * cols);
    let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
    let h = rand_f32(&mut r, nb as usize * cols, -4.0, 4.0);
    let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
    let nw = rand_f32(&mut r, cols, 0.5, 1.5);
    let nwb = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
    let norm = NormInput {
        h: &hb,
        weight: &nwb,
        eps: 1e-5,
    };
    for input in [
        MatmulInput::Plain(&xb),
        MatmulInput::Acc(&xb),
        MatmulInput::Norm(norm),
    ] {
        let mut outs = Vec::new();
        for (c, m) in [(&small, &split), (&*ctx, &whole)] {
            // Acc adds into zeros here, so all three forms have the plain product as reference.
            let y = ctx
                .storage("y", (nb as usize * (rows + PAD)) as u64 * 4)
                .unwrap();
            let a = MatmulArgs {
                m,
                input,
                nb,
                y: &y,
                y_stride: (rows + PAD) as u32,
                state: &state,
            };
            let b = k.bind(c, &a).unwrap();
            assert_eq!(b.dispatch_count(), m.parts.len());
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            outs.push(ctx.read_f32(&y, nb as usize * (rows + PAD)).unwrap());
        }
        let xs: Vec<f32> = match input {
            MatmulInput::Norm(n) => h
                .chunks_exact(cols)
                .flat_map(|hc| crate::kernels::norm::rmsnorm_ref(hc, None, &nw, n.eps).1)
                .collect(),
            _ => x.clone(),
        };
        let want = matmul_f32_ref(&deq, rows, cols, &xs);
        for b in 0..nb as usize {
            let mag = magnitudes(&deq, rows, cols, &xs[b * cols..(b + 1) * cols]);
            for i in 0..rows {
                let (s, w) = (outs[0][b * (rows + PAD) + i], outs[1][b * (rows + PAD) + i]);
                let want = want[b * rows + i];
                assert!(
                    (s - want).abs() <= 2e-6 * mag[i],
                    "split column {b} row {i}: got {s}, want {want}"
                );
                assert_eq!(s, w, "split vs whole column {b} row {i}");
            }
        }
    }
}

#[test]
fn matmul_done_state_is_a_no_op() {
    let Some(ctx) = gpu("matmul_done_state_is_a_no_op") else {
        return;
    };
    let mut r = rng(25);
    let k = MatmulKernel::new(&ctx).unwrap();
    let w = weights(&ctx, &mut r, 16, 64);
    let state = RunState {
        done: 1,
        ..Default::default()
    }
    .buffer(&ctx)
    .unwrap();
    let x = ctx
        .storage_init(
            "x",
            bytemuck::cast_slice(&rand_f32(&mut r, 4 * 64, -1.0, 1.0)),
        )
        .unwrap();
    let nw = ctx
        .storage_init("nw", bytemuck::cast_slice(&rand_f32(&mut r, 64, 0.5, 1.5)))
        .unwrap();
    let norm = NormInput {
        h: &x,
        weight: &nw,
        eps: 1e-6,
    };
    for input in [
        MatmulInput::Plain(&x),
        MatmulInput::Acc(&x),
        MatmulInput::Norm(norm),
    ] {
        let y = ctx
            .storage_init("y", bytemuck::cast_slice(&[7.5f32; 64]))
            .unwrap();
        let a = MatmulArgs {
            m: &w.m,
            input,
            nb: 4,
            y: &y,
            y_stride: 16,
            state: &state,
        };
        let got = run(&ctx, &k, &a, None);
        assert_eq!(got, vec![7.5f32; 64]);
    }
}

#[test]
fn matmul_rejects_bad_shapes() {
    let Some(ctx) = gpu("matmul_rejects_bad_shapes") else {
        return;
    };
    let mut r = rng(26);
    let k = MatmulKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let w = weights(&ctx, &mut r, 10, 64);
    let x = ctx.storage("x", 4 * 64 * 4).unwrap();
    let nw = ctx.storage("nw", 64 * 4).unwrap();
    let y = ctx.storage("y", 4 * 10 * 4).unwrap();
    let ok = MatmulArgs {
        m: &w.m,
        input: MatmulInput::Plain(&x),
        nb: 4,
        y: &y,
        y_stride: 10,
        state: &state,
    };
    assert!(k.bind(&ctx, &ok).is_ok(), "the base case binds");
    let err = |a: MatmulArgs<'_>| k.bind(&ctx, &a).err().expect("must fail").to_string();
    assert!(err(MatmulArgs { nb: 0, ..ok }).contains("0 columns"));
    assert!(err(MatmulArgs { nb: 9, ..ok }).contains("9 columns"));
    // Y of 4 columns for 5; X of 4 columns for 5 (Y made big enough).
    assert!(err(MatmulArgs { nb: 5, ..ok }).contains("Y"));
    let y5 = ctx.storage("y5", 5 * 10 * 4).unwrap();
    let e = err(MatmulArgs {
        nb: 5,
        y: &y5,
        ..ok
    });
    assert!(e.contains("X"), "{e}");
    // Overlapping columns; a stride that overflows Y.
    assert!(err(MatmulArgs { y_stride: 9, ..ok }).contains("stride"));
    assert!(err(MatmulArgs { y_stride: 11, ..ok }).contains("Y"));
    assert!(err(MatmulArgs {
        input: MatmulInput::Acc(&nw),
        ..ok
    })
    .contains("X"));
    let norm = |h, weight, eps| MatmulInput::Norm(NormInput { h, weight, eps });
    assert!(k
        .bind(
            &ctx,
            &MatmulArgs {
                input: norm(&x, &nw, 1e-6),
                ..ok
            }
        )
        .is_ok());
    assert!(err(MatmulArgs {
        input: norm(&nw, &nw, 1e-6),
        ..ok
    })
    .contains("H"));
    let e = err(MatmulArgs {
        input: norm(&x, &y, 1e-6),
        ..ok
    });
    assert!(e.contains("norm weight"), "{e}");
    assert!(err(MatmulArgs {
        input: norm(&x, &nw, f32::NAN),
        ..ok
    })
    .contains("eps"));
    // Past the norm-on-load limit.
    let wide = weights(&ctx, &mut r, 1, 4128);
    let hw = ctx.storage("hw", 4128 * 4).unwrap();
    let e = err(MatmulArgs {
        m: &wide.m,
        input: norm(&hw, &hw, 1e-6),
        nb: 1,
        y_stride: 1,
        ..ok
    });
    assert!(e.contains("4096"), "{e}");
    // Tiles: too few columns for nb, and ones that are not compiled (R * C > 16, C * L > 128,
    // 3 lanes).
    let t = |cols, rows_per_team, lanes| Tile {
        cols,
        rows_per_team,
        lanes,
    };
    assert!(k.bind_tiled(&ctx, &ok, t(2, 1, 8)).is_err());
    assert!(k.bind_tiled(&ctx, &ok, t(8, 4, 8)).is_err());
    assert!(k.bind_tiled(&ctx, &ok, t(8, 1, 32)).is_err());
    assert!(k.bind_tiled(&ctx, &ok, t(4, 1, 3)).is_err());
    assert!(k.bind_tiled(&ctx, &ok, t(4, 2, 32)).is_ok());
    assert!(Tile::for_shape(100, 2048, 0).is_err());
}

#[test]
fn tile_choice() {
    // The fewest compiled columns holding nb; tall matrices 4 lanes x 2 rows per team (128 rows
    // per workgroup); rows of <= 64 blocks 8 lanes x 2 rows (64 rows per workgroup); others one
    // row per team on as many lanes as a chunk feeds.
    for (nb, cols, lanes) in [
        (1, 2, 32),
        (2, 2, 32),
        (3, 4, 32),
        (4, 4, 32),
        (5, 8, 16),
        (8, 8, 16),
    ] {
        for rows in [1, 2048, 5120, 32767] {
            let want = Tile {
                cols,
                rows_per_team: 1,
                lanes,
            };
            for inputs in [2080, 4096, 6144] {
                assert_eq!(
                    Tile::for_shape(rows, inputs, nb).unwrap(),
                    want,
                    "nb {nb} rows {rows} inputs {inputs}"
                );
            }
            assert_eq!(want.rows_per_workgroup(), 256 / lanes);
            let short = Tile {
                cols,
                rows_per_team: 2,
                lanes: 8,
            };
            for inputs in [32, 64, 2048] {
                assert_eq!(
                    Tile::for_shape(rows, inputs, nb).unwrap(),
                    short,
                    "nb {nb} rows {rows} inputs {inputs}"
                );
            }
            assert_eq!(short.rows_per_workgroup(), 64);
        }
        for rows in [32768, 151936] {
            let want = Tile {
                cols,
                rows_per_team: 2,
                lanes: 4,
            };
            for inputs in [64, 2048, 4096] {
                assert_eq!(
                    Tile::for_shape(rows, inputs, nb).unwrap(),
                    want,
                    "nb {nb} rows {rows}"
                );
            }
            assert_eq!(want.rows_per_workgroup(), 128);
        }
    }
    assert!(Tile::for_shape(100, 2048, 9).is_err());
    assert_eq!(Tile::all().count(), 30);
    assert!(Tile::all().all(|t| t.cols * t.rows_per_team <= 16 && t.cols * t.lanes <= 128));
    // Every chosen tile is compiled.
    for nb in 1..=8 {
        for (rows, inputs) in [(1, 64), (1, 4096), (151936, 2048)] {
            let t = Tile::for_shape(rows, inputs, nb).unwrap();
            assert!(Tile::all().any(|x| x == t), "{t:?}");
        }
    }
    // Every tile fits the 28 KiB budget (lavapipe offers 32): 16 KiB of staged activations,
    // 10 KiB of partials (8 KiB, lines padded by one word at 4 lanes) and the norm's sums at 8
    // columns.
    assert_eq!(Tile::all().map(|t| t.shared_bytes()).max(), Some(27200));
}
