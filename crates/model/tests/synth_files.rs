//! Synthetic models: both file formats hold exactly the same weights, every tensor nibble
//! writes is read back bit-identical, and the loader rejects lying files by tensor name.

use nibble_model::config::Qwen3MoeConfig;
use nibble_model::loader;
use nibble_model::synth::{self, SynthParams};
use nibble_model::weights::{LayerTensor, TensorKey};

fn small_cfg() -> Qwen3MoeConfig {
    // Tiny architecture with a reduced vocabulary so the test runs in well under a second.
    Qwen3MoeConfig {
        vocab_size: 1024,
        ..Qwen3MoeConfig::tiny()
    }
}

fn decode(w: &nibble_model::weights::Weight) -> Vec<f32> {
    let bytes: Vec<u8> = w.parts.concat();
    let mut out = vec![0f32; w.elements()];
    nibble_quant::dequantize(w.dtype, &bytes, &mut out).unwrap();
    out
}

#[test]
fn gguf_round_trip_is_bit_identical() {
    let cfg = small_cfg();
    let p = SynthParams {
        seed: 7,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    synth::write_gguf(&cfg, &p, None, &path, true).unwrap();
    let m = loader::open(&path).unwrap();
    // Without a tokenizer the GGUF names no special ids, and 151643/151645 lie past this vocab.
    let want = Qwen3MoeConfig {
        eos_token_ids: vec![],
        bos_token_id: None,
        ..cfg.clone()
    };
    assert_eq!(m.weights.config(), &want);
    for k in TensorKey::all(&cfg) {
        let w = m.weights.weight(k).unwrap();
        assert_eq!(w.dtype, synth::gguf_dtype(k), "{k:?}");
        assert_eq!(
            w.parts.concat(),
            synth::tensor_bytes(&cfg, &p, k),
            "{k:?} bytes differ"
        );
    }
    let info = m.info().unwrap();
    assert_eq!(info.tensor_count, 3 + 12 * cfg.num_layers);
    assert_eq!(
        info.resident_bytes,
        synth::gguf_tensor_bytes(&cfg, synth::QuantMix::Q4_0)
    );
    assert!(!info.tokenizer && !info.chat_template);
}

#[test]
fn safetensors_holds_the_same_weights_as_gguf() {
    let cfg = small_cfg();
    let p = SynthParams {
        seed: 3,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("m.gguf");
    let hf = dir.path().join("hf");
    synth::write_gguf(&cfg, &p, None, &gguf, true).unwrap();
    synth::write_safetensors(&cfg, &p, &hf, true).unwrap();
    let a = loader::open(&gguf).unwrap();
    let b = loader::open(&hf).unwrap();
    assert_eq!(b.format, "safetensors");
    assert_eq!(b.weights.config().hidden_size, cfg.hidden_size);
    for k in TensorKey::all(&cfg) {
        let (wa, wb) = (a.weights.weight(k).unwrap(), b.weights.weight(k).unwrap());
        assert_eq!(wa.shape, wb.shape, "{k:?}");
        let (va, vb) = (decode(&wa), decode(&wb));
        assert!(synth::is_exact_in_bf16(&va), "{k:?} not exact in bf16");
        assert_eq!(va, vb, "{k:?} values differ between formats");
    }
    // Experts are stacked from one safetensors tensor per expert.
    let w = b
        .weights
        .weight(TensorKey::Layer(1, LayerTensor::ExpDown))
        .unwrap();
    assert_eq!(w.parts.len(), cfg.num_experts);
}

#[test]
fn weights_are_random_and_scaled() {
    let cfg = small_cfg();
    let p = SynthParams::default();
    let q = synth::tensor_bytes(&cfg, &p, TensorKey::Layer(0, LayerTensor::AttnQ));
    let mut v = vec![0f32; cfg.q_dim() * cfg.hidden_size];
    nibble_quant::dequantize(nibble_quant::DType::Q4_0, &q, &mut v).unwrap();
    let mean = v.iter().sum::<f32>() / v.len() as f32;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt();
    let want = 1.0 / (cfg.hidden_size as f32).sqrt();
    assert!(mean.abs() < 0.05 * want, "mean {mean}");
    assert!(std > 0.5 * want && std < 2.0 * want, "std {std} vs {want}");
    // Different seeds give different weights; the same seed the same.
    let p2 = SynthParams {
        seed: 1,
        ..p.clone()
    };
    assert_ne!(
        q,
        synth::tensor_bytes(&cfg, &p2, TensorKey::Layer(0, LayerTensor::AttnQ))
    );
    assert_eq!(
        q,
        synth::tensor_bytes(&cfg, &p, TensorKey::Layer(0, LayerTensor::AttnQ))
    );
}

/// `--quant q8_0` holds exactly the Q4_0 mix's values of the same seed, every matrix in Q8_0
/// (norms and router stay F32) with levels past the nibble range, so the byte form's high bits
/// are exercised by whole-model tests.
#[test]
fn q8_0_mix_holds_the_q4_0_values() {
    let cfg = small_cfg();
    let dir = tempfile::tempdir().unwrap();
    let (p4, p8) = (dir.path().join("q4.gguf"), dir.path().join("q8.gguf"));
    let p = |mix| SynthParams {
        seed: 9,
        mix,
        ..Default::default()
    };
    synth::write_gguf(&cfg, &p(synth::QuantMix::Q4_0), None, &p4, true).unwrap();
    synth::write_gguf(&cfg, &p(synth::QuantMix::Q8_0), None, &p8, true).unwrap();
    let (m4, m8) = (loader::open(&p4).unwrap(), loader::open(&p8).unwrap());
    let mut big = false;
    for k in TensorKey::all(&cfg) {
        let (w4, w8) = (m4.weights.weight(k).unwrap(), m8.weights.weight(k).unwrap());
        let want = if w4.dtype == nibble_quant::DType::Q4_0 {
            nibble_quant::DType::Q8_0
        } else {
            w4.dtype
        };
        assert_eq!(w8.dtype, want, "{k:?}");
        let (a, b) = (decode(&w4), decode(&w8));
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{k:?}"
        );
        if w8.dtype == nibble_quant::DType::Q8_0 {
            let bytes = w8.parts.concat();
            big |= bytes
                .chunks_exact(34)
                .any(|blk| blk[2..].iter().any(|&q| (q as i8).unsigned_abs() > 15));
        }
    }
    assert!(big, "no level outside the nibble range");
}

/// Writing over a model that is open (a server has it mapped) replaces the file whole: the open
/// model keeps its weights and a fresh open sees the new ones (it was rewritten in place, the
/// open model reading a mix of both); the new file is readable by all, as before.
#[test]
fn writing_over_an_open_model_replaces_it_whole() {
    let cfg = small_cfg();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let seed = |seed| SynthParams {
        seed,
        ..Default::default()
    };
    synth::write_gguf(&cfg, &seed(1), None, &path, true).unwrap();
    let old = loader::open(&path).unwrap();
    synth::write_gguf(&cfg, &seed(2), None, &path, true).unwrap();
    let new = loader::open(&path).unwrap();
    let k = TensorKey::Layer(1, LayerTensor::ExpDown);
    let bytes = |m: &loader::LoadedModel| m.weights.weight(k).unwrap().parts.concat();
    let same = |m: &loader::LoadedModel, s| bytes(m) == synth::tensor_bytes(&cfg, &seed(s), k);
    assert!(same(&old, 1), "the open model's weights changed under it");
    assert!(same(&new, 2), "the new file does not hold the new weights");
    // Only the model is left in the directory.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o444, 0o444, "{mode:o}");
    }
}
