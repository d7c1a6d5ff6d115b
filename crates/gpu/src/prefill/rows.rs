//! Every prompt token's logits from the GEMM prefill ([`PrefillPlan::prefill_rows`]), for
//! scoring a text (perplexity, prompt logprobs): after a chunk's layers its residual stream `h`
//! holds every token's last hidden state, so the lm_head (the column matmul with the final
//! norm on load, each weight read once per 8 tokens) runs over 8 rows of it at a time. Rows
//! come back [`ROWS_PER_READ`] at a time through one mappable buffer, so the host holds one
//! such batch, never a whole chunk's `[chunk, V]` logits (1.2 GB at 2048 tokens of Qwen3).

use super::{PrefillPlan, Target};
use crate::kernels::matmul::{MatmulArgs, MatmulBinding, MatmulInput, B_MAX};
use crate::kernels::matvec::NormInput;
use crate::weights::{GpuWeights, HeadRef};
use anyhow::{bail, Result};
use nibble_backend::RowSink;

/// Rows read back per submission: `[32, V]` f32 is 19 MB for Qwen3's vocabulary.
pub const ROWS_PER_READ: usize = 32;

/// The lm_head bound over 8 rows and the buffers around it.
pub(super) struct RowsHead {
    head: MatmulBinding,
    /// `[8, H]` the rows of `h` the head reads (copied out of the chunk's `h`).
    hcols: wgpu::Buffer,
    /// `[8, V]` the head's output.
    logits: wgpu::Buffer,
    /// `[ROWS_PER_READ, V]` mappable.
    readback: wgpu::Buffer,
}

impl PrefillPlan {
    /// The row head, bound now if this is its first use.
    fn rows_head(&self, w: &GpuWeights) -> Result<&RowsHead> {
        if let Some(r) = self.rows.get() {
            return Ok(r);
        }
        let HeadRef::Q4(whead) = w.head() else {
            bail!("the GEMM prefill needs an int4 lm_head");
        };
        let (h, v) = (self.hidden as u64, self.vocab as u64);
        let hcols = self.ctx.storage("p.rows.h", B_MAX as u64 * h * 4)?;
        let logits = self.ctx.storage("p.rows.logits", B_MAX as u64 * v * 4)?;
        let head = self.matmul.bind(
            &self.ctx,
            &MatmulArgs {
                m: whead,
                input: MatmulInput::Norm(NormInput {
                    h: &hcols,
                    weight: &w.out_norm,
                    eps: w.cfg.rms_norm_eps,
                }),
                nb: B_MAX,
                y: &logits,
                y_stride: v as u32,
                state: &self.state,
            },
        )?;
        let readback = self
            .ctx
            .readback_buffer("p.rows.readback", ROWS_PER_READ as u64 * v * 4);
        Ok(self.rows.get_or_init(|| RowsHead {
            head,
            hcols,
            logits,
            readback,
        }))
    }

    /// Prefill `tokens` at positions `pos..` of `target`'s sequence as [`PrefillPlan::prefill`]
    /// does, handing every token's logits to `row` in order (`row(i, [V])`: after `tokens[i]`).
    /// Returns whether every row was finite (the caller's cue to redo the prompt on f32 fmas
    /// when the GEMMs ran on matrix units). The caller checks the ids and the context.
    pub fn prefill_rows(
        &self,
        w: &GpuWeights,
        target: Target,
        tokens: &[u32],
        pos: usize,
        row: &mut RowSink<'_>,
    ) -> Result<bool> {
        anyhow::ensure!(!tokens.is_empty(), "prefill of an empty token list");
        let slot = self.slot_of(target)?;
        let rh = self.rows_head(w)?;
        let (hrow, vrow) = (self.hidden as u64 * 4, self.vocab as u64 * 4);
        let mut finite = true;
        for (c, group) in tokens.chunks(self.chunk as usize).enumerate() {
            let first = c * self.chunk as usize;
            let n = group.len();
            let bound = self.load_chunk(group, pos + first, slot);
            let mut enc = self.ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                self.record_layers(&mut pass, target, n as u32, bound, &mut |_, _| {})?;
            }
            self.ctx.submit(enc);
            for r0 in (0..n).step_by(ROWS_PER_READ) {
                let rn = ROWS_PER_READ.min(n - r0);
                let mut enc = self.ctx.device.create_command_encoder(&Default::default());
                for g0 in (r0..r0 + rn).step_by(B_MAX as usize) {
                    // The head always computes 8 columns; those past the chunk's rows read
                    // stale (finite or zeroed) rows and are not copied out.
                    let gn = (B_MAX as usize).min(r0 + rn - g0) as u64;
                    enc.copy_buffer_to_buffer(&self.h, g0 as u64 * hrow, &rh.hcols, 0, gn * hrow);
                    {
                        let mut pass = enc.begin_compute_pass(&Default::default());
                        self.matmul.record(&mut pass, &rh.head);
                    }
                    let at = (g0 - r0) as u64 * vrow;
                    enc.copy_buffer_to_buffer(&rh.logits, 0, &rh.readback, at, gn * vrow);
                }
                let index = self.ctx.submit(enc);
                let rows: Vec<f32> =
                    self.ctx
                        .map_read_with(&rh.readback, index, bytemuck::pod_collect_to_vec)?;
                for (i, l) in rows.chunks_exact(self.vocab).take(rn).enumerate() {
                    finite &= l.iter().all(|x| x.is_finite());
                    row(first + r0 + i, l)?;
                }
            }
        }
        Ok(finite)
    }
}
