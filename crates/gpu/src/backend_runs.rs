//! The folded request runs of [`GpuBackend`] (split from backend.rs): a greedy or GPU-sampled
//! request on the main sequence (`stream_folded`), its per-token comparison path, and the
//! multi-stream queue's restart and continuation (`streams_queue_with`), on the lone stream's
//! plan or on the columns.

use super::{lone_input, GpuBackend, MAX_EOS};
use anyhow::{bail, ensure, Result};
use nibble_backend::{Backend, DeviceSampling};

impl GpuBackend {
    /// The folded greedy request (checked by the caller, `n >= 1`, `run >= 1`): runs of `run`
    /// steps handed to `on_ids` as each completes, the next run already queued on the GPU.
    /// Returns the ids handed out; the position advances by the steps the GPU really took
    /// (more than handed out when `on_ids` stopped early), or stays put on an error.
    /// `spec`: the ids are sampled on the GPU by these settings instead of the argmax.
    pub(super) fn stream_folded(
        &mut self,
        token: u32,
        n: usize,
        run: usize,
        eos: &[u32],
        spec: Option<&DeviceSampling<'_>>,
        on_ids: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<usize> {
        let start = self.pos;
        let mut produced = 0;
        // Runs longer than the request are one run; the state's step counter is u32.
        let (n32, run32) = (u32::try_from(n)?, run.min(n) as u32);
        let vocab = self.config().vocab_size;
        let steps = (|| -> Result<u32> {
            let mut s = match spec {
                None => self.plan.begin_greedy(token, start, n32, run32, eos)?,
                Some(sp) => self.plan.begin_sampled(token, start, n32, run32, eos, sp)?,
            };
            while let Some(out) = s.next_run()? {
                ensure!(!out.ids.is_empty(), "the GPU run produced no token");
                // The sampler's mark for a row with no finite value to choose from.
                ensure!(
                    out.ids.iter().all(|&id| (id as usize) < vocab),
                    "the GPU sampler found no finite logit to choose from"
                );
                produced += out.ids.len();
                let more = on_ids(&out.ids);
                if out.state.done != 0 {
                    // EOS or the last step: any run still queued is a no-op.
                    return Ok(out.state.step);
                }
                if !more {
                    // The next run is already queued and will execute: wait for it so the
                    // position counts the KV rows it writes.
                    let last = s.drain()?;
                    return Ok(last.map_or(out.state.step, |st| st.step));
                }
            }
            bail!("the GPU request ended without its done flag")
        })();
        match steps {
            Ok(steps) if (produced..=n).contains(&(steps as usize)) => {
                self.pos = start + steps as usize;
                Ok(produced)
            }
            Ok(steps) => {
                self.pos = start;
                bail!("the GPU reports {steps} steps after handing out {produced} of {n}")
            }
            Err(e) => {
                self.pos = start;
                Err(e)
            }
        }
    }

    /// The per-token path in runs: `decode_greedy` (one submit and wait per token) per run.
    pub(super) fn stream_per_token(
        &mut self,
        token: u32,
        n: usize,
        run: usize,
        eos: &[u32],
        on_ids: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<usize> {
        let mut produced = 0;
        let mut cur = token;
        while produced < n {
            let ids = self.decode_greedy(cur, run.min(n - produced), eos)?;
            produced += ids.len();
            let Some(&last) = ids.last() else { break };
            if !on_ids(&ids) || eos.contains(&last) {
                break;
            }
            cur = last;
        }
        Ok(produced)
    }

    /// `streams_queue`, stream `s`'s ids sampled on the GPU by `specs[s]` where given (the
    /// caller checked that the GPU samples them); every draw list holds the stream's room.
    pub(super) fn streams_queue_with(
        &mut self,
        restart: Option<&[Option<u32>]>,
        n: usize,
        eos: &[u32],
        specs: &[Option<&DeviceSampling<'_>>],
    ) -> Result<usize> {
        if let Some(tokens) = restart {
            let seqs = self.stream_inputs(tokens, 0)?;
            self.lone_idle("restart")?;
            let ctx = self.context_len();
            for (s, sp) in specs.iter().enumerate() {
                if let (Some(sp), Some(Some((_, pos)))) = (sp, seqs.get(s)) {
                    let room = ctx - pos;
                    ensure!(
                        sp.temperature <= 0.0 || sp.uniforms.len() >= room,
                        "sampled stream {s} with {room} steps of room needs {room} draws, got {}",
                        sp.uniforms.len()
                    );
                }
            }
            let b = self.batch.as_mut().expect("stream_inputs checked the path");
            match lone_input(&seqs).filter(|_| self.lone_path) {
                // One stream: the single-sequence plan in its KV slot (plan_slots.rs), its ids
                // from the argmax or, with `spec`, the GPU sampler.
                Some((slot, token, pos)) => {
                    b.idle("restart")?;
                    ensure!(
                        eos.len() <= MAX_EOS,
                        "at most {MAX_EOS} EOS ids, got {}",
                        eos.len()
                    );
                    let n = u32::try_from(ctx - pos)?;
                    let mut runs = self.plan.begin_runs(Some(slot), token, pos, n, eos)?;
                    if let Some(Some(sp)) = specs.get(slot) {
                        runs.set_sampled(&self.plan, sp)?;
                    }
                    self.lone = Some((slot, runs));
                }
                None => {
                    if !b.restart_sampled(&seqs, eos, specs)? {
                        return Ok(0);
                    }
                }
            }
            self.stream_live = seqs.iter().map(Option::is_some).collect();
            self.stream_live.resize(b.streams(), false);
        }
        // Every live stream stays within its context.
        let ctx = self.context_len();
        let Some(b) = self.batch.as_mut() else {
            bail!("no multi-stream path: the GPU backend was built with 0 streams");
        };
        let room = (0..b.streams())
            .filter(|s| self.stream_live[*s])
            .map(|s| ctx.saturating_sub(self.stream_pos[s] + self.stream_queued))
            .min()
            .unwrap_or(0);
        let mut n = n.min(room);
        if n == 0 {
            return Ok(0);
        }
        match &mut self.lone {
            Some((_, runs)) => {
                n = runs.submit(&self.plan, n as u32)? as usize;
                if n == 0 {
                    return Ok(0);
                }
            }
            None => b.queue_run(n as u32)?,
        }
        self.stream_queued += n;
        self.stream_runs.push_back(n);
        Ok(n)
    }
}
