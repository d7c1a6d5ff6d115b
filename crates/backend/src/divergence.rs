//! Localising a divergence: given two backends' [`StepTrace`]s of the same step (the oracle's
//! and a fast backend's, see [`crate::Backend::trace_step`]), name the first intermediate whose
//! relative L2 error exceeds a tolerance; given a traced batched prefill
//! ([`crate::Backend::trace_prefill`]) and the oracle's per-token traces, name the first layer
//! and token where it departs, and how near a tie the oracle's routing was there.

use crate::StepTrace;

/// The first intermediate that differs beyond the tolerance.
#[derive(Debug, Clone, PartialEq)]
pub struct OpDivergence {
    /// The oracle's name, e.g. `l2.attn_out`.
    pub name: String,
    /// `|fast - oracle|_2 / |oracle|_2` (infinite for a length mismatch or non-finite values).
    pub rel_err: f64,
}

/// `|got - want|_2 / |want|_2` in f64; infinite when the lengths differ or a value is not
/// finite; the denominator is floored so an all-zero `want` compares absolutely.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (*g as f64, *w as f64);
        num += (g - w) * (g - w);
        den += w * w;
    }
    let e = num.sqrt() / den.sqrt().max(1e-30);
    if e.is_finite() {
        e
    } else {
        f64::INFINITY
    }
}

/// Walk `oracle` in its order and return the first name that `fast` also has whose relative
/// L2 error exceeds `tol` (names `fast` lacks are skipped: a backend traces what it can).
pub fn first_divergence(oracle: &StepTrace, fast: &StepTrace, tol: f64) -> Option<OpDivergence> {
    oracle.iter().find_map(|(name, want)| {
        let (_, got) = fast.iter().find(|(n, _)| n == name)?;
        let rel_err = rel_l2(got, want);
        (rel_err > tol).then(|| OpDivergence {
            name: name.clone(),
            rel_err,
        })
    })
}

/// One (layer, token) of a traced prefill against the oracle's run of that token.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillPoint {
    pub layer: usize,
    pub token: usize,
    /// Relative L2 error of the token's residual stream after the layer.
    pub rel_err: f64,
    /// Expert ids, each side's rank order.
    pub fast_experts: Vec<u32>,
    pub oracle_experts: Vec<u32>,
    /// The oracle's router gap there: its K-th largest logit minus its (K+1)-th (how near a
    /// tie the routing was; a flip across a gap of ~1e-6 is rounding, not a bug).
    pub oracle_gap: Option<f32>,
}

/// Where a batched prefill (a [`crate::PrefillLayerTrace`] per layer) first departs from the
/// oracle's token-by-token run of the same prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDeparture {
    /// Per layer, the largest relative L2 error of a token's residual stream.
    pub layer_max_rel: Vec<f64>,
    /// The first (layer, token), layer by layer and token by token within one, whose experts
    /// differ as sets or whose residual error exceeds the tolerance.
    pub first: Option<PrefillPoint>,
    /// The oracle's smallest router gap over every layer and token: `(gap, layer, token)`.
    pub min_gap: Option<(f32, usize, usize)>,
}

/// The oracle's router gap of a logits row with `k` experts chosen.
fn router_gap(logits: &[f32], k: usize) -> Option<f32> {
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    Some(v.get(k.checked_sub(1)?)? - v.get(k)?)
}

/// Compare a traced prefill (`fast`, one entry per layer, rows per token) with the oracle's
/// per-token traces of the same tokens (`oracle[j]` = token j's [`StepTrace`], whose
/// `l{n}.h`, `l{n}.moe_experts` and `l{n}.router_logits` are read). `k`: experts per token.
pub fn prefill_departure(
    oracle: &[StepTrace],
    fast: &[crate::PrefillLayerTrace],
    k: usize,
    tol: f64,
) -> anyhow::Result<PrefillDeparture> {
    let get = |j: usize, name: &str| -> anyhow::Result<&[f32]> {
        oracle[j]
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .ok_or_else(|| anyhow::anyhow!("the oracle's trace of token {j} has no {name}"))
    };
    let t = oracle.len();
    let mut out = PrefillDeparture {
        layer_max_rel: Vec::with_capacity(fast.len()),
        first: None,
        min_gap: None,
    };
    for (l, layer) in fast.iter().enumerate() {
        anyhow::ensure!(
            t > 0 && layer.h.len() % t == 0 && layer.experts.len() == t * k,
            "layer {l}: {} residual values and {} expert ids for {t} tokens",
            layer.h.len(),
            layer.experts.len()
        );
        let hd = layer.h.len() / t;
        let mut worst = 0f64;
        for j in 0..t {
            let want = get(j, &format!("l{l}.h"))?;
            let rel_err = rel_l2(&layer.h[j * hd..(j + 1) * hd], want);
            worst = worst.max(rel_err);
            let oracle_experts: Vec<u32> = get(j, &format!("l{l}.moe_experts"))?
                .iter()
                .map(|v| *v as u32)
                .collect();
            let fast_experts = layer.experts[j * k..(j + 1) * k].to_vec();
            let gap = router_gap(get(j, &format!("l{l}.router_logits"))?, k);
            if let Some(g) = gap {
                if out.min_gap.is_none_or(|(m, _, _)| g < m) {
                    out.min_gap = Some((g, l, j));
                }
            }
            let (mut a, mut b) = (fast_experts.clone(), oracle_experts.clone());
            a.sort_unstable();
            b.sort_unstable();
            if out.first.is_none() && (a != b || rel_err > tol) {
                out.first = Some(PrefillPoint {
                    layer: l,
                    token: j,
                    rel_err,
                    fast_experts,
                    oracle_experts,
                    oracle_gap: gap,
                });
            }
        }
        out.layer_max_rel.push(worst);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_departure_finds_the_first_flip_and_the_nearest_tie() {
        // Two tokens, two layers, K = 2 of 3 experts, H = 2.
        let step = |h0: [f32; 2], h1: [f32; 2], e0: [f32; 2], e1: [f32; 2], g: f32| {
            vec![
                ("l0.router_logits".to_string(), vec![3.0, 2.0, 2.0 - g]),
                ("l0.moe_experts".to_string(), e0.to_vec()),
                ("l0.h".to_string(), h0.to_vec()),
                ("l1.router_logits".to_string(), vec![1.0, 0.5, 0.0]),
                ("l1.moe_experts".to_string(), e1.to_vec()),
                ("l1.h".to_string(), h1.to_vec()),
            ]
        };
        let oracle = vec![
            step([1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 1.0], 0.5),
            step([0.0, 1.0], [0.0, 2.0], [0.0, 1.0], [0.0, 1.0], 1e-6),
        ];
        let layer = |h: [f32; 4], e: [u32; 4]| crate::PrefillLayerTrace {
            h: h.to_vec(),
            experts: e.to_vec(),
        };
        // Layer 0 agrees (experts in another rank order count as equal); layer 1's token 1
        // took expert 2 where the oracle took 1, and its residual is off by 10%.
        let fast = vec![
            layer([1.0, 0.0, 0.0, 1.0], [1, 0, 0, 1]),
            layer([2.0, 0.0, 0.0, 2.2], [0, 1, 0, 2]),
        ];
        let d = prefill_departure(&oracle, &fast, 2, 1e-3).unwrap();
        assert_eq!(d.layer_max_rel[0], 0.0);
        assert!((d.layer_max_rel[1] - 0.1).abs() < 1e-6);
        let p = d.first.unwrap();
        assert_eq!((p.layer, p.token), (1, 1));
        assert_eq!((p.fast_experts, p.oracle_experts), (vec![0, 2], vec![0, 1]));
        assert_eq!(p.oracle_gap, Some(0.5));
        // The nearest tie: layer 0, token 1 (2.0 against 2.0 - 1e-6).
        let (g, l, j) = d.min_gap.unwrap();
        assert!((l, j) == (0, 1) && g < 1e-5, "{g} {l} {j}");
        // Within tolerance and the same experts: no departure.
        let same = vec![fast[0].clone(), layer([2.0, 0.0, 0.0, 2.0], [0, 1, 1, 0])];
        assert_eq!(
            prefill_departure(&oracle, &same, 2, 1e-3).unwrap().first,
            None
        );
        // A trace whose rows do not match the tokens is an error, not a panic.
        assert!(prefill_departure(&oracle, &[layer([1.0; 4], [0; 4])][..1], 3, 1e-3).is_err());
    }

    fn t(items: &[(&str, &[f32])]) -> StepTrace {
        items
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_vec()))
            .collect()
    }

    #[test]
    fn rel_l2_values() {
        assert!((rel_l2(&[3.0, 4.0], &[3.0, 4.5]) - 0.5 / 4.5f64.hypot(3.0)).abs() < 1e-12);
        assert_eq!(rel_l2(&[1.0, -2.0], &[1.0, -2.0]), 0.0);
        assert_eq!(rel_l2(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[f32::NAN, 1.0], &[1.0, 1.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[f32::INFINITY], &[1.0]), f64::INFINITY);
    }

    #[test]
    fn first_divergence_follows_the_oracle_order_and_skips_missing_names() {
        let oracle = t(&[
            ("embd", &[1.0, 2.0]),
            ("l0.q_rope", &[5.0, 5.0]),
            ("l0.attn_out", &[0.5, -0.25]),
            ("l0.h", &[3.0, 1.0]),
        ]);
        // The fast trace lists names in another order and lacks q_rope.
        let fast = t(&[
            ("l0.h", &[9.0, 1.0]),
            ("l0.attn_out", &[0.5001, -0.25]),
            ("embd", &[1.0, 2.0]),
        ]);
        let d = first_divergence(&oracle, &fast, 1e-3).unwrap();
        assert_eq!(d.name, "l0.h");
        assert!((d.rel_err - 6.0 / 10f64.sqrt()).abs() < 1e-9);
        // A looser tolerance still catches h; a tighter one catches attn_out first.
        assert_eq!(
            first_divergence(&oracle, &fast, 1e-5).unwrap().name,
            "l0.attn_out"
        );
        assert_eq!(first_divergence(&oracle, &fast, 10.0), None);
    }
}
