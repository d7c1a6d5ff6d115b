//! `nibble synth`: write a synthetic Qwen3-MoE model (GGUF or safetensors).

use anyhow::{bail, Result};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::synth::{self, SynthParams};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Preset {
    /// hidden 64, 4 layers, 16 experts (top 4), head_dim 32, real vocab: milliseconds per token on CPU.
    Tiny,
    /// hidden 256, 8 layers, 16 experts (top 4), head_dim 64, real vocab: every matrix row whole
    /// 256-weight super-blocks, for `--quant q4_k_m`, `q5_k_m`, `q4_k` and `q6_k`.
    Small,
    /// The real Qwen3-30B-A3B shapes (~17 GB in Q4_0).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum Quant {
    /// Q4_0 matrices (llama.cpp's Q4_0 files).
    #[value(name = "q4_0")]
    Q4_0,
    /// Q4_K with Q6_K for the lm_head and some attn_v / ffn_down_exps, as llama.cpp's Q4_K_M
    /// (GGUF only; rows that are not whole 256-weight super-blocks stay Q4_0).
    #[value(name = "q4_k_m")]
    Q4KM,
    /// Q8_0 matrices holding exactly the q4_0 model's values of the same seed (llama.cpp's
    /// Q8_0 files); with `--format mlx`, 8-bit MLX groups of those values.
    #[value(name = "q8_0")]
    Q8_0,
    /// Q6_K matrices, as llama.cpp's Q6_K files (GGUF only; rows that are not whole
    /// 256-weight super-blocks stay Q4_0).
    #[value(name = "q6_k")]
    Q6K,
    /// Q4_K matrices with no mixture, as `llama-quantize --pure` writes Q4_K_M (GGUF only; rows
    /// that are not whole 256-weight super-blocks stay Q4_0).
    #[value(name = "q4_k")]
    Q4K,
    /// Q5_K with Q6_K for the lm_head and some attn_v / ffn_down_exps, as llama.cpp's Q5_K_M
    /// (GGUF only; rows that are not whole 256-weight super-blocks stay Q4_0).
    #[value(name = "q5_k_m")]
    Q5KM,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum Format {
    Gguf,
    Safetensors,
    /// An MLX checkpoint directory (mlx-lm's layout): 4-bit groups of 64 (8-bit with `--quant
    /// q8_0`), the routers at 8 bits.
    Mlx,
}

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value = "tiny")]
    preset: Preset,
    #[arg(long, value_enum, default_value = "gguf")]
    format: Format,
    /// Storage types of the weight matrices.
    #[arg(long, value_enum, default_value = "q4_0")]
    quant: Quant,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Std of the logits: larger gives wider greedy top-1 margins.
    #[arg(long, default_value_t = SynthParams::default().logit_scale)]
    logit_scale: f32,
    /// A Hugging Face tokenizer.json to embed (GGUF) or copy beside the weights (safetensors);
    /// tokenizer_config.json next to it supplies the chat template.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output: a .gguf file, or a directory for safetensors and mlx.
    #[arg(short, long)]
    output: PathBuf,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
    /// A RoPE scaling written into the model's config (e.g. `--rope-scaling yarn --rope-scale 4
    /// --yarn-orig-ctx 1024`), as a config.json with `rope_scaling` or a GGUF converted from one.
    #[command(flatten)]
    rope: crate::rope_args::RopeArgs,
}

pub fn run(a: Args) -> Result<()> {
    let mut cfg = match a.preset {
        Preset::Tiny => Qwen3MoeConfig::tiny(),
        Preset::Small => Qwen3MoeConfig::small(),
        Preset::Qwen3_30bA3b => Qwen3MoeConfig::qwen3_30b_a3b(),
    };
    cfg.rope_scaling = a.rope.resolve(&cfg)?;
    cfg.validate()?;
    // The logits' std: past 1000 no greedy margin grows, and far past it the lm_head's block
    // scales overflow f16 (a 1e30 wrote infinities).
    if !(a.logit_scale > 0.0 && a.logit_scale <= 1000.0) {
        bail!(
            "--logit-scale {} must be a number in (0, 1000]: it is the logits' standard deviation",
            a.logit_scale
        );
    }
    let params = SynthParams {
        seed: a.seed,
        logit_scale: a.logit_scale,
        mix: match a.quant {
            Quant::Q4_0 => synth::QuantMix::Q4_0,
            Quant::Q4KM => synth::QuantMix::Q4KM,
            Quant::Q8_0 => synth::QuantMix::Q8_0,
            Quant::Q6K => synth::QuantMix::Q6K,
            Quant::Q4K => synth::QuantMix::Q4K,
            Quant::Q5KM => synth::QuantMix::Q5KM,
        },
        ..SynthParams::default()
    };
    let t0 = Instant::now();
    match a.format {
        Format::Gguf => {
            let tok = match &a.tokenizer {
                Some(p) => Some(crate::tokenizer::gguf_meta(p, cfg.vocab_size)?),
                None => None,
            };
            synth::write_gguf(&cfg, &params, tok.as_ref(), &a.output, a.quiet)?;
        }
        Format::Safetensors | Format::Mlx => {
            if a.format == Format::Mlx {
                synth::write_mlx(&cfg, &params, &a.output, a.quiet)?;
            } else {
                synth::write_safetensors(&cfg, &params, &a.output, a.quiet)?;
            }
            if let Some(p) = &a.tokenizer {
                copy_tokenizer(p, &a.output)?;
            }
        }
    }
    // A failed write to stderr is not worth a panic: the file is written.
    let _ = writeln!(
        std::io::stderr(),
        "wrote {} ({:?}, seed {}) in {:.1} s",
        a.output.display(),
        a.preset,
        a.seed,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn copy_tokenizer(tokenizer_json: &std::path::Path, dir: &std::path::Path) -> Result<()> {
    std::fs::copy(tokenizer_json, dir.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{}: {e}", tokenizer_json.display()))?;
    let cfg = tokenizer_json.with_file_name("tokenizer_config.json");
    if cfg.is_file() {
        std::fs::copy(&cfg, dir.join("tokenizer_config.json"))?;
    }
    Ok(())
}
