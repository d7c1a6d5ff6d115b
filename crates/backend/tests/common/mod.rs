//! Shared test fixtures: an in-memory [`WeightSource`] filled with seeded random weights.
//!
//! Norm weights and the router are F32, the embedding F16, every other matrix Q4_0, and the
//! stacked expert tensors are stored one part per expert (as Hugging Face checkpoints are), so
//! the tests exercise several decoders and multi-part tensors.
#![allow(dead_code)] // each test binary uses a different subset

use anyhow::Context;
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use nibble_quant::DType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// One stored tensor: its dtype, canonical shape and byte parts.
pub struct Stored {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub parts: Vec<Vec<u8>>,
}

pub struct MemSource {
    pub cfg: Qwen3MoeConfig,
    pub tensors: HashMap<TensorKey, Stored>,
}

impl WeightSource for MemSource {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let s = self
            .tensors
            .get(&key)
            .with_context(|| format!("no tensor {key:?}"))?;
        Ok(Weight {
            dtype: s.dtype,
            shape: s.shape.clone(),
            parts: s.parts.iter().map(|p| p.as_slice()).collect(),
        })
    }
}

/// The tiny config with a 512-token vocabulary, so a token costs microseconds.
pub fn tiny_cfg() -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: 512,
        ..Qwen3MoeConfig::tiny()
    }
}

impl MemSource {
    /// Store `values` (row-major, `key`'s canonical shape) as `dtype`, split into `parts` equal parts.
    pub fn set(&mut self, key: TensorKey, dtype: DType, values: &[f32], parts: usize) {
        let shape = key.shape(&self.cfg);
        assert_eq!(values.len(), shape.iter().product::<usize>());
        let per = values.len() / parts;
        let parts = values
            .chunks(per)
            .map(|c| nibble_quant::encode_float(dtype, c))
            .collect();
        self.tensors.insert(
            key,
            Stored {
                dtype,
                shape,
                parts,
            },
        );
    }

    /// Dequantized f32 contents of a stored tensor (what the backend sees).
    pub fn values(&self, key: TensorKey) -> Vec<f32> {
        let w = self.weight(key).unwrap();
        let cols = *w.shape.last().unwrap();
        let rows = w.elements() / cols;
        let mut out = vec![0f32; w.elements()];
        for r in 0..rows {
            nibble_quant::dequantize(w.dtype, w.row(r), &mut out[r * cols..(r + 1) * cols])
                .unwrap();
        }
        out
    }
}

/// Uniform values in `[-scale, scale)`.
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// A model with `cfg`'s shapes and seeded random weights, scaled so activations stay O(1).
pub fn random_model(cfg: &Qwen3MoeConfig, seed: u64) -> MemSource {
    cfg.validate().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut m = MemSource {
        cfg: cfg.clone(),
        tensors: HashMap::new(),
    };
    for key in TensorKey::all(cfg) {
        let shape = key.shape(cfg);
        let n: usize = shape.iter().product();
        // Uniform(-a, a) has variance a²/3: a = sqrt(3 / fan_in) keeps unit-variance outputs.
        let mat = |rng: &mut ChaCha8Rng| {
            let fan_in = *shape.last().unwrap() as f32;
            uniform(rng, n, (3.0 / fan_in).sqrt())
        };
        let (dtype, values, parts) = match key {
            TensorKey::TokenEmbd => (DType::F16, uniform(&mut rng, n, 1.0), 1),
            TensorKey::OutputNorm => (DType::F32, norm_weight(&mut rng, n), 1),
            TensorKey::Output => (DType::Q4_0, mat(&mut rng), 1),
            TensorKey::Layer(_, t) => match t {
                LayerTensor::AttnNorm
                | LayerTensor::FfnNorm
                | LayerTensor::QNorm
                | LayerTensor::KNorm => (DType::F32, norm_weight(&mut rng, n), 1),
                // A wider router spread makes the routing decisive, as in trained models.
                LayerTensor::Router => {
                    let v = mat(&mut rng).iter().map(|x| x * 3.0).collect();
                    (DType::F32, v, 1)
                }
                LayerTensor::ExpGate | LayerTensor::ExpUp | LayerTensor::ExpDown => {
                    (DType::Q4_0, mat(&mut rng), cfg.num_experts)
                }
                _ => (DType::Q4_0, mat(&mut rng), 1),
            },
        };
        m.set(key, dtype, &values, parts);
    }
    m
}

/// Norm weights near 1, as in trained models.
fn norm_weight(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    uniform(rng, n, 0.2).iter().map(|x| 1.0 + x).collect()
}

/// Seeded random token ids below `vocab`.
pub fn random_tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}
