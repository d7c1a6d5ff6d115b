//! Causal attention of a prefill chunk over query tiles (shaders/attention_prefill.wgsl): one
//! workgroup per (tile of `BQ` consecutive tokens, kv head) holds the `BQ x G = 64` query rows of
//! the tile and streams the K/V rows once for all of them. The column attention (attention_cols.rs,
//! one workgroup per token and kv head) reads every K/V row once per token instead. Inside a
//! workgroup each thread computes a small block of products (2 rows x `BK / 8` keys for the
//! scores, 2 rows x `D / 8` output dims for `p V`) from values it loads once, so shared-memory
//! loads are not the limit; the shader's header says how the work is split.
//!
//! Where a chunk has too few query tiles to fill the GPU (a short chunk deep in the context),
//! the keys are split too: workgroup z = s walks run s of the K/V tiles and leaves partials
//! (unnormalised output, running max and sum per row) in [`AttentionPrefillScratch`], and a
//! second dispatch merges them ([`AttentionPrefillKernel::splits`] says how many).
//!
//! The chunk's own K/V rows must be in the cache first (the column attention's KV write,
//! [`crate::kernels::attention::AttentionKernel::record_kv_write`]). Buffers:
//! `qkv [T, (Hq + 2 Hkv) D]`, the caches `[slots, ctx, Hkv, D]`, `out [T, Hq D]`, the chunk's `[T]` columns (position, slot), the
//! `[T, S, 0, 0]` uniform and the partials (which also hold the roped q while the kernel runs).
//! Shapes: `G = Hq / Hkv` divides 64 and `D % 16 == 0` ([`AttentionPrefillKernel::supports`]);
//! the prefill plan falls back to the column attention otherwise.

use super::attention::{rope, AttentionParams};
use crate::columns::COLUMNS_WGSL;
use crate::context::{Context, GpuError, Result};

/// Query rows per workgroup: 256 threads, 2 rows each in the score phase, 4 threads per row in
/// the softmax phase.
const ROWS: u32 = 64;

/// Workgroups a chunk should fill before its keys are split: 2048 tokens (256 tiles x 4 kv
/// heads at Qwen3's shape) run at the kernel's best rate on the H200. Measured gain of the
/// splits (docs/BENCHMARKS.md run 97): pp64 at depth 4096 (32 workgroups, 16 splits) 1.28x,
/// pp512 there (256 workgroups, 4 splits) 1.02x.
const SPLIT_TARGET: u32 = 1024;
/// Most splits, and the fewest K/V tiles a split should walk.
const MAX_SPLITS: u32 = 16;
const MIN_TILES_PER_SPLIT: u32 = 4;
/// Rows (token x split) the partials hold at least: a chunk of `t` tokens splits only while
/// `S t` fits.
const SPLIT_ROWS: u32 = 2048;

/// The pipelines for one model's attention shape.
pub struct AttentionPrefillKernel {
    pipeline: wgpu::ComputePipeline,
    combine: wgpu::ComputePipeline,
    params: AttentionParams,
    inv_freq: wgpu::Buffer,
    /// Tokens per workgroup (`64 / G`).
    bq: u32,
    /// K/V rows per staged tile.
    bk: u32,
    /// Most key splits ([`MAX_SPLITS`] unless [`Self::with_max_splits`] says fewer).
    max_splits: u32,
}

/// The partials of split keys, shared by every layer (they run one after another): `part_o
/// [rows, Hq D]` (also the parked q), `part_ml [rows, Hq]` (m, l).
pub struct AttentionPrefillScratch {
    part_o: wgpu::Buffer,
    part_ml: wgpu::Buffer,
    /// Token x split rows the buffers hold.
    rows: u32,
}

/// The buffers of one layer (and one cache: the main sequence's or the streams').
pub struct AttentionPrefillBuffers<'a> {
    pub qkv: &'a wgpu::Buffer,
    pub q_norm: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
    pub cols: &'a wgpu::Buffer,
    /// Uniform `[T, S, 0, 0]`: tokens, splits ([`AttentionPrefillKernel::dims`]).
    pub dims: &'a wgpu::Buffer,
    /// Tokens the buffers hold (the chunk).
    pub tokens: u32,
    /// KV slots the caches hold.
    pub slots: u32,
}

/// One layer's bind groups.
pub struct AttentionPrefillBinding {
    bg: wgpu::BindGroup,
    combine: wgpu::BindGroup,
    /// Token x split rows of the partials.
    rows: u32,
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
        // Keys per thread in the scores; rows x vec4s per thread in the output.
        let (kpt, qpv, dv) = (bk / 8, ROWS * dg / 256, d4 / dg);
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
            rope(&p).score_scale(),
            (p.heads + 2 * p.kv_heads) * d / 4,
            d4 + 1,
            bk + 4,
            kpt,
            dv,
            qpv,
        );
        let body = unroll(
            include_str!("../shaders/attention_prefill.wgsl"),
            kpt,
            qpv,
            dv,
            dg,
        )?;
        let src = [
            consts.as_str(),
            &super::attention::kv_wgsl(p.cache),
            COLUMNS_WGSL,
            body.as_str(),
        ]
        .concat();
        // Compiled without naga's runtime bounds checks: every module unchecked gave the prefill
        // at depth 4096 +17% over the unchecked GEMMs alone (docs/BENCHMARKS.md runs 115-116),
        // the rest being this kernel.
        // SAFETY: every index of attention_prefill.wgsl (with the `unroll` blocks) stays in
        // bounds for any `dims`, `cols` and cache contents, because:
        // - `clamp_dims` clamps the token count mm below the rows `out`, `cols` and `qkv` hold
        //   and the split count below what `part_o` / `part_ml` hold for mm tokens (arrayLength,
        //   so whatever `bind` was given); workgroups with wid.x >= the tiles of mm or wid.z >=
        //   that count return first; every token index is min(.., mm - 1) or tested < mm;
        // - K/V rows: pmax is clamped below CTX and the slot below the slots both caches hold,
        //   and rows are read at slot CTX + min(kb + j, pmax); kv head h = wid.y < HKV (the
        //   grid), query heads h G + r % G < HQ, so qkv / out / part offsets stay inside a
        //   token's row; q_norm is read below D (`bind` checks it), inv_freq below D / 2;
        // - workgroup arrays (R = 64 rows, 256 threads): ks / vs at j KS + c with j < BK, c <
        //   D4 < KS; scores at row sa + 1 <= 63 and key kq + 8 i < BK <= PS; the softmax's
        //   rows li / 4 < R and keys < BK; the output's rows ov + a < QPV 256 / DG = R and
        //   vec4s dg + DG i < DG DV = D4; the norm's partials at r PS + sl, sl < NS = 4;
        //   cr below R; the row sums at 4 sr + sp < 256;
        // - loops run to constants, to the split's tile end or to ns; the run-time divisors are
        //   ns (>= 1 once past the early return) and max(mm, 1).
        // `combine` cannot see `cols` / `qkv`, so a `dims` token count past their rows (never
        // from the host, which writes `dims` from the chunk) would give it another mm than
        // `main`: wrong output, every index still below its clamped bounds.
        let module = unsafe { ctx.module_unchecked("attention_prefill", &src)? };
        let pipeline = ctx.pipeline("attention_prefill", &module, "main")?;
        let combine = ctx.pipeline("attention_prefill.combine", &module, "combine")?;
        let table = rope(&p).inv_freq;
        let inv_freq =
            ctx.storage_init("attention_prefill.inv_freq", bytemuck::cast_slice(&table))?;
        Ok(AttentionPrefillKernel {
            pipeline,
            combine,
            params: p,
            inv_freq,
            bq,
            bk,
            max_splits: MAX_SPLITS,
        })
    }

    /// At most `n` key splits (1..=`MAX_SPLITS`; 1: never split), for comparisons.
    pub fn with_max_splits(mut self, n: u32) -> Result<Self> {
        if !(1..=MAX_SPLITS).contains(&n) {
            return Err(GpuError::Shape(format!(
                "prefill attention: {n} key splits, need 1..={MAX_SPLITS}"
            )));
        }
        self.max_splits = n;
        Ok(self)
    }

    /// The partials for chunks of up to `tokens` tokens (at least `SPLIT_ROWS` rows where a
    /// binding holds them).
    pub fn scratch(&self, ctx: &Context, tokens: u32) -> Result<AttentionPrefillScratch> {
        let hq = self.params.heads as u64;
        let row = hq * self.params.head_dim as u64 * 4;
        // More rows than the chunk only where a binding holds them (else no splits past it).
        let fit = (ctx.max_binding_bytes() / row).min(u32::MAX as u64) as u32;
        let rows = tokens.max(SPLIT_ROWS.min(fit));
        Ok(AttentionPrefillScratch {
            part_o: ctx.storage("attention_prefill.part_o", rows as u64 * row)?,
            part_ml: ctx.storage("attention_prefill.part_ml", rows as u64 * hq * 8)?,
            rows,
        })
    }

    /// Splits of the keys for a chunk of `tokens` tokens whose last position is `pos_bound`:
    /// enough for `SPLIT_TARGET` workgroups, each split at least `MIN_TILES_PER_SPLIT` K/V
    /// tiles of the longest query tile, `S tokens` within `rows` (the partials); 1 = no split.
    pub fn splits(&self, tokens: u32, pos_bound: u32, rows: u32) -> u32 {
        let groups = tokens.div_ceil(self.bq).max(1) * self.params.kv_heads;
        let want = SPLIT_TARGET.div_ceil(groups);
        let key_tiles = pos_bound / self.bk + 1;
        want.min(self.max_splits)
            .min(key_tiles / MIN_TILES_PER_SPLIT)
            .min(rows / tokens.max(1))
            .max(1)
    }

    /// The `dims` uniform every prefill kernel reads for a chunk of `tokens` tokens up to
    /// position `pos_bound`: `[T, S, 0, 0]` (the other kernels read T only).
    pub fn dims(&self, tokens: u32, pos_bound: u32, scratch: &AttentionPrefillScratch) -> [u32; 4] {
        [tokens, self.splits(tokens, pos_bound, scratch.rows), 0, 0]
    }

    /// Check the sizes and create one layer's bind group.
    pub fn bind(
        &self,
        ctx: &Context,
        b: &AttentionPrefillBuffers<'_>,
        scratch: &AttentionPrefillScratch,
    ) -> Result<AttentionPrefillBinding> {
        let p = &self.params;
        let (hq, hkv, d) = (p.heads as u64, p.kv_heads as u64, p.head_dim as u64);
        let t = b.tokens as u64;
        let cache = b.slots as u64 * p.ctx as u64 * hkv * d;
        let col = std::mem::size_of::<crate::columns::Col>() as u64;
        let checks = [
            (b.qkv.size(), t * (hq + 2 * hkv) * d * 4, "qkv"),
            (b.q_norm.size(), d * 4, "q_norm"),
            (
                b.k_cache.size(),
                b.slots as u64 * p.cache_bytes(),
                "k_cache",
            ),
            (
                b.v_cache.size(),
                b.slots as u64 * p.cache_bytes(),
                "v_cache",
            ),
            (b.out.size(), t * hq * d * 4, "out"),
            (b.cols.size(), t * col, "cols"),
        ];
        if b.tokens == 0 || b.slots == 0 || cache >= 1 << 31 {
            return Err(GpuError::Shape(format!(
                "prefill attention: {} tokens, {} slots of {} rows",
                b.tokens, b.slots, p.ctx
            )));
        }
        if scratch.rows < b.tokens {
            return Err(GpuError::Shape(format!(
                "prefill attention: partials of {} rows for {} tokens",
                scratch.rows, b.tokens
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
                scratch.part_o.as_entire_binding(),
                scratch.part_ml.as_entire_binding(),
            ],
        )?;
        let combine = ctx.bind_group_at(
            "attention_prefill.combine",
            &self.combine,
            &[5, 7, 8, 9],
            &[
                b.out.as_entire_binding(),
                b.dims.as_entire_binding(),
                scratch.part_o.as_entire_binding(),
                scratch.part_ml.as_entire_binding(),
            ],
        )?;
        Ok(AttentionPrefillBinding {
            bg,
            combine,
            rows: scratch.rows,
        })
    }

    /// Record the attention of the chunk's first `tokens` columns, the last at position
    /// `pos_bound`; `dims` must hold [`Self::dims`] of the same arguments. One dispatch, two
    /// where the keys are split (the merge).
    pub fn record(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        b: &AttentionPrefillBinding,
        tokens: u32,
        pos_bound: u32,
    ) {
        self.record_split(pass, b, tokens, self.splits(tokens, pos_bound, b.rows));
    }

    /// [`Self::record`] with `s` splits (`dims` holding `[tokens, s, 0, 0]`, `s tokens` within
    /// the partials): the tests' way to every split count, empty splits included.
    pub(crate) fn record_split(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        b: &AttentionPrefillBinding,
        tokens: u32,
        s: u32,
    ) {
        let s = s.max(1);
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(tokens.div_ceil(self.bq), self.params.kv_heads, s);
        if s > 1 {
            pass.set_pipeline(&self.combine);
            pass.set_bind_group(0, &b.combine, &[]);
            pass.dispatch_workgroups(tokens, 1, 1);
        }
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
                    "{{ let r = ov + {a}u; let tq = t0 + r / G; if (tq < mm) {{ \
                     let ob = tq * HQ * D4 + (h * G + r % G) * D4; if (ns == 1u) {{ \
                     let lt = (ps[r * 4u] + ps[r * 4u + 1u]) + (ps[r * 4u + 2u] + ps[r * 4u + 3u]); \
                     {} }} else {{ {} }} }} }}",
                    each(dv, &|i| format!("out[ob + dg + {}u] = o{a}_{i} / lt;", dg * i)),
                    each(dv, &|i| format!("part_o[so + ob + dg + {}u] = o{a}_{i};", dg * i))
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
