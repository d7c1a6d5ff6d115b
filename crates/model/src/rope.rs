//! RoPE for contexts beyond the trained one: the frequency scalings a config may ask for
//! (`rope_scaling` in a Hugging Face `config.json`, `rope.scaling.*` in GGUF metadata, or
//! llama.cpp-style flags at start-up), and [`RopeTable`], the one rotation every backend applies.
//!
//! Qwen3-MoE is trained at 32768 positions; Qwen's model card reaches 131072 by *adding* YaRN
//! (`{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}`), which
//! changes the rotation at every position, not only past 32768. A scaling this module does not
//! implement is refused by name: ignoring it would give another model's outputs silently.
//!
//! YaRN (arXiv 2309.00071), as transformers' `_compute_yarn_parameters`, vLLM and llama.cpp
//! compute it: with `f_i = θ^(−2i/D)` the default frequencies, dimensions that turn fewer than
//! `beta_slow` times over the original context are interpolated (`f_i / factor`), those that turn
//! more than `beta_fast` times keep `f_i`, and a linear ramp over the dimension index mixes the
//! two between; both rotated `q` and `k` are multiplied by the attention factor (by default
//! `0.1 ln(factor) + 1`), so the attention scores carry its square. The explicit `factor` is used
//! even where `max_position_embeddings / original_max_position_embeddings` differs from it
//! (transformers' current rule, vLLM's and llama.cpp's; a few transformers 4.5x releases
//! took the ratio instead).

use crate::config::ConfigError;
use serde_json::Value;

/// A RoPE frequency scaling (none is `Option::None` where a config holds one).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f32 },
    /// YaRN; `attention_factor` is resolved when the config is read (explicit, from
    /// `mscale` / `mscale_all_dim`, or the default `0.1 ln(factor) + 1`).
    Yarn {
        factor: f32,
        /// The trained context the ramp is computed over.
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        /// Round the ramp's ends to whole dimensions (transformers' `truncate`, default true;
        /// llama.cpp always does).
        truncate: bool,
    },
}

/// The rotation a backend applies: `inv_freq` `[D/2]` (f32, computed in f64) and the factor
/// that multiplies the rotated `q` and `k` (1 without YaRN).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub inv_freq: Vec<f32>,
    pub attention_factor: f32,
}

impl RopeTable {
    /// The scale of the attention scores: `attention_factor² / sqrt(D)` (a backend that leaves
    /// `q` and `k` unscaled multiplies their dot by this instead).
    pub fn score_scale(&self) -> f32 {
        // In f32 as the kernels always computed `1 / sqrt(D)`: without a scaling the constant
        // stays bit for bit what it was.
        let af = f64::from(self.attention_factor);
        (af * af) as f32 / ((2 * self.inv_freq.len()) as f32).sqrt()
    }
}

/// YaRN's default attention factor for a scale `s` (`mscale` 1): `0.1 · mscale · ln(s) + 1`,
/// 1 for `s <= 1`.
fn yarn_mscale(s: f64, mscale: f64) -> f64 {
    if s <= 1.0 {
        1.0
    } else {
        0.1 * mscale * s.ln() + 1.0
    }
}

/// The default YaRN attention factor for `factor` (what a config that names none gets).
pub fn yarn_default_attention_factor(factor: f32) -> f32 {
    yarn_mscale(f64::from(factor), 1.0) as f32
}

/// The rotation for base `theta`, head size `head_dim` and `scaling`.
pub fn rope_table(theta: f32, scaling: Option<RopeScaling>, head_dim: usize) -> RopeTable {
    let half = head_dim / 2;
    let base = f64::from(theta);
    // f_i = θ^(−2i/D): what HF's float32 `1 / θ^(2i/D)` holds, up to an ulp.
    let default = |i: usize| base.powf(-2.0 * i as f64 / head_dim as f64);
    let (inv_freq, attention_factor) = match scaling {
        None => ((0..half).map(default).collect::<Vec<f64>>(), 1.0),
        Some(RopeScaling::Linear { factor }) => (
            (0..half).map(|i| default(i) / f64::from(factor)).collect(),
            1.0,
        ),
        Some(RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        }) => {
            let d = head_dim as f64;
            // The dimension whose frequency turns `rotations` times over the original context.
            let dim_of = |rotations: f64| {
                d * (original_context as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * base.ln())
            };
            let (mut low, mut high) = (dim_of(f64::from(beta_fast)), dim_of(f64::from(beta_slow)));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, high) = (low.max(0.0), high.min(d - 1.0));
            // Equal ends would divide by zero: HF and llama.cpp widen them by 0.001.
            let width = if high == low { 0.001 } else { high - low };
            let table = (0..half)
                .map(|i| {
                    let ramp = ((i as f64 - low) / width).clamp(0.0, 1.0);
                    // 1 keeps the trained frequency, 0 interpolates fully.
                    let keep = 1.0 - ramp;
                    let f = default(i);
                    f / f64::from(factor) * (1.0 - keep) + f * keep
                })
                .collect();
            (table, attention_factor)
        }
    };
    RopeTable {
        inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
        attention_factor,
    }
}

fn err(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        problem: problem.into(),
    }
}

impl RopeScaling {
    /// The positions a model with this scaling may reach: `factor` times the original context
    /// (YaRN) or times `max_position_embeddings` (linear), and never fewer than the config's own
    /// `max_position_embeddings` (vLLM's rule for its default context).
    pub fn context_limit(self, max_position_embeddings: usize) -> usize {
        let (factor, base) = match self {
            RopeScaling::Linear { factor } => (factor, max_position_embeddings),
            RopeScaling::Yarn {
                factor,
                original_context,
                ..
            } => (factor, original_context),
        };
        ((f64::from(factor) * base as f64) as usize).max(max_position_embeddings)
    }

    /// The scaling's factor.
    pub fn factor(self) -> f32 {
        match self {
            RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } => factor,
        }
    }

    /// Check the numbers every backend relies on; the error names `field`.
    pub fn validate(self, field: &str) -> Result<(), ConfigError> {
        let factor = self.factor();
        if !(factor.is_finite() && (1.0..=1024.0).contains(&factor)) {
            return Err(err(field, format!("factor {factor} is not in [1, 1024]")));
        }
        if let RopeScaling::Yarn {
            original_context,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        } = self
        {
            if original_context == 0 || original_context > 1 << 24 {
                return Err(err(
                    field,
                    format!("original context {original_context} is not in [1, 2^24]"),
                ));
            }
            for (name, v) in [("beta_fast", beta_fast), ("beta_slow", beta_slow)] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(err(field, format!("{name} {v} is not a positive number")));
                }
            }
            // Real ones are near 1 (0.1 ln(factor) + 1, or a ratio of two such); the scores
            // carry its square, which overflows f32 from ~1.8e19.
            if !(attention_factor.is_finite() && (1.0 / 64.0..=64.0).contains(&attention_factor)) {
                return Err(err(
                    field,
                    format!("attention factor {attention_factor} is not in [1/64, 64]"),
                ));
            }
        }
        Ok(())
    }

    /// Read a Hugging Face `rope_scaling` (or transformers 5's `rope_parameters`) object;
    /// `None` for the default rotation. `field` names it in errors.
    pub fn from_hf(
        v: &Value,
        max_position_embeddings: usize,
        field: &str,
    ) -> Result<Option<Self>, ConfigError> {
        let o = match v {
            Value::Null => return Ok(None),
            Value::Object(o) => o,
            other => return Err(err(field, format!("expected an object, got {other}"))),
        };
        let get = |k: &str| o.get(k).filter(|x| !x.is_null());
        let kind = match get("rope_type").or_else(|| get("type")) {
            // A factor with no type says nothing about how to scale: refused, not dropped.
            None if get("factor").is_some() => {
                return Err(err(field, "a factor but no rope_type (linear or yarn?)"))
            }
            None => return Ok(None),
            Some(Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(err(
                    field,
                    format!("rope_type: expected a string, got {other}"),
                ))
            }
        };
        let num = |k: &str| -> Result<Option<f64>, ConfigError> {
            match get(k) {
                None => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(field, format!("{k}: expected a number, got {x}"))),
            }
        };
        let factor = || -> Result<f32, ConfigError> {
            num("factor")?
                .map(|f| f as f32)
                .ok_or_else(|| err(field, format!("rope type `{kind}` needs a factor")))
        };
        let scaling = match kind {
            "default" => return Ok(None),
            "linear" => RopeScaling::Linear { factor: factor()? },
            "yarn" => {
                let factor = factor()?;
                let original_context = match get("original_max_position_embeddings") {
                    None => max_position_embeddings,
                    // transformers takes an integral float too (1024.0).
                    Some(x) => (x.as_u64().or_else(|| {
                        x.as_f64()
                            .filter(|f| f.fract() == 0.0 && (1.0..=16_777_216.0).contains(f))
                            .map(|f| f as u64)
                    }))
                    .map(|x| x as usize)
                    .ok_or_else(|| {
                        err(
                            field,
                            format!(
                                "original_max_position_embeddings: expected an integer, got {x}"
                            ),
                        )
                    })?,
                };
                // `beta_fast or 32`: transformers takes a 0 for the default too.
                let beta = |k: &str, default: f32| -> Result<f32, ConfigError> {
                    Ok(num(k)?.filter(|&b| b != 0.0).map_or(default, |b| b as f32))
                };
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None => {
                        let f = f64::from(factor);
                        match (num("mscale")?, num("mscale_all_dim")?) {
                            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                                yarn_mscale(f, m) / yarn_mscale(f, all)
                            }
                            _ => yarn_mscale(f, 1.0),
                        }
                    }
                };
                let truncate = match get("truncate") {
                    None => true,
                    Some(x) => x.as_bool().ok_or_else(|| {
                        err(field, format!("truncate: expected a boolean, got {x}"))
                    })?,
                };
                RopeScaling::Yarn {
                    factor,
                    original_context,
                    beta_fast: beta("beta_fast", 32.0)?,
                    beta_slow: beta("beta_slow", 1.0)?,
                    attention_factor: attention_factor as f32,
                    truncate,
                }
            }
            other => {
                return Err(err(
                    field,
                    format!(
                        "rope type `{other}` is not supported (default, linear and yarn are); \
                         ignoring it would rotate positions differently from the trained model"
                    ),
                ))
            }
        };
        scaling.validate(field)?;
        Ok(Some(scaling))
    }

    /// The `rope_scaling` object of a Hugging Face config for this scaling (what `synth` writes).
    pub fn to_hf(self) -> Value {
        match self {
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let mut v = serde_json::json!({
                    "rope_type": "yarn",
                    "factor": factor,
                    "original_max_position_embeddings": original_context,
                });
                let o = v.as_object_mut().expect("an object");
                // Only what differs from the defaults, as real configs write it.
                if beta_fast != 32.0 {
                    o.insert("beta_fast".into(), beta_fast.into());
                }
                if beta_slow != 1.0 {
                    o.insert("beta_slow".into(), beta_slow.into());
                }
                if attention_factor != yarn_default_attention_factor(factor) {
                    o.insert("attention_factor".into(), attention_factor.into());
                }
                if !truncate {
                    o.insert("truncate".into(), false.into());
                }
                v
            }
        }
    }
}

impl std::fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RopeScaling::Linear { factor } => write!(f, "linear x{factor}"),
            RopeScaling::Yarn {
                factor,
                original_context,
                attention_factor,
                ..
            } => write!(
                f,
                "yarn x{factor} over {original_context} positions (attention factor {attention_factor})"
            ),
        }
    }
}
