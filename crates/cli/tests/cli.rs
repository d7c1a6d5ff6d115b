//! End-to-end tests of the `nibble` binary on a tiny synthetic GGUF that embeds the real Qwen3
//! tokenizer (fetched by scripts/fetch-tokenizer.sh; required when CI is set).

mod common;

use common::{model, nibble, run, text};
use std::io::Write;
use std::path::Path;
use std::process::Stdio;

#[test]
fn generate_streams_text_and_prints_a_summary() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let out = run(
        &["generate", "-m", m, "-p", "Once upon a time", "-n", "24"],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.trim().chars().count() >= 10,
        "too little text: {stdout:?}"
    );
    let err = text(&out.stderr);
    let summary = err
        .lines()
        .find(|l| l.starts_with("prompt "))
        .expect("summary line");
    // "prompt 4 tokens, generated 24 tokens, prompt X tok/s, decode Y tok/s (Length)"
    assert!(
        summary.contains("prompt 4 tokens, generated 24 tokens"),
        "{summary}"
    );
    assert!(
        summary.contains("tok/s, decode") && summary.contains("tok/s"),
        "{summary}"
    );
    // Greedy is deterministic.
    let again = run(
        &["generate", "-m", m, "-p", "Once upon a time", "-n", "24"],
        None,
    );
    assert_eq!(again.stdout, out.stdout);
}

#[test]
fn prompt_longer_than_context_is_a_clear_error() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let long = "word ".repeat(100);
    let out = run(&["generate", "-m", m, "-p", &long, "--ctx", "16"], None);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("does not fit the context of 16 tokens"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // More bytes than 16 tokens can cover: refused before tokenizing.
    let longer = "x".repeat(16 * 512);
    let out = run(&["generate", "-m", m, "-p", &longer, "--ctx", "16"], None);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bytes cannot fit the context of 16 tokens"),
        "{err}"
    );
}

/// `-n 0` is refused: `generate` makes at least one token (the server's `max_tokens: 0` only
/// echoes or scores a prompt).
#[test]
fn zero_max_tokens_is_a_clear_error() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let out = run(&["generate", "-m", m, "-p", "hello", "-n", "0"], None);
    assert!(!out.status.success());
    assert!(text(&out.stdout).is_empty(), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("(-n) must be at least 1"), "{err}");
}

/// A NaN in a float tensor (a norm weight) is a clear error naming the tensor on the CPU
/// backend and the oracle, never silent garbage (a greedy argmax over NaN logits picked id 0).
#[test]
fn nan_in_a_norm_weight_is_a_clear_error() {
    let Some(m) = model() else { return };
    let mut bytes = std::fs::read(m).unwrap();
    let f = nibble_formats::gguf::GgufFile::from_bytes("tiny.gguf", bytes.clone()).unwrap();
    let info = f
        .tensors()
        .iter()
        .find(|t| t.name == "blk.1.attn_norm.weight")
        .unwrap();
    assert_eq!(info.dtype, nibble_quant::DType::F32);
    let at = (f.data_offset() + info.offset) as usize + 4 * 3;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("nan-norm.gguf");
    std::fs::write(&bad, &bytes).unwrap();
    let bad = bad.to_str().unwrap();
    for (backend, names) in [("cpu", "Layer(1, AttnNorm)"), ("ref", "layer 1 attn norm")] {
        let out = run(
            &[
                "generate",
                "-m",
                bad,
                "-p",
                "hello",
                "-n",
                "4",
                "--backend",
                backend,
            ],
            None,
        );
        assert!(!out.status.success(), "{backend}");
        let err = text(&out.stderr);
        assert!(
            err.contains(names) && err.contains("element 3 is not finite"),
            "{backend}: {err}"
        );
        assert!(
            text(&out.stdout).is_empty(),
            "{backend}: {}",
            text(&out.stdout)
        );
    }
}

#[test]
fn inspect_reports_the_model() {
    let Some(m) = model() else { return };
    let out = run(&["inspect", m.to_str().unwrap(), "--json"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["architecture"], "qwen3moe");
    assert_eq!(v["tensor_count"], 3 + 12 * 4);
    assert_eq!(v["tokenizer"], true);
    assert_eq!(v["chat_template"], true);
    assert_eq!(v["config"]["num_experts"], 16);
    // tiny: embed + lm_head 2*151936*64, per layer attention 4*... — compare with the config arithmetic.
    let c = &v["config"];
    let (h, v_, l) = (
        c["hidden_size"].as_u64().unwrap(),
        c["vocab_size"].as_u64().unwrap(),
        c["num_layers"].as_u64().unwrap(),
    );
    let (q, kv, e, i) = (4 * 32, 2 * 32, 16, 64);
    let per_layer = 2 * h + q * h + 2 * kv * h + h * q + 2 * 32 + e * h + 3 * e * i * h;
    assert_eq!(
        v["parameters"].as_u64().unwrap(),
        2 * v_ * h + h + l * per_layer
    );
}

#[test]
fn bad_model_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, b"GGUF\x03\x00\x00\x00trunc").unwrap();
    let out = run(&["inspect", p.to_str().unwrap()], None);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("bad.gguf") && !err.contains("panicked"),
        "{err}"
    );
}

/// A report whose reader goes away (`nibble inspect --json FILE | head -c 1`, the reader gone
/// before the first write here) ends without a panic: killed by SIGPIPE as Unix tools are,
/// not "failed printing to stdout".
#[cfg(unix)]
#[test]
fn a_closed_stdout_pipe_ends_a_report_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let Some(m) = model() else { return };
    // The read end is closed before the child starts, so its first write meets a pipe with no
    // reader whatever the timing.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = nibble()
        .args(["inspect", "--json"])
        .arg(m)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {err}",
        out.status
    ); // chat keeps SIGPIPE ignored and ends quietly, as generate does (it said "error: Broken
       // pipe" and exited 1).
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = nibble()
        .args(["chat", "-n", "2", "--backend", "cpu", "-m"])
        .arg(m)
        .stdin(Stdio::piped())
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hi\nhi\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("error"), "{err}");
}

/// A stdout that cannot be written (a full disk) is an error naming the cause, never a panic
/// (the reports printed with `println!`, exit 101) nor a success (`generate` exited 0 with its
/// text lost); a reader that left (`| head`) still ends `generate` quietly.
#[cfg(target_os = "linux")]
#[test]
fn an_unwritable_stdout_is_an_error() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let reports: [&[&str]; 4] = [
        &["generate", "-m", m, "-p", "hi", "-n", "4"],
        &["inspect", m],
        &["inspect", "--json", m],
        &[
            "parity",
            "-m",
            m,
            "--backend",
            "cpu",
            "-n",
            "2",
            "--ctx",
            "64",
        ],
    ];
    for args in reports {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = nibble()
            .args(args)
            .stdout(full)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("No space left on device"), "{args:?}: {err}");
    }
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = nibble()
        .args(["generate", "-m", m, "-p", "hi", "-n", "4"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("(output closed)"), "{err}");
}

/// Notes on a stderr that cannot be written (a closed pipe) do not panic `generate` or `chat`,
/// which keep SIGPIPE ignored: `-v`'s backend line and chat's turn lines used `eprintln!`,
/// which panicked (exit 101).
#[test]
fn an_unwritable_stderr_is_not_a_panic() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let runs: [(&[&str], Option<&str>); 2] = [
        (
            &[
                "generate",
                "-m",
                m,
                "-p",
                "hi",
                "-n",
                "4",
                "--backend",
                "cpu",
                "-v",
            ],
            None,
        ),
        (
            &["chat", "-m", m, "-n", "4", "--backend", "cpu", "-v"],
            Some("hi\n/help\n"),
        ),
    ];
    for (args, input) in runs {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut child = nibble()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(writer)
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.unwrap_or("").as_bytes()).unwrap();
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{args:?}: {:?}", out.status);
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn tune_help_names_every_key() {
    // `--tune` is how a reader repeats a BENCHMARKS comparison, so its help must not fall
    // behind the keys the parser takes.
    for cmd in ["bench", "generate"] {
        let out = run(&[cmd, "--help"], None);
        assert!(out.status.success(), "{cmd} --help: {:?}", out.status);
        let help = text(&out.stdout);
        for key in nibble_gpu::tune::KEYS {
            assert!(
                help.contains(key),
                "`nibble {cmd} --help` does not name --tune key {key}"
            );
        }
    }
}

/// Flags that mean nothing alone, or out of range, are refused before any model is opened
/// (`--system` without `--chat` used to be ignored, `--reps 0` ran one rep, a `--logit-scale`
/// of 1e30 wrote infinite scales, an empty `--api-key` served without auth).
#[test]
fn meaningless_flags_are_refused_up_front() {
    let cases: [(&[&str], &str); 12] = [
        (
            &[
                "serve",
                "-m",
                "none.gguf",
                "--backend",
                "ref",
                "--streams",
                "2",
            ],
            "--streams: the reference backend decodes one sequence",
        ),
        (
            &[
                "bench",
                "-m",
                "none.gguf",
                "--backend",
                "cpu",
                "--compare-per-token",
            ],
            "--compare-per-token compares the GPU's",
        ),
        (&["bench", "-m", "none.gguf", "-n", "0"], "0 is not in 1.."),
        (
            &[
                "generate",
                "-m",
                "none.gguf",
                "-p",
                "hi",
                "--backend",
                "cpu",
                "--tune",
                "warm=0",
            ],
            "--tune applies to the GPU backend only, not to --backend cpu",
        ),
        (
            &[
                "serve",
                "-m",
                "none.gguf",
                "--backend",
                "ref",
                "--per-token",
            ],
            "--per-token applies to the GPU backend only, not to --backend ref",
        ),
        (
            &["serve", "-m", "none.gguf", "--api-key", " "],
            "--api-key is empty",
        ),
        (
            &["serve", "-m", "none.gguf", "--model-name", ""],
            "--model-name is empty",
        ),
        (
            &["serve", "-m", "none.gguf", "--ctx", "1"],
            "--ctx 1 cannot hold",
        ),
        (
            &["generate", "-m", "none.gguf", "-p", "hi", "--system", "s"],
            "--chat",
        ),
        (
            &["generate", "-m", "none.gguf", "-p", "hi", "--no-think"],
            "--chat",
        ),
        (
            &["bench", "-m", "none.gguf", "--reps", "0"],
            "0 is not in 1..=100000",
        ),
        (
            &[
                "synth",
                "--preset",
                "tiny",
                "--logit-scale",
                "1e30",
                "-o",
                "none.gguf",
            ],
            "must be a number in (0, 1000]",
        ),
    ];
    for (args, want) in cases {
        let out = run(args, None);
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
        assert!(
            !err.contains("none.gguf"),
            "{args:?} opened the model: {err}"
        );
    }
    assert!(!Path::new("none.gguf").exists());
}

/// A context error suggests raising --ctx only where it can be raised.
#[test]
fn context_errors_name_the_models_own_limit() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let bench = ["bench", "-m", m, "--backend", "cpu", "-p", "8", "-n", "4"];
    for (ctx, want) in [
        ("1000", "(raise --ctx)"),
        ("4096", "(the model's own limit)"),
    ] {
        let out = run(
            &[&bench[..], &["--depth", "4090", "--ctx", ctx]].concat(),
            None,
        );
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "--ctx {ctx}: {err}"
        );
    }
}

/// A depth given twice is measured once (`--depth 0,4,0` ran depth 0 twice).
#[test]
fn bench_measures_each_depth_once() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let args = [
        "bench",
        "-m",
        m,
        "--backend",
        "cpu",
        "-p",
        "0",
        "-n",
        "2",
        "--reps",
        "1",
    ];
    let out = run(&[&args[..], &["--depth", "0,4,0"]].concat(), None);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("tg2")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(
        rows[0].starts_with("tg2 ") && rows[1].starts_with("tg2 @ d4"),
        "{stdout}"
    );
}

/// `--cache-type` reaches the backends: a bench names the type it ran, `parity` with f16 gives
/// its oracle the same cache (the CPU's logits then stay within 2e-3 of the oracle's, where
/// an f32 oracle would sit ~1e-2 away on this model), and a bad type is refused by name.
#[test]
fn cache_type_reaches_the_backends_and_their_oracle() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let bench = ["bench", "-m", m, "--backend", "cpu", "-p", "0", "-n", "2"];
    let out = run(
        &[&bench[..], &["--reps", "1", "--cache-type", "f16"]].concat(),
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("(f16 KV cache)"),
        "{}",
        text(&out.stdout)
    );
    let args = ["parity", "-m", m, "--backend", "cpu", "-n", "8", "--json"];
    let out = run(&[&args[..], &["--cache-type", "f16"]].concat(), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["kv_cache"], "f16");
    for p in report["prompts"].as_array().unwrap() {
        let d = p["max_abs_delta"].as_f64().unwrap();
        assert!(d < 2e-3, "{}: max |delta| {d}", p["prompt"]);
    }
    let out = run(&[&bench[..], &["--cache-type", "q8_0"]].concat(), None);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("expected f16 or f32"),
        "{}",
        text(&out.stderr)
    );
}
