//! [`check_supported`]: which mixtures of stored types the GPU backend takes (each tensor in
//! its own form, as llama.cpp's `Q4_K_M` files store them) and the clear refusals before any
//! upload: an embedding or expert tensor of a type the kernels do not read packed, and a
//! layer whose gate and up differ. No adapter is needed: only the types are read.

use super::check_supported;
use crate::backend_tests::{model_with_vocab, Mem};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use nibble_quant::DType;
use std::collections::HashMap;
use std::sync::Arc;

/// The tiny model with some tensors' types said to be others (their bytes are not read).
struct Retyped {
    inner: Arc<Mem>,
    types: HashMap<TensorKey, DType>,
}

impl WeightSource for Retyped {
    fn config(&self) -> &Qwen3MoeConfig {
        self.inner.config()
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let mut w = self.inner.weight(key)?;
        if let Some(t) = self.types.get(&key) {
            w.dtype = *t;
        }
        Ok(w)
    }
}

fn retyped(types: &[(TensorKey, DType)]) -> Retyped {
    Retyped {
        inner: model_with_vocab(5, false, 512),
        types: types.iter().copied().collect(),
    }
}

fn layer(l: usize, t: LayerTensor) -> TensorKey {
    TensorKey::Layer(l, t)
}

#[test]
fn mixed_packed_types_are_taken_and_others_refused_by_name() {
    // The tiny model as synth writes it (Q4_0), and with a `Q4_K_M`-like mixture: another
    // layer's down Q6_K, the embedding Q4_K, the lm_head Q6_K, a whole layer Q8_0.
    check_supported(&retyped(&[])).unwrap();
    check_supported(&retyped(&[
        (layer(1, LayerTensor::ExpDown), DType::Q6_K),
        (TensorKey::TokenEmbd, DType::Q4_K),
        (TensorKey::Output, DType::Q6_K),
        (layer(0, LayerTensor::ExpGate), DType::Q8_0),
        (layer(0, LayerTensor::ExpUp), DType::Q8_0),
        (layer(0, LayerTensor::ExpDown), DType::MLX_A8),
        (layer(2, LayerTensor::ExpGate), DType::Q5_K),
        (layer(2, LayerTensor::ExpUp), DType::Q5_K),
    ]))
    .unwrap();
    // An expert tensor the kernels do not read packed (an unquantised checkpoint's BF16):
    // named, counted, the CPU suggested.
    let e = check_supported(&retyped(&[
        (layer(1, LayerTensor::ExpUp), DType::BF16),
        (layer(1, LayerTensor::ExpGate), DType::BF16),
    ]))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("2 of them are not")
            && e.contains("blk.1.ffn_gate_exps.weight is BF16")
            && e.contains("--backend cpu"),
        "{e}"
    );
    let e = check_supported(&retyped(&[(TensorKey::TokenEmbd, DType::F16)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("token_embd.weight is F16"), "{e}");
    // Gate and up of one layer in two types: the gate/up kernel reads both alike.
    let e = check_supported(&retyped(&[(layer(1, LayerTensor::ExpUp), DType::Q8_0)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer 1's expert gate is Q4_0 and its up is Q8_0")
            && e.contains("--backend cpu"),
        "{e}"
    );
}
