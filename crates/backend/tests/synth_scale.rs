//! The synthetic weights keep activations O(1) over 48 layers and give greedy top-1 margins of
//! a few logits, as a trained model's (formats-spec sizes except the width, shrunk for speed).

use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::synth::{self, SynthParams};
use nibble_model::weights::{TensorKey, Weight, WeightSource};
use std::sync::{Arc, Mutex};

/// The synthetic model held in memory (GGUF storage types), no file in between.
struct Mem {
    cfg: Qwen3MoeConfig,
    tensors: Vec<(TensorKey, Vec<u8>)>,
}

impl WeightSource for Mem {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let (_, bytes) = self
            .tensors
            .iter()
            .find(|(k, _)| *k == key)
            .ok_or_else(|| anyhow::anyhow!("no {key:?}"))?;
        Ok(Weight {
            dtype: synth::gguf_dtype(key),
            shape: key.shape(&self.cfg),
            parts: vec![bytes],
        })
    }
}

#[test]
fn activations_stay_order_one_over_48_layers_and_margins_look_trained() {
    let cfg = Qwen3MoeConfig {
        num_layers: 48,
        ..Qwen3MoeConfig::tiny()
    };
    let p = SynthParams::default();
    let tensors = TensorKey::all(&cfg)
        .into_iter()
        .map(|k| (k, synth::tensor_bytes(&cfg, &p, k)))
        .collect();
    let mut b = RefBackend::new(
        Arc::new(Mem {
            cfg: cfg.clone(),
            tensors,
        }),
        64,
    )
    .unwrap();
    // RMS of the residual stream after each layer, for the last token fed.
    let rms = Arc::new(Mutex::new(vec![0f64; 48]));
    let r2 = rms.clone();
    b.set_trace(Some(Box::new(move |_pos, name, v| {
        if let Some(l) = name
            .strip_prefix('l')
            .and_then(|s| s.strip_suffix(".h"))
            .and_then(|s| s.parse::<usize>().ok())
        {
            r2.lock().unwrap()[l] =
                (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        }
    })));
    let mut margins = vec![];
    let mut tok = 9707u32;
    for _ in 0..24 {
        let logits = b.step(tok).unwrap();
        let top = argmax(&logits) as usize;
        let second = logits
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != top)
            .map(|(_, v)| *v)
            .fold(f32::MIN, f32::max);
        margins.push(logits[top] - second);
        tok = top as u32;
    }
    let rms = rms.lock().unwrap().clone();
    eprintln!(
        "residual RMS by layer: first {:.2}, mid {:.2}, last {:.2}",
        rms[0], rms[24], rms[47]
    );
    for (l, r) in rms.iter().enumerate() {
        assert!(
            r.is_finite() && *r > 0.3 && *r < 100.0,
            "layer {l}: residual RMS {r}"
        );
    }
    margins.sort_by(f32::total_cmp);
    let median = margins[margins.len() / 2];
    eprintln!(
        "greedy top-1 margins: min {:.3}, median {median:.3}, max {:.3}",
        margins[0],
        margins[margins.len() - 1]
    );
    // Trained models' greedy margins are mostly a few logits; neither ~0 (noise) nor ~100 (one-hot).
    assert!(
        median > 0.3 && median < 20.0,
        "median top-1 margin {median}"
    );
}
