//! Helpers shared by the CLI test files that drive `nibble` on synthetic checkpoints (mlx.rs,
//! byte_files.rs): the binary, its output as text, the parity check and the refusal of a
//! corrupted file they use.
#![allow(dead_code)]

use serde_json::Value;
use std::path::Path;
use std::process::Command;

pub fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
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
