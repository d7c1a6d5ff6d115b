//! The loader checks every tensor against the config: a lying file is refused by name.

use nibble_formats::gguf::{GgufWriter, MetaValue, TensorSpec};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::loader;
use nibble_model::qwen3_moe::{gguf_metadata, gguf_name};
use nibble_model::synth::{self, SynthParams};
use nibble_model::weights::{LayerTensor, TensorKey};
use nibble_quant::DType;

fn cfg() -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: 256,
        num_layers: 2,
        ..Qwen3MoeConfig::tiny()
    }
}

/// Write a synthetic GGUF where `edit` may change each tensor's spec (or drop it with None).
fn write(
    edit: impl Fn(TensorKey, TensorSpec) -> Option<TensorSpec>,
) -> (tempfile::TempDir, std::path::PathBuf) {
    write_meta(gguf_metadata(&cfg(), "t"), edit)
}

/// [`write`] with the metadata `meta` (the tensors are still [`cfg`]'s).
fn write_meta(
    meta: Vec<(String, MetaValue)>,
    edit: impl Fn(TensorKey, TensorSpec) -> Option<TensorSpec>,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let c = cfg();
    let p = SynthParams::default();
    let mut specs = vec![];
    let mut keys = vec![];
    for k in TensorKey::all(&c) {
        let s = TensorSpec {
            name: gguf_name(k),
            dtype: synth::gguf_dtype(k),
            shape: k.shape(&c).iter().map(|d| *d as u64).collect(),
        };
        if let Some(s) = edit(k, s) {
            specs.push(s);
            keys.push(k);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let f = std::fs::File::create(&path).unwrap();
    let mut w = GgufWriter::new(f, meta, specs.clone()).unwrap();
    for (k, s) in keys.iter().zip(&specs) {
        let n: u64 = s.shape.iter().product();
        let bytes = if s.dtype == synth::gguf_dtype(*k)
            && s.shape == k.shape(&c).iter().map(|d| *d as u64).collect::<Vec<_>>()
        {
            synth::tensor_bytes(&c, &p, *k)
        } else {
            // A random-but-valid payload for the edited spec.
            let vals: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.01)
                .collect();
            nibble_quant::encode_float(s.dtype, &vals)
        };
        w.write_tensor(&s.name, &bytes).unwrap();
    }
    w.finish().unwrap();
    (dir, path)
}

fn err_of(path: &std::path::Path) -> String {
    match loader::open(path) {
        Ok(_) => panic!("a lying file was accepted"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn well_formed_file_opens() {
    let (_d, p) = write(|_, s| Some(s));
    loader::open(&p).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let (_d, p) = write(|k, s| (k != TensorKey::Layer(1, LayerTensor::AttnK)).then_some(s));
    let e = err_of(&p);
    assert!(
        e.contains("missing tensor `blk.1.attn_k.weight`") && e.contains("m.gguf"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let (_d, p) = write(|k, mut s| {
        if k == TensorKey::Layer(0, LayerTensor::ExpUp) {
            s.shape[1] = 32; // I = 32 instead of 64
        }
        Some(s)
    });
    let e = err_of(&p);
    assert!(
        e.contains("blk.0.ffn_up_exps.weight")
            && e.contains("shape [16, 32, 64]")
            && e.contains("expected [16, 64, 64]"),
        "{e}"
    );
}

#[test]
fn quantised_norm_is_refused() {
    let (_d, p) = write(|k, mut s| {
        if k == TensorKey::Layer(0, LayerTensor::QNorm) {
            s.dtype = DType::Q8_0;
        }
        Some(s)
    });
    let e = err_of(&p);
    assert!(
        e.contains("blk.0.attn_q_norm.weight") && e.contains("Q8_0"),
        "{e}"
    );
}

/// The error of opening a tensorless GGUF whose metadata is the config's with `key` set to
/// `value` (and `qwen3moe.vocab_size` given, as there is no embedding to infer it from).
fn meta_err(key: &str, value: MetaValue) -> String {
    let mut meta = gguf_metadata(&cfg(), "t");
    meta.retain(|(k, _)| k != key);
    meta.push((key.into(), value));
    meta.push(("qwen3moe.vocab_size".into(), MetaValue::U32(256)));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let w = GgufWriter::new(std::fs::File::create(&path).unwrap(), meta, vec![]).unwrap();
    w.finish().unwrap();
    err_of(&path)
}

#[test]
fn bad_config_metadata_is_named() {
    // A GGUF claiming 3 kv heads for 4 query heads.
    let e = meta_err("qwen3moe.attention.head_count_kv", MetaValue::U32(3));
    assert!(
        e.contains("num_key_value_heads") && e.contains("m.gguf"),
        "{e}"
    );
}

/// A token id wider than u32 in the GGUF metadata is named, not truncated into another id
/// (2^32 + 93674 would have become 93674, a valid id of this vocabulary's size).
#[test]
fn token_id_past_u32_is_named() {
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"] {
        let e = meta_err(key, MetaValue::U64((1 << 32) + 93674));
        assert!(
            e.contains(key) && e.contains("4295060970 does not fit in 32 bits"),
            "{key}: {e}"
        );
    }
}

/// A file that is not GGUF (bad magic, empty) is named as such, even beside a model directory's
/// files, instead of loading that directory's model or blaming its missing config.json.
#[test]
fn a_file_without_the_gguf_magic_is_named() {
    let (dir, good) = write(|_, s| Some(s));
    for (name, bytes) in [
        ("bad.gguf", &b"GGUX\x03\0\0\0"[..]),
        ("empty.gguf", &b""[..]),
        ("model.bin", &b"GGUF"[..3]),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = err_of(&p);
        assert!(
            e.contains(name) && e.contains("not a GGUF file"),
            "{name}: {e}"
        );
    }
    loader::open(&good).unwrap();
}

/// A synthetic Hugging Face directory of [`cfg`] whose config.json has `edit` applied.
fn hf_with(edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth::write_safetensors(&cfg(), &SynthParams::default(), dir.path(), true).unwrap();
    let config = dir.path().join("config.json");
    let mut v = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&config, v.to_string()).unwrap();
    dir
}

#[test]
fn tensors_the_metadata_does_not_describe_are_refused() {
    // GGUF: block_count 1 over two layers of tensors (it used to run one layer).
    let one_layer = Qwen3MoeConfig {
        num_layers: 1,
        ..cfg()
    };
    let (_d, p) = write_meta(gguf_metadata(&one_layer, "t"), |_, s| Some(s));
    let e = err_of(&p);
    assert!(
        e.contains("12 tensor(s) are not part of the 1-layer, 16-expert model")
            && e.contains("first `blk.1.attn_k.weight`")
            && e.contains("m.gguf"),
        "{e}"
    );
    // Hugging Face: config.json's num_hidden_layers 1 over two layers.
    let dir = hf_with(|v| v["num_hidden_layers"] = 1.into());
    let e = err_of(dir.path());
    assert!(
        e.contains("not part of the 1-layer") && e.contains("first `model.layers.1."),
        "{e}"
    );
}

#[test]
fn a_tied_checkpoint_may_carry_an_lm_head_which_is_dropped() {
    // transformers and mlx-lm drop the lm_head of a tied checkpoint; so does nibble.
    let dir = hf_with(|v| v["tie_word_embeddings"] = true.into());
    let m = loader::open(dir.path()).unwrap();
    let (out, embd) = (
        m.weights.weight(TensorKey::Output).unwrap(),
        m.weights.weight(TensorKey::TokenEmbd).unwrap(),
    );
    assert_eq!(out.parts, embd.parts);
}

/// Only a regular file or a directory is opened: weights are memory-mapped, and opening a pipe
/// with no writer blocked forever (a pipe with one gave "No such device").
#[cfg(unix)]
#[test]
fn a_device_or_pipe_is_not_opened() {
    let e = err_of(std::path::Path::new("/dev/null"));
    assert!(
        e.contains("/dev/null: not a regular file or a directory"),
        "{e}"
    );
}
