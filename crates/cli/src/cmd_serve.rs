//! `nibble serve`: the OpenAI-compatible HTTP server (see the `nibble-server` crate).
//!
//! Loads the model, tokenizer and backend like `generate`, binds (127.0.0.1 by default), prints
//! `listening on http://ADDR` to stderr once the port is bound (port 0 picks a free one), and
//! serves until Ctrl-C.

use crate::backends::{self, BackendArgs};
use anyhow::{Context, Result};
use nibble_server::ServerConfig;
use std::path::PathBuf;

/// Where a chat answer's thinking goes (llama.cpp's `--reasoning-format` names).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// `reasoning_content`.
    Auto,
    /// `content`, as generated.
    None,
}

#[derive(clap::Args)]
pub struct Args {
    /// Model: a .gguf file or a Hugging Face directory.
    #[arg(short, long)]
    model: PathBuf,
    /// Address to bind; anything but loopback exposes the server to the network.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 = any free port; the bound one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests admitted at once. From 2, the GPU backend decodes greedy requests together (one
    /// multi-stream slot each, continuous batching); sampled ones run alone in between.
    #[arg(long, default_value_t = 4)]
    max_streams: usize,
    /// Requests that may wait beyond the admitted ones; more get 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    api_key: Option<String>,
    /// Model id reported by /v1/models (default: the model file's name without extension).
    #[arg(long)]
    model_name: Option<String>,
    /// Chat answers' thinking: `auto` puts a leading `<think>…</think>` block in
    /// `reasoning_content` (as llama.cpp's server does by default); `none` leaves it in
    /// `content`. Tool calls are parsed whenever a request offers tools.
    #[arg(long, value_enum, default_value = "auto")]
    reasoning_format: ReasoningFormat,
    #[command(flatten)]
    backend: BackendArgs,
}

pub fn run(a: Args) -> Result<()> {
    a.backend.check_flags()?;
    // An empty key (`--api-key "$KEY"` with KEY unset) would leave the server open unnoticed.
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        anyhow::bail!("--api-key is empty: give a key, or leave the flag out for no auth");
    }
    if a.model_name.as_deref().is_some_and(|n| n.trim().is_empty()) {
        anyhow::bail!("--model-name is empty: /v1/models would report an id of \"\"");
    }
    if let Some(ctx) = a.backend.ctx.filter(|c| *c < 2) {
        anyhow::bail!("--ctx {ctx} cannot hold a prompt and one generated token");
    }
    let model = crate::backends::open_model(&a.model, &a.backend)?;
    let tok = crate::tokenizer::required(&model)?;
    let mut bargs = a.backend.clone();
    if a.max_streams >= 2 {
        bargs.streams = bargs.streams.max(a.max_streams.min(8));
    }
    let backend = backends::make(&bargs, model.weights.clone())?;
    let model_id = a.model_name.clone().unwrap_or_else(|| {
        a.model
            .file_stem()
            .map_or("nibble".into(), |s| s.to_string_lossy().into_owned())
    });
    let cfg = ServerConfig {
        max_streams: a.max_streams,
        queue: a.queue,
        api_key: a.api_key.clone(),
        model_id,
        reasoning: a.reasoning_format == ReasoningFormat::Auto,
        ..ServerConfig::default()
    };
    let router = nibble_server::app(backend, tok, model.chat_template.as_deref(), cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("cannot bind {}:{}", a.host, a.port))?;
        note!("listening on http://{}", listener.local_addr()?);
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        nibble_server::serve(listener, router, shutdown).await?;
        Ok(())
    })
}
