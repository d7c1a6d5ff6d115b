//! MLX 4-bit checkpoints end to end: synth writes one in mlx-lm's layout, `inspect` reads it,
//! the CPU and GPU backends decode it with greedy parity against the oracle (the GPU on the
//! affine int4 form, multi-stream too), and a NaN scale in the file is a clear error on every
//! backend, never a panic or garbage.

mod common;

use common::{every_backend_refuses_non_finite, have_gpu, nibble, parity_passes, text};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A tiny MLX checkpoint in `dir` (with the Qwen3 tokenizer when vendored; required in CI).
fn synth(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-mlx");
    let tok =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vendor/qwen3-tokenizer/tokenizer.json");
    let mut c = nibble();
    c.args([
        "synth", "--preset", "tiny", "--format", "mlx", "--seed", "2",
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
fn mlx_checkpoint_decodes_on_the_cpu_and_the_gpu_with_oracle_parity() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let out = nibble()
        .args(["inspect", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["format"], "mlx", "{info:#}");
    for t in ["U32", "BF16"] {
        assert!(
            info["bytes_per_type"][t].as_u64().unwrap_or(0) > 0,
            "{info:#}"
        );
    }
    parity_passes(&path, 24, &["--backend", "cpu"]);
    // auto: without a hardware GPU (lavapipe does not count) the CPU backend decodes.
    let out = nibble()
        .args(["generate", "-n", "6", "--prompt", "Hello", "-m"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    if !have_gpu() {
        return;
    }
    // The GPU backend reads the affine (MLX) form in every kernel the decode and both prefills
    // use: greedy parity with the oracle.
    parity_passes(&path, 24, &["--backend", "gpu"]);
    // Every prompt through the GEMM prefill (its f32 kernel reads the affine form): parity too.
    let err = parity_passes(
        &path,
        8,
        &["--backend", "gpu", "-v", "--prefill-gemm-min", "2"],
    );
    assert!(err.contains("GEMM prefill (int4 GEMM, f32 fmas"), "{err}");
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
            "--reps",
            "1",
            "--json",
            "-m",
        ])
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

/// Byte offset in `file` of tensor `name`'s data (from the safetensors header).
fn data_offset(file: &Path, name: &str) -> usize {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize
}

#[test]
fn a_nan_scale_or_bias_in_an_mlx_file_is_a_clear_error_on_every_backend() {
    for tensor in ["scales", "biases"] {
        let dir = tempfile::tempdir().unwrap();
        let path = synth(dir.path());
        let file = path.join("model.safetensors");
        let name = format!("model.layers.1.self_attn.q_proj.{tensor}");
        let at = data_offset(&file, &name);
        let mut bytes = std::fs::read(&file).unwrap();
        // The second group's value becomes a bf16 NaN.
        bytes[at + 2..at + 4].copy_from_slice(&0x7fc0u16.to_le_bytes());
        std::fs::write(&file, bytes).unwrap();
        every_backend_refuses_non_finite(&path, tensor);
    }
}

/// An 8-bit MLX checkpoint (`synth --format mlx --quant q8_0`, as `mlx_lm.convert --q-bits 8`):
/// the GPU reads it in the 8-bit affine form; greedy parity with the oracle through both
/// prefills, the CPU backend too.
#[test]
fn eight_bit_mlx_checkpoint_decodes_on_the_gpu_with_oracle_parity() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-mlx8");
    let out = nibble()
        .args([
            "synth", "--preset", "tiny", "--format", "mlx", "--quant", "q8_0",
        ])
        .args(["--seed", "3", "--quiet", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "synth: {}", text(&out.stderr));
    let config: Value =
        serde_json::from_slice(&std::fs::read(path.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization"]["bits"], 8, "{config:#}");
    parity_passes(&path, 16, &["--backend", "cpu"]);
    if !have_gpu() {
        return;
    }
    let err = parity_passes(&path, 64, &["--backend", "gpu", "-v"]);
    assert!(err.contains("affine 8-bit (MLX_A8) weights"), "{err}");
    let err = parity_passes(
        &path,
        8,
        &["--backend", "gpu", "-v", "--prefill-gemm-min", "2"],
    );
    assert!(err.contains("GEMM prefill (int4 GEMM, f32 fmas"), "{err}");
}
