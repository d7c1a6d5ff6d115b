//! [`check_supported`]: which mixtures of stored types the GPU backend takes (each tensor in
//! its own form, as llama.cpp's `Q4_K_M` files store them) and the clear refusals before any
//! upload: an embedding or expert tensor of a type the kernels do not read packed, and a
//! layer whose gate and up differ (no adapter needed: only the types are read); and which
//! dense matrices stay packed for which numerics ([`DenseForms`]).

use super::{check_supported, DenseForms, GpuWeights, HeadRef};
use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::{model_with_vocab, Mem};
use crate::numerics::Numerics;
use crate::testing::{cosine, gpu};
use nibble_backend::{Backend, RefBackend};
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

/// The tiny model with its lm_head re-encoded as Q8_0 (a dense matrix in another packed type
/// than the model's Q4_0, as llama.cpp's Q4_0 files hold a Q6_K one), read by both backends.
struct Q8Head {
    inner: Arc<Mem>,
    head: Vec<u8>,
}

impl WeightSource for Q8Head {
    fn config(&self) -> &Qwen3MoeConfig {
        self.inner.config()
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let mut w = self.inner.weight(key)?;
        if key == TensorKey::Output {
            w.dtype = DType::Q8_0;
            w.parts = vec![self.head.as_slice()];
        }
        Ok(w)
    }
}

#[test]
fn dense_matrices_of_other_forms_stay_packed_for_f32_and_are_widened_for_int8() {
    let Some(ctx) =
        gpu("dense_matrices_of_other_forms_stay_packed_for_f32_and_are_widened_for_int8")
    else {
        return;
    };
    let inner = model_with_vocab(6, false, 512);
    let w = inner.weight(TensorKey::Output).unwrap();
    let mut vals = vec![0f32; w.elements()];
    nibble_quant::dequantize(w.dtype, w.parts[0], &mut vals).unwrap();
    let head = nibble_quant::encode_float(DType::Q8_0, &vals);
    let src = Arc::new(Q8Head { inner, head });
    let packed = GpuWeights::upload_with(&ctx, src.as_ref(), DenseForms::Any).unwrap();
    assert!(
        matches!(packed.head(), HeadRef::Q4(m) if m.form() == Some(crate::tensor::QForm::Q8_0))
    );
    let wide = GpuWeights::upload_with(&ctx, src.as_ref(), DenseForms::Q4_0Only).unwrap();
    assert!(matches!(wide.head(), HeadRef::F32(_)));
    // Both numerics decode the model: the logits of a short prompt against the oracle's.
    let prompt = [3u32, 141, 59, 26];
    let mut rb = RefBackend::new(src.clone(), 64).unwrap();
    let want = rb.prefill(&prompt).unwrap();
    for numerics in [Numerics::F32, Numerics::Int8] {
        let o = GpuOptions {
            context_len: 64,
            numerics,
            ..Default::default()
        };
        let mut gb = GpuBackend::with_context(&ctx, src.as_ref(), o).unwrap();
        let got = gb.prefill(&prompt).unwrap();
        let c = cosine(&got, &want);
        assert!(c >= 0.999, "{numerics}: cosine {c} with the oracle");
    }
}

/// The tiny model with one tensor that its source fails to lend (as a source that cannot
/// build it would).
struct Failing {
    inner: Arc<Mem>,
    key: TensorKey,
}

impl WeightSource for Failing {
    fn config(&self) -> &Qwen3MoeConfig {
        self.inner.config()
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        self.inner.weight(key)
    }
    fn with_weight(
        &self,
        key: TensorKey,
        f: &mut dyn FnMut(&Weight<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(key != self.key, "planted failure");
        f(&self.weight(key)?)
    }
}

#[test]
fn a_failed_upload_names_its_tensors_once() {
    let Some(ctx) = gpu("a_failed_upload_names_its_tensors_once") else {
        return;
    };
    // The qkv lends three tensors nested in one another: the error used to name them as
    // three nested causes ("loading Layer(1, AttnQ): loading Layer(1, AttnK): ...").
    let cases = [
        (
            layer(1, LayerTensor::AttnK),
            "loading Layer(1, AttnQ), Layer(1, AttnK) and Layer(1, AttnV): planted failure",
        ),
        (
            layer(1, LayerTensor::FfnNorm),
            "loading Layer(1, FfnNorm): planted failure",
        ),
    ];
    for (key, want) in cases {
        let src = Failing {
            inner: model_with_vocab(5, false, 512),
            key,
        };
        match GpuWeights::upload(&ctx, &src) {
            Ok(_) => panic!("{key:?}: the failure was not reported"),
            Err(e) => assert_eq!(format!("{e:#}"), want),
        }
    }
}
