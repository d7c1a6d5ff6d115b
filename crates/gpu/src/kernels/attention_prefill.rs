//! Causal attention of a prefill chunk over query tiles (shaders/attention_prefill.wgsl): one
//! workgroup per (tile of `BQ` consecutive tokens, kv head) holds the `BQ x G` query rows of the
//! tile and streams the K/V rows once for all of them. The column attention it replaces in the
//! GEMM prefill (attention_cols.rs, one workgroup per token and kv head) read every K/V row once
//! per token, 36% of a 2048-token prefill on the H200 (docs/BENCHMARKS.md run 80).
//!
//! The chunk's own K/V rows must be in the cache first (the column attention's KV write,
//! [`super::AttentionKernel::record_kv_write`]). Buffers: `qkv [T, (Hq + 2 Hkv) D]`, the caches
//! `[slots, ctx, Hkv, D]`, `out [T, Hq D]`, the chunk's `[T]` columns (position, slot) and the
//! `[m, 0, 0, 0]` uniform. Shapes: `G = Hq / Hkv` divides 64 and `D % 16 == 0`
//! ([`AttentionPrefillKernel::supports`]); the prefill plan falls back to the column attention
//! otherwise.

use super::attention::{inv_freq, AttentionParams};
use crate::columns::COLUMNS_WGSL;
use crate::context::{Context, GpuError, Result};

/// Threads per query row (each owns `D / 4 / NS` vec4s of it).
const NS: u32 = 4;
/// Query rows per workgroup (`256 / NS`).
const ROWS: u32 = 256 / NS;

/// The pipeline for one model's attention shape.
pub struct AttentionPrefillKernel {
    pipeline: wgpu::ComputePipeline,
    params: AttentionParams,
    inv_freq: wgpu::Buffer,
    /// Tokens per workgroup (`64 / G`).
    bq: u32,
}

/// The buffers of one layer (and one cache: the main sequence's or the streams').
pub struct AttentionPrefillBuffers<'a> {
    pub qkv: &'a wgpu::Buffer,
    pub q_norm: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
    pub cols: &'a wgpu::Buffer,
    pub dims: &'a wgpu::Buffer,
    /// Tokens the buffers hold (the chunk).
    pub tokens: u32,
    /// KV slots the caches hold.
    pub slots: u32,
}

/// One layer's bind group.
pub struct AttentionPrefillBinding {
    bg: wgpu::BindGroup,
}

impl AttentionPrefillKernel {
    /// Whether the kernel takes these shapes.
    pub fn supports(p: &AttentionParams) -> bool {
        let g = p.heads / p.kv_heads.max(1);
        g > 0 && ROWS % g == 0 && p.head_dim % (4 * NS) == 0
    }

    /// Compile for `p`; K/V tiles of 16 rows where the device has 48 KiB of workgroup memory
    /// (else 8).
    pub fn new(ctx: &Context, p: AttentionParams) -> Result<Self> {
        p.validate()?;
        if !Self::supports(&p) {
            return Err(GpuError::Shape(format!(
                "prefill attention: G = {} must divide {ROWS} and D = {} be a multiple of {}",
                p.heads / p.kv_heads,
                p.head_dim,
                4 * NS
            )));
        }
        let (d, g) = (p.head_dim, p.heads / p.kv_heads);
        let shared = |bk: u32| (bk * d * 8 + ROWS * (bk * NS + 4) * 4) as u64;
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        let bk = if shared(16) <= limit { 16 } else { 8 };
        if shared(bk) > limit {
            return Err(GpuError::TooLarge {
                label: "prefill attention workgroup memory".into(),
                bytes: shared(bk),
                limit,
            });
        }
        let bq = ROWS / g;
        let consts = format!(
            "const D: u32 = {d}u;\nconst D4: u32 = {}u;\nconst HQ: u32 = {}u;\nconst HKV: u32 = {}u;\n\
             const G: u32 = {g}u;\nconst CTX: u32 = {}u;\nconst EPS: f32 = {:e};\nconst SCALE: f32 = {:e};\n\
             const QKVW4: u32 = {}u;\nconst NS: u32 = {NS}u;\nconst BQ: u32 = {bq}u;\nconst BK: u32 = {bk}u;\n\
             const R: u32 = {ROWS}u;\nconst RS: u32 = {}u;\n",
            d / 4,
            p.heads,
            p.kv_heads,
            p.ctx,
            p.eps,
            1.0 / (d as f32).sqrt(),
            (p.heads + 2 * p.kv_heads) * d / 4,
            bk * NS + 4,
        );
        let src = [
            consts.as_str(),
            COLUMNS_WGSL,
            include_str!("../shaders/attention_prefill.wgsl"),
        ]
        .concat();
        let pipeline = ctx.compute("attention_prefill", &src, "main")?;
        let table = inv_freq(p.rope_theta, d as usize);
        let inv_freq =
            ctx.storage_init("attention_prefill.inv_freq", bytemuck::cast_slice(&table))?;
        Ok(AttentionPrefillKernel {
            pipeline,
            params: p,
            inv_freq,
            bq,
        })
    }

    /// Check the sizes and create one layer's bind group.
    pub fn bind(
        &self,
        ctx: &Context,
        b: &AttentionPrefillBuffers<'_>,
    ) -> Result<AttentionPrefillBinding> {
        let p = &self.params;
        let (hq, hkv, d) = (p.heads as u64, p.kv_heads as u64, p.head_dim as u64);
        let t = b.tokens as u64;
        let cache = b.slots as u64 * p.ctx as u64 * hkv * d;
        let col = std::mem::size_of::<crate::columns::Col>() as u64;
        let checks = [
            (b.qkv.size(), t * (hq + 2 * hkv) * d * 4, "qkv"),
            (b.q_norm.size(), d * 4, "q_norm"),
            (b.k_cache.size(), cache * 4, "k_cache"),
            (b.v_cache.size(), cache * 4, "v_cache"),
            (b.out.size(), t * hq * d * 4, "out"),
            (b.cols.size(), t * col, "cols"),
        ];
        if b.tokens == 0 || b.slots == 0 || cache >= 1 << 31 {
            return Err(GpuError::Shape(format!(
                "prefill attention: {} tokens, {} slots of {} rows",
                b.tokens, b.slots, p.ctx
            )));
        }
        if let Some((have, need, what)) = checks.iter().find(|(have, need, _)| have < need) {
            return Err(GpuError::Shape(format!(
                "prefill attention: {what} holds {have} bytes, needs {need}"
            )));
        }
        let bg = ctx.bind_group(
            "attention_prefill",
            &self.pipeline,
            &[
                b.qkv.as_entire_binding(),
                b.q_norm.as_entire_binding(),
                self.inv_freq.as_entire_binding(),
                b.k_cache.as_entire_binding(),
                b.v_cache.as_entire_binding(),
                b.out.as_entire_binding(),
                b.cols.as_entire_binding(),
                b.dims.as_entire_binding(),
            ],
        )?;
        Ok(AttentionPrefillBinding { bg })
    }

    /// Record the attention of the chunk's first `tokens` columns (as `dims` says).
    pub fn record(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        b: &AttentionPrefillBinding,
        tokens: u32,
    ) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(tokens.div_ceil(self.bq), self.params.kv_heads, 1);
    }
}

#[cfg(test)]
#[path = "attention_prefill_tests.rs"]
mod tests;
