//! Matrix-vector products: int4 (repacked Q4_0) weights with int8-quantised activations via
//! `dot4I8Packed` (the fast path: ~2.4x the f32-activation variant on an H200), the same with
//! f32 activations (kept for parity checks), a plain f32 matvec (router), and the activation
//! quantiser.
//!
//! Every matvec uses 256-thread workgroups of 8 rows x 32 lanes and a shared-memory tree
//! reduction, so no subgroup size is assumed. A matrix split across bindings is one dispatch
//! per part, each writing its rows at `row_start` of the one output vector. All kernels return
//! immediately when the run state says `done`.

use crate::context::{Context, GpuError, Result};
use crate::state::with_state;
use crate::tensor::{F32Matrix, Q4Matrix, QuantActs, BLOCK};

/// Rows per matvec workgroup (must match `RPW` in the shaders).
const ROWS_PER_WG: u32 = 8;

/// The activation a Q4 matvec reads.
#[derive(Clone, Copy)]
pub enum Act<'a> {
    /// int8 per block of 32 (fast path).
    Int8(&'a QuantActs),
    /// f32 `[cols]` (parity path).
    F32(&'a wgpu::Buffer),
}

/// Bind groups (one per matrix part) of one matvec, ready to record.
pub struct MatvecBinding {
    pipeline: Which,
    dispatches: Vec<(wgpu::BindGroup, (u32, u32))>,
}

#[derive(Clone, Copy)]
enum Which {
    Q4I8,
    Q4F32,
    F32,
}

impl MatvecBinding {
    /// Dispatches [`MatvecKernel::record`] issues (one per matrix part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

/// Params uniform of every matvec shader: `{ rows, inner, row_start, gx }`.
fn params(
    ctx: &Context,
    rows: u32,
    inner: u32,
    row_start: u32,
) -> Result<(wgpu::Buffer, (u32, u32))> {
    let grid = ctx.grid(rows.div_ceil(ROWS_PER_WG));
    let buf = ctx.uniform(
        "matvec.params",
        bytemuck::cast_slice(&[rows, inner, row_start, grid.0]),
    )?;
    Ok((buf, grid))
}

fn check_out(y: &wgpu::Buffer, rows: u32, what: &str) -> Result<()> {
    if y.size() < rows as u64 * 4 {
        return Err(GpuError::Shape(format!(
            "{what}: output holds {} bytes, need {} rows",
            y.size(),
            rows
        )));
    }
    Ok(())
}

/// The matvec pipelines (compiled once per context).
pub struct MatvecKernel {
    q4_i8: wgpu::ComputePipeline,
    q4_f32: wgpu::ComputePipeline,
    f32: wgpu::ComputePipeline,
}

impl MatvecKernel {
    pub fn new(ctx: &Context) -> Result<MatvecKernel> {
        let src = |s: &str| with_state(s);
        Ok(MatvecKernel {
            q4_i8: ctx.compute(
                "matvec_q4_i8",
                &src(include_str!("../shaders/matvec_q4_i8.wgsl")),
                "main",
            )?,
            q4_f32: ctx.compute(
                "matvec_q4_f32",
                &src(include_str!("../shaders/matvec_q4_f32.wgsl")),
                "main",
            )?,
            f32: ctx.compute(
                "matvec_f32",
                &src(include_str!("../shaders/matvec_f32.wgsl")),
                "main",
            )?,
        })
    }

    /// `y[0..rows] = m · x` for a Q4 matrix `[rows, cols]` and `x` of `cols` elements.
    pub fn bind_q4(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: Act<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        check_out(y, m.rows, "matvec_q4")?;
        let bpr = m.cols / BLOCK as u32;
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let (p, grid) = params(ctx, part.rows, bpr, part.row_start)?;
            let bg = match x {
                Act::Int8(a) => {
                    if a.n != m.cols {
                        return Err(GpuError::Shape(format!(
                            "matvec_q4: {} activations for {} columns",
                            a.n, m.cols
                        )));
                    }
                    ctx.bind_group(
                        "matvec_q4_i8",
                        &self.q4_i8,
                        &[
                            part.qs.as_entire_binding(),
                            part.scales.as_entire_binding(),
                            a.q.as_entire_binding(),
                            a.s.as_entire_binding(),
                            y.as_entire_binding(),
                            p.as_entire_binding(),
                            state.as_entire_binding(),
                        ],
                    )?
                }
                Act::F32(xb) => {
                    if xb.size() < m.cols as u64 * 4 {
                        return Err(GpuError::Shape(format!(
                            "matvec_q4: x holds {} bytes for {} columns",
                            xb.size(),
                            m.cols
                        )));
                    }
                    ctx.bind_group(
                        "matvec_q4_f32",
                        &self.q4_f32,
                        &[
                            part.qs.as_entire_binding(),
                            part.scales.as_entire_binding(),
                            xb.as_entire_binding(),
                            y.as_entire_binding(),
                            p.as_entire_binding(),
                            state.as_entire_binding(),
                        ],
                    )?
                }
            };
            dispatches.push((bg, grid));
        }
        let pipeline = match x {
            Act::Int8(_) => Which::Q4I8,
            Act::F32(_) => Which::Q4F32,
        };
        Ok(MatvecBinding {
            pipeline,
            dispatches,
        })
    }

    /// `y[0..rows] = m · x` for an f32 matrix `[rows, cols]` and f32 `x[cols]`.
    pub fn bind_f32(
        &self,
        ctx: &Context,
        m: &F32Matrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        check_out(y, m.rows, "matvec_f32")?;
        if x.size() < m.cols as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "matvec_f32: x holds {} bytes for {} columns",
                x.size(),
                m.cols
            )));
        }
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let (p, grid) = params(ctx, part.rows, m.cols / 4, part.row_start)?;
            let bg = ctx.bind_group(
                "matvec_f32",
                &self.f32,
                &[
                    part.w.as_entire_binding(),
                    x.as_entire_binding(),
                    y.as_entire_binding(),
                    p.as_entire_binding(),
                    state.as_entire_binding(),
                ],
            )?;
            dispatches.push((bg, grid));
        }
        Ok(MatvecBinding {
            pipeline: Which::F32,
            dispatches,
        })
    }

    /// Record the dispatches (one per matrix part).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &MatvecBinding) {
        pass.set_pipeline(match b.pipeline {
            Which::Q4I8 => &self.q4_i8,
            Which::Q4F32 => &self.q4_f32,
            Which::F32 => &self.f32,
        });
        for (bg, (gx, gy)) in &b.dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, 1);
        }
    }
}

/// The activation quantiser: f32 `x[n]` -> [`QuantActs`] (one thread per block of 32).
pub struct QuantizeKernel {
    pipeline: wgpu::ComputePipeline,
}

/// Bind group of one quantisation.
pub struct QuantizeBinding {
    bg: wgpu::BindGroup,
    grid: (u32, u32),
}

impl QuantizeKernel {
    pub fn new(ctx: &Context) -> Result<QuantizeKernel> {
        Ok(QuantizeKernel {
            pipeline: ctx.compute(
                "quantize",
                &with_state(include_str!("../shaders/quantize.wgsl")),
                "main",
            )?,
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
        let bg = ctx.bind_group(
            "quantize",
            &self.pipeline,
            &[
                x.as_entire_binding(),
                out.q.as_entire_binding(),
                out.s.as_entire_binding(),
                p.as_entire_binding(),
                state.as_entire_binding(),
            ],
        )?;
        Ok(QuantizeBinding { bg, grid })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &QuantizeBinding) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(b.grid.0, b.grid.1, 1);
    }
}

/// Scalar reference of the Q4 x int8 matvec: exactly the integer arithmetic of the kernel, in f64.
/// `w` is ggml Q4_0 `[rows, cols]`, `(q, s)` from [`crate::tensor::quantize_acts_ref`].
pub fn matvec_q4_i8_ref(w: &[u8], rows: usize, cols: usize, q: &[i8], s: &[[f32; 2]]) -> Vec<f32> {
    let bpr = cols / BLOCK;
    (0..rows)
        .map(|r| {
            let mut acc = 0f64;
            for b in 0..bpr {
                let blk = &w[(r * bpr + b) * 18..(r * bpr + b + 1) * 18];
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                let mut dot = 0i64;
                for j in 0..16 {
                    dot += (blk[2 + j] & 15) as i64 * q[b * 32 + j] as i64;
                    dot += (blk[2 + j] >> 4) as i64 * q[b * 32 + j + 16] as i64;
                }
                acc += d * (s[b][0] as f64 * dot as f64 - 8.0 * s[b][1] as f64);
            }
            acc as f32
        })
        .collect()
}

/// Scalar reference of an f32 matvec over already-dequantised weights `[rows, cols]`, in f64.
pub fn matvec_f32_ref(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}
