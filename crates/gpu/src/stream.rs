//! Greedy and GPU-sampled requests on the GPU, recorded in runs that overlap with execution.
//!
//! A request of n steps ([`GreedyStream`]) writes the run state and the argmax's length (n) and
//! EOS ids ONCE, then is recorded in runs of `run` steps, each its own command buffer ending in
//! a copy of the state and of the run's slice of `out_tokens` into its own host-mappable buffer.
//! Run k+1 needs only positions (`pos + step`), never run k's ids (the token chain stays in the
//! state buffer on the GPU), so it is recorded and submitted BEFORE the host waits for run k:
//! the GPU works through run k while the host records run k+1, and at most two runs are in
//! flight. The host waits for one submission index at a time ([`Context::map_read`]), so
//! waiting for run k never waits for run k+1. After an EOS or the request's last step the
//! state's `done` flag makes any queued run a no-op.
//!
//! [`Context::map_read`]: crate::context::Context::map_read

use crate::context::{GpuError, Result};
use crate::plan::{DecodePlan, Pick};
use crate::state::RunState;
use nibble_backend::DeviceSampling;
use std::collections::VecDeque;

impl DecodePlan {
    /// Greedy run of `n` steps from `token` at `pos` as one submission (one run of a
    /// [`GreedyStream`]). Returns the ids produced (stopping after the first EOS). The caller
    /// guarantees `token < V`.
    pub fn run_greedy(&self, token: u32, pos: usize, n: u32, eos: &[u32]) -> Result<Vec<u32>> {
        let mut s = self.begin_greedy(token, pos, n, n.max(1), eos)?;
        Ok(s.next_run()?.map(|o| o.ids).unwrap_or_default())
    }

    /// Start a greedy request of `n` steps from `token` at `pos`, to be recorded in runs of
    /// `run` steps: writes the state and the argmax's run length (`n`) and EOS ids once;
    /// nothing is recorded until [`GreedyStream::next_run`]. The caller guarantees `token < V`.
    pub fn begin_greedy(
        &self,
        token: u32,
        pos: usize,
        n: u32,
        run: u32,
        eos: &[u32],
    ) -> Result<GreedyStream<'_>> {
        if run == 0 {
            return Err(GpuError::Shape("greedy runs of 0 steps".into()));
        }
        Ok(GreedyStream {
            plan: self,
            run,
            runs: self.begin_runs(None, token, pos, n, eos)?,
        })
    }

    /// [`Self::begin_greedy`] for a request whose ids the GPU samples by `spec`
    /// (kernels/sample.rs): writes the sampler's settings, counts and draws once as well.
    pub fn begin_sampled(
        &self,
        token: u32,
        pos: usize,
        n: u32,
        run: u32,
        eos: &[u32],
        spec: &DeviceSampling<'_>,
    ) -> Result<GreedyStream<'_>> {
        if run == 0 {
            return Err(GpuError::Shape("sampled runs of 0 steps".into()));
        }
        let mut runs = self.begin_runs(None, token, pos, n, eos)?;
        runs.set_sampled(self, spec)?;
        Ok(GreedyStream {
            plan: self,
            run,
            runs,
        })
    }

    /// Start a greedy request of `n` steps from `token` at `pos` on the plan's own cache
    /// (`slot` None) or on multi-stream KV slot `slot` ([`DecodePlan::bind_slots`]): writes
    /// the state, the argmax's run length and EOS ids once. The caller guarantees `token < V`.
    pub(crate) fn begin_runs(
        &self,
        slot: Option<usize>,
        token: u32,
        pos: usize,
        n: u32,
        eos: &[u32],
    ) -> Result<GreedyRuns> {
        if pos + n as usize > self.opts.context_len {
            return Err(GpuError::Shape(format!(
                "greedy request of {n} steps at position {pos} (context {})",
                self.opts.context_len
            )));
        }
        if let Some(s) = slot.filter(|s| *s >= self.slots()) {
            return Err(GpuError::Shape(format!(
                "KV slot {s} of {} bound",
                self.slots()
            )));
        }
        self.start_greedy(token, pos, n, eos)?;
        Ok(GreedyRuns {
            slot,
            pick: Pick::Argmax,
            pos,
            n,
            next: 0,
            queued: VecDeque::with_capacity(2),
        })
    }
}

/// Bytes of the run state at the start of a run's readback buffer.
const STATE_BYTES: u64 = std::mem::size_of::<RunState>() as u64;

/// One run recorded and submitted but not yet read back.
struct QueuedRun {
    /// The request's step index of the run's first step.
    first: u32,
    len: u32,
    /// `[16 + 4 len]` bytes: the state after the run, then `out_tokens[first..first + len]`.
    readback: wgpu::Buffer,
    index: wgpu::SubmissionIndex,
}

/// What one completed run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOutput {
    /// The run's ids: shorter than the run when an EOS ended it (the EOS is the last id),
    /// empty when the request had already ended before the run.
    pub ids: Vec<u32>,
    /// The state after the run: `step` counts the request's steps so far (= KV rows written
    /// since its start), `done` is set after an EOS or the request's last step.
    pub state: RunState,
}

/// The runs of one greedy request on a [`DecodePlan`] (its cache or a KV slot), each run its
/// own command buffer: the queue of submitted runs, owned apart from the plan so a backend can
/// keep it between calls (the lone multi-stream path) while [`GreedyStream`] borrows the plan.
///
/// Dropping it with runs still queued is harmless: they execute (as no-ops once `done` is
/// set) and their readback buffers are freed when they finish.
pub(crate) struct GreedyRuns {
    /// None: the plan's own cache; else the multi-stream KV slot.
    slot: Option<usize>,
    /// How each step picks its token: the argmax, or the sampler for a sampled request.
    pick: Pick,
    /// Position of the request's first step.
    pos: usize,
    n: u32,
    /// The first step not recorded yet (`n` once every run is queued or the request ended).
    next: u32,
    /// Submitted runs, oldest first.
    queued: VecDeque<QueuedRun>,
}

impl GreedyRuns {
    /// Make the request's steps sample their ids by `spec` (kernels/sample.rs) instead of
    /// the argmax: writes the sampler's settings, counts and draws for its steps. Before any
    /// run is submitted.
    pub(crate) fn set_sampled(&mut self, p: &DecodePlan, spec: &DeviceSampling<'_>) -> Result<()> {
        if self.next > 0 {
            return Err(GpuError::Shape(
                "sampling set after a run was queued".into(),
            ));
        }
        p.start_sampled(self.n, spec)?;
        self.pick = Pick::Sample;
        Ok(())
    }

    /// Record the next run (up to `run` steps from `next`, positions `pos + step`) into its
    /// own command buffer and submit it without waiting. Returns the steps queued (0 when
    /// none is left).
    pub(crate) fn submit(&mut self, p: &DecodePlan, run: u32) -> Result<u32> {
        if self.next >= self.n || run == 0 {
            return Ok(0);
        }
        let first = self.next;
        let len = run.min(self.n - first);
        let ctx = &p.ctx;
        let readback = ctx.readback_buffer("run.readback", STATE_BYTES + len as u64 * 4);
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            for s in first..first + len {
                p.record_greedy_step(
                    &mut pass,
                    (self.pos + s as usize) as u32,
                    self.slot,
                    self.pick,
                );
            }
        }
        // Copies after the pass see the state and ids as this run left them, whatever the
        // runs queued after it do later.
        let (state, out_tokens) = p.greedy_buffers();
        enc.copy_buffer_to_buffer(state, 0, &readback, 0, STATE_BYTES);
        enc.copy_buffer_to_buffer(
            out_tokens,
            first as u64 * 4,
            &readback,
            STATE_BYTES,
            len as u64 * 4,
        );
        let index = ctx.submit(enc);
        self.queued.push_back(QueuedRun {
            first,
            len,
            readback,
            index,
        });
        self.next += len;
        Ok(len)
    }

    /// Wait for the oldest queued run only (later ones keep running) and read its output.
    pub(crate) fn wait_next(&mut self, p: &DecodePlan) -> Result<Option<RunOutput>> {
        let Some(q) = self.queued.pop_front() else {
            return Ok(None);
        };
        let bytes = p.ctx.map_read(&q.readback, q.index)?;
        let want = (STATE_BYTES + q.len as u64 * 4) as usize;
        if bytes.len() < want {
            return Err(GpuError::Map(format!(
                "run readback of {} bytes, expected {want}",
                bytes.len()
            )));
        }
        let (st, ids) = bytes.split_at(STATE_BYTES as usize);
        let state: RunState = bytemuck::pod_read_unaligned(st);
        let ids: Vec<u32> = bytemuck::pod_collect_to_vec(&ids[..q.len as usize * 4]);
        let got = state.step.saturating_sub(q.first).min(q.len) as usize;
        if state.done != 0 {
            // The request has ended: later steps would be no-ops, so record no more runs.
            self.next = self.n;
        }
        Ok(Some(RunOutput {
            ids: ids[..got].to_vec(),
            state,
        }))
    }

    /// Runs submitted and not yet read back.
    pub(crate) fn queued_runs(&self) -> usize {
        self.queued.len()
    }

    /// Stop recording; wait for the runs already queued (they still execute) and return the
    /// last one's state, i.e. what the GPU really wrote (`None` when nothing was queued).
    pub(crate) fn drain(&mut self, p: &DecodePlan) -> Result<Option<RunState>> {
        self.next = self.n;
        let mut last = None;
        while let Some(o) = self.wait_next(p)? {
            last = Some(o.state);
        }
        Ok(last)
    }
}

/// A greedy request of `n` steps recorded in runs of `run` steps, with the next run queued on
/// the GPU while the host waits for (and handles) the current one.
pub struct GreedyStream<'p> {
    plan: &'p DecodePlan,
    run: u32,
    runs: GreedyRuns,
}

impl GreedyStream<'_> {
    /// The next run's output, in order; `None` once every run has been read. Before waiting
    /// for run k it records and submits run k+1 (if any step is left), so the GPU never idles
    /// while the host records.
    pub fn next_run(&mut self) -> Result<Option<RunOutput>> {
        while self.runs.queued_runs() < 2 && self.runs.submit(self.plan, self.run)? > 0 {}
        self.runs.wait_next(self.plan)
    }

    /// Runs submitted and not yet read back.
    pub fn queued_runs(&self) -> usize {
        self.runs.queued_runs()
    }

    /// Stop recording; wait for the runs already queued (they still execute) and return the
    /// last one's state, i.e. what the GPU really wrote (`None` when nothing was queued).
    pub fn drain(&mut self) -> Result<Option<RunState>> {
        self.runs.drain(self.plan)
    }
}
