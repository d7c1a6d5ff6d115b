//! The attention's partial buffers, and the deep kernel: a second [`AttentionKernel`] of
//! another chunk shape and split that records the single-sequence steps from a position on
//! (`--tune attn_deep=P`). Runs 175-176 (docs/BENCHMARKS.md) found no one shape best at every
//! depth: the streamed body with 64-row key blocks over fewer, longer chunks is 33% faster per
//! layer at position 16384 but its whole-token decode is 9% slower at depth 0, where every
//! chunk is the minimum 16 positions.
//!
//! The multi-stream and prefill column forms (`bind_cols`) keep the first kernel: with a deep
//! kernel, a sequence past `P` decoded alone takes other bits than on a stream slot.

use super::{need, GpuError, Result};
use super::{AttentionBinding, AttentionKernel, AttentionScratch, ChunkShape, Context};

/// The kernel that serves steps whose position bound is at least `from`.
#[derive(Debug, Clone)]
pub(super) struct Deep {
    pub kernel: AttentionKernel,
    pub from: u32,
}

impl Deep {
    /// This with `f` applied to its kernel.
    pub fn map(self, f: impl FnOnce(AttentionKernel) -> AttentionKernel) -> Deep {
        Deep {
            kernel: f(self.kernel),
            from: self.from,
        }
    }
}

impl AttentionKernel {
    /// This kernel with `deep` recording the steps whose position bound is `from` or more (both
    /// are exact at every position: the pick is for speed). `deep` must be built for the same
    /// params and need no more partial slots (it writes into this kernel's scratch); it takes
    /// this kernel's merge.
    pub fn with_deep(self, deep: AttentionKernel, from: u32) -> Result<Self> {
        if deep.params != self.params || deep.deep.is_some() {
            return Err(GpuError::Shape(
                "attention: a deep kernel must share the params and have no deep kernel itself"
                    .into(),
            ));
        }
        if deep.split.slots() > self.split.slots() {
            return Err(GpuError::Shape(format!(
                "attention: the deep kernel's split needs {} partial slots per head, the first {}",
                deep.split.slots(),
                self.split.slots()
            )));
        }
        let deep = deep
            .with_combine(self.merge)
            .with_fused_max_chunks(self.fused_max);
        Ok(AttentionKernel {
            deep: Some(Box::new(Deep { kernel: deep, from })),
            ..self
        })
    }

    /// The deep kernel's first position and chunk shape, if this kernel has one.
    pub fn deep_shape(&self) -> Option<(u32, ChunkShape)> {
        (self.deep.as_ref()).map(|d| (d.from, d.kernel.shape))
    }

    /// The deep kernel and its binding when they record a step at `pos_bound`.
    pub(super) fn deep_for<'a>(
        &'a self,
        b: &'a AttentionBinding,
        pos_bound: u32,
    ) -> Option<(&'a AttentionKernel, &'a AttentionBinding)> {
        match (&self.deep, &b.deep) {
            (Some(d), Some(db)) if pos_bound >= d.from => Some((&d.kernel, db)),
            _ => None,
        }
    }

    /// Bytes of one column's partials ([`Self::scratch_cols`] holds `columns` of them).
    pub fn scratch_bytes_per_column(&self) -> u64 {
        let p = &self.params;
        p.heads as u64 * self.split.slots() as u64 * (p.head_dim as u64 + 2) * 4
            + p.kv_heads as u64 * 4
    }

    /// Partial buffers sized for the whole cache.
    pub fn scratch(&self, ctx: &Context) -> Result<AttentionScratch> {
        self.scratch_for(ctx, 1)
    }

    /// Partial buffers for `columns` columns (validated by the caller) over the whole cache.
    pub(super) fn scratch_for(&self, ctx: &Context, columns: u32) -> Result<AttentionScratch> {
        let p = &self.params;
        let n = columns as u64 * p.heads as u64 * self.split.slots() as u64;
        if n * p.head_dim as u64 >= 1 << 31 {
            return Err(GpuError::Shape(format!(
                "attention partials of {columns} columns exceed 2^31 elements"
            )));
        }
        Ok(AttentionScratch {
            part_o: ctx.storage("attention.part_o", n * p.head_dim as u64 * 4)?,
            part_ml: ctx.storage("attention.part_ml", n * 8)?,
            arrive: ctx.storage("attention.arrive", columns as u64 * p.kv_heads as u64 * 4)?,
            columns,
        })
    }

    /// Error unless `scratch` holds this kernel's partials and arrival counters for `columns`
    /// columns: a scratch made by another kernel (another split, fewer heads) may be smaller,
    /// and the chunk modules read and write them unchecked.
    pub(super) fn check_scratch(&self, scratch: &AttentionScratch, columns: u32) -> Result<()> {
        let p = &self.params;
        let slots = columns as u64 * p.heads as u64 * self.split.slots() as u64;
        need(&scratch.part_o, slots * p.head_dim as u64, "part_o")?;
        need(&scratch.part_ml, slots * 2, "part_ml")?;
        need(
            &scratch.arrive,
            columns as u64 * p.kv_heads as u64,
            "arrive",
        )
    }
}
