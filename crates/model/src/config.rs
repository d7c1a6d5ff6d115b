//! Qwen3-MoE hyper-parameters, validated once so that later tiers can trust them.

use crate::rope::{rope_table, RopeScaling, RopeTable};
use serde_json::Value;

/// Error naming the config field that is missing or wrong.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("config field `{field}`: {problem}")]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

fn err(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        problem: problem.into(),
    }
}

/// Hyper-parameters of a Qwen3-MoE model (formats-spec §1). All dims are element counts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Qwen3MoeConfig {
    /// H: hidden size (residual stream width).
    pub hidden_size: usize,
    /// L: decoder layers.
    pub num_layers: usize,
    /// Hq: query heads.
    pub num_heads: usize,
    /// Hkv: key/value heads (GQA); `num_heads % num_kv_heads == 0`.
    pub num_kv_heads: usize,
    /// D: per-head dim, always explicit (128 for Qwen3, not hidden/heads).
    pub head_dim: usize,
    /// E: routed experts per layer.
    pub num_experts: usize,
    /// K: experts used per token.
    pub num_experts_per_tok: usize,
    /// I: expert MLP inner size.
    pub moe_intermediate_size: usize,
    /// V: embedding / lm_head rows.
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// A RoPE frequency scaling for contexts beyond the trained one (YaRN, linear); `None` for
    /// the plain rotation of every released Qwen3-MoE config.
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// Renormalise the top-k router weights (true for every released Qwen3-MoE).
    pub norm_topk_prob: bool,
    /// lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// Every id that ends generation (151645 and 151643 for Qwen3).
    pub eos_token_ids: Vec<u32>,
}

impl Qwen3MoeConfig {
    /// The real Qwen3-30B-A3B shapes (formats-spec §1.1).
    pub fn qwen3_30b_a3b() -> Self {
        Qwen3MoeConfig {
            hidden_size: 2048,
            num_layers: 48,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            num_experts: 128,
            num_experts_per_tok: 8,
            moe_intermediate_size: 768,
            vocab_size: 151936,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 40960,
            norm_topk_prob: true,
            tie_word_embeddings: false,
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645, 151643],
        }
    }

    /// A tiny model of the same architecture that runs a token in milliseconds on a CPU; it keeps
    /// the real vocabulary so the real tokenizer works with it.
    pub fn tiny() -> Self {
        Qwen3MoeConfig {
            hidden_size: 64,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
            num_experts: 16,
            num_experts_per_tok: 4,
            moe_intermediate_size: 64,
            max_position_embeddings: 4096,
            ..Self::qwen3_30b_a3b()
        }
    }

    /// A small model whose every matrix row is whole 256-weight super-blocks (so a K-quant mix
    /// applies to all of them, see `synth::QuantMix`), still milliseconds per token on a CPU.
    pub fn small() -> Self {
        Qwen3MoeConfig {
            hidden_size: 256,
            num_layers: 8,
            head_dim: 64,
            moe_intermediate_size: 256,
            ..Self::tiny()
        }
    }

    /// Query projection width `Hq * D`.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Key/value projection width `Hkv * D`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The most positions a KV cache may hold: `max_position_embeddings`, or what a RoPE
    /// scaling reaches ([`RopeScaling::context_limit`]).
    pub fn max_context(&self) -> usize {
        self.rope_scaling.map_or(self.max_position_embeddings, |s| {
            s.context_limit(self.max_position_embeddings)
        })
    }

    /// The rotation every backend applies (`rope_theta` with `rope_scaling`).
    pub fn rope(&self) -> RopeTable {
        rope_table(self.rope_theta, self.rope_scaling, self.head_dim)
    }

    /// Check the invariants every later tier relies on; the error names the bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let dims = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(err(name, "must be > 0"));
            }
            // Guards against absurd values that would overflow size arithmetic downstream.
            if v > 1 << 24 {
                return Err(err(name, format!("{v} is implausibly large")));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{} query heads are not a multiple of {} kv heads",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(err(
                "head_dim",
                format!("{} is odd; RoPE rotates halves", self.head_dim),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(err(
                "num_experts_per_tok",
                format!(
                    "{} > num_experts {}",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(err(
                "rms_norm_eps",
                format!("{} is not a positive number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(err(
                "rope_theta",
                format!("{} is not a number > 1", self.rope_theta),
            ));
        }
        if let Some(s) = self.rope_scaling {
            s.validate("rope_scaling")?;
        }
        Ok(())
    }

    /// Parse a Hugging Face `config.json` (both transformers 4.x and 5.x spellings).
    pub fn from_hf_json(text: &str) -> Result<Self, ConfigError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| err("config.json", format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| err("config.json", "top level is not an object"))?;
        if let Some(mt) = obj.get("model_type").and_then(Value::as_str) {
            if mt != "qwen3_moe" {
                return Err(err("model_type", format!("`{mt}` is not qwen3_moe")));
            }
        }
        let get = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| obj.get(*n).filter(|v| !v.is_null()))
        };
        let usize_of = |names: &[&str]| -> Result<usize, ConfigError> {
            let v = get(names).ok_or_else(|| err(names[0], "missing"))?;
            v.as_u64().map(|x| x as usize).ok_or_else(|| {
                err(
                    names[0],
                    format!("expected a non-negative integer, got {v}"),
                )
            })
        };
        let f32_of = |names: &[&str], default: Option<f32>| -> Result<f32, ConfigError> {
            match get(names) {
                Some(v) => v
                    .as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| err(names[0], format!("expected a number, got {v}"))),
                None => default.ok_or_else(|| err(names[0], "missing")),
            }
        };
        let bool_of = |name: &str, default: bool| -> Result<bool, ConfigError> {
            match get(&[name]) {
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| err(name, format!("expected a boolean, got {v}"))),
                None => Ok(default),
            }
        };
        // transformers 5 moves rope_theta into rope_parameters.
        let rope_theta = match get(&["rope_theta"]) {
            Some(_) => f32_of(&["rope_theta"], None)?,
            None => match obj
                .get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .filter(|v| !v.is_null())
            {
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    err(
                        "rope_parameters",
                        format!("rope_theta: expected a number, got {v}"),
                    )
                })?,
                None => 10_000.0,
            },
        };
        // transformers 4 writes `rope_scaling`; 5 folds it into `rope_parameters` (whose
        // `rope_type` is "default" when there is none).
        let max_position_embeddings = usize_of(&["max_position_embeddings"])?;
        // Both present (a transformers 5 config with Qwen's card's `rope_scaling` added): they
        // must agree, since which one a reader takes differs between readers.
        let read = |field: &str| {
            get(&[field])
                .map(|v| RopeScaling::from_hf(v, max_position_embeddings, field))
                .transpose()
        };
        let rope_scaling = match (read("rope_scaling")?, read("rope_parameters")?) {
            (Some(a), Some(b)) if a != b => {
                let say =
                    |s: Option<RopeScaling>| s.map_or("none".to_string(), |s| format!("{s:?}"));
                return Err(err(
                    "rope_scaling",
                    format!(
                        "{} disagrees with rope_parameters' {}: keep one of them",
                        say(a),
                        say(b)
                    ),
                ));
            }
            (Some(a), _) => a,
            (None, b) => b.flatten(),
        };
        if obj
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(err(
                "mlp_only_layers",
                "dense MLP layers are not supported (no released Qwen3-MoE has them)",
            ));
        }
        if let Some(step) = obj.get("decoder_sparse_step").and_then(Value::as_u64) {
            if step != 1 {
                return Err(err(
                    "decoder_sparse_step",
                    format!("{step}: only 1 (every layer MoE) is supported"),
                ));
            }
        }
        let eos_token_ids = match get(&["eos_token_id"]) {
            None => vec![151645, 151643],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| err("eos_token_id", format!("bad id {x}")))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                let id = v
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| err("eos_token_id", format!("bad id {v}")))?;
                // Qwen3 ends turns with <|im_end|> but also stops on <|endoftext|>.
                let mut ids = vec![id];
                if id == 151645 {
                    ids.push(151643);
                }
                ids
            }
        };
        let cfg = Qwen3MoeConfig {
            hidden_size: usize_of(&["hidden_size"])?,
            num_layers: usize_of(&["num_hidden_layers"])?,
            num_heads: usize_of(&["num_attention_heads"])?,
            num_kv_heads: usize_of(&["num_key_value_heads"])?,
            head_dim: usize_of(&["head_dim"])?,
            num_experts: usize_of(&["num_experts", "num_local_experts"])?,
            num_experts_per_tok: usize_of(&["num_experts_per_tok"])?,
            moe_intermediate_size: usize_of(&["moe_intermediate_size"])?,
            vocab_size: usize_of(&["vocab_size"])?,
            rms_norm_eps: f32_of(&["rms_norm_eps"], Some(1e-6))?,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            norm_topk_prob: bool_of("norm_topk_prob", false)?,
            tie_word_embeddings: bool_of("tie_word_embeddings", false)?,
            bos_token_id: match get(&["bos_token_id"]).and_then(Value::as_u64) {
                Some(x) => {
                    Some(u32::try_from(x).map_err(|_| err("bos_token_id", format!("bad id {x}")))?)
                }
                None => None,
            },
            eos_token_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The Hugging Face `config.json` for this config (what `synth --format safetensors` writes).
    pub fn to_hf_json(&self) -> Value {
        serde_json::json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "decoder_sparse_step": 1,
            "eos_token_id": self.eos_token_ids.first(),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.moe_intermediate_size * self.num_experts_per_tok,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.num_heads,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "output_router_logits": false,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": self.rope_scaling.map(RopeScaling::to_hf),
            "rope_theta": self.rope_theta,
            "router_aux_loss_coef": 0.001,
            "sliding_window": null,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "use_sliding_window": false,
            "vocab_size": self.vocab_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate() {
        Qwen3MoeConfig::qwen3_30b_a3b().validate().unwrap();
        Qwen3MoeConfig::tiny().validate().unwrap();
    }

    #[test]
    fn hf_json_round_trip() {
        let c = Qwen3MoeConfig::qwen3_30b_a3b();
        let back = Qwen3MoeConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn transformers5_spellings() {
        let mut j = Qwen3MoeConfig::tiny().to_hf_json();
        let o = j.as_object_mut().unwrap();
        let e = o.remove("num_experts").unwrap();
        o.insert("num_local_experts".into(), e);
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_theta": 5e6, "rope_type": "default"}),
        );
        let c = Qwen3MoeConfig::from_hf_json(&j.to_string()).unwrap();
        assert_eq!(c.num_experts, 16);
        assert_eq!(c.rope_theta, 5e6);
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: &[(&str, serde_json::Value, &str)] = &[
            (
                "num_key_value_heads",
                serde_json::json!(3),
                "num_key_value_heads",
            ),
            (
                "num_experts_per_tok",
                serde_json::json!(17),
                "num_experts_per_tok",
            ),
            ("hidden_size", serde_json::json!(0), "hidden_size"),
            ("head_dim", serde_json::json!(null), "head_dim"),
            ("head_dim", serde_json::json!("x"), "head_dim"),
            ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
            ("model_type", serde_json::json!("llama"), "model_type"),
            // Ids wider than u32 are refused, not truncated into another id.
            (
                "eos_token_id",
                serde_json::json!(4295061370u64),
                "eos_token_id",
            ),
            (
                "eos_token_id",
                serde_json::json!([151645, 4295061370u64]),
                "eos_token_id",
            ),
            (
                "bos_token_id",
                serde_json::json!(4295061370u64),
                "bos_token_id",
            ),
        ];
        for (field, value, named) in cases {
            let mut j = Qwen3MoeConfig::tiny().to_hf_json();
            j.as_object_mut()
                .unwrap()
                .insert(field.to_string(), value.clone());
            let e = Qwen3MoeConfig::from_hf_json(&j.to_string()).unwrap_err();
            assert_eq!(&e.field, named, "{field}={value}: {e}");
        }
        assert_eq!(
            Qwen3MoeConfig::from_hf_json("{").unwrap_err().field,
            "config.json"
        );
    }
}
