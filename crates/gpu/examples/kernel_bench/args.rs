//! kernel_bench's command line (see the doc comment of kernel_bench.rs for what each flag does).

use clap::{Parser, ValueEnum};
use nibble_gpu::Numerics;

/// Which model shapes the kernels run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Shapes {
    /// Qwen3-30B-A3B's real shapes (a big GPU).
    Full,
    /// The tiny model's (lavapipe).
    Tiny,
}

/// Per-kernel GPU microbenchmark of nibble's decode step.
#[derive(Parser, Debug)]
struct Cli {
    #[arg(long, value_enum, default_value = "full")]
    shapes: Shapes,
    /// Measured passes per row (default 5 at full shapes, 3 at tiny).
    #[arg(long)]
    reps: Option<usize>,
    /// Calls recorded per pass (default 200 at full shapes, 20 at tiny).
    #[arg(long)]
    calls: Option<usize>,
    /// Run-state position (default 512 at full shapes, 64 at tiny).
    #[arg(long)]
    pos: Option<u32>,
    /// Activation numerics of the kernels (f32, precise-int8, int8, bfp24).
    #[arg(long, default_value_t = Numerics::DEFAULT, value_parser = parse_numerics)]
    numerics: Numerics,
    /// Adapter to use, by name (default: the automatic choice).
    #[arg(long)]
    adapter: Option<String>,
    /// JSON on stdout, the table on stderr.
    #[arg(long)]
    json: bool,
    /// Every compiled tile of the multi-column matmul, not only the one it picks.
    #[arg(long)]
    matmul_tiles: bool,
    /// The staged f32 MoE's work-split sweep.
    #[arg(long)]
    moe_tunings: bool,
    /// One copy of every weight, KV cache and MoE route (read from L2 once warm).
    #[arg(long)]
    hot: bool,
    /// Time only the rows whose name contains this or one of its `|`-separated parts.
    #[arg(long)]
    only: Option<String>,
}

fn parse_numerics(s: &str) -> Result<Numerics, String> {
    s.parse()
}

/// Validated command line, defaults filled in.
pub struct Args {
    pub full: bool,
    pub reps: usize,
    pub calls: usize,
    pub pos: u32,
    pub numerics: Numerics,
    pub adapter: Option<String>,
    pub json: bool,
    pub matmul_tiles: bool,
    pub moe_tunings: bool,
    pub hot: bool,
    /// Time only the rows whose name contains this or one of its `|`-separated parts.
    pub only: Option<String>,
}

impl Args {
    pub fn parse() -> anyhow::Result<Args> {
        let c = Cli::parse();
        let full = c.shapes == Shapes::Full;
        let calls = c.calls.unwrap_or(if full { 200 } else { 20 });
        let reps = c.reps.unwrap_or(if full { 5 } else { 3 });
        anyhow::ensure!(calls >= 1 && reps >= 1, "--calls and --reps must be >= 1");
        Ok(Args {
            full,
            reps,
            calls,
            pos: c.pos.unwrap_or(if full { 512 } else { 64 }),
            numerics: c.numerics,
            adapter: c.adapter,
            json: c.json,
            matmul_tiles: c.matmul_tiles,
            moe_tunings: c.moe_tunings,
            hot: c.hot,
            only: c.only,
        })
    }
}
