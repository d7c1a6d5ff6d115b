//! Log-probabilities of generated tokens (OpenAI's `logprobs`): for each chosen id, its
//! log-softmax value over the model's raw logits row (before bias, penalties and temperature,
//! vLLM's default "raw" logprobs) and the `k` most likely ids with theirs.
//!
//! One pass over the row (a vocabulary is ~150k logits) finds the maximum, a second sums the
//! exponentials in f64 and keeps the top `k` in a small sorted list; NaN logits count as -inf.
//! A request that asks for logprobs samples on the host (each step's row comes back).

/// Most alternatives per token (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability and the most likely alternatives at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// `id`'s rank in the row, 1 for the most likely (1 + the ids with a strictly higher
    /// logit), as vLLM reports it.
    pub rank: u32,
    /// `(id, logprob)`, most likely first (ties: lower id first); `k` of them.
    pub top: Vec<(u32, f32)>,
}

/// A logit as the log-softmax takes it: NaN counts as -inf.
fn finite(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// `log Σ exp(x)` over one row (f64 sums; `+inf` where no logit is finite, so that every
/// log-probability comes out -inf) and the rank of the logit `own` in it (1 + the logits
/// strictly above it), in one pass after the maximum's. NaN counts as -inf.
pub(crate) fn log_sum_exp_rank(logits: &[f32], own: f32) -> (f64, u32) {
    let max = logits
        .iter()
        .map(|&x| finite(x))
        .fold(f32::NEG_INFINITY, f32::max);
    let (mut sum, mut above) = (0f64, 0u32);
    for &x in logits {
        let x = finite(x);
        above += u32::from(x > own);
        if max.is_finite() {
            sum += (f64::from(x) - f64::from(max)).exp();
        }
    }
    let lse = if max.is_finite() {
        f64::from(max) + sum.ln()
    } else {
        f64::INFINITY
    };
    (lse, 1 + above)
}

/// The entry of `id` chosen from `logits` (one row), with the `k` most likely ids.
pub fn token_logprob(logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let own = logits
        .get(id as usize)
        .map_or(f32::NEG_INFINITY, |&x| finite(x));
    let (lse, rank) = log_sum_exp_rank(logits, own);
    let lp = |x: f32| (f64::from(finite(x)) - lse) as f32;
    let k = k.min(MAX_TOP_LOGPROBS).min(logits.len());
    // The top k: a sorted list, each logit compared with its worst entry first.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &x) in logits.iter().enumerate() {
            let x = finite(x);
            if top.len() == k && x <= top[k - 1].1 {
                continue;
            }
            let at = top.partition_point(|&(_, y)| y >= x);
            top.insert(at, (i as u32, x));
            top.truncate(k);
        }
    }
    TokenLogprob {
        id,
        rank,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&x| lp(x)),
        top: top.into_iter().map(|(i, x)| (i, lp(x))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_of_the_row() {
        let p = [0.1f64, 0.2, 0.3, 0.4];
        let logits: Vec<f32> = p.iter().map(|x| (x.ln() + 3.0) as f32).collect();
        let e = token_logprob(&logits, 1, 2);
        assert_eq!((e.id, e.rank), (1, 3));
        assert!((e.logprob - 0.2f32.ln()).abs() < 1e-6, "{e:?}");
        assert_eq!(e.top.len(), 2);
        assert_eq!((e.top[0].0, e.top[1].0), (3, 2));
        assert!((e.top[0].1 - 0.4f32.ln()).abs() < 1e-6);
        assert!((e.top[1].1 - 0.3f32.ln()).abs() < 1e-6);
        // Ties: lower id first; k beyond the row or the bound is cut; NaN never ranks.
        let e = token_logprob(&[1.0, f32::NAN, 1.0, 0.0], 0, 50);
        let ids: Vec<u32> = e.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![0, 2, 3, 1]);
        // A tie shares the better rank; NaN ranks below every number.
        assert_eq!(e.rank, 1);
        assert_eq!(token_logprob(&[1.0, f32::NAN, 1.0, 0.0], 1, 0).rank, 4);
        assert_eq!(e.top[3].1, f32::NEG_INFINITY);
        assert!((e.logprob - e.top[1].1).abs() < 1e-7);
        let big: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect();
        assert_eq!(token_logprob(&big, 0, 50).top.len(), MAX_TOP_LOGPROBS);
        assert!(token_logprob(&big, 0, 0).top.is_empty());
    }
}
