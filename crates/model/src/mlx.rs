//! MLX checkpoints (mlx-lm's `convert -q`, formats-spec §4): a directory with `config.json`
//! (carrying a `quantization` object) and safetensors whose quantised modules are three tensors
//! each, `{module}.weight` (U32 words of packed 4- or 8-bit integers), `{module}.scales` and
//! `{module}.biases` (bf16, one per group of 64 inputs), experts stacked under
//! `mlp.switch_mlp`.
//!
//! The three arrays are interleaved into nibble's MLX blocks (`nibble_quant::mlx`: 36 bytes per
//! 64 weights at 4 bits), so the model code and the backends see one dtype per tensor as for
//! GGUF. Open only checks the arrays; a tensor is interleaved when a backend first asks for it.
//! [`WeightSource::weight`] keeps that copy (the CPU backends read their weights at every
//! step), [`WeightSource::with_weight`] frees it after its one use (the GPU's upload, so the
//! host never holds the model twice). Norms (and any module left unquantised) are served
//! zero-copy.
//!
//! Which modules are quantised, and how, follows mlx-lm's loader (spec §4.3): a module named in
//! `quantization` takes that entry (an object, or `false` for "not quantised"); any other module
//! is quantised with the global parameters iff its `.scales` exist. The bits come from the config and
//! are checked against the shapes: a file whose shapes disagree with its config is refused.

use crate::config::Qwen3MoeConfig;
use crate::qwen3_moe::{check_view, mlx_module, refuse_unused};
use crate::weights::{TensorKey, Weight, WeightSource};
use anyhow::{anyhow, bail, ensure, Context, Result};
use nibble_formats::safetensors::SafetensorsModel;
use nibble_quant::{mlx, DType};
use rayon::prelude::*;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Whether `dir` holds an MLX checkpoint: its config has a `quantization` object, or its
/// safetensors say `"format": "mlx"`.
pub fn is_mlx_dir(dir: &Path) -> bool {
    let quantized = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|v| v.get("quantization").is_some());
    quantized
        || SafetensorsModel::open(dir)
            .ok()
            .is_some_and(|m| m.format_tag() == Some("mlx"))
}

/// A Qwen3-MoE model served from an MLX checkpoint directory.
pub struct MlxWeights {
    dir: PathBuf,
    model: SafetensorsModel,
    config: Qwen3MoeConfig,
    /// The quantised tensors (checked at open; interleaved on first use).
    packed: HashMap<TensorKey, Packed>,
}

/// One quantised module, its three arrays checked against the config at open.
struct Packed {
    /// The module's name in the file (`model.layers.0.self_attn.q_proj`).
    module: String,
    quant: Quant,
    /// `MLX_A4` or `MLX_A8`.
    dtype: DType,
    /// Its blocks `[rows, cols/64 blocks]` in canonical row order (experts stacked
    /// expert-major, as in the file), once [`WeightSource::weight`] has built them.
    blocks: OnceLock<Vec<u8>>,
}

/// How one module is quantised.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quant {
    bits: u64,
    group: u64,
}

/// What mlx's `to_quantized` takes for a field a per-module entry leaves out.
const MODULE_DEFAULT: Quant = Quant { bits: 4, group: 64 };

/// The `{group_size, bits}` of a quantisation object, refused unless affine. `defaults` (a
/// per-module entry) fills a missing field as mlx's `to_quantized` does (group 64, 4 bits);
/// the global object must name both.
fn quant_of(v: &Value, what: &str, defaults: Option<Quant>) -> Result<Quant> {
    let field = |k: &str, default: Option<u64>| match v.get(k) {
        None => default.ok_or_else(|| anyhow!("{what}: `{k}` is missing")),
        Some(f) => f
            .as_u64()
            .ok_or_else(|| anyhow!("{what}: `{k}` is not a whole number")),
    };
    if let Some(mode) = v.get("mode").and_then(Value::as_str) {
        ensure!(
            mode == "affine",
            "{what}: quantisation mode \"{mode}\" is not supported (nibble reads MLX's affine mode)"
        );
    }
    Ok(Quant {
        bits: field("bits", defaults.map(|d| d.bits))?,
        group: field("group_size", defaults.map(|d| d.group))?,
    })
}

impl MlxWeights {
    /// Open `dir` and check every tensor (each quantised module's three arrays) against the
    /// config; nothing is interleaved yet (module docs).
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("{}: cannot read", cfg_path.display()))?;
        let config = Qwen3MoeConfig::from_hf_json(&text)
            .with_context(|| format!("{}", cfg_path.display()))?;
        let json: Value = serde_json::from_str(&text)?;
        let qcfg = json.get("quantization");
        let global = qcfg
            .map(|q| quant_of(q, "config.json quantization", None))
            .transpose()
            .with_context(|| format!("{}", cfg_path.display()))?;
        let model = SafetensorsModel::open(dir)?;
        let mut packed = HashMap::new();
        for key in TensorKey::all(&config) {
            if key == TensorKey::Output && config.tie_word_embeddings {
                continue;
            }
            let m = mlx_module(key);
            let entry = qcfg.and_then(|q| q.get(&m));
            let quant = match entry {
                // `null` is falsy in mlx-lm's class predicate: not quantised, like `false`.
                Some(Value::Bool(false) | Value::Null) => None,
                Some(Value::Bool(true)) => global,
                Some(v) => Some(quant_of(
                    v,
                    &format!("config.json quantization.{m}"),
                    Some(MODULE_DEFAULT),
                )?),
                None if model.contains(&format!("{m}.scales")) => {
                    Some(global.ok_or_else(|| {
                        anyhow!("`{m}` has scales but config.json has no `quantization` object")
                    })?)
                }
                None => None,
            };
            if let Some(quant) = quant {
                let want = key.shape(&config);
                let dtype = check_module(&model, &m, quant, &want)
                    .with_context(|| format!("{}: `{m}`", dir.display()))?;
                packed.insert(
                    key,
                    Packed {
                        module: m,
                        quant,
                        dtype,
                        blocks: OnceLock::new(),
                    },
                );
            }
        }
        let w = MlxWeights {
            dir: dir.to_path_buf(),
            model,
            config,
            packed,
        };
        let mut used = HashSet::new();
        for key in TensorKey::all(&w.config) {
            w.dtype(key).with_context(|| format!("{}", dir.display()))?;
            let m = mlx_module(key);
            if w.packed.contains_key(&key) {
                used.extend(["scales", "biases"].map(|a| format!("{m}.{a}")));
            }
            used.insert(format!("{m}.weight"));
        }
        if w.config.tie_word_embeddings {
            // A tied checkpoint may still carry an lm_head: mlx-lm drops it, as nibble does
            // (its scales and biases too, where mlx-lm's strict load would refuse them).
            let m = mlx_module(TensorKey::Output);
            used.extend(["weight", "scales", "biases"].map(|a| format!("{m}.{a}")));
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

    /// Bytes of interleaved blocks held (those [`WeightSource::weight`] built and keeps).
    pub fn interleaved_bytes(&self) -> usize {
        self.packed
            .values()
            .filter_map(|p| p.blocks.get())
            .map(Vec::len)
            .sum()
    }
}

/// The three arrays of module `m` (`weight`, `scales`, `biases`).
fn arrays<'a>(
    model: &'a SafetensorsModel,
    m: &str,
) -> Result<[nibble_formats::safetensors::RawView<'a>; 3]> {
    let get = |suffix: &str| {
        model
            .raw(&format!("{m}.{suffix}"))?
            .ok_or_else(|| anyhow!("missing tensor `{m}.{suffix}`"))
    };
    Ok([get("weight")?, get("scales")?, get("biases")?])
}

/// Check module `m`'s three arrays against the canonical shape `want` (`[.., out, in]`) and
/// the quantisation `q`; its blocks' dtype.
fn check_module(model: &SafetensorsModel, m: &str, q: Quant, want: &[usize]) -> Result<DType> {
    let dtype = match q.bits {
        4 => DType::MLX_A4,
        8 => DType::MLX_A8,
        b => bail!("{b}-bit MLX quantisation is not supported (nibble reads 4 and 8 bits)"),
    };
    ensure!(
        q.group == mlx::GROUP as u64,
        "MLX group size {} is not supported (nibble reads group size {})",
        q.group,
        mlx::GROUP
    );
    let [w, s, b] = arrays(model, m)?;
    let (lead, cols) = want.split_at(want.len() - 1);
    let cols = cols[0] as u64;
    ensure!(
        cols.is_multiple_of(mlx::GROUP as u64),
        "{cols} inputs are not whole groups of {}",
        mlx::GROUP
    );
    let with = |last: u64| -> Vec<u64> { lead.iter().map(|&d| d as u64).chain([last]).collect() };
    let words = cols * q.bits / 32;
    let groups = cols / mlx::GROUP as u64;
    ensure!(
        w.dtype == "U32" && w.shape == with(words),
        "`{m}.weight` is {} {:?}; {}-bit groups of this config's {:?} need U32 {:?}",
        w.dtype,
        w.shape,
        q.bits,
        want,
        with(words)
    );
    for (t, name) in [(&s, "scales"), (&b, "biases")] {
        ensure!(
            t.dtype == "BF16" && t.shape == with(groups),
            "`{m}.{name}` is {} {:?}, expected BF16 {:?} (nibble reads bf16 scales and biases)",
            t.dtype,
            t.shape,
            with(groups)
        );
    }
    Ok(dtype)
}

/// Module `p`'s three arrays (checked at open) interleaved into `[rows, cols/64 blocks]` of
/// `p.dtype`'s blocks, `want` being its canonical shape.
fn interleave(model: &SafetensorsModel, p: &Packed, want: &[usize]) -> Result<Vec<u8>> {
    let [w, s, b] = arrays(model, &p.module)?;
    let cols = want[want.len() - 1];
    let rows: usize = want[..want.len() - 1].iter().product();
    let (pb, sb) = (cols * p.quant.bits as usize / 8, cols / mlx::GROUP * 2);
    let rb = p.dtype.byte_size(cols as u64)? as usize;
    let mut out = vec![0u8; rows * rb];
    // Row by row in parallel: the model's ~17 GB of experts take seconds, not minutes.
    out.par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, o)| {
            mlx::repack_row(
                p.dtype,
                &w.data[r * pb..(r + 1) * pb],
                &s.data[r * sb..(r + 1) * sb],
                &b.data[r * sb..(r + 1) * sb],
                o,
            )
        })
        .map_err(|e| anyhow!(e))
        .with_context(|| format!("`{}`", p.module))?;
    Ok(out)
}

impl MlxWeights {
    /// The tied lm_head is the embedding.
    fn canonical(&self, key: TensorKey) -> TensorKey {
        match key {
            TensorKey::Output if self.config.tie_word_embeddings => TensorKey::TokenEmbd,
            k => k,
        }
    }

    /// `key`'s tensor over `bytes` (its interleaved blocks when it is quantised), or the mapped
    /// tensor as stored when `bytes` is `None`.
    fn view<'a>(&'a self, key: TensorKey, bytes: Option<&'a [u8]>) -> Result<Weight<'a>> {
        let want = key.shape(&self.config);
        let name = format!("{}.weight", mlx_module(key));
        if let (Some(p), Some(bytes)) = (self.packed.get(&key), bytes) {
            let shape: Vec<u64> = want.iter().map(|&d| d as u64).collect();
            check_view(key, &name, p.dtype, &shape, &want)?;
            return Ok(Weight {
                dtype: p.dtype,
                shape: want,
                parts: vec![bytes],
            });
        }
        let view = self
            .model
            .tensor(&name)?
            .ok_or_else(|| anyhow!("missing tensor `{name}`"))?;
        check_view(key, &name, view.dtype, &view.shape, &want)?;
        Ok(Weight {
            dtype: view.dtype,
            shape: want,
            parts: vec![view.data],
        })
    }
}

impl WeightSource for MlxWeights {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    fn weight(&self, key: TensorKey) -> Result<Weight<'_>> {
        let key = self.canonical(key);
        let Some(p) = self.packed.get(&key) else {
            return self.view(key, None);
        };
        let blocks = match p.blocks.get() {
            Some(b) => b,
            None => {
                let built = interleave(&self.model, p, &key.shape(&self.config))?;
                // Two threads may both build it; the first one stored is kept.
                p.blocks.get_or_init(|| built)
            }
        };
        self.view(key, Some(blocks))
    }

    fn dtype(&self, key: TensorKey) -> Result<DType> {
        let key = self.canonical(key);
        match self.packed.get(&key) {
            Some(p) => Ok(p.dtype),
            None => Ok(self.view(key, None)?.dtype),
        }
    }

    fn with_weight(
        &self,
        key: TensorKey,
        f: &mut dyn FnMut(&Weight<'_>) -> Result<()>,
    ) -> Result<()> {
        let key = self.canonical(key);
        match self.packed.get(&key) {
            Some(p) if p.blocks.get().is_none() => {
                let built = interleave(&self.model, p, &key.shape(&self.config))?;
                f(&self.view(key, Some(&built))?)
            }
            _ => f(&self.weight(key)?),
        }
    }
}
