//! Accessors and counts of a built [`DecodePlan`] (split from plan.rs): the folded router's
//! recomputation after a weight changed, the kernel forms chosen, and the dispatches a step
//! records.

use super::{DecodePlan, MatvecBinding, MoeKernel, RouterFoldKernel};
use crate::kernels::attention::Combine;
#[cfg(test)]
use crate::kernels::matvec::MatvecKernel;
use crate::weights::Matrix;

impl DecodePlan {
    /// Recompute layer `layer`'s folded router from its o-proj, router and norm weight on the
    /// GPU (after plant.rs changed one of them); a no-op when the router is not folded.
    pub fn refold(&self, layer: usize) -> anyhow::Result<()> {
        let (Some(out), Some(lw)) = (self.folds.get(layer), self.weights.layers.get(layer)) else {
            return Ok(());
        };
        match (&lw.o, &lw.router) {
            (Matrix::Q4(o), Matrix::F32(r)) => {
                RouterFoldKernel::new(&self.ctx)?.fold_into(&self.ctx, o, r, &lw.ffn_norm, out)?;
                Ok(())
            }
            _ => anyhow::bail!("router fold: unexpected matrix forms"),
        }
    }

    /// The compiled matvec kernel (tests check which splits it binds).
    #[cfg(test)]
    pub(crate) fn matvec_for_tests(&self) -> &MatvecKernel {
        &self.k.matvec
    }

    /// Slot groups of the MoE down kernels (1: one workgroup sums a row block's K slots), per
    /// down form where they differ ([`crate::kernels::moe::MoeSet::down_splits`]).
    pub fn moe_down_splits(&self) -> String {
        self.k.moe.down_splits()
    }

    /// Where the attention merges chunk partials ([`Combine`]).
    pub fn attention_combine(&self) -> Combine {
        self.k.attn.combine()
    }

    /// The attention's chunk body ([`crate::kernels::attention::ChunkShape`]).
    pub fn attention_shape(&self) -> crate::kernels::attention::ChunkShape {
        self.k.attn.shape()
    }

    /// The deep attention kernel's first position and chunk body, if the plan has one
    /// (`--tune attn_deep`).
    pub fn attention_deep(&self) -> Option<(u32, crate::kernels::attention::ChunkShape)> {
        self.k.attn.deep_shape()
    }

    /// Bytes of the folded router matrices (router_fold.rs; 0 when the router has its own
    /// dispatch).
    pub fn fold_bytes(&self) -> u64 {
        self.folds.iter().map(|b| b.size()).sum()
    }

    /// Layers whose qkv dispatch warms the o-proj's weights into L2, whose MoE down warms the
    /// next layer's qkv, and whose MoE gate/up warms its experts' down weights (`--tune warm`,
    /// kernels/warm.rs).
    pub fn warmed_layers(&self) -> (usize, usize, usize) {
        self.warmed
    }

    /// Positions below which the qkv dispatch also attends (kernels/qkv_attention.rs: 4
    /// dispatches per layer instead of 5), or None where that form is not built.
    pub fn qkv_attention_positions(&self) -> Option<u32> {
        self.k.qkv_attn.as_ref().map(|k| k.max_positions())
    }

    /// Dispatches of layer `lb`'s qkv and attention for a step at a position up to `pos_bound`
    /// on the plan's own cache.
    fn qkv_attention_dispatches(&self, lb: &super::LayerBinding, pos_bound: u32) -> usize {
        match (&self.k.qkv_attn, &lb.qkv_attn) {
            (Some(k), Some(_)) if k.serves(pos_bound) => 1,
            _ => lb.qkv.dispatch_count() + self.k.attn.dispatches(&lb.attn, pos_bound) as usize,
        }
    }

    /// Dispatches one recorded step issues (with argmax), at position 0 (attention takes one
    /// dispatch per layer while a chunk covers the context, two after).
    pub fn dispatches_per_step(&self) -> usize {
        self.dispatches_per_step_at(0)
    }

    /// [`Self::dispatches_per_step`] for a step at a position up to `pos_bound`.
    pub fn dispatches_per_step_at(&self, pos_bound: u32) -> usize {
        let count = |b: &MatvecBinding| b.dispatch_count();
        let per_layer: usize = self
            .layers
            .iter()
            .map(|lb| {
                lb.norm1.is_some() as usize
                    + lb.norm2.is_some() as usize
                    + self.qkv_attention_dispatches(lb, pos_bound)
                    + count(&lb.o)
                    + lb.router.as_ref().map_or(0, count)
                    + MoeKernel::dispatches(self.opts.routing) as usize
            })
            .sum();
        let head = self.head.dispatch_count();
        self.embed.dispatch_count() + per_layer + !self.fused as usize + head + 2
    }
}
