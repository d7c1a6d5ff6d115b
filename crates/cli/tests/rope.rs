//! RoPE scaling from the command line: llama.cpp's `--rope-scaling yarn --rope-scale F
//! --yarn-orig-ctx N` on a plain model gives what the same model written with YaRN in its file
//! gives, `--rope-scaling none` drops a file's scaling, the scaling raises the context `--ctx`
//! may ask for, and bad combinations are named.

mod common;
use common::{nibble, parity_passes, text};
use std::path::{Path, PathBuf};

const YARN: [&str; 6] = [
    "--rope-scaling",
    "yarn",
    "--rope-scale",
    "4",
    "--yarn-orig-ctx",
    "1024",
];

/// The tiny model (seed 1) with the tokenizer, written with `extra` synth flags.
fn synth(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let tok = common::tokenizer_dir().unwrap();
    let path = dir.join(name);
    let out = nibble()
        .args(["synth", "--preset", "tiny", "--seed", "1", "--quiet", "-o"])
        .arg(&path)
        .arg("--tokenizer")
        .arg(tok.join("tokenizer.json"))
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "synth: {}", text(&out.stderr));
    path
}

/// Greedy text of 16 tokens on `backend`, with `extra` flags.
fn generate(model: &Path, backend: &str, extra: &[&str]) -> String {
    let out = nibble()
        .args(["generate", "-p", "The capital of France is", "-n", "16"])
        .args(["--temperature", "0", "--backend", backend, "-m"])
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "generate: {}", text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn flags_equal_a_file_with_the_scaling_and_extend_the_context() {
    if common::tokenizer_dir().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plain = synth(dir.path(), "plain.gguf", &[]);
    let yarn = synth(dir.path(), "yarn.gguf", &YARN);
    let out = nibble().arg("inspect").arg(&yarn).output().unwrap();
    assert!(
        text(&out.stdout).contains("rope scaling yarn x4 over 1024 positions")
            && text(&out.stdout).contains("context up to 4096"),
        "{}",
        text(&out.stdout)
    );
    for backend in ["ref", "cpu"] {
        let from_file = generate(&yarn, backend, &[]);
        assert_eq!(generate(&plain, backend, &YARN), from_file, "{backend}");
        assert_ne!(generate(&plain, backend, &[]), from_file, "{backend}");
        assert_eq!(
            generate(&yarn, backend, &["--rope-scaling", "none"]),
            generate(&plain, backend, &[]),
            "{backend}"
        );
    }
    // The file's YaRN is the oracle's too: the CPU backend passes parity against it.
    parity_passes(&yarn, 8, &["--backend", "cpu"]);

    // The tiny model's own context is 4096; YaRN x4 over 4096 reaches 16384.
    let long = ["--ctx", "8192"];
    let out = nibble()
        .args(["generate", "-p", "Hi", "-n", "2", "--backend", "ref", "-m"])
        .arg(&plain)
        .args(long)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(
        out.status.code() == Some(1)
            && err.contains("context of 4096")
            && err.contains("--rope-scaling"),
        "{err}"
    );
    let text_long = generate(
        &plain,
        "ref",
        &[
            "--ctx",
            "8192",
            "--rope-scaling",
            "yarn",
            "--rope-scale",
            "4",
        ],
    );
    assert!(!text_long.is_empty());
}

#[test]
fn bad_rope_flags_are_named() {
    let Some(model) = common::model() else {
        return;
    };
    for (flags, says) in [
        (&["--rope-scale", "4"][..], "need --rope-scaling"),
        (&["--rope-scaling", "yarn"][..], "needs --rope-scale"),
        (
            &["--rope-scaling", "yarn", "--rope-scale", "0.5"][..],
            "--rope-scale 0.5",
        ),
        (
            &[
                "--rope-scaling",
                "linear",
                "--rope-scale",
                "2",
                "--yarn-orig-ctx",
                "9",
            ][..],
            "yarn only",
        ),
        (
            &["--rope-scaling", "dynamic"][..],
            "invalid value 'dynamic'",
        ),
    ] {
        let out = nibble()
            .args(["generate", "-p", "Hi", "-n", "2", "--backend", "ref", "-m"])
            .arg(model)
            .args(flags)
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says) && !err.contains("panicked"),
            "{flags:?}: {err}"
        );
    }
}
