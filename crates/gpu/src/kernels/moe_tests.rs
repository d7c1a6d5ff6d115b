//! Lavapipe tests of the MoE kernels against the scalar references in `moe.rs`.
//!
//! Tolerances: against references fed the same int8 activations the kernels see (x, and the
//! kernel's own int8 h for down), outputs agree to 2e-5 of the output scale + 1e-4 relative
//! (f32 vs f64 accumulation). Against the pure-f32 reference (f32 x and h), the int8 activations
//! add ~4e-3 relative error per stage; that error is printed and bounded at 3e-2 (L2, relative).

use super::*;
use crate::tensor::{pack_i8, quantize_acts_ref, QForm};
use crate::testing::{assert_close, dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};
use rand::Rng;

pub(super) struct Case {
    pub(super) p: MoeParams,
    pub(super) logits: Vec<f32>,
    pub(super) x: Vec<f32>,
    pub(super) residual: Vec<f32>,
    pub(super) gate: Vec<u8>,
    pub(super) up: Vec<u8>,
    pub(super) down: Vec<u8>,
    /// The form of the expert bytes (tensor.rs): gate and up's, and down's.
    pub(super) form: QForm,
    pub(super) down_form: QForm,
}

impl Case {
    pub(super) fn new(p: MoeParams, seed: u64) -> Case {
        let mut r = rng(seed);
        let (e, h, i) = (p.experts as usize, p.hidden as usize, p.inter as usize);
        Case {
            p,
            logits: rand_f32(&mut r, e, -4.0, 4.0),
            x: rand_f32(&mut r, h, -2.0, 2.0),
            residual: rand_f32(&mut r, h, -1.0, 1.0),
            gate: rand_q4_0(&mut r, e * i, h),
            up: rand_q4_0(&mut r, e * i, h),
            down: rand_q4_0(&mut r, e * h, i),
            form: QForm::Q4_0,
            down_form: QForm::Q4_0,
        }
    }

    /// [`Self::new`] with expert bytes of `form` (`salt` varies the random stream).
    pub(super) fn new_form(p: MoeParams, seed: u64, form: QForm, salt: u64) -> Case {
        Case::new_forms(p, seed, (form, form), salt)
    }

    /// [`Self::new`] with gate and up bytes of one form and down bytes of another (a
    /// `Q4_K_M` layer: Q4_K and Q6_K).
    pub(super) fn new_forms(p: MoeParams, seed: u64, forms: (QForm, QForm), salt: u64) -> Case {
        let mut c = Case::new(p, seed);
        let mut r = rng(seed ^ salt);
        let (e, h, i) = (p.experts as usize, p.hidden as usize, p.inter as usize);
        c.gate = crate::testing::rand_form(&mut r, forms.0, e * i, h).0;
        c.up = crate::testing::rand_form(&mut r, forms.0, e * i, h).0;
        c.down = crate::testing::rand_form(&mut r, forms.1, e * h, i).0;
        (c.form, c.down_form) = forms;
        c
    }

    /// [`Self::new`] with MLX_A4 expert bytes (the affine form).
    pub(super) fn new_affine(p: MoeParams, seed: u64) -> Case {
        Case::new_form(p, seed, QForm::Affine4, 0xA5)
    }

    /// [`Self::new`] with Q8_0 expert bytes (the byte form).
    pub(super) fn new_q8(p: MoeParams, seed: u64) -> Case {
        Case::new_form(p, seed, QForm::Q8_0, 0x5A)
    }

    /// [`Self::new`] with MLX_A8 expert bytes (the 8-bit affine form).
    pub(super) fn new_a8(p: MoeParams, seed: u64) -> Case {
        Case::new_form(p, seed, QForm::Affine8, 0x3C)
    }

    /// The block type of the expert bytes.
    pub(super) fn dtype(&self) -> nibble_quant::DType {
        crate::testing::dtype_of(self.form)
    }

    /// The block type of the down bytes.
    pub(super) fn down_dtype(&self) -> nibble_quant::DType {
        crate::testing::dtype_of(self.down_form)
    }

    /// Dequantised `[out, in]` slice of expert `e` of one of this case's stacked tensors
    /// (the down's when `bytes` is this case's down, else in the gate and up's type).
    pub(super) fn expert_w(&self, bytes: &[u8], e: u32, out: u32, inp: u32) -> Vec<f32> {
        let dt = match std::ptr::eq(bytes, self.down.as_slice()) {
            true => self.down_dtype(),
            false => self.dtype(),
        };
        let n = dt.byte_size((out * inp) as u64).expect("whole blocks") as usize;
        crate::testing::dequant(
            dt,
            &bytes[e as usize * n..(e as usize + 1) * n],
            out as usize,
            inp as usize,
        )
    }

    /// Dequantised `[out, in]` slice of expert `e` of a stacked Q4_0 tensor.
    pub(super) fn expert(bytes: &[u8], e: u32, out: u32, inp: u32) -> Vec<f32> {
        let n = (out * inp / 32) as usize * 18;
        dequant_q4_0(
            &bytes[e as usize * n..(e as usize + 1) * n],
            out as usize,
            inp as usize,
        )
    }
}

struct Outputs {
    route: Vec<u32>,
    h: Vec<f32>,
    h_q: Vec<i8>,
    h_s: Vec<[f32; 2]>,
    out: Vec<f32>,
}

fn upload_acts(ctx: &Context, label: &str, x: &[f32]) -> QuantActs {
    let acts = QuantActs::new(ctx, label, x.len()).expect("acts");
    let (q, s) = quantize_acts_ref(x);
    ctx.write(&acts.q, 0, bytemuck::cast_slice(&pack_i8(&q)));
    ctx.write(&acts.s, 0, bytemuck::cast_slice(&s));
    acts
}

/// Run one MoE block; `max_binding` (bytes) forces weight tensors to split into parts.
fn run(
    ctx: &Context,
    c: &Case,
    routing: Routing,
    residual: bool,
    max_binding: Option<u64>,
    done: bool,
) -> Outputs {
    let ctx = match max_binding {
        Some(b) => ctx.with_max_binding_bytes(b),
        None => ctx.clone(),
    };
    let p = c.p;
    let (e, k, h, i) = (
        p.experts as usize,
        p.top_k as usize,
        p.hidden as usize,
        p.inter as usize,
    );
    let kern = MoeKernel::new(&ctx, p).expect("kernel");
    let state = ctx
        .storage_init("state", bytemuck::cast_slice(&[3u32, 0, done as u32, 0]))
        .unwrap();
    let logits = ctx
        .storage_init("logits", bytemuck::cast_slice(&c.logits))
        .unwrap();
    let route = ctx.storage("route", 8 * k as u64).unwrap();
    let x = upload_acts(&ctx, "x", &c.x);
    let gate = Q4Matrix::upload(&ctx, "gate", e * i, h, i, &[&c.gate]).unwrap();
    let up = Q4Matrix::upload(&ctx, "up", e * i, h, i, &[&c.up]).unwrap();
    let down = Q4Matrix::upload(&ctx, "down", e * h, i, h, &[&c.down]).unwrap();
    if max_binding.is_some() {
        assert!(
            gate.parts.len() > 1 && down.parts.len() > 1,
            "test meant to split the weights"
        );
    }
    let hbuf = ctx.storage("h", (k * i * 4) as u64).unwrap();
    let h_q = QuantActs::new(&ctx, "h_q", k * i).unwrap();
    let out = ctx
        .storage_init("out", bytemuck::cast_slice(&c.residual))
        .unwrap();
    let bufs = MoeBuffers {
        state: &state,
        logits: &logits,
        route: &route,
        x: Act::Int8(&x),
        gate: &gate,
        up: &up,
        down: &down,
        h: &hbuf,
        h_q: Some(&h_q),
        out: &out,
        residual,
    };
    let b = kern.bind(&ctx, &bufs, routing).expect("bind");
    ctx.run_pass(|pass| kern.record(pass, &ctx, &b))
        .expect("run");
    let words = ctx.read_u32(&h_q.q, k * i / 4).unwrap();
    let s = ctx.read_f32(&h_q.s, k * i / 16).unwrap();
    Outputs {
        route: ctx.read_u32(&route, 2 * k).unwrap(),
        h: ctx.read_f32(&hbuf, k * i).unwrap(),
        h_q: (0..k * i)
            .map(|j| (words[j / 4] >> (8 * (j % 4))) as u8 as i8)
            .collect(),
        h_s: s.chunks(2).map(|c| [c[0], c[1]]).collect(),
        out: ctx.read_f32(&out, h).unwrap(),
    }
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let e: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let n: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (e / n).sqrt()
}

/// Everything one MoE run must satisfy; returns the relative L2 error vs the pure-f32 chain.
fn check(
    ctx: &Context,
    c: &Case,
    routing: Routing,
    residual: bool,
    max_binding: Option<u64>,
) -> f64 {
    let p = c.p;
    let (k, h, i) = (p.top_k as usize, p.hidden as usize, p.inter as usize);
    let what = format!("{p:?} {routing:?} residual {residual} split {max_binding:?}");
    let o = run(ctx, c, routing, residual, max_binding, false);

    let (ids, w) = router_ref(&c.logits, k, p.norm_topk_prob);
    assert_eq!(o.route[..k], ids, "{what}: expert ids");
    let got_w: Vec<f32> = o.route[k..].iter().map(|b| f32::from_bits(*b)).collect();
    assert_close(&got_w, &w, 1e-7, 1e-5, &format!("{what}: route weights"));

    // gate/up against the reference fed the same int8 x.
    let (xq, xs) = quantize_acts_ref(&c.x);
    let x_deq: Vec<f32> = xq
        .iter()
        .enumerate()
        .map(|(j, q)| *q as f32 * xs[j / 32][0])
        .collect();
    let mut h_want = Vec::new();
    let mut h_f32 = Vec::new();
    for &e in &ids {
        let wg = Case::expert(&c.gate, e, p.inter, p.hidden);
        let wu = Case::expert(&c.up, e, p.inter, p.hidden);
        h_want.extend(gate_up_ref(&wg, &wu, &x_deq));
        h_f32.extend(gate_up_ref(&wg, &wu, &c.x));
    }
    assert_close(
        &o.h,
        &h_want,
        2e-5 * max_abs(&h_want),
        1e-4,
        &format!("{what}: h"),
    );

    // The kernel's int8 h is the quantisation of its f32 h (one step of slack for rounding).
    let (hq_want, hs_want) = quantize_acts_ref(&o.h);
    for (j, (g, wq)) in o.h_q.iter().zip(&hq_want).enumerate() {
        assert!(
            (*g as i32 - *wq as i32).abs() <= 1,
            "{what}: h_q[{j}] {g} vs {wq}"
        );
    }
    for (b, (g, ws)) in o.h_s.iter().zip(&hs_want).enumerate() {
        assert!(
            (g[0] - ws[0]).abs() <= 1e-6 * ws[0].abs(),
            "{what}: h_s[{b}] {g:?} vs {ws:?}"
        );
        let sum: i32 = o.h_q[b * 32..(b + 1) * 32].iter().map(|q| *q as i32).sum();
        assert!(
            (g[1] - g[0] * sum as f32).abs() <= 1e-6 * g[0].abs() * 4064.0,
            "{what}: h_s[{b}] sum"
        );
    }

    // down + combine against the reference fed the kernel's own int8 h.
    let h_deq: Vec<f32> = o
        .h_q
        .iter()
        .enumerate()
        .map(|(j, q)| *q as f32 * o.h_s[j / 32][0])
        .collect();
    let wd: Vec<Vec<f32>> = ids
        .iter()
        .map(|&e| Case::expert(&c.down, e, p.hidden, p.inter))
        .collect();
    let wd_refs: Vec<&[f32]> = wd.iter().map(|v| v.as_slice()).collect();
    let hs: Vec<&[f32]> = h_deq.chunks(i).collect();
    let y = down_ref(&wd_refs, &hs, &w, h);
    let base = if residual {
        c.residual.clone()
    } else {
        vec![0.0; h]
    };
    let want: Vec<f32> = y.iter().zip(&base).map(|(a, b)| a + b).collect();
    assert_close(
        &o.out,
        &want,
        2e-5 * max_abs(&y),
        1e-4,
        &format!("{what}: out"),
    );

    // Pure f32 chain: the error the int8 activations introduce.
    let hs32: Vec<&[f32]> = h_f32.chunks(i).collect();
    let y32 = down_ref(&wd_refs, &hs32, &w, h);
    let got_y: Vec<f32> = o.out.iter().zip(&base).map(|(a, b)| a - b).collect();
    let err = rel_l2(&got_y, &y32);
    let herr = rel_l2(&o.h, &h_f32);
    eprintln!("{what}: int8 activations vs pure f32: h rel L2 {herr:.2e}, y rel L2 {err:.2e}");
    assert!(
        herr < 3e-2 && err < 3e-2,
        "{what}: int8 error vs f32 too large ({herr}, {err})"
    );
    err
}

pub(super) fn params(experts: u32, top_k: u32, hidden: u32, inter: u32, norm: bool) -> MoeParams {
    MoeParams {
        experts,
        top_k,
        hidden,
        inter,
        norm_topk_prob: norm,
    }
}

#[test]
fn moe_tiny_e16_k4_both_routings() {
    let Some(ctx) = gpu("moe_tiny_e16_k4_both_routings") else {
        return;
    };
    let c = Case::new(params(16, 4, 64, 64, true), 1);
    for routing in [Routing::Fused, Routing::Separate] {
        for residual in [true, false] {
            check(&ctx, &c, routing, residual, None);
        }
    }
}

#[test]
fn moe_e128_k8_i768() {
    let Some(ctx) = gpu("moe_e128_k8_i768") else {
        return;
    };
    // The real E, K and I with a reduced hidden size (H = 2048 is covered below with E = 16).
    let c = Case::new(params(128, 8, 128, 768, true), 2);
    check(&ctx, &c, Routing::Fused, true, None);
    check(&ctx, &c, Routing::Separate, true, None);
}

#[test]
fn moe_h2048_reduced_experts() {
    let Some(ctx) = gpu("moe_h2048_reduced_experts") else {
        return;
    };
    let c = Case::new(params(16, 8, 2048, 64, true), 3);
    check(&ctx, &c, Routing::Fused, true, None);
}

#[test]
fn moe_odd_shapes_and_no_renormalise() {
    let Some(ctx) = gpu("moe_odd_shapes_and_no_renormalise") else {
        return;
    };
    // H = 96 (3 blocks for 8 lanes), I = 32 (one block), K = 1 and K = E, norm_topk_prob off;
    // E = 160 > WG / 2: the routing rank's one-thread-per-expert form (moe_route.wgsl; up to
    // 128 experts, two threads share each expert's count).
    for (n, p) in [
        params(5, 1, 96, 32, false),
        params(6, 6, 96, 96, true),
        params(24, 3, 160, 32, false),
        params(160, 8, 64, 32, true),
    ]
    .into_iter()
    .enumerate()
    {
        let c = Case::new(p, 10 + n as u64);
        check(&ctx, &c, Routing::Fused, true, None);
        check(&ctx, &c, Routing::Separate, false, None);
    }
}

#[test]
fn moe_ties_go_to_lower_index() {
    let Some(ctx) = gpu("moe_ties_go_to_lower_index") else {
        return;
    };
    let mut c = Case::new(params(16, 4, 64, 32, true), 20);
    let mut r = rng(21);
    // Experts 3, 7, 9, 12 share the top logit; 1 and 14 share the next one.
    c.logits = (0..16).map(|_| r.random_range(-3.0f32..0.0)).collect();
    for e in [12, 9, 7, 3] {
        c.logits[e] = 2.5;
    }
    for e in [14, 1] {
        c.logits[e] = 1.0;
    }
    let o = run(&ctx, &c, Routing::Fused, false, None, false);
    assert_eq!(o.route[..4], [3, 7, 9, 12]);
    c.logits[9] = 0.5;
    c.logits[12] = 0.5;
    let o = run(&ctx, &c, Routing::Separate, false, None, false);
    assert_eq!(o.route[..4], [3, 7, 1, 14]);
    check(&ctx, &c, Routing::Fused, true, None);
}

#[test]
fn moe_weights_split_across_bindings() {
    let Some(ctx) = gpu("moe_weights_split_across_bindings") else {
        return;
    };
    // 16 experts of 64 x 64: 64*2*16 = 2 KiB of nibbles per expert: parts of 3 experts each
    // (the last holds one), so selected experts land in different parts.
    let c = Case::new(params(16, 4, 64, 64, true), 30);
    let limit = 3 * 64 * 2 * 16 + 100;
    for routing in [Routing::Fused, Routing::Separate] {
        check(&ctx, &c, routing, true, Some(limit as u64));
        check(&ctx, &c, routing, false, Some(limit as u64));
    }
}

#[test]
fn moe_done_flag_skips_everything() {
    let Some(ctx) = gpu("moe_done_flag_skips_everything") else {
        return;
    };
    let c = Case::new(params(16, 4, 64, 64, true), 40);
    let o = run(&ctx, &c, Routing::Fused, true, None, true);
    assert_eq!(o.out, c.residual, "residual changed although done");
    assert!(
        o.route.iter().all(|v| *v == 0),
        "route written although done"
    );
    assert!(o.h.iter().all(|v| *v == 0.0), "h written although done");
}

#[test]
fn moe_rejects_bad_shapes() {
    let Some(ctx) = gpu("moe_rejects_bad_shapes") else {
        return;
    };
    for bad in [
        params(16, 0, 64, 64, true),
        params(4, 5, 64, 64, true),
        params(16, 4, 48, 64, true),
    ] {
        let e = MoeKernel::new(&ctx, bad).expect_err("bad shape accepted");
        assert!(matches!(e, GpuError::Shape(_)), "{bad:?}: {e}");
    }
    // Weights of the wrong shape are refused at bind time.
    let p = params(16, 4, 64, 64, true);
    let c = Case::new(p, 50);
    let kern = MoeKernel::new(&ctx, p).unwrap();
    let gate = Q4Matrix::upload(&ctx, "gate", 16 * 64, 64, 64, &[&c.gate]).unwrap();
    let wrong =
        Q4Matrix::upload(&ctx, "down", 8 * 64, 64, 64, &[&c.down[..c.down.len() / 2]]).unwrap();
    let buf = ctx.storage("buf", 4096).unwrap();
    let acts_h = QuantActs::new(&ctx, "x", 64).unwrap();
    let acts_k = QuantActs::new(&ctx, "h", 256).unwrap();
    let bufs = MoeBuffers {
        state: &buf,
        logits: &buf,
        route: &buf,
        x: Act::Int8(&acts_h),
        gate: &gate,
        up: &gate,
        down: &wrong,
        h: &buf,
        h_q: Some(&acts_k),
        out: &buf,
        residual: true,
    };
    let e = kern
        .bind(&ctx, &bufs, Routing::Fused)
        .expect_err("wrong down accepted");
    assert!(e.to_string().contains("down"), "{e}");
    // The right shape over buffers too small for it (the staged kernels read without runtime
    // bounds checks, so the binder checks the buffers, not only the shape fields).
    let mut lying = Q4Matrix::upload(&ctx, "down", 16 * 64, 64, 64, &[&c.down]).unwrap();
    lying.parts[0].qs = ctx.storage("small", 256).unwrap();
    let e = kern
        .bind(
            &ctx,
            &MoeBuffers {
                down: &lying,
                ..bufs
            },
            Routing::Fused,
        )
        .expect_err("lying down accepted");
    assert!(e.to_string().contains("Q4 matrix"), "{e}");
}
