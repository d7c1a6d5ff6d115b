//! Localising a divergence: given two backends' [`StepTrace`]s of the same step (the oracle's
//! and a fast backend's, see [`crate::Backend::trace_step`]), name the first intermediate whose
//! relative L2 error exceeds a tolerance.

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

#[cfg(test)]
mod tests {
    use super::*;

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
