//! Multi-column attention: the chunk / single / combine kernels of `attention.rs` over `B`
//! columns (columns.rs: up to 8 streams, or one per prefill-chunk token) in one dispatch each, the column in the grid's z dimension. Column `c`
//! reads its q|k|v at `qkv[c * (Hq + 2 Hkv) * D ..]`, its position `cols[c].pos` and its KV
//! region, slot `cols[c].slot` of the `[slots, ctx, Hkv, D]` caches (rows from `slot * ctx`),
//! and writes `out[c * Hq * D ..]`; its chunk partials get a leading column dimension
//! ([`AttentionKernel::scratch_cols`]). The WGSL body is the single-token one, handed a
//! per-column `Site` (shaders/attention_chunk_cols.wgsl, attention_combine_cols.wgsl).
//!
//! Two modes, fixed per binding ([`ColumnMode`]):
//! - `Independent` (multi-stream decode): as the single-token kernel, the workgroup owning
//!   position `pos` of a column writes that column's roped k / raw v row and uses the values
//!   directly. Columns must not read rows other columns write in the same step (the host gives
//!   them distinct slots).
//! - `Prefill` (consecutive prompt tokens of one sequence: one slot, positions `p0 + c`): a
//!   KV-write dispatch first stores every column's row, then the attention reads every row from
//!   the cache, so column `c` sees the rows of columns `< c` of the same step. One more dispatch.
//!
//! Skipped columns (`done != 0`, or a slot outside the bound caches, or `state.done`) touch
//! nothing: no cache row, no partial, no output. Positions past the cache clamp the reads and
//! skip the write, as in the single-token form. The column pipelines compile on first bind of a
//! mode, so runs that never use columns pay nothing.

use super::{need, whole, AttentionKernel, AttentionScratch};
use crate::columns::{COLUMNS_WGSL, MAX_COLUMNS};
use crate::context::{Context, GpuError, Result};

/// How the columns of one binding get their new K/V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnMode {
    /// Multi-stream decode: every column writes its own row inside its attention dispatch.
    Independent,
    /// Batched prefill: one KV-write dispatch for all columns, then the attention.
    Prefill,
}

/// Shader sources of the single-token modules (constants + bodies), extended by the column forms.
#[derive(Debug, Clone)]
pub(super) struct Sources {
    pub chunk: String,
    pub combine: String,
}

/// Compiled column pipelines of one mode.
#[derive(Debug, Clone)]
pub(super) struct ColsPipelines {
    chunk: wgpu::ComputePipeline,
    single: wgpu::ComputePipeline,
    combine: wgpu::ComputePipeline,
    /// The chunk form with the combine fused in ([`super::Combine::Fused`]).
    fused: wgpu::ComputePipeline,
    /// `kv_write_cols`, prefill mode only.
    kv_write: Option<wgpu::ComputePipeline>,
}

/// The buffers one layer's multi-column attention reads and writes.
#[derive(Debug, Clone, Copy)]
pub struct AttentionColsBuffers<'a> {
    /// Run state (`State` in shaders/state.wgsl): `done` ends every column at once.
    pub state: &'a wgpu::Buffer,
    /// `[max(columns, MAX_COLUMNS)]` `Col` (columns.rs): per-column position, slot, done.
    pub cols: &'a wgpu::Buffer,
    /// `[columns, Hq*D | Hkv*D | Hkv*D]` f32: fused q|k|v per column (read only).
    pub qkv: &'a wgpu::Buffer,
    /// `[D]` f32 q_norm / k_norm weights.
    pub q_norm: &'a wgpu::Buffer,
    pub k_norm: &'a wgpu::Buffer,
    /// `[slots, ctx, Hkv, D]` f32 this layer's cache.
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    /// `[columns, Hq*D]` f32 attention output.
    pub out: &'a wgpu::Buffer,
    /// Columns the activation buffers hold (1..=65535): the most `nb` can be.
    pub columns: u32,
    /// KV slots the caches hold (>= 1); columns with `slot >= slots` are skipped.
    pub slots: u32,
    pub mode: ColumnMode,
}

/// The prefill mode's KV write on its own ([`AttentionKernel::bind_kv_write`]).
#[derive(Debug)]
pub struct KvWriteBinding {
    pipe: wgpu::ComputePipeline,
    bg: wgpu::BindGroup,
    columns: u32,
    /// The binding kernel's shapes: its pipeline was compiled for them, so only a kernel of
    /// the same shapes may record it (the grid comes from the recording kernel).
    made_by: Made,
}

/// What a column binding's pipelines were compiled for ([`KvWriteBinding`],
/// [`AttentionColsBinding`]): the pipelines run unchecked, and their grids come from the
/// recording kernel, so recording refuses a binding of another kernel's shapes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Made {
    params: super::AttentionParams,
    split: super::Split,
}

/// Bind groups of one layer's multi-column attention, created once.
#[derive(Debug)]
pub struct AttentionColsBinding {
    pipes: ColsPipelines,
    chunk: wgpu::BindGroup,
    single: wgpu::BindGroup,
    combine: wgpu::BindGroup,
    /// With [`super::Combine::Fused`] only.
    fused: Option<wgpu::BindGroup>,
    /// Prefill mode only.
    kv_write: Option<wgpu::BindGroup>,
    columns: u32,
    mode: ColumnMode,
    made_by: Made,
}

impl AttentionColsBinding {
    /// The mode this binding was created for.
    pub fn mode(&self) -> ColumnMode {
        self.mode
    }

    /// Columns the bound buffers hold (the largest `nb` [`AttentionKernel::record_cols`] takes).
    pub fn columns(&self) -> u32 {
        self.columns
    }
}

/// Columns are the grid's z: 1..=65535 (the multi-stream plans use up to [`MAX_COLUMNS`], the
/// prefill plan one per chunk token).
fn check_columns(columns: u32, what: &str) -> Result<()> {
    if columns == 0 || columns > 65535 {
        return Err(GpuError::Shape(format!(
            "attention {what}: {columns} columns, need 1..=65535"
        )));
    }
    Ok(())
}

impl AttentionKernel {
    fn made(&self) -> Made {
        Made {
            params: self.params,
            split: self.split,
        }
    }

    /// Error unless a binding made by a kernel of `made` shapes may be recorded by this one.
    fn check_made(&self, made: Made) -> Result<()> {
        if made != self.made() {
            return Err(GpuError::Shape(format!(
                "attention columns: a binding made for {:?} recorded by a kernel for {:?}",
                made,
                self.made()
            )));
        }
        Ok(())
    }

    /// Partial buffers for up to `columns` columns over the whole cache.
    pub fn scratch_cols(&self, ctx: &Context, columns: u32) -> Result<AttentionScratch> {
        check_columns(columns, "scratch")?;
        self.scratch_for(ctx, columns)
    }

    /// The column pipelines of `mode`, compiled on first use.
    fn cols_pipelines(&self, ctx: &Context, mode: ColumnMode) -> Result<ColsPipelines> {
        let slot = &self.cols[mode as usize];
        if let Some(p) = slot.get() {
            return Ok(p.clone());
        }
        let shared = include_str!("../shaders/attention_cols.wgsl");
        // WGSL declarations are order-independent, so the column parts follow the bodies.
        let chunk_src = [
            self.src.chunk.as_str(),
            shared,
            include_str!("../shaders/attention_chunk_cols.wgsl"),
            COLUMNS_WGSL,
        ]
        .concat();
        let combine_src = [
            self.src.combine.as_str(),
            shared,
            include_str!("../shaders/attention_combine_cols.wgsl"),
            COLUMNS_WGSL,
        ]
        .concat();
        // Compiled without naga's runtime bounds checks, as the single-token chunk module
        // (multi-stream decode; docs/BENCHMARKS.md run 115).
        // SAFETY: the body is the single-token one (the audit in attention.rs
        // `with_split_tile`, which holds for any position and so for `cols[c].pos`), handed
        // column c's `Site`; what the column adds stays in bounds because:
        // - the grids come from the recording kernel, which `record_cols` / `record_kv_write`
        //   require to have this kernel's params and split (`check_made`), so grid y = HKV and
        //   x <= NC as in the single-token audit;
        // - c = wid.z < the recorded nb <= `b.columns` (`record_cols` refuses more; grid z =
        //   nb), and `col_live` reads `cols[c]` only below arrayLength(cols) and runs the
        //   column only when its slot < cp.slots = `b.slots`;
        // - `check_inputs` / `bind_cols` make qkv hold columns (HQ + 2 HKV) D floats, out
        //   columns HQ D, the caches slots CTX HKV D (< 2^31), and the scratch columns HQ NC
        //   partials and columns HKV `arrive` counters (`check_scratch`, whoever made it);
        //   column c's offsets are c (HQ + 2 HKV) D (qkv), slot CTX rows (caches: row0 + row
        //   with row < n <= CTX, or pos < CTX for the write), c HQ query heads (partials, out)
        //   and c HKV + h (arrive);
        // - `kv_write_cols` (prefill mode) writes row pos < CTX of kv head h = wid.y < HKV (grid
        //   y) of a live column, reading its q|k|v as `attend` does;
        // - the one run-time divisor is `chunk_len(n)` >= the split's minimum chunk >= 1.
        // The combine module below keeps the checks, as the single-token combine does.
        let module = unsafe { ctx.module_unchecked("attention.chunk_cols", &chunk_src)? };
        let (chunk, single, fused, kv_write) = match mode {
            ColumnMode::Independent => (
                ctx.pipeline("attention.chunk_cols", &module, "chunk_cols")?,
                ctx.pipeline("attention.single_cols", &module, "single_cols")?,
                ctx.pipeline("attention.fused_cols", &module, "fused_cols")?,
                None,
            ),
            ColumnMode::Prefill => (
                ctx.pipeline("attention.chunk_cols_read", &module, "chunk_cols_read")?,
                ctx.pipeline("attention.single_cols_read", &module, "single_cols_read")?,
                ctx.pipeline("attention.fused_cols_read", &module, "fused_cols_read")?,
                Some(ctx.pipeline("attention.kv_write_cols", &module, "kv_write_cols")?),
            ),
        };
        let module = ctx.module("attention.combine_cols", &combine_src)?;
        let combine = ctx.pipeline("attention.combine_cols", &module, "combine_cols")?;
        let built = ColsPipelines {
            chunk,
            single,
            combine,
            fused,
            kv_write,
        };
        Ok(slot.get_or_init(|| built).clone())
    }

    /// The sizes of everything both bindings read: the cache of `b.slots` slots (u32 indices
    /// address it, see AttentionParams::validate), state, columns, q|k|v and the norms.
    fn check_inputs(&self, b: &AttentionColsBuffers<'_>) -> Result<()> {
        let p = &self.params;
        let (hq, hkv, d) = (p.heads as u64, p.kv_heads as u64, p.head_dim as u64);
        // f32 words of the slots' caches (`need` counts 4-byte words).
        let cache = b.slots as u64 * p.cache_bytes() / 4;
        if b.slots == 0 || b.slots as u64 * p.ctx as u64 * hkv * d >= 1 << 31 {
            return Err(GpuError::Shape(format!(
                "attention cache of {} slots x {} rows: need 1 slot or more and < 2^31 elements",
                b.slots, p.ctx
            )));
        }
        let col_words = (MAX_COLUMNS.max(b.columns as usize)
            * std::mem::size_of::<crate::columns::Col>()
            / 4) as u64;
        need(b.state, 4, "state")?;
        need(b.cols, col_words, "cols")?;
        need(b.qkv, b.columns as u64 * (hq + 2 * hkv) * d, "qkv")?;
        need(b.q_norm, d, "q_norm")?;
        need(b.k_norm, d, "k_norm")?;
        need(b.k_cache, cache, "k_cache")?;
        need(b.v_cache, cache, "v_cache")
    }

    /// Check the buffer sizes and create the bind groups of one layer's multi-column attention
    /// (compiling the column pipelines of `b.mode` on first use).
    pub fn bind_cols(
        &self,
        ctx: &Context,
        b: &AttentionColsBuffers<'_>,
        scratch: &AttentionScratch,
    ) -> Result<AttentionColsBinding> {
        let p = &self.params;
        check_columns(b.columns, "buffers")?;
        if scratch.columns < b.columns {
            return Err(GpuError::Shape(format!(
                "attention scratch holds {} columns, buffers {}",
                scratch.columns, b.columns
            )));
        }
        self.check_inputs(b)?;
        need(
            b.out,
            b.columns as u64 * (p.heads * p.head_dim) as u64,
            "out",
        )?;
        self.check_scratch(scratch, b.columns)?;
        let pipes = self.cols_pipelines(ctx, b.mode)?;
        let params = ctx.uniform(
            "attention.cols_params",
            bytemuck::cast_slice(&[b.slots, 0, 0, 0]),
        )?;
        // Bindings 0..=9 as in the single-token kernel, then cols (10) and params (11).
        let res = [
            whole(b.state),
            whole(b.qkv),
            whole(b.q_norm),
            whole(b.k_norm),
            whole(&self.inv_freq),
            whole(b.k_cache),
            whole(b.v_cache),
            whole(&scratch.part_o),
            whole(&scratch.part_ml),
            whole(b.out),
            whole(b.cols),
            whole(&params),
        ];
        let chunk = ctx.bind_group("attention.chunk_cols", &pipes.chunk, &res)?;
        let single = ctx.bind_group("attention.single_cols", &pipes.single, &res)?;
        let fused = match self.merge {
            super::Combine::Fused => {
                let mut r = res.to_vec();
                r.push(whole(&scratch.arrive));
                let at: Vec<u32> = (0..12).chain([12]).collect();
                Some(ctx.bind_group_at("attention.fused_cols", &pipes.fused, &at, &r)?)
            }
            super::Combine::Dispatch => None,
        };
        // The KV write touches no partial and no output: its derived layout omits them.
        let kv_write = match &pipes.kv_write {
            Some(pipe) => {
                let at = [0, 1, 2, 3, 4, 5, 6, 10, 11];
                let r: Vec<_> = at.iter().map(|i| res[*i as usize].clone()).collect();
                Some(ctx.bind_group_at("attention.kv_write_cols", pipe, &at, &r)?)
            }
            None => None,
        };
        let combine_res = [
            whole(b.state),
            whole(&scratch.part_o),
            whole(&scratch.part_ml),
            whole(b.out),
            whole(b.cols),
            whole(&params),
        ];
        let combine = ctx.bind_group_at(
            "attention.combine_cols",
            &pipes.combine,
            &[0, 1, 2, 3, 10, 11],
            &combine_res,
        )?;
        Ok(AttentionColsBinding {
            pipes,
            chunk,
            single,
            combine,
            fused,
            kv_write,
            columns: b.columns,
            mode: b.mode,
            made_by: self.made(),
        })
    }

    /// Record one layer's attention over columns `0..nb` (`1 <= nb <= b.columns()`): in prefill
    /// mode the KV write first, then `single_cols` alone when one chunk covers every position up
    /// to `pos_bound`, else the fused form while it serves the bound (as [`Self::record`]), else
    /// `chunk_cols` and `combine_cols`. `pos_bound` bounds every column's
    /// position (chunks past a column's position exit at once; `ctx - 1` is always correct).
    pub fn record_cols(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        b: &AttentionColsBinding,
        pos_bound: u32,
        nb: u32,
    ) -> Result<()> {
        if nb == 0 || nb > b.columns {
            return Err(GpuError::Shape(format!(
                "attention record of {nb} columns, binding holds 1..={}",
                b.columns
            )));
        }
        self.check_made(b.made_by)?;
        let p = &self.params;
        if let (Some(pipe), Some(group)) = (&b.pipes.kv_write, &b.kv_write) {
            pass.set_pipeline(pipe);
            pass.set_bind_group(0, group, &[]);
            pass.dispatch_workgroups(1, p.kv_heads, nb);
        }
        if self.one_chunk(pos_bound) {
            pass.set_pipeline(&b.pipes.single);
            pass.set_bind_group(0, &b.single, &[]);
            pass.dispatch_workgroups(1, p.kv_heads, nb);
            return Ok(());
        }
        let chunks = self.split.chunks_bound(self.positions_bound(pos_bound));
        if let Some(fused) = b.fused.as_ref().filter(|_| self.fused_serves(pos_bound)) {
            pass.set_pipeline(&b.pipes.fused);
            pass.set_bind_group(0, fused, &[]);
            pass.dispatch_workgroups(chunks, p.kv_heads, nb);
            return Ok(());
        }
        pass.set_pipeline(&b.pipes.chunk);
        pass.set_bind_group(0, &b.chunk, &[]);
        pass.dispatch_workgroups(chunks, p.kv_heads, nb);
        pass.set_pipeline(&b.pipes.combine);
        pass.set_bind_group(0, &b.combine, &[]);
        pass.dispatch_workgroups(p.heads, 1, nb);
        Ok(())
    }

    /// The prefill mode's KV write alone (no partials, no output): what the GEMM prefill's
    /// query-tile attention (attention_prefill.rs) needs in the cache before it reads it.
    /// `b.mode` must be [`ColumnMode::Prefill`]; `b.out` is not bound.
    pub fn bind_kv_write(
        &self,
        ctx: &Context,
        b: &AttentionColsBuffers<'_>,
    ) -> Result<KvWriteBinding> {
        check_columns(b.columns, "kv write")?;
        if b.mode != ColumnMode::Prefill {
            return Err(GpuError::Shape(
                "attention kv write: needs the prefill mode".into(),
            ));
        }
        self.check_inputs(b)?;
        let pipes = self.cols_pipelines(ctx, ColumnMode::Prefill)?;
        let pipe = pipes
            .kv_write
            .ok_or_else(|| GpuError::Shape("attention kv write: no pipeline".into()))?;
        let params = ctx.uniform(
            "attention.cols_params",
            bytemuck::cast_slice(&[b.slots, 0, 0, 0]),
        )?;
        let res = [
            whole(b.state),
            whole(b.qkv),
            whole(b.q_norm),
            whole(b.k_norm),
            whole(&self.inv_freq),
            whole(b.k_cache),
            whole(b.v_cache),
            whole(b.cols),
            whole(&params),
        ];
        let bg = ctx.bind_group_at(
            "attention.kv_write_cols",
            &pipe,
            &[0, 1, 2, 3, 4, 5, 6, 10, 11],
            &res,
        )?;
        Ok(KvWriteBinding {
            pipe,
            bg,
            columns: b.columns,
            made_by: self.made(),
        })
    }

    /// Record [`Self::bind_kv_write`]'s dispatch over columns `0..nb`.
    pub fn record_kv_write(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        b: &KvWriteBinding,
        nb: u32,
    ) -> Result<()> {
        if nb == 0 || nb > b.columns {
            return Err(GpuError::Shape(format!(
                "attention kv write of {nb} columns, binding holds 1..={}",
                b.columns
            )));
        }
        self.check_made(b.made_by)?;
        pass.set_pipeline(&b.pipe);
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(1, self.params.kv_heads, nb);
        Ok(())
    }

    /// Dispatches [`Self::record_cols`] issues for `b` at `pos_bound`: 1 or 2 (as
    /// [`Self::dispatches`] for an f32 output), plus the KV write in prefill mode.
    pub fn dispatches_cols(&self, b: &AttentionColsBinding, pos_bound: u32) -> u32 {
        let fused = b.fused.is_some() && self.fused_serves(pos_bound);
        let attend = if self.one_chunk(pos_bound) || fused {
            1
        } else {
            2
        };
        attend + b.kv_write.is_some() as u32
    }
}

#[cfg(test)]
#[path = "attention_cols_tests.rs"]
mod tests;
