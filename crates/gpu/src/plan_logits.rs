//! The one-step logits runs of sampled decoding ([`DecodePlan::step_logits`], on the plan's own
//! cache as `nibble generate` samples, and [`DecodePlan::step_logits_slot`], a lone sampled
//! stream of the server): each token is a submit and a wait, because the host's sampler picks
//! the next token from the logits.
//!
//! What such a step costs besides the GPU's work is kept off the critical path: the step's
//! command buffer also copies the logits into a mappable buffer the plan keeps (one submit, no
//! buffer made per token), and while the GPU runs step `pos` the host records the command
//! buffer of step `pos + 1` (recording ~250 dispatches takes a good part of a millisecond). A
//! recorded step reads the token and position from the state buffer, written just before its
//! submit, so it only depends on where it is recorded for: the KV cache (plan or slot) and the
//! position bound that sizes the attention's dispatches. A call for any other step records
//! afresh; the unused one is dropped.

use super::{DecodePlan, Pick};
use crate::context::{GpuError, Result};

/// The step recorded ahead: (slot, position) and its command buffer.
pub(super) type Prepared = std::sync::Mutex<Option<(Option<usize>, usize, wgpu::CommandBuffer)>>;

impl DecodePlan {
    /// Process `token` at `pos` (KV row `pos` is written) and return the logits `[V]`.
    /// The caller guarantees `token < V` and `pos < context_len`.
    pub fn step_logits(&self, token: u32, pos: usize) -> Result<Vec<f32>> {
        self.logits_step(None, token, pos)
    }

    /// Process `token` at `pos` of multi-stream KV slot `slot` (its row `pos` is written) and
    /// return the logits `[V]`: a lone sampled stream's one-step run. The caller guarantees
    /// `token < V` and `pos < context_len`.
    pub(crate) fn step_logits_slot(&self, slot: usize, token: u32, pos: usize) -> Result<Vec<f32>> {
        if slot >= self.slots() {
            return Err(GpuError::Shape(format!(
                "KV slot {slot} of {} bound",
                self.slots()
            )));
        }
        self.logits_step(Some(slot), token, pos)
    }

    fn logits_step(&self, slot: Option<usize>, token: u32, pos: usize) -> Result<Vec<f32>> {
        let ready = self
            .prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let cb = match ready {
            Some((s, p, cb)) if s == slot && p == pos => cb,
            _ => self.record_logits_step(slot, pos),
        };
        self.set_state(token, pos);
        let index = self.ctx.queue.submit([cb]);
        if pos + 1 < self.opts.context_len {
            let next = self.record_logits_step(slot, pos + 1);
            *self.prepared.lock().unwrap_or_else(|p| p.into_inner()) = Some((slot, pos + 1, next));
        }
        let v = self.weights.cfg.vocab_size;
        self.ctx
            .map_read_with(&self.acts.logits_rb, index, |bytes| {
                bytemuck::pod_collect_to_vec(&bytes[..v * 4])
            })
    }

    /// One step at `pos` on `slot` (None: the plan's cache) without the argmax, then the copy
    /// of its logits into the readback buffer.
    fn record_logits_step(&self, slot: Option<usize>, pos: usize) -> wgpu::CommandBuffer {
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            self.record_step_marked(&mut pass, pos as u32, Pick::Logits, slot, &mut |_, _| {});
        }
        let bytes = self.weights.cfg.vocab_size as u64 * 4;
        enc.copy_buffer_to_buffer(&self.acts.logits, 0, &self.acts.logits_rb, 0, bytes);
        enc.finish()
    }
}
