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

/// RMSNorm of every row of a prefill chunk, `y[t] = rmsnorm(h[t]) * w` for `t < dims.m`
/// (shaders/rmsnorm_rows.wgsl): one workgroup per token row.
pub struct RmsNormRowsKernel {
    pipeline: wgpu::ComputePipeline,
    hidden: u32,
}

/// Bind group of one rows norm.
pub struct RmsNormRowsBinding {
    bg: wgpu::BindGroup,
}

impl RmsNormRowsKernel {
    /// The pipeline for rows of `hidden` (a multiple of 4) values and this `eps`.
    pub fn new(ctx: &Context, hidden: u32, eps: f32) -> Result<Self> {
        if hidden == 0 || hidden % 4 != 0 || !(eps.is_finite() && eps >= 0.0) {
            return Err(GpuError::Shape(format!(
                "rmsnorm rows: hidden {hidden} (a multiple of 4), eps {eps}"
            )));
        }
        let src = format!(
            "const H4: u32 = {}u;\nconst EPS: f32 = {:e};\n{}",
            hidden / 4,
            eps,
            include_str!("../shaders/rmsnorm_rows.wgsl")
        );
        // Compiled without naga's runtime bounds checks (two per layer of a prefill chunk).
        // SAFETY: every index of rmsnorm_rows.wgsl stays in bounds for every binding `bind`
        // makes: the row t is below the rows both h and y hold (arrayLength / H4, in the
        // shader) and i < H4, so h and y are read / written below (t + 1) H4; w holds H floats
        // (`bind` checks it); red is indexed at li + s < 256 (li < s <= 128). Loops run to H4
        // or halve a constant; no run-time divisor.
        let pipeline = unsafe { ctx.compute_unchecked("rmsnorm_rows", &src, "main")? };
        Ok(RmsNormRowsKernel { pipeline, hidden })
    }

    /// `h`, `y` `[rows, H]`, `w` `[H]`, `dims` the `[m, 0, 0, 0]` uniform (`m <= rows`).
    pub fn bind(
        &self,
        ctx: &Context,
        h: &wgpu::Buffer,
        w: &wgpu::Buffer,
        y: &wgpu::Buffer,
        rows: u32,
        dims: &wgpu::Buffer,
    ) -> Result<RmsNormRowsBinding> {
        let n = rows as u64 * self.hidden as u64 * 4;
        if rows == 0 || h.size() < n || y.size() < n || w.size() < self.hidden as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "rmsnorm rows: {rows} rows of {}: a buffer is too small",
                self.hidden
            )));
        }
        let bg = ctx.bind_group(
            "rmsnorm_rows",
            &self.pipeline,
            &[
                h.as_entire_binding(),
                w.as_entire_binding(),
                y.as_entire_binding(),
                dims.as_entire_binding(),
            ],
        )?;
        Ok(RmsNormRowsBinding { bg })
    }

    /// Record the norm of the first `rows` rows (the chunk's tokens, as `dims` says).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &RmsNormRowsBinding, rows: u32) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(rows, 1, 1);
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

#[cfg(test)]
mod rows_tests {
    use super::*;
    use crate::testing::{gpu, rand_f32, rng};

    /// Every row of a chunk against the reference (odd widths, rows past `m` untouched, a
    /// token count past the buffers).
    #[test]
    fn rmsnorm_rows_matches_reference() {
        let Some(ctx) = gpu("rmsnorm_rows_matches_reference") else {
            return;
        };
        let mut r = rng(91);
        // The last case's `dims` and grid claim more rows than the buffers hold (the kernel,
        // compiled without bounds checks, skips them).
        for (hidden, rows, m) in [(4usize, 1usize, 1u32), (64, 5, 3), (2052, 9, 9), (64, 3, 5)] {
            let k = RmsNormRowsKernel::new(&ctx, hidden as u32, 1e-6).unwrap();
            // Rows with a wide spread of magnitudes.
            let h: Vec<f32> = rand_f32(&mut r, rows * hidden, -1.0, 1.0)
                .iter()
                .enumerate()
                .map(|(i, v)| v * 10f32.powi((i / hidden) as i32 % 5 - 2))
                .collect();
            let w = rand_f32(&mut r, hidden, 0.5, 1.5);
            let hb = ctx.storage_init("h", bytemuck::cast_slice(&h)).unwrap();
            let wb = ctx.storage_init("w", bytemuck::cast_slice(&w)).unwrap();
            let y = ctx
                .storage_init("y", &vec![0xFF; rows * hidden * 4])
                .unwrap();
            let dims = ctx
                .uniform("dims", bytemuck::cast_slice(&[m, 0, 0, 0]))
                .unwrap();
            let b = k.bind(&ctx, &hb, &wb, &y, rows as u32, &dims).unwrap();
            ctx.run_pass(|p| k.record(p, &b, m)).unwrap();
            let got = ctx.read_f32(&y, rows * hidden).unwrap();
            for t in 0..rows {
                let row = &got[t * hidden..(t + 1) * hidden];
                if t < m as usize {
                    let (_, want) = rmsnorm_ref(&h[t * hidden..(t + 1) * hidden], None, &w, 1e-6);
                    crate::testing::assert_close(
                        row,
                        &want,
                        1e-6,
                        1e-5,
                        &format!("H {hidden} row {t}"),
                    );
                } else {
                    assert!(
                        row.iter().all(|v| v.is_nan()),
                        "H {hidden}: row {t} past m written"
                    );
                }
            }
            assert!(k.bind(&ctx, &hb, &wb, &y, rows as u32 + 1, &dims).is_err());
        }
    }
}
