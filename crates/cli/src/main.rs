//! The `nibble` command: argument parsing and glue over the library tiers. No model or format
//! logic lives here; each subcommand is one small module.

mod cmd_inspect;
mod cmd_synth;
mod tokenizer;

use clap::{Parser, Subcommand};

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
    /// Describe a model file: architecture, dims, tensors, bytes per type, parameters.
    Inspect(cmd_inspect::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Synth(a) => cmd_synth::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
