//! End-to-end tests of `nibble generate` and `nibble chat` on the tiny synthetic GGUF with the
//! real Qwen3 tokenizer: sampling settings (logit bias, seeds), special tokens in the output,
//! prompt sources, and chat's turns, commands and context handling.

mod common;

use common::{model, nibble, run, text};
use std::io::Write;
use std::process::Stdio;

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

/// A JSON schema (llama.cpp's `-j`), a regex or a Lark grammar shape the answer on every
/// backend, in `generate` and in `chat`; bad grammars are refused before the model loads.
#[test]
fn grammars_shape_the_answer_on_every_backend() {
    let Some(m) = model() else { return };
    let m = m.to_str().unwrap();
    let schema = r#"{"type": "object", "properties": {"pick": {"enum": ["left", "right"]},
        "n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["pick", "n"],
        "additionalProperties": false}"#;
    let mut answers = Vec::new();
    for backend in ["ref", "cpu", "gpu"] {
        let args = [
            "generate",
            "-m",
            m,
            "-p",
            "Once upon a time",
            "-n",
            "200",
            "--backend",
            backend,
        ];
        let out = run(&[&args[..], &["-j", schema]].concat(), None);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{backend}: {err}");
        assert!(err.contains("(end of text"), "{backend}: {err}");
        let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim_end())
            .unwrap_or_else(|e| panic!("{backend}: {e}: {}", text(&out.stdout)));
        assert!(v["pick"] == "left" || v["pick"] == "right", "{v}");
        assert!((1..=9).contains(&v["n"].as_u64().unwrap()), "{v}");
        answers.push(text(&out.stdout));
    }
    // Greedy: every backend picks the same constrained answer.
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
    let base = [
        "generate",
        "-m",
        m,
        "-p",
        "Hi",
        "-n",
        "40",
        "--backend",
        "cpu",
    ];
    let out = run(
        &[&base[..], &["--regex", "(yes|no)! [0-9]{2}"]].concat(),
        None,
    );
    let t = text(&out.stdout);
    let t = t.trim_end();
    assert!(
        t.len() == 6 && (t.starts_with("yes!") || t.starts_with("no! ")) || t.len() == 7,
        "{t:?}"
    );
    assert!(t.ends_with(|c: char| c.is_ascii_digit()), "{t:?}");
    let dir = tempfile::tempdir().unwrap();
    let lark = dir.path().join("g.lark");
    std::fs::write(&lark, "start: \"A\" | \"B\" \"C\"\n").unwrap();
    let out = run(
        &[&base[..], &["--grammar-file", lark.to_str().unwrap()]].concat(),
        None,
    );
    assert!(
        ["A", "BC"].contains(&text(&out.stdout).trim_end()),
        "{}",
        text(&out.stdout)
    );
    // Chat: each turn's answer follows the grammar.
    let out = run(
        &[
            "chat",
            "-m",
            m,
            "-n",
            "30",
            "--backend",
            "cpu",
            "--no-think",
            "-j",
            r#"{"enum": ["yes", "no"]}"#,
        ],
        Some("Is it?\nReally?\n"),
    );
    let lines: Vec<String> = text(&out.stdout)
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines.iter().all(|l| l == "\"yes\"" || l == "\"no\""),
        "{lines:?}"
    );
    // Refusals, before any model is read.
    let gbnf = dir.path().join("g.gbnf");
    std::fs::write(&gbnf, "root ::= \"a\"\n").unwrap();
    for (flags, want) in [
        (vec!["-j", "{bad"], "the schema is not JSON"),
        (vec!["-j", "[1]"], "object or a boolean"),
        (
            vec!["--grammar-file", gbnf.to_str().unwrap()],
            "looks like GBNF",
        ),
        (vec!["--regex", "("], "invalid grammar"),
        (vec!["-j", "{}", "--regex", "a"], "cannot be used with"),
        (
            vec!["--json-schema-file", "/nonexistent.json"],
            "reading /nonexistent.json",
        ),
    ] {
        let out = run(&[&base[..], &flags[..]].concat(), None);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}
