//! The bfp24 conversion dispatch of the matvec's bfp24 numerics (matvec.rs): one workgroup
//! turns `rmsnorm(h)` into the blocks the bfp24 forms read.

use super::super::matvec_wgsl::bfp_quant_wgsl;
use super::{check_norm_input, NormInput};
use crate::context::{Context, Result};
use crate::numerics::BfpActs;
use crate::state::with_state;

/// The bfp24 conversion dispatch: `rmsnorm(h)` into [`BfpActs`] by one workgroup (the same
/// blocks the bfp24 norm-on-load matvec stages), for matvecs that then read it as
/// [`crate::numerics::Act::Bfp`] with no per-workgroup staging (`--tune head=3`: the lm_head).
pub struct BfpQuantKernel {
    pipeline: wgpu::ComputePipeline,
}

/// One bound conversion, ready to record.
pub struct BfpQuantBinding {
    bind_group: wgpu::BindGroup,
}

impl BfpQuantKernel {
    pub fn new(ctx: &Context) -> Result<Self> {
        let src = with_state(&bfp_quant_wgsl());
        Ok(BfpQuantKernel {
            pipeline: ctx.compute("bfp_quant", &src, "main")?,
        })
    }

    /// `out = bfp24(rmsnorm(x.h))` for `out.n` elements (at most [`super::NORM_ON_LOAD_MAX`]).
    pub fn bind(
        &self,
        ctx: &Context,
        x: NormInput<'_>,
        out: &BfpActs,
        state: &wgpu::Buffer,
    ) -> Result<BfpQuantBinding> {
        check_norm_input(&x, out.n, "bfp_quant")?;
        let words = [out.n / 4, x.eps.to_bits(), 0, 0];
        let p = ctx.uniform("bfp_quant.params", bytemuck::cast_slice(&words))?;
        let ids = [0, 1, 2, 3, 4, 5];
        let res = [
            state.as_entire_binding(),
            p.as_entire_binding(),
            x.h.as_entire_binding(),
            x.weight.as_entire_binding(),
            out.parts.as_entire_binding(),
            out.recs.as_entire_binding(),
        ];
        Ok(BfpQuantBinding {
            bind_group: ctx.bind_group_at("bfp_quant", &self.pipeline, &ids, &res)?,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &BfpQuantBinding) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bind_group, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
}
