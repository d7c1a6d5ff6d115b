//! Backend selection, done once at start-up (`--backend auto|gpu|cpu|ref`).

use crate::rope_args::RopeArgs;
use anyhow::Result;
use nibble_backend::reference::RefBackend;
use nibble_backend::Backend;
use nibble_cpu::CpuBackend;
use nibble_gpu::backend::{GpuBackend, GpuOptions};
use nibble_gpu::context::{AdapterChoice, Context};
use nibble_model::kv_cache::CacheType;
use nibble_model::loader::LoadedModel;
use nibble_model::weights::WeightSource;
use std::sync::Arc;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The GPU if a hardware adapter exists, else (with a message) the CPU backend.
    Auto,
    /// wgpu + WGSL kernels (Metal, Vulkan; lavapipe counts as a GPU here).
    Gpu,
    /// The fast forward pass on the CPU (packed weights, vectorised products, batched prefill).
    Cpu,
    /// The plain reference forward pass on the CPU (the oracle).
    Ref,
}

/// Flags shared by every command that runs a model.
#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// Which backend decodes.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendKind,
    /// GPU: greedy tokens recorded into one command buffer per run.
    #[arg(long, default_value_t = nibble_gpu::backend::GpuOptions::default().fold)]
    pub fold: u32,
    /// GPU: submit and wait every token, argmax on the host (the unfolded path, for comparison).
    #[arg(long)]
    pub per_token: bool,
    /// GPU: activation form of the int4 matvecs: f32, bfp24 (f32 in memory, the dense matvecs
    /// multiply in block floating point with integer dots), precise-int8 or int8 (default: the
    /// fastest that keeps oracle parity).
    #[arg(long, default_value_t = nibble_gpu::Numerics::DEFAULT)]
    pub numerics: nibble_gpu::Numerics,
    /// GPU and CPU: independent sequences the multi-stream path decodes together (each gets its
    /// own KV cache of --ctx positions; 0 = no multi-stream path).
    #[arg(long, default_value_t = 0)]
    pub streams: usize,
    /// GPU: keep the router in a dispatch of its own instead of folding it into the o-proj's
    /// (for comparisons; the fold is the default).
    #[arg(long)]
    pub router_dispatch: bool,
    /// GPU: decode a lone multi-stream sequence on the column kernels too, instead of on the
    /// single-sequence plan in its KV slot (for comparisons; the single plan is the default).
    #[arg(long)]
    pub columns_alone: bool,
    /// GPU: merge the attention's chunks in a dispatch of their own instead of in the last
    /// chunk workgroup of each kv head (for comparisons; fused is the default on Vulkan).
    #[arg(long)]
    pub combine_dispatch: bool,
    /// GPU: override work splits and kernel forms, for comparisons: comma-separated key=value
    /// (crates/gpu/src/tune.rs documents each; unset keys keep the measured defaults). qkv_rows,
    /// o_rows: rows per team of those matvecs (1, 2 or 4). gate_up_lanes, gate_up_rows,
    /// down_lanes, down_rows: the staged MoE kernels' lanes per row and rows per team.
    /// down_split, down_split_wide: each down row block's expert slots over 1, 2, 4 or 8
    /// workgroups (wide: a down of a byte form, default 8; else 4). attn_workgroups (the
    /// attention split's target, default 1024), attn_tile_loads (1..=16, default 2),
    /// attn_fused_max (chunks per kv head the fused combine serves, default 16), attn_form (1,
    /// the default: the tiled chunk body; 2: the streamed one), attn_v_rows (the streamed body's
    /// V rows per thread per batch, 1..=16, default 4), attn_deep (P: from position P on, a
    /// single sequence's steps take the streamed body with 64-row key blocks over 256
    /// workgroups; off by default). late_norm,
    /// moe_late_norm (1, the default: the qkv and the MoE gate/up scale by 1 / rms after their
    /// dots; 0: the norm first). head (the lm_head form, 0..=4, default 4). prefill_splits (most
    /// key splits of the prefill's query-tile attention, 1..=16, default 16; 1: none),
    /// prefill_ksplits (K splits of a short chunk's qkv and o-proj GEMMs, default 8; 1:
    /// unsplit), prefill_dbuf (0: the matrix-unit prefill GEMM's 32-token tiles with one staging
    /// buffer instead of the default two), prefill_coop_affine (1: an MLX model's prefill GEMMs
    /// on the matrix units; off by default). qkv_attn (N: the qkv dispatch also attends below
    /// position N, 4 dispatches per layer; off by default, slower on the H200). warm (the L2
    /// warming's bit mask, default 3; 0: none). qkv_pair (0: a two-form qkv, e.g. Q4_K_M's, in
    /// a dispatch per part instead of one).
    #[arg(long, value_parser = |s: &str| s.parse::<nibble_gpu::tune::Tune>())]
    pub tune: Option<nibble_gpu::tune::Tune>,
    /// GPU: prompt tokens per chunk of the GEMM prefill (0: the column prefill, 8 tokens per
    /// dispatch, for comparisons).
    #[arg(long, default_value_t = nibble_gpu::prefill::DEFAULT_CHUNK)]
    pub prefill_chunk: u32,
    /// GPU: the GEMM prefill's attention as one column per token instead of query tiles (a
    /// block of tokens per workgroup, the default where the shapes allow; for comparisons).
    #[arg(long)]
    pub prefill_column_attention: bool,
    /// GPU: the GEMM prefill's int4 products as f32 fmas even where matrix units (tensor
    /// cores) are offered (for comparisons; the matrix-unit kernel is the default there).
    #[arg(long)]
    pub prefill_f32_gemm: bool,
    /// GPU: prompts of fewer tokens take the column prefill (8 tokens per dispatch) instead of
    /// the GEMM prefill, which costs about a chunk's weight traffic whatever the prompt's length
    /// (default: the crossover measured on the H200; 2: the GEMM prefill for every prompt).
    #[arg(long, default_value_t = nibble_gpu::backend::GEMM_PREFILL_MIN_TOKENS)]
    pub prefill_gemm_min: usize,
    /// KV-cache capacity in tokens (default: the model's context, capped at 4096; a RoPE
    /// scaling raises the model's context, e.g. YaRN x4 over 32768 to 131072).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// The KV cache's element type: f32 (the default: exact, the oracle's parity bar holds) or
    /// f16 (half the cache's memory and reads, as llama.cpp's default `--cache-type-k f16`;
    /// every backend, the oracle included, then rounds what it caches to f16, and parity is
    /// near rather than exact).
    #[arg(long, default_value_t = CacheType::default(), value_parser = |s: &str| s.parse::<CacheType>())]
    pub cache_type: CacheType,
    #[command(flatten)]
    pub rope: RopeArgs,
    /// Print what runs (backend, kernel variants, memory).
    #[arg(short, long)]
    pub verbose: bool,
}

/// The GPU backend with `args`' options and a KV cache of `ctx` positions.
pub fn make_gpu(args: &BackendArgs, weights: &dyn WeightSource, ctx: usize) -> Result<GpuBackend> {
    let opts = GpuOptions {
        context_len: ctx,
        cache: args.cache_type,
        fold: args.fold.max(1),
        per_token: args.per_token,
        numerics: args.numerics,
        streams: args.streams,
        fold_router: !args.router_dispatch,
        lone_stream: !args.columns_alone,
        attention_combine: args
            .combine_dispatch
            .then_some(nibble_gpu::kernels::attention::Combine::Dispatch),
        tune: args.tune.unwrap_or_default(),
        prefill_chunk: args.prefill_chunk,
        prefill_query_tiles: !args.prefill_column_attention,
        prefill_matrix_units: !args.prefill_f32_gemm,
        prefill_gemm_min: args.prefill_gemm_min,
        ..GpuOptions::default()
    };
    let g = GpuBackend::new(weights, opts)?;
    if args.verbose {
        note!(
            "gpu: {} dispatches per token ({} at the end of the context), {:.3} GB resident \
             weights, {} KV cache {:.1} MB, {} weights, numerics {}, fold {}, {}, attention combine {:?}, MoE down slot \
             groups {}, L2 warming {}, tune {}{}{}",
            g.dispatches_per_step(),
            g.dispatches_per_step_max(),
            g.resident_bytes() as f64 / 1e9,
            args.cache_type,
            g.kv_cache_bytes() as f64 / 1e6,
            g.plan().weights.form_names(),
            args.numerics,
            args.fold,
            match g.plan().qkv_attention_positions() {
                Some(n) => format!("qkv + attention in one dispatch below position {n}"),
                None => "qkv and attention in dispatches of their own".to_string(),
            },
            g.plan().attention_combine(),
            g.plan().moe_down_splits(),
            g.warming_summary(),
            args.tune.unwrap_or_default(),
            if args.per_token {
                " (per-token path)"
            } else {
                ""
            },
            match g.streams_summary() {
                x if x.is_empty() => x,
                x => format!(", {x}"),
            }
        );
        // Which prefill (and on which GEMM kernel) this device runs, e.g. matrix units or fmas.
        note!("gpu prefill: {}", g.prefill_summary());
    }
    Ok(g)
}

impl BackendArgs {
    /// The GPU-only flags given away from their defaults: meaningless on the CPU backends.
    fn gpu_flags(&self) -> Vec<&'static str> {
        let gpu = GpuOptions::default();
        [
            ("--fold", self.fold != gpu.fold),
            ("--per-token", self.per_token),
            ("--numerics", self.numerics != nibble_gpu::Numerics::DEFAULT),
            ("--router-dispatch", self.router_dispatch),
            ("--columns-alone", self.columns_alone),
            ("--combine-dispatch", self.combine_dispatch),
            ("--tune", self.tune.is_some()),
            (
                "--prefill-chunk",
                self.prefill_chunk != nibble_gpu::prefill::DEFAULT_CHUNK,
            ),
            ("--prefill-column-attention", self.prefill_column_attention),
            ("--prefill-f32-gemm", self.prefill_f32_gemm),
            (
                "--prefill-gemm-min",
                self.prefill_gemm_min != nibble_gpu::backend::GEMM_PREFILL_MIN_TOKENS,
            ),
        ]
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect()
    }

    /// Refuses GPU-only flags with an explicit CPU backend (they used to be ignored
    /// silently); with `auto` falling back to the CPU they are named as ignored.
    pub fn check_flags(&self) -> Result<()> {
        let given = self.gpu_flags();
        if self.backend == BackendKind::Ref && self.streams > 0 {
            anyhow::bail!("--streams: the reference backend decodes one sequence (the gpu and cpu backends have the multi-stream path)");
        }
        if let (false, Some(first)) = (
            matches!(self.backend, BackendKind::Auto | BackendKind::Gpu),
            given.first(),
        ) {
            anyhow::bail!(
                "{first} applies to the GPU backend only, not to --backend {}",
                format!("{:?}", self.backend).to_lowercase()
            );
        }
        Ok(())
    }
}

/// Open the model at `path` with `args`' RoPE scaling flags applied (every command that runs a
/// model opens it here, so its backends, context checks and messages see one config).
pub fn open_model(path: &std::path::Path, args: &BackendArgs) -> Result<LoadedModel> {
    let model = nibble_model::loader::open(path)?;
    let scaling = args.rope.resolve(model.weights.config())?;
    let model = model.with_rope_scaling(scaling)?;
    if args.verbose {
        if let Some(s) = model.weights.config().rope_scaling {
            note!(
                "rope scaling: {s} (context up to {})",
                model.weights.config().max_context()
            );
        }
    }
    Ok(model)
}

/// Build the chosen backend over `weights`.
pub fn make(args: &BackendArgs, weights: Arc<dyn WeightSource>) -> Result<Box<dyn Backend>> {
    let cfg = weights.config().clone();
    let ctx = args.ctx.unwrap_or(cfg.max_position_embeddings.min(4096));
    if ctx == 0 || ctx > cfg.max_context() {
        anyhow::bail!(
            "--ctx {ctx} must be between 1 and the model's context of {}{}",
            cfg.max_context(),
            if cfg.rope_scaling.is_none() {
                " (--rope-scaling yarn --rope-scale F extends it)"
            } else {
                ""
            }
        );
    }
    let kind = match args.backend {
        BackendKind::Auto => match Context::new(&AdapterChoice::Auto) {
            Ok(c) if !c.is_cpu() => match nibble_gpu::weights::check_supported(weights.as_ref()) {
                Ok(_) => BackendKind::Gpu,
                Err(e) => {
                    note!("note: {e}; using the CPU backend");
                    BackendKind::Cpu
                }
            },
            Ok(c) => {
                note!(
                    "note: only a CPU Vulkan adapter ({}) was found; using the CPU backend (--backend gpu forces it)",
                    c.info.name
                );
                BackendKind::Cpu
            }
            Err(e) => {
                note!("note: no GPU adapter ({e}); using the CPU backend");
                BackendKind::Cpu
            }
        },
        k => k,
    };
    let ignored = args.gpu_flags();
    if kind != BackendKind::Gpu && !ignored.is_empty() {
        note!(
            "note: ignored on the CPU backend (GPU only): {}",
            ignored.join(", ")
        );
    }
    let b: Box<dyn Backend> = match kind {
        BackendKind::Gpu => Box::new(make_gpu(args, weights.as_ref(), ctx)?),
        BackendKind::Cpu => Box::new(CpuBackend::with_cache(
            weights,
            ctx,
            args.streams,
            args.cache_type,
        )?),
        _ => Box::new(RefBackend::with_cache(weights, ctx, args.cache_type)?),
    };
    if args.verbose {
        note!(
            "backend: {} (context {ctx} tokens, {} KV cache)",
            b.name(),
            args.cache_type
        );
    }
    Ok(b)
}
