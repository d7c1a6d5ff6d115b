//! Batched prefill as GEMMs, the default prompt path: up to `chunk` prompt tokens (default
//! [`DEFAULT_CHUNK`]) go through every layer together, each weight block dequantised once per
//! tile of tokens (kernels/gemm.rs) and each expert once per tile of the tokens that chose it
//! (kernels/moe_prefill.rs). The column prefill (`batch.rs`, 8 tokens per dispatch) it replaces
//! read every weight once per 8 tokens and every expert once per token.
//!
//! One chunk, one command buffer, per layer (`T` = tokens in the chunk, buffers `[chunk, ...]`):
//! 1. `xn = rmsnorm(h) * attn_norm` (one workgroup per token);
//! 2. `qkv = Wqkv xn` (dense GEMM);
//! 3. attention: every token's roped k and v written into its cache row first (attention_cols.rs
//!    in prefill mode), then the query-tile kernel (kernels/attention_prefill.rs, the default
//!    where the shapes allow: a block of tokens x the q heads of one kv head per workgroup)
//!    attends causally over the cache (rows of earlier chunks included); with
//!    `GpuOptions::prefill_query_tiles` false, or shapes it does not take, the column attention
//!    (one column per token in the grid's z) does instead;
//! 4. `h += Wo att` (dense GEMM, `+=`);
//! 5. `xn = rmsnorm(h) * ffn_norm`, then the router logits `Wr xn` (the f32 GEMM);
//! 6. the MoE (route, plan, gate/up GEMM, down GEMM, combine into `h`).
//!
//! The embedding runs first (one column per token); after the last chunk's layers the last
//! token's row of `h` is copied out and the lm_head (the column matmul with the final norm on
//! load) gives the logits, copied into a mappable buffer in the same submission. Chunks are
//! submitted back to back; the host writes the next chunk's columns and token count on the
//! queue (ordered after the previous submission) and waits once, for the logits.
//!
//! The KV rows go where decode reads them: the decode plan's cache `[ctx, Hkv, D]` for the main
//! sequence, or slot `s` of the multi-stream caches `[B, ctx, Hkv, D]` ([`PrefillPlan::bind_streams`]).
//! Numerics are f32 activations throughout, like the default decode path.

use crate::columns::{Col, MAX_COLUMNS};
use crate::context::{Context, Result as GpuResult};
use crate::kernels::attention::{
    AttentionColsBinding, AttentionColsBuffers, AttentionKernel, AttentionParams, AttentionScratch,
    ColumnMode, Combine, KvWriteBinding,
};
use crate::kernels::attention_prefill::{
    AttentionPrefillBinding, AttentionPrefillBuffers, AttentionPrefillKernel,
    AttentionPrefillScratch,
};
use crate::kernels::embed::{EmbedBinding, EmbedKernel};
use crate::kernels::gemm::{k_splits, GemmArgs, GemmBinding, GemmForm, GemmKernel, GemmWeights};
use crate::kernels::gemm_reduce::{GemmReduceArgs, GemmReduceBinding, GemmReduceKernel};
use crate::kernels::matmul::{MatmulArgs, MatmulBinding, MatmulInput, MatmulKernel};
use crate::kernels::matvec::NormInput;
use crate::kernels::moe_prefill::{MoeDims, MoePrefill, MoePrefillBuffers, MoePrefillLayer};
use crate::kernels::norm::{RmsNormRowsBinding, RmsNormRowsKernel};
use crate::state::RunState;
use crate::tensor::Q4Matrix;
use crate::weights::{GpuWeights, HeadRef, Matrix};
use anyhow::{bail, ensure, Result};
use nibble_model::kv_cache::CacheType;

mod rows;

/// Prompt tokens per chunk by default. Longer chunks give each expert more tokens per weight
/// tile: on the H200 a 2048-token prompt ran at 1217 / 1535 / 1729 tok/s with chunks of 512 /
/// 1024 / 2048 (docs/BENCHMARKS.md run 81). [`PrefillPlan::new`] shortens it when the buffers
/// would pass [`CHUNK_BUDGET`].
pub const DEFAULT_CHUNK: u32 = 2048;

/// Most bytes the chunk-sized buffers may take (one binding must also hold each): the attention
/// partials grow with the context (`[chunk, Hq, ctx / chunk length, D]`), the MoE rows with
/// `K` (`[chunk K, H]`).
pub const CHUNK_BUDGET: u64 = 512 << 20;

/// Dense GEMMs take 64-token tiles from this many tokens on (fewer: 32-token tiles, so a short
/// chunk still spreads over more workgroups).
const TALL_TILE_TOKENS: u32 = 256;

/// K splits of the router GEMM (gemm.rs `bind_split`; fewer where the hidden size has fewer
/// blocks). Its E = 128 outputs are one tile column, so without a split a 512-token chunk ran
/// on 16 workgroups, each walking all 64 blocks of K: 7.5 ms of a 145 ms pp512 whatever the
/// chunk's length (docs/BENCHMARKS.md run 126).
const ROUTER_K_SPLITS: u32 = 16;

/// K splits of the qkv and o-proj GEMMs of a chunk under `TALL_TILE_TOKENS` tokens (its
/// 32-token tiles): 64 tokens give the o-proj's 2048 rows 32 tiles, each walking 128 blocks
/// of K, on a GPU of 132 SMs. Each split writes partial sums that a reduce dispatch
/// (kernels/gemm_reduce.rs) adds into the qkv or the residual stream. 8 splits ran pp64 /
/// pp128 at 1252.1 / 1918.5 tok/s against 1135.3 / 1831.0 unsplit on the H200 (+7 to +10% /
/// +5 to +6% over two rounds, docs/BENCHMARKS.md runs 128-129), with full-model parity PASS on
/// the matrix units (run 129); `--tune prefill_ksplits=1` turns them off.
pub const SHORT_K_SPLITS: u32 = 8;

struct Layer {
    norm: RmsNormRowsBinding,
    /// Short (32-token tiles, maybe K-split) and tall forms; the short one's reduce if split.
    qkv: [GemmBinding; 2],
    qkv_sum: Option<GemmReduceBinding>,
    /// The main sequence's cache (the decode plan's).
    attn: Attn,
    /// The multi-stream caches, once bound ([`PrefillPlan::bind_streams`]).
    attn_streams: Option<Attn>,
    o: [GemmBinding; 2],
    o_sum: Option<GemmReduceBinding>,
    ffn_norm: RmsNormRowsBinding,
    /// 32-token tiles, K in splits (`ROUTER_K_SPLITS`).
    router: GemmBinding,
    moe: MoePrefillLayer,
}

/// One layer's attention over one cache: the column attention (the default), or the KV write
/// and the query-tile kernel (`GpuOptions::prefill_query_tiles`, where it takes the shapes).
enum Attn {
    Tiles(KvWriteBinding, AttentionPrefillBinding),
    Columns(AttentionColsBinding),
}

/// Which KV caches a prefill writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The decode plan's own sequence.
    Main,
    /// Slot `s` of the multi-stream caches.
    Stream(u32),
}

/// Buffers and bindings of the GEMM prefill (see the module docs).
pub struct PrefillPlan {
    ctx: Context,
    chunk: u32,
    hidden: usize,
    vocab: usize,
    gemm: GemmKernel,
    norm_k: RmsNormRowsKernel,
    embed_k: EmbedKernel,
    attn_k: AttentionKernel,
    /// The query-tile attention when asked for and the shapes allow; `None`: the column attention.
    tiles_k: Option<AttentionPrefillKernel>,
    matmul: MatmulKernel,
    moe: MoePrefill,
    embed: EmbedBinding,
    layers: Vec<Layer>,
    head: MatmulBinding,
    /// `[max(chunk, 8)]` Col: token `i` of the chunk is column `i`.
    cols: wgpu::Buffer,
    /// Uniform `[T, 0, 0, 0]`.
    dims: wgpu::Buffer,
    /// `[chunk, H]` the residual stream.
    h: wgpu::Buffer,
    /// `[H]` the last prompt token's row of `h`, for the lm_head.
    hlast: wgpu::Buffer,
    /// `[V]` and its mappable copy.
    logits: wgpu::Buffer,
    logits_rb: wgpu::Buffer,
    state: wgpu::Buffer,
    /// Adds a short chunk's K-split qkv / o-proj partials (`Layer::qkv_sum`, `o_sum`).
    reduce: GemmReduceKernel,
    /// xn `[chunk, H]`, qkv `[chunk, Q + 2 KV]`, att `[chunk, Q]`, router logits `[splits,
    /// chunk, E]`, the short GEMMs' partials `[splits, min(chunk, 256), Q + 2 KV or H]`.
    keep: Vec<wgpu::Buffer>,
    /// The column attention's partials (only without the tile kernel).
    scratch: Option<AttentionScratch>,
    /// The tile kernel's partials (only with it).
    tiles_scratch: Option<AttentionPrefillScratch>,
    /// Multi-stream KV slots bound, 0 before [`Self::bind_streams`].
    stream_slots: u32,
    /// The lm_head over 8 rows at a time, for [`Self::prefill_rows`]; bound at its first use.
    rows: std::sync::OnceLock<rows::RowsHead>,
}

/// The prefill's build choices (from [`crate::GpuOptions`]).
#[derive(Debug, Clone, Copy)]
pub struct PrefillShape {
    /// Most tokens per chunk (one command buffer each).
    pub chunk: u32,
    /// Attention as query tiles (kernels/attention_prefill.rs) instead of one column per token.
    pub query_tiles: bool,
    /// The int4 GEMMs on matrix units (kernels/gemm_coop.rs) where the device has them.
    pub matrix_units: bool,
    /// Most key splits of the query-tile attention (`Tune::prefill_splits`; None: its own).
    pub max_splits: Option<u32>,
    /// K splits of a short chunk's qkv and o-proj GEMMs (`Tune::prefill_ksplits`; None:
    /// [`SHORT_K_SPLITS`]).
    pub k_splits: Option<u32>,
    /// The matrix-unit GEMM's 32-token tiles double-buffered (`Tune::prefill_dbuf`): None, the
    /// default, where the workgroup memory holds them; Some(on) as asked (an error where it
    /// does not fit).
    pub double_buffer: Option<bool>,
}

impl PrefillPlan {
    /// Bind every layer of `w` for chunks of up to `chunk` tokens, writing the main sequence's
    /// KV rows (of type `cache`, in a context of `context_len` positions) into
    /// `k_cache`/`v_cache` (`[ctx, Hkv, D]` per layer, the decode plan's).
    pub fn new(
        ctx: &Context,
        w: &GpuWeights,
        (context_len, cache): (usize, CacheType),
        PrefillShape {
            chunk,
            query_tiles,
            matrix_units,
            max_splits,
            k_splits: short_splits,
            double_buffer,
        }: PrefillShape,
        merge: Combine,
        (k_cache, v_cache): (&[wgpu::Buffer], &[wgpu::Buffer]),
    ) -> Result<PrefillPlan> {
        let cfg = &w.cfg;
        ensure!(
            (1..=65535).contains(&chunk),
            "prefill chunk of {chunk} tokens (1..=65535)"
        );
        ensure!(
            k_cache.len() == cfg.num_layers && v_cache.len() == cfg.num_layers,
            "prefill caches for {} layers, the model has {}",
            k_cache.len(),
            cfg.num_layers
        );
        let (h, q, kv) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let (e, k, i, v) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.vocab_size,
        );
        let eps = cfg.rms_norm_eps;
        let ap = AttentionParams::from_config(cfg, context_len, cache)?;
        // Every token of the chunk is a column of its own: the sequence needs no split for
        // parallelism, so the fewest chunks (as long as shared memory allows) keep the
        // partials small.
        let attn_k = AttentionKernel::with_split(ctx, ap, Some((1, u32::MAX)))?.with_combine(merge);
        let tiles_k = if query_tiles && AttentionPrefillKernel::supports(&ap) {
            let k = AttentionPrefillKernel::new(ctx, ap)?;
            Some(match max_splits {
                Some(n) => k.with_max_splits(n)?,
                None => k,
            })
        } else {
            None
        };
        // The router GEMM's K splits: each writes its partial logits to rows of its own.
        let rs = k_splits((h / 32) as u32, ROUTER_K_SPLITS);
        // No prompt is longer than the context, so no chunk need be either.
        let chunk = fit_chunk(
            chunk.min(context_len.clamp(1, u32::MAX as usize) as u32),
            CHUNK_BUDGET.min(ctx.max_binding_bytes()),
            &[
                if tiles_k.is_some() {
                    0
                } else {
                    attn_k.scratch_bytes_per_column()
                },
                (k * h * 4) as u64,
                (k * i * 4) as u64,
                ((q + 2 * kv) * 4) as u64,
                (rs as usize * e * 4) as u64,
            ],
        );
        let t = chunk as usize;
        let f32s = |label: &str, n: usize| ctx.storage(label, (t * n) as u64 * 4);
        let state = RunState::default().buffer(ctx)?;
        let cols = ctx.storage(
            "p.cols",
            (t.max(MAX_COLUMNS) * std::mem::size_of::<Col>()) as u64,
        )?;
        let dims = ctx.uniform("p.dims", bytemuck::cast_slice(&[0u32; 4]))?;
        let hb = f32s("p.h", h)?;
        let xn = f32s("p.xn", h)?;
        let qkv = f32s("p.qkv", q + 2 * kv)?;
        let att = f32s("p.att", q)?;
        let rlog = f32s("p.router", rs as usize * e)?;
        // A short chunk's split qkv / o-proj partial sums: [splits, prows, outputs] each.
        let prows = chunk.min(TALL_TILE_TOKENS);
        // At most 16 (as the router), which keeps the partials below 100 MiB for Qwen3-30B-A3B.
        let want = short_splits.unwrap_or(SHORT_K_SPLITS).min(16);
        let (sq, so) = (
            k_splits((h / 32) as u32, want),
            k_splits((q / 32) as u32, want),
        );
        let part = ctx.storage(
            "p.split_partials",
            // One word where neither splits (`--tune prefill_ksplits=1`, or a model whose K is
            // a single block): the buffer is then unused.
            if sq == 1 && so == 1 {
                4
            } else {
                prows as u64 * 4 * (sq as usize * (q + 2 * kv)).max(so as usize * h) as u64
            },
        )?;
        let reduce = GemmReduceKernel::new(ctx)?;
        let hlast = ctx.storage("p.hlast", h as u64 * 4)?;
        let logits = ctx.storage("p.logits", v as u64 * 4)?;
        let logits_rb = ctx.readback_buffer("p.logits.readback", v as u64 * 4);
        let (scratch, tiles_scratch) = match &tiles_k {
            Some(tk) => (None, Some(tk.scratch(ctx, chunk)?)),
            None => (Some(attn_k.scratch_cols(ctx, chunk)?), None),
        };
        // Forms off the matrix units take the f32 kernel (gemm.rs `with_forms`).
        let gemm = GemmKernel::with_forms(ctx, matrix_units, &w.forms())?;
        let gemm = match double_buffer {
            Some(on) => gemm.with_double_buffer(ctx, on)?,
            // The default (runs 133: pp128 +6-10%, pp512 +11% on the H200): two buffers where
            // they fit, one elsewhere.
            None => gemm.with_double_buffer(ctx, crate::kernels::gemm::double_buffer_fits(ctx))?,
        };
        let norm_k = RmsNormRowsKernel::new(ctx, h as u32, eps)?;
        let embed_k = EmbedKernel::new_for(ctx, w.embed.one_form("token_embd")?)?;
        let matmul = MatmulKernel::new(ctx)?;
        let moe = MoePrefill::new(
            ctx,
            MoeDims {
                hidden: h as u32,
                inter: i as u32,
                experts: e as u32,
                top_k: k as u32,
                norm_topk: cfg.norm_topk_prob,
            },
            chunk,
            &MoePrefillBuffers {
                logits: &rlog,
                logit_splits: rs,
                h: &hb,
                dims: &dims,
            },
        )?;
        // One dense GEMM: `tm` tokens per thread, K in `splits` slices (rows `y_rows` apart).
        let dense = |w: GemmWeights<'_>,
                     x: &wgpu::Buffer,
                     (y, stride, y_rows): (&wgpu::Buffer, usize, u32),
                     acc: bool,
                     (tm, splits): (u32, u32)| {
            let args = GemmArgs {
                form: match (w, acc) {
                    (GemmWeights::F32(_), _) => GemmForm::DenseF32,
                    (_, true) => GemmForm::DenseAcc,
                    _ => GemmForm::Dense,
                },
                w,
                x,
                y,
                y_stride: stride as u32,
                x_rows: chunk,
                y_rows,
                dims: Some(&dims),
                plan: None,
                rows_per_expert: 0,
                max_tiles: 0,
            };
            gemm.bind_split(ctx, &args, tm, splits)
        };
        // The qkv (`=`) or the o-proj (`+=` into h): the short form (32-token tiles) in `splits`
        // K splits into `part` plus the reduce that adds them (unsplit: straight into y), and
        // the tall form (64-token tiles).
        let pair = |w: &Q4Matrix,
                    x: &wgpu::Buffer,
                    (y, stride): (&wgpu::Buffer, usize),
                    acc: bool,
                    splits: u32| {
            let w = GemmWeights::Q4(w);
            let tall = dense(w, x, (y, stride, chunk), acc, (4, 1))?;
            if splits == 1 {
                let short = dense(w, x, (y, stride, chunk), acc, (2, 1))?;
                return Ok::<_, crate::context::GpuError>(([short, tall], None));
            }
            let short = dense(w, x, (&part, stride, prows), false, (2, splits))?;
            let sum = reduce.bind(
                ctx,
                &GemmReduceArgs {
                    part: &part,
                    y,
                    y_rows: chunk,
                    n: stride as u32,
                    ys: stride as u32,
                    splits,
                    prows,
                    acc,
                    dims: &dims,
                },
            )?;
            Ok(([short, tall], Some(sum)))
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, lw) in w.layers.iter().enumerate() {
            let (Matrix::Q4(wqkv), Matrix::Q4(wo), Matrix::F32(wr)) = (&lw.qkv, &lw.o, &lw.router)
            else {
                bail!("the GEMM prefill needs int4 attention projections and an f32 router");
            };
            let (qkv_g, qkv_sum) = pair(wqkv, &xn, (&qkv, q + 2 * kv), false, sq)?;
            let (o, o_sum) = pair(wo, &att, (&hb, h), true, so)?;
            layers.push(Layer {
                norm: norm_k.bind(ctx, &hb, &lw.attn_norm, &xn, chunk, &dims)?,
                qkv: qkv_g,
                qkv_sum,
                attn: bind_attn(
                    ctx,
                    (
                        &attn_k,
                        tiles_k.as_ref(),
                        tiles_scratch.as_ref(),
                        scratch.as_ref(),
                    ),
                    &AttentionColsBuffers {
                        state: &state,
                        cols: &cols,
                        qkv: &qkv,
                        q_norm: &lw.q_norm,
                        k_norm: &lw.k_norm,
                        k_cache: &k_cache[l],
                        v_cache: &v_cache[l],
                        out: &att,
                        columns: chunk,
                        slots: 1,
                        mode: ColumnMode::Prefill,
                    },
                    &dims,
                )?,
                attn_streams: None,
                o,
                o_sum,
                ffn_norm: norm_k.bind(ctx, &hb, &lw.ffn_norm, &xn, chunk, &dims)?,
                // 32-token tiles only: E = 128 outputs are one tile column, so they give
                // twice the workgroups of the 64-token ones at every chunk length.
                router: dense(GemmWeights::F32(wr), &xn, (&rlog, e, chunk), false, (2, rs))?,
                moe: moe.bind_layer(ctx, &gemm, &xn, &lw.gate, &lw.up, &lw.down)?,
            });
        }
        let HeadRef::Q4(whead) = w.head() else {
            bail!("the GEMM prefill needs an int4 lm_head");
        };
        let head = matmul.bind(
            ctx,
            &MatmulArgs {
                m: whead,
                input: MatmulInput::Norm(NormInput {
                    h: &hlast,
                    weight: &w.out_norm,
                    eps,
                }),
                nb: 1,
                y: &logits,
                y_stride: v as u32,
                state: &state,
            },
        )?;
        let embed = embed_k.bind_cols(ctx, &w.embed, &hb, &cols, chunk)?;
        Ok(PrefillPlan {
            ctx: ctx.clone(),
            chunk,
            hidden: h,
            vocab: v,
            gemm,
            norm_k,
            embed_k,
            attn_k,
            tiles_k,
            matmul,
            moe,
            embed,
            layers,
            head,
            cols,
            dims,
            h: hb,
            hlast,
            logits,
            logits_rb,
            state,
            keep: vec![xn, qkv, att, rlog, part],
            reduce,
            scratch,
            tiles_scratch,
            stream_slots: 0,
            rows: Default::default(),
        })
    }

    /// Also bind the multi-stream caches (`[slots, ctx, Hkv, D]` per layer), so
    /// [`Target::Stream`] prefills write a stream's slot.
    pub fn bind_streams(
        &mut self,
        w: &GpuWeights,
        (k_cache, v_cache): (&[wgpu::Buffer], &[wgpu::Buffer]),
        slots: u32,
    ) -> Result<()> {
        ensure!(
            k_cache.len() == self.layers.len() && v_cache.len() == self.layers.len(),
            "stream caches for {} layers, the model has {}",
            k_cache.len(),
            self.layers.len()
        );
        let [_, qkv, att, _, _] = &self.keep[..] else {
            unreachable!("keep holds xn, qkv, att, router logits, split partials")
        };
        for (l, (layer, lw)) in self.layers.iter_mut().zip(&w.layers).enumerate() {
            layer.attn_streams = Some(bind_attn(
                &self.ctx,
                (
                    &self.attn_k,
                    self.tiles_k.as_ref(),
                    self.tiles_scratch.as_ref(),
                    self.scratch.as_ref(),
                ),
                &AttentionColsBuffers {
                    state: &self.state,
                    cols: &self.cols,
                    qkv,
                    q_norm: &lw.q_norm,
                    k_norm: &lw.k_norm,
                    k_cache: &k_cache[l],
                    v_cache: &v_cache[l],
                    out: att,
                    columns: self.chunk,
                    slots,
                    mode: ColumnMode::Prefill,
                },
                &self.dims,
            )?);
        }
        self.stream_slots = slots;
        Ok(())
    }

    /// Most tokens per chunk.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether the int4 GEMMs run on matrix units (kernels/gemm_coop.rs).
    pub fn uses_matrix_units(&self) -> bool {
        self.gemm.coop()
    }

    /// Which GEMM kernel the int4 projections run on, in words.
    pub fn gemm_kind(&self) -> String {
        crate::kernels::gemm::describe(self.gemm.coop(), self.gemm.double_buffered())
    }

    /// The `dims` uniform of a chunk of `n` tokens whose last position is `bound`: `[n, S, 0,
    /// 0]`, S the tile attention's key splits (0 without it).
    fn dims_for(&self, n: u32, bound: u32) -> [u32; 4] {
        match (&self.tiles_k, &self.tiles_scratch) {
            (Some(k), Some(sc)) => k.dims(n, bound, sc),
            _ => [n, 0, 0, 0],
        }
    }

    /// Which attention reads the cache, in words.
    pub fn attention_kind(&self) -> &'static str {
        if self.tiles_k.is_some() {
            "query-tile attention"
        } else {
            "column attention"
        }
    }

    /// Prefill `tokens` at positions `pos..` of `target`'s sequence; returns the logits `[V]`
    /// after the last token. The caller checks the ids and that `pos + len` fits the context.
    pub fn prefill(&self, target: Target, tokens: &[u32], pos: usize) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "prefill of an empty token list");
        let slot = self.slot_of(target)?;
        let chunks: Vec<&[u32]> = tokens.chunks(self.chunk as usize).collect();
        let mut last = None;
        for (c, group) in chunks.iter().enumerate() {
            let p0 = pos + c * self.chunk as usize;
            let n = group.len() as u32;
            let bound = self.load_chunk(group, p0, slot);
            let mut enc = self.ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                self.record_layers(&mut pass, target, n, bound, &mut |_, _| {})?;
            }
            if c + 1 == chunks.len() {
                let row = self.hidden as u64 * 4;
                enc.copy_buffer_to_buffer(&self.h, (n as u64 - 1) * row, &self.hlast, 0, row);
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    self.matmul.record(&mut pass, &self.head);
                }
                let bytes = self.vocab as u64 * 4;
                enc.copy_buffer_to_buffer(&self.logits, 0, &self.logits_rb, 0, bytes);
            }
            last = Some(self.ctx.submit(enc));
        }
        let index = last.expect("at least one chunk");
        let bytes = self.ctx.map_read(&self.logits_rb, index)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// The KV slot `target` writes (0 for the main sequence), checked against the bound ones.
    fn slot_of(&self, target: Target) -> Result<u32> {
        Ok(match target {
            Target::Main => 0,
            Target::Stream(s) => {
                ensure!(
                    s < self.stream_slots,
                    "stream slot {s} of {} bound to the prefill",
                    self.stream_slots
                );
                s
            }
        })
    }

    /// Write a chunk's columns (`tokens` at positions `p0..` of stream slot `slot`) and its
    /// `dims`; returns the chunk's last position (the attention's bound).
    fn load_chunk(&self, tokens: &[u32], p0: usize, slot: u32) -> u32 {
        let cs: Vec<Col> = tokens
            .iter()
            .enumerate()
            .map(|(j, &t)| Col::active(t, (p0 + j) as u32, slot))
            .collect();
        self.ctx.write(&self.cols, 0, bytemuck::cast_slice(&cs));
        let bound = (p0 + tokens.len() - 1) as u32;
        let n = tokens.len() as u32;
        self.ctx.write(
            &self.dims,
            0,
            bytemuck::cast_slice(&self.dims_for(n, bound)),
        );
        bound
    }

    /// The embedding and every layer over the chunk's first `n` columns; `mark` runs after
    /// every op with its name (the profile's timestamps; a no-op otherwise).
    fn record_layers(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        target: Target,
        n: u32,
        pos_bound: u32,
        mark: &mut dyn FnMut(&mut wgpu::ComputePass<'_>, &'static str),
    ) -> GpuResult<()> {
        self.embed_k.record_n(pass, &self.embed, n);
        mark(pass, "embed");
        for l in &self.layers {
            self.record_layer(pass, l, target, n, pos_bound, mark)?;
        }
        Ok(())
    }

    /// One layer of [`Self::record_layers`].
    fn record_layer(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        l: &Layer,
        target: Target,
        n: u32,
        pos_bound: u32,
        mark: &mut dyn FnMut(&mut wgpu::ComputePass<'_>, &'static str),
    ) -> GpuResult<()> {
        let tall = (n >= TALL_TILE_TOKENS) as usize;
        self.norm_k.record(pass, &l.norm, n);
        mark(pass, "attn norm");
        self.gemm.record(pass, &l.qkv[tall], n);
        if let (0, Some(r)) = (tall, &l.qkv_sum) {
            self.reduce.record(pass, r, n);
        }
        mark(pass, "qkv gemm");
        let attn = match target {
            Target::Main => &l.attn,
            Target::Stream(_) => l
                .attn_streams
                .as_ref()
                .expect("prefill() checked the stream slots are bound"),
        };
        match attn {
            Attn::Tiles(write, attend) => {
                self.attn_k.record_kv_write(pass, write, n)?;
                self.tiles_k
                    .as_ref()
                    .expect("tile bindings come from the tile kernel")
                    .record(pass, attend, n, pos_bound);
            }
            Attn::Columns(b) => self.attn_k.record_cols(pass, b, pos_bound, n)?,
        }
        mark(pass, "attention (kv write + attend)");
        self.gemm.record(pass, &l.o[tall], n);
        if let (0, Some(r)) = (tall, &l.o_sum) {
            self.reduce.record(pass, r, n);
        }
        mark(pass, "o gemm +=");
        self.norm_k.record(pass, &l.ffn_norm, n);
        mark(pass, "ffn norm");
        self.gemm.record(pass, &l.router, n);
        mark(pass, "router gemm");
        self.moe.record_marked(pass, &self.gemm, &l.moe, n, mark);
        Ok(())
    }
}

/// One layer's attention over the cache in `b`: the KV write and the query-tile kernel when
/// there is one, else the column attention with `scratch`.
fn bind_attn(
    ctx: &Context,
    (attn_k, tiles_k, tiles_scratch, scratch): (
        &AttentionKernel,
        Option<&AttentionPrefillKernel>,
        Option<&AttentionPrefillScratch>,
        Option<&AttentionScratch>,
    ),
    b: &AttentionColsBuffers<'_>,
    dims: &wgpu::Buffer,
) -> Result<Attn> {
    Ok(match (tiles_k.zip(tiles_scratch), scratch) {
        (Some((t, ts)), _) => Attn::Tiles(
            attn_k.bind_kv_write(ctx, b)?,
            t.bind(
                ctx,
                &AttentionPrefillBuffers {
                    qkv: b.qkv,
                    q_norm: b.q_norm,
                    k_cache: b.k_cache,
                    v_cache: b.v_cache,
                    out: b.out,
                    cols: b.cols,
                    dims,
                    tokens: b.columns,
                    slots: b.slots,
                },
                ts,
            )?,
        ),
        (None, Some(sc)) => Attn::Columns(attn_k.bind_cols(ctx, b, sc)?),
        (None, None) => bail!("the column attention needs its partials"),
    })
}

/// The longest chunk up to `want` whose buffers of `per_token` bytes per token each stay within
/// `budget` (at least one token).
fn fit_chunk(want: u32, budget: u64, per_token: &[u64]) -> u32 {
    let most = per_token.iter().max().copied().unwrap_or(1).max(1);
    want.min((budget / most).clamp(1, u32::MAX as u64) as u32)
}

#[path = "prefill_diag.rs"]
mod diagnostics;

#[cfg(test)]
mod chunk_tests {
    #[test]
    fn fit_chunk_keeps_every_buffer_in_the_budget() {
        assert_eq!(
            super::fit_chunk(2048, 512 << 20, &[4 << 10, 64 << 10]),
            2048
        );
        // 1 MiB per token: 512 tokens fit 512 MiB.
        assert_eq!(super::fit_chunk(2048, 512 << 20, &[1 << 20, 8]), 512);
        assert_eq!(super::fit_chunk(100, 10, &[1 << 20]), 1);
    }
}
