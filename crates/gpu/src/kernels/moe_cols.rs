//! The MoE block over columns (multi-stream decode, batched prefill; [`crate::columns`]): for
//! each column `c < nb` that is not done, the fused routing + gate/up and the down + combine of
//! moe.rs on that column's token, in the same two dispatches per weight part for all columns.
//!
//! Buffers (column `c` at `c * n`, `n` the single-token length): router logits `[nb, E]`, x (the
//! post-attention RMSNorm output) `[nb, H]` f32, route `[nb, 2K]` u32 (per column: ids, then f32
//! weight bits), h `[nb, K*I]` f32, out (the residual stream) `[nb, H]` f32. Grids: gate/up
//! `(I / R, K, nb)`, down `(gx, gy, nb)` (z = the column). A done column's route, h and out are
//! left untouched.
//!
//! Only the staged f32 kernels have column forms (the real model's shapes are staged); the int8
//! numerics and f32 past [`super::STAGE_BUDGET`] return an error here.
//!
//! Gate/up reads the union of the experts the live columns chose, each once
//! ([`ColsGateUp::Union`], `gate_up_union_cols` in moe_gate_up_f32.wgsl): workgroup (b, k, c)
//! routes column c, and the first (column, rank) that chose an expert owns it; the owner keeps
//! its lanes' weight blocks of that expert in registers and applies them to every column that
//! chose it, one staged x after the other (all 8 columns' x at once would be 64 KiB at the real
//! shape), with the single-token dots and sums in the same order, so every h value is
//! bit-identical to the single-token kernel's. The other workgroups exit after routing.
//! Down still runs per column (a column's output row sums its K experts' blocks in one
//! per-lane chain that interleaves the experts, so sharing an expert's rows across columns
//! within one workgroup would need every union expert's rows or every column's partial items
//! held at once, or a second pass): columns that chose the same expert share its down rows only
//! through the cache. [`ColsGateUp::PerColumn`] keeps the per-column gate/up for benchmarks.

use super::{down_params, gate_up_params, need, whole, MoeKernel};
use crate::context::{Context, GpuError, Result};
use crate::kernels::embed::check_cols;
use crate::tensor::Q4Matrix;

/// The buffers of one layer's MoE block over `nb` columns.
#[derive(Debug, Clone, Copy)]
pub struct MoeColsBuffers<'a> {
    /// Run state (`State` in shaders/state.wgsl): `done` once every column is done.
    pub state: &'a wgpu::Buffer,
    /// The [`crate::columns`] buffer (read only).
    pub cols: &'a wgpu::Buffer,
    /// Columns, `1..=MAX_COLUMNS` (the grids' z).
    pub nb: u32,
    /// `[nb, E]` f32 router logits.
    pub logits: &'a wgpu::Buffer,
    /// `[nb, 2K]` u32 route (written here: per column ids, then f32 weight bits).
    pub route: &'a wgpu::Buffer,
    /// `[nb, H]` f32 input (post-attention RMSNorm output).
    pub x: &'a wgpu::Buffer,
    /// `[E*I, H]` gate and up, `[E*H, I]` down.
    pub gate: &'a Q4Matrix,
    pub up: &'a Q4Matrix,
    pub down: &'a Q4Matrix,
    /// `[nb, K, I]` f32 SiLU(gate) * up (scratch, also read by tests).
    pub h: &'a wgpu::Buffer,
    /// `[nb, H]` f32 output.
    pub out: &'a wgpu::Buffer,
    /// Add the MoE output into `out` (the residual stream) instead of overwriting it.
    pub residual: bool,
}

/// Which gate/up kernel a column binding records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColsGateUp {
    /// Each chosen expert's gate/up read once for all the columns that chose it (the default).
    #[default]
    Union,
    /// Every column reads its own K experts (the earlier form, for side-by-side benchmarks).
    PerColumn,
}

/// The compiled column pipelines of a [`MoeKernel`].
#[derive(Debug)]
pub(super) struct ColsPipelines {
    /// `gate_up_union_cols`.
    union: wgpu::ComputePipeline,
    /// `gate_up_routed_cols`.
    per_column: wgpu::ComputePipeline,
    /// `main_cols`.
    down: wgpu::ComputePipeline,
}

impl ColsPipelines {
    /// The column entry points of the compiled gate/up and down modules.
    pub(super) fn new(
        ctx: &Context,
        gate_up: &wgpu::ShaderModule,
        down: &wgpu::ShaderModule,
    ) -> Result<Self> {
        Ok(ColsPipelines {
            union: ctx.pipeline("moe.gate_up_union_cols", gate_up, "gate_up_union_cols")?,
            per_column: ctx.pipeline("moe.gate_up_routed_cols", gate_up, "gate_up_routed_cols")?,
            down: ctx.pipeline("moe.down_cols", down, "main_cols")?,
        })
    }

    fn gate_up(&self, form: ColsGateUp) -> &wgpu::ComputePipeline {
        match form {
            ColsGateUp::Union => &self.union,
            ColsGateUp::PerColumn => &self.per_column,
        }
    }
}

/// Bind groups of one layer's MoE block over columns, created once.
#[derive(Debug)]
pub struct MoeColsBinding {
    form: ColsGateUp,
    /// One per weight part.
    gate_up: Vec<wgpu::BindGroup>,
    down: Vec<wgpu::BindGroup>,
    nb: u32,
}

impl MoeColsBinding {
    /// Dispatches [`MoeKernel::record_cols`] issues (one per weight part and stage: 2 when every
    /// weight fits one binding).
    pub fn dispatch_count(&self) -> usize {
        self.gate_up.len() + self.down.len()
    }
}

impl MoeKernel {
    /// Whether this kernel has the column forms (f32 numerics, both stages staged).
    pub fn supports_cols(&self) -> bool {
        self.cols.is_some()
    }

    /// Check shapes and create the bind groups of one layer's MoE block over `b.nb` columns
    /// (the union gate/up).
    pub fn bind_cols(&self, ctx: &Context, b: &MoeColsBuffers<'_>) -> Result<MoeColsBinding> {
        self.bind_cols_with(ctx, b, ColsGateUp::Union)
    }

    /// As [`Self::bind_cols`] with the gate/up form chosen (benchmarks compare them; every
    /// form writes the same route, h and out).
    pub fn bind_cols_with(
        &self,
        ctx: &Context,
        b: &MoeColsBuffers<'_>,
        form: ColsGateUp,
    ) -> Result<MoeColsBinding> {
        let Some(pipes) = &self.cols else {
            return Err(GpuError::Shape(format!(
                "MoE over columns needs f32 activations and both stages staged (numerics {}, \
                 staged {:?}); one column at a time uses bind",
                self.numerics, self.staged
            )));
        };
        check_cols(b.cols, b.nb, "MoE columns")?;
        self.check_weights(b.gate, b.up, b.down)?;
        let p = &self.params;
        let (nb, e, k, h, i) = (
            b.nb as u64,
            p.experts as u64,
            p.top_k as u64,
            p.hidden as u64,
            p.inter as u64,
        );
        need(b.state, 16, "state")?;
        need(b.logits, nb * e * 4, "column logits [nb, E]")?;
        need(b.route, nb * 2 * k * 4, "column route [nb, 2K]")?;
        need(b.x, nb * h * 4, "column x [nb, H]")?;
        need(b.h, nb * k * i * 4, "column h [nb, K*I]")?;
        need(b.out, nb * h * 4, "column out [nb, H]")?;
        let mut gate_up = Vec::with_capacity(b.gate.parts.len());
        for (n, (g, u)) in b.gate.parts.iter().zip(&b.up.parts).enumerate() {
            let params = gate_up_params(ctx, g, u, p.inter, n)?;
            let res = [
                (0, whole(b.state)),
                (1, whole(&params)),
                (2, whole(b.logits)),
                (3, whole(b.route)),
                (4, whole(b.x)),
                (6, whole(&g.qs)),
                (7, whole(&g.scales)),
                (8, whole(&u.qs)),
                (9, whole(&u.scales)),
                (10, whole(b.h)),
                (13, whole(b.cols)),
            ];
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            let pipe = pipes.gate_up(form);
            gate_up.push(ctx.bind_group_at("moe.gate_up_cols", pipe, &ids, &res)?);
        }
        let mut down = Vec::with_capacity(b.down.parts.len());
        for (n, part) in b.down.parts.iter().enumerate() {
            let params = down_params(ctx, part, p.hidden, b.residual || n > 0)?;
            let res = [
                (0, whole(b.state)),
                (1, whole(&params)),
                (2, whole(b.route)),
                (3, whole(b.h)),
                (5, whole(&part.qs)),
                (6, whole(&part.scales)),
                (7, whole(b.out)),
                (8, whole(b.cols)),
            ];
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            down.push(ctx.bind_group_at("moe.down_cols", &pipes.down, &ids, &res)?);
        }
        Ok(MoeColsBinding {
            form,
            gate_up,
            down,
            nb: b.nb,
        })
    }

    /// Record one layer's MoE dispatches over the binding's columns (no host sync): gate/up per
    /// weight part, then down per part, each with the column as the grid's z.
    pub fn record_cols(&self, pass: &mut wgpu::ComputePass<'_>, ctx: &Context, b: &MoeColsBinding) {
        // bind_cols only succeeds with the column pipelines, so a binding implies them.
        let Some(pipes) = &self.cols else {
            return;
        };
        let ((ux, uy), (gx, gy)) = self.grids(ctx);
        pass.set_pipeline(pipes.gate_up(b.form));
        for bg in &b.gate_up {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(ux, uy, b.nb);
        }
        pass.set_pipeline(&pipes.down);
        for bg in &b.down {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(gx, gy, b.nb);
        }
    }
}

#[cfg(test)]
#[path = "moe_cols_tests.rs"]
mod tests;
