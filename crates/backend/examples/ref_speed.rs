//! Times the reference backend on the real Qwen3-30B-A3B dimensions with only a few layers.
//!
//! `cargo run --release -p nibble-backend --example ref_speed -- [layers] [tokens]`
//! (defaults 2 and 4). Weights are random Q4_0 made in memory (norms and router F32), about
//! 0.35 GiB per layer plus 0.35 GiB for the embedding and lm_head. The trace hook timestamps
//! each layer's end, so the per-layer and lm_head costs are measured separately and the
//! 48-layer time per token is projected from them.

use anyhow::Context;
use nibble_backend::{Backend, RefBackend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use nibble_quant::DType;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// In-memory model: each tensor is one byte buffer in its canonical layout.
struct Mem {
    cfg: Qwen3MoeConfig,
    tensors: HashMap<TensorKey, (DType, Vec<u8>)>,
}

impl WeightSource for Mem {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let (dtype, bytes) = self.tensors.get(&key).context("missing tensor")?;
        Ok(Weight {
            dtype: *dtype,
            shape: key.shape(&self.cfg),
            parts: vec![bytes.as_slice()],
        })
    }
}

/// Random Q4_0 blocks whose weights have a standard deviation near `1/sqrt(fan_in)`.
fn random_q4(rng: &mut ChaCha8Rng, elements: usize, fan_in: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; elements / 32 * 18];
    rng.fill_bytes(&mut bytes);
    // Nibble 0 (weight -8) becomes 8 (weight 0) so that weights are symmetric around 0: a biased
    // mean would grow an all-ones component layer after layer. Their deviation is then about 4.3.
    let d = half::f16::from_f32(1.0 / (4.3 * (fan_in as f32).sqrt()));
    for block in bytes.chunks_exact_mut(18) {
        block[..2].copy_from_slice(&d.to_le_bytes());
        for b in &mut block[2..] {
            let (lo, hi) = (*b & 15, *b >> 4);
            *b = if lo == 0 { 8 } else { lo } | (if hi == 0 { 8 } else { hi }) << 4;
        }
    }
    bytes
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let layers: usize = args.next().map_or(Ok(2), |a| a.parse())?;
    let tokens: usize = args.next().map_or(Ok(4), |a| a.parse())?;
    let cfg = Qwen3MoeConfig {
        num_layers: layers,
        ..Qwen3MoeConfig::qwen3_30b_a3b()
    };
    let t0 = Instant::now();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut tensors = HashMap::new();
    for key in TensorKey::all(&cfg) {
        let shape = key.shape(&cfg);
        let n: usize = shape.iter().product();
        let fan_in = *shape.last().unwrap();
        let entry = match key {
            TensorKey::OutputNorm
            | TensorKey::Layer(
                _,
                LayerTensor::AttnNorm
                | LayerTensor::FfnNorm
                | LayerTensor::QNorm
                | LayerTensor::KNorm,
            ) => (
                DType::F32,
                nibble_quant::encode_float(DType::F32, &vec![1.0; n]),
            ),
            TensorKey::Layer(_, LayerTensor::Router) => {
                let v: Vec<f32> = (0..n).map(|_| rng.random_range(-0.1..0.1)).collect();
                (DType::F32, nibble_quant::encode_float(DType::F32, &v))
            }
            _ => (DType::Q4_0, random_q4(&mut rng, n, fan_in)),
        };
        tensors.insert(key, entry);
    }
    println!(
        "built {layers}-layer model in {:.1} s; {} rayon threads",
        t0.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );

    let mut b = RefBackend::new(Arc::new(Mem { cfg, tensors }), 256)?;
    // Timestamps of "l{i}.h" (end of layer i) and "logits", per token.
    let marks: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let sink = Arc::clone(&marks);
    b.set_trace(Some(Box::new(move |_, name, _| {
        if name.ends_with(".h") || name == "logits" || name == "embd" {
            sink.lock()
                .unwrap()
                .push((name.to_string(), Instant::now()));
        }
    })));
    b.prefill(&[9707])?;
    let (mut total, mut layer_ms, mut head_ms) = (0.0, 0.0, 0.0);
    for i in 0..tokens {
        marks.lock().unwrap().clear();
        let t = Instant::now();
        let logits = b.step(1000 + i as u32)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let m = marks.lock().unwrap();
        let at = |n: &str| m.iter().find(|x| x.0 == n).map(|x| x.1).unwrap();
        let last = format!("l{}.h", layers - 1);
        let per_layer = (at(&last) - at("embd")).as_secs_f64() * 1e3 / layers as f64;
        let head = (at("logits") - at(&last)).as_secs_f64() * 1e3;
        println!(
            "token {i}: {ms:.1} ms ({per_layer:.1} ms/layer, lm_head {head:.1} ms), argmax {}",
            nibble_backend::argmax(&logits)
        );
        total += ms;
        layer_ms += per_layer;
        head_ms += head;
    }
    let n = tokens as f64;
    println!(
        "mean {:.1} ms/token for {layers} layers; {:.1} ms/layer, lm_head {:.1} ms; \
         projected 48 layers: {:.0} ms/token",
        total / n,
        layer_ms / n,
        head_ms / n,
        48.0 * layer_ms / n + head_ms / n
    );
    Ok(())
}
