//! Synthetic MLX checkpoints: the synthetic model's weights quantised as mlx-lm's `convert -q`
//! stores them (formats-spec §4): 4-bit affine groups of 64 for every matrix and the embedding
//! (8-bit ones with `--quant q8_0`, as `convert -q --q-bits 8`), 8 bits for the router (mlx-lm's
//! per-module override for `mlp.gate` since 2025-08), bf16 norms, experts stacked under
//! `mlp.switch_mlp`, `{"format": "mlx"}` in every file.
//!
//! The values are the Q4_0 synthetic model's, requantised: an MLX file of a seed holds close to,
//! not exactly, the GGUF's weights (affine 4-bit cannot hold every Q4_0 block exactly).

use super::{gguf_dtype, progress, storage_dtype, tensor_bytes, QuantMix, SynthParams};
use crate::config::Qwen3MoeConfig;
use crate::qwen3_moe::mlx_module;
use crate::weights::{LayerTensor, TensorKey};
use nibble_formats::safetensors::{write_model_as, Element, TensorSpec};
use nibble_quant::{mlx, DType};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// The bits of the matrices of an MLX checkpoint written from `mix`: 4 from the Q4_0 mix, 8
/// from the Q8_0 one (the same values); `None` for a mix MLX cannot take.
pub fn mlx_bits(mix: QuantMix) -> Option<u32> {
    match mix {
        QuantMix::Q4_0 => Some(4),
        QuantMix::Q8_0 => Some(8),
        QuantMix::Q4KM | QuantMix::Q6K | QuantMix::Q4K | QuantMix::Q5KM => None,
    }
}

/// The MLX storage of `key` in a synthetic checkpoint with `bits`-bit matrices (4 or 8):
/// `None` for the bf16 norms.
pub fn mlx_dtype(key: TensorKey, bits: u32) -> Option<DType> {
    match gguf_dtype(key) {
        DType::Q4_0 if bits == 8 => Some(DType::MLX_A8),
        DType::Q4_0 => Some(DType::MLX_A4),
        _ if matches!(key, TensorKey::Layer(_, LayerTensor::Router)) => Some(DType::MLX_A8),
        _ => None,
    }
}

/// The config.json of an MLX conversion: the HF config plus `quantization` (global `bits`-bit
/// groups of 64, the routers at 8 bits) and its copy `quantization_config`.
fn mlx_config(cfg: &Qwen3MoeConfig, bits: u32) -> serde_json::Value {
    let mut q = serde_json::json!({ "group_size": mlx::GROUP, "bits": bits });
    for l in 0..cfg.num_layers {
        q[mlx_module(TensorKey::Layer(l, LayerTensor::Router))] =
            serde_json::json!({ "group_size": mlx::GROUP, "bits": 8 });
    }
    let mut v = cfg.to_hf_json();
    v["quantization"] = q.clone();
    v["quantization_config"] = q;
    v
}

/// Write an MLX checkpoint directory (config.json + safetensors, sharded at 4 GiB as mlx-lm's
/// 5 GiB shards are). Tokenizer files are copied beside it by the caller.
pub fn write_mlx(
    cfg: &Qwen3MoeConfig,
    p: &SynthParams,
    dir: &Path,
    quiet: bool,
) -> anyhow::Result<Vec<PathBuf>> {
    write_mlx_sharded(cfg, p, dir, quiet, 4 << 30)
}

/// [`write_mlx`] with shards of at most `max_shard_bytes` of tensor data (tests shard a tiny
/// model this way).
pub fn write_mlx_sharded(
    cfg: &Qwen3MoeConfig,
    p: &SynthParams,
    dir: &Path,
    quiet: bool,
    max_shard_bytes: u64,
) -> anyhow::Result<Vec<PathBuf>> {
    cfg.validate()?;
    let Some(bits) = mlx_bits(p.mix) else {
        anyhow::bail!(
            "an MLX checkpoint requantises the Q4_0 (4-bit) or Q8_0 (8-bit) mix's weights; {:?} \
             is GGUF only",
            p.mix
        );
    };
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&mlx_config(cfg, bits))?,
    )?;
    // (spec, key, part): part 0 = weight, 1 = scales, 2 = biases of a quantised module.
    let mut specs = vec![];
    let mut origin = vec![];
    for k in TensorKey::all(cfg) {
        let m = mlx_module(k);
        let shape: Vec<u64> = k.shape(cfg).iter().map(|&d| d as u64).collect();
        let (lead, cols) = shape.split_at(shape.len() - 1);
        let with = |last: u64| lead.iter().copied().chain([last]).collect::<Vec<_>>();
        match mlx_dtype(k, bits) {
            None => {
                specs.push(TensorSpec {
                    name: format!("{m}.weight"),
                    dtype: Element::Float(DType::BF16),
                    shape: shape.clone(),
                });
                origin.push((k, 0));
            }
            Some(d) => {
                let bits = mlx::bits(d).expect("an MLX type") as u64;
                let groups = cols[0] / mlx::GROUP as u64;
                for (part, (suffix, dtype, last)) in [
                    ("weight", Element::U32, cols[0] * bits / 32),
                    ("scales", Element::Float(DType::BF16), groups),
                    ("biases", Element::Float(DType::BF16), groups),
                ]
                .into_iter()
                .enumerate()
                {
                    specs.push(TensorSpec {
                        name: format!("{m}.{suffix}"),
                        dtype,
                        shape: with(last),
                    });
                    origin.push((k, part));
                }
            }
        }
    }
    let pb = progress(
        specs
            .iter()
            .map(|s| s.shape.iter().product::<u64>() * if s.dtype == Element::U32 { 4 } else { 2 })
            .sum(),
        quiet,
    );
    // The three parts of the module last quantised, so each is quantised once.
    let mut cache: Option<(TensorKey, [Vec<u8>; 3])> = None;
    let mut data = |i: usize| -> Vec<u8> {
        let (k, part) = origin[i];
        if cache.as_ref().map(|c| c.0) != Some(k) {
            cache = Some((k, module_parts(cfg, p, k, bits)));
        }
        let out = cache.as_ref().expect("just filled").1[part].clone();
        pb.inc(out.len() as u64);
        out
    };
    let files = write_model_as(dir, "mlx", &specs, max_shard_bytes, &mut data)?;
    pb.finish_and_clear();
    Ok(files)
}

/// The tensors of `k` as the file stores them: `[weight words, scales, biases]` of a quantised
/// module, or `[bf16 weight, -, -]` of a norm.
fn module_parts(cfg: &Qwen3MoeConfig, p: &SynthParams, k: TensorKey, bits: u32) -> [Vec<u8>; 3] {
    let shape = k.shape(cfg);
    let cols = *shape.last().expect("non-empty shape");
    let src = storage_dtype(cfg, p.mix, k);
    let bytes = tensor_bytes(cfg, p, k);
    let row_bytes = bytes.len() / (shape.iter().product::<usize>() / cols);
    // Rows in parallel (a serial pass over the full-size model's 30 B weights took minutes).
    let row = |b: &[u8]| {
        let mut vals = vec![0f32; cols];
        nibble_quant::dequantize(src, b, &mut vals).expect("synth writes valid blocks");
        vals
    };
    let Some(d) = mlx_dtype(k, bits) else {
        let bf16: Vec<u8> = bytes
            .par_chunks(row_bytes)
            .flat_map_iter(|b| {
                row(b)
                    .into_iter()
                    .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
            })
            .collect();
        return [bf16, vec![], vec![]];
    };
    // Each row's blocks split back into MLX's three arrays.
    let rows: Vec<_> = bytes
        .par_chunks(row_bytes)
        .map(|b| mlx::unpack_row(d, &mlx::quantize(d, &row(b))))
        .collect();
    let mut parts: [Vec<u8>; 3] = Default::default();
    for (w, s, b) in rows {
        parts[0].extend_from_slice(&w);
        parts[1].extend_from_slice(&s);
        parts[2].extend_from_slice(&b);
    }
    parts
}
