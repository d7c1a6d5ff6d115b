//! [`GpuBackend`]: `nibble_backend::Backend` on the GPU decode plan.
//!
//! - `decode_greedy` and `decode_greedy_stream` are folded: the run state is written once per
//!   request, runs of `fold` (resp. the caller's `run`) steps are each recorded into one command
//!   buffer, the argmax and the token chain stay on the GPU, and run k+1 is submitted before the
//!   host waits for run k (at most two in flight, [`crate::stream::GreedyStream`]). With
//!   `per_token` set they instead submit and wait per token and take the argmax on the host
//!   (the comparison path; same kernels otherwise).
//! - `decode_sampled_stream` folds sampled requests the same way, the GPU sampler
//!   (kernels/sample.rs) in place of the argmax, for the settings it takes (top-k 1..=256).
//! - An early stop of the stream (`on_ids` returning false) lets the queued run finish:
//!   `position()` then counts the steps the GPU really took, and the caller truncates.
//! - `step` / `prefill` return logits. A prompt of [`GpuOptions::prefill_gemm_min`] tokens or
//!   more takes the GEMM prefill (`prefill.rs`: chunks of [`GpuOptions::prefill_chunk`] tokens,
//!   one command buffer each, every weight tile shared by the chunk's tokens), also for stream
//!   slots; a shorter one of 2 or more the column prefill (8 tokens per dispatch), as every
//!   prompt does with `prefill_chunk` 0; only the last token's logits come back (paths:
//!   backend_prefill.rs). `--per-token` and the int8 numerics prefill token by token
//!   ([`crate::plan::PREFILL_CHUNK`] tokens per command buffer).
//! - [`GpuOptions::numerics`] picks the activation form of every int4 matvec; the default
//!   ([`Numerics::DEFAULT`]) is the fastest that keeps the oracle-parity bar.
//! - Position bookkeeping follows the trait: a failing call leaves `position()` unchanged.

use crate::context::{AdapterChoice, Context};
use crate::kernels::attention::{AttnForm, ChunkShape, Combine};
use crate::kernels::moe::Routing;
use crate::numerics::Numerics;
use crate::plan::{DecodePlan, PlanOptions};
use crate::stream::GreedyRuns;
use crate::weights::{DenseForms, GpuWeights};
use anyhow::{bail, ensure, Result};
use nibble_backend::{argmax, Backend, DeviceSampling, OpTime, RowSink, StepTrace};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::WeightSource;

/// Options of the GPU backend.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// KV-cache positions.
    pub context_len: usize,
    /// The KV cache's element type (f32 by default; f16 halves its memory and its reads, but
    /// was not faster on the H100, BENCHMARKS runs 171-173: nibble_model::kv_cache).
    pub cache: nibble_model::kv_cache::CacheType,
    /// Greedy steps per submission in `decode_greedy`. Default 4, from the H200 sweep of
    /// 2026-11-29 (docs/BENCHMARKS.md run 3, runs overlapped): tg128 249.1 / 249.6 / 248.3 /
    /// 245.3 / 239.8 / 234.5 tok/s at N = 1 / 4 / 8 / 16 / 32 / 64.
    pub fold: u32,
    /// Submit per token and take the argmax on the host (and prefill token by token: the
    /// unbatched path end to end, for comparisons).
    pub per_token: bool,
    pub routing: Routing,
    pub adapter: AdapterChoice,
    /// Activation form of the int4 matvecs (see `numerics.rs`).
    pub numerics: Numerics,
    /// Independent sequences the multi-stream path decodes together (each with its own KV cache
    /// of `context_len` positions); 0: no multi-stream path is built.
    pub streams: usize,
    /// Fold the router into the o-proj dispatch (kernels/router_fold.rs); false keeps its own
    /// dispatch, for comparisons.
    pub fold_router: bool,
    /// When exactly one stream of the multi-stream path is live and greedy, decode it on the
    /// single-sequence plan in its KV slot (plan_slots.rs; faster than the column kernels at
    /// one column); false keeps it on the columns, for comparisons.
    pub lone_stream: bool,
    /// Where the attention (single-sequence and multi-stream) merges its chunks; `None`: the
    /// backend's default ([`Combine::for_context`]: fused on Vulkan). `Some(Combine::Dispatch)`
    /// for comparisons.
    pub attention_combine: Option<Combine>,
    /// Work-split overrides for comparisons (`crate::tune::Tune`; the default changes
    /// nothing): rows per team of the qkv and o-proj matvecs, the MoE kernels' lanes, rows and
    /// down slot groups, the attention's split, tile loads and fused-combine limit.
    pub tune: crate::tune::Tune,
    /// Prompt tokens per chunk of the GEMM prefill (`prefill.rs`); 0 keeps the column prefill
    /// (8 tokens per dispatch), for comparisons.
    pub prefill_chunk: u32,
    /// The GEMM prefill's attention as query tiles (kernels/attention_prefill.rs) where the
    /// shapes allow, instead of one column per token (false: for comparisons). On the H200 it
    /// is 1.1-2.0x faster in the whole prefill (docs/BENCHMARKS.md run 95).
    pub prefill_query_tiles: bool,
    /// The GEMM prefill's int4 products on matrix units (tensor cores; kernels/gemm_coop.rs)
    /// where the device offers them (NVIDIA on Vulkan); false keeps the f32-fma kernel
    /// everywhere, for comparisons.
    pub prefill_matrix_units: bool,
    /// Prompts (main sequence and stream slots) of fewer tokens take the column prefill, 8
    /// tokens per dispatch, instead of the GEMM prefill ([`GEMM_PREFILL_MIN_TOKENS`], measured;
    /// 2: every prompt of 2 tokens or more takes the GEMM prefill).
    pub prefill_gemm_min: usize,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            context_len: 4096,
            cache: Default::default(),
            fold: 4,
            per_token: false,
            routing: Routing::default(),
            adapter: AdapterChoice::Auto,
            numerics: Numerics::DEFAULT,
            streams: 0,
            fold_router: true,
            lone_stream: true,
            attention_combine: None,
            tune: crate::tune::Tune::default(),
            prefill_chunk: crate::prefill::DEFAULT_CHUNK,
            prefill_query_tiles: true,
            prefill_matrix_units: true,
            prefill_gemm_min: GEMM_PREFILL_MIN_TOKENS,
        }
    }
}

/// `(slot, token, position)` of the only stream fed in `seqs`; `None` when none or several are.
fn lone_input(seqs: &[Option<(u32, usize)>]) -> Option<(usize, u32, usize)> {
    let mut fed = seqs
        .iter()
        .enumerate()
        .filter_map(|(s, q)| q.map(|(t, p)| (s, t, p)));
    match (fed.next(), fed.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

/// Most EOS ids a folded run can stop on.
const MAX_EOS: usize = 16;

/// The GPU backend: weights resident on the device, one sequence's KV cache.
pub struct GpuBackend {
    plan: DecodePlan,
    per_token: bool,
    pos: usize,
    /// The multi-stream path (`GpuOptions::streams > 0`) and each stream's position.
    batch: Option<crate::batch::BatchPlan>,
    /// The column prefill: 8 prompt tokens per dispatch into the main sequence's cache (f32
    /// numerics; the int8 forms prefill token by token), for prompts under `gemm_min` tokens
    /// (every prompt with `GpuOptions::prefill_chunk` 0).
    prefill: ColumnPrefill,
    /// The GEMM prefill (`prefill.rs`), the default for prompts of 2 tokens or more, main
    /// sequence and stream slots alike (f32 numerics, not `--per-token`).
    gemm_prefill: GemmPrefill,
    /// [`GpuOptions::prefill_gemm_min`].
    gemm_min: usize,
    stream_pos: Vec<usize>,
    /// Streams the queued multi-stream runs advance (set by a restart, cleared by
    /// `streams_end`), the steps queued and not collected, and each queued run's length.
    stream_live: Vec<bool>,
    stream_queued: usize,
    stream_runs: std::collections::VecDeque<usize>,
    /// The lone stream's greedy runs on the plan, in its KV slot (`None`: the column path
    /// runs, or nothing): its slot and the runs' queue.
    lone: Option<(usize, GreedyRuns)>,
    /// Whether a lone stream may take the plan ([`GpuOptions::lone_stream`] and slots bound).
    lone_path: bool,
}

impl GpuBackend {
    /// Checked `(token, position)` inputs of a multi-stream run of `n` steps: `tokens[s]`
    /// feeds stream `s` (`None` sits out); ids in the vocabulary, `n` steps within the context.
    fn stream_inputs(&self, tokens: &[Option<u32>], n: usize) -> Result<Vec<Option<(u32, usize)>>> {
        let Some(b) = &self.batch else {
            bail!("no multi-stream path: the GPU backend was built with 0 streams");
        };
        ensure!(
            tokens.len() <= b.streams(),
            "{} streams requested, the path decodes {}",
            tokens.len(),
            b.streams()
        );
        let mut seqs = Vec::with_capacity(tokens.len());
        for (s, t) in tokens.iter().enumerate() {
            seqs.push(match t {
                Some(t) => {
                    self.check_token(*t)?;
                    let pos = self.stream_pos[s];
                    ensure!(
                        n <= self.context_len() - pos,
                        "{n} steps of stream {s} at position {pos} exceed the context of {}",
                        self.context_len()
                    );
                    Some((*t, pos))
                }
                None => None,
            });
        }
        Ok(seqs)
    }

    /// Open a device per `opts.adapter` and upload `source`.
    pub fn new(source: &dyn WeightSource, opts: GpuOptions) -> Result<GpuBackend> {
        let ctx = Context::new(&opts.adapter)?;
        Self::with_context(&ctx, source, opts)
    }

    /// Upload `source` to an existing context.
    pub fn with_context(
        ctx: &Context,
        source: &dyn WeightSource,
        opts: GpuOptions,
    ) -> Result<GpuBackend> {
        let cfg = source.config();
        ensure!(
            opts.context_len > 0,
            "the context length must be at least 1"
        );
        ensure!(
            opts.context_len <= cfg.max_context(),
            "a context of {} positions exceeds the model's context ({})",
            opts.context_len,
            cfg.max_context()
        );
        ensure!(opts.fold > 0, "fold must be at least 1");
        // The quantised and bfp24 matvecs read Q4_0 only: other dense forms are widened for them.
        let dense = match opts.numerics {
            Numerics::F32 => DenseForms::Any,
            _ => DenseForms::Q4_0Only,
        };
        let weights = GpuWeights::upload_with(ctx, source, dense)?;
        let mut plan = DecodePlan::new(
            ctx,
            weights,
            PlanOptions {
                context_len: opts.context_len,
                cache: opts.cache,
                max_run: opts.fold,
                routing: opts.routing,
                max_eos: MAX_EOS,
                numerics: opts.numerics,
                fold_router: opts.fold_router,
                attention_combine: opts.attention_combine,
                tune: opts.tune,
            },
        )?;
        use crate::batch::{BatchMode, BatchPlan};
        let merge = opts.attention_combine.unwrap_or(Combine::for_context(ctx));
        let batch = match opts.streams {
            0 => None,
            n => Some(BatchPlan::new(
                ctx,
                &plan.weights,
                (n, opts.context_len, opts.cache),
                opts.numerics,
                merge,
                opts.tune,
                BatchMode::Streams,
            )?),
        };
        let lone_path = match &batch {
            Some(b) if opts.lone_stream => {
                let (k, v) = b.kv_caches();
                plan.bind_slots(k, v, b.streams())?
            }
            _ => false,
        };
        let prefill = ColumnPrefill::new(&opts, merge);
        let gemm_prefill = GemmPrefill::new(&opts, merge, &plan.weights.forms());
        Ok(GpuBackend {
            plan,
            per_token: opts.per_token,
            pos: 0,
            stream_pos: vec![0; opts.streams],
            stream_live: vec![false; opts.streams],
            stream_queued: 0,
            stream_runs: Default::default(),
            lone: None,
            lone_path,
            batch,
            prefill,
            gemm_prefill,
            gemm_min: opts.prefill_gemm_min,
        })
    }

    /// Bytes of the KV caches on the GPU: keys and values of every layer, for the main sequence
    /// and each multi-stream slot.
    pub fn kv_cache_bytes(&self) -> u64 {
        let per_seq = 2 * self.plan.weights.cfg.num_layers as u64 * self.plan.cache_bytes();
        per_seq * (1 + self.batch.as_ref().map_or(0, |b| b.streams() as u64))
    }

    /// Bytes of weights resident on the GPU (with the folded router's matrices).
    pub fn resident_bytes(&self) -> u64 {
        self.plan.weights.resident_bytes + self.plan.fold_bytes()
    }

    /// Dispatches recorded per greedy step.
    pub fn dispatches_per_step(&self) -> usize {
        self.plan.dispatches_per_step()
    }

    /// Dispatches per greedy step at the last position of the context (the most: attention
    /// adds a combine once the context spans several chunks).
    pub fn dispatches_per_step_max(&self) -> usize {
        let last = self.context_len().saturating_sub(1) as u32;
        self.plan.dispatches_per_step_at(last)
    }

    /// The plan (diagnostics and tests).
    pub fn plan(&self) -> &DecodePlan {
        &self.plan
    }

    /// Corrupt one tensor of `layer` in the GPU copy of the weights (testing the parity
    /// localiser; see [`crate::plant`]).
    pub fn plant_error(&mut self, layer: usize, target: crate::plant::PlantTarget) -> Result<()> {
        crate::plant::plant_error(&self.plan, layer, target)
    }

    /// The multi-stream path in words (empty without it): slots, and where a lone greedy
    /// stream decodes (`GpuOptions::lone_stream`).
    pub fn streams_summary(&self) -> String {
        match &self.batch {
            None => String::new(),
            Some(b) => format!(
                "{} stream slots, a lone greedy stream on the {}",
                b.streams(),
                if self.lone_path {
                    "single-sequence plan"
                } else {
                    "multi-stream kernels"
                }
            ),
        }
    }

    /// Which dispatches warm which weights into L2 (kernels/warm.rs), in how many layers:
    /// "off", or e.g. "qkv -> o-proj in 48 layers, down -> next qkv in 47, gate/up -> down in 0".
    pub fn warming_summary(&self) -> String {
        match self.plan.warmed_layers() {
            (0, 0, 0) => "off".to_string(),
            (q, d, g) => {
                format!(
                    "qkv -> o-proj in {q} layers, down -> next qkv in {d}, gate/up -> down in {g}"
                )
            }
        }
    }

    /// A multi-line summary for `--verbose`: adapter, numerics, fold, dispatches per token,
    /// resident bytes, prefill chunk, and the multi-stream path when there is one.
    pub fn describe(&self) -> String {
        let info = &self.plan.ctx.info;
        let o = &self.plan.opts;
        let mode = if self.per_token {
            "per-token submits".to_string()
        } else {
            format!("{} tokens per submit", o.max_run)
        };
        format!(
            "gpu adapter: {} ({:?}, {:?})\n\
             numerics: {} ({} weights x {} activations)\n\
             decode: fold {} ({mode}), {} dispatches per token ({} at the end of the context), \
             routing {:?}, router {}, attention {}, attention combine {}, MoE down slot \
             groups {}, lm_head {}, L2 warming {}, tune {}\n\
             prefill: {}\n\
             resident weights: {} bytes ({:.1} MiB), context {} positions, KV cache {} ({:.1} \
             MiB){}",
            info.name,
            info.device_type,
            info.backend,
            o.numerics,
            self.plan.weights.form_names(),
            o.numerics,
            o.max_run,
            self.dispatches_per_step(),
            self.dispatches_per_step_max(),
            o.routing,
            if self.plan.fold_bytes() > 0 {
                "folded into the o-proj"
            } else {
                "in its own dispatch"
            },
            {
                let name = |sh: ChunkShape| match sh.form {
                    AttnForm::Tiles => format!("tiled body, {} loads per tile", sh.tile_loads),
                    AttnForm::Stream => format!(
                        "streamed body, {} loads per key block, {} V rows per batch",
                        sh.tile_loads, sh.v_rows
                    ),
                };
                let mut body = name(self.plan.attention_shape());
                if let Some((from, sh)) = self.plan.attention_deep() {
                    body += &format!("; from position {from}: {} over 256 workgroups", name(sh));
                }
                match self.plan.qkv_attention_positions() {
                    Some(n) => {
                        format!("in the qkv dispatch below position {n}, then chunks ({body})")
                    }
                    None => format!("in chunks ({body})"),
                }
            },
            match self.plan.attention_combine() {
                Combine::Fused => "fused into the chunks",
                Combine::Dispatch => "in its own dispatch",
            },
            self.plan.moe_down_splits(),
            self.plan.head_form(),
            self.warming_summary(),
            o.tune,
            self.prefill_summary(),
            self.resident_bytes(),
            self.resident_bytes() as f64 / (1u64 << 20) as f64,
            o.context_len,
            o.cache,
            self.kv_cache_bytes() as f64 / (1u64 << 20) as f64,
            match self.streams_summary() {
                x if x.is_empty() => x,
                x => format!("\nmulti-stream: {x}"),
            },
        )
    }

    fn check_token(&self, t: u32) -> Result<()> {
        nibble_backend::check_token(self.plan.weights.cfg.vocab_size, t)
    }

    /// Something is about to rewrite the plan's run state or the columns (a main-sequence op,
    /// a stream prefill, a one-step run, a restart): no lone-stream run may be queued, and
    /// the lone pipeline ends, so the next greedy stream run restarts (as the columns' does).
    fn lone_idle(&mut self, what: &str) -> Result<()> {
        if let Some((_, runs)) = &self.lone {
            ensure!(
                runs.queued_runs() == 0,
                "{what} with {} multi-stream runs queued: collect them first",
                runs.queued_runs()
            );
        }
        self.lone = None;
        Ok(())
    }

    /// Validate a greedy request of `n` steps from `token` at the current position.
    fn check_greedy(&self, token: u32, n: usize, eos: &[u32]) -> Result<()> {
        self.check_token(token)?;
        ensure!(
            eos.len() <= MAX_EOS,
            "at most {MAX_EOS} EOS ids are supported, got {}",
            eos.len()
        );
        if n > self.context_len() - self.pos {
            bail!(
                "{n} greedy steps at position {} exceed the context of {}",
                self.pos,
                self.context_len()
            );
        }
        Ok(())
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> String {
        format!("gpu ({})", self.plan.ctx.info.name)
    }

    fn config(&self) -> &Qwen3MoeConfig {
        &self.plan.weights.cfg
    }

    fn context_len(&self) -> usize {
        self.plan.opts.context_len
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn truncate(&mut self, pos: usize) -> Result<()> {
        ensure!(
            pos <= self.pos,
            "cannot truncate to {pos}: only {} positions are cached",
            self.pos
        );
        // Rows >= pos are stale and get overwritten before attention reads them again.
        self.pos = pos;
        Ok(())
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.prefill_with(tokens, None)
    }

    fn prefill_rows(&mut self, tokens: &[u32], from: usize, row: &mut RowSink<'_>) -> Result<()> {
        self.prefill_with(tokens, Some((from, row))).map(drop)
    }

    fn max_streams(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| b.streams())
    }

    fn stream_prefill(&mut self, slot: usize, start: usize, prompt: &[u32]) -> Result<Vec<f32>> {
        self.stream_prefill_with(slot, start, prompt, None)
    }

    fn stream_prefill_rows(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
        row: &mut RowSink<'_>,
    ) -> Result<()> {
        self.stream_prefill_with(slot, start, tokens, Some((0, row)))
            .map(drop)
    }

    fn streams_decode_greedy(
        &mut self,
        tokens: &[Option<u32>],
        n: usize,
        eos: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        // Strict here: the whole run must fit every fed stream's context.
        self.stream_inputs(tokens, n)?;
        if n == 0 || self.streams_queue(Some(tokens), n, eos)? == 0 {
            return Ok(vec![Vec::new(); tokens.len()]);
        }
        let mut ids = self.streams_collect()?.expect("one run was queued");
        ids.truncate(tokens.len());
        Ok(ids)
    }

    fn streams_queue(
        &mut self,
        restart: Option<&[Option<u32>]>,
        n: usize,
        eos: &[u32],
    ) -> Result<usize> {
        self.streams_queue_with(restart, n, eos, &[])
    }

    /// A lone stream on the plan (kernels/sample.rs) or any streams on the columns (its
    /// column form).
    fn streams_sample_on_device(&self, spec: &DeviceSampling<'_>) -> bool {
        self.batch.is_some() && !self.per_token && spec.in_device_range()
    }

    fn streams_queue_sampled(
        &mut self,
        restart: &[Option<u32>],
        n: usize,
        eos: &[u32],
        specs: &[Option<&DeviceSampling<'_>>],
    ) -> Result<usize> {
        for sp in specs.iter().flatten() {
            ensure!(
                self.streams_sample_on_device(sp),
                "these sampling settings are not sampled on the GPU (top_k {} of 1..={})",
                sp.top_k,
                nibble_backend::DEVICE_TOP_K_MAX
            );
        }
        self.streams_queue_with(Some(restart), n, eos, specs)
    }

    fn streams_collect(&mut self) -> Result<Option<Vec<Vec<u32>>>> {
        let Some(b) = self.batch.as_mut() else {
            bail!("no multi-stream path: the GPU backend was built with 0 streams");
        };
        if let Some((slot, runs)) = &mut self.lone {
            // A restart needs every queued run collected, so runs are queued on the plan or
            // on the columns, never both.
            let Some(out) = runs.wait_next(&self.plan)? else {
                return Ok(None);
            };
            self.stream_queued -= self.stream_runs.pop_front().unwrap_or(0);
            self.stream_pos[*slot] += out.ids.len();
            let mut ids = vec![Vec::new(); b.streams()];
            ids[*slot] = out.ids;
            return Ok(Some(ids));
        }
        let Some(ids) = b.collect()? else {
            return Ok(None);
        };
        self.stream_queued -= self.stream_runs.pop_front().unwrap_or(0);
        for (s, v) in ids.iter().enumerate() {
            self.stream_pos[s] += v.len();
        }
        Ok(Some(ids))
    }

    fn streams_end(&mut self, slot: usize) -> Result<()> {
        let Some(b) = self.batch.as_mut() else {
            bail!("no multi-stream path: the GPU backend was built with 0 streams");
        };
        if self.lone.as_ref().is_none_or(|(s, _)| *s != slot) {
            b.end_column(slot)?;
        }
        self.stream_live[slot] = false;
        Ok(())
    }

    fn streams_step(&mut self, tokens: &[Option<u32>]) -> Result<Vec<Option<Vec<f32>>>> {
        let seqs = self.stream_inputs(tokens, 1)?;
        self.lone_idle("a one-step run")?;
        let b = self.batch.as_mut().expect("stream_inputs checked the path");
        if let Some((slot, token, pos)) = lone_input(&seqs).filter(|_| self.lone_path) {
            // One stream fed: the single-sequence plan's step in its KV slot (plan_slots.rs).
            b.idle("a one-step run")?;
            let logits = self.plan.step_logits_slot(slot, token, pos)?;
            self.stream_pos[slot] += 1;
            let mut out = vec![None; seqs.len()];
            out[slot] = Some(logits);
            return Ok(out);
        }
        let logits = b.step_logits(&seqs)?;
        for (s, q) in seqs.iter().enumerate() {
            self.stream_pos[s] += q.is_some() as usize;
        }
        Ok(logits)
    }

    /// Sums of a 1 GiB buffer (capped by the binding limit), 10 times ([`crate::bandwidth`]).
    fn read_bandwidth_gbps(&mut self) -> Result<Option<f64>> {
        Ok(Some(crate::bandwidth::read_gbps(
            &self.plan.ctx,
            1 << 30,
            10,
        )?))
    }

    /// [`DecodePlan::profile_step`] at the current position (token 0: any id times the same).
    fn profile_step(&mut self, reps: usize) -> Result<Option<Vec<OpTime>>> {
        self.lone_idle("a profiled step")?;
        ensure!(
            self.pos < self.context_len(),
            "the context of {} positions is full",
            self.context_len()
        );
        Ok(self.plan.profile_step(0, self.pos, reps)?)
    }

    fn profile_prefill(&mut self, tokens: &[u32]) -> Result<Option<Vec<OpTime>>> {
        self.profile_gemm_prefill(tokens)
    }

    /// The GEMM prefill one layer per submit ([`crate::prefill::PrefillPlan::trace`]); `None`
    /// where a prompt of this length takes another prefill.
    fn trace_prefill(
        &mut self,
        tokens: &[u32],
    ) -> Result<Option<Vec<nibble_backend::PrefillLayerTrace>>> {
        self.trace_gemm_prefill(tokens)
    }

    /// One op per submit with a readback each ([`DecodePlan::trace_step`]).
    fn trace_step(&mut self, token: u32) -> Result<Option<StepTrace>> {
        self.check_token(token)?;
        self.lone_idle("a traced step")?;
        ensure!(
            self.pos < self.context_len(),
            "the context of {} positions is full",
            self.context_len()
        );
        let t = self.plan.trace_step(token, self.pos)?;
        self.pos += 1;
        Ok(Some(t))
    }

    fn decode_greedy(&mut self, token: u32, n: usize, eos: &[u32]) -> Result<Vec<u32>> {
        self.check_greedy(token, n, eos)?;
        self.lone_idle("greedy decode")?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(n);
        if !self.per_token {
            let fold = self.plan.opts.max_run as usize;
            self.stream_folded(token, n, fold, eos, None, &mut |ids| {
                out.extend_from_slice(ids);
                true
            })?;
            return Ok(out);
        }
        let start = self.pos;
        let mut cur = token;
        let result = (|| -> Result<()> {
            while out.len() < n {
                let next = argmax(&self.plan.step_logits(cur, start + out.len())?);
                out.push(next);
                if eos.contains(&next) {
                    break;
                }
                cur = next;
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                self.pos = start + out.len();
                Ok(out)
            }
            Err(e) => {
                self.pos = start;
                Err(e)
            }
        }
    }

    /// Folded: one state write for all `n` steps, runs of `run` steps each in its own command
    /// buffer, run k+1 queued before the host waits for run k (see the module docs).
    fn decode_greedy_stream(
        &mut self,
        token: u32,
        n: usize,
        run: usize,
        eos: &[u32],
        on_ids: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<usize> {
        self.check_greedy(token, n, eos)?;
        self.lone_idle("greedy decode")?;
        if n == 0 {
            return Ok(0);
        }
        if self.per_token {
            return self.stream_per_token(token, n, run.max(1), eos, on_ids);
        }
        self.stream_folded(token, n, run.max(1), eos, None, on_ids)
    }

    /// Folded sampled runs on the plan's cache; not on the per-token path (kept for the
    /// host-side comparison) nor past the device sampler's range.
    fn samples_on_device(&self, spec: &DeviceSampling<'_>) -> bool {
        !self.per_token && spec.in_device_range()
    }

    fn decode_sampled_stream(
        &mut self,
        token: u32,
        n: usize,
        run: usize,
        eos: &[u32],
        spec: &DeviceSampling<'_>,
        on_ids: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<usize> {
        self.check_greedy(token, n, eos)?;
        ensure!(
            self.samples_on_device(spec),
            "these sampling settings are not sampled on the GPU (top_k {} of 1..={})",
            spec.top_k,
            nibble_backend::DEVICE_TOP_K_MAX
        );
        ensure!(
            spec.temperature <= 0.0 || spec.uniforms.len() >= n,
            "{n} sampled steps need {n} draws, got {}",
            spec.uniforms.len()
        );
        self.lone_idle("sampled decode")?;
        if n == 0 {
            return Ok(0);
        }
        self.stream_folded(token, n, run.max(1), eos, Some(spec), on_ids)
    }
}

#[path = "backend_runs.rs"]
mod runs;

#[path = "backend_prefill.rs"]
mod prefill_paths;
pub use prefill_paths::GEMM_PREFILL_MIN_TOKENS;
use prefill_paths::{ColumnPrefill, GemmPrefill};
