//! The CPU backend's multi-stream path: up to [`MAX_STREAMS`] independent sequences, each with
//! its own KV cache and position, advanced together. One step of B streams is ONE forward pass
//! over B tokens, so every weight block is decoded once for all of them (the products take four
//! tokens per pass over a row) and each chosen expert is read once for the streams that chose
//! it: the server's concurrent requests share the CPU's work the way they share the GPU's runs.
//!
//! The trait's pipelined form (`streams_queue` then `streams_collect`) is kept, but a run is
//! computed when it is queued: there is no device to overlap with, so `streams_collect` only
//! hands back runs already done. A stream's ids equal its single-stream greedy decoding (a
//! token's bits do not depend on the other tokens of a pass; see [`crate::matmul`]).

use crate::{Cache, CpuBackend, Place};
use anyhow::{ensure, Result};
use nibble_backend::argmax;
use std::collections::VecDeque;

/// Most streams one backend decodes together (the GPU's bound).
pub const MAX_STREAMS: usize = 8;

/// The multi-stream state: each slot's position and the id it is fed next, and the runs
/// computed but not yet collected.
pub(crate) struct Streams {
    slots: Vec<Slot>,
    /// Per queued run, the ids of each stream (empty for a stream that sat it out).
    runs: VecDeque<Vec<Vec<u32>>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// Tokens in the slot's cache.
    pos: usize,
    /// Live in greedy runs: the id fed at the next step (`None`: not live, ended, or past EOS).
    next: Option<u32>,
}

impl Streams {
    pub(crate) fn new(n: usize) -> Streams {
        Streams {
            slots: vec![Slot::default(); n],
            runs: VecDeque::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }
}

impl CpuBackend {
    fn slot_check(&self, slot: usize) -> Result<()> {
        ensure!(
            slot < self.streams.len(),
            "stream slot {slot} does not exist ({} streams)",
            self.streams.len()
        );
        Ok(())
    }

    /// The cache of stream `slot`, allocated on first use.
    fn slot_cache(&mut self, slot: usize) -> Result<usize> {
        let c = 1 + slot;
        if self.caches[c].is_none() {
            self.caches[c] = Some(Cache::new(&self.cfg, self.context_len, self.cache_type)?);
        }
        Ok(c)
    }

    /// See [`nibble_backend::Backend::stream_prefill`] (and `stream_prefill_rows`, with `rows`).
    pub(crate) fn streams_prefill(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
        rows: Option<(usize, &mut nibble_backend::RowSink<'_>)>,
    ) -> Result<Vec<f32>> {
        self.slot_check(slot)?;
        let held = self.streams.slots[slot].pos;
        ensure!(
            start <= held,
            "stream {slot} holds {held} positions, cannot keep {start}"
        );
        self.check_tokens(tokens, start)?;
        let cache = self.slot_cache(slot)?;
        // Truncate first: a prefill that fails part-way has overwritten rows from `start` on,
        // so the slot must not keep claiming them.
        self.streams.slots[slot] = Slot {
            pos: start,
            next: None,
        };
        let logits = self.prefill_cache(cache, start, tokens, rows)?;
        self.streams.slots[slot].pos = start + tokens.len();
        Ok(logits)
    }

    /// One forward pass over the fed streams (`fed`: (slot, id)), each at its position; their
    /// logits in the same order. Positions advance only when the pass succeeds.
    fn streams_pass(&mut self, fed: &[(usize, u32)]) -> Result<Vec<Vec<f32>>> {
        let mut places = Vec::with_capacity(fed.len());
        for (s, id) in fed {
            nibble_backend::check_token(self.cfg.vocab_size, *id)?;
            let pos = self.streams.slots[*s].pos;
            ensure!(
                pos < self.context_len,
                "stream {s} has filled its context of {} positions",
                self.context_len
            );
            places.push(Place {
                cache: self.slot_cache(*s)?,
                pos,
            });
        }
        let tokens: Vec<u32> = fed.iter().map(|(_, id)| *id).collect();
        let all: Vec<usize> = (0..fed.len()).collect();
        let logits = self.forward(&tokens, &places, &all)?;
        for (s, _) in fed {
            self.streams.slots[*s].pos += 1;
        }
        Ok(logits)
    }

    /// See [`nibble_backend::Backend::streams_queue`]; the run is computed now.
    pub(crate) fn streams_run(
        &mut self,
        restart: Option<&[Option<u32>]>,
        n: usize,
        eos: &[u32],
    ) -> Result<usize> {
        if let Some(tokens) = restart {
            ensure!(
                self.streams.runs.is_empty(),
                "collect the queued runs before restarting the streams"
            );
            ensure!(
                tokens.len() <= self.streams.len(),
                "{} streams fed, {} exist",
                tokens.len(),
                self.streams.len()
            );
            for (s, slot) in self.streams.slots.iter_mut().enumerate() {
                slot.next = tokens.get(s).copied().flatten();
            }
        }
        let live: Vec<usize> = (0..self.streams.len())
            .filter(|s| self.streams.slots[*s].next.is_some())
            .collect();
        let room = live
            .iter()
            .map(|s| self.context_len - self.streams.slots[*s].pos)
            .min();
        let Some(room) = room else { return Ok(0) };
        let steps = n.min(room);
        if steps == 0 {
            return Ok(0);
        }
        let mut ids = vec![Vec::new(); self.streams.len()];
        // A run that fails part-way appends nothing: every slot goes back to where it was.
        let before = self.streams.slots.clone();
        for _ in 0..steps {
            let fed: Vec<(usize, u32)> = live
                .iter()
                .filter_map(|s| self.streams.slots[*s].next.map(|id| (*s, id)))
                .collect();
            if fed.is_empty() {
                break;
            }
            let logits = match self.streams_pass(&fed) {
                Ok(l) => l,
                Err(e) => {
                    self.streams.slots = before;
                    return Err(e);
                }
            };
            for ((s, _), l) in fed.iter().zip(&logits) {
                let id = argmax(l);
                ids[*s].push(id);
                self.streams.slots[*s].next = (!eos.contains(&id)).then_some(id);
            }
        }
        self.streams.runs.push_back(ids);
        Ok(steps)
    }

    /// See [`nibble_backend::Backend::streams_collect`].
    pub(crate) fn streams_take(&mut self) -> Option<Vec<Vec<u32>>> {
        self.streams.runs.pop_front()
    }

    /// See [`nibble_backend::Backend::streams_end`].
    pub(crate) fn streams_stop(&mut self, slot: usize) -> Result<()> {
        self.slot_check(slot)?;
        self.streams.slots[slot].next = None;
        Ok(())
    }

    /// See [`nibble_backend::Backend::streams_step`].
    pub(crate) fn streams_logits(
        &mut self,
        tokens: &[Option<u32>],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        ensure!(
            tokens.len() <= self.streams.len(),
            "{} streams fed, {} exist",
            tokens.len(),
            self.streams.len()
        );
        let fed: Vec<(usize, u32)> = tokens
            .iter()
            .enumerate()
            .filter_map(|(s, t)| t.map(|id| (s, id)))
            .collect();
        let mut out = vec![None; tokens.len()];
        if fed.is_empty() {
            return Ok(out);
        }
        let logits = self.streams_pass(&fed)?;
        for ((s, _), l) in fed.iter().zip(logits) {
            // The host picks this stream's next id: it leaves the greedy runs.
            self.streams.slots[*s].next = None;
            out[*s] = Some(l);
        }
        Ok(out)
    }
}
