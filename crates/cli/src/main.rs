//! The `nibble` command: argument parsing and glue over the library tiers. No model or format
//! logic lives here; each subcommand is one small module.

/// `eprintln!` that ignores a failed write: a note on a stderr that cannot be written (a
/// closed pipe, a full disk) must not panic the command (`eprintln!` does).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod backends;
mod cmd_bench;
mod cmd_chat;
mod cmd_generate;
mod cmd_inspect;
mod cmd_parity;
mod cmd_perplexity;
mod cmd_serve;
mod cmd_synth;
mod plot;
mod prefill_trace;
mod rope_args;
mod sampling_args;
mod tokenizer;

use clap::{Parser, Subcommand};
use std::io::Write;

/// nibble: fast single-stream decoding of Qwen3-MoE models from 4-bit weights.
#[derive(Parser)]
#[command(name = "nibble", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic model with the exact Qwen3-MoE architecture and seeded random weights.
    Synth(cmd_synth::Args),
    /// Generate text from a prompt, streamed to stdout; a summary line goes to stderr.
    Generate(cmd_generate::Args),
    /// Interactive multi-turn chat (one user message per stdin line); the KV cache is kept between turns.
    Chat(cmd_chat::Args),
    /// Measure prompt-processing and generation speed (median and min-max over repetitions).
    Bench(cmd_bench::Args),
    /// Compare a fast backend with the oracle: greedy sequences, logits cosine, first divergence.
    Parity(cmd_parity::Args),
    /// The model's perplexity on a text file (llama.cpp's protocol: windows of --ctx tokens,
    /// 512 by default, each from an empty cache, the second half of each scored).
    Perplexity(cmd_perplexity::Args),
    /// OpenAI-compatible HTTP server (chat/completions, SSE streaming, /metrics).
    Serve(cmd_serve::Args),
    /// Describe a model file: architecture, dims, tensors, bytes per type, parameters.
    Inspect(cmd_inspect::Args),
}

/// A report (`inspect`, `bench`, `parity`) piped into `head` and the like ends quietly when
/// the reader goes away, as Unix tools do: Rust starts with SIGPIPE ignored, which turns the
/// closed pipe into a panic inside `println!`. `generate` and `chat` see the write error
/// themselves (they stop decoding and print their summary); `synth` writes only progress to
/// stderr, and a closed stderr must not cut a model file short; the server keeps SIGPIPE
/// ignored, since a client closing its connection must not end the process.
#[cfg(unix)]
fn default_sigpipe() {
    // SAFETY: called in `main` right after argument parsing, before any other thread exists
    // (the backends and rayon start later); SIG_DFL is a valid disposition for SIGPIPE and no
    // handler of ours is replaced.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    #[cfg(unix)]
    if matches!(
        cli.command,
        Command::Inspect(_) | Command::Bench(_) | Command::Parity(_) | Command::Perplexity(_)
    ) {
        default_sigpipe();
    }
    let result = match cli.command {
        Command::Synth(a) => cmd_synth::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Generate(a) => cmd_generate::run(a),
        Command::Chat(a) => cmd_chat::run(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::Parity(a) => cmd_parity::run(a),
        Command::Perplexity(a) => cmd_perplexity::run(a),
        Command::Serve(a) => cmd_serve::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // A failed write to stderr is not worth a panic: the exit status still tells.
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
