//! Recording one decode step of the plan into a compute pass: the embedding, every layer's
//! dispatches (qkv, attention, o-proj with the folded router, MoE) and how the step ends
//! (logits, argmax or sampler). No host sync; plan.rs module docs say what a step reads and
//! writes.

use super::{AttentionBinding, DecodePlan, LayerBinding, Pick, QkvAttentionBinding};

impl DecodePlan {
    /// Record the embedding and every layer for a token at a position `<= pos_bound` (the KV
    /// rows are written; `h` holds the last layer's output).
    pub(super) fn record_layers(&self, pass: &mut wgpu::ComputePass<'_>, pos_bound: u32) {
        self.record_layers_marked(pass, pos_bound, None, &mut |_, _| {});
    }

    /// [`Self::record_layers`] calling `mark(pass, op)` after each op (profile.rs).
    pub(super) fn record_layers_marked<F: FnMut(&mut wgpu::ComputePass<'_>, &'static str)>(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pos_bound: u32,
        slot: Option<usize>,
        mark: &mut F,
    ) {
        self.k.embed.record(pass, &self.embed);
        mark(pass, "embed");
        for (l, lb) in self.layers.iter().enumerate() {
            let attn = match slot {
                Some(s) => (&self.slot_attn[s][l], self.slot_qkv_attn[s].get(l)),
                None => (&lb.attn, lb.qkv_attn.as_ref()),
            };
            self.record_layer_marked(pass, lb, attn, pos_bound, mark);
        }
    }

    pub(super) fn record_layer(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        lb: &LayerBinding,
        pos_bound: u32,
    ) {
        let attn = (&lb.attn, lb.qkv_attn.as_ref());
        self.record_layer_marked(pass, lb, attn, pos_bound, &mut |_, _| {});
    }

    /// [`Self::record_layer`] calling `mark(pass, op)` after each op's dispatches (the
    /// profile's timestamps, profile.rs); `attn` is the attention binding and the qkv +
    /// attention one (if any) on the plan's own cache or on a KV slot's.
    pub(super) fn record_layer_marked<F: FnMut(&mut wgpu::ComputePass<'_>, &'static str)>(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        lb: &LayerBinding,
        attn: (&AttentionBinding, Option<&QkvAttentionBinding>),
        pos_bound: u32,
        mark: &mut F,
    ) {
        let k = &self.k;
        if let Some(n) = &lb.norm1 {
            k.norm.record(pass, n);
            mark(pass, "rmsnorm (attention input)");
        }
        match (&k.qkv_attn, attn.1) {
            (Some(qk), Some(b)) if qk.serves(pos_bound) => {
                qk.record(pass, b);
                mark(pass, "qkv matvec + attention");
            }
            _ => {
                k.matvec.record(pass, &lb.qkv);
                mark(pass, "qkv matvec");
                k.attn.record_marked(pass, attn.0, pos_bound, mark);
            }
        }
        k.matvec.record(pass, &lb.o);
        mark(
            pass,
            if self.opts.fold_router && lb.router.is_none() {
                "o-proj + folded router"
            } else {
                "o-proj"
            },
        );
        if let Some(n) = &lb.norm2 {
            k.norm.record(pass, n);
            mark(pass, "rmsnorm (MoE input)");
        }
        if let Some(r) = &lb.router {
            k.matvec.record(pass, r);
            mark(pass, "router matvec");
        }
        k.moe.record_marked(pass, &self.ctx, &lb.moe, mark);
    }

    /// Record one step (`pick`: how the next token is chosen on the GPU, if at all) calling
    /// `mark(pass, op)` after each op (profile.rs), on the plan's own cache (`slot` None) or on
    /// multi-stream KV slot `slot` (plan_slots.rs).
    pub(crate) fn record_step_marked<F: FnMut(&mut wgpu::ComputePass<'_>, &'static str)>(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pos_bound: u32,
        pick: Pick,
        slot: Option<usize>,
        mark: &mut F,
    ) {
        self.record_layers_marked(pass, pos_bound, slot, mark);
        if !self.fused {
            self.k.norm.record(pass, &self.final_norm);
            mark(pass, "final rmsnorm");
        }
        self.record_head(pass);
        mark(pass, "lm_head");
        match pick {
            Pick::Logits => {}
            Pick::Argmax => {
                self.k.argmax.record(pass, &self.argmax);
                mark(pass, "argmax");
            }
            Pick::Sample => {
                self.k.sample.record(pass, &self.sample);
                mark(pass, "sample");
            }
        }
    }
}
