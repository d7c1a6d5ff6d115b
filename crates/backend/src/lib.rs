//! The decoding seam: the [`Backend`] trait the engine drives, and the reference backend.
//!
//! A backend owns the weights it reads and one sequence's KV cache. It is chosen once at start-up
//! (`--backend ref|cpu|gpu`); the engine knows only this trait and never a model internal.
//!
//! Invariants every implementation keeps:
//! - `position()` is the number of tokens in the KV cache; every call that appends advances it by
//!   exactly the number of tokens appended, and a call that fails leaves it where it was.
//! - Logits are returned as `[V]` f32, V = `config().vocab_size`.
//! - Bad input (token id >= V, overflowing the context, an empty prefill) is an error, never a panic.
//!
//! [`reference`](mod@reference) holds [`RefBackend`], the oracle: a plain scalar forward pass
//! that every fast backend is judged against; [`divergence`] names the first intermediate where
//! two backends' [`Backend::trace_step`]s part.

pub mod divergence;
pub mod reference;

pub use nibble_model::config::Qwen3MoeConfig;
pub use reference::RefBackend;

/// Named intermediates of one step, in the order they were produced: `(name, values)` with the
/// oracle's trace names ([`reference::TRACE_NAMES`], per-layer ones as `l{layer}.{name}`).
pub type StepTrace = Vec<(String, Vec<f32>)>;

/// One layer of a traced prefill ([`Backend::trace_prefill`]): every prompt token's residual
/// stream after the layer and the experts it routed to.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillLayerTrace {
    /// `[tokens, H]`: the residual stream after the layer.
    pub h: Vec<f32>,
    /// `[tokens, K]`: each token's expert ids in rank order.
    pub experts: Vec<u32>,
}

/// GPU time of one kind of op over one decode step ([`Backend::profile_step`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The op, e.g. `"qkv matvec"`.
    pub op: String,
    /// How many times the step runs it (per layer ops: once per layer).
    pub calls: usize,
    /// Total GPU microseconds over the step.
    pub us: f64,
}

/// A decoding backend: chosen once at start-up (`--backend ref|cpu|gpu`); the engine knows only this trait.
pub trait Backend: Send {
    /// Short name, e.g. `"ref"`.
    fn name(&self) -> String;
    /// The model's hyper-parameters.
    fn config(&self) -> &Qwen3MoeConfig;
    /// KV cache capacity in positions.
    fn context_len(&self) -> usize;
    /// Tokens currently in the KV cache.
    fn position(&self) -> usize;
    /// Keep the first `pos` cached positions (0 = reset); `pos > position()` is an error.
    fn truncate(&mut self, pos: usize) -> anyhow::Result<()>;
    /// Append `tokens` at the current position (batched prompt processing) and return the logits
    /// `[V]` of the last one.
    fn prefill(&mut self, tokens: &[u32]) -> anyhow::Result<Vec<f32>>;
    /// Append one token and return its logits `[V]`.
    fn step(&mut self, token: u32) -> anyhow::Result<Vec<f32>> {
        self.prefill(&[token])
    }
    /// Append `tokens` as [`Backend::prefill`] does, handing the logits `[V]` after each of them
    /// to `row`: `row(i, logits)` is the model's distribution of the token that follows
    /// `tokens[..=i]` (scoring a text: perplexity, prompt logprobs). Rows come in order; a
    /// backend that redoes work after a fallback may hand a row again, and the last one holds.
    /// An error from `row` ends the call. Only rows from index `from` on are handed (a scorer
    /// that reads the later rows alone, as perplexity does, spares the others' lm_head). The
    /// default steps token by token (one step's logits per row); a fast backend reads the rows
    /// of its batched prefill instead.
    fn prefill_rows(
        &mut self,
        tokens: &[u32],
        from: usize,
        row: &mut RowSink<'_>,
    ) -> anyhow::Result<()> {
        let start = self.position();
        check_prompt(self.config().vocab_size, tokens, start, self.context_len())?;
        let run = rows_by_steps(tokens, from, row, &mut |t| self.step(t));
        if run.is_err() {
            // A failed call appends nothing (the trait's invariant).
            self.truncate(start)?;
        }
        run
    }
    /// [`Backend::prefill_rows`] (every row) for stream `slot`, keeping its first `start`
    /// positions as [`Backend::stream_prefill`] does. The default feeds the tokens one at a time; a failure
    /// may leave the stream past `start` (callers end the stream then).
    fn stream_prefill_rows(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
        row: &mut RowSink<'_>,
    ) -> anyhow::Result<()> {
        check_prompt(self.config().vocab_size, tokens, start, self.context_len())?;
        let mut pos = start;
        rows_by_steps(tokens, 0, row, &mut |t| {
            let logits = self.stream_prefill(slot, pos, &[t])?;
            pos += 1;
            Ok(logits)
        })
    }
    /// Multi-stream decode: how many independent sequences ("streams", each with its own KV
    /// cache slot and position, apart from the main sequence of `prefill`/`step`) one device run
    /// can decode together. 0: the backend has no multi-stream path.
    fn max_streams(&self) -> usize {
        0
    }
    /// Keep the first `start` positions of stream `slot` (< `max_streams()`; `start` at most
    /// what it holds: 0 resets it) and feed it `tokens`; returns the logits after the last one.
    fn stream_prefill(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
    ) -> anyhow::Result<Vec<f32>> {
        let _ = (slot, start, tokens);
        anyhow::bail!("{}: no multi-stream decode", self.name())
    }
    /// Greedy multi-stream decode: stream `i` is fed `tokens[i]` (`None`: stream `i` sits this
    /// run out) and produces up to `n` ids, stopping after an EOS id; all streams share each
    /// device run, so each weight is read once for all of them. Returns the ids per stream.
    /// Each stream's ids equal what single-stream greedy decoding of the same sequence gives.
    fn streams_decode_greedy(
        &mut self,
        tokens: &[Option<u32>],
        n: usize,
        eos: &[u32],
    ) -> anyhow::Result<Vec<Vec<u32>>> {
        let _ = (tokens, n, eos);
        anyhow::bail!("{}: no multi-stream decode", self.name())
    }
    /// Pipelined greedy multi-stream decode, part 1: record and submit one run of up to `n`
    /// steps without waiting. `restart = Some(tokens)` starts the streams from host-given ids
    /// as [`Backend::streams_decode_greedy`] does (every queued run must have been collected);
    /// `None` continues every live stream where the last queued run leaves it, on the device,
    /// so the host can queue run k+1 before it waits for run k. Returns the steps queued:
    /// fewer than `n` where a live stream's context would overflow, 0 when none is live.
    fn streams_queue(
        &mut self,
        restart: Option<&[Option<u32>]>,
        n: usize,
        eos: &[u32],
    ) -> anyhow::Result<usize> {
        let _ = (restart, n, eos);
        anyhow::bail!("{}: no multi-stream decode", self.name())
    }
    /// Whether [`Backend::streams_queue_sampled`] takes a stream sampled by `spec`.
    fn streams_sample_on_device(&self, spec: &DeviceSampling<'_>) -> bool {
        let _ = spec;
        false
    }
    /// [`Backend::streams_queue`]'s restart where stream `s`'s ids are sampled on the device
    /// by `specs[s]` (`None`, and streams past `specs`: the argmax; `uniforms`: a draw per
    /// step the stream may take, its room in the context, used in order);
    /// `streams_queue(None, ..)` continues the runs and [`Backend::streams_collect`] returns
    /// the ids, as for greedy runs.
    fn streams_queue_sampled(
        &mut self,
        restart: &[Option<u32>],
        n: usize,
        eos: &[u32],
        specs: &[Option<&DeviceSampling<'_>>],
    ) -> anyhow::Result<usize> {
        let _ = (restart, n, eos, specs);
        anyhow::bail!("{}: no multi-stream device sampling", self.name())
    }
    /// Part 2: wait for the oldest queued run (later ones keep running) and return its ids per
    /// stream, as [`Backend::streams_decode_greedy`] does; `None` when no run is queued.
    fn streams_collect(&mut self) -> anyhow::Result<Option<Vec<Vec<u32>>>> {
        anyhow::bail!("{}: no multi-stream decode", self.name())
    }
    /// Part 3: stream `slot` sits out the runs queued from now on (its request ended on the
    /// host); the runs already queued still advance it, and their ids for it are to be ignored.
    fn streams_end(&mut self, slot: usize) -> anyhow::Result<()> {
        let _ = slot;
        anyhow::bail!("{}: no multi-stream decode", self.name())
    }
    /// One step for every stream `i` with `tokens[i] = Some(t)` (fed `t` at its position), all
    /// in one device run; returns each fed stream's logits `[V]` (`None` for the others). The
    /// multi-stream path for streams whose next id the host chooses (sampling): the host waits
    /// on every step, where [`Backend::streams_decode_greedy`] folds many.
    fn streams_step(&mut self, tokens: &[Option<u32>]) -> anyhow::Result<Vec<Option<Vec<f32>>>> {
        let _ = tokens;
        anyhow::bail!("{}: no multi-stream decode", self.name())
    }
    /// The device's plain read bandwidth in GB/s, measured now (a benchmark puts its implied
    /// weight-streaming rate against it). `Ok(None)`: the backend has no such probe.
    fn read_bandwidth_gbps(&mut self) -> anyhow::Result<Option<f64>> {
        Ok(None)
    }
    /// Diagnostics: the GPU time of every op of one greedy decode step at the current position,
    /// recorded the fast path's way with a timestamp after each op (the median step of `reps`),
    /// in the order the step first runs them. Nothing is appended (a KV row past the position may
    /// be written, as a later step overwrites it). `Ok(None)`: not supported by this backend.
    fn profile_step(&mut self, reps: usize) -> anyhow::Result<Option<Vec<OpTime>>> {
        let _ = reps;
        Ok(None)
    }
    /// Diagnostics: GPU time per op kind of prefilling `tokens` (one chunk) from position 0,
    /// which it leaves at `tokens.len()`. The default, `Ok(None)`: not supported.
    fn profile_prefill(&mut self, tokens: &[u32]) -> anyhow::Result<Option<Vec<OpTime>>> {
        let _ = tokens;
        Ok(None)
    }
    /// Diagnostics: append `token` like [`Backend::step`] and return the named intermediates of
    /// that step (a backend exposes the subset it can read back, under the oracle's names), so
    /// a parity tool can name the first op where two backends diverge. The slow path. The
    /// default, `Ok(None)`, means tracing is not supported and nothing was appended.
    fn trace_step(&mut self, token: u32) -> anyhow::Result<Option<StepTrace>> {
        let _ = token;
        Ok(None)
    }
    /// Diagnostics: prefill `tokens` from position 0 on the batched path a prompt of that
    /// length takes, one layer per submit, and return per layer every token's residual stream
    /// and experts (a parity tool compares them with the oracle's per-token traces to find
    /// the first token and layer where a batched prefill departs). Leaves the position at
    /// `tokens.len()`. The default, `Ok(None)`: not supported (nothing was appended).
    fn trace_prefill(&mut self, tokens: &[u32]) -> anyhow::Result<Option<Vec<PrefillLayerTrace>>> {
        let _ = tokens;
        Ok(None)
    }

    /// Greedy run: append `token`, then repeatedly append the argmax, producing up to `n` new ids;
    /// stops after (and including) the first id in `eos`. The last returned id is *not* appended
    /// (it has no logits to compute yet), so the position advances by the number of ids returned.
    /// `n == 0` appends nothing. Fast backends fold this into one GPU submission.
    fn decode_greedy(&mut self, token: u32, n: usize, eos: &[u32]) -> anyhow::Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n.min(self.context_len()));
        let mut cur = token;
        for _ in 0..n {
            let next = argmax(&self.step(cur)?);
            out.push(next);
            if eos.contains(&next) {
                break;
            }
            cur = next;
        }
        Ok(out)
    }

    /// Streaming greedy decode: the ids of `decode_greedy(token, n, eos)`, handed to `on_ids` in
    /// runs of up to `run` ids as soon as each run is known; `on_ids` returning `false` stops.
    /// Returns how many ids were produced. Fast backends keep the next run queued on the device
    /// while the host handles the previous one, so they may have appended (at most one run)
    /// past an early stop: callers compare `position()` with what they kept and `truncate`.
    fn decode_greedy_stream(
        &mut self,
        token: u32,
        n: usize,
        run: usize,
        eos: &[u32],
        on_ids: &mut dyn FnMut(&[u32]) -> bool,
    ) -> anyhow::Result<usize> {
        let mut produced = 0;
        let mut cur = token;
        while produced < n {
            let ids = self.decode_greedy(cur, run.max(1).min(n - produced), eos)?;
            produced += ids.len();
            let Some(&last) = ids.last() else { break };
            if !on_ids(&ids) || eos.contains(&last) {
                break;
            }
            cur = last;
        }
        Ok(produced)
    }

    /// Whether [`Backend::decode_sampled_stream`] takes `spec` (the device samples these
    /// settings); `false` by default: the caller samples on the host from each step's logits.
    fn samples_on_device(&self, spec: &DeviceSampling<'_>) -> bool {
        let _ = spec;
        false
    }

    /// Sampled decode folded like [`Backend::decode_greedy_stream`]: append `token`, then
    /// repeatedly append the id the device samples by `spec` (step `i` uses `spec.uniforms[i]`,
    /// so `spec.uniforms` holds at least `n` draws when `temperature > 0`), handing the ids to
    /// `on_ids` in runs of up to `run`; the same ids the host sampler gives on the same logits
    /// with the same draws. Only where [`Backend::samples_on_device`] holds.
    fn decode_sampled_stream(
        &mut self,
        token: u32,
        n: usize,
        run: usize,
        eos: &[u32],
        spec: &DeviceSampling<'_>,
        on_ids: &mut dyn FnMut(&[u32]) -> bool,
    ) -> anyhow::Result<usize> {
        let _ = (token, n, run, eos, spec, on_ids);
        anyhow::bail!("{}: no device sampling", self.name())
    }
}

/// What [`Backend::prefill_rows`] hands each row to: `(index in the tokens, logits [V])`.
pub type RowSink<'a> = dyn FnMut(usize, &[f32]) -> anyhow::Result<()> + 'a;

/// [`Backend::prefill_rows`] one step at a time: `step(t)` appends `t` and returns its logits;
/// rows from `from` on are handed. Fast backends fall back to it where their batched path is off.
pub fn rows_by_steps(
    tokens: &[u32],
    from: usize,
    row: &mut RowSink<'_>,
    step: &mut dyn FnMut(u32) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<()> {
    for (i, &t) in tokens.iter().enumerate() {
        let logits = step(t)?;
        if i >= from {
            row(i, &logits)?;
        }
    }
    Ok(())
}

/// The one check every backend makes on a token id: it must index the vocabulary of `vocab`.
pub fn check_token(vocab: usize, id: u32) -> anyhow::Result<()> {
    anyhow::ensure!(
        (id as usize) < vocab,
        "token id {id} is outside the vocabulary of {vocab} tokens"
    );
    Ok(())
}

/// The checks every backend makes before appending `tokens` at position `pos` of a context of
/// `ctx` positions (`pos <= ctx`): not empty, every id in the vocabulary, and room for all.
pub fn check_prompt(vocab: usize, tokens: &[u32], pos: usize, ctx: usize) -> anyhow::Result<()> {
    anyhow::ensure!(!tokens.is_empty(), "prefill of an empty token list");
    for t in tokens {
        check_token(vocab, *t)?;
    }
    anyhow::ensure!(
        tokens.len() <= ctx.saturating_sub(pos),
        "prompt of {} tokens at position {pos} exceeds the context of {ctx}",
        tokens.len()
    );
    Ok(())
}

/// First index of the largest value; NaN never wins. Returns 0 for an empty or all-NaN slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        // Strictly greater: on ties the earlier index stays.
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// A sampled request handed to a backend that samples on the device
/// ([`Backend::decode_sampled_stream`]): the host sampler's settings (nibble_engine::sampler
/// documents the rule) and the inputs only the host has.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSampling<'a> {
    /// `<= 0`: greedy on the penalised row (no draw).
    pub temperature: f32,
    /// Candidates kept, `>= 1` (device samplers keep at most [`DEVICE_TOP_K_MAX`]).
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `(id, bias)` added to the raw logits (the host sampler's rule); no device sampler
    /// adds one yet, so a non-empty bias is outside [`DeviceSampling::in_device_range`].
    pub logit_bias: &'a [(u32, f32)],
    /// The ids the penalties count before the first step, the fed token included; each id the
    /// device picks is counted for the steps after it.
    pub history: &'a [u32],
    /// One uniform draw in `[0, 1)` per step (the host sampler's RNG, in its order); unused
    /// when `temperature <= 0`.
    pub uniforms: &'a [f64],
}

/// Largest top-k a device sampler handles (the host sampler's streamed top-k bound).
pub const DEVICE_TOP_K_MAX: usize = 256;

impl DeviceSampling<'_> {
    /// Whether the settings are in the range device samplers take: `1 <= top_k <= 256` (or
    /// greedy), finite penalties, `0 < top_p <= 1`, `0 <= min_p <= 1`, no logit bias.
    pub fn in_device_range(&self) -> bool {
        self.logit_bias.is_empty()
            && (self.temperature <= 0.0 || (1..=DEVICE_TOP_K_MAX).contains(&self.top_k))
            && self.temperature.is_finite()
            && self.top_p > 0.0
            && self.top_p <= 1.0
            && (0.0..=1.0).contains(&self.min_p)
            && self.repetition_penalty.is_finite()
            && self.repetition_penalty > 0.0
            && self.presence_penalty.is_finite()
            && self.frequency_penalty.is_finite()
    }

    /// Whether any penalty is active.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}
