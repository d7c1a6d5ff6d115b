//! Lavapipe tests of matrices stacked from parts of several block forms (`Q4Matrix::stack`,
//! as a `Q4_K_M` file's qkv: q and k Q4_K, v Q6_K): the stack's bookkeeping, and the dense
//! kernels that pick a pipeline per part (the matvec's int4 x f32 forms, the matmul) against
//! the reference on random inputs. The GEMM's stacked case is in gemm_tests.rs, the MoE's
//! pair of forms in moe_f32_tests.rs and moe_prefill_tests.rs.

use super::matmul::{MatmulArgs, MatmulInput, MatmulKernel, Tile};
use super::matvec::{matvec_f32_ref, Act, MatvecKernel, NormInput, F32_ROWS_PER_TEAM};
use super::q8_tests::{assert_within, mag_of};
use crate::numerics::Numerics;
use crate::state::RunState;
use crate::tensor::{Q4Matrix, QForm};
use crate::testing::{dequant, gpu, rand_f32, rand_form, rng};

/// A stack of `pieces` (`(form, rows)`), its reference values and, for `x`, the per-row
/// rounding scale of each piece ([`mag_of`]).
struct Stack {
    m: Q4Matrix,
    deq: Vec<f32>,
    bytes: Vec<(nibble_quant::DType, Vec<u8>, usize)>,
    cols: usize,
}

impl Stack {
    fn new(
        ctx: &crate::context::Context,
        seed: u64,
        pieces: &[(QForm, usize)],
        cols: usize,
    ) -> Self {
        let mut r = rng(seed);
        let (mut mats, mut deq, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        for &(form, rows) in pieces {
            let (b, dt) = rand_form(&mut r, form, rows, cols);
            mats.push(Q4Matrix::upload_dtype(ctx, "piece", dt, rows, cols, 1, &[&b]).unwrap());
            deq.extend(dequant(dt, &b, rows, cols));
            bytes.push((dt, b, rows));
        }
        let m = Q4Matrix::stack("stack", mats).unwrap();
        Stack {
            m,
            deq,
            bytes,
            cols,
        }
    }

    fn rows(&self) -> usize {
        self.m.rows as usize
    }

    fn mag(&self, x: &[f32]) -> Vec<f32> {
        self.bytes
            .iter()
            .flat_map(|(dt, b, rows)| mag_of(*dt, b, *rows, self.cols, x))
            .collect()
    }
}

/// A random residual stream `h [cols]` and RMSNorm weight on the GPU, and `rmsnorm(h)` (eps
/// 1e-6) on the host: the norm-on-load matvec's input and its reference.
fn norm_input(
    ctx: &crate::context::Context,
    r: &mut impl rand::Rng,
    cols: usize,
) -> (wgpu::Buffer, wgpu::Buffer, Vec<f32>) {
    let h = rand_f32(r, cols, -30.0, 30.0);
    let nw = rand_f32(r, cols, 0.5, 1.5);
    let (_, xn) = crate::kernels::norm::rmsnorm_ref(&h, None, &nw, 1e-6);
    let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
    let wb = ctx.storage_init("nw", bytemuck::cast_slice(&nw)).unwrap();
    (hb, wb, xn)
}

#[test]
fn a_stack_keeps_each_parts_form_and_refuses_unequal_widths() {
    let Some(ctx) = gpu("a_stack_keeps_each_parts_form_and_refuses_unequal_widths") else {
        return;
    };
    let s = Stack::new(&ctx, 90, &[(QForm::Q4K, 40), (QForm::Q6K, 24)], 512);
    let m = &s.m;
    assert_eq!((m.rows, m.cols), (64, 512));
    let parts: Vec<(u32, u32, QForm)> = m
        .parts
        .iter()
        .map(|p| (p.row_start, p.rows, p.form))
        .collect();
    assert_eq!(parts, [(0, 40, QForm::Q4K), (40, 24, QForm::Q6K)]);
    m.check_layout("stack").unwrap();
    assert_eq!(m.form(), None);
    assert_eq!(m.form_names(), "Q4_K+Q6_K");
    let e = m.one_form("router fold").unwrap_err().to_string();
    assert!(e.contains("router fold") && e.contains("Q4_K+Q6_K"), "{e}");
    // A stack of one form is that form.
    let one = Stack::new(&ctx, 91, &[(QForm::Q6K, 8), (QForm::Q6K, 8)], 256);
    assert_eq!(one.m.form(), Some(QForm::Q6K));
    // Widths must agree; an empty stack is refused.
    let a = Stack::new(&ctx, 92, &[(QForm::Q4K, 4)], 512).m;
    let b = Stack::new(&ctx, 93, &[(QForm::Q4K, 4)], 256).m;
    let e = Q4Matrix::stack("qkv", vec![a, b]).unwrap_err().to_string();
    assert!(e.contains("qkv") && e.contains("equal width"), "{e}");
    assert!(Q4Matrix::stack("qkv", vec![]).is_err());
}

#[test]
fn stacked_forms_through_the_matvec_match_the_reference() {
    let Some(ctx) = gpu("stacked_forms_through_the_matvec_match_the_reference") else {
        return;
    };
    let state = RunState::default().buffer(&ctx).unwrap();
    let sink = crate::kernels::warm::sink(&ctx).unwrap();
    let forms = [QForm::Q4K, QForm::Q6K];
    let k = MatvecKernel::with_forms(&ctx, Numerics::F32, false, &forms).unwrap();
    let late = MatvecKernel::with_forms(&ctx, Numerics::F32, true, &forms).unwrap();
    // The norm-on-load forms with a dispatch per part (`--tune qkv_pair=0`).
    let split = |late| {
        MatvecKernel::with_forms(&ctx, Numerics::F32, late, &forms)
            .unwrap()
            .with_pair_forms(false)
    };
    let (k_split, late_split) = (split(false), split(true));
    let mut r = rng(94);
    // Odd row counts (a part that ends mid-workgroup), the real qkv's split (q + k, v) and a
    // Q6_K piece between two Q4_K ones.
    for (seed, pieces, cols) in [
        (95, vec![(QForm::Q4K, 13), (QForm::Q6K, 7)], 256),
        (96, vec![(QForm::Q4K, 4608), (QForm::Q6K, 512)], 2048),
        (
            97,
            vec![(QForm::Q4K, 33), (QForm::Q6K, 64), (QForm::Q4K, 5)],
            768,
        ),
    ] {
        let s = Stack::new(&ctx, seed, &pieces, cols);
        let rows = s.rows();
        let x = rand_f32(&mut r, cols, -2.0, 2.0);
        let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
        let want = matvec_f32_ref(&s.deq, rows, cols, &x);
        let mag = s.mag(&x);
        let y = ctx.storage("y", rows as u64 * 4).unwrap();
        for rpt in F32_ROWS_PER_TEAM {
            ctx.write(&y, 0, &vec![0xFF; rows * 4]);
            let b = k
                .bind_q4_with(&ctx, &s.m, Act::F32(&xb), &y, &state, rpt)
                .unwrap();
            assert_eq!(b.dispatch_count(), pieces.len(), "a dispatch per part");
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            let got = ctx.read_f32(&y, rows).unwrap();
            assert_within(&got, &want, &mag, 2e-6, &format!("{pieces:?} r{rpt}"));
        }
        // y += m · x.
        let y0 = rand_f32(&mut r, rows, -1.0, 1.0);
        ctx.write(&y, 0, bytemuck::cast_slice(&y0));
        let b = k.bind_q4_acc(&ctx, &s.m, &xb, &y, &state).unwrap();
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, rows).unwrap();
        let want_acc: Vec<f32> = want.iter().zip(&y0).map(|(a, b)| a + b).collect();
        let mag_acc: Vec<f32> = mag.iter().zip(&y0).map(|(m, b)| m + b.abs()).collect();
        assert_within(&got, &want_acc, &mag_acc, 2e-6, &format!("{pieces:?} acc"));
        // The norm-on-load forms (the decode's qkv), plain and late-scaled.
        let (hb, wb, xn) = norm_input(&ctx, &mut r, cols);
        let input = NormInput {
            h: &hb,
            weight: &wb,
            eps: 1e-6,
        };
        let want = matvec_f32_ref(&s.deq, rows, cols, &xn);
        let mag = s.mag(&xn);
        // Two parts take one dispatch, their workgroups in their two forms; three, one each.
        let one = if pieces.len() == 2 { 1 } else { pieces.len() };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (kern, apart, what) in [(&k, &k_split, "norm"), (&late, &late_split, "late norm")] {
            ctx.write(&y, 0, &vec![0xFF; rows * 4]);
            let b = apart.bind_q4_norm(&ctx, &s.m, input, &y, &state).unwrap();
            assert_eq!(b.dispatch_count(), pieces.len(), "a dispatch per part");
            ctx.run_pass(|p| apart.record(p, &b)).unwrap();
            let per_part = ctx.read_f32(&y, rows).unwrap();
            ctx.write(&y, 0, &vec![0xFF; rows * 4]);
            let b = kern.bind_q4_norm(&ctx, &s.m, input, &y, &state).unwrap();
            assert_eq!(b.dispatch_count(), one, "{what}");
            ctx.run_pass(|p| kern.record(p, &b)).unwrap();
            let got = ctx.read_f32(&y, rows).unwrap();
            assert_within(&got, &want, &mag, 4e-6, &format!("{pieces:?} {what}"));
            assert_eq!(
                bits(&got),
                bits(&per_part),
                "{pieces:?} {what}: one dispatch"
            );
            // The decode's qkv warms the o-proj from its first part's dispatch: the same
            // bits in every row, warm workgroups or not.
            ctx.write(&y, 0, &vec![0xFF; rows * 4]);
            let last = s.m.parts.last().unwrap();
            let b = kern
                .bind_q4_norm_warm(&ctx, &s.m, input, &y, &state, (last, &sink))
                .unwrap();
            assert_eq!(b.dispatch_count(), one, "{what} warm");
            ctx.run_pass(|p| kern.record(p, &b)).unwrap();
            let warm = ctx.read_f32(&y, rows).unwrap();
            assert_eq!(bits(&warm), bits(&got), "{pieces:?} {what} warm");
        }
    }
    // A kernel without one of the stack's forms refuses it by name.
    let s = Stack::new(&ctx, 98, &[(QForm::Q4K, 8), (QForm::Q6K, 8)], 256);
    let x = ctx.storage("x", 256 * 4).unwrap();
    let y = ctx.storage("y", 16 * 4).unwrap();
    let only = MatvecKernel::with_form(&ctx, Numerics::F32, false, QForm::Q4K).unwrap();
    let e = only
        .bind_q4(&ctx, &s.m, Act::F32(&x), &y, &state)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("reads Q4_K") && e.contains("is Q6_K"), "{e}");
}

#[test]
fn two_form_stacks_take_one_norm_dispatch_in_every_pairing() {
    let Some(ctx) = gpu("two_form_stacks_take_one_norm_dispatch_in_every_pairing") else {
        return;
    };
    // Each payload as the first and as the second (renamed) form: nibbles, bytes, the 5- and
    // 6-bit K forms, affine and not.
    let state = RunState::default().buffer(&ctx).unwrap();
    let forms = [QForm::Q4_0, QForm::Q8_0, QForm::Q6K, QForm::Q4K, QForm::Q5K];
    let k = MatvecKernel::with_forms(&ctx, Numerics::F32, true, &forms).unwrap();
    let mut r = rng(99);
    let cols = 256;
    for (i, pair) in [
        (QForm::Q6K, QForm::Q4K),
        (QForm::Q5K, QForm::Q6K),
        (QForm::Q4_0, QForm::Q8_0),
        (QForm::Q8_0, QForm::Q5K),
        (QForm::Q4K, QForm::Q4_0),
    ]
    .into_iter()
    .enumerate()
    {
        let s = Stack::new(&ctx, 100 + i as u64, &[(pair.0, 19), (pair.1, 9)], cols);
        let (hb, wb, xn) = norm_input(&ctx, &mut r, cols);
        let input = NormInput {
            h: &hb,
            weight: &wb,
            eps: 1e-6,
        };
        let y = ctx.storage("y", 28 * 4).unwrap();
        ctx.write(&y, 0, &[0xFF; 28 * 4]);
        let b = k.bind_q4_norm(&ctx, &s.m, input, &y, &state).unwrap();
        assert_eq!(b.dispatch_count(), 1, "{pair:?}");
        ctx.run_pass(|p| k.record(p, &b)).unwrap();
        let got = ctx.read_f32(&y, 28).unwrap();
        let want = matvec_f32_ref(&s.deq, 28, cols, &xn);
        assert_within(&got, &want, &s.mag(&xn), 4e-6, &format!("{pair:?}"));
    }
    // A kernel without one of the two forms refuses the stack by name.
    let s = Stack::new(&ctx, 110, &[(QForm::Q4K, 8), (QForm::Q6K, 8)], 256);
    let only = MatvecKernel::with_form(&ctx, Numerics::F32, false, QForm::Q4K).unwrap();
    let h = ctx.storage("h", 256 * 4).unwrap();
    let y = ctx.storage("y", 16 * 4).unwrap();
    let input = NormInput {
        h: &h,
        weight: &h,
        eps: 1e-6,
    };
    let e = only
        .bind_q4_norm(&ctx, &s.m, input, &y, &state)
        .err()
        .unwrap();
    assert!(e.to_string().contains("is Q6_K"), "{e}");
}

#[test]
fn stacked_forms_through_the_matmul_match_the_reference() {
    let Some(ctx) = gpu("stacked_forms_through_the_matmul_match_the_reference") else {
        return;
    };
    let state = RunState::default().buffer(&ctx).unwrap();
    let k = MatmulKernel::new(&ctx).unwrap();
    let mut r = rng(99);
    let cols = 512;
    let s = Stack::new(&ctx, 100, &[(QForm::Q4K, 37), (QForm::Q6K, 20)], cols);
    let rows = s.rows();
    let nb = 3u32;
    let n = nb as usize;
    let x = rand_f32(&mut r, n * cols, -2.0, 2.0);
    let xb = ctx.storage_init("x", bytemuck::cast_slice(&x)).unwrap();
    let y = ctx.storage("y", (n * rows * 4) as u64).unwrap();
    for tile in Tile::all().filter(|t| t.cols >= nb) {
        for acc in [false, true] {
            let y0 = rand_f32(&mut r, n * rows, -1.0, 1.0);
            ctx.write(&y, 0, bytemuck::cast_slice(&y0));
            let a = MatmulArgs {
                m: &s.m,
                input: match acc {
                    true => MatmulInput::Acc(&xb),
                    false => MatmulInput::Plain(&xb),
                },
                nb,
                y: &y,
                y_stride: rows as u32,
                state: &state,
            };
            let b = k.bind_tiled(&ctx, &a, tile).unwrap();
            assert_eq!(b.dispatch_count(), 2);
            ctx.run_pass(|p| k.record(p, &b)).unwrap();
            let got = ctx.read_f32(&y, n * rows).unwrap();
            for c in 0..n {
                let xc = &x[c * cols..(c + 1) * cols];
                let mut want = matvec_f32_ref(&s.deq, rows, cols, xc);
                let mut mag = s.mag(xc);
                if acc {
                    for i in 0..rows {
                        want[i] += y0[c * rows + i];
                        mag[i] += y0[c * rows + i].abs();
                    }
                }
                let what = format!("{tile:?} acc {acc} column {c}");
                assert_within(&got[c * rows..(c + 1) * rows], &want, &mag, 2e-6, &what);
            }
        }
    }
}
