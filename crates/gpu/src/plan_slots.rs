//! A lone stream of the multi-stream path decoded by the single-sequence plan, in place.
//!
//! The multi-stream path ([`crate::batch`]) keeps one KV slot per stream (`[B, ctx, Hkv, D]`
//! per layer, slot-major). When only one stream is live, its column kernels are slower than
//! this plan's (no folded router, matmul tiles sized for several columns): 268.0 against 284.5
//! tok/s on the H200, side by side (docs/BENCHMARKS.md run 28). So the plan also holds, per
//! slot, attention
//! bindings whose cache is that slot's region of the multi-stream cache: a lone greedy stream
//! runs the plan's own steps ([`crate::stream::GreedyRuns`]) reading and writing its KV rows
//! where the column kernels do, and when a second stream joins, the column runs continue from
//! the same rows. Nothing is copied either way. A lone sampled stream's one-step runs (logits
//! read back for the host's sampler) take the plan's step the same way, and so does the qkv
//! dispatch's own attention (kernels/qkv_attention.rs), bound per slot alike.

use super::DecodePlan;
use crate::context::Result;
use crate::kernels::attention::AttentionBuffers;
use crate::kernels::matvec::NormInput;
use crate::kernels::qkv_attention::QkvAttentionBuffers;
use crate::weights::Matrix;

impl DecodePlan {
    /// Bind the attention of every layer to each of the `slots` KV slots of the multi-stream
    /// caches `k`, `v` (per layer `[slots, ctx, Hkv, D]` f32, this plan's `ctx`). Returns
    /// false, binding nothing, when a slot's byte offset is not a multiple of the device's
    /// storage-offset alignment (some tiny models at odd context lengths; Qwen3's 2 KiB (f32)
    /// or 1 KiB (f16) per position always is): the lone stream then stays on the columns.
    pub(crate) fn bind_slots(
        &mut self,
        k: &[wgpu::Buffer],
        v: &[wgpu::Buffer],
        slots: usize,
    ) -> Result<bool> {
        let cfg = &self.weights.cfg;
        let slot_bytes = self.cache_bytes();
        let align = self.ctx.limits.min_storage_buffer_offset_alignment as u64;
        if slots > 1 && slot_bytes % align != 0 {
            return Ok(false);
        }
        let a = &self.acts;
        let mut all = Vec::with_capacity(slots);
        let mut all_qa = Vec::with_capacity(slots);
        for s in 0..slots {
            let mut layers = Vec::with_capacity(cfg.num_layers);
            let mut qa = Vec::with_capacity(cfg.num_layers);
            for (l, lw) in self.weights.layers.iter().enumerate() {
                let bufs = AttentionBuffers {
                    state: &a.state,
                    qkv: &a.qkv,
                    q_norm: &lw.q_norm,
                    k_norm: &lw.k_norm,
                    k_cache: &k[l],
                    v_cache: &v[l],
                    out: &a.att,
                    out_q: a.att_q.as_ref(),
                };
                layers.push(self.k.attn.bind_at(
                    &self.ctx,
                    &bufs,
                    &a.scratch,
                    s as u64 * slot_bytes,
                )?);
                // The qkv dispatch's own attention on this slot, where the plan has it.
                if let (Some(qk), Some(arrive), Matrix::Q4(m)) =
                    (&self.k.qkv_attn, &self.qkv_arrive, &lw.qkv)
                {
                    let qb = QkvAttentionBuffers {
                        m,
                        x: NormInput {
                            h: &a.h,
                            weight: &lw.attn_norm,
                            eps: cfg.rms_norm_eps,
                        },
                        qkv: &a.qkv,
                        q_norm: &lw.q_norm,
                        k_norm: &lw.k_norm,
                        k_cache: &k[l],
                        v_cache: &v[l],
                        out: &a.att,
                        arrive,
                        state: &a.state,
                    };
                    qa.push(qk.bind_at(&self.ctx, &qb, s as u64 * slot_bytes)?);
                }
            }
            all.push(layers);
            all_qa.push(qa);
        }
        self.slot_attn = all;
        self.slot_qkv_attn = all_qa;
        Ok(true)
    }

    /// Layers with a qkv + attention binding, per KV slot (diagnostics and tests).
    pub fn slot_qkv_attention_layers(&self) -> Vec<usize> {
        self.slot_qkv_attn.iter().map(Vec::len).collect()
    }

    /// KV slots bound by [`Self::bind_slots`].
    pub(crate) fn slots(&self) -> usize {
        self.slot_attn.len()
    }
}
