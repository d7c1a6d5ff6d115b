//! The MoE binders' weight checks: shapes, splits and block form of the expert matrices
//! (the unchecked staged modules rely on them, moe.rs `unchecked_staged`), and the params
//! uniforms of a part's experts they bind.

use super::MoeKernel;
use crate::context::{Context, GpuError, Result};
use crate::tensor::Q4Matrix;

impl MoeKernel {
    /// Check the stacked expert weights' shapes and that gate and up are split alike.
    pub(super) fn check_weights(
        &self,
        gate: &Q4Matrix,
        up: &Q4Matrix,
        down: &Q4Matrix,
    ) -> Result<()> {
        let p = &self.params;
        let (e, h, i) = (p.experts, p.hidden, p.inter);
        let shape = |what: &str, m: &Q4Matrix, rows: u32, cols: u32| {
            if m.rows != rows || m.cols != cols {
                return Err(GpuError::Shape(format!(
                    "MoE {what}: [{}, {}], need [{rows}, {cols}]",
                    m.rows, m.cols
                )));
            }
            Ok(())
        };
        let (gu_form, down_form) = self.forms;
        for (what, m, form) in [
            ("MoE gate", gate, gu_form),
            ("MoE up", up, gu_form),
            ("MoE down", down, down_form),
        ] {
            m.check_layout(what)?;
            if m.parts.iter().any(|p| p.form != form) {
                return Err(GpuError::Shape(format!(
                    "{what}: the kernels read {} matrices, this one is {}",
                    form.name(),
                    m.form_names()
                )));
            }
        }
        shape("gate", gate, e * i, h)?;
        shape("up", up, e * i, h)?;
        shape("down", down, e * h, i)?;
        if gate.parts.len() != up.parts.len() {
            return Err(GpuError::Shape(
                "MoE gate and up are split differently".into(),
            ));
        }
        Ok(())
    }
}

/// Experts `[lo, hi)` held by `part` of a matrix with `per` rows per expert.
pub(super) fn expert_range(
    part: &crate::tensor::Q4Part,
    per: u32,
    what: &str,
) -> Result<(u32, u32)> {
    if part.row_start % per != 0 || part.rows % per != 0 {
        return Err(GpuError::Shape(format!(
            "{what}: part at row {} with {} rows splits an expert of {per} rows",
            part.row_start, part.rows
        )));
    }
    Ok((part.row_start / per, (part.row_start + part.rows) / per))
}

/// Error unless `buf` holds at least `bytes`.
pub(super) fn need(buf: &wgpu::Buffer, bytes: u64, what: &str) -> Result<()> {
    if buf.size() < bytes {
        return Err(GpuError::Shape(format!(
            "MoE {what}: {} bytes, need {bytes}",
            buf.size()
        )));
    }
    Ok(())
}

/// Params uniform of gate/up part `n` (gate part `g`, up part `u`, `i` rows per expert): the
/// experts it holds, and whether it writes the route (the first part only).
pub(super) fn gate_up_params(
    ctx: &Context,
    g: &crate::tensor::Q4Part,
    u: &crate::tensor::Q4Part,
    i: u32,
    n: usize,
) -> Result<wgpu::Buffer> {
    gate_up_params_eps(ctx, g, u, i, n, 0.0)
}

/// [`gate_up_params`] with the folded form's RMSNorm `eps` in the last word.
pub(super) fn gate_up_params_eps(
    ctx: &Context,
    g: &crate::tensor::Q4Part,
    u: &crate::tensor::Q4Part,
    i: u32,
    n: usize,
    eps: f32,
) -> Result<wgpu::Buffer> {
    let (lo, hi) = expert_range(g, i, "gate")?;
    if expert_range(u, i, "up")? != (lo, hi) {
        return Err(GpuError::Shape(
            "MoE gate and up parts hold different experts".into(),
        ));
    }
    ctx.uniform(
        "moe.gate_up.params",
        bytemuck::cast_slice(&[lo, hi, (n == 0) as u32, eps.to_bits()]),
    )
}

/// Params uniform of down part `part` (`h` rows per expert): the experts it holds, and whether it
/// adds into `out` (the residual, or a later part) or writes it.
pub(super) fn down_params(
    ctx: &Context,
    part: &crate::tensor::Q4Part,
    h: u32,
    accumulate: bool,
) -> Result<wgpu::Buffer> {
    let (lo, hi) = expert_range(part, h, "down")?;
    let acc = accumulate as u32;
    ctx.uniform("moe.down.params", bytemuck::cast_slice(&[lo, hi, acc, 0]))
}
