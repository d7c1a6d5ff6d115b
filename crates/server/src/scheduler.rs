//! The engine worker: one thread that owns the [`Session`] and serves requests in arrival order.
//!
//! HTTP handlers hand validated requests ([`Job`]s) to the worker through a bounded queue
//! ([`Queue`], `--queue` slots); a full queue is answered 429 at once. Each job carries an unbounded
//! channel back to its handler on which the worker sends text pieces and a final [`Event::Done`].
//! When the handler goes away (the client disconnected), sending fails, the session's callback
//! returns `false` and generation stops at the next piece of text: the worker moves on at once.
//!
//! The loop is shaped like nano-vllm's `schedule -> run -> postprocess`, with explicit per-step
//! inputs, so a backend that decodes several sequences per run can slot in:
//! * [`Scheduler::schedule`] admits queued jobs until `max_streams` are admitted (blocking only when
//!   none is) and returns a [`Step`]: the admitted sequences to advance this step;
//! * [`Worker::run`] advances them; the single-sequence backend of today advances ONE sequence (the
//!   oldest admitted) from prompt to end per step, so admitted sequences run one after another;
//! * [`Worker::postprocess`] sends the final events, retires finished sequences and updates metrics.
//!
//! `--max-streams` therefore bounds how many requests are admitted at once (the
//! `nibble_active_streams` gauge) and, with `--queue`, how many are held at all
//! (`max_streams + queue`); it does not yet make them decode together.

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::protocol::Usage;
use nibble_engine::session::{FinishReason, GenParams, GenStats, Session};
use nibble_engine::Tokenizer;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use tokio::sync::mpsc::UnboundedSender;

/// Sequences the backend decodes in one run: 1 until the backend is multi-stream.
pub const BACKEND_STREAMS: usize = 1;

/// What the worker tells a handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A piece of generated text (complete UTF-8, stop strings already removed).
    Text(String),
    /// Generation ended normally.
    Done { finish: &'static str, usage: Usage },
    /// Generation failed inside the engine.
    Error(String),
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
    metrics: Metrics,
}

impl Queue {
    /// Enqueues without waiting: 429 when all slots are taken, 503 when the worker is gone.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        // Count first so the worker's decrement can never run before the increment.
        self.metrics.queue_depth.inc();
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.metrics.queue_depth.dec();
                Err(match e {
                    TrySendError::Full(_) => ApiError::queue_full(self.capacity),
                    TrySendError::Disconnected(_) => {
                        ApiError::unavailable("the engine worker has stopped")
                    }
                })
            }
        }
    }
}

/// An admitted sequence.
struct Seq {
    job: Job,
}

/// Admission: the queue's consuming end plus the admitted sequences, oldest first.
pub struct Scheduler {
    rx: Receiver<Job>,
    running: VecDeque<Seq>,
    max_streams: usize,
    metrics: Metrics,
}

/// One step's explicit input: indices into the admitted sequences to advance, oldest first.
#[derive(Debug, PartialEq, Eq)]
pub struct Step {
    pub seqs: Vec<usize>,
}

impl Scheduler {
    fn admit(&mut self, job: Job) {
        self.metrics.queue_depth.dec();
        // A client that left while queued costs nothing.
        if job.events.is_closed() {
            return;
        }
        self.running.push_back(Seq { job });
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
            seqs: (0..self.running.len().min(BACKEND_STREAMS)).collect(),
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
}

impl Worker {
    /// Advances every sequence of `step`. Today: each one from its prompt to its end, in order.
    fn run(&mut self, sched: &Scheduler, step: &Step) -> Vec<SeqOutput> {
        step.seqs
            .iter()
            .map(|&index| {
                let job = &sched.running[index].job;
                let events = &job.events;
                let session = &mut self.session;
                let tok = &self.tok;
                let out = catch_unwind(AssertUnwindSafe(|| {
                    session.generate(tok, &job.prompt, &job.gen, &mut |t| {
                        events.send(Event::Text(t.to_owned())).is_ok()
                    })
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
            let _ = seq.job.events.send(Event::Done { finish, usage });
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
    let mut sched = Scheduler {
        rx,
        running: VecDeque::new(),
        max_streams: max_streams.max(1),
        metrics: metrics.clone(),
    };
    let mut worker = Worker {
        session,
        tok,
        metrics: metrics.clone(),
    };
    let handle = std::thread::Builder::new()
        .name("nibble-engine".into())
        .spawn(move || {
            while let Some(step) = sched.schedule() {
                let out = worker.run(&sched, &step);
                worker.postprocess(&mut sched, out);
            }
        })?;
    let q = Queue {
        tx,
        capacity: queue.max(1),
        metrics,
    };
    Ok((q, handle))
}
