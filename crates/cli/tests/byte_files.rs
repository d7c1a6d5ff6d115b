//! GGUF files whose matrices the GPU reads in its byte forms or its K form, end to end: Q8_0
//! (llama.cpp's 8-bit files; synth writes the Q4_0 model's values), Q6_K (llama.cpp's `Q6_K`
//! files), Q4_K with no mixture (`llama-quantize --pure`), `Q4_K_M` (Q4_K with Q6_K in the
//! lm_head and in some layers' attn_v and ffn_down_exps: each tensor in its own form, the qkv
//! a stack of both) and `Q5_K_M` (the same mixture on Q5_K, `QForm::Q5K`). `inspect` counts the file's types, the GPU backend decodes it
//! (`QForm::Q8_0`, `QForm::Q6K`, `QForm::Q4K`)
//! with greedy parity against the oracle, through both prefills (the GEMMs on f32 fmas: the
//! matrix units read the nibble forms only), multi-stream ids equal single-stream ones, and a
//! NaN scale in the file is a clear error on every backend.

mod common;

use common::{every_backend_refuses_non_finite, have_gpu, nibble, parity_passes, text};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One file type: synth's preset and `--quant`, the type's name, and its block's bytes and
/// the offset of its f16 scale in the block.
struct Kind {
    preset: &'static str,
    quant: &'static str,
    dtype: &'static str,
    block: usize,
    scale_at: usize,
    /// The GPU's forms as `--verbose` names them.
    forms: &'static str,
    /// Greedy tokens of the decode parity check (the bar, 128, where the type is the
    /// only one of its form; a mixture of forms tested elsewhere takes fewer).
    tokens: usize,
}

/// Q8_0 on the tiny model.
const Q8_0: Kind = Kind {
    tokens: 128,
    forms: "Q8_0",
    preset: "tiny",
    quant: "q8_0",
    dtype: "Q8_0",
    block: 34,
    scale_at: 0,
};

/// Q6_K on the small model (its rows are whole 256-weight super-blocks; the tiny model's are
/// not, so synth would keep them Q4_0).
const Q6_K: Kind = Kind {
    tokens: 128,
    forms: "Q6_K",
    preset: "small",
    quant: "q6_k",
    dtype: "Q6_K",
    block: 210,
    scale_at: 208,
};

/// Q4_K with no mixture (`llama-quantize --pure`) on the small model: the K form.
const Q4_K: Kind = Kind {
    tokens: 128,
    forms: "Q4_K",
    preset: "small",
    quant: "q4_k",
    dtype: "Q4_K",
    block: 144,
    scale_at: 0,
};

/// llama.cpp's `Q4_K_M` mixture on the small model (8 layers: layers 0, 3, 6 and 7 have the
/// Q6_K attn_v and ffn_down_exps; synth's `QuantMix::Q4KM`).
const Q4_K_M: Kind = Kind {
    tokens: 128,
    preset: "small",
    quant: "q4_k_m",
    dtype: "Q4_K",
    block: 144,
    scale_at: 0,
    forms: "Q6_K+Q4_K",
};

/// llama.cpp's `Q5_K_M` mixture on the small model: Q5_K (nibbles and a word of fifth bits per
/// block, with Q4_K's scale words) and Q6_K as in [`Q4_K_M`]; 32 tokens (Q6_K's run holds the 128).
const Q5_K_M: Kind = Kind {
    tokens: 32,
    preset: "small",
    quant: "q5_k_m",
    dtype: "Q5_K",
    block: 176,
    scale_at: 0,
    forms: "Q6_K+Q5_K",
};

/// A GGUF of `k` in `dir` (with the Qwen3 tokenizer when vendored; required in CI).
fn synth(dir: &Path, k: &Kind) -> PathBuf {
    let path = dir.join(format!("{}-{}.gguf", k.preset, k.quant));
    let tok =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vendor/qwen3-tokenizer/tokenizer.json");
    let mut c = nibble();
    c.args([
        "synth", "--preset", k.preset, "--quant", k.quant, "--seed", "4",
    ])
    .args(["--quiet", "-o"])
    .arg(&path);
    if tok.is_file() {
        c.arg("--tokenizer").arg(&tok);
    } else {
        assert!(std::env::var_os("CI").is_none(), "CI: tokenizer missing");
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "synth: {}", text(&out.stderr));
    path
}

#[test]
fn q8_0_file_decodes_on_the_gpu_with_oracle_parity() {
    decodes_on_the_gpu_with_oracle_parity(&Q8_0);
}

#[test]
fn q6_k_file_decodes_on_the_gpu_with_oracle_parity() {
    decodes_on_the_gpu_with_oracle_parity(&Q6_K);
}

#[test]
fn q4_k_file_decodes_on_the_gpu_with_oracle_parity() {
    decodes_on_the_gpu_with_oracle_parity(&Q4_K);
}

#[test]
fn q4_k_m_file_decodes_on_the_gpu_with_oracle_parity() {
    decodes_on_the_gpu_with_oracle_parity(&Q4_K_M);
}

#[test]
fn q5_k_m_file_decodes_on_the_gpu_with_oracle_parity() {
    decodes_on_the_gpu_with_oracle_parity(&Q5_K_M);
}

fn decodes_on_the_gpu_with_oracle_parity(k: &Kind) {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path(), k);
    let out = nibble()
        .args(["inspect", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let types = &info["bytes_per_type"];
    for t in k.forms.split('+') {
        assert!(types[t].as_u64().unwrap_or(0) > 0, "{t}: {info:#}");
    }
    assert!(types.get("Q4_0").is_none(), "{info:#}");
    if !have_gpu() {
        return;
    }
    // The form in every kernel the decode and the column prefill use: `k.tokens` greedy tokens
    // equal to the oracle's (128 as the bar for the tiny model asks).
    let err = parity_passes(&path, k.tokens, &["--backend", "gpu", "-v"]);
    assert!(
        err.contains(&format!("{} weights, numerics f32", k.forms)) && err.contains("f32 fmas"),
        "{err}"
    );
    // Every layer's qkv warms its o-proj and every down the next qkv, a qkv of two forms
    // (a `Q4_K_M` file's v in Q6_K: a dispatch per form) too.
    let layers = if k.preset == "tiny" { 4 } else { 8 };
    let warm = format!(
        "L2 warming qkv -> o-proj in {layers} layers, down -> next qkv in {},",
        layers - 1
    );
    assert!(err.contains(&warm), "{err}");
    // Every prompt through the GEMM prefill (its f32 kernel reads the byte form; the matrix
    // units do not): parity too.
    let err = parity_passes(
        &path,
        16,
        &["--backend", "gpu", "-v", "--prefill-gemm-min", "2"],
    );
    assert!(err.contains("GEMM prefill (int4 GEMM, f32 fmas"), "{err}");
    // The per-token path gives the same ids.
    parity_passes(&path, 16, &["--backend", "gpu", "--per-token"]);
    // Multi-stream decode on the column kernels: every stream's ids equal its single-stream ids.
    let out = nibble()
        .args([
            "bench",
            "--backend",
            "gpu",
            "-p",
            "8",
            "-n",
            "12",
            "--batch",
            "2",
        ])
        .args(["--reps", "1", "--json", "-m"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let j: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON ({e}): {}", text(&out.stderr)));
    let batch = j["stats"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["batch"] == 2)
        .unwrap_or_else(|| panic!("no batch row: {j:#}"));
    assert_eq!(batch["streams_equal_single"], 2, "{batch:#}");
}

#[test]
fn a_nan_scale_in_a_q8_0_file_is_a_clear_error_on_every_backend() {
    nan_scale_is_a_clear_error(&Q8_0);
}

#[test]
fn a_nan_scale_in_a_q6_k_file_is_a_clear_error_on_every_backend() {
    nan_scale_is_a_clear_error(&Q6_K);
}

#[test]
fn a_nan_scale_in_a_q4_k_file_is_a_clear_error_on_every_backend() {
    nan_scale_is_a_clear_error(&Q4_K);
}

fn nan_scale_is_a_clear_error(k: &Kind) {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path(), k);
    let gguf = nibble_formats::gguf::GgufFile::open(&path).unwrap();
    let info = gguf
        .tensors()
        .iter()
        .find(|t| t.name == "blk.1.attn_q.weight")
        .unwrap();
    let at = (gguf.data_offset() + info.offset) as usize;
    drop(gguf);
    let mut bytes = std::fs::read(&path).unwrap();
    // The third block's f16 scale becomes a NaN, in a matrix every token reads (the CPU
    // backends find a bad scale where a product turns non-finite, so an expert the prompt never
    // routes to would go unread there).
    let at = at + 2 * k.block + k.scale_at;
    bytes[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    every_backend_refuses_non_finite(&path, k.dtype);
}
