//! Helpers shared by the CLI test files that drive `nibble` on synthetic checkpoints: the binary,
//! its output as text, a run with stdin, the tiny model with the real tokenizer (cli.rs,
//! generate_chat.rs), the parity check and the refusal of a corrupted file (mlx.rs,
//! byte_files.rs).
#![allow(dead_code)]

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

pub fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn tokenizer_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("NIBBLE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vendor/qwen3-tokenizer")
        });
    if dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI: tokenizer missing at {}",
        dir.display()
    );
    eprintln!(
        "SKIP: no tokenizer at {} (run scripts/fetch-tokenizer.sh)",
        dir.display()
    );
    None
}

/// The tiny model (seed 1) with the tokenizer, made once per test binary.
pub fn model() -> Option<&'static Path> {
    static MODEL: OnceLock<Option<(tempfile::TempDir, PathBuf)>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let tok = tokenizer_dir()?;
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tiny.gguf");
            let out = nibble()
                .args(["synth", "--preset", "tiny", "--seed", "1", "--quiet", "-o"])
                .arg(&path)
                .arg("--tokenizer")
                .arg(tok.join("tokenizer.json"))
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "synth failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Some((dir, path))
        })
        .as_ref()
        .map(|(_, p)| p.as_path())
}

pub fn run(args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = nibble();
    c.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        // A command that fails at start-up may exit before reading: a broken pipe here.
        if let Err(e) = input.write_all(s.as_bytes()) {
            assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
        }
    }
    drop(input);
    child.wait_with_output().unwrap()
}

pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// `nibble parity --json -n N` with `args` on `path`: asserts it passes with every prompt's N
/// ids equal to the oracle's and min cos >= 0.99999; returns stderr.
pub fn parity_passes(path: &Path, n: usize, args: &[&str]) -> String {
    let out = nibble()
        .args(["parity", "--json", "-n", &n.to_string()])
        .args(args)
        .arg("-m")
        .arg(path)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    let j: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("no JSON ({e}): {err}"));
    assert_eq!(j["pass"], Value::Bool(true), "{j:#}\n{err}");
    for p in j["prompts"].as_array().unwrap() {
        let (o, f) = (ids(&p["oracle_tokens"]), ids(&p["fast_tokens"]));
        assert_eq!((o.len(), &o), (n, &f), "{p:#}");
        assert!(p["min_cosine"].as_f64().unwrap() >= 0.99999, "{p:#}");
    }
    err
}

/// Whether a wgpu adapter exists (lavapipe counts); in CI one must.
pub fn have_gpu() -> bool {
    let have = nibble_gpu::Context::new(&nibble_gpu::AdapterChoice::Auto).is_ok();
    assert!(
        have || std::env::var_os("CI").is_none(),
        "no wgpu adapter and CI is set"
    );
    have
}

/// `nibble generate` on `path` with each backend (the GPU where an adapter exists): every one
/// exits with status 1 and a clear "non-finite" error, no panic; `what` labels failures.
pub fn every_backend_refuses_non_finite(path: &Path, what: &str) {
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
            .arg(path)
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{backend} {what}: {err}");
        assert!(
            err.contains("non-finite") && !err.contains("panicked"),
            "{backend} {what}: {err}"
        );
    }
}
