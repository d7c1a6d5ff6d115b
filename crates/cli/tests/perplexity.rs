//! `nibble perplexity` on the tiny synthetic GGUF with the real tokenizer: the three backends
//! agree, the figure equals an independent sum over the oracle's stepped logits (llama.cpp's
//! protocol: windows from an empty cache, the second half of each scored), and bad input is a
//! clear error.

mod common;

use common::{have_gpu, model, nibble, text, tokenizer_dir};
use nibble_backend::{Backend, RefBackend};
use serde_json::Value;

const TEXT: &str = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles \
begins with a single step. All that glitters is not gold, and not all those who wander are \
lost. To be or not to be, that is the question: whether it is nobler in the mind to suffer \
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. It \
was the best of times, it was the worst of times, it was the age of wisdom, it was the age \
of foolishness. Call me Ishmael. Some years ago, never mind how long precisely, having \
little or no money in my purse, I thought I would sail about a little and see the watery \
part of the world.";

fn ppl(m: &str, file: &str, extra: &[&str]) -> (Value, String) {
    let out = nibble()
        .args(["perplexity", "--json", "-m", m, "-f", file])
        .args(extra)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{extra:?}: {err}");
    (serde_json::from_slice(&out.stdout).unwrap(), err)
}

#[test]
fn perplexity_matches_the_oracle_summed_by_hand() {
    let Some(m) = model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("text.txt");
    std::fs::write(&file, TEXT).unwrap();
    let (m, f) = (m.to_str().unwrap(), file.to_str().unwrap());
    let args = ["--ctx", "32", "--chunks", "3"];
    let (want, err) = ppl(m, f, &[&args[..], &["--backend", "ref"]].concat());
    assert!(err.contains("[1]") && err.contains("[3]"), "{err}");
    assert_eq!(want["windows"], 3);
    assert_eq!(want["scored_tokens"], 3 * (32 - 1 - 16));

    // By hand: the oracle stepped token by token from an empty cache per window, the
    // log-softmax in f64, tokens 17..31 of each window.
    let tok = nibble_engine::Tokenizer::from_hf_dir(tokenizer_dir().unwrap()).unwrap();
    let ids = tok.encode(TEXT).unwrap();
    assert_eq!(want["text_tokens"].as_u64().unwrap() as usize, ids.len());
    let loaded = nibble_model::loader::open(std::path::Path::new(m)).unwrap();
    let mut rb = RefBackend::new(loaded.weights.clone(), 32).unwrap();
    let (mut sum, mut n) = (0f64, 0usize);
    for w in ids.chunks_exact(32).take(3) {
        rb.truncate(0).unwrap();
        for (i, &t) in w.iter().enumerate().take(31) {
            let row = rb.step(t).unwrap();
            if i >= 16 {
                let max = row.iter().fold(f64::MIN, |a, &x| a.max(x as f64));
                let lse = max
                    + row
                        .iter()
                        .map(|&x| (x as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                sum += lse - row[w[i + 1] as usize] as f64;
                n += 1;
            }
        }
    }
    let mean = want["mean_nll"].as_f64().unwrap();
    assert!(
        (mean - sum / n as f64).abs() <= 1e-9 * mean.abs(),
        "{mean} vs {}",
        sum / n as f64
    );
    assert!((want["ppl"].as_f64().unwrap() / mean.exp() - 1.0).abs() < 1e-12);
    assert!(want["ppl_err"].as_f64().unwrap() > 0.0);

    // The fast backends: the same figure (f32 logits within the parity bar).
    let mut fast = vec!["cpu"];
    if have_gpu() {
        fast.push("gpu");
    }
    for b in fast {
        let (got, _) = ppl(m, f, &[&args[..], &["--backend", b]].concat());
        let g = got["mean_nll"].as_f64().unwrap();
        assert!(
            (g - mean).abs() <= 1e-5 * mean.abs(),
            "{b}: mean nll {g} vs {mean}"
        );
        assert_eq!(got["scored_tokens"], want["scored_tokens"], "{b}");
    }
}

#[test]
fn perplexity_refuses_bad_input() {
    let Some(m) = model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let bad = dir.path().join("bad.bin");
    std::fs::write(&bad, [0xffu8, 0xfe, 0x00]).unwrap();
    let m = m.to_str().unwrap();
    let s = short.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["-f", s, "--ctx", "64"],
            "fewer than one window of --ctx 64",
        ),
        (&["-f", s, "--ctx", "2"], "at least 3 tokens"),
        (&["-f", s, "--chunks", "0"], "--chunks must be at least 1"),
        (&["-f", "/nonexistent/text"], "cannot read"),
        (&["-f", bad.to_str().unwrap()], "as UTF-8 text"),
    ];
    for (args, want) in cases {
        let out = nibble()
            .args(["perplexity", "--backend", "cpu", "-m", m])
            .args(args)
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
