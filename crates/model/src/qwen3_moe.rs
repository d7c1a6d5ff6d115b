//! Qwen3-MoE checkpoint naming: how GGUF (`qwen3moe`) and Hugging Face names map onto the
//! canonical [`TensorKey`]s, and the two [`WeightSource`]s that serve a model from either file.
//!
//! Both sources check every tensor's presence, dtype and shape against the config when opened,
//! so a later `weight()` call cannot fail on a well-formed model and a broken file is reported
//! once, up front, naming the tensor; a tensor the config does not describe is refused too.

use crate::config::{ConfigError, Qwen3MoeConfig};
use crate::rope::{yarn_default_attention_factor, RopeScaling};
use crate::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use anyhow::{anyhow, bail, Context, Result};
use nibble_formats::gguf::{GgufFile, MetaValue};
use nibble_formats::safetensors::SafetensorsModel;
use nibble_quant::DType;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// GGUF architecture name for Qwen3-MoE.
pub const GGUF_ARCH: &str = "qwen3moe";

/// The GGUF tensor name of `key` (llama.cpp's `qwen3moe` names, formats-spec §3.6).
pub fn gguf_name(key: TensorKey) -> String {
    match key {
        TensorKey::TokenEmbd => "token_embd.weight".into(),
        TensorKey::OutputNorm => "output_norm.weight".into(),
        TensorKey::Output => "output.weight".into(),
        TensorKey::Layer(l, t) => {
            let s = match t {
                LayerTensor::AttnNorm => "attn_norm",
                LayerTensor::AttnQ => "attn_q",
                LayerTensor::AttnK => "attn_k",
                LayerTensor::AttnV => "attn_v",
                LayerTensor::AttnOut => "attn_output",
                LayerTensor::QNorm => "attn_q_norm",
                LayerTensor::KNorm => "attn_k_norm",
                LayerTensor::FfnNorm => "ffn_norm",
                LayerTensor::Router => "ffn_gate_inp",
                LayerTensor::ExpGate => "ffn_gate_exps",
                LayerTensor::ExpUp => "ffn_up_exps",
                LayerTensor::ExpDown => "ffn_down_exps",
            };
            format!("blk.{l}.{s}.weight")
        }
    }
}

/// Hugging Face tensor names of `key`: one name, or one per expert for stacked expert tensors.
pub fn hf_names(key: TensorKey, cfg: &Qwen3MoeConfig) -> Vec<String> {
    match key {
        TensorKey::TokenEmbd => vec!["model.embed_tokens.weight".into()],
        TensorKey::OutputNorm => vec!["model.norm.weight".into()],
        TensorKey::Output => vec!["lm_head.weight".into()],
        TensorKey::Layer(l, t) => {
            let p = format!("model.layers.{l}");
            let one = |s: &str| vec![format!("{p}.{s}.weight")];
            let experts = |s: &str| {
                (0..cfg.num_experts)
                    .map(|e| format!("{p}.mlp.experts.{e}.{s}.weight"))
                    .collect()
            };
            match t {
                LayerTensor::AttnNorm => one("input_layernorm"),
                LayerTensor::AttnQ => one("self_attn.q_proj"),
                LayerTensor::AttnK => one("self_attn.k_proj"),
                LayerTensor::AttnV => one("self_attn.v_proj"),
                LayerTensor::AttnOut => one("self_attn.o_proj"),
                LayerTensor::QNorm => one("self_attn.q_norm"),
                LayerTensor::KNorm => one("self_attn.k_norm"),
                LayerTensor::FfnNorm => one("post_attention_layernorm"),
                LayerTensor::Router => one("mlp.gate"),
                LayerTensor::ExpGate => experts("gate_proj"),
                LayerTensor::ExpUp => experts("up_proj"),
                LayerTensor::ExpDown => experts("down_proj"),
            }
        }
    }
}

/// The module path of `key` in an MLX checkpoint (mlx-lm's names, formats-spec §4.2): the HF
/// name without `.weight`, experts stacked under `mlp.switch_mlp`. The tensors are `{path}.weight`
/// (plus `.scales` and `.biases` when quantised).
pub fn mlx_module(key: TensorKey) -> String {
    match key {
        TensorKey::Layer(
            l,
            t @ (LayerTensor::ExpGate | LayerTensor::ExpUp | LayerTensor::ExpDown),
        ) => {
            let s = match t {
                LayerTensor::ExpGate => "gate_proj",
                LayerTensor::ExpUp => "up_proj",
                _ => "down_proj",
            };
            format!("model.layers.{l}.mlp.switch_mlp.{s}")
        }
        // Every other key has one HF name, `{module}.weight`.
        k => {
            let cfg_free = hf_names(k, &Qwen3MoeConfig::tiny());
            cfg_free[0].trim_end_matches(".weight").to_string()
        }
    }
}

/// Read the config from GGUF `qwen3moe.*` metadata (formats-spec §3.5).
pub fn config_from_gguf(f: &GgufFile) -> Result<Qwen3MoeConfig, ConfigError> {
    let bad = |field: &str, problem: String| ConfigError {
        field: field.to_string(),
        problem,
    };
    match f.get("general.architecture").and_then(MetaValue::as_str) {
        Some(GGUF_ARCH) => {}
        Some(other) => {
            return Err(bad(
                "general.architecture",
                format!("`{other}` is not {GGUF_ARCH}"),
            ))
        }
        None => return Err(bad("general.architecture", "missing".into())),
    }
    let key = |k: &str| format!("{GGUF_ARCH}.{k}");
    let int = |k: &str| -> Result<usize, ConfigError> {
        let name = key(k);
        let v = f.get(&name).ok_or_else(|| bad(&name, "missing".into()))?;
        v.as_u64().map(|x| x as usize).ok_or_else(|| {
            bad(
                &name,
                format!("expected an unsigned integer, got {}", v.type_name()),
            )
        })
    };
    let float = |k: &str, default: f32| -> Result<f32, ConfigError> {
        let name = key(k);
        match f.get(&name) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| bad(&name, format!("expected a float, got {}", v.type_name()))),
        }
    };
    let num_heads = int("attention.head_count")?;
    let hidden_size = int("embedding_length")?;
    // head_dim must be explicit: Qwen3 uses 128 while hidden/heads is 64.
    let head_dim = int("attention.key_length")?;
    let vocab_size = match f.get(&key("vocab_size")).and_then(MetaValue::as_u64) {
        Some(v) => v as usize,
        None => f
            .tensors()
            .iter()
            .find(|t| t.name == "token_embd.weight")
            .and_then(|t| t.shape.first().copied())
            .ok_or_else(|| {
                bad(
                    "token_embd.weight",
                    "missing; cannot infer vocab size".into(),
                )
            })? as usize,
    };
    // A token id wider than u32 is an error, not truncated into some other id.
    let tok_id = |k: &str| -> Result<Option<u32>, ConfigError> {
        match f.get(k).and_then(MetaValue::as_u64) {
            None => Ok(None),
            Some(x) => u32::try_from(x)
                .map(Some)
                .map_err(|_| bad(k, format!("token id {x} does not fit in 32 bits"))),
        }
    };
    let mut eos_token_ids = vec![];
    if let Some(id) = tok_id("tokenizer.ggml.eos_token_id")? {
        eos_token_ids.push(id);
    }
    // Qwen3 generation stops on <|endoftext|> as well (formats-spec §1.10).
    for id in [151645u32, 151643] {
        if id < vocab_size as u32 && !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    let cfg = Qwen3MoeConfig {
        hidden_size,
        num_layers: int("block_count")?,
        num_heads,
        num_kv_heads: int("attention.head_count_kv")?,
        head_dim,
        num_experts: int("expert_count")?,
        num_experts_per_tok: int("expert_used_count")?,
        moe_intermediate_size: int("expert_feed_forward_length")?,
        vocab_size,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-6)?,
        rope_theta: float("rope.freq_base", 10_000.0)?,
        rope_scaling: gguf_rope_scaling(f, int("context_length")?)?,
        max_position_embeddings: int("context_length")?,
        // llama.cpp renormalises the top-k weights for qwen3moe regardless (formats-spec §1.7).
        norm_topk_prob: true,
        tie_word_embeddings: !f.tensors().iter().any(|t| t.name == "output.weight"),
        bos_token_id: tok_id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The RoPE scaling of llama.cpp's `rope.scaling.*` keys (formats-spec §3.5: what
/// `convert_hf_to_gguf.py` writes for a config with YaRN), or of the older `rope.scale_linear`.
/// Keys that would change YaRN in ways not implemented here are refused unless neutral.
fn gguf_rope_scaling(
    f: &GgufFile,
    context_length: usize,
) -> Result<Option<RopeScaling>, ConfigError> {
    let key = |k: &str| format!("{GGUF_ARCH}.rope.{k}");
    let bad = |k: &str, problem: String| ConfigError {
        field: key(k),
        problem,
    };
    let float = |k: &str| -> Result<Option<f32>, ConfigError> {
        match f.get(&key(k)) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| bad(k, format!("expected a float, got {}", v.type_name()))),
        }
    };
    for (k, neutral) in [
        ("scaling.attn_factor", &[1.0f32][..]),
        ("scaling.yarn_attn_factor", &[1.0]),
        ("scaling.yarn_ext_factor", &[1.0, -1.0]),
        ("scaling.yarn_log_multiplier", &[0.0]),
    ] {
        if let Some(v) = float(k)? {
            if !neutral.contains(&v) {
                return Err(bad(k, format!("{v} is not supported (only {neutral:?})")));
            }
        }
    }
    let kind = match f.get(&key("scaling.type")) {
        None => None,
        Some(v) => Some(v.as_str().ok_or_else(|| {
            bad(
                "scaling.type",
                format!("expected a string, got {}", v.type_name()),
            )
        })?),
    };
    let factor = float("scaling.factor")?;
    // llama.cpp reads a factor without a type as linear, and a factor of 0 or 1 as none.
    let factor = factor.or(float("scale_linear")?);
    let scaling = match (kind, factor) {
        (Some("none"), _) | (None, None | Some(0.0) | Some(1.0)) => None,
        (None, Some(factor)) => Some(RopeScaling::Linear { factor }),
        // A factor of 0 is llama.cpp's "none" as well.
        (Some("linear" | "yarn"), None | Some(0.0)) => {
            return Err(bad("scaling.factor", "missing for a scaled rope".into()))
        }
        (Some("linear"), Some(factor)) => Some(RopeScaling::Linear { factor }),
        (Some("yarn"), Some(factor)) => Some(RopeScaling::Yarn {
            factor,
            original_context: match f.get(&key("scaling.original_context_length")) {
                None => context_length,
                Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                    bad(
                        "scaling.original_context_length",
                        format!("expected an unsigned integer, got {}", v.type_name()),
                    )
                })?,
            },
            beta_fast: float("scaling.yarn_beta_fast")?.unwrap_or(32.0),
            beta_slow: float("scaling.yarn_beta_slow")?.unwrap_or(1.0),
            attention_factor: yarn_default_attention_factor(factor),
            truncate: true,
        }),
        (Some(other), _) => {
            return Err(bad(
                "scaling.type",
                format!(
                    "`{other}` is not supported (none, linear and yarn are); ignoring it would \
                     rotate positions differently from the trained model"
                ),
            ))
        }
    };
    if let Some(s) = scaling {
        s.validate(&key("scaling"))?;
    }
    Ok(scaling)
}

/// GGUF metadata describing `cfg` (what llama.cpp's converter writes for qwen3moe).
pub fn gguf_metadata(cfg: &Qwen3MoeConfig, name: &str) -> Vec<(String, MetaValue)> {
    let u = |v: usize| MetaValue::U32(v as u32);
    let k = |s: &str| format!("{GGUF_ARCH}.{s}");
    let mut meta = vec![
        (
            "general.architecture".into(),
            MetaValue::String(GGUF_ARCH.into()),
        ),
        ("general.name".into(), MetaValue::String(name.into())),
        // 2 = MOSTLY_Q4_0 in llama.cpp's file-type enum.
        ("general.file_type".into(), MetaValue::U32(2)),
        ("general.quantization_version".into(), MetaValue::U32(2)),
        (k("block_count"), u(cfg.num_layers)),
        (k("context_length"), u(cfg.max_position_embeddings)),
        (k("embedding_length"), u(cfg.hidden_size)),
        (
            k("feed_forward_length"),
            u(cfg.moe_intermediate_size * cfg.num_experts_per_tok),
        ),
        (k("attention.head_count"), u(cfg.num_heads)),
        (k("attention.head_count_kv"), u(cfg.num_kv_heads)),
        (k("rope.freq_base"), MetaValue::F32(cfg.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(cfg.rms_norm_eps),
        ),
        (k("expert_used_count"), u(cfg.num_experts_per_tok)),
        (k("attention.key_length"), u(cfg.head_dim)),
        (k("attention.value_length"), u(cfg.head_dim)),
        (k("expert_count"), u(cfg.num_experts)),
        (
            k("expert_feed_forward_length"),
            u(cfg.moe_intermediate_size),
        ),
    ];
    match cfg.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            meta.push((k("rope.scaling.type"), MetaValue::String("linear".into())));
            meta.push((k("rope.scaling.factor"), MetaValue::F32(factor)));
        }
        Some(RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast,
            beta_slow,
            ..
        }) => {
            meta.push((k("rope.scaling.type"), MetaValue::String("yarn".into())));
            meta.push((k("rope.scaling.factor"), MetaValue::F32(factor)));
            meta.push((
                k("rope.scaling.original_context_length"),
                u(original_context),
            ));
            if beta_fast != 32.0 {
                meta.push((k("rope.scaling.yarn_beta_fast"), MetaValue::F32(beta_fast)));
            }
            if beta_slow != 1.0 {
                meta.push((k("rope.scaling.yarn_beta_slow"), MetaValue::F32(beta_slow)));
            }
        }
    }
    meta
}

/// Storage types a Qwen3-MoE tensor may have; anything else is refused at open time.
fn allowed(key: TensorKey, dtype: DType) -> bool {
    let is_vector = matches!(
        key,
        TensorKey::OutputNorm
            | TensorKey::Layer(
                _,
                LayerTensor::AttnNorm
                    | LayerTensor::FfnNorm
                    | LayerTensor::QNorm
                    | LayerTensor::KNorm
            )
    );
    // Norms are never quantised (llama.cpp forces F32); every other tensor may be any type.
    !is_vector || !dtype.is_quantized()
}

pub(crate) fn check_view(
    key: TensorKey,
    name: &str,
    dtype: DType,
    shape: &[u64],
    want: &[usize],
) -> Result<()> {
    if shape.len() != want.len() || shape.iter().zip(want).any(|(a, b)| *a != *b as u64) {
        bail!("tensor `{name}` ({key:?}) has shape {shape:?}, expected {want:?} from the config");
    }
    if !allowed(key, dtype) {
        bail!(
            "tensor `{name}` ({key:?}) has type {} which is not allowed for it",
            dtype.name()
        );
    }
    Ok(())
}

/// Refuse a file holding tensors that are not part of the model its metadata describes: such a
/// tensor means the metadata lies (a `block_count` of 3 over four layers of tensors would run
/// three), and llama.cpp and mlx-lm's strict load refuse it too. `used` names every tensor the
/// model reads, plus any the caller drops on purpose.
pub(crate) fn refuse_unused<'a>(
    names: impl IntoIterator<Item = &'a str>,
    used: &HashSet<String>,
    cfg: &Qwen3MoeConfig,
) -> Result<()> {
    let mut unused: Vec<&str> = names.into_iter().filter(|n| !used.contains(*n)).collect();
    if unused.is_empty() {
        return Ok(());
    }
    unused.sort_unstable();
    bail!(
        "{} tensor(s) are not part of the {}-layer, {}-expert model the metadata describes \
         (the metadata and the tensors disagree), first `{}`",
        unused.len(),
        cfg.num_layers,
        cfg.num_experts,
        unused[0]
    )
}

/// A Qwen3-MoE model served from one GGUF file.
pub struct GgufWeights {
    file: GgufFile,
    config: Qwen3MoeConfig,
}

impl GgufWeights {
    /// Parse the config and check every tensor against it.
    pub fn new(file: GgufFile) -> Result<Self> {
        let path = file.path().to_path_buf();
        let config = config_from_gguf(&file).with_context(|| format!("{}", path.display()))?;
        let w = GgufWeights { file, config };
        let mut used = HashSet::new();
        for key in TensorKey::all(&w.config) {
            w.weight(key)
                .with_context(|| format!("{}", path.display()))?;
            used.insert(gguf_name(key));
        }
        let names = w.file.tensors().iter().map(|t| t.name.as_str());
        refuse_unused(names, &used, &w.config).with_context(|| format!("{}", path.display()))?;
        Ok(w)
    }

    /// The underlying file (metadata, tokenizer arrays).
    pub fn file(&self) -> &GgufFile {
        &self.file
    }
}

impl WeightSource for GgufWeights {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    fn weight(&self, key: TensorKey) -> Result<Weight<'_>> {
        let key = match key {
            TensorKey::Output if self.config.tie_word_embeddings => TensorKey::TokenEmbd,
            k => k,
        };
        let name = gguf_name(key);
        let view = self
            .file
            .tensor(&name)
            .ok_or_else(|| anyhow!("missing tensor `{name}`"))?;
        let want = key.shape(&self.config);
        check_view(key, &name, view.dtype, &view.shape, &want)?;
        Ok(Weight {
            dtype: view.dtype,
            shape: want,
            parts: vec![view.data],
        })
    }
}

/// A Qwen3-MoE model served from a Hugging Face directory (config.json + safetensors).
pub struct HfWeights {
    dir: PathBuf,
    model: SafetensorsModel,
    config: Qwen3MoeConfig,
}

impl HfWeights {
    /// Open `dir` (holding config.json and model.safetensors or an index) and check every tensor.
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("{}: cannot read", cfg_path.display()))?;
        let config = Qwen3MoeConfig::from_hf_json(&text)
            .with_context(|| format!("{}", cfg_path.display()))?;
        let model = SafetensorsModel::open(dir)?;
        let w = HfWeights {
            dir: dir.to_path_buf(),
            model,
            config,
        };
        let mut used = HashSet::new();
        for key in TensorKey::all(&w.config) {
            w.weight(key)
                .with_context(|| format!("{}", dir.display()))?;
            used.extend(hf_names(key, &w.config));
        }
        if w.config.tie_word_embeddings {
            // A tied checkpoint may still carry an lm_head: transformers drops it, as nibble does.
            used.extend(hf_names(TensorKey::Output, &w.config));
        }
        refuse_unused(w.model.names(), &used, &w.config)
            .with_context(|| format!("{}", dir.display()))?;
        Ok(w)
    }

    /// The checkpoint directory (tokenizer files live beside the weights).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying safetensors files.
    pub fn model(&self) -> &SafetensorsModel {
        &self.model
    }
}

impl WeightSource for HfWeights {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    fn weight(&self, key: TensorKey) -> Result<Weight<'_>> {
        let key = match key {
            TensorKey::Output if self.config.tie_word_embeddings => TensorKey::TokenEmbd,
            k => k,
        };
        let names = hf_names(key, &self.config);
        let want = key.shape(&self.config);
        // Per-expert tensors are stacked: each part must be one expert's [out, in] matrix.
        let part_shape: &[usize] = if names.len() > 1 { &want[1..] } else { &want };
        let mut parts = Vec::with_capacity(names.len());
        let mut dtype = None;
        for name in &names {
            let view = self
                .model
                .tensor(name)?
                .ok_or_else(|| anyhow!("missing tensor `{name}`"))?;
            check_view(key, name, view.dtype, &view.shape, part_shape)?;
            if *dtype.get_or_insert(view.dtype) != view.dtype {
                bail!(
                    "tensor `{name}` has type {} unlike its sibling experts",
                    view.dtype.name()
                );
            }
            parts.push(view.data);
        }
        Ok(Weight {
            dtype: dtype.expect("at least one name per key"),
            shape: want,
            parts,
        })
    }
}
