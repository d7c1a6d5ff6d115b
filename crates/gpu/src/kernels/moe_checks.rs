//! The MoE binders' weight checks: shapes, splits and block form of the expert matrices
//! (the unchecked staged modules rely on them, moe.rs `unchecked_staged`).

use super::MoeKernel;
use crate::context::{GpuError, Result};
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
        for (what, m) in [("MoE gate", gate), ("MoE up", up), ("MoE down", down)] {
            m.check_layout(what)?;
            if m.form != self.form {
                return Err(GpuError::Shape(format!(
                    "{what}: the kernels read {} matrices, this one is {}",
                    self.form.name(),
                    m.form.name()
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
