//! kernel_bench's command line (see the doc comment of kernel_bench.rs for what each flag does).

use anyhow::{bail, Context as _};
use nibble_gpu::Numerics;

/// Validated command line.
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
        let mut it = std::env::args().skip(1);
        let (mut full, mut json, mut adapter, mut matmul_tiles) = (true, false, None, false);
        let (mut moe_tunings, mut hot, mut only) = (false, false, None);
        let (mut reps, mut calls, mut pos, mut numerics) = (None, None, None, Numerics::DEFAULT);
        while let Some(a) = it.next() {
            let mut val = || it.next().with_context(|| format!("{a} needs a value"));
            match a.as_str() {
                "--shapes" => match val()?.as_str() {
                    "full" => full = true,
                    "tiny" => full = false,
                    s => bail!("--shapes {s}: expected full or tiny"),
                },
                "--reps" => reps = Some(val()?.parse()?),
                "--calls" => calls = Some(val()?.parse()?),
                "--pos" => pos = Some(val()?.parse()?),
                "--numerics" => numerics = val()?.parse().map_err(anyhow::Error::msg)?,
                "--adapter" => adapter = Some(val()?),
                "--json" => json = true,
                "--matmul-tiles" => matmul_tiles = true,
                "--moe-tunings" => moe_tunings = true,
                "--hot" => hot = true,
                "--only" => only = Some(val()?),
                _ => bail!("unknown argument {a} (see the doc comment of kernel_bench.rs)"),
            }
        }
        let calls = calls.unwrap_or(if full { 200 } else { 20 });
        let reps = reps.unwrap_or(if full { 5 } else { 3 });
        anyhow::ensure!(calls >= 1 && reps >= 1, "--calls and --reps must be >= 1");
        let pos = pos.unwrap_or(if full { 512 } else { 64 });
        Ok(Args {
            full,
            reps,
            calls,
            pos,
            numerics,
            adapter,
            json,
            matmul_tiles,
            moe_tunings,
            hot,
            only,
        })
    }
}
