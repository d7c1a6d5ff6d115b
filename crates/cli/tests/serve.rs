//! Smoke test of `nibble serve`: the real binary on a loopback port (port 0, the bound address
//! read from its "listening on" line) with the reference backend on the tiny synthetic GGUF;
//! one raw HTTP/1.1 exchange per route checked. The server crate's own tests cover the API.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

fn tokenizer_json() -> Option<PathBuf> {
    let dir = std::env::var_os("NIBBLE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vendor/qwen3-tokenizer")
        });
    let p = dir.join("tokenizer.json");
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI: tokenizer missing at {}",
        p.display()
    );
    eprintln!(
        "SKIP: no tokenizer at {} (run scripts/fetch-tokenizer.sh)",
        p.display()
    );
    None
}

/// Sends one request with `Connection: close`; returns the status code and the body. The read
/// timeout only guards against a hang: six requests decoded together on lavapipe on a loaded
/// 2-core CI machine have taken over 60 s.
fn exchange(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// Writes synth's tiny model (seed `seed`, with the tokenizer) into `dir`.
fn tiny_model(dir: &Path, seed: &str, tok: &Path) -> PathBuf {
    let model = dir.join("tiny.gguf");
    let out = nibble()
        .args(["synth", "--preset", "tiny", "--seed", seed, "--quiet", "-o"])
        .arg(&model)
        .arg("--tokenizer")
        .arg(tok)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    model
}

/// Starts `nibble serve ARGS -m MODEL` on port 0; returns the child and its bound address.
fn spawn_serve(args: &[&str], model: &Path) -> (std::process::Child, String) {
    let mut child = nibble()
        .arg("serve")
        .args(args)
        .args(["--port", "0", "-m"])
        .arg(model)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let Some(Ok(line)) = lines.next() else {
            let _ = child.kill();
            panic!("serve exited before listening");
        };
        if let Some(a) = line.strip_prefix("listening on http://") {
            break a.to_owned();
        }
    };
    (child, addr)
}

#[test]
fn serve_answers_health_models_and_a_completion() {
    let Some(tok) = tokenizer_json() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "1", &tok);
    let (mut child, addr) = spawn_serve(&["--backend", "ref", "--ctx", "512"], &model);
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let (st, body) = exchange(&addr, "GET", "/health", "");
    assert_eq!((st, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (st, body) = exchange(&addr, "GET", "/v1/models", "");
    assert_eq!(st, 200);
    assert!(body.contains(r#""id":"tiny""#), "{body}");
    let (st, body) = exchange(
        &addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}"#,
    );
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    let (st, body) = exchange(&addr, "POST", "/v1/completions", r#"{"prompt": 5}"#);
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("prompt must be a string"), "{body}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The value of the first sample of `name` in an OpenMetrics text (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().split(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Whether a wgpu adapter exists (lavapipe counts); in CI it must.
fn have_gpu() -> bool {
    let ok = nibble_gpu::Context::new(&nibble_gpu::AdapterChoice::Auto).is_ok();
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "CI: no wgpu adapter");
        eprintln!("SKIP: no wgpu adapter (install mesa-vulkan-drivers)");
    }
    ok
}

/// `nibble serve --backend gpu --max-streams 6`: four greedy requests of different lengths and two
/// seeded sampled ones sent at once are decoded together on multi-stream slots (one-step runs
/// while the sampled ones live, pipelined greedy runs after, streams ending mid-pipeline) and
/// each text equals what `nibble generate` (the single-stream GPU path) writes for the same
/// prompt and sampling (a sampled request alone too: its stream sampled on the GPU); a
/// follow-up request that extends an earlier one reuses
/// its slot's cached prefix; a client that leaves mid-stream is cancelled and frees its slot; a
/// logit bias steers a greedy request; a logprobs request gets its entries.
#[test]
fn serve_decodes_concurrent_greedy_requests_together_on_the_gpu() {
    if have_gpu() {
        concurrent_requests_on("gpu");
    }
}

/// The same on the CPU backend's multi-stream path (no GPU needed): the requests share each
/// forward pass, the sampled ones pick on the host from their streams' logits, and every text
/// equals `nibble generate --backend cpu`'s.
#[test]
fn serve_decodes_concurrent_requests_together_on_the_cpu() {
    concurrent_requests_on("cpu");
}

fn concurrent_requests_on(backend: &str) {
    let Some(tok) = tokenizer_json() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "3", &tok);
    // Four greedy requests and two sampled ones (seeded: the same seed gives the same text).
    let prompts = [
        "Once upon a time",
        "The capital of France is",
        "def quicksort(xs):",
        "1, 2, 3, 4,",
        "Sampled story:",
        "Another sampled one",
    ];
    let seed = |i: usize| (i >= 4).then_some(i as u64 * 7);
    // Greedy requests of different lengths end at different runs while others go on.
    let max_tokens = |i: usize| if i < 4 { 12 + 8 * i } else { 12 };
    // Single-stream reference texts.
    let want: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let sampling = match seed(i) {
                Some(s) => vec![
                    "--temperature".into(),
                    "0.9".into(),
                    "--top-k".into(),
                    "40".into(),
                    "--seed".into(),
                    s.to_string(),
                ],
                None => vec![],
            };
            let o = nibble()
                .args(["generate", "--backend", backend, "--ctx", "256", "-p", p])
                .args(["-n", &max_tokens(i).to_string()])
                .args(sampling)
                .arg("-m")
                .arg(&model)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            // `generate` ends its output with a newline of its own.
            let text = String::from_utf8(o.stdout).unwrap();
            text.strip_suffix('\n').unwrap_or(&text).to_owned()
        })
        .collect();
    let (mut child, addr) = spawn_serve(
        &["--backend", backend, "--max-streams", "6", "--ctx", "256"],
        &model,
    );
    let body =
        |p: &str| serde_json::json!({"prompt": p, "max_tokens": 12, "temperature": 0}).to_string();
    let threads: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let b = match seed(i) {
                Some(s) => serde_json::json!({"prompt": p, "max_tokens": 12, "temperature": 0.9, "top_k": 40, "seed": s}).to_string(),
                None => serde_json::json!({"prompt": p, "max_tokens": max_tokens(i), "temperature": 0}).to_string(),
            };
            let addr = addr.clone();
            std::thread::spawn(move || exchange(&addr, "POST", "/v1/completions", &b))
        })
        .collect();
    for ((t, p), w) in threads.into_iter().zip(&prompts).zip(&want) {
        let (st, b) = t.join().unwrap();
        assert_eq!(st, 200, "{b}");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(
            text,
            w.as_str(),
            "prompt {p:?}: served together vs single-stream"
        );
    }
    // A sampled request alone on the server: on the GPU its lone stream is sampled on the
    // device in folded runs (fed its sampler's reserved draws); the text is still `generate`'s.
    let lone = serde_json::json!({"prompt": prompts[4], "max_tokens": 12, "temperature": 0.9, "top_k": 40, "seed": seed(4)})
        .to_string();
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &lone);
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        want[4].as_str(),
        "lone sampled"
    );
    // A follow-up that extends the first exchange lands on that slot's cached prefix.
    let follow = format!("{}{} and then", prompts[0], want[0]);
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &body(&follow));
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 4, "follow-up reused {cached} cached tokens: {b}");
    // `n` choices decode as sequences of their own, together: three greedy ones give the
    // single-stream text each; of two sampled ones, the first is the seed's text.
    let many = serde_json::json!({"prompt": prompts[1], "max_tokens": max_tokens(1), "temperature": 0, "n": 3});
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &many.to_string());
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    for i in 0..3 {
        assert_eq!(v["choices"][i]["index"], i, "{b}");
        assert_eq!(
            v["choices"][i]["text"].as_str().unwrap(),
            want[1],
            "choice {i}"
        );
    }
    let many = serde_json::json!({"prompt": prompts[4], "max_tokens": 12, "temperature": 0.9, "top_k": 40, "seed": seed(4), "n": 2});
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &many.to_string());
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want[4], "{b}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{b}");
    // A streaming request whose client leaves after a few chunks is cancelled and frees its
    // slot: the server goes idle long before the 200 tokens it asked for.
    let generated_before = metric(
        &exchange(&addr, "GET", "/metrics", "").1,
        "nibble_generated_tokens_total",
    );
    {
        let mut c = TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let b = serde_json::json!({"prompt": "Count:", "max_tokens": 200, "temperature": 0, "stream": true})
            .to_string();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        )
        .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        while seen.matches("data: ").count() < 3 {
            let n = c.read(&mut buf).unwrap();
            assert!(n > 0, "stream ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
    let t = std::time::Instant::now();
    loop {
        let m = exchange(&addr, "GET", "/metrics", "").1;
        if metric(&m, "nibble_active_streams") == 0.0 {
            let generated = metric(&m, "nibble_generated_tokens_total") - generated_before;
            assert!(
                generated < 200.0,
                "the cancelled request kept going: {generated} tokens"
            );
            break;
        }
        assert!(
            t.elapsed().as_secs() < 60,
            "the cancelled request still holds its slot"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A logit bias is applied on the multi-stream path too (each step's row comes to the host):
    // +100 on id 0 ("!") wins every greedy step.
    let biased = serde_json::json!({"prompt": "Count:", "max_tokens": 5, "temperature": 0, "logit_bias": {"0": 100}});
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &biased.to_string());
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["choices"][0]["text"], "!!!!!", "{b}");
    // Logprobs on the multi-stream path: the stream steps on the host for its logits, and its
    // greedy text is the folded one's.
    let plain = serde_json::json!({"prompt": "Count to five:", "max_tokens": 5, "temperature": 0});
    let mut with = plain.clone();
    with["logprobs"] = serde_json::json!(1);
    let (_, a) = exchange(&addr, "POST", "/v1/completions", &plain.to_string());
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &with.to_string());
    assert_eq!(st, 200, "{b}");
    let (a, b): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(&a).unwrap(),
        serde_json::from_str(&b).unwrap(),
    );
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "{b}");
    let lp = &b["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{b}");
    assert!(lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|x| x.as_f64().unwrap() <= 0.0));
    // A grammar on the multi-stream path: the stream steps on the host, its logits masked (on
    // device runs the text would be the model's free choice).
    let shaped = serde_json::json!({"prompt": "Count:", "max_tokens": 9, "temperature": 0,
        "guided_regex": "[0-9]{4}-[xyz]{2}"});
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &shaped.to_string());
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        t.len() == 7 && t[..4].bytes().all(|c| c.is_ascii_digit()) && &t[4..5] == "-",
        "{b}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{b}");
    // Greedy requests that end at the context's end take every step of their room: a run
    // of 4 that meets it is cut short, not dropped (room 7 and 8 gave 6 ids, 3 and 4 gave 2).
    // Last, as they take slots whose cached prefixes the checks above rely on.
    for room in [3usize, 4, 7, 8] {
        let ids: Vec<u32> = (0..256 - room as u32).map(|i| 1000 + i % 500).collect();
        let b = serde_json::json!({"prompt": ids, "max_tokens": room, "temperature": 0});
        let (st, b) = exchange(&addr, "POST", "/v1/completions", &b.to_string());
        assert_eq!(st, 200, "{b}");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], room, "room {room}: {b}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// On the multi-stream path, a request whose grammar fails mid-answer (its language turns out
/// empty after the first token) ends alone with a short error, while the request decoding
/// beside it in the same runs finishes in full (the whole run used to fail with it).
#[test]
fn a_failing_grammar_ends_only_its_own_request() {
    let Some(tok) = tokenizer_json() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "3", &tok);
    let (mut child, addr) = spawn_serve(
        &["--backend", "cpu", "--ctx", "512", "--max-streams", "2"],
        &model,
    );
    let long = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 200,
        "temperature": 0, "logprobs": 0});
    let a = addr.clone();
    let plain =
        std::thread::spawn(move || exchange(&a, "POST", "/v1/completions", &long.to_string()));
    std::thread::sleep(Duration::from_millis(300));
    let bad = serde_json::json!({"prompt": "x", "max_tokens": 5, "temperature": 0,
        "guided_grammar": "start: \"a\" b\nb: b \"c\"\n"});
    let (st, b) = exchange(&addr, "POST", "/v1/completions", &bad.to_string());
    assert_eq!(st, 500, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("admits no answer") && msg.len() < 500, "{msg}");
    let (st, b) = plain.join().unwrap();
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 200, "{b}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Prompt scoring on the multi-stream slots (`echo` with logprobs, `prompt_logprobs`): the GPU
/// (where an adapter exists) and CPU servers give the reference server's prompt logprobs, and
/// a repeated prompt (cached in its slot) is scored whole again.
#[test]
fn stream_slots_score_prompts_as_the_oracle_does() {
    let Some(tok) = tokenizer_json() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "3", &tok);
    let body = serde_json::json!({"prompt": "The capital of France is Paris, and of Spain",
        "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 1,
        "prompt_logprobs": 2})
    .to_string();
    let score = |args: &[&str]| {
        let (mut child, addr) = spawn_serve(args, &model);
        let mut out = Vec::new();
        for _ in 0..2 {
            let (st, b) = exchange(&addr, "POST", "/v1/completions", &body);
            assert_eq!(st, 200, "{args:?}: {b}");
            out.push(serde_json::from_str::<serde_json::Value>(&b).unwrap());
        }
        child.kill().unwrap();
        child.wait().unwrap();
        out
    };
    let want = score(&["--backend", "ref", "--ctx", "256"]);
    let lps = |v: &serde_json::Value| -> Vec<f64> {
        let c = &v["choices"][0];
        let mut x: Vec<f64> = (c["logprobs"]["token_logprobs"].as_array().unwrap())
            .iter()
            .filter_map(|x| x.as_f64())
            .collect();
        for (i, e) in c["prompt_logprobs"].as_array().unwrap().iter().enumerate() {
            if i > 0 {
                let m = e.as_object().unwrap();
                assert!(m.len() <= 3, "{e}");
                x.extend(m.values().map(|y| y["logprob"].as_f64().unwrap()));
            }
        }
        x
    };
    let mut backends = vec!["cpu"];
    if have_gpu() {
        backends.push("gpu");
    }
    for b in backends {
        let got = score(&["--backend", b, "--ctx", "256", "--max-streams", "2"]);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g["choices"][0]["text"], w["choices"][0]["text"], "{b}");
            assert_eq!(
                g["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
                "{b}"
            );
            let (g, w) = (lps(g), lps(w));
            assert_eq!(g.len(), w.len(), "{b}");
            for (i, (x, y)) in g.iter().zip(&w).enumerate() {
                assert!((x - y).abs() < 1e-3, "{b}: logprob {i}: {x} vs {y}");
            }
        }
    }
}
