//! End-to-end tests of the `nibble` binary on a tiny synthetic GGUF that embeds the real Qwen3
//! tokenizer (fetched by scripts/fetch-tokenizer.sh; required when CI is set).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

fn tokenizer_dir() -> Option<PathBuf> {
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

/// The tiny model with the tokenizer, made once per test binary.
fn model() -> Option<&'static Path> {
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

fn run(args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = nibble();
    c.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

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

/// `--logit-bias 0+100` makes token 0 ("!" in Qwen's vocabulary) win every greedy step on
/// every backend (each samples the biased row on the host); a ban on it changes nothing else.
#[test]
fn logit_bias_steers_greedy_output_on_every_backend() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    for backend in ["ref", "cpu", "gpu"] {
        let args = ["generate", "-m", m, "-p", "Once upon a time", "-n", "8"];
        let out = run(
            &[&args[..], &["--backend", backend, "--logit-bias", "0+100"]].concat(),
            None,
        );
        let err = text(&out.stderr);
        assert!(out.status.success(), "{backend}: {err}");
        assert_eq!(text(&out.stdout).trim_end(), "!!!!!!!!", "{backend}");
    }
    let out = run(&["generate", "-m", m, "-p", "x", "--logit-bias", "5"], None);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("want ID+BIAS or ID-BIAS"));
    // An id given twice gets the sum (llama.cpp's rule): -100 + 200 favours "!" again.
    let args = [
        "generate",
        "-m",
        m,
        "-p",
        "Hi",
        "-n",
        "3",
        "--backend",
        "cpu",
    ];
    let twice = ["--logit-bias", "0-100", "--logit-bias", "0+200"];
    let out = run(&[&args[..], &twice].concat(), None);
    assert_eq!(text(&out.stdout).trim_end(), "!!!");
    // Bounded, so a penalty cannot carry a favoured logit to infinity.
    let out = run(&[&args[..], &["--logit-bias", "0+2e6"]].concat(), None);
    assert!(text(&out.stderr).contains("want |bias| <= 1e6"));
    let out = run(
        &["generate", "-m", m, "-p", "x", "--logit-bias", "999999+1"],
        None,
    );
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("outside the model's vocabulary"), "{err}");
}

/// Special tokens and ids past the tokenizer add no text unless `--special` (llama.cpp's flag)
/// asks for them: a bias forces <|vision_start|> (151652) or the padding row 151700.
#[test]
fn special_tokens_are_printed_only_with_special() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    for (bias, shown) in [
        ("151652+100", "<|vision_start|>"),
        ("151700+100", "<|unk:151700|>"),
    ] {
        let args = [
            "generate",
            "-m",
            m,
            "-p",
            "Hi",
            "-n",
            "3",
            "--logit-bias",
            bias,
        ];
        let out = run(&args, None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout).trim_end(), "", "{bias}");
        assert!(text(&out.stderr).contains("generated 3 tokens"));
        let out = run(&[&args[..], &["--special"]].concat(), None);
        assert_eq!(text(&out.stdout).trim_end(), shown.repeat(3), "{bias}");
        // In chat, --special changes what is printed, not the history the model sees next
        // (`<|unk:ID|>` went back into it as plain text: 54 prompt tokens against 20).
        let chat = [
            "chat",
            "-m",
            m,
            "-n",
            "3",
            "--ctx",
            "128",
            "--logit-bias",
            bias,
        ];
        let second = |extra: &[&str]| {
            let err = text(&run(&[&chat[..], extra].concat(), Some("hi\nhi\n")).stderr);
            let at = err.find("[turn 2: prompt ").expect("a second turn") + 16;
            err[at..].split(' ').next().unwrap().to_owned()
        };
        assert_eq!(second(&["--special"]), second(&[]), "{bias}");
    }
}

/// `-f FILE` (llama.cpp's flag) and `-f -` (stdin) read the prompt; the text is `-p`'s.
#[test]
fn the_prompt_can_come_from_a_file_or_stdin() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (file, bad) = (dir.path().join("p.txt"), dir.path().join("bad.txt"));
    std::fs::write(&file, "Once upon a time").unwrap();
    std::fs::write(&bad, b"\xff\xfe").unwrap();
    let gen = |src: &[&str], stdin: Option<&str>| {
        run(
            &[&["generate", "-m", m, "-n", "6"][..], src].concat(),
            stdin,
        )
    };
    let want = gen(&["-p", "Once upon a time"], None);
    assert!(want.status.success(), "{}", text(&want.stderr));
    let from_file = gen(&["-f", file.to_str().unwrap()], None);
    assert_eq!(text(&from_file.stdout), text(&want.stdout));
    let from_stdin = gen(&["-f", "-"], Some("Once upon a time"));
    assert_eq!(text(&from_stdin.stdout), text(&want.stdout));
    for (src, err) in [
        (vec!["-f", bad.to_str().unwrap()], "is not UTF-8 text"),
        (
            vec!["-f", "/nonexistent/p.txt"],
            "reading the prompt /nonexistent/p.txt",
        ),
        (vec![], "--prompt"),
        (vec!["-p", "x", "-f", "-"], "cannot be used with"),
    ] {
        let out = gen(&src, None);
        assert!(!out.status.success(), "{src:?}");
        assert!(
            text(&out.stderr).contains(err),
            "{src:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn same_seed_same_bytes() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let args = |seed: &'static str| {
        vec![
            "generate",
            "-m",
            m,
            "-p",
            "Hello there",
            "-n",
            "32",
            "--temperature",
            "1.0",
            "--top-p",
            "0.95",
            "--seed",
            seed,
        ]
    };
    let a = run(&args("42"), None);
    let b = run(&args("42"), None);
    let c = run(&args("43"), None);
    assert!(a.status.success(), "{}", text(&a.stderr));
    assert_eq!(a.stdout, b.stdout, "same seed must give the same bytes");
    assert_ne!(a.stdout, c.stdout, "different seeds gave identical output");
}

#[test]
fn chat_keeps_context_across_turns() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    // Thinking on: the generation prompt `<|im_start|>assistant\n` is also how the template renders
    // the answered turn, so the whole first prompt is a prefix of the second. (With --no-think
    // the template drops the empty think block from history, as transformers does.)
    let out = run(
        &["chat", "-m", m, "-n", "12"],
        Some("My name is Ada.\nWhat is my name?\n"),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let turns: Vec<&str> = err.lines().filter(|l| l.starts_with("[turn")).collect();
    assert_eq!(turns.len(), 2, "{err}");
    assert!(
        turns[0].starts_with("[turn 1:") && turns[1].starts_with("[turn 2:"),
        "{err}"
    );
    // Each turn says why its answer ended (12 ids of a random model: the limit, or an end id).
    let ended = |l: &str| l.ends_with(", max tokens]") || l.contains(", end of text, id ");
    assert!(turns.iter().all(|l| ended(l)), "{err}");
    let num = |l: &str, key: &str| -> usize {
        let i = l.find(key).unwrap_or_else(|| panic!("{key} in {l}")) + key.len();
        l[i..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (p1, p2) = (num(turns[0], "prompt "), num(turns[1], "prompt "));
    let reused = num(turns[1], "tokens (");
    assert!(
        p2 > p1,
        "second prompt must hold the first turn: {p1} vs {p2}"
    );
    // The whole first turn (its prompt at least) is served from the KV cache, not recomputed.
    assert!(
        reused >= p1,
        "second turn reused only {reused} of {p1} first-turn prompt tokens"
    );
    assert!(reused < p2);
}

/// A conversation that outgrows the context drops its oldest exchange (it was an error that
/// dropped the new message); `/help` and `/reset` are commands, not messages.
#[test]
fn chat_drops_its_oldest_exchanges_when_the_context_fills() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let input = format!(
        "hi there\n{}\n/help\nsecond question here\nthird question\n /RESET\n/unknown\nafter reset\n",
        "word ".repeat(20)
    );
    let out = run(&["chat", "-m", m, "-n", "8", "--ctx", "80"], Some(&input));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("this message is dropped"), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.starts_with("[turn")).collect();
    assert_eq!(turns.len(), 5, "{err}");
    assert!(err.contains("[commands: /reset"), "{err}");
    assert!(
        err.contains(
            "the conversation outgrew the context of 80 tokens: its oldest 2 messages are dropped"
        ),
        "{err}"
    );
    assert!(err.contains("[the conversation is cleared]"), "{err}");
    // After /reset the prompt is a lone message again (10 tokens for a two-word one).
    assert!(turns[4].starts_with("[turn 5: prompt 10 tokens"), "{err}");
    assert!(
        err.contains("[unknown command /unknown: /help lists"),
        "{err}"
    );
    // An answer that fills the context is dropped too (the last exchange was always kept, so
    // every later message failed).
    let out = run(
        &["chat", "-m", m, "-n", "200", "--ctx", "128"],
        Some("hi\nhi\nhi\n"),
    );
    let err = text(&out.stderr);
    assert!(!err.contains("this message is dropped"), "{err}");
    assert_eq!(err.matches("[turn ").count(), 3, "{err}");
    // Settings that would fail every message fail at start-up.
    let long = "w ".repeat(100);
    for (args, want) in [
        (
            vec!["--system", long.as_str()],
            "the --system message takes",
        ),
        (
            vec!["--logit-bias", "999999+1"],
            "outside the model's vocabulary",
        ),
        (vec!["-n", "0"], "-n must be at least 1"),
    ] {
        let out = run(
            &[&["chat", "-m", m, "--ctx", "64"][..], &args].concat(),
            Some("hi\n"),
        );
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains(want),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// A message that cannot be answered (the conversation outgrew the context) is dropped with
/// the error and the chat goes on; a line that is not UTF-8 is answered, not fatal. Both used
/// to end the whole chat.
#[test]
fn chat_survives_a_turn_that_cannot_be_answered() {
    let Some(m) = model() else { return };
    let mut input = b"hi\n".to_vec();
    input.extend("word ".repeat(60).as_bytes());
    input.extend(b"\n\xff\xfe hello\n");
    let mut child = nibble()
        .args(["chat", "-m", m.to_str().unwrap(), "-n", "4", "--ctx", "64"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("does not fit the context of 64 tokens")
            && err.contains("[this message is dropped; the chat goes on"),
        "{err}"
    );
    // The first and the third lines are turns 1 and 2.
    assert!(err.contains("[turn 2: prompt"), "{err}");
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

/// `-n 0` is refused: the first id would be emitted before the length is checked.
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
    );
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
    let cases: [(&[&str], &str); 11] = [
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
