//! Every prompt token's logits from the GEMM prefill ([`PrefillPlan::prefill_rows`]), for
//! scoring a text (perplexity, prompt logprobs): after a chunk's layers its residual stream `h`
//! holds every token's last hidden state, so the lm_head (the column matmul with the final
//! norm on load, each weight read once per 8 tokens) runs over 8 rows of it at a time, and only
//! over the rows asked for. Rows come back [`ROWS_PER_READ`] at a time through two mappable
//! buffers in turn, so the head of one batch runs while the host reads the one before, and the
//! host holds two batches, never a whole chunk's `[chunk, V]` logits (1.2 GB at 2048 tokens of
//! Qwen3).

use super::{PrefillPlan, Target};
use crate::kernels::matmul::{MatmulArgs, MatmulBinding, MatmulInput, B_MAX};
use crate::kernels::matvec::NormInput;
use crate::weights::{GpuWeights, HeadRef};
use anyhow::{bail, Result};
use nibble_backend::RowSink;
use std::collections::VecDeque;

/// Rows read back per submission: `[32, V]` f32 is 19 MB for Qwen3's vocabulary.
pub const ROWS_PER_READ: usize = 32;

/// The lm_head bound over 8 rows and the buffers around it.
pub(super) struct RowsHead {
    head: MatmulBinding,
    /// `[8, H]` the rows of `h` the head reads (copied out of the chunk's `h`).
    hcols: wgpu::Buffer,
    /// `[8, V]` the head's output.
    logits: wgpu::Buffer,
    /// `[ROWS_PER_READ, V]` mappable, two used in turn.
    readback: [wgpu::Buffer; 2],
}

/// A batch of rows submitted and not yet read: its first row's index in the prompt, its row
/// count, its readback buffer and submission.
struct Queued {
    at: usize,
    rows: usize,
    buf: usize,
    index: wgpu::SubmissionIndex,
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
        let bytes = ROWS_PER_READ as u64 * v * 4;
        let readback = [0, 1].map(|_| self.ctx.readback_buffer("p.rows.readback", bytes));
        Ok(self.rows.get_or_init(|| RowsHead {
            head,
            hcols,
            logits,
            readback,
        }))
    }

    /// Prefill `tokens` at positions `pos..` of `target`'s sequence as [`PrefillPlan::prefill`]
    /// does, handing the logits of every token from index `from` on to `row` in order (`row(i,
    /// [V])`: after `tokens[i]`). Returns whether every row handed was finite (the caller's cue
    /// to redo the prompt on f32 fmas when the GEMMs ran on matrix units). The caller checks the
    /// ids and the context.
    pub fn prefill_rows(
        &self,
        w: &GpuWeights,
        target: Target,
        tokens: &[u32],
        (pos, from): (usize, usize),
        row: &mut RowSink<'_>,
    ) -> Result<bool> {
        anyhow::ensure!(!tokens.is_empty(), "prefill of an empty token list");
        let slot = self.slot_of(target)?;
        let rh = self.rows_head(w)?;
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
            // Two batches in flight: the next one's head runs while the host reads this one.
            let mut queued: VecDeque<Queued> = VecDeque::with_capacity(2);
            let lo = from.saturating_sub(first).min(n);
            for (k, r0) in (lo..n).step_by(ROWS_PER_READ).enumerate() {
                if queued.len() == 2 {
                    let q = queued.pop_front().expect("two queued");
                    finite &= self.hand_rows(rh, q, row)?;
                }
                let rn = ROWS_PER_READ.min(n - r0);
                let index = self.record_head(rh, r0, rn, k % 2);
                queued.push_back(Queued {
                    at: first + r0,
                    rows: rn,
                    buf: k % 2,
                    index,
                });
            }
            while let Some(q) = queued.pop_front() {
                finite &= self.hand_rows(rh, q, row)?;
            }
        }
        Ok(finite)
    }

    /// Submit the head over rows `r0..r0 + rn` of the chunk's `h` into readback buffer `buf`.
    fn record_head(
        &self,
        rh: &RowsHead,
        r0: usize,
        rn: usize,
        buf: usize,
    ) -> wgpu::SubmissionIndex {
        let (hrow, vrow) = (self.hidden as u64 * 4, self.vocab as u64 * 4);
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        for g0 in (r0..r0 + rn).step_by(B_MAX as usize) {
            // The head always computes 8 columns; those past the rows asked for read stale
            // (finite or zeroed) rows and are not copied out.
            let gn = (B_MAX as usize).min(r0 + rn - g0) as u64;
            enc.copy_buffer_to_buffer(&self.h, g0 as u64 * hrow, &rh.hcols, 0, gn * hrow);
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                self.matmul.record(&mut pass, &rh.head);
            }
            let at = (g0 - r0) as u64 * vrow;
            enc.copy_buffer_to_buffer(&rh.logits, 0, &rh.readback[buf], at, gn * vrow);
        }
        self.ctx.submit(enc)
    }

    /// Wait for batch `q`, hand its rows to `row`; whether they were all finite.
    fn hand_rows(&self, rh: &RowsHead, q: Queued, row: &mut RowSink<'_>) -> Result<bool> {
        let vocab = self.vocab;
        self.ctx
            .map_read_with(&rh.readback[q.buf], q.index, |bytes| -> Result<bool> {
                let mut finite = true;
                // The mapped range is 4-aligned (wgpu maps at 8-byte offsets); copy otherwise.
                let owned;
                let all: &[f32] = match bytemuck::try_cast_slice(bytes) {
                    Ok(v) => v,
                    Err(_) => {
                        owned = bytemuck::pod_collect_to_vec::<u8, f32>(bytes);
                        &owned
                    }
                };
                for (i, l) in all.chunks_exact(vocab).take(q.rows).enumerate() {
                    finite &= l.iter().all(|x| x.is_finite());
                    row(q.at + i, l)?;
                }
                Ok(finite)
            })?
    }
}
