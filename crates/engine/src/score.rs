//! Scoring a text with a model: how likely the model finds each token of it given the ones
//! before ([`nibble_backend::Backend::prefill_rows`]), for perplexity (`nibble perplexity`) and
//! prompt logprobs (the server's `echo` and `prompt_logprobs`).
//!
//! Perplexity follows llama.cpp's `llama-perplexity` protocol, so figures compare with it: the
//! tokenised text is cut into windows of `ctx` tokens, each scored from an empty cache; of each
//! window only the second half is scored (every token there has at least `ctx / 2` tokens of
//! context), and PPL = exp(mean negative log-likelihood) over all scored tokens. The ± is the
//! standard error of that mean carried through the exponential (`ppl · se`).

use crate::logprobs::{log_sum_exp_rank, token_logprob, TokenLogprob};
use anyhow::{ensure, Result};
use nibble_backend::{argmax, Backend};
use rayon::prelude::*;

/// Running sums of scored tokens' negative log-likelihoods.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Perplexity {
    /// Σ nll (natural log).
    pub sum: f64,
    /// Σ nll².
    pub sum2: f64,
    /// Tokens scored.
    pub count: usize,
    /// Scored tokens that were the model's most likely (argmax) choice.
    pub top1: usize,
}

impl Perplexity {
    pub fn add(&mut self, nll: f64, top1: bool) {
        self.sum += nll;
        self.sum2 += nll * nll;
        self.count += 1;
        self.top1 += usize::from(top1);
    }

    /// Mean negative log-likelihood per token (nats).
    pub fn mean_nll(&self) -> f64 {
        self.sum / self.count as f64
    }

    pub fn ppl(&self) -> f64 {
        self.mean_nll().exp()
    }

    /// Standard error of the perplexity (0 below two tokens).
    pub fn ppl_err(&self) -> f64 {
        if self.count < 2 {
            return 0.0;
        }
        let n = self.count as f64;
        let mean = self.mean_nll();
        let var = (self.sum2 / n - mean * mean).max(0.0);
        (var / (n - 1.0)).sqrt() * self.ppl()
    }

    /// Share of scored tokens the model ranked first.
    pub fn top1_rate(&self) -> f64 {
        self.top1 as f64 / self.count as f64
    }
}

/// `-log p(id)` under the log-softmax of `logits` (f64 sums), and whether `id` is the argmax.
/// A row with a non-finite logit is an error naming `at`.
pub fn nll_of(logits: &[f32], id: u32, at: usize) -> Result<(f64, bool)> {
    ensure!(
        logits.iter().all(|x| x.is_finite()),
        "non-finite logits at token {at}"
    );
    ensure!(
        (id as usize) < logits.len(),
        "token id {id} outside the logits"
    );
    let own = logits[id as usize];
    let (lse, _) = log_sum_exp_rank(logits, own);
    Ok((lse - f64::from(own), argmax(logits) == id))
}

/// Rows are scored this many at a time on rayon's threads (an exp per logit: ~150k per row).
const SCORE_BATCH: usize = 32;

/// Prefill `window` into an emptied cache and add the tokens from index `first + 1` on (each
/// predicted by the row before it) to `acc`. `1 <= first + 1 < window.len()`.
pub fn score_window(
    backend: &mut dyn Backend,
    window: &[u32],
    first: usize,
    acc: &mut Perplexity,
) -> Result<()> {
    ensure!(
        first + 1 < window.len(),
        "a window of {} tokens scores nothing from {first}",
        window.len()
    );
    backend.truncate(0)?;
    // This window's sums, merged into `acc` once it is whole: a backend that hands the rows
    // again from the start (after a fallback) restarts them.
    let mut win = Perplexity::default();
    let mut seen: Option<usize> = None;
    let mut pending: Vec<(usize, Vec<f32>)> = Vec::with_capacity(SCORE_BATCH);
    let flush = |pending: &mut Vec<(usize, Vec<f32>)>, win: &mut Perplexity| -> Result<()> {
        let scored = pending
            .par_iter()
            .map(|(i, row)| nll_of(row, window[i + 1], i + 1))
            .collect::<Result<Vec<_>>>()?;
        for (nll, top1) in scored {
            win.add(nll, top1);
        }
        pending.clear();
        Ok(())
    };
    backend.prefill_rows(window, first, &mut |i, row| {
        if seen.is_some_and(|s| i <= s) {
            win = Perplexity::default();
            pending.clear();
        }
        seen = Some(i);
        // The last row predicts past the window: not scored.
        if i >= first && i + 1 < window.len() {
            pending.push((i, row.to_vec()));
            if pending.len() == SCORE_BATCH {
                flush(&mut pending, &mut win)?;
            }
        }
        Ok(())
    })?;
    flush(&mut pending, &mut win)?;
    acc.sum += win.sum;
    acc.sum2 += win.sum2;
    acc.count += win.count;
    acc.top1 += win.top1;
    Ok(())
}

/// Each prompt token's logprob entry given the tokens before it (with the `k` most likely
/// alternatives), prefilled at the backend's current position: entry `i` is `tokens[i + 1]`'s
/// (the first token has none). Also returns the logits after the last token, the
/// distribution of the first generated one.
pub fn prompt_logprobs(
    backend: &mut dyn Backend,
    tokens: &[u32],
    k: usize,
) -> Result<(Vec<TokenLogprob>, Vec<f32>)> {
    let mut entries = Vec::with_capacity(tokens.len().saturating_sub(1));
    let mut last = Vec::new();
    backend.prefill_rows(tokens, 0, &mut |i, row| {
        entry_or_last(tokens, i, row, k, &mut entries, &mut last);
        Ok(())
    })?;
    Ok((entries, last))
}

/// A row of [`nibble_backend::Backend::prefill_rows`] over `tokens`: row `i` scores
/// `tokens[i + 1]` into `entries[i]` (a row handed again replaces its entry), the last row
/// becomes `last`.
pub fn entry_or_last(
    tokens: &[u32],
    i: usize,
    row: &[f32],
    k: usize,
    entries: &mut Vec<TokenLogprob>,
    last: &mut Vec<f32>,
) {
    match tokens.get(i + 1) {
        Some(&next) => {
            let e = token_logprob(row, next, k);
            entries.truncate(i);
            entries.push(e);
        }
        None => *last = row.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_the_negative_log_softmax() {
        let p = [0.1f64, 0.2, 0.3, 0.4];
        let row: Vec<f32> = p.iter().map(|x| (x.ln() + 7.0) as f32).collect();
        let (nll, top) = nll_of(&row, 2, 0).unwrap();
        assert!((nll + 0.3f64.ln()).abs() < 1e-6, "{nll}");
        assert!(!top);
        assert!(nll_of(&row, 3, 0).unwrap().1);
        let e = nll_of(&[1.0, f32::NAN], 0, 17).unwrap_err();
        assert!(e.to_string().contains("token 17"), "{e}");
        assert!(nll_of(&row, 4, 0).is_err());
    }

    #[test]
    fn perplexity_of_known_nlls() {
        let mut p = Perplexity::default();
        for (nll, top) in [(1.0, true), (2.0, false), (3.0, true)] {
            p.add(nll, top);
        }
        assert!((p.ppl() - 2f64.exp()).abs() < 1e-12);
        // var = 14/3 - 4 = 2/3; se = sqrt(var / 2) = sqrt(1/3).
        assert!((p.ppl_err() - (1.0f64 / 3.0).sqrt() * 2f64.exp()).abs() < 1e-12);
        assert!((p.top1_rate() - 2.0 / 3.0).abs() < 1e-12);
        let mut one = Perplexity::default();
        one.add(0.5, false);
        assert_eq!(one.ppl_err(), 0.0);
    }

    /// A backend whose row at position `p` favours token `p % 5` (vocabulary 8), handing its
    /// rows twice when `again` (as the GPU does after a fallback) and holding what it was fed.
    struct Mock {
        cfg: nibble_backend::Qwen3MoeConfig,
        fed: Vec<u32>,
        again: bool,
    }

    impl Mock {
        fn new(again: bool) -> Mock {
            Mock {
                cfg: nibble_backend::Qwen3MoeConfig {
                    vocab_size: 8,
                    ..nibble_backend::Qwen3MoeConfig::tiny()
                },
                fed: Vec::new(),
                again,
            }
        }
        fn row(p: usize) -> Vec<f32> {
            (0..8)
                .map(|j| if j == p % 5 { 2.0 } else { 0.1 * j as f32 })
                .collect()
        }
    }

    impl Backend for Mock {
        fn name(&self) -> String {
            "mock".into()
        }
        fn config(&self) -> &nibble_backend::Qwen3MoeConfig {
            &self.cfg
        }
        fn context_len(&self) -> usize {
            64
        }
        fn position(&self) -> usize {
            self.fed.len()
        }
        fn truncate(&mut self, pos: usize) -> Result<()> {
            self.fed.truncate(pos);
            Ok(())
        }
        fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.fed.extend_from_slice(tokens);
            Ok(Mock::row(self.fed.len() - 1))
        }
        fn prefill_rows(
            &mut self,
            tokens: &[u32],
            from: usize,
            row: &mut nibble_backend::RowSink<'_>,
        ) -> Result<()> {
            let start = self.fed.len();
            for pass in 0..1 + usize::from(self.again) {
                for i in from..tokens.len() {
                    // The first pass of a repeated run hands garbage: the second must win.
                    let mut r = Mock::row(start + i);
                    if self.again && pass == 0 {
                        r[tokens.get(i + 1).map_or(0, |&t| t as usize)] = 50.0;
                    }
                    row(i, &r)?;
                }
            }
            self.fed.extend_from_slice(tokens);
            Ok(())
        }
    }

    #[test]
    fn a_window_scores_its_second_half_once_even_when_rows_come_again() {
        let window: Vec<u32> = (0..12).map(|i| (i * 3 % 8) as u32).collect();
        let mut want = Perplexity::default();
        for i in 6..11 {
            let (nll, top) = nll_of(&Mock::row(i), window[i + 1], i + 1).unwrap();
            want.add(nll, top);
        }
        for again in [false, true] {
            let mut b = Mock::new(again);
            b.prefill(&[1, 2, 3]).unwrap();
            let mut acc = Perplexity::default();
            score_window(&mut b, &window, 6, &mut acc).unwrap();
            assert_eq!(acc, want, "again: {again}");
            assert_eq!(b.position(), 12, "scored from an emptied cache");
        }
        let e = score_window(
            &mut Mock::new(false),
            &window[..7],
            6,
            &mut Perplexity::default(),
        );
        assert!(e.unwrap_err().to_string().contains("scores nothing"));
        // Prompt logprobs: entry i is token i + 1's; a repeated row replaces its entry.
        let mut b = Mock::new(true);
        let (entries, last) = prompt_logprobs(&mut b, &window[..4], 2).unwrap();
        assert_eq!(entries.len(), 3);
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e, &token_logprob(&Mock::row(i), window[i + 1], 2));
        }
        assert_eq!(last, Mock::row(3));
    }
}
