//! RMSNorm of the residual stream with an optional fused residual add (`h += r`) and an optional
//! fused int8 (plain or precise) quantisation of the output for the next int4 matvec: one dispatch where a naive
//! plan needs three. One 256-thread workgroup per vector (the vector is a few thousand floats);
//! the quantisation uses the whole workgroup (four threads per block of 32, `act_store8`).

use crate::context::{Context, GpuError, Result};
use crate::numerics::{act_out_wgsl, act_store8_wgsl, Numerics};
use crate::state::with_state;
use crate::tensor::{QuantActs, BLOCK};

const ADD: u32 = 1;
const QUANT: u32 = 2;

/// The rmsnorm pipeline plus dummy buffers bound in place of unused optional operands.
pub struct RmsNormKernel {
    /// Quantised output plain / precise (or none, by a runtime flag).
    pipeline: wgpu::ComputePipeline,
    precise: wgpu::ComputePipeline,
    dummy_q: wgpu::Buffer,
    dummy_s: wgpu::Buffer,
}

/// What one rmsnorm reads and writes.
pub struct RmsNormArgs<'a> {
    /// `[n]` residual stream; updated in place when `add` is given.
    pub h: &'a wgpu::Buffer,
    /// `[n]` added to `h` before the norm.
    pub add: Option<&'a wgpu::Buffer>,
    /// `[n]` norm weight.
    pub weight: &'a wgpu::Buffer,
    /// `[n]` normalised output (always written: the router and parity paths read it).
    pub out: &'a wgpu::Buffer,
    /// Also write the output int8-quantised here.
    pub quant: Option<&'a QuantActs>,
    pub n: u32,
    pub eps: f32,
}

/// Bind group of one rmsnorm.
pub struct RmsNormBinding {
    precise: bool,
    bg: wgpu::BindGroup,
}

impl RmsNormKernel {
    pub fn new(ctx: &Context) -> Result<RmsNormKernel> {
        let src = |n: Numerics| {
            let body = include_str!("../shaders/rmsnorm.wgsl");
            with_state(&format!(
                "{}{}{body}",
                act_out_wgsl(n, 4, 5),
                act_store8_wgsl(n)
            ))
        };
        Ok(RmsNormKernel {
            pipeline: ctx.compute("rmsnorm", &src(Numerics::Int8), "main")?,
            precise: ctx.compute("rmsnorm.precise", &src(Numerics::PreciseInt8), "main")?,
            dummy_q: ctx.storage("rmsnorm.dummy_q", 16)?,
            dummy_s: ctx.storage("rmsnorm.dummy_s", 16)?,
        })
    }

    pub fn bind(
        &self,
        ctx: &Context,
        a: &RmsNormArgs<'_>,
        state: &wgpu::Buffer,
    ) -> Result<RmsNormBinding> {
        let need = a.n as u64 * 4;
        let small = [Some(a.h), a.add, Some(a.weight), Some(a.out)]
            .into_iter()
            .flatten()
            .any(|b| b.size() < need);
        if a.n == 0 || small || !(a.eps.is_finite() && a.eps >= 0.0) {
            return Err(GpuError::Shape(format!(
                "rmsnorm: n = {}, eps = {}: a buffer is too small or eps is bad",
                a.n, a.eps
            )));
        }
        if let Some(q) = a.quant {
            if q.n != a.n || a.n % BLOCK as u32 != 0 {
                return Err(GpuError::Shape(format!(
                    "rmsnorm: quantised output of {} for n = {}",
                    q.n, a.n
                )));
            }
        }
        let flags = a.add.map_or(0, |_| ADD) | a.quant.map_or(0, |_| QUANT);
        let p = ctx.uniform(
            "rmsnorm.params",
            bytemuck::cast_slice(&[a.n, a.eps.to_bits(), flags, 0]),
        )?;
        let precise = a.quant.is_some_and(|q| q.precise);
        let bg = ctx.bind_group(
            "rmsnorm",
            if precise {
                &self.precise
            } else {
                &self.pipeline
            },
            &[
                a.h.as_entire_binding(),
                // Unused operands still need a binding; `weight` is read-only like `r`.
                a.add.unwrap_or(a.weight).as_entire_binding(),
                a.weight.as_entire_binding(),
                a.out.as_entire_binding(),
                a.quant.map_or(&self.dummy_q, |q| &q.q).as_entire_binding(),
                a.quant.map_or(&self.dummy_s, |q| &q.s).as_entire_binding(),
                p.as_entire_binding(),
                state.as_entire_binding(),
            ],
        )?;
        Ok(RmsNormBinding { precise, bg })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &RmsNormBinding) {
        pass.set_pipeline(if b.precise {
            &self.precise
        } else {
            &self.pipeline
        });
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
}

/// Scalar reference: returns (new `h`, normalised output), in f64 internally.
pub fn rmsnorm_ref(h: &[f32], add: Option<&[f32]>, w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let h: Vec<f32> = match add {
        Some(r) => h.iter().zip(r).map(|(a, b)| a + b).collect(),
        None => h.to_vec(),
    };
    let ms = h.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() / h.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    let y = h
        .iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * inv * *w as f64) as f32)
        .collect();
    (h, y)
}
