//! MLX checkpoints: every weight the loader serves equals formats-spec §4.1's element formula
//! applied to the file's own arrays (words, scales, biases), lies within half a quantisation
//! step of the synthetic model's values, and files that disagree with their config are refused
//! by name.

use half::bf16;
use nibble_formats::safetensors::SafetensorsModel;
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::loader;
use nibble_model::mlx::MlxWeights;
use nibble_model::qwen3_moe::mlx_module;
use nibble_model::synth::{self, SynthParams};
use nibble_model::weights::{LayerTensor, TensorKey, WeightSource};
use nibble_quant::DType;
use serde_json::Value;
use std::path::Path;

fn cfg() -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: 1024,
        ..Qwen3MoeConfig::tiny()
    }
}

fn decode(w: &nibble_model::weights::Weight) -> Vec<f32> {
    let mut out = vec![0f32; w.elements()];
    nibble_quant::dequantize(w.dtype, &w.parts.concat(), &mut out).unwrap();
    out
}

fn write(dir: &Path) -> SynthParams {
    let p = SynthParams {
        seed: 5,
        ..Default::default()
    };
    synth::write_mlx(&cfg(), &p, dir, true).unwrap();
    p
}

/// Element `(o, i)` of module `m` read as the spec says: word `W[o, i/(32/bits)]`, its
/// `bits`-wide field `i mod (32/bits)` from the least-significant end, `scale·q + bias` with
/// the group's bf16 scale and bias.
fn by_the_spec(st: &SafetensorsModel, m: &str, rows: usize, cols: usize) -> Vec<f32> {
    let raw = |s: &str| st.raw(&format!("{m}.{s}")).unwrap().unwrap();
    let (w, s, b) = (raw("weight"), raw("scales"), raw("biases"));
    let per_word = cols / *w.shape.last().unwrap() as usize;
    let bits = 32 / per_word;
    let word = |o: usize, j: usize| {
        let at = 4 * (o * cols / per_word + j);
        u32::from_le_bytes(w.data[at..at + 4].try_into().unwrap())
    };
    let half = |d: &[u8], at: usize| bf16::from_le_bytes([d[2 * at], d[2 * at + 1]]).to_f32();
    let mut out = Vec::with_capacity(rows * cols);
    for o in 0..rows {
        for i in 0..cols {
            let q = (word(o, i / per_word) >> (bits * (i % per_word))) & ((1 << bits) - 1);
            let g = o * (cols / 64) + i / 64;
            out.push(q as f32 * half(s.data, g) + half(b.data, g));
        }
    }
    out
}

/// The bf16 scale and bias of group `g` (row-major over the whole tensor) of module `m`.
fn group_scale_bias(st: &SafetensorsModel, m: &str, g: usize) -> (f32, f32) {
    let half = |s: &str| {
        let d = st.raw(&format!("{m}.{s}")).unwrap().unwrap().data;
        bf16::from_le_bytes([d[2 * g], d[2 * g + 1]]).to_f32()
    };
    (half("scales"), half("biases"))
}

#[test]
fn weights_follow_the_spec_formula_and_stay_near_the_synthetic_values() {
    check_weights(synth::QuantMix::Q4_0, 0.12);
}

/// `--quant q8_0 --format mlx`: 8-bit matrices (as `mlx_lm.convert --q-bits 8`), the same
/// checks, and an error 16x smaller.
#[test]
fn eight_bit_weights_follow_the_spec_formula_and_stay_nearer() {
    check_weights(synth::QuantMix::Q8_0, 0.0075);
}

/// Every weight of a checkpoint written from `mix` against the spec formula and the synthetic
/// values; the whole tensor within relative RMS error `max_rel`.
fn check_weights(mix: synth::QuantMix, max_rel: f64) {
    let cfg = cfg();
    let dir = tempfile::tempdir().unwrap();
    let p = SynthParams {
        seed: 5,
        mix,
        ..Default::default()
    };
    synth::write_mlx(&cfg, &p, dir.path(), true).unwrap();
    let bits = synth::mlx_bits(mix).unwrap();
    let m = loader::open(dir.path()).unwrap();
    assert_eq!(m.format, "mlx");
    let st = SafetensorsModel::open(dir.path()).unwrap();
    assert_eq!(st.format_tag(), Some("mlx"));
    let mut kinds = std::collections::HashSet::new();
    for k in TensorKey::all(&cfg) {
        let w = m.weights.weight(k).unwrap();
        kinds.insert(w.dtype);
        let got = decode(&w);
        let shape = k.shape(&cfg);
        let cols = *shape.last().unwrap();
        let rows = got.len() / cols;
        // The synthetic model's own values (Q4_0 or Q8_0 matrices, f32 norms and router).
        let mut want = vec![0f32; got.len()];
        nibble_quant::dequantize(
            synth::storage_dtype(&cfg, mix, k),
            &synth::tensor_bytes(&cfg, &p, k),
            &mut want,
        )
        .unwrap();
        match synth::mlx_dtype(k, bits) {
            None => {
                assert_eq!(w.dtype, DType::BF16, "{k:?}");
                assert_eq!(got, want, "{k:?}: norms are exact in bf16");
            }
            Some(d) => {
                assert_eq!(w.dtype, d, "{k:?}");
                let spec = by_the_spec(&st, &mlx_module(k), rows, cols);
                assert!(
                    got.iter()
                        .zip(&spec)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{k:?}: the loader's blocks decode unlike the file's arrays"
                );
                // Every weight is the level of its group nearest the synthetic value, and
                // the whole tensor stays close (the quantiser chose sensible scales).
                let n = if d == DType::MLX_A4 { 15 } else { 255 };
                let (mut err2, mut sum2) = (0f64, 0f64);
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    let (s, z) = group_scale_bias(&st, &mlx_module(k), i / 64);
                    let best = (0..=n)
                        .map(|q| (a - (q as f32 * s + z)).abs())
                        .fold(f32::MAX, f32::min);
                    assert!(
                        (a - b).abs() <= best + s.abs() * 1e-3,
                        "{k:?}[{i}]: {a} became {b}, a level {best} away exists"
                    );
                    err2 += ((a - b) as f64).powi(2);
                    sum2 += (*a as f64).powi(2);
                }
                let rel = (err2 / sum2).sqrt();
                println!("{k:?}: relative RMS error {rel:.4}");
                assert!(rel < max_rel, "{k:?}: relative RMS error {rel}");
            }
        }
    }
    let want_kinds = match bits {
        4 => [DType::MLX_A4, DType::MLX_A8, DType::BF16].into(),
        _ => [DType::MLX_A8, DType::BF16].into(),
    };
    assert_eq!(
        kinds, want_kinds,
        "{bits}-bit matrices, 8-bit routers, bf16 norms"
    );
    // inspect counts packed weights, not words, and the scales as storage only.
    let info = m.info().unwrap();
    let params: u64 = TensorKey::all(&cfg)
        .iter()
        .map(|k| k.shape(&cfg).iter().product::<usize>() as u64)
        .sum();
    assert_eq!(info.parameters, params);
    assert_eq!(info.format, "mlx");
    assert!(info.bytes_per_type["U32"] > 0 && info.bytes_per_type["BF16"] > 0);
}

/// Rewrites config.json with `edit` applied.
fn edit_config(dir: &Path, edit: impl Fn(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn configs_that_lie_about_the_quantisation_are_refused_by_name() {
    let router = mlx_module(TensorKey::Layer(0, LayerTensor::Router));
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["quantization"]["group_size"] = 32.into()),
            "group size 32 is not supported",
        ),
        (
            Box::new(|v| v["quantization"]["bits"] = 3.into()),
            "3-bit MLX quantisation is not supported",
        ),
        (
            Box::new(|v| v["quantization"]["bits"] = 8.into()),
            "`model.embed_tokens.weight` is U32 [1024, 8]; 8-bit groups",
        ),
        (
            Box::new(|v| v["quantization"]["mode"] = "mxfp4".into()),
            "mode \"mxfp4\" is not supported",
        ),
        (
            Box::new(|v| {
                v["quantization"]
                    .as_object_mut()
                    .unwrap()
                    .remove("group_size");
            }),
            "`group_size` is missing",
        ),
        (
            // A per-module entry's missing group size defaults to 64 (mlx's `to_quantized`),
            // so this 8-bit router read as 4-bit groups of 64 disagrees with its shapes.
            Box::new(move |v| v["quantization"][&router] = serde_json::json!({"bits": 4})),
            "4-bit groups",
        ),
        (
            // `null` means "not quantised", as `false` does.
            Box::new(move |v| {
                let r = mlx_module(TensorKey::Layer(0, LayerTensor::Router));
                v["quantization"][&r] = Value::Null;
            }),
            "model.layers.0.mlp.gate.weight` has dtype U32",
        ),
        (
            Box::new(move |v| {
                let r = mlx_module(TensorKey::Layer(0, LayerTensor::Router));
                v["quantization"][&r] = false.into();
            }),
            "model.layers.0.mlp.gate.weight` has dtype U32",
        ),
        (
            // Fewer layers than the file holds: mlx-lm's strict load refuses the rest too.
            Box::new(|v| v["num_hidden_layers"] = 1.into()),
            "are not part of the 1-layer",
        ),
    ];
    for (edit, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path());
        edit_config(dir.path(), edit);
        let e = format!("{:#}", loader::open(dir.path()).err().expect("refused"));
        assert!(e.contains(want), "want {want:?} in: {e}");
    }
    // An empty per-module entry is 4-bit groups of 64: what the experts are, so it opens.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let gate = mlx_module(TensorKey::Layer(1, LayerTensor::ExpGate));
    edit_config(dir.path(), |v| {
        v["quantization"][&gate] = serde_json::json!({})
    });
    loader::open(dir.path()).expect("an empty per-module entry takes mlx's defaults");
    // A tied checkpoint's lm_head is dropped, as mlx-lm drops it.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    edit_config(dir.path(), |v| v["tie_word_embeddings"] = true.into());
    loader::open(dir.path()).expect("a tied checkpoint may carry an lm_head");
    // Scales without a quantisation object: the file, not the config, says MLX.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    edit_config(dir.path(), |v| {
        v.as_object_mut().unwrap().remove("quantization");
    });
    let e = format!("{:#}", loader::open(dir.path()).err().expect("refused"));
    assert!(
        e.contains("has scales but config.json has no `quantization`"),
        "{e}"
    );
}

#[test]
fn a_sharded_checkpoint_serves_the_same_weights() {
    let cfg = cfg();
    let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let p = write(one.path());
    let files = synth::write_mlx_sharded(&cfg, &p, many.path(), true, 64 << 10).unwrap();
    assert!(files.len() > 3, "{files:?}");
    assert!(many.path().join("model.safetensors.index.json").is_file());
    let (a, b) = (
        loader::open(one.path()).unwrap(),
        loader::open(many.path()).unwrap(),
    );
    assert_eq!(b.format, "mlx");
    for k in TensorKey::all(&cfg) {
        let (wa, wb) = (a.weights.weight(k).unwrap(), b.weights.weight(k).unwrap());
        assert_eq!(wa.dtype, wb.dtype, "{k:?}");
        assert_eq!(wa.parts.concat(), wb.parts.concat(), "{k:?}");
    }
}

#[test]
fn lent_tensors_are_built_for_their_use_and_only_weight_keeps_them() {
    let cfg = cfg();
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let w = MlxWeights::open(dir.path()).unwrap();
    assert_eq!(w.interleaved_bytes(), 0, "open interleaves nothing");
    let mut lent = Vec::new();
    for k in TensorKey::all(&cfg) {
        w.with_weight(k, &mut |t| {
            lent.push((t.dtype, t.shape.clone(), t.parts.concat()));
            Ok(())
        })
        .unwrap();
        assert_eq!(w.dtype(k).unwrap(), lent.last().unwrap().0, "{k:?}");
    }
    assert_eq!(
        w.interleaved_bytes(),
        0,
        "a lent tensor is freed after its use"
    );
    let mut quantised = 0;
    for (k, (dtype, shape, bytes)) in TensorKey::all(&cfg).into_iter().zip(&lent) {
        let t = w.weight(k).unwrap();
        assert_eq!((&t.dtype, &t.shape), (dtype, shape), "{k:?}");
        assert_eq!(&t.parts.concat(), bytes, "{k:?}");
        let tied = k == TensorKey::Output && cfg.tie_word_embeddings;
        if matches!(t.dtype, DType::MLX_A4 | DType::MLX_A8) && !tied {
            quantised += bytes.len();
        }
    }
    assert!(quantised > 0);
    assert_eq!(
        w.interleaved_bytes(),
        quantised,
        "weight keeps each tensor once"
    );
    // Kept now, so a lent tensor is the kept one.
    let k = TensorKey::Layer(0, LayerTensor::ExpGate);
    w.with_weight(k, &mut |t| {
        assert_eq!(t.parts[0].as_ptr(), w.weight(k).unwrap().parts[0].as_ptr());
        Ok(())
    })
    .unwrap();
    assert_eq!(w.interleaved_bytes(), quantised);
}
