//! `nibble inspect`: describe a model file.

use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file or a Hugging Face directory.
    path: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn gb(b: u64) -> String {
    format!("{:.3} GB", b as f64 / 1e9)
}

pub fn run(a: Args) -> Result<()> {
    let model = nibble_model::loader::open(&a.path)?;
    let info = model.info()?;
    // Building the tokenizer proves the embedded arrays are usable, not merely present.
    let tok_ids = crate::tokenizer::from_model(&model)?.map(|t| t.vocab_size());
    // A failed write (a full disk, a closed stdout) is an error, not a panic.
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&info)?)?;
        return Ok(());
    }
    let c = &info.config;
    writeln!(out, "path           {}", info.path)?;
    writeln!(out, "format         {}", info.format)?;
    writeln!(out, "architecture   {}", info.architecture)?;
    writeln!(
        out,
        "dims           hidden {}  layers {}  heads {}/{} (q/kv)  head_dim {}",
        c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
    )?;
    writeln!(
        out,
        "experts        {} (top {})  expert width {}  vocab {}  context {}",
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.vocab_size,
        c.max_position_embeddings
    )?;
    writeln!(
        out,
        "rope_theta     {}  rms_norm_eps {}{}",
        c.rope_theta,
        c.rms_norm_eps,
        match c.rope_scaling {
            Some(s) => format!("  rope scaling {s} (context up to {})", c.max_context()),
            None => String::new(),
        }
    )?;
    writeln!(out, "tensors        {}", info.tensor_count)?;
    for (t, b) in &info.bytes_per_type {
        writeln!(out, "  {t:<12} {}", gb(*b))?;
    }
    writeln!(
        out,
        "parameters     {} ({:.2} B)",
        info.parameters,
        info.parameters as f64 / 1e9
    )?;
    writeln!(out, "resident       {}", gb(info.resident_bytes))?;
    writeln!(out, "read/token     {}", gb(info.active_bytes_per_token))?;
    match tok_ids {
        Some(n) => writeln!(out, "tokenizer      present ({n} ids)")?,
        None => writeln!(out, "tokenizer      absent")?,
    }
    writeln!(
        out,
        "chat template  {}",
        if info.chat_template {
            "present"
        } else {
            "absent"
        }
    )?;
    Ok(())
}
