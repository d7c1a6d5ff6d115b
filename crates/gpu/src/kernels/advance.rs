//! The prefill state advance: between two prompt tokens recorded in one pass, set the run
//! state's token to the next prompt id (read from a GPU buffer) and step the position, so a
//! whole prompt chunk runs with one submit and no readback (shaders/advance.wgsl).

use crate::context::{Context, GpuError, Result};
use crate::state::with_state;

/// The advance pipeline.
pub struct AdvanceKernel {
    pipeline: wgpu::ComputePipeline,
}

/// Bind group of one (state, prompt) pair.
pub struct AdvanceBinding {
    bg: wgpu::BindGroup,
}

impl AdvanceKernel {
    pub fn new(ctx: &Context) -> Result<AdvanceKernel> {
        Ok(AdvanceKernel {
            pipeline: ctx.compute(
                "advance",
                &with_state(include_str!("../shaders/advance.wgsl")),
                "main",
            )?,
        })
    }

    /// `prompt` holds the chunk's token ids `[chunk]` u32 (at least one).
    pub fn bind(
        &self,
        ctx: &Context,
        state: &wgpu::Buffer,
        prompt: &wgpu::Buffer,
    ) -> Result<AdvanceBinding> {
        if prompt.size() < 4 || state.size() < 16 {
            return Err(GpuError::Shape(
                "advance: empty prompt or state buffer".into(),
            ));
        }
        let bg = ctx.bind_group(
            "advance",
            &self.pipeline,
            &[state.as_entire_binding(), prompt.as_entire_binding()],
        )?;
        Ok(AdvanceBinding { bg })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &AdvanceBinding) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
}
