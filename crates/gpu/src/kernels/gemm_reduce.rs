//! The sum of a K-split prefill GEMM's partial outputs (gemm.rs `bind_split`): `Y[m, c] (+)=
//! Σ_z P[z, m, c]` over the splits in order, for tokens `m < dims.m` and the GEMM's `n` output
//! columns. A short chunk's dense GEMMs (the qkv, the o-proj) take few tiles of 128 rows, each
//! walking all of K; split into slices they fill the GPU, and this dispatch adds the slices back.
//! `=` writes the sum (the qkv), `+=` adds it to the residual stream (the o-proj).
//!
//! Compiled with naga's bounds checks (a small kernel): the binder also checks every buffer
//! holds what the parameters say.

use crate::context::{Context, GpuError, Result};

const WGSL: &str = "
struct Params { n: u32, ys: u32, splits: u32, prows: u32, acc: u32, p5: u32, p6: u32, p7: u32 };
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };
@group(0) @binding(0) var<storage, read> part: array<f32>;    // [splits, prows, ys]
@group(0) @binding(1) var<storage, read_write> y: array<f32>; // [rows, ys]
@group(0) @binding(2) var<uniform> p: Params;
@group(0) @binding(3) var<uniform> dims: Dims;

// Workgroup (x, m): columns 256 x .. of token m.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let m = wid.y;
    let c = wid.x * 256u + li;
    if (m >= min(dims.m, p.prows) || c >= p.n) {
        return;
    }
    var v = part[m * p.ys + c];
    for (var z = 1u; z < p.splits; z++) {
        v += part[(z * p.prows + m) * p.ys + c];
    }
    let i = m * p.ys + c;
    if (p.acc != 0u) {
        y[i] += v;
    } else {
        y[i] = v;
    }
}
";

/// The reduce pipeline (one per plan).
pub struct GemmReduceKernel {
    pipeline: wgpu::ComputePipeline,
}

/// One bound reduce: its bind group and the columns it covers.
pub struct GemmReduceBinding {
    bg: wgpu::BindGroup,
    n: u32,
    prows: u32,
}

/// What one reduce reads and writes.
pub struct GemmReduceArgs<'a> {
    /// `[splits, prows, ys]` partial outputs (the split GEMM's Y).
    pub part: &'a wgpu::Buffer,
    /// `[rows, ys]` the output, `rows >= prows`.
    pub y: &'a wgpu::Buffer,
    pub y_rows: u32,
    /// Columns per row written (the GEMM's outputs) and the row stride of both buffers.
    pub n: u32,
    pub ys: u32,
    pub splits: u32,
    /// Token rows per split in `part`.
    pub prows: u32,
    /// `+=` rather than `=`.
    pub acc: bool,
    /// The `[m, 0, 0, 0]` uniform.
    pub dims: &'a wgpu::Buffer,
}

impl GemmReduceKernel {
    pub fn new(ctx: &Context) -> Result<GemmReduceKernel> {
        Ok(GemmReduceKernel {
            pipeline: ctx.compute("gemm_reduce", WGSL, "main")?,
        })
    }

    /// Check the shapes and bind.
    pub fn bind(&self, ctx: &Context, a: &GemmReduceArgs<'_>) -> Result<GemmReduceBinding> {
        let bad = |what: String| Err(GpuError::Shape(format!("gemm reduce: {what}")));
        if a.n == 0 || a.n > a.ys || a.splits == 0 || a.prows == 0 || a.prows > a.y_rows {
            return bad(format!(
                "{} columns of stride {}, {} splits of {} rows into {} rows",
                a.n, a.ys, a.splits, a.prows, a.y_rows
            ));
        }
        let words = |rows: u64| rows * a.ys as u64 * 4;
        if a.part.size() < words(a.splits as u64 * a.prows as u64)
            || a.y.size() < words(a.y_rows as u64)
        {
            return bad("a buffer is smaller than its rows".into());
        }
        let params = [a.n, a.ys, a.splits, a.prows, a.acc as u32, 0, 0, 0];
        let pb = ctx.uniform("gemm_reduce.params", bytemuck::cast_slice(&params))?;
        let bg = ctx.bind_group(
            "gemm_reduce",
            &self.pipeline,
            &[
                a.part.as_entire_binding(),
                a.y.as_entire_binding(),
                pb.as_entire_binding(),
                a.dims.as_entire_binding(),
            ],
        )?;
        Ok(GemmReduceBinding {
            bg,
            n: a.n,
            prows: a.prows,
        })
    }

    /// Record the reduce of `tokens` tokens (at most the binding's `prows`).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &GemmReduceBinding, tokens: u32) {
        let m = tokens.min(b.prows);
        if m == 0 {
            return;
        }
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(b.n.div_ceil(256), m, 1);
    }
}
