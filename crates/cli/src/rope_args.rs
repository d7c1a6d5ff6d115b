//! llama.cpp's RoPE scaling flags (`--rope-scaling`, `--rope-scale`, `--yarn-orig-ctx`): what a
//! user gives to run Qwen3 past its trained 32768 positions (Qwen's model card for llama.cpp:
//! `--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768`), overriding the model file's
//! own scaling; `nibble synth` takes the same flags to write one into a file.

use anyhow::{bail, Result};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::rope::{yarn_default_attention_factor, RopeScaling};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// The plain rotation (drops the file's scaling).
    None,
    /// Position interpolation: every frequency divided by --rope-scale.
    Linear,
    /// YaRN over --yarn-orig-ctx positions, as Qwen's model card enables 131072 tokens.
    Yarn,
}

#[derive(clap::Args, Clone, Debug, Default)]
pub struct RopeArgs {
    /// RoPE scaling, overriding the model file's (llama.cpp's flag): none, linear or yarn
    /// (with --rope-scale; default: the file's own).
    #[arg(long, value_enum)]
    pub rope_scaling: Option<RopeKind>,
    /// The RoPE scaling's factor: the context grows by it (e.g. 4 with YaRN: 32768 -> 131072).
    #[arg(long)]
    pub rope_scale: Option<f32>,
    /// YaRN: the trained context the scaling extends (default: the file's, else the model's
    /// context; Qwen3's is 32768).
    #[arg(long)]
    pub yarn_orig_ctx: Option<usize>,
}

impl RopeArgs {
    /// Whether any flag was given.
    pub fn given(&self) -> bool {
        self.rope_scaling.is_some() || self.rope_scale.is_some() || self.yarn_orig_ctx.is_some()
    }

    /// The scaling `cfg` runs with under these flags (checked: the error names the flag).
    pub fn resolve(&self, cfg: &Qwen3MoeConfig) -> Result<Option<RopeScaling>> {
        let file = cfg.rope_scaling;
        let kind = match (self.rope_scaling, file) {
            (Some(k), _) => k,
            (None, Some(RopeScaling::Linear { .. })) => RopeKind::Linear,
            (None, Some(RopeScaling::Yarn { .. })) => RopeKind::Yarn,
            (None, None) if self.given() => bail!(
                "--rope-scale / --yarn-orig-ctx need --rope-scaling linear|yarn: the model has no \
                 RoPE scaling of its own"
            ),
            (None, None) => return Ok(None),
        };
        if kind == RopeKind::None {
            if self.rope_scale.is_some() || self.yarn_orig_ctx.is_some() {
                bail!("--rope-scaling none takes no --rope-scale or --yarn-orig-ctx");
            }
            return Ok(None);
        }
        if kind == RopeKind::Linear && self.yarn_orig_ctx.is_some() {
            bail!("--yarn-orig-ctx applies to --rope-scaling yarn only");
        }
        let factor = match (self.rope_scale, file) {
            (Some(f), _) => f,
            (None, Some(s)) if same_kind(kind, s) => s.factor(),
            (None, _) => bail!(
                "--rope-scaling {} needs --rope-scale (the factor)",
                if kind == RopeKind::Linear {
                    "linear"
                } else {
                    "yarn"
                }
            ),
        };
        if !(factor.is_finite() && (1.0..=1024.0).contains(&factor)) {
            bail!("--rope-scale {factor} must be a number in [1, 1024]");
        }
        let scaling = match kind {
            RopeKind::Linear => RopeScaling::Linear { factor },
            _ => {
                let from_file = match file {
                    Some(RopeScaling::Yarn {
                        original_context, ..
                    }) => Some(original_context),
                    _ => None,
                };
                let original_context = self
                    .yarn_orig_ctx
                    .or(from_file)
                    .unwrap_or(cfg.max_position_embeddings);
                if original_context == 0 || original_context > 1 << 24 {
                    bail!("--yarn-orig-ctx {original_context} must be in [1, 2^24]");
                }
                match file {
                    // The file's own YaRN keeps its betas; its attention factor follows a new
                    // factor only where the file left it at the default.
                    Some(RopeScaling::Yarn {
                        factor: old,
                        beta_fast,
                        beta_slow,
                        attention_factor,
                        truncate,
                        ..
                    }) => RopeScaling::Yarn {
                        factor,
                        original_context,
                        beta_fast,
                        beta_slow,
                        attention_factor: if attention_factor == yarn_default_attention_factor(old)
                        {
                            yarn_default_attention_factor(factor)
                        } else {
                            attention_factor
                        },
                        truncate,
                    },
                    _ => RopeScaling::Yarn {
                        factor,
                        original_context,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        attention_factor: yarn_default_attention_factor(factor),
                        truncate: true,
                    },
                }
            }
        };
        Ok(Some(scaling))
    }
}

fn same_kind(kind: RopeKind, s: RopeScaling) -> bool {
    matches!(
        (kind, s),
        (RopeKind::Linear, RopeScaling::Linear { .. }) | (RopeKind::Yarn, RopeScaling::Yarn { .. })
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(kind: Option<RopeKind>, scale: Option<f32>, orig: Option<usize>) -> RopeArgs {
        RopeArgs {
            rope_scaling: kind,
            rope_scale: scale,
            yarn_orig_ctx: orig,
        }
    }

    #[test]
    fn flags_resolve_as_llama_cpp_reads_them() {
        let plain = Qwen3MoeConfig::qwen3_30b_a3b();
        assert_eq!(args(None, None, None).resolve(&plain).unwrap(), None);
        let yarn = args(Some(RopeKind::Yarn), Some(4.0), Some(32768))
            .resolve(&plain)
            .unwrap()
            .unwrap();
        assert_eq!(
            yarn,
            RopeScaling::Yarn {
                factor: 4.0,
                original_context: 32768,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: yarn_default_attention_factor(4.0),
                truncate: true,
            }
        );
        assert_eq!(yarn.context_limit(40960), 131072);
        // Without --yarn-orig-ctx: the model's context, as llama.cpp's n_ctx_train.
        let y = args(Some(RopeKind::Yarn), Some(2.0), None)
            .resolve(&plain)
            .unwrap()
            .unwrap();
        assert_eq!(y.context_limit(40960), 81920);
        // A file with YaRN: a new factor keeps its original context; none drops it.
        let mut file = plain.clone();
        file.rope_scaling = Some(yarn);
        let y = args(None, Some(2.0), None).resolve(&file).unwrap().unwrap();
        assert!(matches!(
            y,
            RopeScaling::Yarn { factor: 2.0, original_context: 32768, attention_factor, .. }
                if attention_factor == yarn_default_attention_factor(2.0)
        ));
        assert_eq!(args(None, None, None).resolve(&file).unwrap(), Some(yarn));
        assert_eq!(
            args(Some(RopeKind::None), None, None)
                .resolve(&file)
                .unwrap(),
            None
        );
        assert_eq!(
            args(Some(RopeKind::Linear), Some(2.0), None)
                .resolve(&plain)
                .unwrap(),
            Some(RopeScaling::Linear { factor: 2.0 })
        );
    }

    #[test]
    fn bad_flags_are_named() {
        let plain = Qwen3MoeConfig::qwen3_30b_a3b();
        for (a, named) in [
            (args(None, Some(4.0), None), "--rope-scaling"),
            (args(Some(RopeKind::Yarn), None, None), "--rope-scale"),
            (args(Some(RopeKind::Yarn), Some(0.5), None), "--rope-scale"),
            (
                args(Some(RopeKind::Yarn), Some(f32::NAN), None),
                "--rope-scale",
            ),
            (
                args(Some(RopeKind::Yarn), Some(4.0), Some(0)),
                "--yarn-orig-ctx",
            ),
            (
                args(Some(RopeKind::Linear), Some(4.0), Some(10)),
                "--yarn-orig-ctx",
            ),
            (
                args(Some(RopeKind::None), Some(4.0), None),
                "--rope-scaling none",
            ),
        ] {
            let e = a.resolve(&plain).unwrap_err().to_string();
            assert!(e.contains(named), "{a:?}: {e}");
        }
    }
}
