//! Lavapipe tests of the multi-column embed, argmax and router kernels against their scalar
//! references, at odd shapes and nb = 1, 2, 3, 8, each with a done column that must be left
//! untouched.

use super::argmax::*;
use super::embed::*;
use super::matvec::{matvec_f32_ref, MatvecKernel, NormInput};
use super::norm::rmsnorm_ref;
use super::router_cols::*;
use crate::columns::{self, Col, MAX_COLUMNS};
use crate::context::Context;
use crate::state::RunState;
use crate::tensor::{F32Matrix, Q4Matrix};
use crate::testing::{assert_close, dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};
use rand::Rng;

const NBS: [usize; 4] = [1, 2, 3, 8];

/// `nb` active columns with random positions, steps and slots; column `done_at` (if any) done.
fn rand_cols(r: &mut impl Rng, nb: usize, vocab: u32, done_at: Option<usize>) -> Vec<Col> {
    (0..nb)
        .map(|c| {
            let mut col = Col::active(r.random_range(0..vocab), r.random_range(0..500), c as u32);
            col.step = r.random_range(0..3);
            if done_at == Some(c) {
                col.done = 1;
            }
            col
        })
        .collect()
}

/// The done column of a test over `nb` columns: the last one when there are several.
fn done_col(nb: usize) -> Option<usize> {
    (nb > 1).then_some(nb - 1)
}

#[test]
fn embed_cols_match_reference_across_parts() {
    let Some(ctx) = gpu("embed_cols_match_reference_across_parts") else {
        return;
    };
    let mut r = rng(21);
    let k = EmbedKernel::new(&ctx).unwrap();
    // 4128 columns = 129 blocks: three workgroups per column in x.
    for (vocab, hidden, limit) in [
        (37usize, 4128usize, None),
        (301, 96, Some(7 * 3 * 16)),
        (50, 32, None),
    ] {
        let c = match limit {
            Some(l) => ctx.with_max_binding_bytes(l as u64),
            None => (*ctx).clone(),
        };
        let table = rand_q4_0(&mut r, vocab, hidden);
        let m = Q4Matrix::upload(&c, "embd", vocab, hidden, 1, &[&table]).unwrap();
        if limit.is_some() {
            assert_eq!(m.parts.len(), vocab.div_ceil(7), "split table");
        }
        let full = dequant_q4_0(&table, vocab, hidden);
        for nb in NBS {
            // nb = 1 is also run with its only column done.
            for done_at in [done_col(nb), (nb == 1).then_some(0)] {
                if nb == 1 && done_at.is_none() && limit.is_some() {
                    continue; // covered by the other shapes
                }
                let mut cols = rand_cols(&mut r, nb, vocab as u32, done_at);
                // The first and last ids, and a stray id past the table in a live column.
                cols[0].token = if done_at == Some(0) { 5 } else { 0 };
                if nb >= 3 {
                    cols[1].token = vocab as u32 - 1;
                    cols[2].token = vocab as u32 + 3;
                }
                // Activations are not split: only the table's bindings are limited.
                let cb = columns::buffer(&ctx, &cols).unwrap();
                let before = rand_f32(&mut r, nb * hidden, -9.0, 9.0);
                let h = ctx
                    .storage_init("h", bytemuck::cast_slice(&before))
                    .unwrap();
                let b = k.bind_cols(&c, &m, &h, &cb, nb as u32).unwrap();
                assert_eq!(b.dispatch_count(), m.parts.len());
                c.run_pass(|p| k.record(p, &b)).unwrap();
                let got = c.read_f32(&h, nb * hidden).unwrap();
                for (ci, col) in cols.iter().enumerate() {
                    let t = col.token as usize;
                    let what = format!("V={vocab} H={hidden} nb={nb} column {ci} token {t}");
                    let g = &got[ci * hidden..(ci + 1) * hidden];
                    let want = if col.done == 0 && t < vocab {
                        &full[t * hidden..(t + 1) * hidden]
                    } else {
                        // Done or stray: untouched.
                        &before[ci * hidden..(ci + 1) * hidden]
                    };
                    assert_close(g, want, 0.0, 0.0, &what);
                }
                // The column buffer is only read.
                assert_eq!(&columns::read(&c, &cb).unwrap()[..nb], &cols[..]);
            }
        }
    }
}

#[test]
fn embed_cols_rejects_bad_shapes() {
    let Some(ctx) = gpu("embed_cols_rejects_bad_shapes") else {
        return;
    };
    let mut r = rng(22);
    let k = EmbedKernel::new(&ctx).unwrap();
    let m = Q4Matrix::upload(&ctx, "embd", 4, 64, 1, &[&rand_q4_0(&mut r, 4, 64)]).unwrap();
    let cb = columns::buffer(&ctx, &[Col::active(1, 0, 0)]).unwrap();
    let h3 = ctx.storage("h", 3 * 64 * 4).unwrap();
    assert!(k.bind_cols(&ctx, &m, &h3, &cb, 3).is_ok());
    assert!(k.bind_cols(&ctx, &m, &h3, &cb, 4).is_err(), "h too small");
    assert!(k.bind_cols(&ctx, &m, &h3, &cb, 0).is_err(), "no columns");
    let big = ctx.storage("h", 9 * 64 * 4).unwrap();
    assert!(
        k.bind_cols(&ctx, &m, &big, &cb, 9).is_err(),
        "too many columns"
    );
    let short = ctx.storage("cols", 32).unwrap();
    assert!(
        k.bind_cols(&ctx, &m, &h3, &short, 1).is_err(),
        "column buffer"
    );
}

/// Buffers of one column argmax run.
struct ArgmaxRun {
    logits: wgpu::Buffer,
    cols: wgpu::Buffer,
    state: wgpu::Buffer,
    out: wgpu::Buffer,
    binding: ArgmaxBinding,
}

#[allow(clippy::too_many_arguments)]
fn argmax_run(
    ctx: &Context,
    k: &ArgmaxKernel,
    logits: &[f32],
    n: usize,
    cols: &[Col],
    cap: usize,
    max_steps: u32,
    eos: &[u32],
) -> ArgmaxRun {
    let nb = cols.len();
    let lb = ctx
        .storage_init("logits", bytemuck::cast_slice(logits))
        .unwrap();
    let cb = columns::buffer(ctx, cols).unwrap();
    let state = RunState::default().buffer(ctx).unwrap();
    let out = ctx
        .storage_init("out", bytemuck::cast_slice(&vec![u32::MAX; nb * cap]))
        .unwrap();
    let args = ArgmaxColsArgs {
        logits: &lb,
        n: n as u32,
        nb: nb as u32,
        cols: &cb,
        state: &state,
        out_tokens: &out,
        cap: cap as u32,
        max_steps,
        eos,
    };
    let binding = k.bind_cols(ctx, &args).unwrap();
    ArgmaxRun {
        logits: lb,
        cols: cb,
        state,
        out,
        binding,
    }
}

/// Where column `c` of `n >= 7` logits holds its tied maximum (three indices, in different
/// workgroups when `n` is large).
fn tie_at(n: usize, c: usize) -> [usize; 3] {
    [n - 1, n / 2, n / 3 + c % 3]
}

/// Random logits `[nb, n]` with, per column, a tie of the maximum in different workgroups and
/// NaNs that must not win (when `n` allows).
fn rand_logits(r: &mut impl Rng, nb: usize, n: usize) -> Vec<f32> {
    let mut x = rand_f32(r, nb * n, -30.0, 30.0);
    for c in 0..nb {
        let col = &mut x[c * n..(c + 1) * n];
        if n >= 7 && c % 2 == 1 {
            let top = 50.0 + c as f32;
            for i in tie_at(n, c) {
                col[i] = top;
            }
            col[0] = f32::NAN;
            col[n / 5] = f32::NAN;
        }
    }
    x
}

#[test]
fn argmax_cols_match_reference_with_ties_and_nan() {
    let Some(ctx) = gpu("argmax_cols_match_reference_with_ties_and_nan") else {
        return;
    };
    let mut r = rng(23);
    let k = ArgmaxKernel::new(&ctx).unwrap();
    let cap = 11;
    for n in [7usize, 2049, 5000] {
        for nb in NBS {
            let logits = rand_logits(&mut r, nb, n);
            let cols = rand_cols(&mut r, nb, n as u32, done_col(nb));
            let run = argmax_run(&ctx, &k, &logits, n, &cols, cap, 9, &[]);
            assert_eq!(run.binding.dispatch_count(), 2);
            ctx.run_pass(|p| k.record(p, &run.binding)).unwrap();
            let mut want_cols = cols.clone();
            let mut want_out = vec![u32::MAX; nb * cap];
            let all = argmax_cols_ref(&logits, n, &mut want_cols, &mut want_out, cap, 9, &[]);
            let what = format!("n={n} nb={nb}");
            let got = columns::read(&ctx, &run.cols).unwrap();
            assert_eq!(&got[..nb], &want_cols[..], "{what}: columns");
            assert!(
                got[nb..].iter().all(|c| *c == Col::idle()),
                "{what}: columns past nb untouched"
            );
            assert_eq!(
                ctx.read_u32(&run.out, nb * cap).unwrap(),
                want_out,
                "{what}: out_tokens"
            );
            assert!(!all);
            assert_eq!(RunState::read(&ctx, &run.state).unwrap().done, 0, "{what}");
            // The tie columns went to the lowest index of the maximum, not to a NaN.
            for c in (1..nb).step_by(2).filter(|c| Some(*c) != done_col(nb)) {
                if n >= 7 {
                    let lowest = *tie_at(n, c).iter().min().unwrap();
                    assert_eq!(got[c].token as usize, lowest, "{what}: tie in column {c}");
                }
            }
            // The logits are only read.
            assert_eq!(
                ctx.read_f32(&run.logits, nb * n)
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}

/// A run of several steps: columns stop on EOS and on their own last step at different times;
/// the shared state's done is set with the last column, after which nothing changes.
#[test]
fn argmax_cols_stop_per_column_then_set_the_run_done() {
    let Some(ctx) = gpu("argmax_cols_stop_per_column_then_set_the_run_done") else {
        return;
    };
    let mut r = rng(24);
    let k = ArgmaxKernel::new(&ctx).unwrap();
    let (n, cap, max_steps) = (3001usize, 6usize, 4u32);
    let eos = [77u32, 2999];
    for nb in NBS {
        let mut logits = rand_f32(&mut r, nb * n, -1.0, 1.0);
        let mut cols = rand_cols(&mut r, nb, n as u32, done_col(nb));
        for (c, col) in cols.iter_mut().enumerate() {
            col.step = (c % 3) as u32;
            // Column 0 greedily picks an EOS id; the others a plain id.
            let win = if c == 0 { 2999 } else { 100 + c };
            logits[c * n + win] = 5.0;
        }
        let run = argmax_run(&ctx, &k, &logits, n, &cols, cap, max_steps, &eos);
        let mut want_cols = cols.clone();
        let mut want_out = vec![u32::MAX; nb * cap];
        let what = format!("nb={nb}");
        let mut all = false;
        // One more step than any column needs: the last one must be a no-op.
        for step in 0..=max_steps {
            ctx.run_pass(|p| k.record(p, &run.binding)).unwrap();
            let was_all = all;
            if !all {
                all = argmax_cols_ref(
                    &logits,
                    n,
                    &mut want_cols,
                    &mut want_out,
                    cap,
                    max_steps,
                    &eos,
                );
            }
            let got = columns::read(&ctx, &run.cols).unwrap();
            assert_eq!(&got[..nb], &want_cols[..], "{what} step {step}");
            let st = RunState::read(&ctx, &run.state).unwrap();
            assert_eq!(st.done, all as u32, "{what} step {step}: run done");
            if was_all {
                assert_eq!(
                    st,
                    RunState {
                        done: 1,
                        ..Default::default()
                    }
                );
            }
        }
        assert!(all, "{what}: every column ended");
        assert_eq!(
            want_cols[0].step,
            cols[0].step + 1,
            "{what}: EOS after one step"
        );
        assert_eq!(
            ctx.read_u32(&run.out, nb * cap).unwrap(),
            want_out,
            "{what}"
        );
        // set_run: a longer run for the same binding, columns restarted.
        run.binding.set_run(&ctx, 6, &eos).unwrap();
        assert!(run.binding.set_run(&ctx, cap as u32 + 1, &eos).is_err());
        let restart: Vec<Col> = cols.iter().map(|c| Col { step: 4, ..*c }).collect();
        columns::write(&ctx, &run.cols, &restart);
        ctx.write(&run.state, 0, bytemuck::bytes_of(&RunState::default()));
        ctx.run_pass(|p| k.record(p, &run.binding)).unwrap();
        let got = columns::read(&ctx, &run.cols).unwrap();
        for (c, g) in got.iter().enumerate().take(nb).skip(1) {
            if Some(c) != done_col(nb) {
                assert_eq!(
                    (g.step, g.done),
                    (5, 0),
                    "{what}: column {c} at step 5 of 6"
                );
            }
        }
    }
}

#[test]
fn argmax_cols_rejects_bad_shapes() {
    let Some(ctx) = gpu("argmax_cols_rejects_bad_shapes") else {
        return;
    };
    let k = ArgmaxKernel::new(&ctx).unwrap();
    let logits = ctx.storage("l", 3 * 100 * 4).unwrap();
    let cb = columns::buffer(&ctx, &[Col::active(1, 0, 0)]).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    let out = ctx.storage("o", 3 * 5 * 4).unwrap();
    let base = ArgmaxColsArgs {
        logits: &logits,
        n: 100,
        nb: 3,
        cols: &cb,
        state: &state,
        out_tokens: &out,
        cap: 5,
        max_steps: 5,
        eos: &[2],
    };
    assert!(k.bind_cols(&ctx, &base).is_ok());
    let bad = [
        ArgmaxColsArgs { nb: 4, ..base },
        ArgmaxColsArgs { nb: 0, ..base },
        ArgmaxColsArgs { n: 101, ..base },
        ArgmaxColsArgs { n: 0, ..base },
        ArgmaxColsArgs { cap: 6, ..base },
        ArgmaxColsArgs {
            max_steps: 6,
            ..base
        },
        ArgmaxColsArgs { cols: &out, ..base },
    ];
    for (i, a) in bad.iter().enumerate() {
        assert!(k.bind_cols(&ctx, a).is_err(), "case {i}");
    }
}

/// Run the router over `cols`; returns (logits `[nb, rows]`, xn `[nb, cols]`) after starting
/// both from the `junk` values.
#[allow(clippy::too_many_arguments)]
fn run_router(
    ctx: &Context,
    k: &RouterColsKernel,
    m: &F32Matrix,
    h: &[f32],
    nw: &[f32],
    cols: &[Col],
    junk_y: &[f32],
    junk_xn: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let nb = cols.len();
    let hb = ctx.storage_init("h", bytemuck::cast_slice(h)).unwrap();
    let wb = ctx.storage_init("nw", bytemuck::cast_slice(nw)).unwrap();
    let xn = ctx
        .storage_init("xn", bytemuck::cast_slice(junk_xn))
        .unwrap();
    let y = ctx.storage_init("y", bytemuck::cast_slice(junk_y)).unwrap();
    let cb = columns::buffer(ctx, cols).unwrap();
    let args = RouterColsArgs {
        m,
        x: NormInput {
            h: &hb,
            weight: &wb,
            eps: 1e-6,
        },
        xn: &xn,
        logits: &y,
        cols: &cb,
        nb: nb as u32,
    };
    let b = k.bind(ctx, &args).unwrap();
    assert_eq!(b.dispatch_count(), m.parts.len());
    ctx.run_pass(|p| k.record(p, &b)).unwrap();
    (
        ctx.read_f32(&y, nb * m.rows as usize).unwrap(),
        ctx.read_f32(&xn, nb * m.cols as usize).unwrap(),
    )
}

#[test]
fn router_cols_match_reference_and_publish_the_norm() {
    let Some(ctx) = gpu("router_cols_match_reference_and_publish_the_norm") else {
        return;
    };
    let mut r = rng(25);
    let k = RouterColsKernel::new(&ctx).unwrap();
    // Narrow (8 rows x 32 lanes), the real router [128, 2048] and an odd wide shape (one row
    // per workgroup), and a narrow matrix split in 6 parts.
    for (rows, hid, limit) in [
        (13usize, 100usize, None),
        (128, 2048, None),
        (5, 2052, None),
        (41, 96, Some(96 * 4 * 7)),
    ] {
        let c = match limit {
            Some(l) => ctx.with_max_binding_bytes(l as u64),
            None => (*ctx).clone(),
        };
        let wm = rand_f32(&mut r, rows * hid, -0.5, 0.5);
        let m = F32Matrix::upload(&c, "router", rows, hid, &wm).unwrap();
        if limit.is_some() {
            assert_eq!(m.parts.len(), 6, "split router");
        }
        let nw = rand_f32(&mut r, hid, 0.5, 1.5);
        for nb in NBS {
            let cols = rand_cols(&mut r, nb, 1000, done_col(nb));
            // Columns far from unit scale, each its own (the norm must use its own column).
            let h: Vec<f32> = (0..nb)
                .flat_map(|ci| {
                    rand_f32(&mut r, hid, -8.0, 8.0)
                        .into_iter()
                        .map(move |v| v * (ci + 1) as f32)
                })
                .collect();
            let junk_y = rand_f32(&mut r, nb * rows, -3.0, 3.0);
            let junk_xn = rand_f32(&mut r, nb * hid, -3.0, 3.0);
            let (y, xn) = run_router(&ctx, &k, &m, &h, &nw, &cols, &junk_y, &junk_xn);
            for (ci, col) in cols.iter().enumerate() {
                let what = format!("[{rows}, {hid}] nb={nb} column {ci}");
                let (gy, gx) = (
                    &y[ci * rows..(ci + 1) * rows],
                    &xn[ci * hid..(ci + 1) * hid],
                );
                if col.done != 0 {
                    assert_eq!(gy, &junk_y[ci * rows..(ci + 1) * rows], "{what}: done");
                    assert_eq!(gx, &junk_xn[ci * hid..(ci + 1) * hid], "{what}: done");
                    continue;
                }
                let (_, want_xn) = rmsnorm_ref(&h[ci * hid..(ci + 1) * hid], None, &nw, 1e-6);
                assert_close(gx, &want_xn, 1e-6, 1e-5, &format!("{what}: xn"));
                let want = matvec_f32_ref(&wm, rows, hid, &want_xn);
                for (i, (g, w)) in gy.iter().zip(&want).enumerate() {
                    // f32 rounding is bounded by the row's sum |w||x|, not by a result that
                    // may cancel.
                    let mag: f32 = wm[i * hid..(i + 1) * hid]
                        .iter()
                        .zip(&want_xn)
                        .map(|(a, b)| (a * b).abs())
                        .sum();
                    assert!(
                        (g - w).abs() <= 2e-6 * mag,
                        "{what}: row {i}: got {g}, want {w}, |w||x| {mag}"
                    );
                }
            }
        }
    }
}

/// A live column of the column router gives exactly what the single-column norm-on-load
/// matvec gives for that column alone (same reduction order).
#[test]
fn router_cols_equal_the_single_column_kernel() {
    let Some(ctx) = gpu("router_cols_equal_the_single_column_kernel") else {
        return;
    };
    let mut r = rng(26);
    let k = RouterColsKernel::new(&ctx).unwrap();
    let mv = MatvecKernel::new(&ctx).unwrap();
    let state = RunState::default().buffer(&ctx).unwrap();
    for (rows, hid) in [(128usize, 2048usize), (13, 100)] {
        let wm = rand_f32(&mut r, rows * hid, -0.5, 0.5);
        let m = F32Matrix::upload(&ctx, "router", rows, hid, &wm).unwrap();
        let nw = rand_f32(&mut r, hid, 0.5, 1.5);
        let nb = 3;
        let h = rand_f32(&mut r, nb * hid, -4.0, 4.0);
        let cols = rand_cols(&mut r, nb, 1000, None);
        let (y, xn) = run_router(
            &ctx,
            &k,
            &m,
            &h,
            &nw,
            &cols,
            &vec![0.0; nb * rows],
            &vec![0.0; nb * hid],
        );
        let wb = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
        for ci in 0..nb {
            let hb = ctx
                .storage_init("h", bytemuck::cast_slice(&h[ci * hid..(ci + 1) * hid]))
                .unwrap();
            let y1 = ctx.storage("y1", rows as u64 * 4).unwrap();
            let xn1 = ctx.storage("xn1", hid as u64 * 4).unwrap();
            let x = NormInput {
                h: &hb,
                weight: &wb,
                eps: 1e-6,
            };
            let b = mv.bind_f32_norm(&ctx, &m, x, &xn1, &y1, &state).unwrap();
            ctx.run_pass(|p| mv.record(p, &b)).unwrap();
            let what = format!("[{rows}, {hid}] column {ci}");
            assert_eq!(
                &y[ci * rows..(ci + 1) * rows],
                &ctx.read_f32(&y1, rows).unwrap()[..],
                "{what}: logits"
            );
            assert_eq!(
                &xn[ci * hid..(ci + 1) * hid],
                &ctx.read_f32(&xn1, hid).unwrap()[..],
                "{what}: xn"
            );
        }
    }
}

#[test]
fn router_cols_rejects_bad_shapes() {
    let Some(ctx) = gpu("router_cols_rejects_bad_shapes") else {
        return;
    };
    let mut r = rng(27);
    let k = RouterColsKernel::new(&ctx).unwrap();
    let m = F32Matrix::upload(&ctx, "router", 8, 64, &rand_f32(&mut r, 8 * 64, -1.0, 1.0)).unwrap();
    let big = F32Matrix::upload(&ctx, "big", 1, 4100, &rand_f32(&mut r, 4100, -1.0, 1.0)).unwrap();
    let h = ctx.storage("h", 2 * 4100 * 4).unwrap();
    let h1 = ctx.storage("h1", 64 * 4).unwrap();
    let short = ctx.storage("cols", 32).unwrap();
    let w = ctx.storage("w", 4100 * 4).unwrap();
    let xn = ctx.storage("xn", 2 * 4100 * 4).unwrap();
    let y = ctx.storage("y", 2 * 8 * 4).unwrap();
    let cb = columns::buffer(&ctx, &[Col::active(0, 0, 0); 2]).unwrap();
    let x = NormInput {
        h: &h,
        weight: &w,
        eps: 1e-6,
    };
    let base = RouterColsArgs {
        m: &m,
        x,
        xn: &xn,
        logits: &y,
        cols: &cb,
        nb: 2,
    };
    assert!(k.bind(&ctx, &base).is_ok());
    let bad = [
        RouterColsArgs { nb: 3, ..base },
        RouterColsArgs { nb: 0, ..base },
        RouterColsArgs {
            nb: MAX_COLUMNS as u32 + 1,
            ..base
        },
        RouterColsArgs { m: &big, ..base },
        RouterColsArgs {
            x: NormInput { h: &h1, ..x },
            ..base
        },
        RouterColsArgs {
            x: NormInput { eps: f32::NAN, ..x },
            ..base
        },
        RouterColsArgs { xn: &h1, ..base },
        RouterColsArgs {
            cols: &short,
            ..base
        },
    ];
    for (i, a) in bad.iter().enumerate() {
        assert!(k.bind(&ctx, a).is_err(), "case {i}");
    }
    // The kernel runs without runtime bounds checks: a matrix whose public fields lie about its
    // buffers must be refused too.
    let upload = || F32Matrix::upload(&ctx, "router", 8, 64, &vec![0.5; 8 * 64]).unwrap();
    type Lie = fn(&mut F32Matrix, &Context);
    let lies: [(&str, Lie); 4] = [
        ("w too small", |m, ctx| {
            m.parts[0].w = ctx.storage("w", 64).unwrap()
        }),
        ("more rows than the buffer", |m, _| {
            m.rows = 16;
            m.parts[0].rows = 16;
        }),
        ("parts end before the rows", |m, _| m.parts[0].rows = 4),
        ("cols not a multiple of 4", |m, _| m.cols = 62),
    ];
    for (what, lie) in lies {
        let mut lying = upload();
        lie(&mut lying, &ctx);
        let e = k.bind(&ctx, &RouterColsArgs { m: &lying, ..base }).err();
        let e = e.unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(e.to_string().contains("f32 matrix"), "{what}: {e}");
    }
}
