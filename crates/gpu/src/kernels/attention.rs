//! Attention kernels (formats-spec §1.4 steps 3-6, §1.5, §1.6) and their scalar references.
//!
//! One or two dispatches per layer (one with the fused combine, below), all reading the
//! position from the run-state buffer:
//! 1. `chunk`: flash-decoding split of the single-query GQA attention over positions `0..=pos`
//!    in chunks; one workgroup per (chunk, kv head) serves the `G = Hq/Hkv` query heads of that
//!    kv head, so every K/V row is read once. Grid `(chunks, Hkv)`. Each workgroup first applies
//!    the per-head RMSNorm (weight `[D]` shared by the heads) + NeoX rotate-half RoPE (pairs `i`,
//!    `i + D/2`) to its G query heads itself (G*D values: cheaper than a dispatch); the workgroup
//!    whose chunk holds `pos` (one per kv head) also norms and ropes k, writes the roped k and
//!    the raw v to cache row `pos`, and uses those values for that row rather than the cache
//!    (writes within a dispatch are not visible to other loads). The chunk length is chosen
//!    from the position on the GPU (`Split`): `params.chunk` positions while that gives at most
//!    ~`TARGET_WORKGROUPS` workgroups, longer chunks after (up to a cap), so short contexts
//!    still fill a big GPU and long ones do not flood the combine. The chunk body comes in two
//!    forms ([`AttnForm`]): the tiled one (default) passes K and V through coalesced
//!    shared-memory tiles; the streamed one keeps the next key block in flight in registers,
//!    reads each key once for several heads and V straight from the cache into registers
//!    (fewer, longer chunks keep the memory busy; see attention_stream.wgsl). No thread walks a
//!    long serial chain of global loads.
//! 2. `combine`: per query head, rescale the chunk partials by `exp(m_c - M)` and normalise,
//!    every thread of the workgroup taking a slice of the chunks.
//!    `combine_q8` additionally writes the output int8-quantised (tensor.rs layout) for the
//!    o-proj int4 matvec. Grid `Hq`.
//!
//! With [`Combine::Fused`] (the default on Vulkan) the combine runs inside the chunk dispatch:
//! each chunk workgroup publishes its partials, counts itself in a per-kv-head atomic, and the
//! last one to arrive merges the G heads' chunks (`fused` in attention.wgsl): one dispatch per
//! layer while a step needs at most [`FUSED_MAX_CHUNKS`] chunks per kv head (the last workgroup
//! walks them serially), the pair beyond. The scratch's `arrive` counters are back at zero
//! after each dispatch.
//!
//! When the host's position bound guarantees one chunk (`pos_bound + 1 <= ` the minimum chunk
//! length, or more generally `Split::chunks_bound` of 1) and the output is f32 only, the
//! `single` variant of `chunk` normalises and writes the output itself: one dispatch per layer.
//! [`AttentionKernel::dispatches`] says which.
//!
//! Multi-column forms (B <= 8 tokens per dispatch, columns.rs) live in `attention_cols.rs`:
//! [`AttentionKernel::bind_cols`] / [`AttentionKernel::record_cols`], the same body with a
//! column grid dimension, in an independent (multi-stream decode) and a prefill mode.
//!
//! Invariants: KV cache `[ctx, Hkv, D]` f32, row `pos` written only by the chunk kernel of the
//! same step (the owning workgroup); `qkv` is read only, so the raw q/k/v stay for tracing.
//! `pos < ctx` is the host's job (the kernels clamp reads to the cache and skip an out-of-range
//! write). The partial buffers ([`AttentionScratch`]) are per dispatch sequence, so one scratch
//! can serve every layer. Every kernel returns at once when `state.done != 0`.

use crate::context::{Context, GpuError, Result};
use crate::numerics::{act_out_wgsl, Numerics};
use crate::state::STATE_WGSL;
use crate::tensor::QuantActs;
use nibble_model::kv_cache::CacheType;
use nibble_model::rope::{rope_table, RopeScaling, RopeTable};

/// Largest workgroup of the chunk and combine kernels (a power of two, >= D/4 for every valid
/// D). Both are sized from the shape (`G * D/4` outputs, `D/4` lanes x 8 chunk slices) between
/// 64 and this: 256 at Qwen3 shapes; small shapes stay small, which lavapipe (a CPU, paying for
/// every invocation at every barrier) needs.
const CHUNK_WG: u32 = 256;
/// Shapes and constants of one model's attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Hq: query heads.
    pub heads: u32,
    /// Hkv: key/value heads (`heads % kv_heads == 0`).
    pub kv_heads: u32,
    /// D: head dim (a multiple of 4; of 32 for the int8 output).
    pub head_dim: u32,
    /// Cache rows (maximum positions).
    pub ctx: u32,
    /// Minimum positions per attention chunk (the unit of sequence parallelism); longer
    /// contexts use longer chunks (see `Split`).
    pub chunk: u32,
    pub rope_theta: f32,
    /// YaRN or linear RoPE scaling (the model's); its attention factor's square scales the
    /// scores (the kernels leave `q` and `k` unscaled, so the cache holds plain rotated keys).
    pub rope_scaling: Option<RopeScaling>,
    pub eps: f32,
    /// The cache's element type (attention_wgsl.rs `kv_wgsl`): what its rows hold and how many
    /// bytes they take.
    pub cache: CacheType,
}

impl AttentionParams {
    /// The attention of `cfg` with a cache of `ctx` positions of type `cache` and the default
    /// minimum chunk of 16 (one tile at D = 128: at position 512 that is 33 x Hkv workgroups).
    pub fn from_config(
        cfg: &nibble_model::config::Qwen3MoeConfig,
        ctx: usize,
        cache: CacheType,
    ) -> Result<Self> {
        let u = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| GpuError::Shape(format!("{what} {v} does not fit u32")))
        };
        let p = AttentionParams {
            heads: u(cfg.num_heads, "num_heads")?,
            kv_heads: u(cfg.num_kv_heads, "num_kv_heads")?,
            head_dim: u(cfg.head_dim, "head_dim")?,
            ctx: u(ctx, "ctx")?,
            chunk: 16,
            rope_theta: cfg.rope_theta,
            rope_scaling: cfg.rope_scaling,
            eps: cfg.rms_norm_eps,
            cache,
        };
        p.validate()?;
        Ok(p)
    }

    /// G: query heads per kv head.
    pub fn group(&self) -> u32 {
        self.heads / self.kv_heads
    }

    /// Bytes of one slot's cache `[ctx, Hkv, D]` (keys or values).
    pub fn cache_bytes(&self) -> u64 {
        self.ctx as u64 * self.kv_heads as u64 * self.head_dim as u64 * self.cache.bytes() as u64
    }

    /// Chunks covering the whole cache.
    pub fn max_chunks(&self) -> u32 {
        self.ctx.div_ceil(self.chunk)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(GpuError::Shape(format!("attention {self:?}: {m}")));
        if self.heads == 0 || self.kv_heads == 0 || self.heads % self.kv_heads != 0 {
            return bad("heads must be a positive multiple of kv_heads".into());
        }
        if self.head_dim == 0 || self.head_dim % 4 != 0 || self.head_dim > 1024 {
            return bad("head_dim must be a multiple of 4 in 4..=1024".into());
        }
        if self.group() > CHUNK_WG {
            return bad(format!("more than {CHUNK_WG} query heads per kv head"));
        }
        if self.ctx == 0 || self.chunk == 0 || self.chunk > 1024 {
            return bad("ctx must be > 0 and chunk in 1..=1024".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad("rope_theta must be finite and > 1".into());
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps must be finite and > 0".into());
        }
        // Element counts of the largest buffers must stay addressable with u32 indices.
        let cache = self.ctx as u64 * self.kv_heads as u64 * self.head_dim as u64;
        let parts = self.heads as u64 * self.max_chunks() as u64 * self.head_dim as u64;
        if cache >= 1 << 31 || parts >= 1 << 31 {
            return bad("cache or partials exceed 2^31 elements".into());
        }
        Ok(())
    }
}

/// The rotation of `p` (`nibble_model::rope::rope_table`): the `[D/2]` inverse frequencies the
/// kernels read and the attention factor whose square their score scale carries. Shared by the
/// kernels and the reference.
pub fn rope(p: &AttentionParams) -> RopeTable {
    rope_table(p.rope_theta, p.rope_scaling, p.head_dim as usize)
}

/// Compiled attention pipelines plus the constant inverse-frequency table.
#[derive(Debug, Clone)]
pub struct AttentionKernel {
    /// The shapes the shaders were compiled for. Private: `bind` and `record` read them, and
    /// the unchecked chunk module relies on those matching its constants.
    params: AttentionParams,
    chunk: wgpu::ComputePipeline,
    /// `chunk` for a one-chunk grid, writing the final f32 output (no combine).
    single: wgpu::ComputePipeline,
    /// `chunk` with the combine in the last chunk workgroup of each kv head ([`Combine::Fused`]).
    fused: wgpu::ComputePipeline,
    /// Which of `fused` or `chunk` + `combine` records positions needing several chunks.
    merge: Combine,
    /// `fused` only while a step's chunks per kv head stay within this ([`FUSED_MAX_CHUNKS`]).
    fused_max: u32,
    combine: wgpu::ComputePipeline,
    /// Quantised output: plain and precise int8 (`None` unless `D % 32 == 0`).
    combine_q8: Option<[wgpu::ComputePipeline; 2]>,
    /// `[D/2]` f32.
    inv_freq: wgpu::Buffer,
    split: Split,
    /// The chunk body this kernel was compiled with.
    shape: ChunkShape,
    /// Sources of the chunk and combine modules, extended by the column forms.
    src: cols::Sources,
    /// Column pipelines per [`ColumnMode`], compiled on first [`Self::bind_cols`].
    cols: [std::sync::OnceLock<cols::ColsPipelines>; 2],
    /// A second kernel for the single-sequence steps from a position on ([`Self::with_deep`]).
    deep: Option<Box<Deep>>,
}

/// The buffers one layer's attention reads and writes (see the module docs for shapes).
#[derive(Debug, Clone, Copy)]
pub struct AttentionBuffers<'a> {
    /// Run state (`State` in shaders/state.wgsl).
    pub state: &'a wgpu::Buffer,
    /// `[Hq*D | Hkv*D | Hkv*D]` f32: fused q|k|v projection output (read only).
    pub qkv: &'a wgpu::Buffer,
    /// `[D]` f32 q_norm / k_norm weights.
    pub q_norm: &'a wgpu::Buffer,
    pub k_norm: &'a wgpu::Buffer,
    /// `[ctx, Hkv, D]` f32 this layer's cache.
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    /// `[Hq*D]` f32 attention output.
    pub out: &'a wgpu::Buffer,
    /// When set, the output is also written int8-quantised here (`Hq*D` elements).
    pub out_q: Option<&'a QuantActs>,
}

/// Chunk partials, reusable by every layer: `part_o [B, Hq, NC, D]`, `part_ml [B, Hq, NC] (m, l)`
/// with `NC` = `Split::slots` and `B` columns (1 from [`AttentionKernel::scratch`]).
#[derive(Debug)]
pub struct AttentionScratch {
    part_o: wgpu::Buffer,
    part_ml: wgpu::Buffer,
    /// `[B, Hkv]` u32 chunk arrival counts of the fused combine, zero between dispatches.
    arrive: wgpu::Buffer,
    /// B: columns the partials hold.
    columns: u32,
}

/// Bind groups of one layer, created once.
#[derive(Debug)]
pub struct AttentionBinding {
    chunk: wgpu::BindGroup,
    /// For the `single` pipeline; `None` when the output is quantised (that needs the combine).
    single: Option<wgpu::BindGroup>,
    /// For the `fused` pipeline; `None` when the output is quantised or the kernel's
    /// [`Combine`] is the dispatch.
    fused: Option<wgpu::BindGroup>,
    combine: wgpu::BindGroup,
    /// Index into `combine_q8` when the output is quantised.
    quantized: Option<usize>,
    /// The deep kernel's binding of the same buffers, when the kernel has one.
    deep: Option<Box<AttentionBinding>>,
}

impl AttentionKernel {
    /// The shapes this kernel was compiled for.
    pub fn params(&self) -> AttentionParams {
        self.params
    }

    /// Compile the pipelines for `params` and upload the RoPE table.
    pub fn new(ctx: &Context, params: AttentionParams) -> Result<Self> {
        Self::with_split(ctx, params, None)
    }

    /// [`Self::new`] with the split's target chunks per kv head and chunk cap overridden (tests
    /// reach the long-context geometry with small caches this way; kernel_bench times other
    /// splits).
    pub fn with_split(
        ctx: &Context,
        params: AttentionParams,
        over: Option<(u32, u32)>,
    ) -> Result<Self> {
        Self::with_split_tile(ctx, params, over, TILE_LOADS)
    }

    /// [`Self::new`] with the comparison overrides of [`crate::tune::Tune`]: `workgroups`, the
    /// split's target workgroups over all kv heads (default 1024), and `tile_loads` (default
    /// [`TILE_LOADS`]).
    pub fn with_overrides(
        ctx: &Context,
        params: AttentionParams,
        workgroups: Option<u32>,
        shape: ChunkShape,
    ) -> Result<Self> {
        if workgroups == Some(0) {
            return Err(GpuError::Shape(
                "attention: a split over 0 workgroups".into(),
            ));
        }
        let over = workgroups.map(|w| ((w / params.kv_heads).max(1), CHUNK_CAP));
        Self::with_shape(ctx, params, over, shape)
    }

    /// [`Self::with_split`] with `tile_loads` cache loads per thread per tile instead of
    /// [`TILE_LOADS`] (1..=16; wider tiles mean fewer tile rounds per chunk, for benchmarks).
    pub fn with_split_tile(
        ctx: &Context,
        params: AttentionParams,
        over: Option<(u32, u32)>,
        tile_loads: u32,
    ) -> Result<Self> {
        let shape = ChunkShape {
            tile_loads,
            ..ChunkShape::default()
        };
        Self::with_shape(ctx, params, over, shape)
    }

    /// [`Self::with_split`] with the chunk body `shape` (form, loads per thread per tile, V rows
    /// per batch).
    pub fn with_shape(
        ctx: &Context,
        params: AttentionParams,
        over: Option<(u32, u32)>,
        shape: ChunkShape,
    ) -> Result<Self> {
        params.validate()?;
        let ChunkShape {
            form,
            tile_loads,
            v_rows,
        } = shape;
        if !(1..=16).contains(&tile_loads) || !(1..=16).contains(&v_rows) {
            return Err(GpuError::Shape(format!(
                "attention: {tile_loads} loads per thread per tile, {v_rows} V rows per batch (expected 1..=16)"
            )));
        }
        // The streamed form keeps a register per head (`acc{g}`): past 32 heads per kv head
        // they would spill.
        if form == AttnForm::Stream && params.group() > 32 {
            return Err(GpuError::Shape(format!(
                "attention: the streamed form serves at most 32 query heads per kv head, not {}",
                params.group()
            )));
        }
        let p = &params;
        let (d, g) = (p.head_dim, p.group());
        let d4 = d / 4;
        let wg = (g * d4).next_power_of_two().clamp(64, CHUNK_WG);
        let cwg = (8 * d4).next_power_of_two().clamp(64, CHUNK_WG);
        let tile = (tile_loads * wg / d4).clamp(1, TILE_CAP);
        let tile_vec4s = match form {
            AttnForm::Tiles => tile * (d4 + 1),
            AttnForm::Stream => stream_tile_vec4s(tile, d4, wg),
        };
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        // Chunk kernel shared memory: qs + tile + red + stat + kown + cst + rms (+ 12: the score
        // buffer rounded up to whole vec4s), plus 4*G bytes per chunk position.
        let fixed =
            (g * d4 * 16 + tile_vec4s * 16 + wg * 4 + g * 8 + d * 8 + (g + 1) * 4 + 12) as u64;
        let fit = (limit.saturating_sub(fixed) / (4 * g as u64)).min(u32::MAX as u64) as u32;
        if p.chunk > fit {
            return Err(GpuError::Shape(format!(
                "attention chunk of {} needs {} bytes of workgroup memory, device allows {limit}: lower the chunk",
                p.chunk,
                fixed + 4 * g as u64 * p.chunk as u64
            )));
        }
        let (target, cap) = over.unwrap_or(((TARGET_WORKGROUPS / p.kv_heads).max(1), CHUNK_CAP));
        let split = Split {
            target: target.max(1),
            min: p.chunk,
            max: (cap.min(fit) / tile * tile).max(p.chunk),
            tile,
            ctx: p.ctx,
        };
        let nw = split.slots();
        let combine_shared = (d * 4 + nw * 4 + cwg * 24) as u64;
        if combine_shared > limit || nw as u64 * p.heads as u64 * d as u64 >= 1 << 31 {
            return Err(GpuError::Shape(format!(
                "attention combine over {nw} chunks needs {combine_shared} bytes of workgroup memory, device allows {limit}"
            )));
        }
        let dims = [
            u32_const("D", d),
            u32_const("D4", d / 4),
            u32_const("HQ", p.heads),
            u32_const("HKV", p.kv_heads),
            u32_const("G", g),
            u32_const("CTX", p.ctx),
            u32_const("C", p.chunk),
            u32_const("NC", nw),
            u32_const("NW", nw),
            u32_const("P", tile),
            u32_const("DP", d4 + 1),
            u32_const("CMAX", split.max),
            format!(
                "const SC4: bool = {};\n",
                split.max % 4 == 0 && tile % 4 == 0
            ),
            u32_const("OPT", (g * d4).div_ceil(wg)),
            f32_const("EPS", p.eps),
            f32_const("SCALE", rope(p).score_scale()),
            split.wgsl(),
            kv_wgsl(p.cache),
        ]
        .concat();
        let src = |wg: u32, extra: &str, body: &str| {
            format!("{STATE_WGSL}{dims}{}{extra}{body}", u32_const("WG", wg))
        };
        // Largest power of two <= WG / G lanes per query head in the softmax reductions, and
        // <= WG / (G + 1) (at least 1) per head vector in the q/k norm reduction.
        let lg = 1u32 << (wg / g).ilog2();
        let lr = 1u32 << (wg / (g + 1)).max(1).ilog2();
        let chunk_src = src(
            wg,
            &[u32_const("LG", lg), u32_const("LR", lr)].concat(),
            &[
                chunk_body(form, tile, d4, wg, g, v_rows).as_str(),
                include_str!("../shaders/attention_rope.wgsl"),
            ]
            .concat(),
        );
        // Compiled without naga's runtime bounds checks: they cost this kernel 6-9% on the H200
        // (docs/BENCHMARKS.md run 110: 24.03 -> 22.55 us per chunk dispatch at position 4096).
        // SAFETY: every index of the module (attention.wgsl + attention_rope.wgsl + the written-out
        // `stage` / `prefetch`) stays in bounds for any run-state position, because:
        // - kv head h = wid.y < HKV (the grid's y) and query head offsets < G, so qkv indices stay
        //   below (HQ + 2 HKV) D and out below HQ D; q_norm / k_norm are read below D, inv_freq
        //   below D / 2; `bind_at` checks each buffer's size (and the scratch's, below);
        // - cache rows: n = min(pos + 1, CTX) (a wrapped pos + 1 = 0 gives n = 0, and every
        //   workgroup returns); a tile reads rows t0 + tt + r < t0 + len <= n <= CTX, and the owner
        //   writes row pos only when pos < CTX;
        // - chunk c = wid.x goes on only while c * chunk_len(n) < n, i.e. c < chunks(n) <= NC (the
        //   host's `Split::chunks_bound`, checked for every position by
        //   `attention_split_bounds_hold_for_every_position`), so part_o / part_ml stay below
        //   HQ NC (D, 1); the fused combine walks c < nc <= NC and reads the tile below G nc only
        //   when G nc <= P DP;
        // - workgroup arrays: tile rows r < rows <= P (elements e < rows D4), score slots
        //   tt + t < len <= chunk_len <= CMAX, the trees' `li + st` stay inside their LG / LR
        //   group (lane < st <= group / 2, WG a multiple of both), qs / kown / cst / rms / stat
        //   below G D4 / D4 / D/2 / G+1 / G by their loop bounds;
        // - the streamed body (attention_stream.wgsl): a key block element e < rows D4 is row
        //   e / D4 < rows <= P of `tile` (P DP <= TILE_N) and cache row t0 + tt + e / D4 < t0 +
        //   len; a V lane loads only while vt < TS, rows r < len, vec4 vd < D4; score_row reads
        //   tile row t < rows, qs at min(g, G - 1) D4 + d, and writes sc at g < G, tt + t < len;
        //   the fmas read sc at r < len <= CMAX; the reduction puts (vt GR + j) D4 + vd < TS GR
        //   D4 <= TILE_N (GR by the host: `stream_body`) and reads u < TS alike;
        // - every loop advances a counter towards a constant or `n` bound (no loop-bounding
        //   needed).
        // The column forms (attention_cols.rs) extend this audit to their column offsets.
        let module = unsafe { ctx.module_unchecked("attention.chunk", &chunk_src)? };
        let chunk = ctx.pipeline("attention.chunk", &module, "chunk")?;
        let single = ctx.pipeline("attention.single", &module, "single")?;
        let fused = ctx.pipeline("attention.fused", &module, "fused")?;
        let combine_src = |n: Numerics| {
            src(
                cwg,
                &act_out_wgsl(n, 4, 5),
                include_str!("../shaders/attention_combine.wgsl"),
            )
        };
        let combine_int8 = combine_src(Numerics::Int8);
        let module = ctx.module("attention.combine", &combine_int8)?;
        let combine = ctx.pipeline("attention.combine", &module, "combine")?;
        let combine_q8 = if d % 32 == 0 {
            let precise = ctx.module(
                "attention.combine.precise",
                &combine_src(Numerics::PreciseInt8),
            )?;
            Some([
                ctx.pipeline("attention.combine_q8", &module, "combine_q8")?,
                ctx.pipeline("attention.combine_q8.precise", &precise, "combine_q8")?,
            ])
        } else {
            None
        };
        let table = rope(p).inv_freq;
        let inv_freq = ctx.storage_init("attention.inv_freq", bytemuck::cast_slice(&table))?;
        Ok(AttentionKernel {
            params,
            chunk,
            single,
            fused,
            merge: Combine::for_context(ctx),
            fused_max: FUSED_MAX_CHUNKS,
            combine,
            combine_q8,
            inv_freq,
            split,
            shape,
            src: cols::Sources {
                chunk: chunk_src,
                combine: combine_int8,
            },
            cols: Default::default(),
            deep: None,
        })
    }

    /// This kernel with the partials merged as `merge` says ([`Combine::for_context`] by
    /// default; tests and benchmarks compare both). Takes effect for bindings made after.
    pub fn with_combine(mut self, merge: Combine) -> Self {
        self.merge = merge;
        self.deep = self
            .deep
            .map(|d| Box::new(d.map(|k| k.with_combine(merge))));
        self
    }

    /// This kernel with the fused combine serving steps of up to `chunks` chunks per kv head
    /// (benchmarks time it past [`FUSED_MAX_CHUNKS`]).
    pub fn with_fused_max_chunks(mut self, chunks: u32) -> Self {
        self.fused_max = chunks;
        self.deep = (self.deep).map(|d| Box::new(d.map(|k| k.with_fused_max_chunks(chunks))));
        self
    }

    /// The chunk body this kernel was compiled with (form, loads per tile, V rows per batch).
    pub fn shape(&self) -> ChunkShape {
        self.shape
    }

    /// How this kernel merges chunk partials.
    pub fn combine(&self) -> Combine {
        self.merge
    }

    /// The sequence split this kernel uses.
    #[cfg(test)]
    pub(crate) fn split(&self) -> Split {
        self.split
    }

    /// Check the buffer sizes and create the bind groups of one layer.
    pub fn bind(
        &self,
        ctx: &Context,
        b: &AttentionBuffers<'_>,
        scratch: &AttentionScratch,
    ) -> Result<AttentionBinding> {
        self.bind_at(ctx, b, scratch, 0)
    }

    /// [`Self::bind`] with the cache `[ctx, Hkv, D]` starting `kv_offset` bytes into
    /// `k_cache` and `v_cache`: one slot of a multi-stream cache `[B, ctx, Hkv, D]`, so the
    /// single-sequence plan can decode a lone stream in place (plan_slots.rs). The offset
    /// must be a multiple of the device's storage-offset alignment.
    pub fn bind_at(
        &self,
        ctx: &Context,
        b: &AttentionBuffers<'_>,
        scratch: &AttentionScratch,
        kv_offset: u64,
    ) -> Result<AttentionBinding> {
        let p = &self.params;
        let (hq, hkv, d) = (p.heads as u64, p.kv_heads as u64, p.head_dim as u64);
        let cache = p.cache_bytes();
        let align = ctx.limits.min_storage_buffer_offset_alignment as u64;
        if kv_offset % align != 0 {
            return Err(GpuError::Shape(format!(
                "attention cache offset {kv_offset} is not a multiple of {align}"
            )));
        }
        need(b.state, 4, "state")?;
        need(b.qkv, (hq + 2 * hkv) * d, "qkv")?;
        need(b.q_norm, d, "q_norm")?;
        need(b.k_norm, d, "k_norm")?;
        need(b.k_cache, (kv_offset + cache) / 4, "k_cache")?;
        need(b.v_cache, (kv_offset + cache) / 4, "v_cache")?;
        need(b.out, hq * d, "out")?;
        self.check_scratch(scratch, 1)?;
        let range = |buf| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: buf,
                offset: kv_offset,
                size: std::num::NonZeroU64::new(cache),
            })
        };
        // Both entry points share one body, so both layouts hold every binding.
        let chunk_res = [
            whole(b.state),
            whole(b.qkv),
            whole(b.q_norm),
            whole(b.k_norm),
            whole(&self.inv_freq),
            range(b.k_cache),
            range(b.v_cache),
            whole(&scratch.part_o),
            whole(&scratch.part_ml),
            whole(b.out),
        ];
        let chunk = ctx.bind_group("attention.chunk", &self.chunk, &chunk_res)?;
        let single = match b.out_q {
            None => Some(ctx.bind_group("attention.single", &self.single, &chunk_res)?),
            Some(_) => None,
        };
        let fused = match (b.out_q, self.merge) {
            (None, Combine::Fused) => {
                let mut res = chunk_res.to_vec();
                res.push(whole(&scratch.arrive));
                let at: Vec<u32> = (0..10).chain([12]).collect();
                Some(ctx.bind_group_at("attention.fused", &self.fused, &at, &res)?)
            }
            _ => None,
        };
        let mut res = vec![
            whole(b.state),
            whole(&scratch.part_o),
            whole(&scratch.part_ml),
            whole(b.out),
        ];
        let pipe = match (b.out_q, &self.combine_q8) {
            (None, _) => &self.combine,
            (Some(q), Some(pipes)) => {
                let pipe = &pipes[q.precise as usize];
                if q.n as u64 != hq * d {
                    return Err(GpuError::Shape(format!(
                        "attention out_q holds {} activations, need {}",
                        q.n,
                        hq * d
                    )));
                }
                res.push(whole(&q.q));
                res.push(whole(&q.s));
                pipe
            }
            (Some(_), None) => {
                return Err(GpuError::Shape(format!(
                    "int8 attention output needs head_dim % 32 == 0, got {d}"
                )))
            }
        };
        let combine = ctx.bind_group("attention.combine", pipe, &res)?;
        let deep = (self.deep.as_ref())
            .map(|d| d.kernel.bind_at(ctx, b, scratch, kv_offset).map(Box::new))
            .transpose()?;
        Ok(AttentionBinding {
            chunk,
            single,
            fused,
            combine,
            quantized: b.out_q.map(|q| q.precise as usize),
            deep,
        })
    }

    /// The bind group of the one-dispatch `single` variant when it serves `pos_bound`: the
    /// bound guarantees one chunk and the output is f32 only.
    fn single_for<'b>(
        &self,
        b: &'b AttentionBinding,
        pos_bound: u32,
    ) -> Option<&'b wgpu::BindGroup> {
        let one = self.one_chunk(pos_bound);
        b.single.as_ref().filter(|_| one)
    }

    /// The bind group of the `fused` variant when it serves `pos_bound`: the binding has it and
    /// the bound needs at most `fused_max` chunks per kv head.
    fn fused_for<'b>(
        &self,
        b: &'b AttentionBinding,
        pos_bound: u32,
    ) -> Option<&'b wgpu::BindGroup> {
        b.fused.as_ref().filter(|_| self.fused_serves(pos_bound))
    }

    /// Whether a step at a position up to `pos_bound` needs at most `fused_max` chunks per kv
    /// head (the fused combine's limit).
    fn fused_serves(&self, pos_bound: u32) -> bool {
        self.split.chunks_bound(self.positions_bound(pos_bound)) <= self.fused_max
    }

    /// Whether one chunk covers every position up to `pos_bound` (the `single` variants).
    fn one_chunk(&self, pos_bound: u32) -> bool {
        self.split.chunks_bound(self.positions_bound(pos_bound)) == 1
    }

    /// Positions an attention step at position `<= pos_bound` covers, at most (the cache).
    fn positions_bound(&self, pos_bound: u32) -> u32 {
        pos_bound.min(self.params.ctx - 1) + 1
    }

    /// Record one layer's attention: `single` alone while one chunk covers `pos_bound`, else
    /// `fused` when it serves the bound, else `chunk` then `combine` ([`Self::dispatches`]). `pos_bound` is an upper bound of the position this step runs at (the host
    /// knows it: start + step); chunks past the real position exit at once, so any bound >= pos
    /// is correct and `ctx - 1` always is.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &AttentionBinding, pos_bound: u32) {
        self.record_marked(pass, b, pos_bound, &mut |_, _| {});
    }

    /// [`Self::record`] calling `mark(pass, op)` after each dispatch (the plan's profile).
    pub fn record_marked<F: FnMut(&mut wgpu::ComputePass<'_>, &'static str)>(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        b: &AttentionBinding,
        pos_bound: u32,
        mark: &mut F,
    ) {
        if let Some((k, b)) = self.deep_for(b, pos_bound) {
            return k.record_marked(pass, b, pos_bound, mark);
        }
        let p = &self.params;
        if let Some(single) = self.single_for(b, pos_bound) {
            pass.set_pipeline(&self.single);
            pass.set_bind_group(0, single, &[]);
            pass.dispatch_workgroups(1, p.kv_heads, 1);
            mark(pass, "attention (one chunk)");
            return;
        }
        let chunks = self.split.chunks_bound(self.positions_bound(pos_bound));
        if let Some(fused) = self.fused_for(b, pos_bound) {
            pass.set_pipeline(&self.fused);
            pass.set_bind_group(0, fused, &[]);
            pass.dispatch_workgroups(chunks, p.kv_heads, 1);
            mark(pass, "attention chunks+combine");
            return;
        }
        pass.set_pipeline(&self.chunk);
        pass.set_bind_group(0, &b.chunk, &[]);
        pass.dispatch_workgroups(chunks, p.kv_heads, 1);
        mark(pass, "attention chunks");
        match (&self.combine_q8, b.quantized) {
            (Some(q8), Some(i)) => pass.set_pipeline(&q8[i]),
            _ => pass.set_pipeline(&self.combine),
        }
        pass.set_bind_group(0, &b.combine, &[]);
        pass.dispatch_workgroups(p.heads, 1, 1);
        mark(pass, "attention combine");
    }

    /// Dispatches [`Self::record`] issues for binding `b` at `pos_bound`: 1 while one chunk
    /// covers every position up to the bound and the output is f32 only, or while the fused
    /// combine serves the bound, else 2.
    pub fn dispatches(&self, b: &AttentionBinding, pos_bound: u32) -> u32 {
        if let Some((k, b)) = self.deep_for(b, pos_bound) {
            return k.dispatches(b, pos_bound);
        }
        if self.single_for(b, pos_bound).is_some() || self.fused_for(b, pos_bound).is_some() {
            1
        } else {
            2
        }
    }
}

fn whole(buf: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    buf.as_entire_binding()
}

/// `buf` must hold `elems` f32/u32 elements.
fn need(buf: &wgpu::Buffer, elems: u64, what: &str) -> Result<()> {
    if buf.size() < elems * 4 {
        return Err(GpuError::Shape(format!(
            "attention {what}: {} bytes, need {}",
            buf.size(),
            elems * 4
        )));
    }
    Ok(())
}

#[path = "attention_forms.rs"]
mod forms;
pub use forms::{AttnForm, ChunkShape, Combine, FUSED_MAX_CHUNKS, TILE_LOADS, V_ROWS};
use forms::{CHUNK_CAP, TARGET_WORKGROUPS, TILE_CAP};

#[path = "attention_deep.rs"]
mod deep;
use deep::Deep;

#[path = "attention_split.rs"]
mod split;
pub(crate) use split::Split;

#[path = "attention_wgsl.rs"]
mod wgsl;
pub(crate) use wgsl::kv_wgsl;
use wgsl::{chunk_body, f32_const, stream_tile_vec4s, u32_const};

#[path = "attention_ref.rs"]
mod reference;
pub use reference::{attention_ref, rope_ref};

#[path = "attention_cols.rs"]
mod cols;
pub use cols::{AttentionColsBinding, AttentionColsBuffers, ColumnMode, KvWriteBinding};

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
