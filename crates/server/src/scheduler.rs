//! The engine worker: one thread that owns the [`Session`] and serves requests in arrival order.
//!
//! HTTP handlers hand validated requests ([`Job`]s) to the worker through a bounded queue
//! ([`Queue`], `--queue` slots); a full queue is answered 429 at once. Each job carries an unbounded
//! channel back to its handler on which the worker sends text pieces and a final [`Event::Done`].
//! When the handler goes away (the client disconnected), sending fails, the session's callback
//! returns `false` and generation stops at the next piece of text: the worker moves on at once.
//!
//! The loop is shaped like nano-vllm's `schedule -> run -> postprocess`, with explicit per-step
//! inputs:
//! * [`Scheduler::schedule`] admits queued jobs until `max_streams` are admitted (blocking only when
//!   none is) and returns a [`Step`]: the admitted sequences;
//! * `Worker::run` advances them. On a multi-stream backend (`Backend::max_streams() > 0`, the
//!   GPU with `--max-streams`), every admitted request gets a stream slot (prefilled when it
//!   joins) and ONE device run advances all of them together (continuous batching: a request
//!   that arrives mid-run joins at the next run, a finished or cancelled one frees its slot at
//!   once): a folded run of up to [`RUN`] tokens while every stream is greedy or sampled by
//!   settings the backend samples on the device (fed each request sampler's reserved draws),
//!   else one step returning each stream's logits (the sampled streams pick on the host, the
//!   greedy ones take the argmax). On a backend without streams each request
//!   runs alone on the main sequence from prompt to end (with prefix reuse);
//! * `Worker::postprocess` sends the final events, retires finished sequences and updates metrics.
//!
//! `--max-streams` bounds how many requests are admitted at once (the `nibble_active_streams`
//! gauge) and, with `--queue`, how many are held at all (`max_streams + queue`).

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::protocol::Usage;
use nibble_engine::session::{FinishReason, GenParams, GenStats, Session};
use nibble_engine::streams::StreamSeq;
use nibble_engine::{TokenLogprob, Tokenizer};
use rayon::prelude::*;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// Tokens per multi-stream device run: small, so a request that arrives mid-run waits little,
/// and measured on the H200 to cost nothing against longer runs (docs/BENCHMARKS.md, fold sweep).
pub const RUN: usize = 4;

/// Greedy runs queued on the device at once: the host records run k+1 while the GPU works
/// through run k.
pub const IN_FLIGHT: usize = 2;

/// What the worker tells a handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A piece of generated text (complete UTF-8, stop strings already removed) and, when asked,
    /// the logprob entries of the ids produced since the previous piece (see
    /// [`nibble_engine::session::OnText`]: the text of the last piece may be empty).
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Generation ended normally; `logprobs` holds an entry per generated id if asked,
    /// `prompt_logprobs` one per prompt token after the first if asked.
    Done {
        finish: &'static str,
        usage: Usage,
        logprobs: Vec<TokenLogprob>,
        prompt_logprobs: Vec<TokenLogprob>,
    },
    /// Generation failed inside the engine.
    Error(String),
}

/// Where a request's engine output goes: its handler's event channel (`false` once the
/// handler is gone, which cancels generation).
fn text_sink(events: &UnboundedSender<Event>) -> impl FnMut(&str, &[TokenLogprob]) -> bool + '_ {
    |t, lp| {
        let ev = Event::Text {
            text: t.to_owned(),
            logprobs: lp.to_vec(),
        };
        events.send(ev).is_ok()
    }
}

/// One validated request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub gen: GenParams,
    pub events: UnboundedSender<Event>,
}

/// The handlers' end of the bounded queue.
#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Job>,
    capacity: usize,
    /// Jobs sent and not yet taken by the worker (it decrements on taking one): slots are
    /// reserved here first, so a request's jobs enter all together or not at all.
    pending: Arc<AtomicUsize>,
    metrics: Metrics,
}

impl Queue {
    /// Enqueues without waiting: 429 when all slots are taken, 503 when the worker is gone.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.submit_all(vec![job])
    }

    /// Enqueues every job of one request (its `n` choices) or none: 400 when they could never
    /// fit the queue, 429 when its free slots are fewer, 503 when the worker is gone.
    pub fn submit_all(&self, jobs: Vec<Job>) -> Result<(), ApiError> {
        let n = jobs.len();
        if n > self.capacity {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "n = {n} choices exceed this server's queue of {} (serve --queue)",
                    self.capacity
                ),
            ));
        }
        let reserved = self
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                (p + n <= self.capacity).then_some(p + n)
            });
        if reserved.is_err() {
            return Err(ApiError::queue_full(self.capacity));
        }
        for (i, job) in jobs.into_iter().enumerate() {
            // Count first so the worker's decrement can never run before the increment.
            self.metrics.queue_depth.inc();
            if let Err(e) = self.tx.try_send(job) {
                // Only a stopped worker fails here: the reservation left room for every job.
                self.metrics.queue_depth.dec();
                self.pending.fetch_sub(n - i, Ordering::AcqRel);
                return Err(match e {
                    TrySendError::Full(_) => ApiError::queue_full(self.capacity),
                    TrySendError::Disconnected(_) => {
                        ApiError::unavailable("the engine worker has stopped")
                    }
                });
            }
        }
        Ok(())
    }
}

/// An admitted sequence.
struct Seq {
    job: Job,
    /// Set once the request decodes on a multi-stream slot.
    stream: Option<StreamSeq>,
    /// Why this request's own step failed (its grammar, its sampler): it alone ends with the
    /// error; the others in the run go on.
    failed: Option<String>,
}

/// Admission: the queue's consuming end plus the admitted sequences, oldest first.
pub struct Scheduler {
    rx: Receiver<Job>,
    running: VecDeque<Seq>,
    max_streams: usize,
    metrics: Metrics,
    /// The queue's count of jobs not yet taken ([`Queue`]).
    pending: Arc<AtomicUsize>,
}

/// One step's explicit input: indices into the admitted sequences to advance, oldest first.
#[derive(Debug, PartialEq, Eq)]
pub struct Step {
    pub seqs: Vec<usize>,
}

impl Scheduler {
    fn admit(&mut self, job: Job) {
        self.metrics.queue_depth.dec();
        self.pending.fetch_sub(1, Ordering::AcqRel);
        // A client that left while queued costs nothing.
        if job.events.is_closed() {
            return;
        }
        self.running.push_back(Seq {
            job,
            stream: None,
            failed: None,
        });
    }

    /// Tops the admitted set up to `max_streams` and picks what to advance. Blocks while nothing is
    /// admitted; `None` once the queue is closed and everything is done.
    pub fn schedule(&mut self) -> Option<Step> {
        while self.running.len() < self.max_streams {
            let next = if self.running.is_empty() {
                self.rx.recv().ok()
            } else {
                // Empty or closed: run what is admitted.
                self.rx.try_recv().ok()
            };
            match next {
                Some(job) => self.admit(job),
                None if self.running.is_empty() => return None,
                None => break,
            }
            // Admission may have dropped a cancelled job; keep waiting for a live one.
        }
        self.metrics.active_streams.set(self.running.len() as i64);
        Some(Step {
            seqs: (0..self.running.len()).collect(),
        })
    }
}

/// The result of advancing one sequence.
struct SeqOutput {
    index: usize,
    result: Result<GenStats, String>,
}

/// Owns the session and runs steps.
pub struct Worker {
    session: Session,
    tok: Tokenizer,
    metrics: Metrics,
    /// Multi-stream slots taken (empty when the backend has none).
    slots: Vec<bool>,
    /// The ids each slot's KV cache holds (for prefix reuse by the next request there).
    slot_ids: Vec<Vec<u32>>,
    /// Greedy multi-stream runs queued on the device and not collected.
    in_flight: usize,
}

impl Worker {
    /// Advances the sequences of `step`: each on a stream slot, one device run for all of them;
    /// without stream slots, the oldest one alone from prompt to end.
    ///
    /// Greedy runs are pipelined: up to [`IN_FLIGHT`] runs are queued on the device, run k+1
    /// continuing the streams where run k leaves them, so the host records while the GPU
    /// works. A join (its prefill) and a one-step run for a sampled stream rewrite the device's
    /// columns, so they first collect every queued run; the next greedy run restarts from the
    /// ids the host holds.
    fn run(&mut self, sched: &mut Scheduler, step: &Step) -> Vec<SeqOutput> {
        if self.slots.is_empty() {
            return self.run_alone(sched, step.seqs.iter().copied().take(1));
        }
        let mut out = Vec::new();
        for seq in sched.running.iter_mut() {
            if let Some(s) = seq.stream.as_mut() {
                if seq.job.events.is_closed() {
                    s.cancel();
                }
            }
        }
        let joining = sched.running.iter().any(|q| q.stream.is_none())
            && self.slots.iter().any(|taken| !taken);
        let sampled = sched.running.iter().any(|q| {
            q.stream
                .as_ref()
                .is_some_and(|s| s.sampled() && !s.finished())
        });
        // Sampled streams whose settings the device samples (every live one) fold into
        // pipelined runs like greedy ones, sampled on the GPU; queued runs go on unless a
        // request joins or a sampled stream needs the host.
        if joining || (sampled && !self.all_sampled_on_device(sched)) {
            if let Err(msg) = self.drain(sched) {
                return self.fail_streams(sched, msg, out);
            }
        }
        // Join: waiting requests take free slots (prefill now).
        for &index in &step.seqs {
            let seq = &mut sched.running[index];
            if seq.stream.is_some() {
                continue;
            }
            // A client that left while its request waited for a slot costs no prefill.
            if seq.job.events.is_closed() {
                out.push(SeqOutput {
                    index,
                    result: Err("the client went away".to_owned()),
                });
                continue;
            }
            // The free slot whose cached ids share the longest prefix with the prompt (a
            // follow-up chat turn lands where its conversation is cached).
            let prompt = &seq.job.prompt;
            let common = |c: &Vec<u32>| {
                c.iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(prompt.len().saturating_sub(1))
            };
            let Some((slot, keep)) = (0..self.slots.len())
                .filter(|s| !self.slots[*s])
                .map(|s| (s, common(&self.slot_ids[s])))
                .max_by_key(|(s, k)| (*k, std::cmp::Reverse(*s)))
            else {
                break;
            };
            let events = seq.job.events.clone();
            let started = catch_unwind(AssertUnwindSafe(|| {
                StreamSeq::start(
                    self.session.backend_mut(),
                    &self.tok,
                    slot,
                    keep,
                    &seq.job.prompt,
                    &seq.job.gen,
                    &mut text_sink(&events),
                )
            }));
            match started {
                Ok(Ok(s)) => {
                    self.slots[slot] = true;
                    seq.stream = Some(s);
                }
                Ok(Err(e)) => {
                    self.slot_ids[slot].clear();
                    out.push(SeqOutput {
                        index,
                        result: Err(format!("generation failed: {e:#}")),
                    })
                }
                Err(_) => {
                    self.slot_ids[slot].clear();
                    out.push(SeqOutput {
                        index,
                        result: Err("generation failed: the engine panicked".to_owned()),
                    })
                }
            }
        }
        // One device run for every live stream.
        let mut inputs = vec![None; self.slots.len()];
        let mut sampled = false;
        for seq in sched.running.iter() {
            if let Some(s) = seq.stream.as_ref() {
                if let Some(t) = s.next_input() {
                    inputs[s.slot] = Some(t);
                    sampled |= s.sampled();
                }
            }
        }
        if inputs.iter().any(Option::is_some) || self.in_flight > 0 {
            // After a join the queued runs were collected, so the run restarts with the
            // joined streams on the device too.
            let advanced = if sampled && self.all_sampled_on_device(sched) {
                self.step_runs(sched, &inputs, true)
            } else if sampled {
                self.step_sampled(sched, &inputs)
            } else {
                self.step_greedy(sched, &inputs)
            };
            if let Err(msg) = advanced {
                return self.fail_streams(sched, msg, out);
            }
        }
        // Leave: finished streams report and free their slots.
        for (index, seq) in sched.running.iter_mut().enumerate() {
            if seq.stream.as_ref().is_some_and(|s| s.finished()) {
                let s = seq.stream.take().expect("checked above");
                let slot = s.slot;
                self.slots[slot] = false;
                if self.in_flight > 0 {
                    // Runs after the ones queued leave the slot alone.
                    let _ = self.session.backend_mut().streams_end(slot);
                }
                if let Some(msg) = seq.failed.take() {
                    self.slot_ids[slot].clear();
                    out.push(SeqOutput {
                        index,
                        result: Err(msg),
                    });
                    continue;
                }
                let events = &seq.job.events;
                let stats = s.end(&mut text_sink(events));
                // What the slot's KV rows hold from position 0: the prompt and every id fed
                // back (all generated ids but the last); queued runs write only past them.
                let fed = stats.generated.len().saturating_sub(1);
                self.slot_ids[slot] = seq.job.prompt.clone();
                self.slot_ids[slot].extend_from_slice(&stats.generated[..fed]);
                out.push(SeqOutput {
                    index,
                    result: Ok(stats),
                });
            }
        }
        out
    }

    /// Calls `f` inside `catch_unwind`, turning an error or a panic into the message every
    /// stream of the run ends with.
    fn guarded<T>(
        &mut self,
        f: impl FnOnce(&mut dyn nibble_backend::Backend) -> anyhow::Result<T>,
    ) -> Result<T, String> {
        let backend = self.session.backend_mut();
        match catch_unwind(AssertUnwindSafe(|| f(backend))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("generation failed: {e:#}")),
            Err(_) => Err("generation failed: the engine panicked".to_owned()),
        }
    }

    /// Hand one collected run's ids to the streams of its slots (ids of ended slots are dropped).
    fn push_ids(sched: &mut Scheduler, ids: &[Vec<u32>]) {
        for seq in sched.running.iter_mut() {
            let Some(s) = seq.stream.as_mut() else {
                continue;
            };
            if let Some(v) = ids.get(s.slot).filter(|v| !v.is_empty()) {
                let events = &seq.job.events;
                s.push_run(v, &mut text_sink(events));
            }
        }
    }

    /// Collect every queued greedy run into its streams.
    fn drain(&mut self, sched: &mut Scheduler) -> Result<(), String> {
        while self.in_flight > 0 {
            self.collect_one(sched)?;
        }
        Ok(())
    }

    /// Wait for the oldest queued greedy run and hand its ids to the streams.
    fn collect_one(&mut self, sched: &mut Scheduler) -> Result<(), String> {
        let ids = self.guarded(|b| b.streams_collect())?;
        self.in_flight -= 1;
        if let Some(ids) = ids {
            Self::push_ids(sched, &ids);
        }
        Ok(())
    }

    /// One step returning logits for every fed stream (a sampled one is among them).
    fn step_sampled(
        &mut self,
        sched: &mut Scheduler,
        inputs: &[Option<u32>],
    ) -> Result<(), String> {
        let logits = self.guarded(|b| b.streams_step(inputs))?;
        // Each stream samples from its own [V] logits (a top-k selection or a sort over the
        // vocabulary, milliseconds each): in parallel, so the step waits for one, not all.
        sched
            .running
            .par_iter_mut()
            .map(|seq| {
                let Some(s) = seq.stream.as_mut() else {
                    return Ok(());
                };
                if inputs[s.slot].is_none() {
                    return Ok(());
                }
                let Some(l) = &logits[s.slot] else {
                    return Err("generation failed: a stream got no logits".to_owned());
                };
                let events = &seq.job.events;
                // A request's own failure (a grammar error, a panic inside its grammar or
                // sampler) ends that request alone.
                let pushed = catch_unwind(AssertUnwindSafe(|| {
                    s.push_logits(l, &mut text_sink(events))
                }));
                let failed = match pushed {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(format!("generation failed: {e:#}")),
                    Err(_) => Some("generation failed: the request's sampler panicked".to_owned()),
                };
                if failed.is_some() {
                    s.cancel();
                    seq.failed = failed;
                }
                Ok(())
            })
            .collect()
    }

    /// Keep [`IN_FLIGHT`] greedy runs of [`RUN`] steps queued (restarting from the host's ids
    /// when none is) and collect the oldest.
    fn step_greedy(&mut self, sched: &mut Scheduler, inputs: &[Option<u32>]) -> Result<(), String> {
        self.step_runs(sched, inputs, false)
    }

    /// [`Self::step_greedy`], the restart handing the device each sampled stream's settings,
    /// penalty history and reserved draws (one per step of its room) where `on_device`; the
    /// greedy streams take the argmax either way.
    fn step_runs(
        &mut self,
        sched: &mut Scheduler,
        inputs: &[Option<u32>],
        on_device: bool,
    ) -> Result<(), String> {
        let eos = self.session.backend().config().eos_token_ids.clone();
        if self.in_flight == 0 {
            let queued = if on_device {
                let mut draws = vec![Vec::new(); inputs.len()];
                for s in sched.running.iter_mut().filter_map(|q| q.stream.as_mut()) {
                    if inputs.get(s.slot).is_some_and(Option::is_some) && s.sampled() {
                        draws[s.slot] = s.device_draws(s.room());
                    }
                }
                let mut specs = vec![None; inputs.len()];
                for s in sched.running.iter().filter_map(|q| q.stream.as_ref()) {
                    if inputs.get(s.slot).is_some_and(Option::is_some) {
                        specs[s.slot] = s.device_sampling(&draws[s.slot]);
                    }
                }
                let refs: Vec<_> = specs.iter().map(Option::as_ref).collect();
                self.guarded(|b| b.streams_queue_sampled(inputs, RUN, &eos, &refs))?
            } else {
                self.guarded(|b| b.streams_queue(Some(inputs), RUN, &eos))?
            };
            if queued == 0 {
                return Err("generation failed: no stream has room left in its context".into());
            }
            self.in_flight = 1;
        }
        while self.in_flight < IN_FLIGHT {
            if self.guarded(|b| b.streams_queue(None, RUN, &eos))? == 0 {
                break;
            }
            self.in_flight += 1;
        }
        self.collect_one(sched)
    }

    /// Whether the backend samples every live sampled stream's settings on the device.
    fn all_sampled_on_device(&self, sched: &Scheduler) -> bool {
        let backend = self.session.backend();
        sched
            .running
            .iter()
            .filter_map(|q| q.stream.as_ref().filter(|s| !s.finished()))
            .all(|s| {
                !s.needs_logits()
                    && s.device_sampling(&[])
                        .is_none_or(|sp| backend.streams_sample_on_device(&sp))
            })
    }

    /// The run failed: every stream in it ends with `msg` (their slots are freed and forgotten,
    /// queued runs dropped).
    fn fail_streams(
        &mut self,
        sched: &mut Scheduler,
        msg: String,
        mut out: Vec<SeqOutput>,
    ) -> Vec<SeqOutput> {
        // Whatever is still queued is waited for and discarded.
        while self.in_flight > 0 {
            self.in_flight -= 1;
            let _ = self.guarded(|b| b.streams_collect());
        }
        for (index, seq) in sched.running.iter_mut().enumerate() {
            if let Some(s) = seq.stream.take() {
                self.slots[s.slot] = false;
                self.slot_ids[s.slot].clear();
                out.push(SeqOutput {
                    index,
                    result: Err(msg.clone()),
                });
            }
        }
        out
    }

    /// Advances each of `seqs` from its prompt to its end on the main sequence, in order.
    fn run_alone(
        &mut self,
        sched: &Scheduler,
        seqs: impl Iterator<Item = usize>,
    ) -> Vec<SeqOutput> {
        seqs.map(|index| {
            let job = &sched.running[index].job;
            let events = &job.events;
            // A client that left while its request waited for its turn costs nothing (a
            // scored prompt emits no text, so generation would not notice).
            if events.is_closed() {
                return SeqOutput {
                    index,
                    result: Err("the client went away".to_owned()),
                };
            }
            let session = &mut self.session;
            let tok = &self.tok;
            let out = catch_unwind(AssertUnwindSafe(|| {
                session.generate(tok, &job.prompt, &job.gen, &mut text_sink(events))
            }));
            let result = match out {
                Ok(Ok(stats)) => Ok(stats),
                Ok(Err(e)) => Err(format!("generation failed: {e:#}")),
                Err(_) => {
                    // The cache may be inconsistent after a panic: forget it.
                    let _ = catch_unwind(AssertUnwindSafe(|| self.session.reset()));
                    Err("generation failed: the engine panicked".to_owned())
                }
            };
            SeqOutput { index, result }
        })
        .collect()
    }

    /// Reports results, retires finished sequences, updates metrics.
    fn postprocess(&mut self, sched: &mut Scheduler, outputs: Vec<SeqOutput>) {
        // Highest index first so removals do not shift the ones still to come.
        let mut outputs = outputs;
        outputs.sort_by_key(|o| std::cmp::Reverse(o.index));
        for o in outputs {
            let Some(seq) = sched.running.remove(o.index) else {
                continue;
            };
            // Before the final event: a client that reads /metrics right after its answer
            // must not still count its own request as active.
            self.metrics.active_streams.set(sched.running.len() as i64);
            let stats = match o.result {
                Ok(s) => s,
                Err(msg) => {
                    let _ = seq.job.events.send(Event::Error(msg));
                    continue;
                }
            };
            let m = &self.metrics;
            m.prompt_tokens.inc_by(stats.prompt_tokens as u64);
            m.cached_tokens.inc_by(stats.cached_tokens as u64);
            m.generated_tokens.inc_by(stats.generated.len() as u64);
            if stats.generated.len() >= 2 {
                m.decode_tps.set(stats.decode_tps());
            }
            let finish = match stats.finish {
                FinishReason::Stop(_) => "stop",
                FinishReason::Length | FinishReason::ContextFull => "length",
                FinishReason::Cancelled => continue,
            };
            let usage = Usage {
                prompt_tokens: stats.prompt_tokens,
                completion_tokens: stats.generated.len(),
                cached_tokens: stats.cached_tokens,
            };
            let _ = seq.job.events.send(Event::Done {
                finish,
                usage,
                logprobs: stats.logprobs,
                prompt_logprobs: stats.prompt_logprobs,
            });
        }
        self.metrics.active_streams.set(sched.running.len() as i64);
    }
}

/// Starts the worker thread; returns the queue handlers submit to. The thread ends when every
/// [`Queue`] clone is dropped and the admitted jobs are done.
pub fn spawn(
    session: Session,
    tok: Tokenizer,
    max_streams: usize,
    queue: usize,
    metrics: Metrics,
) -> std::io::Result<(Queue, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::sync_channel(queue.max(1));
    let pending = Arc::new(AtomicUsize::new(0));
    let mut sched = Scheduler {
        rx,
        running: VecDeque::new(),
        max_streams: max_streams.max(1),
        metrics: metrics.clone(),
        pending: Arc::clone(&pending),
    };
    let slots = vec![false; session.backend().max_streams().min(max_streams.max(1))];
    let mut worker = Worker {
        session,
        tok,
        metrics: metrics.clone(),
        slot_ids: vec![Vec::new(); slots.len()],
        slots,
        in_flight: 0,
    };
    let handle = std::thread::Builder::new()
        .name("nibble-engine".into())
        .spawn(move || {
            while let Some(step) = sched.schedule() {
                let out = worker.run(&mut sched, &step);
                worker.postprocess(&mut sched, out);
            }
        })?;
    let q = Queue {
        tx,
        capacity: queue.max(1),
        pending,
        metrics,
    };
    Ok((q, handle))
}
