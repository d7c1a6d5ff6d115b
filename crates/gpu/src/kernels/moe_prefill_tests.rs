//! Lavapipe tests of the prefill MoE (route, plan, expert GEMMs, combine) against the scalar
//! references of moe_ref.rs on random inputs: odd token counts, a chunk shorter than the buffers,
//! router logits in partial sums (the router GEMM's K splits),
//! consecutive layers (the counts are cleared between them), split expert tensors, and the plan's
//! own invariants (every assignment exactly once, grouped by expert, tiles covering each list).

use super::*;
use crate::kernels::moe::{down_ref, gate_up_ref, router_ref};
use crate::tensor::QForm;
use crate::testing::{dequant, gpu, rand_f32, rng};
use rand::Rng;

struct Layer {
    gate: Q4Matrix,
    up: Q4Matrix,
    down: Q4Matrix,
    dg: Vec<f32>,
    du: Vec<f32>,
    dd: Vec<f32>,
}

/// A random layer's experts: gate and up in the first block form, down in the second.
fn layer(
    ctx: &Context,
    r: &mut impl Rng,
    d: &MoeDims,
    (gu_form, down_form): (QForm, QForm),
) -> Layer {
    let (e, h, i) = (d.experts as usize, d.hidden as usize, d.inter as usize);
    let mat = |r: &mut _, rows: usize, cols: usize, per: usize, name: &str, form: QForm| {
        let (b, dt) = crate::testing::rand_form(r, form, rows, cols);
        let m = Q4Matrix::upload_dtype(ctx, name, dt, rows, cols, per, &[&b]).unwrap();
        (m, dequant(dt, &b, rows, cols))
    };
    let (gate, dg) = mat(r, e * i, h, i, "gate", gu_form);
    let (up, du) = mat(r, e * i, h, i, "up", gu_form);
    let (down, dd) = mat(r, e * h, i, h, "down", down_form);
    Layer {
        gate,
        up,
        down,
        dg,
        du,
        dd,
    }
}

/// `h + MoE(xn)` per token from the references.
fn reference(d: &MoeDims, l: &Layer, logits: &[f32], xn: &[f32], h: &[f32], t: usize) -> Vec<f32> {
    let (e, hd, i, k) = (
        d.experts as usize,
        d.hidden as usize,
        d.inter as usize,
        d.top_k as usize,
    );
    let mut out = h[..t * hd].to_vec();
    for tok in 0..t {
        let (ids, w) = router_ref(&logits[tok * e..(tok + 1) * e], k, d.norm_topk);
        let x = &xn[tok * hd..(tok + 1) * hd];
        let acts: Vec<Vec<f32>> = ids
            .iter()
            .map(|&ex| {
                let ex = ex as usize;
                gate_up_ref(
                    &l.dg[ex * i * hd..(ex + 1) * i * hd],
                    &l.du[ex * i * hd..(ex + 1) * i * hd],
                    x,
                )
            })
            .collect();
        let wd: Vec<&[f32]> = ids
            .iter()
            .map(|&ex| &l.dd[ex as usize * hd * i..(ex as usize + 1) * hd * i])
            .collect();
        let hs: Vec<&[f32]> = acts.iter().map(|a| a.as_slice()).collect();
        let y = down_ref(&wd, &hs, &w, hd);
        for (o, v) in out[tok * hd..(tok + 1) * hd].iter_mut().zip(y) {
            *o += v;
        }
    }
    out
}

/// The plan read back: every assignment `0..t K` once in the list, each expert's rows together
/// and in `rid` order of experts, the inverse consistent, the tiles exactly the list's
/// `ceil(count / bm)` row blocks.
fn check_plan(words: &[u32], p: &MoePrefill, logits: &[f32], t: usize) {
    let d = p.dims;
    let (e, k) = (d.experts as usize, d.top_k as usize);
    let l = p.layout;
    let inv0 = l.list as usize + (p.tokens_max * d.top_k) as usize;
    let off = &words[l.off as usize..l.off as usize + e + 1];
    assert_eq!(off[e] as usize, t * k, "offsets end at T K");
    let list = &words[l.list as usize..l.list as usize + t * k];
    let inv = &words[inv0..inv0 + t * k];
    let mut seen = vec![false; t * k];
    for (j, &i) in list.iter().enumerate() {
        let i = i as usize;
        assert!(
            i < t * k && !seen[i],
            "list position {j}: assignment {i} repeated or out of range"
        );
        seen[i] = true;
        assert_eq!(inv[i] as usize, j, "inverse of assignment {i}");
        let tok = i / k;
        let (ids, _) = router_ref(&logits[tok * e..(tok + 1) * e], k, d.norm_topk);
        let ex = ids[i % k] as usize;
        assert!(
            off[ex] as usize <= j && j < off[ex + 1] as usize,
            "assignment {i} (expert {ex}) at {j} outside the expert's list"
        );
    }
    let bm = 16 * p.tm;
    let mut tiles = vec![];
    for ex in 0..e {
        let mut m0 = 0;
        while m0 < off[ex + 1] - off[ex] {
            tiles.push(((ex as u32) << 16) | m0);
            m0 += bm;
        }
    }
    assert_eq!(words[0] as usize, tiles.len(), "tile count");
    assert_eq!(
        &words[l.tiles as usize..l.tiles as usize + tiles.len()],
        &tiles[..]
    );
}

/// One chunk of `t` tokens through `layers` consecutive MoE layers on the GPU and the reference;
/// the router logits come as `rs` partial sums (the router GEMM's K splits) that `route` adds.
fn run_case(
    ctx: &Context,
    d: MoeDims,
    (tokens_max, t): (u32, usize),
    seed: u64,
    split: bool,
    rs: usize,
    forms: (QForm, QForm),
) {
    let mut r = rng(seed);
    let (e, hd) = (d.experts as usize, d.hidden as usize);
    let tm = tokens_max as usize;
    let logits = ctx.storage("logits", (rs * tm * e) as u64 * 4).unwrap();
    let h = ctx.storage("h", (tm * hd) as u64 * 4).unwrap();
    let xn = ctx.storage("xn", (tm * hd) as u64 * 4).unwrap();
    let dims = ctx
        .uniform("dims", bytemuck::cast_slice(&[t as u32, 0, 0, 0]))
        .unwrap();
    let wctx = if split {
        // Two experts' worth of gate rows per binding: several parts.
        ctx.with_max_binding_bytes((2 * d.inter * d.hidden / 32 * 16) as u64)
    } else {
        ctx.with_max_binding_bytes(ctx.max_binding_bytes())
    };
    // Layer 0 on the default GEMM, layer 1 on the double-buffered one where it exists.
    let gemms = crate::kernels::gemm::tests::test_kernels_for_forms(ctx, &[forms.0, forms.1]);
    let bufs = MoePrefillBuffers {
        logits: &logits,
        logit_splits: rs as u32,
        h: &h,
        dims: &dims,
    };
    let moe = MoePrefill::new(ctx, d, tokens_max, &bufs).unwrap();
    let mut hv = rand_f32(&mut r, tm * hd, -1.0, 1.0);
    ctx.write(&h, 0, bytemuck::cast_slice(&hv));
    for li in 0..2 {
        let gemm = &gemms[li % gemms.len()];
        let l = layer(&wctx, &mut r, &d, forms);
        if split {
            assert!(l.gate.parts.len() > 1 && l.down.parts.len() > 1);
        }
        // Logits spread wide enough that the top-K has no ties, as `rs` partial sums (the
        // reference takes their f32 sum in split order, as `route` adds them).
        let parts = rand_f32(&mut r, rs * tm * e, -4.0 / rs as f32, 4.0 / rs as f32);
        let lg: Vec<f32> = (0..tm * e)
            .map(|i| (1..rs).fold(parts[i], |v, j| v + parts[j * tm * e + i]))
            .collect();
        let x = rand_f32(&mut r, tm * hd, -1.0, 1.0);
        ctx.write(&logits, 0, bytemuck::cast_slice(&parts));
        ctx.write(&xn, 0, bytemuck::cast_slice(&x));
        let b = moe
            .bind_layer(ctx, gemm, &xn, &l.gate, &l.up, &l.down)
            .unwrap();
        ctx.run_pass(|p| moe.record(p, gemm, &b, t as u32)).unwrap();
        let words = ctx
            .read_u32(moe.plan_buffer(), (moe.plan_buffer().size() / 4) as usize)
            .unwrap();
        check_plan(&words, &moe, &lg, t);
        let want = reference(&d, &l, &lg, &x, &hv, t);
        let got = ctx.read_f32(&h, tm * hd).unwrap();
        let what = format!(
            "E {} K {} H {hd} I {} t {t} layer {li} {forms:?}",
            e, d.top_k, d.inter
        );
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got[..t * hd].iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-5 * scale,
                "{what}: element {i}: got {g}, want {w} (scale {scale})"
            );
        }
        assert_eq!(
            &got[t * hd..],
            &hv[t * hd..],
            "{what}: rows past the chunk were written"
        );
        hv = got;
    }
}

/// A case of [`run_case`]: dims, (tokens the buffers hold, tokens), seed, split expert
/// tensors, router partial sums, (gate/up form, down form).
type Case = (MoeDims, (u32, usize), u64, bool, usize, (QForm, QForm));

fn run_cases(name: &str, cases: &[Case]) {
    let Some(ctx) = gpu(name) else {
        return;
    };
    for &(d, ct, seed, split, rs, forms) in cases {
        run_case(&ctx, d, ct, seed, split, rs, forms);
    }
}

const fn dims(hidden: u32, inter: u32, experts: u32, top_k: u32, norm_topk: bool) -> MoeDims {
    MoeDims {
        hidden,
        inter,
        experts,
        top_k,
        norm_topk,
    }
}

/// 16 experts, 4 per token, renormalised.
const TINY: MoeDims = dims(64, 64, 16, 4, true);
/// Rows of whole 256-weight super-blocks (the K-quants).
const K256: MoeDims = dims(256, 512, 8, 2, true);
const Q4: (QForm, QForm) = (QForm::Q4_0, QForm::Q4_0);

#[test]
fn moe_prefill_matches_reference() {
    // Odd widths (I not a multiple of the 64-column gate/up tile, H of the 128-row down tile),
    // no renormalisation, 64-row tiles (300 x 2 / 8 >= 64 tokens per expert).
    let odd = dims(96, 160, 8, 2, false);
    run_cases(
        "moe_prefill_matches_reference",
        &[
            // One token; a chunk shorter than the buffers; lists long enough for several tiles.
            (TINY, (8, 1), 81, false, 1, Q4),
            (TINY, (64, 37), 82, false, 1, Q4),
            (TINY, (300, 300), 83, false, 1, Q4),
            // Logits in 3 partial sums (the router GEMM's K splits): a chunk shorter than the
            // buffers.
            (TINY, (64, 37), 87, false, 3, Q4),
            (odd, (300, 257), 84, false, 1, Q4),
            (odd, (40, 33), 85, false, 2, Q4),
        ],
    );
}

#[test]
fn moe_prefill_split_experts_match_reference() {
    let name = "moe_prefill_split_experts_match_reference";
    run_cases(name, &[(TINY, (50, 50), 86, true, 1, Q4)]);
}

/// The expert GEMMs on affine (MLX) weights: one token, several tiles, split expert tensors,
/// and H not a multiple of the down form's 128-row tile (I stays whole groups of 64).
#[test]
fn moe_prefill_affine_experts_match_reference() {
    let a4 = (QForm::Affine4, QForm::Affine4);
    run_cases(
        "moe_prefill_affine_experts_match_reference",
        &[
            (TINY, (8, 1), 91, false, 1, a4),
            (TINY, (300, 300), 92, false, 1, a4),
            (TINY, (50, 50), 93, true, 1, a4),
            (dims(192, 128, 8, 2, false), (300, 257), 94, false, 2, a4),
        ],
    );
}

/// The expert GEMMs on Q8_0 weights (the byte form, f32 fmas only): one token, several tiles,
/// split expert tensors, and an odd shape; MLX's 8-bit groups, Q6_K and Q4_K likewise.
#[test]
fn moe_prefill_q8_experts_match_reference() {
    let q8 = (QForm::Q8_0, QForm::Q8_0);
    let a8 = (QForm::Affine8, QForm::Affine8);
    let (q6, q4k, q5k) = (QForm::Q6K, QForm::Q4K, QForm::Q5K);
    run_cases(
        "moe_prefill_q8_experts_match_reference",
        &[
            (TINY, (8, 1), 95, false, 1, q8),
            (TINY, (300, 300), 96, false, 1, q8),
            (TINY, (50, 50), 97, true, 1, q8),
            (dims(192, 96, 8, 2, false), (300, 257), 98, false, 2, q8),
            // MLX's 8-bit groups (I whole groups of 64).
            (TINY, (300, 300), 99, false, 1, a8),
            (TINY, (50, 50), 100, true, 1, a8),
            // Q6_K (rows of whole 256-weight super-blocks), split weights too.
            (K256, (300, 257), 101, false, 2, (q6, q6)),
            (K256, (50, 50), 102, true, 1, (q6, q6)),
            // Q4_K likewise.
            (K256, (300, 257), 103, false, 2, (q4k, q4k)),
            (K256, (50, 50), 104, true, 1, (q4k, q4k)),
            // A `Q4_K_M` layer: gate and up Q4_K, down Q6_K (each GEMM binding takes its own
            // form's pipeline), split too.
            (K256, (300, 257), 105, true, 2, (q4k, q6)),
            (K256, (50, 50), 106, false, 1, (q4k, q6)),
            // Q5_K, and a `Q5_K_M` layer (down Q6_K).
            (K256, (300, 257), 107, false, 2, (q5k, q5k)),
            (K256, (50, 50), 108, true, 1, (q5k, q6)),
        ],
    );
}
