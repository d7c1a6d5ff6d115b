//! The decode plan's lm_head: its binding forms and their recording (plan.rs).

use super::DecodePlan;
use crate::kernels::matmul::MatmulBinding;
use crate::kernels::matvec::{BfpQuantBinding, MatvecBinding};

/// The lm_head: the fused plan's int4 head is by default (`--tune head=4`) a one-workgroup
/// dispatch converting `rmsnorm(h)` to bfp24 once and the matvec reading those blocks from
/// global memory with two rows per team, each activation block a lane loads serving both rows
/// (`BfpGlobal`; 70.4 us against 79.0 with one row per team, `--tune head=3`, the default of
/// runs 67-103, and the matmul's 88.2 in kernel_bench; tg128 +0.3% over head=3, run 104);
/// `--tune head=0` the one-column matmul normalising on load (its
/// tall-matrix tile reads 151936 x 2048 in 88 us vs the f32 matvec's 116), `--tune head=1|2`
/// the norm-on-load matvec in f32 or bfp24 (`Bfp`, recorded with [`Kernels::head_bfp`]);
/// otherwise a matvec.
pub(super) enum HeadBinding {
    Matvec(MatvecBinding),
    Bfp(MatvecBinding),
    /// The conversion, the matvec, its rows per team (1 or 2).
    BfpGlobal(BfpQuantBinding, MatvecBinding, u32),
    Matmul(MatmulBinding),
}

impl HeadBinding {
    pub(super) fn dispatch_count(&self) -> usize {
        match self {
            HeadBinding::Matvec(b) | HeadBinding::Bfp(b) => b.dispatch_count(),
            HeadBinding::BfpGlobal(_, b, _) => 1 + b.dispatch_count(),
            HeadBinding::Matmul(b) => b.dispatch_count(),
        }
    }

    /// The form `--verbose` names.
    pub(super) fn name(&self) -> &'static str {
        match self {
            HeadBinding::Matvec(_) => "matvec",
            HeadBinding::Bfp(_) => "matvec (bfp24)",
            HeadBinding::BfpGlobal(.., 1) => "bfp24 conversion + matvec",
            HeadBinding::BfpGlobal(..) => "bfp24 conversion + matvec (2 rows per team)",
            HeadBinding::Matmul(_) => "one-column matmul",
        }
    }
}

impl DecodePlan {
    pub(super) fn record_head(&self, pass: &mut wgpu::ComputePass<'_>) {
        match &self.head {
            HeadBinding::Matvec(b) => self.k.matvec.record(pass, b),
            HeadBinding::Bfp(b) => {
                if let Some(hk) = &self.k.head_bfp {
                    hk.record(pass, b)
                }
            }
            HeadBinding::BfpGlobal(q, b, _) => {
                if let Some(qk) = &self.k.head_quant {
                    qk.record(pass, q);
                    self.k.matvec.record(pass, b);
                }
            }
            HeadBinding::Matmul(b) => self.k.matmul.record(pass, b),
        }
    }

    /// The lm_head's form, for `--verbose`.
    pub fn head_form(&self) -> &'static str {
        self.head.name()
    }
}
