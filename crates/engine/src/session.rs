//! A decoding session: one sequence on one backend, with the token ids its KV cache holds.
//!
//! The session is the only place that drives a [`Backend`] for text generation. It keeps
//! `cached`, the ids whose keys and values the backend holds (invariant:
//! `cached.len() == backend.position()`), so a follow-up request that extends an earlier
//! conversation prefills only the new suffix: the longest common prefix is kept and the rest
//! truncated.
//!
//! Greedy requests go through [`Backend::decode_greedy`] in runs of `greedy_run` tokens (the GPU
//! folds a run into one submission); so do sampled requests whose settings the backend samples
//! on the device ([`Backend::samples_on_device`]: the GPU's top-k sampler, fed the host
//! sampler's own draws); other sampled requests step one token at a time, the host sampler
//! reading each row of logits.

use crate::grammar::Constraint;
use crate::logprobs::{token_logprob, TokenLogprob};
use crate::sampler::{Sampler, SamplingParams};
use crate::score;
use crate::stop::{StopChecker, StopReason};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use nibble_backend::{argmax, Backend};
use std::time::Instant;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// Upper bound on generated tokens (the context may end generation earlier).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Texts that end generation (not emitted).
    pub stop_strings: Vec<String>,
    /// Tokens per folded run (greedy, or sampled on the device).
    pub greedy_run: usize,
    /// Leave special tokens (`<|vision_start|>`, ...) and ids the tokenizer does not know out
    /// of the text, as vLLM's `skip_special_tokens` (default) and llama.cpp without `--special`.
    pub skip_special_tokens: bool,
    /// Each generated token's log-probability and this many alternatives (at most
    /// [`crate::MAX_TOP_LOGPROBS`]); `None`: none. Asking samples on the host each step.
    pub logprobs: Option<usize>,
    /// A grammar the answer must follow (structured outputs), in its start state; `None`: free
    /// text. Asking samples on the host each step (the logits are masked first).
    pub constraint: Option<Constraint>,
    /// Each prompt token's logprob (after the first) with this many alternatives
    /// ([`crate::score::prompt_logprobs`]); the whole prompt is then prefilled afresh (no
    /// cached prefix: its rows are needed). `None`: none.
    pub prompt_logprobs: Option<usize>,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop_strings: vec![],
            greedy_run: 4,
            skip_special_tokens: true,
            logprobs: None,
            constraint: None,
            prompt_logprobs: None,
        }
    }
}

/// Where generated text goes as it is known: each call hands over a piece of complete UTF-8
/// text (stop strings removed) and, when [`GenParams::logprobs`] asked, the entries of the ids
/// produced since the previous call (an id whose text is held back, by a stop string that may
/// be starting or a character split over ids, has its entry handed over with the text that
/// follows it). The text is non-empty, except in one last call at the end that hands over the
/// entries of ids whose text never showed (a stop string's). Returning `false` cancels.
pub type OnText<'a> = dyn FnMut(&str, &[TokenLogprob]) -> bool + 'a;

/// Why a generation ended, in OpenAI's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS id or stop string.
    Stop(StopReason),
    /// `max_tokens` reached.
    Length,
    /// The KV cache is full.
    ContextFull,
    /// The caller's callback asked to stop (e.g. a client disconnected).
    Cancelled,
}

/// Counts and timings of one generation.
#[derive(Debug, Clone)]
pub struct GenStats {
    /// Prompt tokens in the request.
    pub prompt_tokens: usize,
    /// Of those, tokens served from the cache (not recomputed).
    pub cached_tokens: usize,
    /// Generated ids (including a final EOS id, which produces no text).
    pub generated: Vec<u32>,
    pub prompt_secs: f64,
    pub decode_secs: f64,
    pub finish: FinishReason,
    /// One entry per generated id when [`GenParams::logprobs`] asked; else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// One entry per prompt token after the first when [`GenParams::prompt_logprobs`] asked.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

impl GenStats {
    /// Prompt tokens per second over the tokens actually prefilled.
    pub fn prompt_tps(&self) -> f64 {
        (self.prompt_tokens - self.cached_tokens) as f64 / self.prompt_secs.max(1e-9)
    }
    /// Generated tokens per second after the first (the first comes from the prefill).
    pub fn decode_tps(&self) -> f64 {
        self.generated.len().saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// One sequence on one backend.
pub struct Session {
    backend: Box<dyn Backend>,
    cached: Vec<u32>,
}

impl Session {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        Session {
            backend,
            cached: vec![],
        }
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The backend, for paths that bypass the main sequence (multi-stream slots leave this
    /// session's cache alone).
    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        self.backend.as_mut()
    }

    /// Ids currently in the KV cache.
    pub fn cached(&self) -> &[u32] {
        &self.cached
    }

    /// Forget the cache.
    pub fn reset(&mut self) -> Result<()> {
        self.backend.truncate(0)?;
        self.cached.clear();
        Ok(())
    }

    /// Generate a continuation of `prompt`, calling `on_text` with each piece of complete UTF-8
    /// text as soon as it is known; `on_text` returning `false` cancels (see [`OnText`]).
    pub fn generate(
        &mut self,
        tok: &Tokenizer,
        prompt: &[u32],
        p: &GenParams,
        on_text: &mut OnText<'_>,
    ) -> Result<GenStats> {
        if prompt.is_empty() {
            bail!("empty prompt: nothing to condition on");
        }
        let ctx = self.backend.context_len();
        // A prompt alone (max_tokens 0: scored or echoed) may fill the context.
        if prompt.len() > ctx || (prompt.len() == ctx && p.max_tokens > 0) {
            bail!(
                "prompt of {} tokens does not fit the context of {ctx} tokens (at least one must be left to generate)",
                prompt.len()
            );
        }
        let vocab = self.backend.config().vocab_size;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is outside the model's vocabulary of {vocab}");
        }
        if let Some(bad) = p.sampling.bias_outside(vocab) {
            bail!(
                "logit bias for token {bad}: the id is outside the model's vocabulary of {vocab}"
            );
        }
        let mut sampler = Sampler::new(p.sampling.clone())?;
        let mut constraint = p.constraint.clone();
        // Logprobs and grammars need each step's logits on the host: no folded runs then.
        let host_logits = p.logprobs.is_some() || constraint.is_some();
        let greedy = sampler.is_greedy() && !host_logits;
        // Sampled requests fold like greedy ones where the backend samples these settings on
        // the device; otherwise each step's logits come to the host sampler.
        let on_device = !greedy
            && !host_logits
            && self
                .backend
                .samples_on_device(&sampler.device_sampling(&[], &[]));

        // Reuse the cached prefix; at least one prompt token must be fed to get logits. Prompt
        // logprobs need every prompt row: nothing is reused then.
        let common = match p.prompt_logprobs {
            Some(_) => 0,
            None => self
                .cached
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(prompt.len() - 1),
        };
        self.backend.truncate(common)?;
        self.cached.truncate(common);
        let t0 = Instant::now();
        let (logits, prompt_logprobs) = match p.prompt_logprobs {
            Some(k) => {
                let (entries, last) = score::prompt_logprobs(self.backend.as_mut(), prompt, k)?;
                (last, entries)
            }
            None => (self.backend.prefill(&prompt[common..])?, Vec::new()),
        };
        self.cached.extend_from_slice(&prompt[common..]);
        let prompt_secs = t0.elapsed().as_secs_f64();
        if p.max_tokens == 0 {
            // Only the prompt (scored, or echoed by the caller).
            return Ok(GenStats {
                prompt_tokens: prompt.len(),
                cached_tokens: common,
                generated: Vec::new(),
                prompt_secs,
                decode_secs: 0.0,
                finish: FinishReason::Length,
                logprobs: Vec::new(),
                prompt_logprobs,
            });
        }

        let eos_ids = self.backend.config().eos_token_ids.clone();
        let mut stop = StopChecker::new(&eos_ids, &p.stop_strings);
        let mut dec = tok.output_decoder(p.skip_special_tokens);
        let mut generated: Vec<u32> = vec![];
        let mut history = prompt.to_vec();
        let t1 = Instant::now();
        // Feed one id to the stop checker and the caller; Some(reason) ends generation.
        // Entries of `logprobs` handed out with a piece of text so far.
        let mut sent = 0;
        let mut emit = |id: u32,
                        generated: &mut Vec<u32>,
                        logprobs: &[TokenLogprob]|
         -> Option<FinishReason> {
            generated.push(id);
            let text = dec.push(id).unwrap_or_default();
            let step = stop.push(id, &text);
            if !step.text.is_empty() {
                let fresh = &logprobs[sent.min(logprobs.len())..];
                sent = logprobs.len();
                if !on_text(&step.text, fresh) {
                    return Some(FinishReason::Cancelled);
                }
            }
            if let Some(r) = step.stop {
                return Some(FinishReason::Stop(r));
            }
            None
        };
        let mut next = if greedy {
            argmax(&logits)
        } else {
            pick(&mut sampler, constraint.as_mut(), &logits, &history)?
        };
        let mut logprobs = Vec::new();
        if let Some(k) = p.logprobs {
            logprobs.push(token_logprob(&logits, next, k));
        }
        let finish = loop {
            if let Some(r) = emit(next, &mut generated, &logprobs) {
                break r;
            }
            if generated.len() >= p.max_tokens {
                break FinishReason::Length;
            }
            if self.cached.len() >= ctx {
                break FinishReason::ContextFull;
            }
            if greedy || on_device {
                // Folded runs streamed from the backend: it appends `next` and the ids that
                // follow (argmax, or the device's sampler on the host sampler's own draws),
                // queueing run k+1 on the device while we handle run k here.
                let room = (ctx - self.cached.len()).min(p.max_tokens - generated.len());
                self.cached.push(next);
                history.push(next);
                let mut out = None;
                let cached = &mut self.cached;
                let mut last = next;
                let mut on_ids = |ids: &[u32]| {
                    for (i, &id) in ids.iter().enumerate() {
                        if let Some(r) = emit(id, &mut generated, &logprobs) {
                            out = Some(r);
                            // Ids after the stopping one were never shown: keep the cache to what was.
                            cached.extend_from_slice(&ids[..i]);
                            return false;
                        }
                    }
                    cached.extend_from_slice(ids);
                    last = *ids.last().expect("runs are non-empty");
                    true
                };
                let run = p.greedy_run.max(1);
                if greedy {
                    self.backend
                        .decode_greedy_stream(next, room, run, &eos_ids, &mut on_ids)?;
                } else {
                    let draws = sampler.draw_uniforms(room);
                    let spec = sampler.device_sampling(&history, &draws);
                    self.backend.decode_sampled_stream(
                        next,
                        room,
                        run,
                        &eos_ids,
                        &spec,
                        &mut on_ids,
                    )?;
                }
                if let Some(r) = out {
                    break r;
                }
                // The last id of the final run was never fed back: it is not in the cache.
                if self.cached.last() == Some(&last) && generated.last() == Some(&last) {
                    self.cached.pop();
                }
                if generated.len() >= p.max_tokens {
                    break FinishReason::Length;
                }
                break FinishReason::ContextFull;
            }
            let logits = self.backend.step(next)?;
            self.cached.push(next);
            history.push(next);
            next = pick(&mut sampler, constraint.as_mut(), &logits, &history)?;
            if let Some(k) = p.logprobs {
                logprobs.push(token_logprob(&logits, next, k));
            }
        };
        // The last entry belongs to an id never emitted (the loop ended before it): drop it.
        logprobs.truncate(generated.len());
        // The backend may hold ids past a stop string: keep the cache consistent with `cached`.
        if self.backend.position() != self.cached.len() {
            self.backend.truncate(self.cached.len())?;
        }
        if finish != FinishReason::Cancelled {
            // Held-back text, then entries of ids whose text never showed (a stop string's, a
            // skipped special token's at the end).
            let mut fresh = &logprobs[sent.min(logprobs.len())..];
            let tail = stop.finish();
            if !tail.is_empty() {
                on_text(&tail, std::mem::take(&mut fresh));
            }
            if let Some(t) = dec.flush() {
                if !t.is_empty() && stop.stopped().is_none() {
                    on_text(&t, std::mem::take(&mut fresh));
                }
            }
            if !fresh.is_empty() {
                on_text("", fresh);
            }
        }
        Ok(GenStats {
            prompt_tokens: prompt.len(),
            cached_tokens: common,
            generated,
            prompt_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
            finish,
            logprobs,
            prompt_logprobs,
        })
    }
}

/// The host's choice from one step's `logits`: the sampler's, among the ids `constraint` allows
/// (then moved past the choice). The row itself stays raw: logprobs read it unmasked.
pub(crate) fn pick(
    sampler: &mut Sampler,
    constraint: Option<&mut Constraint>,
    logits: &[f32],
    history: &[u32],
) -> Result<u32> {
    let Some(c) = constraint else {
        return Ok(sampler.sample(logits, history)?);
    };
    let mut masked = logits.to_vec();
    c.mask(&mut masked)?;
    let id = sampler.sample(&masked, history)?;
    c.commit(id)?;
    Ok(id)
}
