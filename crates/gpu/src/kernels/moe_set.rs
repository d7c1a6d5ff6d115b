//! The MoE kernels of a model whose layers' expert matrices differ in block form: one
//! [`MoeKernel`] per `(gate and up, down)` pair of forms the layers have (a `Q4_K_M` file's
//! down is Q6_K in the layers llama.cpp gives more bits and Q4_K in the others: two kernels).
//! Each binding remembers its kernel, so a plan binds and records every layer through the set
//! as it would through one kernel, and a model of one form compiles one kernel as before.

use super::{F32Tuning, MoeParams, Routing};
use super::{MoeBinding, MoeBuffers, MoeColsBinding, MoeColsBuffers, MoeFolded, MoeKernel};
use crate::context::{Context, GpuError, Result};
use crate::numerics::Numerics;
use crate::tensor::{Q4Matrix, QForm};

/// One MoE kernel per pair of expert forms, in the order the pairs were first asked for.
#[derive(Debug)]
pub struct MoeSet {
    kernels: Vec<MoeKernel>,
}

impl MoeSet {
    /// The kernels for the `(gate and up, down)` form pairs in `pairs` (repeats are compiled
    /// once; at least one pair).
    pub fn new(
        ctx: &Context,
        params: MoeParams,
        numerics: Numerics,
        tune: F32Tuning,
        pairs: &[(QForm, QForm)],
    ) -> Result<MoeSet> {
        let mut kernels: Vec<MoeKernel> = Vec::new();
        for &pair in pairs {
            if !kernels.iter().any(|k| k.forms() == pair) {
                kernels.push(MoeKernel::with_forms(ctx, params, numerics, tune, pair)?);
            }
        }
        if kernels.is_empty() {
            return Err(GpuError::Shape(
                "MoE: no expert forms to compile for".into(),
            ));
        }
        Ok(MoeSet { kernels })
    }

    /// The down slot groups in use, as `-v` prints them: one number where every kernel has
    /// the same, else each down form's in the order first asked for (`Q6_K 8, Q4_K 4` for a
    /// `Q4_K_M` file, whose layer 0 has the Q6_K down; a byte form's down takes
    /// [`F32Tuning::down_split_wide`]).
    pub fn down_splits(&self) -> String {
        let first = self.kernels[0].down_split();
        if self.kernels.iter().all(|k| k.down_split() == first) {
            return first.to_string();
        }
        let mut seen: Vec<(QForm, u32)> = Vec::new();
        for k in &self.kernels {
            let d = (k.forms().1, k.down_split());
            if !seen.contains(&d) {
                seen.push(d);
            }
        }
        let parts: Vec<String> = seen
            .iter()
            .map(|(f, d)| format!("{} {d}", f.name()))
            .collect();
        parts.join(", ")
    }

    /// Kernels compiled (one per distinct pair of forms).
    pub fn len(&self) -> usize {
        self.kernels.len()
    }

    /// Never empty ([`Self::new`] refuses no pairs); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.kernels.is_empty()
    }

    /// The kernel reading `gate`/`up` and `down` as they are (a matrix of mixed or unknown
    /// form is bound to the first kernel, whose checks name the mismatch).
    fn pick(&self, gate: &Q4Matrix, down: &Q4Matrix) -> usize {
        let pair = (gate.form(), down.form());
        self.kernels
            .iter()
            .position(|k| {
                let (g, d) = k.forms();
                (pair.0.is_none() || pair.0 == Some(g)) && (pair.1.is_none() || pair.1 == Some(d))
            })
            .unwrap_or(0)
    }

    /// [`MoeKernel::bind`] with the kernel of the layer's forms.
    pub fn bind(&self, ctx: &Context, b: &MoeBuffers<'_>, routing: Routing) -> Result<MoeBinding> {
        let k = self.pick(b.gate, b.down);
        let mut out = self.kernels[k].bind(ctx, b, routing)?;
        out.kernel = k;
        Ok(out)
    }

    /// [`MoeKernel::bind_folded`] with the kernel of the layer's forms.
    pub fn bind_folded(
        &self,
        ctx: &Context,
        b: &MoeBuffers<'_>,
        f: &MoeFolded<'_>,
    ) -> Result<MoeBinding> {
        let k = self.pick(b.gate, b.down);
        let mut out = self.kernels[k].bind_folded(ctx, b, f)?;
        out.kernel = k;
        Ok(out)
    }

    /// [`MoeKernel::bind_cols`] with the kernel of the layer's forms.
    pub fn bind_cols(&self, ctx: &Context, b: &MoeColsBuffers<'_>) -> Result<MoeColsBinding> {
        let k = self.pick(b.gate, b.down);
        let mut out = self.kernels[k].bind_cols(ctx, b)?;
        out.kernel = k;
        Ok(out)
    }

    /// Whether every kernel has the folded-router forms.
    pub fn can_fold(&self) -> bool {
        self.kernels.iter().all(MoeKernel::can_fold)
    }

    /// [`MoeKernel::record`] by the binding's kernel.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, ctx: &Context, b: &MoeBinding) {
        self.kernels[b.kernel].record(pass, ctx, b);
    }

    /// [`MoeKernel::record_marked`] by the binding's kernel.
    pub fn record_marked<F: FnMut(&mut wgpu::ComputePass<'_>, &'static str)>(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        ctx: &Context,
        b: &MoeBinding,
        mark: &mut F,
    ) {
        self.kernels[b.kernel].record_marked(pass, ctx, b, mark);
    }

    /// [`MoeKernel::record_cols`] by the binding's kernel.
    pub fn record_cols(&self, pass: &mut wgpu::ComputePass<'_>, ctx: &Context, b: &MoeColsBinding) {
        self.kernels[b.kernel].record_cols(pass, ctx, b);
    }
}
