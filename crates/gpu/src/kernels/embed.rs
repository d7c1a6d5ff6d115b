//! Embedding lookup: dequantise row `state.token` of the Q4_0 embedding `[V, H]` into the
//! residual stream `h[H]`. The token id is read on the GPU, so the bind group is made once and
//! a run never syncs with the host. A matrix split across bindings is one dispatch per part;
//! only the part holding the token writes.

use crate::context::{Context, GpuError, Result};
use crate::state::with_state;
use crate::tensor::{Q4Matrix, BLOCK};

pub struct EmbedKernel {
    pipeline: wgpu::ComputePipeline,
}

/// Bind groups (one per embedding part) and the grid.
pub struct EmbedBinding {
    dispatches: Vec<wgpu::BindGroup>,
    groups: u32,
}

impl EmbedBinding {
    /// Dispatches [`EmbedKernel::record`] issues (one per embedding part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

impl EmbedKernel {
    pub fn new(ctx: &Context) -> Result<EmbedKernel> {
        Ok(EmbedKernel {
            pipeline: ctx.compute(
                "embed",
                &with_state(include_str!("../shaders/embed.wgsl")),
                "main",
            )?,
        })
    }

    /// `h[0..cols] = dequant(table[state.token])`.
    pub fn bind(
        &self,
        ctx: &Context,
        table: &Q4Matrix,
        h: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<EmbedBinding> {
        if h.size() < table.cols as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "embed: h holds {} bytes for {} columns",
                h.size(),
                table.cols
            )));
        }
        let bpr = table.cols / BLOCK as u32;
        let dispatches = table
            .parts
            .iter()
            .map(|part| {
                let p = ctx.uniform(
                    "embed.params",
                    bytemuck::cast_slice(&[part.rows, bpr, part.row_start, 0]),
                )?;
                ctx.bind_group(
                    "embed",
                    &self.pipeline,
                    &[
                        part.qs.as_entire_binding(),
                        part.scales.as_entire_binding(),
                        h.as_entire_binding(),
                        p.as_entire_binding(),
                        state.as_entire_binding(),
                    ],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(EmbedBinding {
            dispatches,
            groups: bpr.div_ceil(64),
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &EmbedBinding) {
        pass.set_pipeline(&self.pipeline);
        for bg in &b.dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(b.groups, 1, 1);
        }
    }
}
