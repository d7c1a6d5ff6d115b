//! `nibble perplexity`: the model's perplexity on a text file, by llama.cpp's `llama-perplexity`
//! protocol (windows of `--ctx` tokens from an empty cache, the second half of each scored;
//! engine score.rs), so the figures compare with llama.cpp's for the same model and text. Each
//! window is one batched prefill whose every row goes through the lm_head
//! (`Backend::prefill_rows`). Running estimates go to stderr as llama.cpp prints them
//! (`[1]8.1234,[2]...`), the result to stdout.

use crate::backends::{self, BackendArgs};
use anyhow::{bail, Context, Result};
use nibble_engine::score::{score_window, Perplexity};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Window length when `--ctx` is not given (llama.cpp's perplexity figures are mostly quoted
/// at `-c 512`).
const DEFAULT_WINDOW: usize = 512;

#[derive(clap::Args)]
#[command(
    after_help = "Here --ctx is the window length (default 512): each window is scored from an \
                  empty KV cache of that many positions, the last half of its tokens counted."
)]
pub struct Args {
    /// Model: a .gguf file, a Hugging Face or MLX directory.
    #[arg(short, long)]
    model: PathBuf,
    /// The text to score (UTF-8), e.g. wikitext-2's `wiki.test.raw`.
    #[arg(short = 'f', long)]
    file: PathBuf,
    /// Score at most this many windows (default: every whole window of the text).
    #[arg(long)]
    chunks: Option<usize>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// `--ctx` is the window length here (see `after_help`).
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Serialize, Debug)]
struct Report {
    backend: String,
    /// Tokens per window.
    ctx: usize,
    windows: usize,
    text_tokens: usize,
    scored_tokens: usize,
    ppl: f64,
    ppl_err: f64,
    /// Mean negative log-likelihood per scored token (nats).
    mean_nll: f64,
    /// Share of scored tokens that were the model's argmax.
    top1: f64,
    /// The first window alone (warm-up: pipelines compiled, buffers bound) and the rest.
    first_window_secs: f64,
    rest_secs: f64,
    /// Window tokens per second after the first window (`None` with one window).
    steady_tok_per_s: Option<f64>,
}

pub fn run(a: Args) -> Result<()> {
    a.backend.check_flags()?;
    if a.chunks == Some(0) {
        bail!("--chunks must be at least 1");
    }
    let window = a.backend.ctx.unwrap_or(DEFAULT_WINDOW);
    if window < 3 {
        bail!("--ctx {window}: a window needs at least 3 tokens to score one");
    }
    let model = crate::backends::open_model(&a.model, &a.backend)?;
    let Some(tok) = crate::tokenizer::from_model(&model)? else {
        bail!(
            "{}: the model carries no tokenizer, and perplexity scores text",
            a.model.display()
        );
    };
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("--file {}: cannot read it as UTF-8 text", a.file.display()))?;
    // In pieces of about 1 MiB: tokenizing a corpus whole took ~500 bytes of memory a token.
    let tokens = tok.encode_long(&text, 1 << 20)?;
    let whole = tokens.len() / window;
    if whole == 0 {
        bail!(
            "--file {}: {} tokens, fewer than one window of --ctx {window}",
            a.file.display(),
            tokens.len()
        );
    }
    let windows = a.chunks.map_or(whole, |c| c.min(whole));
    let mut args = a.backend.clone();
    args.ctx = Some(window);
    let mut backend = backends::make(&args, model.weights.clone())?;
    let first = window / 2;
    note!(
        "perplexity: {} tokens, {windows} windows of {window} (scoring the last {} of each) on {}",
        tokens.len(),
        window - 1 - first,
        backend.name()
    );
    let mut acc = Perplexity::default();
    let mut times = Vec::with_capacity(windows);
    let mut err = std::io::stderr();
    for (w, chunk) in tokens.chunks_exact(window).take(windows).enumerate() {
        let t0 = Instant::now();
        score_window(backend.as_mut(), chunk, first, &mut acc)
            .with_context(|| format!("window {}", w + 1))?;
        times.push(t0.elapsed().as_secs_f64());
        let _ = write!(err, "[{}]{:.4},", w + 1, acc.ppl());
        let _ = err.flush();
    }
    let _ = writeln!(err);
    // A fold from +0.0: an empty `sum()` of floats is -0.0.
    let rest = times[1..].iter().fold(0.0, |a, t| a + t);
    let report = Report {
        backend: backend.name(),
        ctx: window,
        windows,
        text_tokens: tokens.len(),
        scored_tokens: acc.count,
        ppl: acc.ppl(),
        ppl_err: acc.ppl_err(),
        mean_nll: acc.mean_nll(),
        top1: acc.top1_rate(),
        first_window_secs: times[0],
        rest_secs: rest,
        steady_tok_per_s: (windows > 1).then(|| ((windows - 1) * window) as f64 / rest),
    };
    let mut out = std::io::stdout();
    if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        writeln!(
            out,
            "PPL = {:.4} +/- {:.4} ({} tokens scored in {} windows of {}; top-1 {:.2}%)",
            report.ppl,
            report.ppl_err,
            report.scored_tokens,
            windows,
            window,
            100.0 * report.top1
        )?;
        let steady = report
            .steady_tok_per_s
            .map_or(String::new(), |r| format!(", then {r:.1} tok/s"));
        writeln!(
            out,
            "time: first window {:.2} s (warm-up){steady}",
            report.first_window_secs
        )?;
    }
    Ok(())
}
