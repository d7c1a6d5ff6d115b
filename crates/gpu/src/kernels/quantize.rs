//! The activation quantiser of the int8 numerics: f32 `x[n]` -> [`QuantActs`] (tensor.rs layout,
//! one thread per block of 32), plain or precise int8, for the int4 x int8 matvecs (matvec.rs).

use crate::context::{Context, GpuError, Result};
use crate::numerics::{act_out_wgsl, Numerics};
use crate::state::with_state;
use crate::tensor::{QuantActs, BLOCK};

/// The activation quantiser: f32 `x[n]` -> [`QuantActs`] (one thread per block of 32).
pub struct QuantizeKernel {
    /// Plain and precise int8 outputs.
    plain: wgpu::ComputePipeline,
    precise: wgpu::ComputePipeline,
}

/// Bind group of one quantisation.
pub struct QuantizeBinding {
    precise: bool,
    bg: wgpu::BindGroup,
    grid: (u32, u32),
}

impl QuantizeKernel {
    pub fn new(ctx: &Context) -> Result<QuantizeKernel> {
        let src = |n: Numerics| {
            let body = include_str!("../shaders/quantize.wgsl");
            with_state(&format!("{}{body}", act_out_wgsl(n, 1, 2)))
        };
        Ok(QuantizeKernel {
            plain: ctx.compute("quantize", &src(Numerics::Int8), "main")?,
            precise: ctx.compute("quantize.precise", &src(Numerics::PreciseInt8), "main")?,
        })
    }

    /// Quantise the first `out.n` values of `x` into `out`.
    pub fn bind(
        &self,
        ctx: &Context,
        x: &wgpu::Buffer,
        out: &QuantActs,
        state: &wgpu::Buffer,
    ) -> Result<QuantizeBinding> {
        if x.size() < out.n as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "quantize: x holds {} bytes for {} values",
                x.size(),
                out.n
            )));
        }
        let blocks = out.n / BLOCK as u32;
        let grid = ctx.grid(blocks.div_ceil(64));
        let p = ctx.uniform(
            "quantize.params",
            bytemuck::cast_slice(&[blocks, grid.0, 0, 0]),
        )?;
        let pipe = if out.precise {
            &self.precise
        } else {
            &self.plain
        };
        let bg = ctx.bind_group(
            "quantize",
            pipe,
            &[
                x.as_entire_binding(),
                out.q.as_entire_binding(),
                out.s.as_entire_binding(),
                p.as_entire_binding(),
                state.as_entire_binding(),
            ],
        )?;
        Ok(QuantizeBinding {
            precise: out.precise,
            bg,
            grid,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &QuantizeBinding) {
        pass.set_pipeline(if b.precise {
            &self.precise
        } else {
            &self.plain
        });
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(b.grid.0, b.grid.1, 1);
    }
}
