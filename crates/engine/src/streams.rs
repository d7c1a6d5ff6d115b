//! Requests on a multi-stream backend: each request owns one stream slot of the backend (its own
//! KV cache and position) and the backend advances every active slot in the same device run:
//! folded runs while every stream is greedy ([`Backend::streams_decode_greedy`]) or sampled by
//! settings the device samples ([`Backend::streams_queue_sampled`], fed each sampler's reserved
//! draws), else single steps returning logits ([`Backend::streams_step`]; each sampler, seeded
//! per request, picks the next id on the host). This module keeps a request's
//! text side (streaming UTF-8 decode, stop ids and strings, limits, sampling history) exactly as
//! [`crate::session::Session::generate`] does for one sequence, so a request's text is the same
//! whichever path served it.

use crate::grammar::Constraint;
use crate::logprobs::{token_logprob, TokenLogprob};
use crate::sampler::Sampler;
use crate::score;
use crate::session::{pick, FinishReason, GenParams, GenStats, OnText};
use crate::stop::StopChecker;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::Result;
use nibble_backend::{argmax, Backend, DeviceSampling};
use std::time::Instant;

/// One request bound to stream `slot`.
pub struct StreamSeq {
    pub slot: usize,
    /// `None`: greedy (the argmax; the backend may fold many steps into one run).
    sampler: Option<Sampler>,
    /// The prompt and every id produced: what penalties look at.
    history: Vec<u32>,
    dec: StreamDecoder,
    stop: StopChecker,
    generated: Vec<u32>,
    /// The id to feed next (the last one produced).
    next: u32,
    /// Ids in the slot's KV cache.
    pos: usize,
    context: usize,
    prompt_tokens: usize,
    /// Prompt positions reused from the slot's previous request.
    cached_tokens: usize,
    max_tokens: usize,
    prompt_secs: f64,
    t1: Instant,
    finish: Option<FinishReason>,
    /// Alternatives per token's logprob entry; `None`: no entries (see [`GenParams::logprobs`]).
    logprobs_k: Option<usize>,
    logprobs: Vec<TokenLogprob>,
    /// Entries of `logprobs` already handed out with a piece of text.
    sent: usize,
    /// The grammar the answer follows ([`GenParams::constraint`]), at the current id.
    constraint: Option<Constraint>,
    /// Each prompt token's entry after the first ([`GenParams::prompt_logprobs`]).
    prompt_logprobs: Vec<TokenLogprob>,
}

impl StreamSeq {
    /// Prefill `prompt` into `slot`, reusing its first `keep` cached positions (which the
    /// caller knows hold `prompt[..keep]`; `keep < prompt.len()`), and emit the first id. The
    /// caller checked the request as `Session::generate` does (non-empty prompt shorter than the
    /// context, ids in the vocabulary).
    pub fn start(
        backend: &mut dyn Backend,
        tok: &Tokenizer,
        slot: usize,
        keep: usize,
        prompt: &[u32],
        p: &GenParams,
        on_text: &mut OnText<'_>,
    ) -> Result<StreamSeq> {
        anyhow::ensure!(keep < prompt.len(), "at least one prompt token must be fed");
        // Logprobs and grammars need every step's logits: such a stream picks on the host,
        // greedy or not.
        let host_logits = p.logprobs.is_some() || p.constraint.is_some();
        let sampler =
            Some(Sampler::new(p.sampling.clone())?).filter(|s| !s.is_greedy() || host_logits);
        let t0 = Instant::now();
        // Prompt logprobs need every prompt row: nothing is reused then.
        let keep = if p.prompt_logprobs.is_some() { 0 } else { keep };
        let mut prompt_logprobs = Vec::new();
        let logits = match p.prompt_logprobs {
            Some(k) => {
                let mut last = Vec::new();
                backend.stream_prefill_rows(slot, 0, prompt, &mut |i, row| {
                    score::entry_or_last(prompt, i, row, k, &mut prompt_logprobs, &mut last);
                    Ok(())
                })?;
                last
            }
            None => backend.stream_prefill(slot, keep, &prompt[keep..])?,
        };
        let eos = backend.config().eos_token_ids.clone();
        let mut s = StreamSeq {
            slot,
            sampler,
            history: prompt.to_vec(),
            dec: tok.output_decoder(p.skip_special_tokens),
            stop: StopChecker::new(&eos, &p.stop_strings),
            generated: Vec::new(),
            next: 0,
            pos: prompt.len(),
            context: backend.context_len(),
            prompt_tokens: prompt.len(),
            cached_tokens: keep,
            max_tokens: p.max_tokens,
            prompt_secs: t0.elapsed().as_secs_f64(),
            t1: Instant::now(),
            finish: None,
            logprobs_k: p.logprobs,
            logprobs: Vec::new(),
            sent: 0,
            constraint: p.constraint.clone(),
            prompt_logprobs,
        };
        if p.max_tokens == 0 {
            // Only the prompt (scored, or echoed by the caller).
            s.finish = Some(FinishReason::Length);
            return Ok(s);
        }
        let first = s.choose(&logits)?;
        s.push(first, on_text);
        Ok(s)
    }

    /// Whether the next id is sampled on the host (each step must return logits).
    pub fn sampled(&self) -> bool {
        self.sampler.is_some()
    }

    /// The next id from `logits`: sampled, or the argmax (with its logprob entry if asked).
    fn choose(&mut self, logits: &[f32]) -> Result<u32> {
        let id = match &mut self.sampler {
            Some(s) => pick(s, self.constraint.as_mut(), logits, &self.history)?,
            None => argmax(logits),
        };
        if let Some(k) = self.logprobs_k {
            self.logprobs.push(token_logprob(logits, id, k));
        }
        Ok(id)
    }

    /// Whether each step's logits must come to the host (logprobs, a grammar), even where the
    /// device could sample these settings.
    pub fn needs_logits(&self) -> bool {
        self.logprobs_k.is_some() || self.constraint.is_some()
    }

    /// The logits a one-step run produced for this stream (fed `next_input()` at the current
    /// position): choose the next id and hand it to the text side.
    pub fn push_logits(&mut self, logits: &[f32], on_text: &mut OnText<'_>) -> Result<()> {
        self.pos += 1;
        if self.finished() {
            return Ok(());
        }
        let id = self.choose(logits)?;
        self.push(id, on_text);
        Ok(())
    }

    /// Whether the request has ended (its remaining run ids are ignored).
    pub fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// The id this stream is fed next, or `None` once finished.
    pub fn next_input(&self) -> Option<u32> {
        (!self.finished()).then_some(self.next)
    }

    /// Steps this stream can still take before its context is full.
    pub fn room(&self) -> usize {
        self.context - self.pos
    }

    /// Hand one produced id to the text side; the limits are checked after it.
    pub fn push(&mut self, id: u32, on_text: &mut OnText<'_>) {
        if self.finished() {
            return;
        }
        self.generated.push(id);
        self.history.push(id);
        self.next = id;
        let text = self.dec.push(id).unwrap_or_default();
        let step = self.stop.push(id, &text);
        if !step.text.is_empty() && !self.hand_out(&step.text, on_text) {
            self.finish = Some(FinishReason::Cancelled);
        } else if let Some(r) = step.stop {
            self.finish = Some(FinishReason::Stop(r));
        } else if self.generated.len() >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
        } else if self.room() == 0 {
            self.finish = Some(FinishReason::ContextFull);
        }
    }

    /// `n` draws of this stream's sampler reserved for a device that samples its next ids
    /// (see [`Sampler::draw_uniforms`]; the ids a run brings back consume them).
    pub fn device_draws(&mut self, n: usize) -> Vec<f64> {
        self.sampler
            .as_mut()
            .map_or_else(Vec::new, |s| s.draw_uniforms(n))
    }

    /// This stream's sampling as a device takes it, with its penalty history (prompt and
    /// every id so far); `None` for a greedy stream.
    pub fn device_sampling<'a>(&'a self, draws: &'a [f64]) -> Option<DeviceSampling<'a>> {
        self.sampler
            .as_ref()
            .map(|s| s.device_sampling(&self.history, draws))
    }

    /// The ids a run produced for this stream (fed `next_input()` at the current position);
    /// for a sampled stream, the device sampled them with the first of its reserved draws.
    pub fn push_run(&mut self, ids: &[u32], on_text: &mut OnText<'_>) {
        if let Some(s) = &mut self.sampler {
            s.consume_draws(ids.len());
        }
        // Each id took one step: the context fills at the step it does, not at the run's
        // first id (advancing by the whole run first ended a stream up to RUN - 2 ids short of
        // its room, the run's last ids dropped as past a full context).
        for &id in ids {
            self.pos += 1;
            self.push(id, on_text);
        }
    }

    /// Hand `text` to the caller with the entries not yet handed out.
    fn hand_out(&mut self, text: &str, on_text: &mut OnText<'_>) -> bool {
        let fresh = &self.logprobs[self.sent.min(self.logprobs.len())..];
        self.sent = self.logprobs.len();
        on_text(text, fresh)
    }

    /// Mark the request cancelled (its client went away).
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
    }

    /// End the request: flush held-back text (unless cancelled) and report.
    pub fn end(mut self, on_text: &mut OnText<'_>) -> GenStats {
        let finish = self.finish.clone().unwrap_or(FinishReason::Length);
        if finish != FinishReason::Cancelled {
            let tail = self.stop.finish();
            if !tail.is_empty() {
                self.hand_out(&tail, on_text);
            }
            if let Some(t) = self.dec.flush() {
                if !t.is_empty() && self.stop.stopped().is_none() {
                    self.hand_out(&t, on_text);
                }
            }
            // Entries of ids whose text never showed (a stop string's, a skipped special
            // token's at the end).
            if self.sent < self.logprobs.len() {
                self.hand_out("", on_text);
            }
        }
        GenStats {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            generated: self.generated,
            prompt_secs: self.prompt_secs,
            decode_secs: self.t1.elapsed().as_secs_f64(),
            finish,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
        }
    }
}
