//! Q8_0 GGUF files (llama.cpp's 8-bit files) end to end on the GPU: synth writes one holding
//! the Q4_0 model's values, `inspect` counts its types, the GPU backend decodes it on the byte
//! form (`QForm::Q8_0`) with greedy parity against the oracle, through both prefills (the
//! GEMMs on f32 fmas: the matrix units read the nibble forms only), multi-stream ids equal
//! single-stream ones,
//! and a NaN scale in the file is a clear error on every backend.

mod common;

use common::{have_gpu, nibble, parity_passes, text};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A tiny Q8_0 GGUF in `dir` (with the Qwen3 tokenizer when vendored; required in CI).
fn synth(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-q8.gguf");
    let tok =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vendor/qwen3-tokenizer/tokenizer.json");
    let mut c = nibble();
    c.args([
        "synth", "--preset", "tiny", "--quant", "q8_0", "--seed", "4",
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
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let out = nibble()
        .args(["inspect", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let types = &info["bytes_per_type"];
    assert!(types["Q8_0"].as_u64().unwrap_or(0) > 0, "{info:#}");
    assert!(types.get("Q4_0").is_none(), "{info:#}");
    if !have_gpu() {
        return;
    }
    // The byte form in every kernel the decode and the column prefill use: 128 greedy tokens
    // equal to the oracle's, as the bar for the tiny model asks.
    let err = parity_passes(&path, 128, &["--backend", "gpu", "-v"]);
    assert!(
        err.contains("Q8_0 weights, numerics f32") && err.contains("f32 fmas"),
        "{err}"
    );
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
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let gguf = nibble_formats::gguf::GgufFile::open(&path).unwrap();
    let info = gguf
        .tensors()
        .iter()
        .find(|t| t.name == "blk.1.ffn_down_exps.weight")
        .unwrap();
    let at = (gguf.data_offset() + info.offset) as usize;
    drop(gguf);
    let mut bytes = std::fs::read(&path).unwrap();
    // The third block's f16 scale becomes a NaN.
    bytes[at + 2 * 34..at + 2 * 34 + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let gpu = have_gpu();
    for backend in ["cpu", "ref", "gpu"] {
        if backend == "gpu" && !gpu {
            continue;
        }
        let out = nibble()
            .args([
                "generate",
                "--backend",
                backend,
                "-n",
                "2",
                "--prompt",
                "Hi",
                "-m",
            ])
            .arg(&path)
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{backend}: {err}");
        assert!(
            err.contains("non-finite") && !err.contains("panicked"),
            "{backend}: {err}"
        );
    }
}
