//! Causal attention of a prefill chunk over query tiles (shaders/attention_prefill.wgsl): one
//! workgroup per (tile of `BQ` consecutive tokens, kv head) holds the `BQ x G = 64` query rows of
//! the tile and streams the K/V rows once for all of them. The column attention (attention_cols.rs,
//! one workgroup per token and kv head) reads every K/V row once per token instead. Inside a
//! workgroup each thread computes a small block of products (2 rows x `BK / 8` keys for the
//! scores, 2 rows x `D / 8` output dims for `p V`) from values it loads once, so shared-memory
//! loads are not the limit; the shader's header says how the work is split.
//!
//! The chunk's own K/V rows must be in the cache first (the column attention's KV write,
//! [`super::AttentionKernel::record_kv_write`]). Buffers: `qkv [T, (Hq + 2 Hkv) D]`, the caches
//! `[slots, ctx, Hkv, D]`, `out [T, Hq D]` (it also holds the roped q while the kernel runs), the
//! chunk's `[T]` columns (position, slot) and the `[m, 0, 0, 0]` uniform. Shapes: `G = Hq / Hkv`
//! divides 64 and `D % 16 == 0` ([`AttentionPrefillKernel::supports`]); the prefill plan falls
//! back to the column attention otherwise.

use super::attention::{inv_freq, AttentionParams};
use crate::columns::COLUMNS_WGSL;
use crate::context::{Context, GpuError, Result};

/// Query rows per workgroup: 256 threads, 2 rows each in the score phase, 4 threads per row in
/// the softmax phase.
const ROWS: u32 = 64;

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
        g > 0 && ROWS % g == 0 && p.head_dim % 16 == 0
    }

    /// Compile for `p`; K/V tiles of 32 rows where the device has the workgroup memory (43 KiB at
    /// D = 128; the H200 has 48), else 16 or 8.
    pub fn new(ctx: &Context, p: AttentionParams) -> Result<Self> {
        Self::with_variant(ctx, p, 0)
    }

    /// [`Self::new`] with parts of the work switched off (`VARIANT` in the shader; 0 = none):
    /// the timing diagnostic's ablations only.
    pub(crate) fn with_variant(ctx: &Context, p: AttentionParams, variant: u32) -> Result<Self> {
        p.validate()?;
        if !Self::supports(&p) {
            return Err(GpuError::Shape(format!(
                "prefill attention: G = {} must divide {ROWS} and D = {} be a multiple of 16",
                p.heads / p.kv_heads,
                p.head_dim,
            )));
        }
        let (d, g) = (p.head_dim, p.heads / p.kv_heads);
        // Staged K and V rows padded to D / 4 + 1 vec4s, the score rows to BK + 4 floats, one
        // rescale per row.
        let shared = |bk: u32| (2 * bk * (d / 4 + 1) * 16 + ROWS * (bk + 4) * 4 + ROWS * 4) as u64;
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        let bk = [32, 16, 8]
            .into_iter()
            .find(|&bk| shared(bk) <= limit)
            .unwrap_or(8);
        if shared(bk) > limit {
            return Err(GpuError::TooLarge {
                label: "prefill attention workgroup memory".into(),
                bytes: shared(bk),
                limit,
            });
        }
        let bq = ROWS / g;
        // The output phase: 8 groups of D's vec4s (2 rows per thread) where D / 4 allows, else 4
        // (1 row per thread).
        let d4 = d / 4;
        let dg = if d4 % 8 == 0 { 8 } else { 4 };
        let consts = format!(
            "const D: u32 = {d}u;\nconst D4: u32 = {d4}u;\nconst HQ: u32 = {}u;\nconst HKV: u32 = {}u;\n\
             const G: u32 = {g}u;\nconst CTX: u32 = {}u;\nconst EPS: f32 = {:e};\nconst SCALE: f32 = {:e};\n\
             const QKVW4: u32 = {}u;\nconst BQ: u32 = {bq}u;\nconst BK: u32 = {bk}u;\n\
             const R: u32 = {ROWS}u;\nconst KS: u32 = {}u;\nconst PS: u32 = {}u;\nconst KPT: u32 = {}u;\n\
             const DG: u32 = {dg}u;\nconst DV: u32 = {}u;\nconst QPV: u32 = {}u;\nconst VARIANT: u32 = {variant}u;\n",
            p.heads,
            p.kv_heads,
            p.ctx,
            p.eps,
            1.0 / (d as f32).sqrt(),
            (p.heads + 2 * p.kv_heads) * d / 4,
            d4 + 1,
            bk + 4,
            bk / 8,
            d4 / dg,
            ROWS * dg / 256,
        );
        let body = unroll(
            include_str!("../shaders/attention_prefill.wgsl"),
            bk / 8,
            ROWS * dg / 256,
            d4 / dg,
            dg,
        )?;
        let src = [consts.as_str(), COLUMNS_WGSL, body.as_str()].concat();
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

/// Write out the shader's `// @GEN name` lines as straight-line code over named registers:
/// `kpt` keys per thread in the scores (`a{i}`, `b{i}`: rows `sa`, `sa + 1`), `qpv` rows x `dv`
/// vec4s of output per thread (`o{a}_{i}`), output vec4s `dg` apart.
///
/// Why: the H200 ran this kernel's loops over per-thread arrays (`acc[i]`, `o[a * DV + i]`) at
/// ~5 multiply-adds per clock per SM (run 93: 15 ms for one 2048-token layer, the score and
/// p V phases about half each), as if every access went through memory; named registers
/// leave the driver's compiler nothing to spill.
fn unroll(src: &str, kpt: u32, qpv: u32, dv: u32, dg: u32) -> Result<String> {
    let each = |n: u32, f: &dyn Fn(u32) -> String| (0..n).map(f).collect::<Vec<_>>().join(" ");
    let mut out = String::with_capacity(src.len() + 4096);
    for line in src.lines() {
        let Some(name) = line.trim().strip_prefix("// @GEN ") else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let code = match name {
            "out_init" => each(qpv, &|a| {
                each(dv, &|i| format!("var o{a}_{i} = vec4<f32>(0.0);"))
            }),
            "scores_init" => each(kpt, &|i| {
                format!("var a{i} = vec4<f32>(0.0); var b{i} = vec4<f32>(0.0);")
            }),
            "scores_body" => each(kpt, &|i| {
                format!(
                    "let k{i} = ks[(kq + {}u) * KS + c]; a{i} = fma(x, k{i}, a{i}); \
                     b{i} = fma(y, k{i}, b{i});",
                    8 * i
                )
            }),
            "scores_store" => each(kpt, &|i| {
                let k = 8 * i;
                format!(
                    "ps[sa * PS + kq + {k}u] = select(dot(a{i}, one), -3.0e38, kb + kq + {k}u > pos_a); \
                     ps[(sa + 1u) * PS + kq + {k}u] = select(dot(b{i}, one), -3.0e38, kb + kq + {k}u > pos_b);"
                )
            }),
            "out_rescale" => each(qpv, &|a| {
                format!(
                    "let f{a} = cr[ov + {a}u]; {}",
                    each(dv, &|i| format!("o{a}_{i} *= f{a};"))
                )
            }),
            "out_body" => {
                let p = each(qpv, &|a| {
                    format!("let p{a} = vec4<f32>(ps[(ov + {a}u) * PS + j]);")
                });
                let v = each(dv, &|i| {
                    format!(
                        "let v{i} = vs[j * KS + dg + {}u]; {}",
                        dg * i,
                        each(qpv, &|a| format!("o{a}_{i} = fma(p{a}, v{i}, o{a}_{i});"))
                    )
                });
                format!("{p} {v}")
            }
            "out_store" => each(qpv, &|a| {
                format!(
                    "{{ let r = ov + {a}u; let tq = t0 + r / G; if (tq < dims.m) {{ \
                     let lt = (ps[r * 4u] + ps[r * 4u + 1u]) + (ps[r * 4u + 2u] + ps[r * 4u + 3u]); \
                     let ob = tq * HQ * D4 + (h * G + r % G) * D4; {} }} }}",
                    each(dv, &|i| format!("out[ob + dg + {}u] = o{a}_{i} / lt;", dg * i))
                )
            }),
            other => {
                return Err(GpuError::Shape(format!(
                    "prefill attention shader: unknown generated block `{other}`"
                )))
            }
        };
        out.push_str(&code);
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
#[path = "attention_prefill_tests.rs"]
mod tests;
