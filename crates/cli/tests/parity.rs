//! `nibble parity` end to end, oracle vs GPU (lavapipe in CI), on synth's tiny model with the
//! real 151936-token vocabulary: the unplanted model passes with identical greedy sequences,
//! and with one weight of layer 2 corrupted in the GPU copy (`--plant-error`) parity fails and
//! the report names layer 2 and the op family of the planted tensor.
//!
//! No Vulkan adapter: the tests fail when env `CI` is set, otherwise they print a loud SKIP.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

/// Whether a wgpu adapter exists (`--backend gpu` takes any, lavapipe included).
fn have_gpu(test: &str) -> bool {
    static HAVE: OnceLock<bool> = OnceLock::new();
    let have = *HAVE.get_or_init(|| {
        nibble_gpu::Context::new(&nibble_gpu::AdapterChoice::Auto)
            .map_err(|e| eprintln!("no GPU context: {e}"))
            .is_ok()
    });
    if !have {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: no wgpu adapter and CI is set: the parity tests must run in CI"
        );
        eprintln!("!!!!!!!! SKIP {test}: no wgpu adapter (install mesa-vulkan-drivers) !!!!!!!!");
    }
    have
}

/// The tiny model (with the Qwen3 tokenizer when it is vendored; required in CI), made once.
fn model() -> &'static Path {
    static MODEL: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, p) = MODEL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let tok = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../vendor/qwen3-tokenizer/tokenizer.json");
        let mut c = nibble();
        c.args(["synth", "--preset", "tiny", "--seed", "1", "--quiet", "-o"])
            .arg(&path);
        if tok.is_file() {
            c.arg("--tokenizer").arg(&tok);
        } else {
            assert!(std::env::var_os("CI").is_none(), "CI: tokenizer missing");
            eprintln!("note: no tokenizer (scripts/fetch-tokenizer.sh): id prompts are used");
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "synth failed: {}", text(&out.stderr));
        (dir, path)
    });
    p
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn parity(extra: &[&str]) -> (Output, Value) {
    parity_on("gpu", extra)
}

fn parity_on(backend: &str, extra: &[&str]) -> (Output, Value) {
    let out = nibble()
        .args(["parity", "--backend", backend, "--json", "-m"])
        .arg(model())
        .args(extra)
        .output()
        .unwrap();
    let json: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "parity printed no JSON ({e}): stdout {} stderr {}",
            text(&out.stdout),
            text(&out.stderr)
        )
    });
    (out, json)
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("an id array")
        .iter()
        .map(|x| x.as_u64().expect("an id"))
        .collect()
}

#[test]
fn parity_passes_oracle_vs_gpu_on_the_tiny_model() {
    if !have_gpu("parity_passes_oracle_vs_gpu_on_the_tiny_model") {
        return;
    }
    let (out, j) = parity(&["-n", "16"]);
    assert!(
        out.status.success(),
        "parity failed: {j:#}\n{}",
        text(&out.stderr)
    );
    assert_eq!(j["pass"], Value::Bool(true), "{j:#}");
    let prompts = j["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 3, "the built-in prompts");
    for p in prompts {
        let (o, f) = (ids(&p["oracle_tokens"]), ids(&p["fast_tokens"]));
        assert_eq!(o.len(), 16, "{p:#}");
        assert_eq!(o, f, "greedy sequences differ: {p:#}");
        // A real sequence, not a constant one.
        assert!(o.iter().any(|t| *t != o[0]), "{p:#}");
        assert_eq!(p["identical"], Value::Bool(true));
        assert!(p["min_cosine"].as_f64().unwrap() >= 0.99999, "{p:#}");
        assert!(p["traced_step"].is_null() && p["first_divergence_op"].is_null());
    }
}

/// The CPU backend against the oracle through the CLI (no GPU needed): greedy ids identical for
/// the built-in prompts, logits cosine at the bar, and host-sampled runs identical too.
#[test]
fn parity_passes_oracle_vs_cpu_on_the_tiny_model() {
    let (out, j) = parity_on("cpu", &["-n", "24", "--sampled", "5"]);
    assert!(out.status.success(), "{j:#}\n{}", text(&out.stderr));
    assert_eq!(j["pass"], Value::Bool(true), "{j:#}");
    for p in j["prompts"].as_array().unwrap() {
        let (o, f) = (ids(&p["oracle_tokens"]), ids(&p["fast_tokens"]));
        assert_eq!((o.len(), &o), (24, &f), "{p:#}");
        assert!(o.iter().any(|t| *t != o[0]), "{p:#}");
        assert!(p["min_cosine"].as_f64().unwrap() >= 0.99999, "{p:#}");
    }
    let sampled = j["sampled"].as_array().unwrap();
    assert_eq!(sampled.len(), 3, "{j:#}");
    for p in sampled {
        assert_eq!(p["on_device"], Value::Bool(false), "{p:#}");
        assert_eq!(p["identical"], Value::Bool(true), "{p:#}");
    }
}

#[test]
fn sampled_parity_folded_on_the_gpu_equals_the_oracle_with_the_host_sampler() {
    if !have_gpu("sampled_parity_folded_on_the_gpu_equals_the_oracle_with_the_host_sampler") {
        return;
    }
    let (out, j) = parity(&["-n", "16", "--sampled", "5"]);
    assert!(out.status.success(), "{j:#}\n{}", text(&out.stderr));
    let sampled = j["sampled"].as_array().unwrap();
    assert_eq!(sampled.len(), 3, "{j:#}");
    for p in sampled {
        assert_eq!(p["on_device"], Value::Bool(true), "{p:#}");
        assert_eq!(p["identical"], Value::Bool(true), "{p:#}");
        let (o, f) = (ids(&p["oracle_tokens"]), ids(&p["fast_tokens"]));
        assert_eq!((o.len(), &o), (17, &f), "{p:#}");
        assert!(o.iter().any(|t| *t != o[0]), "{p:#}");
    }
}

/// Plant `spec` (layer 2) and check that parity fails and names `want`.
fn planted(spec: &str, want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "The capital of France is\n").unwrap();
    let (out, j) = parity(&[
        "-n",
        "4",
        "--prompts",
        prompts.to_str().unwrap(),
        "--plant-error",
        spec,
    ]);
    assert!(!out.status.success(), "a planted error must fail: {j:#}");
    assert!(text(&out.stderr).contains("parity failed"));
    assert_eq!(j["pass"], Value::Bool(false));
    let p = &j["prompts"][0];
    let op = &p["first_divergence_op"];
    assert_eq!(op["name"].as_str(), Some(want), "{spec}: {p:#}");
    assert!(op["rel_err"].as_f64().unwrap() > 1e-2, "{spec}: {p:#}");
    // The error is in the prefill too, so the first traced step departs and the hint says
    // where to look next.
    assert_eq!(p["traced_step"].as_u64(), Some(0), "{spec}: {p:#}");
    assert!(
        text(&out.stderr).contains("departs at its first step")
            && text(&out.stderr).contains("--trace-prefill"),
        "{spec}: {}",
        text(&out.stderr)
    );
}

#[test]
fn planted_error_fails_parity_and_names_layer_2() {
    if !have_gpu("planted_error_fails_parity_and_names_layer_2") {
        return;
    }
    planted("2:o", "l2.attn_out");
    planted("2:down", "l2.moe_out");
}

/// `--trace-prefill`: the GEMM prefill traced layer by layer against the oracle's per-token
/// run finds no departure on a clean copy, and with layer 1's o-proj corrupted names layer 1
/// (token 0, the first traced there) and not layer 0.
#[test]
fn prefill_trace_names_the_first_departing_layer() {
    if !have_gpu("prefill_trace_names_the_first_departing_layer") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "The capital of France is\n").unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "-n",
            "2",
            "--prompts",
            prompts.to_str().unwrap(),
            "--prefill-gemm-min",
            "2",
            "--trace-prefill",
        ];
        args.extend(extra);
        let (out, _) = parity(&args);
        text(&out.stderr)
    };
    let clean = run(&[]);
    assert!(
        clean.contains("worst residual rel err per layer: l0 ")
            && clean.contains("first departure: none beyond 1e-3")
            && clean.contains("the oracle's nearest routing tie: gap"),
        "{clean}"
    );
    let bad = run(&["--plant-error", "1:o"]);
    assert!(
        bad.contains("first departure: layer 1 token 0: residual rel err"),
        "{bad}"
    );
    // A prompt under the GEMM prefill's minimum takes the column prefill: said, not traced.
    let (out, _) = parity(&[
        "-n",
        "2",
        "--prompts",
        prompts.to_str().unwrap(),
        "--trace-prefill",
    ]);
    assert!(
        text(&out.stderr).contains("does not take a traceable batched prefill"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_plant_spec_is_a_clear_error() {
    for (spec, msg) in [
        ("2", "LAYER:TENSOR"),
        ("x:o", "not a layer"),
        ("2:zz", "unknown tensor"),
    ] {
        let out = nibble()
            .args(["parity", "--backend", "gpu", "-m"])
            .arg(model())
            .args(["--plant-error", spec])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.contains(msg), "{spec}: {err}");
    }
}

/// Requests parity refuses with a clear message before any decoding: a cosine bar outside
/// [-1, 1] or NaN, a prompts file that cannot be read (named), one with only blank lines
/// (which would otherwise pass with no prompt checked), and prompts whose `-n` tokens do not
/// fit the context (which failed only after decoding).
#[test]
fn bad_parity_requests_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let blank = dir.path().join("blank.txt");
    std::fs::write(&blank, "\n  \n\n").unwrap();
    let missing = dir.path().join("missing.txt");
    let (blank, missing) = (blank.to_str().unwrap(), missing.to_str().unwrap());
    for (extra, msg) in [
        (
            &["--min-cosine", "nan"][..],
            "--min-cosine must be a number from -1 to 1",
        ),
        (
            &["--min-cosine", "1.5"][..],
            "--min-cosine must be a number from -1 to 1",
        ),
        (&["--prompts", blank][..], "no prompt (every line is blank)"),
        (&["--prompts", missing][..], "missing.txt: cannot read"),
        (&["--ctx", "16", "-n", "40"][..], "raise --ctx or lower -n"),
    ] {
        let out = nibble()
            .args(["parity", "--backend", "cpu", "-m"])
            .arg(model())
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?}");
        let err = text(&out.stderr);
        assert!(err.contains(msg), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
    }
}

/// `--profile` errors: a position past the context (before any test runs), and a backend that
/// cannot time ops on a device (the oracle).
#[test]
fn bench_profile_bad_requests_are_clear_errors() {
    for (backend, pos, msg) in [
        ("ref", "0", "cannot time ops"),
        ("ref", "64", "outside the context of 64"),
    ] {
        let out = nibble()
            .args([
                "bench",
                "--backend",
                backend,
                "-p",
                "0",
                "-n",
                "2",
                "--reps",
                "1",
            ])
            .args(["--ctx", "64", "--profile", pos, "-m"])
            .arg(model())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{backend} {pos}");
        let err = text(&out.stderr);
        assert!(err.contains(msg), "{backend} {pos}: {err}");
    }
}

/// A bench whose generation cannot fit the context is refused before the warm-up (it failed
/// inside it with a decoding error).
#[test]
fn bench_generation_past_the_context_is_refused_first() {
    let out = nibble()
        .args([
            "bench",
            "--backend",
            "cpu",
            "-p",
            "0",
            "-n",
            "8",
            "--reps",
            "1",
        ])
        .args(["--ctx", "4", "-m"])
        .arg(model())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("depth 0 + 8 generated tokens exceed the context of 4 (raise --ctx)"),
        "{err}"
    );
    assert!(
        !text(&out.stdout).contains("warm-up"),
        "{}",
        text(&out.stdout)
    );
}

/// `nibble bench` on the GPU backend: generation at two depths, pp, the read bandwidth measured
/// in the same run, JSON, the per-op profile and the SVG plot.
#[test]
fn bench_reports_depths_bandwidth_and_plots() {
    if !have_gpu("bench_reports_depths_bandwidth_and_plots") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("tg.svg");
    let out = nibble()
        .args([
            "bench",
            "--backend",
            "gpu",
            "--json",
            "-p",
            "8",
            "-n",
            "6",
            "--reps",
            "2",
        ])
        .args([
            "--depth",
            "0,20",
            "--ctx",
            "64",
            "--batch",
            "1,2",
            "--profile",
            "3,40",
            "--sampled",
        ])
        .arg("--plot")
        .arg(&svg)
        .arg("-m")
        .arg(model())
        .output()
        .unwrap();
    assert!(out.status.success(), "bench failed: {}", text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let stats = json["stats"].as_array().unwrap();
    let tests: Vec<&str> = stats.iter().map(|s| s["test"].as_str().unwrap()).collect();
    assert_eq!(
        tests,
        [
            "tg6",
            "tg6 @ d20",
            "tg6 sampled",
            "tg6 sampled, host sampler per step",
            "tg6 sampled, lone stream",
            "tg6 sampled, lone stream, host sampler per step",
            "tg6 sampled, whole row",
            "pp8",
            "pp8 @ d20",
            "tg6 batch 1",
            "tg6 batch 2"
        ],
        "{json}"
    );
    let row = |name: &str| &stats[tests.iter().position(|t| *t == name).unwrap()];
    assert_eq!(row("tg6 @ d20")["depth"], 20);
    assert_eq!(row("tg6 batch 2")["batch"], 2);
    // Each stream's greedy ids equal single-stream decoding of its prompt.
    assert_eq!(row("tg6 batch 1")["streams_equal_single"], 1, "{json}");
    assert_eq!(row("tg6 batch 2")["streams_equal_single"], 2, "{json}");
    for s in stats {
        let (lo, med, hi) = (
            s["min_tps"].as_f64().unwrap(),
            s["median_tps"].as_f64().unwrap(),
            s["max_tps"].as_f64().unwrap(),
        );
        assert!(lo > 0.0 && lo <= med && med <= hi, "{s}");
    }
    // --profile: every op of a step at both positions, per-layer ops once per layer.
    let layers = 4;
    let profile = json["profile"].as_array().unwrap();
    for pos in [3, 40] {
        let ops: Vec<&Value> = profile.iter().filter(|o| o["pos"] == pos).collect();
        let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
        for want in [
            "embed",
            "qkv matvec",
            "moe gate/up",
            "moe down",
            "lm_head",
            "argmax",
        ] {
            assert!(names.contains(&want), "{pos}: {names:?}");
        }
        let qkv = ops.iter().find(|o| o["op"] == "qkv matvec").unwrap();
        assert_eq!(qkv["calls"], layers, "{qkv}");
        for o in ops {
            let us = o["us"].as_f64().unwrap();
            assert!(us.is_finite() && us >= 0.0, "{o}");
        }
    }
    let read = json["read_gbps"].as_f64().unwrap();
    assert!(read > 0.0 && read.is_finite(), "{json}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("tg6"),
        "{}",
        &plot[..80.min(plot.len())]
    );
}

/// A llama.cpp-style `Q4_K_M` file (synth's small preset: Q4_K matrices, a Q6_K lm_head and
/// some Q6_K attn_v / ffn_down_exps): `inspect` counts the K types and the CPU backend passes
/// parity against the oracle (the GPU's run of it: tests/byte_files.rs).
#[test]
fn k_quant_file_runs_on_the_cpu_with_oracle_parity() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small-q4km.gguf");
    let out = nibble()
        .args([
            "synth", "--preset", "small", "--quant", "q4_k_m", "--seed", "3", "--quiet", "-o",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "synth: {}", text(&out.stderr));
    let out = nibble()
        .args(["inspect", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let types = &info["bytes_per_type"];
    for t in ["Q4_K", "Q6_K", "F32"] {
        assert!(types[t].as_u64().unwrap_or(0) > 0, "{t}: {info:#}");
    }
    assert!(types.get("Q4_0").is_none(), "{info:#}");
    let out = nibble()
        .args(["parity", "--backend", "cpu", "--json", "-n", "16", "-m"])
        .arg(&path)
        .output()
        .unwrap();
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["pass"], Value::Bool(true), "{j:#}\n{}", text(&out.stderr));
    for p in j["prompts"].as_array().unwrap() {
        let (o, f) = (ids(&p["oracle_tokens"]), ids(&p["fast_tokens"]));
        assert_eq!((o.len(), &o), (16, &f), "{p:#}");
        assert!(p["min_cosine"].as_f64().unwrap() >= 0.99999, "{p:#}");
    }
    // The safetensors copy cannot hold K-quant values exactly: refused, not approximated.
    let out = nibble()
        .args([
            "synth",
            "--preset",
            "small",
            "--quant",
            "q4_k_m",
            "--format",
            "safetensors",
        ])
        .arg("-o")
        .arg(dir.path().join("st"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("GGUF only"),
        "{}",
        text(&out.stderr)
    );
}

/// A cosine bar missed by less than the table's 7 decimals (`--min-cosine 1`, identical
/// sequences) says by how much, and gives no hint of a departure that no op showed.
#[test]
fn a_bar_missed_by_a_hair_says_by_how_much() {
    let out = nibble()
        .args([
            "parity",
            "--backend",
            "cpu",
            "-n",
            "2",
            "--min-cosine",
            "1",
            "-m",
        ])
        .arg(model())
        .output()
        .unwrap();
    let (stdout, err) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success());
    assert!(
        stdout.contains("is below --min-cosine 1") && stdout.contains("(1 - "),
        "{stdout}"
    );
    assert!(!err.contains("hint:"), "{err}");
}
