//! Multi-stream decode: `B` independent sequences ("streams", each with its own KV-cache slot,
//! position and token chain) advanced by the same dispatches, so every dense weight is read once
//! per step for all of them (the matmuls read each int4 block once and use it for every column).
//!
//! Column `c` of every `[B, ...]` buffer is stream `c` (slot `c`), its state in `cols[c]`
//! ([`crate::columns`]). One step, per layer: `qkv = Wqkv rmsnorm(h)` (matmul, norm on load per
//! column) · attention over columns (independent mode: each column writes its own new K/V row
//! into its slot) · `h += Wo att` (matmul, residual) · router with norm on load (publishing `xn`)
//! · MoE over columns (each column its own top-k experts); then `logits = Whead rmsnorm(h)` and
//! the per-column argmax, which advances every live column and sets the run's `done` once every
//! column is done. A run of N steps is one compute pass and one submit, like the single-stream
//! folded run; a one-step run without the argmax ([`BatchPlan::step_logits`]) hands every live
//! stream's logits to the host instead (sampled requests). A stream's prompt is prefilled into
//! its slot `B` consecutive tokens per dispatch through the prefill attention described below.
//! Only the f32 activation numerics have column kernels.
//!
//! Buffers live as long as the plan; the KV cache of layer `l` is `[B, ctx, Hkv, D]` (slot-major)
//! and row `p` of slot `s` is written only by the step that processes position `p` of stream `s`.
//!
//! The same machinery is the batched prefill ([`BatchMode::Prefill`]): the columns are up to 8
//! consecutive prompt tokens of the single-stream sequence, written into that sequence's own KV
//! cache (borrowed from the decode plan): the attention first writes every column's K/V row,
//! then attends causally; the lm_head runs only for the group holding the last prompt token.

use crate::columns::{self, Col, MAX_COLUMNS};
use crate::context::{Context, Result as GpuResult};
use crate::kernels::argmax::{ArgmaxBinding, ArgmaxColsArgs, ArgmaxKernel};
use crate::kernels::attention::{
    AttentionColsBinding, AttentionColsBuffers, AttentionKernel, AttentionParams, AttentionScratch,
    ColumnMode, Combine,
};
use crate::kernels::embed::{EmbedBinding, EmbedKernel};
use crate::kernels::matmul::{MatmulArgs, MatmulBinding, MatmulInput, MatmulKernel};
use crate::kernels::matvec::NormInput;
use crate::kernels::moe::{MoeColsBinding, MoeColsBuffers, MoeParams, MoeSet};
use crate::kernels::router_cols::{RouterColsArgs, RouterColsBinding, RouterColsKernel};
use crate::kernels::sample::{SampleBinding, SampleColsArgs, SampleKernel};
use crate::numerics::Numerics;
use crate::state::RunState;
use crate::tune::Tune;
use crate::weights::{GpuWeights, HeadRef, Matrix};
use anyhow::{bail, ensure, Result};
use nibble_backend::DeviceSampling;
use nibble_model::kv_cache::CacheType;

/// One layer's bindings.
/// The matmuls are bound once per column count (`[nb - 1]`), so a run records only the columns
/// up to its highest live one: a lone stream costs one column, not `B`.
struct Layer {
    qkv: Vec<MatmulBinding>,
    attn: AttentionColsBinding,
    /// A [`BatchMode::Streams`] plan's prefill attention (KV rows written first, then read
    /// causally): a stream's prompt goes through in groups of `B` consecutive tokens of one slot.
    /// `None` in a prefill plan, whose `attn` is already that.
    attn_prefill: Option<AttentionColsBinding>,
    o: Vec<MatmulBinding>,
    router: RouterColsBinding,
    moe: MoeColsBinding,
}

/// Activation buffers (`B` columns each) and the KV caches.
struct Bufs {
    state: wgpu::Buffer,
    cols: wgpu::Buffer,
    /// `[B, V]`.
    logits: wgpu::Buffer,
    /// `[B, V]` mappable: a one-step run's logits, copied in its own command buffer
    /// ([`BatchPlan::step_logits`]); multi-stream plans only (a prefill plan's B can be large).
    logits_rb: Option<wgpu::Buffer>,
    /// `[B, cap]` ids of the run, column-major.
    out_tokens: wgpu::Buffer,
    /// Kept alive by the bind groups too; listed so the shapes are documented in one place:
    /// h `[B, H]`, xn `[B, H]`, qkv `[B, Q + 2 KV]`, att `[B, Q]`, router `[B, E]`,
    /// route `[B, 2K]`, moe_h `[B, K*I]`.
    _keep: Vec<wgpu::Buffer>,
    /// Per layer `[B, ctx, Hkv, D]` f32 (streams: slot-major; prefill: the decode plan's own
    /// `[ctx, Hkv, D]`).
    k_cache: Vec<wgpu::Buffer>,
    v_cache: Vec<wgpu::Buffer>,
    _scratch: AttentionScratch,
}

/// Everything needed to decode `streams` sequences together over shared weights.
pub struct BatchPlan {
    ctx: Context,
    /// Columns = streams = KV slots.
    streams: u32,
    context_len: usize,
    vocab: usize,
    matmul: MatmulKernel,
    embed_k: EmbedKernel,
    attn_k: AttentionKernel,
    router_k: RouterColsKernel,
    moe_k: MoeSet,
    argmax_k: ArgmaxKernel,
    sample_k: SampleKernel,
    bufs: Bufs,
    embed: EmbedBinding,
    layers: Vec<Layer>,
    /// `[nb - 1]`, like the layers' matmuls.
    head: Vec<MatmulBinding>,
    argmax: ArgmaxBinding,
    /// The GPU sampler over the columns (runs restarted with sampling settings).
    sample: SampleBinding,
    /// The queued greedy runs ([`BatchPlan::restart`] / [`BatchPlan::queue_run`] /
    /// [`BatchPlan::collect`]).
    pipe: Pipe,
}

/// Greedy runs queued on the device, each continuing where the previous one leaves the columns:
/// the token chain, positions and step counters stay in the `cols` buffer on the GPU, so run
/// k+1 is recorded and submitted before the host waits for run k (as single-stream
/// [`crate::stream::GreedyStream`] runs are).
#[derive(Default)]
struct Pipe {
    /// Whether the columns hold a restarted run's state (prefill and one-step runs overwrite
    /// them).
    live: bool,
    /// Steps recorded since the restart: every live column's `out_tokens` index of the next
    /// run's first step.
    steps: u32,
    /// Highest position at the restart (`top + steps` bounds the next step's positions).
    top: usize,
    /// Columns recorded (one past the highest live one at the restart).
    nb: u32,
    /// The runs end each step in the GPU sampler (some column sampled) instead of the argmax.
    sampled: bool,
    queued: std::collections::VecDeque<QueuedRun>,
}

/// A run submitted and not read back yet.
struct QueuedRun {
    /// Step index (since the restart) of the run's first step.
    first: u32,
    len: u32,
    nb: u32,
    /// The `[8]` columns after the run (256 bytes), then `[nb, len]` ids: column `c`'s
    /// `out_tokens[c * cap + first ..][..len]`.
    readback: wgpu::Buffer,
    index: wgpu::SubmissionIndex,
}

/// Bytes of the `[MAX_COLUMNS]` column buffer.
const COLS_BYTES: u64 = (MAX_COLUMNS * std::mem::size_of::<Col>()) as u64;

/// Most EOS ids a multi-stream run can stop on.
const MAX_EOS: usize = 16;

/// What the columns are.
pub enum BatchMode<'a> {
    /// Independent sequences, one KV slot each (allocated by the plan).
    Streams,
    /// Consecutive tokens of one sequence whose per-layer caches `[ctx, Hkv, D]` these are.
    Prefill {
        k_cache: &'a [wgpu::Buffer],
        v_cache: &'a [wgpu::Buffer],
    },
}

impl BatchPlan {
    /// Allocate `streams` KV slots of `context_len` positions of type `cache` and bind every
    /// layer of `w`; the attention merges its chunks as `merge` says.
    pub fn new(
        ctx: &Context,
        w: &GpuWeights,
        (streams, context_len, cache): (usize, usize, CacheType),
        numerics: Numerics,
        merge: Combine,
        tune: Tune,
        mode: BatchMode<'_>,
    ) -> Result<BatchPlan> {
        ensure!(
            (1..=MAX_COLUMNS).contains(&streams),
            "multi-stream decode takes 1..={MAX_COLUMNS} streams, got {streams}"
        );
        ensure!(
            !numerics.quantized(),
            "multi-stream decode has kernels for f32 activations only (got --numerics {numerics})"
        );
        let cfg = &w.cfg;
        let b = streams as u32;
        let (h, q, kv) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let (e, k, i, v) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.vocab_size,
        );
        let eps = cfg.rms_norm_eps;
        let bs = streams;
        let f32s = |label: &str, n: usize| ctx.storage(label, (bs * n) as u64 * 4);
        let ap = AttentionParams::from_config(cfg, context_len, cache)?;
        let attn_k = tune.attention(ctx, ap, merge)?;
        let mp = MoeParams::from_config(cfg)?;
        let moe_k = MoeSet::new(ctx, mp, numerics, tune.moe(ctx, &mp), &w.moe_forms())?;
        let state = RunState::default().buffer(ctx)?;
        let cols = columns::buffer(ctx, &[])?;
        let hb = f32s("b.h", h)?;
        let xn = f32s("b.xn", h)?;
        let qkv = f32s("b.qkv", q + 2 * kv)?;
        let att = f32s("b.att", q)?;
        let router = f32s("b.router", e)?;
        let route = ctx.storage("b.route", (bs * 2 * k) as u64 * 4)?;
        let moe_h = f32s("b.moe_h", k * i)?;
        let logits = f32s("b.logits", v)?;
        let logits_rb = matches!(mode, BatchMode::Streams)
            .then(|| ctx.readback_buffer("b.logits.readback", (bs * v) as u64 * 4));
        let out_tokens = ctx.storage("b.out_tokens", (bs * context_len) as u64 * 4)?;
        let (slots, col_mode, k_cache, v_cache) = match mode {
            BatchMode::Streams => {
                let cache_bytes = bs as u64 * ap.cache_bytes();
                let alloc = |label: &str| -> GpuResult<Vec<wgpu::Buffer>> {
                    (0..cfg.num_layers)
                        .map(|_| ctx.storage(label, cache_bytes))
                        .collect()
                };
                let (k, v) = (alloc("b.k_cache")?, alloc("b.v_cache")?);
                (b, ColumnMode::Independent, k, v)
            }
            BatchMode::Prefill { k_cache, v_cache } => {
                ensure!(
                    k_cache.len() == cfg.num_layers && v_cache.len() == cfg.num_layers,
                    "prefill caches for {} layers, the model has {}",
                    k_cache.len(),
                    cfg.num_layers
                );
                (1, ColumnMode::Prefill, k_cache.to_vec(), v_cache.to_vec())
            }
        };
        let scratch = attn_k.scratch_cols(ctx, b)?;
        let matmul = MatmulKernel::new(ctx)?;
        let router_k = RouterColsKernel::new(ctx)?;
        let embed_k = EmbedKernel::new_for(ctx, w.embed.one_form("token_embd")?)?;
        let argmax_k = ArgmaxKernel::new(ctx)?;
        let sample_k = SampleKernel::new(ctx)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, lw) in w.layers.iter().enumerate() {
            let (Matrix::Q4(wqkv), Matrix::Q4(wo), Matrix::F32(wr)) = (&lw.qkv, &lw.o, &lw.router)
            else {
                bail!("multi-stream decode needs int4 attention projections and an f32 router");
            };
            let attn = |mode| {
                attn_k.bind_cols(
                    ctx,
                    &AttentionColsBuffers {
                        state: &state,
                        cols: &cols,
                        qkv: &qkv,
                        q_norm: &lw.q_norm,
                        k_norm: &lw.k_norm,
                        k_cache: &k_cache[l],
                        v_cache: &v_cache[l],
                        out: &att,
                        columns: b,
                        slots,
                        mode,
                    },
                    &scratch,
                )
            };
            let norm = |weight| {
                MatmulInput::Norm(NormInput {
                    h: &hb,
                    weight,
                    eps,
                })
            };
            layers.push(Layer {
                qkv: (1..=b)
                    .map(|nb| {
                        matmul.bind(
                            ctx,
                            &MatmulArgs {
                                m: wqkv,
                                input: norm(&lw.attn_norm),
                                nb,
                                y: &qkv,
                                y_stride: (q + 2 * kv) as u32,
                                state: &state,
                            },
                        )
                    })
                    .collect::<GpuResult<_>>()?,
                attn: attn(col_mode)?,
                attn_prefill: match col_mode {
                    ColumnMode::Independent => Some(attn(ColumnMode::Prefill)?),
                    ColumnMode::Prefill => None,
                },
                o: (1..=b)
                    .map(|nb| {
                        matmul.bind(
                            ctx,
                            &MatmulArgs {
                                m: wo,
                                input: MatmulInput::Acc(&att),
                                nb,
                                y: &hb,
                                y_stride: h as u32,
                                state: &state,
                            },
                        )
                    })
                    .collect::<GpuResult<_>>()?,
                router: router_k.bind(
                    ctx,
                    &RouterColsArgs {
                        m: wr,
                        x: NormInput {
                            h: &hb,
                            weight: &lw.ffn_norm,
                            eps,
                        },
                        xn: &xn,
                        logits: &router,
                        cols: &cols,
                        nb: b,
                    },
                )?,
                moe: moe_k.bind_cols(
                    ctx,
                    &MoeColsBuffers {
                        state: &state,
                        cols: &cols,
                        logits: &router,
                        route: &route,
                        x: &xn,
                        gate: &lw.gate,
                        up: &lw.up,
                        down: &lw.down,
                        h: &moe_h,
                        out: &hb,
                        residual: true,
                        nb: b,
                    },
                )?,
            });
        }
        let HeadRef::Q4(whead) = w.head() else {
            bail!("multi-stream decode needs an int4 lm_head");
        };
        let head = (1..=b)
            .map(|nb| {
                matmul.bind(
                    ctx,
                    &MatmulArgs {
                        m: whead,
                        input: MatmulInput::Norm(NormInput {
                            h: &hb,
                            weight: &w.out_norm,
                            eps,
                        }),
                        nb,
                        y: &logits,
                        y_stride: v as u32,
                        state: &state,
                    },
                )
            })
            .collect::<GpuResult<_>>()?;
        let embed = embed_k.bind_cols(ctx, &w.embed, &hb, &cols, b)?;
        let argmax = argmax_k.bind_cols(
            ctx,
            &ArgmaxColsArgs {
                logits: &logits,
                n: v as u32,
                nb: b,
                cols: &cols,
                state: &state,
                out_tokens: &out_tokens,
                cap: context_len as u32,
                max_steps: 1,
                eos: &[u32::MAX; MAX_EOS],
            },
        )?;
        let (run_params, eos) = argmax.run_buffers();
        let sample = sample_k.bind_cols(
            ctx,
            &SampleColsArgs {
                logits: &logits,
                n: v as u32,
                nb: b,
                cap: context_len as u32,
                cols: &cols,
                state: &state,
                out_tokens: &out_tokens,
                run_params,
                eos,
            },
        )?;
        let keep = vec![hb, xn, qkv, att, router, route, moe_h];
        Ok(BatchPlan {
            ctx: ctx.clone(),
            streams: b,
            context_len,
            vocab: v,
            matmul,
            embed_k,
            attn_k,
            router_k,
            moe_k,
            argmax_k,
            sample_k,
            bufs: Bufs {
                state,
                cols,
                logits,
                logits_rb,
                out_tokens,
                _keep: keep,
                k_cache,
                v_cache,
                _scratch: scratch,
            },
            embed,
            layers,
            head,
            argmax,
            sample,
            pipe: Pipe::default(),
        })
    }

    /// Streams (columns, KV slots).
    pub fn streams(&self) -> usize {
        self.streams as usize
    }

    /// The per-layer KV caches (K, V): `[B, ctx, Hkv, D]`, slot `s` at `s * ctx * Hkv * D`.
    pub(crate) fn kv_caches(&self) -> (&[wgpu::Buffer], &[wgpu::Buffer]) {
        (&self.bufs.k_cache, &self.bufs.v_cache)
    }

    /// Batched prefill (a [`BatchMode::Prefill`] plan): `tokens` at positions `pos..` of the
    /// sequence, up to `streams` tokens per dispatch (one submit per group); returns the logits
    /// `[V]` after the last token. The caller checks ids and `pos + len <= context_len`.
    pub fn prefill_sequence(&mut self, tokens: &[u32], pos: usize) -> Result<Vec<f32>> {
        self.prefill_groups(0, tokens, pos)
    }

    /// `tokens` into KV slot `slot` at positions `pos..`, in groups of up to `streams`
    /// consecutive tokens per dispatch (the prefill attention: every column's K/V row is written
    /// first, then each column attends causally), one submit per group; returns the logits `[V]`
    /// after the last token. Only the last group runs the lm_head.
    fn prefill_groups(&mut self, slot: usize, tokens: &[u32], pos: usize) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "prefill of an empty token list");
        self.idle("prefill")?;
        let groups: Vec<&[u32]> = tokens.chunks(self.streams()).collect();
        for (g, group) in groups.iter().enumerate() {
            let p0 = pos + g * self.streams();
            let cs: Vec<Col> = group
                .iter()
                .enumerate()
                .map(|(c, &t)| Col::active(t, (p0 + c) as u32, slot as u32))
                .collect();
            columns::write(&self.ctx, &self.bufs.cols, &cs);
            self.reset_state();
            let last = g + 1 == groups.len();
            let bound = (p0 + group.len() - 1) as u32;
            let mut res = Ok(());
            self.ctx.run_pass(|p| {
                let nb = group.len() as u32;
                res = self.record_layers(p, bound, nb, true);
                if last {
                    self.matmul.record(p, &self.head[nb as usize - 1]);
                }
            })?;
            res?;
        }
        let c = (tokens.len() - 1) % self.streams();
        let v = self.vocab;
        let all = self.ctx.read_f32(&self.bufs.logits, (c + 1) * v)?;
        Ok(all[c * v..].to_vec())
    }

    /// Record one decode step over the first `nb` columns (those past it must be idle):
    /// positions are at most `pos_bound`.
    fn record_step(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pos_bound: u32,
        nb: u32,
        argmax: bool,
    ) -> Result<()> {
        self.record_layers(pass, pos_bound, nb, false)?;
        self.matmul.record(pass, &self.head[nb as usize - 1]);
        if argmax && self.pipe.sampled {
            self.sample_k.record(pass, &self.sample);
        } else if argmax {
            self.argmax_k.record(pass, &self.argmax);
        }
        Ok(())
    }

    /// The embedding and every layer over the first `nb` columns (1..=B; later columns idle);
    /// `prefill`: the columns are consecutive tokens of one slot (the prefill attention).
    fn record_layers(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pos_bound: u32,
        nb: u32,
        prefill: bool,
    ) -> Result<()> {
        self.embed_k.record(pass, &self.embed);
        for l in &self.layers {
            self.matmul.record(pass, &l.qkv[nb as usize - 1]);
            let attn = match (&l.attn_prefill, prefill) {
                (Some(p), true) => p,
                _ => &l.attn,
            };
            self.attn_k.record_cols(pass, attn, pos_bound, nb)?;
            self.matmul.record(pass, &l.o[nb as usize - 1]);
            self.router_k.record(pass, &l.router);
            self.moe_k.record_cols(pass, &self.ctx, &l.moe);
        }
        Ok(())
    }

    fn reset_state(&self) {
        self.ctx.write(
            &self.bufs.state,
            0,
            bytemuck::bytes_of(&RunState::default()),
        );
    }

    /// Feed `tokens` to stream `slot` at positions `pos..` (batched: up to `streams` tokens per
    /// dispatch, the other slots untouched) and return the logits `[V]` after the last one. The
    /// caller checks ids, `slot < streams` and `pos + len <= context_len`.
    pub fn prefill_slot(&mut self, slot: usize, tokens: &[u32], pos: usize) -> Result<Vec<f32>> {
        ensure!(slot < self.streams(), "slot {slot} of {}", self.streams);
        self.prefill_groups(slot, tokens, pos)
    }

    /// One step for every stream `s` with `seqs[s] = Some((token, pos))` (fed `token` at `pos`)
    /// in one pass and one submit, without the argmax; returns each fed stream's logits `[V]`.
    /// The caller checks ids and `pos < context_len`.
    pub fn step_logits(&mut self, seqs: &[Option<(u32, usize)>]) -> Result<Vec<Option<Vec<f32>>>> {
        self.idle("a one-step run")?;
        let Some((cs, top, nb)) = self.columns_for(seqs)? else {
            return Ok(vec![None; seqs.len()]);
        };
        columns::write(&self.ctx, &self.bufs.cols, &cs);
        self.reset_state();
        let v = self.vocab;
        let Some(rb) = &self.bufs.logits_rb else {
            // A prefill plan: a pass, then a read through a staging buffer.
            let mut res = Ok(());
            self.ctx
                .run_pass(|p| res = self.record_step(p, top as u32, nb, false))?;
            res?;
            let all = self.ctx.read_f32(&self.bufs.logits, nb as usize * v)?;
            return Ok(seqs
                .iter()
                .enumerate()
                .map(|(s, q)| q.map(|_| all[s * v..(s + 1) * v].to_vec()))
                .collect());
        };
        // One submit: the step, then the copy of its columns' logits into the kept mappable
        // buffer; each live column's row is copied out of the mapping once.
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            self.record_step(&mut pass, top as u32, nb, false)?;
        }
        enc.copy_buffer_to_buffer(&self.bufs.logits, 0, rb, 0, (nb as usize * v * 4) as u64);
        let index = self.ctx.submit(enc);
        self.ctx
            .map_read_with(rb, index, |bytes| {
                seqs.iter()
                    .enumerate()
                    .map(|(s, q)| {
                        q.map(|_| bytemuck::pod_collect_to_vec(&bytes[s * v * 4..(s + 1) * v * 4]))
                    })
                    .collect()
            })
            .map_err(Into::into)
    }

    /// The columns of a run over `seqs` (`Some((token, pos))` per live stream), the highest
    /// position and the column count to record (one past the highest live column); `None`
    /// when no stream is live.
    fn columns_for(&self, seqs: &[Option<(u32, usize)>]) -> Result<Option<(Vec<Col>, usize, u32)>> {
        ensure!(
            seqs.len() <= self.streams(),
            "{} streams, plan has {}",
            seqs.len(),
            self.streams
        );
        let mut cs = vec![Col::idle(); self.streams()];
        let (mut top, mut nb) = (0usize, 0u32);
        for (s, q) in seqs.iter().enumerate() {
            if let Some((t, pos)) = q {
                cs[s] = Col::active(*t, *pos as u32, s as u32);
                top = top.max(*pos);
                nb = s as u32 + 1;
            }
        }
        Ok((nb > 0).then_some((cs, top, nb)))
    }

    /// Greedy run of up to `n` steps for every stream `s` with `seqs[s] = Some((token, pos))`
    /// (fed `token` at `pos`), all in one pass and one submit; a stream stops after an EOS id.
    /// Returns the ids per stream (empty for `None`). The caller checks ids and
    /// `pos + n <= context_len`.
    pub fn decode_greedy(
        &mut self,
        seqs: &[Option<(u32, usize)>],
        n: u32,
        eos: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        if n == 0 || !self.restart(seqs, eos)? {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        self.queue_run(n)?;
        let mut ids = self.collect()?.expect("one run was queued");
        ids.truncate(seqs.len());
        Ok(ids)
    }

    /// Start greedy runs from host-given ids: stream `s` with `seqs[s] = Some((token, pos))` is
    /// fed `token` at `pos` by the next queued run, the others sit out (every run after, too).
    /// Every queued run must have been collected. Returns whether any stream is live. The caller
    /// checks ids and positions.
    pub fn restart(&mut self, seqs: &[Option<(u32, usize)>], eos: &[u32]) -> Result<bool> {
        self.restart_sampled(seqs, eos, &[])
    }

    /// [`BatchPlan::restart`] with stream `s` sampled on the GPU by `specs[s]` (`None`, and
    /// streams past `specs`: the argmax); `specs[s].uniforms` holds a draw per step of its
    /// room. With no sampled stream the runs end in the argmax, as a plain restart.
    pub fn restart_sampled(
        &mut self,
        seqs: &[Option<(u32, usize)>],
        eos: &[u32],
        specs: &[Option<&DeviceSampling<'_>>],
    ) -> Result<bool> {
        self.idle("restart")?;
        ensure!(
            eos.len() <= MAX_EOS,
            "at most {MAX_EOS} EOS ids, got {}",
            eos.len()
        );
        self.pipe.live = false;
        let Some((cs, top, nb)) = self.columns_for(seqs)? else {
            return Ok(false);
        };
        columns::write(&self.ctx, &self.bufs.cols, &cs);
        self.reset_state();
        // The step limit is the out_tokens capacity; runs are bounded by the context instead.
        self.argmax
            .set_run(&self.ctx, self.context_len as u32, eos)?;
        let sampled = specs.iter().any(Option::is_some);
        if sampled {
            // Each sampled stream's steps: its room in the context.
            let per: Vec<_> = specs
                .iter()
                .zip(seqs.iter().chain(std::iter::repeat(&None)))
                .map(|(sp, q)| match (sp, q) {
                    (Some(sp), Some((_, pos))) => Some((*sp, self.context_len - pos)),
                    _ => None,
                })
                .collect();
            self.sample.set_requests(&self.ctx, &per)?;
        }
        self.pipe = Pipe {
            live: true,
            steps: 0,
            top,
            nb,
            sampled,
            queued: Default::default(),
        };
        Ok(true)
    }

    /// Record `n` more greedy steps of the restarted streams as one submit, without waiting.
    /// The caller keeps every live stream's position within the context.
    pub fn queue_run(&mut self, n: u32) -> Result<()> {
        ensure!(self.pipe.live, "no restarted streams to continue");
        ensure!(n > 0, "a run of 0 steps");
        let (first, nb) = (self.pipe.steps, self.pipe.nb);
        ensure!(
            (first + n) as usize <= self.context_len,
            "{} steps since the restart exceed the context of {}",
            first + n,
            self.context_len
        );
        let cap = self.context_len as u64;
        let readback = self
            .ctx
            .readback_buffer("b.readback", COLS_BYTES + (nb * n) as u64 * 4);
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        let mut res = Ok(());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            for s in first..first + n {
                if res.is_ok() {
                    res =
                        self.record_step(&mut pass, (self.pipe.top + s as usize) as u32, nb, true);
                }
            }
        }
        res?;
        // Copies after the pass see the columns and ids as this run left them.
        enc.copy_buffer_to_buffer(&self.bufs.cols, 0, &readback, 0, COLS_BYTES);
        for c in 0..nb as u64 {
            enc.copy_buffer_to_buffer(
                &self.bufs.out_tokens,
                (c * cap + first as u64) * 4,
                &readback,
                COLS_BYTES + c * n as u64 * 4,
                n as u64 * 4,
            );
        }
        let index = self.ctx.submit(enc);
        self.pipe.queued.push_back(QueuedRun {
            first,
            len: n,
            nb,
            readback,
            index,
        });
        self.pipe.steps += n;
        Ok(())
    }

    /// Wait for the oldest queued run only (later ones keep running) and return its ids per
    /// column (`[streams]`; empty for columns that sat out or had stopped); `None` when no run
    /// is queued.
    pub fn collect(&mut self) -> Result<Option<Vec<Vec<u32>>>> {
        let Some(q) = self.pipe.queued.pop_front() else {
            return Ok(None);
        };
        let bytes = self.ctx.map_read(&q.readback, q.index)?;
        let want = (COLS_BYTES + (q.nb * q.len) as u64 * 4) as usize;
        ensure!(
            bytes.len() >= want,
            "run readback of {} bytes, expected {want}",
            bytes.len()
        );
        let (cols, ids) = bytes.split_at(COLS_BYTES as usize);
        let cols: Vec<Col> = bytemuck::pod_collect_to_vec(cols);
        let ids: Vec<u32> = bytemuck::pod_collect_to_vec(&ids[..want - COLS_BYTES as usize]);
        let len = q.len as usize;
        Ok(Some(
            (0..self.streams())
                .map(|c| {
                    if c >= q.nb as usize {
                        return Vec::new();
                    }
                    let got = cols[c].step.saturating_sub(q.first).min(q.len) as usize;
                    ids[c * len..c * len + got].to_vec()
                })
                .collect(),
        ))
    }

    /// Stop column `c` in the runs queued from now on (the ones already queued still run it;
    /// their ids for it are the caller's to ignore).
    pub fn end_column(&mut self, c: usize) -> Result<()> {
        ensure!(c < self.streams(), "column {c} of {}", self.streams);
        if self.pipe.live {
            let done = std::mem::offset_of!(Col, done);
            let at = (c * std::mem::size_of::<Col>() + done) as u64;
            self.ctx
                .write(&self.bufs.cols, at, bytemuck::bytes_of(&1u32));
        }
        Ok(())
    }

    /// Runs queued and not collected.
    pub fn queued_runs(&self) -> usize {
        self.pipe.queued.len()
    }

    /// Refuse to touch the columns while runs are queued (their state lives there); the next
    /// greedy run must restart.
    pub(crate) fn idle(&mut self, what: &str) -> Result<()> {
        ensure!(
            self.pipe.queued.is_empty(),
            "{what} with {} multi-stream runs queued: collect them first",
            self.pipe.queued.len()
        );
        self.pipe.live = false;
        Ok(())
    }
}
