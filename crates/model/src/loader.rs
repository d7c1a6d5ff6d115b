//! Opening a model from a path, whatever its format, and describing it (`nibble inspect`).
//!
//! A path ending in `.gguf` (or starting with the GGUF magic) is a GGUF file; a directory, or a
//! `.safetensors` file inside one, is a Hugging Face checkpoint with `config.json` beside it, or
//! an MLX one when its config has a `quantization` object (or its files say `"format": "mlx"`).

use crate::config::Qwen3MoeConfig;
use crate::qwen3_moe::{GgufWeights, HfWeights};
use crate::rope::RopeScaling;
use crate::weights::{LayerTensor, Reconfigured, TensorKey, WeightSource};
use anyhow::{bail, Context, Result};
use nibble_formats::gguf::{GgufFile, MetaValue};
use nibble_formats::safetensors::SafetensorsModel;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a model's tokenizer and chat template come from.
#[derive(Debug, Clone)]
pub enum TokenizerSource {
    /// `tokenizer.json` (+ optional `tokenizer_config.json`) in a directory.
    HfDir(PathBuf),
    /// `tokenizer.ggml.*` arrays inside the GGUF.
    Gguf {
        /// `tokenizer.ggml.model` ("gpt2") and `tokenizer.ggml.pre` ("qwen2").
        model: String,
        pre: String,
        tokens: Vec<String>,
        token_types: Vec<i32>,
        merges: Vec<String>,
        eos: Option<u32>,
        bos: Option<u32>,
        pad: Option<u32>,
    },
    /// None found.
    Absent,
}

/// An opened model: its weights plus what the text side needs.
pub struct LoadedModel {
    pub path: PathBuf,
    /// "gguf", "safetensors" or "mlx".
    pub format: &'static str,
    pub weights: Arc<dyn WeightSource>,
    pub tokenizer: TokenizerSource,
    pub chat_template: Option<String>,
    /// Tensors actually present in the file(s), for `inspect`: (name, type name, elements, bytes).
    pub tensors: Vec<(String, &'static str, u64, u64)>,
}

fn string_array(f: &GgufFile, key: &str) -> Option<Vec<String>> {
    f.get(key)?
        .as_array()?
        .iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect()
}

fn meta_str(f: &GgufFile, key: &str) -> Option<String> {
    f.get(key)?.as_str().map(str::to_string)
}

fn meta_u32(f: &GgufFile, key: &str) -> Option<u32> {
    f.get(key)?.as_u64().and_then(|v| u32::try_from(v).ok())
}

/// Open a GGUF file or a Hugging Face directory; every tensor is checked against the config.
pub fn open(path: &Path) -> Result<LoadedModel> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let is_dir = meta.is_dir();
    // Weights are memory-mapped: a pipe or device cannot be (and opening a pipe with no writer
    // would block forever), so only a regular file or a directory is taken.
    if !is_dir && !meta.is_file() {
        bail!(
            "{}: not a regular file or a directory (a pipe or device cannot be memory-mapped: \
             give the model file itself)",
            path.display()
        );
    }
    let is_gguf = !is_dir && {
        let mut magic = [0u8; 4];
        use std::io::Read;
        std::fs::File::open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?
            .read(&mut magic)
            .map(|n| n == 4 && &magic == b"GGUF")
            .unwrap_or(false)
    };
    // A file that is not GGUF is taken as a member of a model directory only if it is one of
    // a directory's own files (weights or config); anything else (a truncated or mislabelled
    // .gguf) is named, not answered with another model from its directory.
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !is_dir && !is_gguf && !matches!(ext, "safetensors" | "json") {
        bail!(
            "{}: not a GGUF file (it does not start with the magic bytes GGUF) and not a model directory",
            path.display()
        );
    }
    if is_gguf {
        let file = GgufFile::open(path)?;
        let tensors = file
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.name(),
                    t.shape.iter().product(),
                    t.size,
                )
            })
            .collect();
        let tokenizer = match (
            string_array(&file, "tokenizer.ggml.tokens"),
            string_array(&file, "tokenizer.ggml.merges"),
        ) {
            (Some(tokens), Some(merges)) => TokenizerSource::Gguf {
                model: meta_str(&file, "tokenizer.ggml.model").unwrap_or_else(|| "gpt2".into()),
                pre: meta_str(&file, "tokenizer.ggml.pre").unwrap_or_else(|| "qwen2".into()),
                eos: meta_u32(&file, "tokenizer.ggml.eos_token_id"),
                bos: meta_u32(&file, "tokenizer.ggml.bos_token_id"),
                pad: meta_u32(&file, "tokenizer.ggml.padding_token_id"),
                token_types: file
                    .get("tokenizer.ggml.token_type")
                    .and_then(MetaValue::as_array)
                    .map(|a| a.iter().map(|v| v.as_i64().unwrap_or(1) as i32).collect())
                    .unwrap_or_else(|| vec![1; tokens.len()]),
                tokens,
                merges,
            },
            _ => TokenizerSource::Absent,
        };
        let chat_template = file
            .get("tokenizer.chat_template")
            .and_then(MetaValue::as_str)
            .map(str::to_string);
        let weights = GgufWeights::new(file)?;
        return Ok(LoadedModel {
            path: path.to_path_buf(),
            format: "gguf",
            weights: Arc::new(weights),
            tokenizer,
            chat_template,
            tensors,
        });
    }
    let dir = if is_dir {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let (format, weights, tensors): (_, Arc<dyn WeightSource>, _) = if crate::mlx::is_mlx_dir(&dir)
    {
        let w = crate::mlx::MlxWeights::open(&dir)?;
        let t = listing(w.model(), true)?;
        ("mlx", Arc::new(w), t)
    } else {
        let w = HfWeights::open(&dir)?;
        let t = listing(w.model(), false)?;
        ("safetensors", Arc::new(w), t)
    };
    let tok = dir.join("tokenizer.json");
    let chat_template = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| {
            v.get("chat_template")
                .and_then(|t| t.as_str())
                .map(str::to_string)
        });
    Ok(LoadedModel {
        path: path.to_path_buf(),
        format,
        weights,
        tokenizer: if tok.is_file() {
            TokenizerSource::HfDir(dir.clone())
        } else {
            TokenizerSource::Absent
        },
        chat_template,
        tensors,
    })
}

/// The tensors of a safetensors checkpoint for `inspect`: (name, type, elements, bytes). In an
/// MLX one a `.weight` of U32 words counts the weights it packs (`scales` elements times the
/// group), and `.scales` and `.biases` count bytes but no parameters (they are their weight's
/// storage, as a Q4_0 block's scale is).
fn listing(m: &SafetensorsModel, mlx: bool) -> Result<Vec<(String, &'static str, u64, u64)>> {
    let mut out = vec![];
    for name in m.names() {
        let Some(v) = m.raw(name)? else { continue };
        let mut elements: u64 = v.shape.iter().product();
        if mlx {
            if let Some(base) = name.strip_suffix(".weight") {
                if let Some(s) = m.raw(&format!("{base}.scales"))? {
                    elements = s.shape.iter().product::<u64>() * nibble_quant::mlx::GROUP as u64;
                }
            } else if name.ends_with(".scales") || name.ends_with(".biases") {
                elements = 0;
            }
        }
        out.push((name.to_string(), v.dtype, elements, v.data.len() as u64));
    }
    Ok(out)
}

/// What `nibble inspect` reports.
#[derive(Debug, Serialize)]
pub struct ModelInfo {
    pub path: String,
    pub format: &'static str,
    pub architecture: &'static str,
    pub config: Qwen3MoeConfig,
    pub tensor_count: usize,
    /// Bytes of tensor data per storage type.
    pub bytes_per_type: BTreeMap<String, u64>,
    pub parameters: u64,
    /// Bytes of weights a backend keeps resident (all tensor data, as stored).
    pub resident_bytes: u64,
    /// Weight bytes one decoded token reads: attention, router, K of E experts, lm_head.
    pub active_bytes_per_token: u64,
    pub tokenizer: bool,
    pub chat_template: bool,
}

impl LoadedModel {
    /// This model run with RoPE scaling `s` instead of its file's (llama.cpp's
    /// `--rope-scaling` flags): every backend reads the config through the weights.
    pub fn with_rope_scaling(mut self, s: Option<RopeScaling>) -> Result<Self> {
        if s != self.weights.config().rope_scaling {
            let mut cfg = self.weights.config().clone();
            cfg.rope_scaling = s;
            self.weights = Arc::new(Reconfigured::new(self.weights, cfg)?);
        }
        Ok(self)
    }

    /// Summarise the model for `inspect`.
    pub fn info(&self) -> Result<ModelInfo> {
        let cfg = self.weights.config().clone();
        let mut bytes_per_type = BTreeMap::new();
        for (_, t, _, b) in &self.tensors {
            *bytes_per_type.entry(t.to_string()).or_insert(0) += b;
        }
        let mut active = 0u64;
        for k in TensorKey::all(&cfg) {
            // From the type and shape: an MLX tensor is not interleaved just to be counted.
            let elements: usize = k.shape(&cfg).iter().product();
            let bytes = self.weights.dtype(k)?.byte_size(elements as u64)?;
            active += match k {
                // Embedding: one row per token.
                TensorKey::TokenEmbd => bytes / cfg.vocab_size as u64,
                TensorKey::Layer(
                    _,
                    LayerTensor::ExpGate | LayerTensor::ExpUp | LayerTensor::ExpDown,
                ) => bytes / cfg.num_experts as u64 * cfg.num_experts_per_tok as u64,
                _ => bytes,
            };
        }
        Ok(ModelInfo {
            path: self.path.display().to_string(),
            format: self.format,
            architecture: "qwen3moe",
            tensor_count: self.tensors.len(),
            parameters: self.tensors.iter().map(|t| t.2).sum(),
            resident_bytes: self.tensors.iter().map(|t| t.3).sum(),
            bytes_per_type,
            active_bytes_per_token: active,
            tokenizer: !matches!(self.tokenizer, TokenizerSource::Absent),
            chat_template: self.chat_template.is_some(),
            config: cfg,
        })
    }
}
