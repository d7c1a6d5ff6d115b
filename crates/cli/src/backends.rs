//! Backend selection, done once at start-up (`--backend ref|gpu`).

use anyhow::Result;
use nibble_backend::reference::RefBackend;
use nibble_backend::Backend;
use nibble_model::weights::WeightSource;
use std::sync::Arc;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The plain reference forward pass on the CPU (the oracle).
    Ref,
}

/// Flags shared by every command that runs a model.
#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// Which backend decodes.
    #[arg(long, value_enum, default_value = "ref")]
    pub backend: BackendKind,
    /// KV-cache capacity in tokens (default: the model's context, capped at 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Print what runs (backend, kernel variants, memory).
    #[arg(short, long)]
    pub verbose: bool,
}

/// Build the chosen backend over `weights`.
pub fn make(args: &BackendArgs, weights: Arc<dyn WeightSource>) -> Result<Box<dyn Backend>> {
    let cfg = weights.config().clone();
    let ctx = args.ctx.unwrap_or(cfg.max_position_embeddings.min(4096));
    if ctx == 0 || ctx > cfg.max_position_embeddings {
        anyhow::bail!(
            "--ctx {ctx} must be between 1 and the model's context of {}",
            cfg.max_position_embeddings
        );
    }
    let b: Box<dyn Backend> = match args.backend {
        BackendKind::Ref => Box::new(RefBackend::new(weights, ctx)?),
    };
    if args.verbose {
        eprintln!("backend: {} (context {ctx} tokens)", b.name());
    }
    Ok(b)
}
