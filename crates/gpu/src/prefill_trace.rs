//! Diagnostics of the GEMM prefill: one chunk recorded one layer per submit, with every
//! token's residual stream and experts read back after each layer (the parity tool's
//! `--trace-prefill`, which compares them with the oracle's per-token traces). The recording
//! is the fast path's; only the submits differ.

use super::{PrefillPlan, Target};
use anyhow::{ensure, Result};
use nibble_backend::PrefillLayerTrace;

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
}
