//! Greedy argmax over the logits on the GPU, feeding the next step without a host round trip.
//!
//! Two dispatches: `partial` (one workgroup per 2048 logits) and `finish` (one workgroup over
//! the partials), which also advances the run state (see `state.rs`): next token, output id,
//! `pos + 1`, `step + 1`, `done` on EOS or after the run's last step. Ties go to the lowest
//! index and NaN never wins over a number, exactly as [`argmax_ref`].

use crate::context::{Context, GpuError, Result};
use crate::state::with_state;

/// Logits reduced by one `partial` workgroup (must match `CHUNK` in argmax.wgsl).
const CHUNK: u32 = 256 * 8;

pub struct ArgmaxKernel {
    partial: wgpu::ComputePipeline,
    finish: wgpu::ComputePipeline,
}

/// What one argmax reads and writes.
pub struct ArgmaxArgs<'a> {
    /// `[n]` f32 logits.
    pub logits: &'a wgpu::Buffer,
    pub n: u32,
    /// The run state (read-write).
    pub state: &'a wgpu::Buffer,
    /// `[max_steps]` u32: the id chosen at step `s` lands in `out_tokens[s]`.
    pub out_tokens: &'a wgpu::Buffer,
    /// Steps of one run: `done` is set after this many.
    pub max_steps: u32,
    /// Ids that end generation.
    pub eos: &'a [u32],
}

pub struct ArgmaxBinding {
    partial: wgpu::BindGroup,
    finish: wgpu::BindGroup,
    nparts: u32,
    n: u32,
    /// `{ n, nparts, neos, max_steps }`, rewritten per run by [`ArgmaxBinding::set_run`].
    params: wgpu::Buffer,
    eos: wgpu::Buffer,
    eos_capacity: usize,
    out_capacity: u32,
}

impl ArgmaxBinding {
    /// Change the run length and EOS ids for the next submission (at most as many ids as the
    /// binding was created with, and at most the `out_tokens` capacity in steps).
    pub fn set_run(&self, ctx: &Context, max_steps: u32, eos: &[u32]) -> Result<()> {
        if eos.len() > self.eos_capacity || max_steps > self.out_capacity {
            return Err(GpuError::Shape(format!(
                "argmax run: {} EOS ids (capacity {}), {max_steps} steps (capacity {})",
                eos.len(),
                self.eos_capacity,
                self.out_capacity
            )));
        }
        if !eos.is_empty() {
            ctx.write(&self.eos, 0, bytemuck::cast_slice(eos));
        }
        ctx.write(
            &self.params,
            0,
            bytemuck::cast_slice(&[self.n, self.nparts, eos.len() as u32, max_steps]),
        );
        Ok(())
    }
}

impl ArgmaxKernel {
    pub fn new(ctx: &Context) -> Result<ArgmaxKernel> {
        let m = ctx.module(
            "argmax",
            &with_state(include_str!("../shaders/argmax.wgsl")),
        )?;
        Ok(ArgmaxKernel {
            partial: ctx.pipeline("argmax.partial", &m, "partial")?,
            finish: ctx.pipeline("argmax.finish", &m, "finish")?,
        })
    }

    pub fn bind(&self, ctx: &Context, a: &ArgmaxArgs<'_>) -> Result<ArgmaxBinding> {
        if a.n == 0
            || a.logits.size() < a.n as u64 * 4
            || a.out_tokens.size() < a.max_steps as u64 * 4
        {
            return Err(GpuError::Shape(format!(
                "argmax: n = {}, max_steps = {}: logits or out_tokens too small",
                a.n, a.max_steps
            )));
        }
        let nparts = a.n.div_ceil(CHUNK);
        if nparts > ctx.limits.max_compute_workgroups_per_dimension {
            return Err(GpuError::Shape(format!(
                "argmax: {} logits is too many",
                a.n
            )));
        }
        let part = ctx.storage("argmax.part", nparts as u64 * 8)?;
        let eos_words: Vec<u32> = if a.eos.is_empty() {
            vec![u32::MAX]
        } else {
            a.eos.to_vec()
        };
        let eos = ctx.storage_init("argmax.eos", bytemuck::cast_slice(&eos_words))?;
        let p = ctx.uniform(
            "argmax.params",
            bytemuck::cast_slice(&[a.n, nparts, a.eos.len() as u32, a.max_steps]),
        )?;
        let entries = [
            a.logits.as_entire_binding(),
            part.as_entire_binding(),
            a.state.as_entire_binding(),
            a.out_tokens.as_entire_binding(),
            eos.as_entire_binding(),
            p.as_entire_binding(),
        ];
        // Derived layouts hold only what an entry point uses: `partial` has no out_tokens or eos,
        // `finish` no logits.
        let pick = |ix: &[usize]| ix.iter().map(|i| entries[*i].clone()).collect::<Vec<_>>();
        Ok(ArgmaxBinding {
            n: a.n,
            eos_capacity: eos_words.len(),
            out_capacity: (a.out_tokens.size() / 4) as u32,
            partial: ctx.bind_group_at(
                "argmax.partial",
                &self.partial,
                &[0, 1, 2, 5],
                &pick(&[0, 1, 2, 5]),
            )?,
            finish: ctx.bind_group_at(
                "argmax.finish",
                &self.finish,
                &[1, 2, 3, 4, 5],
                &pick(&[1, 2, 3, 4, 5]),
            )?,
            nparts,
            params: p,
            eos,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &ArgmaxBinding) {
        pass.set_pipeline(&self.partial);
        pass.set_bind_group(0, &b.partial, &[]);
        pass.dispatch_workgroups(b.nparts, 1, 1);
        pass.set_pipeline(&self.finish);
        pass.set_bind_group(0, &b.finish, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
}

/// Scalar reference (the rule of `nibble_backend::argmax`): index of the largest value, the
/// lowest index on ties, NaN skipped (all NaN gives 0).
pub fn argmax_ref(x: &[f32]) -> u32 {
    let mut best: Option<(u32, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i as u32, v));
        }
    }
    best.map_or(0, |(i, _)| i)
}
