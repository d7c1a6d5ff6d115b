//! Diagnostics of the GEMM prefill, both recording the fast path's way: `profile`, the GPU
//! time per op kind of one chunk (timestamps between ops; `bench --profile`), and `trace`,
//! one chunk recorded one layer per submit with every token's residual stream and experts read
//! back after each layer (the parity tool's `--trace-prefill`, which compares them with the
//! oracle's per-token traces).

use super::{PrefillPlan, Target};
use crate::context::Timestamps;
use anyhow::{ensure, Result};
use nibble_backend::{OpTime, PrefillLayerTrace};

impl PrefillPlan {
    /// Prefill `tokens` (at most a chunk) at positions `pos..` of the main sequence one layer
    /// per submit, returning per layer the residual rows `h [n, H]` and each token's expert
    /// ids `[n, K]` in rank order. Writes the KV rows of those positions like a prefill.
    pub fn trace(&self, tokens: &[u32], pos: usize) -> Result<Vec<PrefillLayerTrace>> {
        ensure!(
            !tokens.is_empty() && tokens.len() <= self.chunk as usize,
            "prefill trace of {} tokens (1..={})",
            tokens.len(),
            self.chunk
        );
        let n = tokens.len() as u32;
        let bound = self.load_chunk(tokens, pos, 0);
        let k = self.moe.top_k() as usize;
        self.ctx
            .run_pass(|p| self.embed_k.record_n(p, &self.embed, n))?;
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mut failed = None;
            self.ctx.run_pass(|p| {
                failed = self
                    .record_layer(p, l, Target::Main, n, bound, &mut |_, _| {})
                    .err();
            })?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            out.push(PrefillLayerTrace {
                h: self.ctx.read_f32(&self.h, tokens.len() * self.hidden)?,
                experts: self.ctx.read_u32(self.moe.route_ids(), tokens.len() * k)?,
            });
        }
        Ok(out)
    }

    /// GPU time per op kind of one chunk of `tokens` (at most a chunk) at positions `pos..`
    /// of the main sequence, summed over the layers: the chunk is recorded once unmarked
    /// (warm-up), then again with a timestamp after every op (their gaps include the marks'
    /// own cost, as in `profile.rs`). `None` without timestamps inside passes. Writes the KV
    /// rows of those positions like a prefill.
    pub fn profile(&self, tokens: &[u32], pos: usize) -> Result<Option<Vec<OpTime>>> {
        let need = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if !self.ctx.features.contains(need) {
            return Ok(None);
        }
        ensure!(
            !tokens.is_empty() && tokens.len() <= self.chunk as usize,
            "prefill profile of {} tokens (1..={})",
            tokens.len(),
            self.chunk
        );
        let n = tokens.len() as u32;
        let bound = self.load_chunk(tokens, pos, 0);
        let marks = 2 + 11 * self.layers.len() as u32;
        let ts = Timestamps::new(&self.ctx, "prefill.profile", marks);
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        let mut labels = Vec::new();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            self.record_layers(&mut pass, Target::Main, n, bound, &mut |_, _| {})?;
            let mut next = 0u32;
            pass.write_timestamp(&ts.set, next);
            next += 1;
            self.record_layers(&mut pass, Target::Main, n, bound, &mut |p, op| {
                if next < marks {
                    p.write_timestamp(&ts.set, next);
                }
                next += 1;
                labels.push(op);
            })?;
            ensure!(
                next <= marks,
                "prefill profile: {next} marks, room for {marks}"
            );
        }
        let used = labels.len() as u32 + 1;
        let gaps = ts.finish(&self.ctx, enc, used)?;
        let out = crate::profile::sum_by_op(labels.iter().copied().zip(gaps));
        Ok(Some(out))
    }
}
