//! Bounded load test on loopback (ignored by default; run it with
//! `cargo test -p nibble-server --test load -- --ignored --nocapture`).
//!
//! A fixed number of requests (`NIBBLE_LOAD_REQUESTS`, default 96, `NIBBLE_LOAD_MAX_TOKENS` each,
//! default 24) from 32 concurrent clients, mixed chat/completions and streamed/whole, against
//! the reference backend on the tiny model, or against a running server at `NIBBLE_LOAD_URL`
//! (scripts/gpu-bench.sh `load`: `nibble serve` on the GPU with the full-size model; there
//! `NIBBLE_LOAD_QUEUE` is only the label the report prints).
//! Every request must end in a full answer (finish reason and usage) or a clean 429/503 error
//! body; the test prints p50/p99 latency and throughput. Each request has a 120 s timeout and the
//! whole run a 600 s one.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const CLIENTS: usize = 32;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One request; returns (status, generated tokens, latency).
async fn one(base: &str, i: usize) -> (u16, u64, Duration) {
    let stream = i % 2 == 1;
    let (path, mut body) = if i % 3 == 1 {
        let m = json!([{"role": "user", "content": format!("Question number {i}?")}]);
        (
            "/v1/chat/completions",
            json!({"messages": m, "chat_template_kwargs": {"enable_thinking": false}}),
        )
    } else {
        (
            "/v1/completions",
            json!({"prompt": format!("Story {i}: once upon a time")}),
        )
    };
    body["max_tokens"] = json!(env_usize("NIBBLE_LOAD_MAX_TOKENS", 24));
    // Half greedy (folded runs), half sampled with a seed and top-k (host sampling per token);
    // all greedy with `NIBBLE_LOAD_GREEDY` set.
    if i % 4 < 2 || std::env::var_os("NIBBLE_LOAD_GREEDY").is_some() {
        body["temperature"] = json!(0);
    } else {
        body["temperature"] = json!(0.7);
        body["top_k"] = json!(40);
        body["seed"] = json!(i);
    }
    body["stream"] = json!(stream);
    let t0 = Instant::now();
    let r = client(120)
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let lat = t0.elapsed();
    if status != 200 {
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {text}"));
        assert!(matches!(status, 429 | 503), "request {i}: {status} {text}");
        assert!(v["error"]["message"].is_string(), "{text}");
        return (status, 0, lat);
    }
    let usage = if stream {
        let sse = parse_sse(&text);
        assert!(sse.done, "request {i}: stream without [DONE]");
        let last = sse.chunks.last().unwrap();
        assert!(
            last["choices"][0]["finish_reason"].is_string(),
            "request {i}: {last}"
        );
        last["usage"].clone()
    } else {
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(
            v["choices"][0]["finish_reason"].is_string(),
            "request {i}: {v}"
        );
        v["usage"].clone()
    };
    (status, usage["completion_tokens"].as_u64().unwrap(), lat)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "load test: ~60 s; run explicitly"]
async fn load_32_clients() {
    let total = env_usize("NIBBLE_LOAD_REQUESTS", 96);
    let queue = env_usize("NIBBLE_LOAD_QUEUE", 64);
    // An external server (`nibble serve` on the GPU machine), or the reference backend here.
    let (base, _srv) = match std::env::var("NIBBLE_LOAD_URL") {
        Ok(url) => (url.trim_end_matches('/').to_owned(), None),
        Err(_) => {
            let Some(_) = model_path() else { return };
            let cfg = nibble_server::ServerConfig { queue, ..cfg() };
            let srv = start(cfg, 4096).await;
            (srv.base.clone(), Some(srv))
        }
    };
    // Tokens the server generated before this run (an external server may have served others).
    let before = metric(
        &get(&base, "/metrics", None).await.1,
        "nibble_generated_tokens_total",
    );
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let run = async {
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (base, next) = (base.clone(), next.clone());
                tokio::spawn(async move {
                    let mut out = vec![];
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= total {
                            return out;
                        }
                        out.push(one(&base, i).await);
                    }
                })
            })
            .collect();
        let mut all = vec![];
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all
    };
    let all = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("load run over 600 s");
    let wall = t0.elapsed().as_secs_f64();
    assert_eq!(all.len(), total);
    let ok: Vec<_> = all.iter().filter(|r| r.0 == 200).collect();
    let busy = all.len() - ok.len();
    let mut lat: Vec<Duration> = ok.iter().map(|r| r.2).collect();
    lat.sort();
    let tokens: u64 = ok.iter().map(|r| r.1).sum();
    assert!(!ok.is_empty(), "no request succeeded");
    println!(
        "load: {total} requests, {CLIENTS} clients, queue {queue}: {} ok, {busy} busy (429/503), {wall:.1} s, \
         {:.2} req/s, {:.1} generated tok/s, latency p50 {:.3} s p99 {:.3} s max {:.3} s",
        ok.len(),
        ok.len() as f64 / wall,
        tokens as f64 / wall,
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.last().unwrap().as_secs_f64(),
    );
    let (_, m) = get(&base, "/metrics", None).await;
    assert_eq!(
        (metric(&m, "nibble_generated_tokens_total") - before) as u64,
        tokens
    );
    assert_eq!(metric(&m, "nibble_queue_depth"), 0.0);
}
