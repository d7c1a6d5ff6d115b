//! End-to-end tests over raw HTTP: a live server on a loopback port with the reference backend on
//! the tiny synthetic model; every request has a bounded timeout.

mod common;

use common::*;
use nibble_engine::session::{GenParams, Session};
use nibble_engine::Message;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const CTX: usize = 4096;

fn chat_body(user: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "chat_template_kwargs": {"enable_thinking": false},
    })
}

/// Greedy text of `prompt` from a Session driven directly: the ground truth for the server.
fn direct_greedy(prompt: &[u32], max_tokens: usize) -> String {
    let tok = tokenizer();
    let mut s = Session::new(Box::new(backend(CTX)));
    let p = GenParams {
        max_tokens,
        ..GenParams::default()
    };
    let mut out = String::new();
    s.generate(&tok, prompt, &p, &mut |t, _| {
        out.push_str(t);
        true
    })
    .unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming_and_streaming_agree_with_the_session() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let (st, v) = post(
        &srv.base,
        "/v1/chat/completions",
        &chat_body("Hi there", 12, false),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap().to_owned();
    let msgs = [Message::system("Be brief."), Message::user("Hi there")];
    let ids = chat_ids(&msgs, Some(false));
    assert_eq!(text, direct_greedy(&ids, 12));
    assert!(!text.is_empty());
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], ids.len());
    let done = u["completion_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"].as_u64().unwrap(), ids.len() as u64 + done);
    match choice["finish_reason"].as_str().unwrap() {
        "length" => assert_eq!(done, 12),
        "stop" => assert!(done <= 12),
        f => panic!("finish {f}"),
    }

    let (st, ctype, sse) = post_stream(
        &srv.base,
        "/v1/chat/completions",
        &chat_body("Hi there", 12, true),
    )
    .await;
    assert_eq!(st, 200);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert!(sse.done, "no [DONE]: {}", sse.raw);
    let first = &sse.chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let ids_seen: Vec<&str> = sse
        .chunks
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert!(
        ids_seen.iter().all(|i| *i == ids_seen[0]),
        "one id per stream"
    );
    assert_eq!(sse.text(), text);
    let last = sse.chunks.last().unwrap();
    assert_eq!(last["choices"][0]["delta"], json!({}));
    assert_eq!(last["choices"][0]["finish_reason"], choice["finish_reason"]);
    assert_eq!(last["usage"]["completion_tokens"], done);
    // The repeat is served from the cache: the whole prompt but the one token fed for logits.
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"],
        ids.len() - 1
    );
    for c in &sse.chunks[1..sse.chunks.len() - 1] {
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["choices"][0]["delta"]["content"].is_string());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_default_to_16_tokens_and_stream_the_same_text() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let body = json!({"prompt": "Once upon a time", "temperature": 0});
    let (st, v) = post(&srv.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let ids = tokenizer().encode("Once upon a time").unwrap();
    assert_eq!(text, direct_greedy(&ids, 16));
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    if v["choices"][0]["finish_reason"] == "length" {
        assert_eq!(v["usage"]["completion_tokens"], 16);
    }
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (st, _, sse) = post_stream(&srv.base, "/v1/completions", &sbody).await;
    assert_eq!(st, 200);
    assert!(sse.done);
    assert_eq!(sse.text(), text);
    assert!(sse.chunks.iter().all(|c| c["object"] == "text_completion"));
    // include_usage: a last chunk with no choices and the usage.
    let n = sse.chunks.len();
    assert_eq!(sse.chunks[n - 1]["choices"], json!([]));
    assert_eq!(
        sse.chunks[n - 1]["usage"],
        v["usage"].clone().tap_cached(ids.len() - 1)
    );
    assert_eq!(
        sse.chunks[n - 2]["choices"][0]["finish_reason"],
        v["choices"][0]["finish_reason"]
    );
    // Only there: a client that adds up every chunk's usage counts it once.
    assert_eq!(sse.chunks[n - 2]["usage"], Value::Null);
    // Token-id prompts are accepted too.
    let (st, v2) = post(
        &srv.base,
        "/v1/completions",
        &json!({"prompt": ids, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(v2["choices"][0]["text"].as_str().unwrap(), text);
}

/// Sets `prompt_tokens_details.cached_tokens` on a usage value.
trait TapCached {
    fn tap_cached(self, n: usize) -> Value;
}
impl TapCached for Value {
    fn tap_cached(mut self, n: usize) -> Value {
        self["prompt_tokens_details"]["cached_tokens"] = json!(n);
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_greedy_requests_match_their_single_texts() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let users = [
        "Tell me a story",
        "What is 2+2?",
        "Name a color",
        "Write a haiku",
    ];
    let mut single = vec![];
    for u in users {
        let (st, v) = post(&srv.base, "/v1/chat/completions", &chat_body(u, 20, false)).await;
        assert_eq!(st, 200, "{v}");
        single.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert!(
        single.iter().any(|t| t != &single[0]),
        "prompts should differ: {single:?}"
    );
    // Two streamed, two whole, all at once.
    let base = srv.base.clone();
    let tasks: Vec<_> = users
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let base = base.clone();
            let body = chat_body(u, 20, i % 2 == 0);
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let (st, _, sse) = post_stream(&base, "/v1/chat/completions", &body).await;
                    assert_eq!(st, 200);
                    assert!(sse.done);
                    sse.text()
                } else {
                    let (st, v) = post(&base, "/v1/chat/completions", &body).await;
                    assert_eq!(st, 200, "{v}");
                    v["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                }
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), single[i], "request {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_stream_is_cancelled_and_frees_the_worker() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    // Speed of this machine: a short request.
    let t0 = Instant::now();
    let (st, _) = post(
        &srv.base,
        "/v1/completions",
        &json!({"prompt": "abc", "max_tokens": 32, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200);
    let per_token = t0.elapsed().as_secs_f64() / 32.0;
    let long = 4000;
    let mut r = client(120)
        .post(format!("{}/v1/completions", srv.base))
        .json(&json!({"prompt": "Count to a million:", "max_tokens": long, "temperature": 0, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut got = 0;
    while got < 3 {
        let c = r.chunk().await.unwrap().expect("stream ended early");
        got += String::from_utf8_lossy(&c).matches("data: ").count();
    }
    drop(r);
    let t1 = Instant::now();
    let (st, v) = post(
        &srv.base,
        "/v1/completions",
        &json!({"prompt": "abc", "max_tokens": 8, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let waited = t1.elapsed().as_secs_f64();
    // The abandoned request would need `long` tokens; the follow-up must not wait for them.
    assert!(
        waited < (per_token * long as f64 / 4.0).max(2.0),
        "follow-up waited {waited:.2}s (per token {per_token:.4}s)"
    );
    let (_, m) = get(&srv.base, "/metrics", None).await;
    let generated = metric(&m, "nibble_generated_tokens_total");
    assert!(
        generated < (32 + 8 + long / 2) as f64,
        "cancelled request kept going: {generated} tokens"
    );
    assert_eq!(metric(&m, "nibble_active_streams"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_turn_reuses_the_cached_prefix() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let (st, v) = post(
        &srv.base,
        "/v1/chat/completions",
        &chat_body("Hello", 10, false),
    )
    .await;
    assert_eq!(st, 200);
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut body = chat_body("And then?", 10, false);
    body["messages"] = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And then?"},
    ]);
    let (st, v2) = post(&srv.base, "/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v2}");
    let p1 = chat_ids(
        &[Message::system("Be brief."), Message::user("Hello")],
        Some(false),
    );
    let p2 = chat_ids(
        &[
            Message::system("Be brief."),
            Message::user("Hello"),
            Message::assistant(answer),
            Message::user("And then?"),
        ],
        Some(false),
    );
    let lcp = p1.iter().zip(&p2).take_while(|(a, b)| a == b).count();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert_eq!(v2["usage"]["prompt_tokens"], p2.len());
    assert!(
        cached >= lcp && cached < p2.len(),
        "cached {cached}, lcp {lcp}, prompt {}",
        p2.len()
    );
}

/// `logit_bias` is applied (it was refused): +100 on id 0 ("!") wins every greedy step, and a
/// ban (-100) on the greedy first token gives the text a Session with the same bias gives;
/// special tokens are left out of the text unless `skip_special_tokens` is false.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_steers_and_bans_tokens() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let body = |bias: Value| json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logit_bias": bias});
    let (st, v) = post(&srv.base, "/v1/completions", &body(json!({"0": 100}))).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], "!!!!!!");
    let tok = tokenizer();
    let ids = tok.encode("Once upon a time").unwrap();
    let plain = direct_greedy(&ids, 6);
    let first = tok.encode(&direct_greedy(&ids, 1)).unwrap();
    assert_eq!(
        first.len(),
        1,
        "the first greedy token's text re-encodes to one id"
    );
    let (st, v) = post(
        &srv.base,
        "/v1/completions",
        &body(json!({first[0].to_string(): -100})),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let banned = v["choices"][0]["text"].as_str().unwrap();
    let mut s = Session::new(Box::new(backend(CTX)));
    let mut p = GenParams {
        max_tokens: 6,
        ..GenParams::default()
    };
    p.sampling.logit_bias = vec![(first[0], -100.0)];
    let mut want = String::new();
    s.generate(&tok, &ids, &p, &mut |t, _| {
        want.push_str(t);
        true
    })
    .unwrap();
    assert_eq!(banned, want);
    assert_ne!(banned, plain);
    // A forced special token (<|vision_start|>) adds no text unless skip_special_tokens is
    // false (vLLM's switch); it is counted either way.
    let mut b = body(json!({"151652": 100}));
    b["max_tokens"] = json!(3);
    let (_, v) = post(&srv.base, "/v1/completions", &b).await;
    assert_eq!(v["choices"][0]["text"], "");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    b["skip_special_tokens"] = json!(false);
    let (_, v) = post(&srv.base, "/v1/completions", &b).await;
    assert_eq!(v["choices"][0]["text"], "<|vision_start|>".repeat(3));
}

/// A chat answer's leading `<think>` block is `reasoning_content` (llama.cpp's default), in
/// whole answers and streamed deltas; `--reasoning-format none` leaves it in `content`. The
/// tiny model is made to think by a bias on `<think>` (151667): three of them open a block
/// holding the other two, never closed (the token limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_goes_to_reasoning_content() {
    let Some(_) = model_path() else { return };
    let mut body = chat_body("Think.", 3, false);
    body["logit_bias"] = json!({"151667": 100});
    for reasoning in [true, false] {
        let srv = start(nibble_server::ServerConfig { reasoning, ..cfg() }, CTX).await;
        let (st, v) = post(&srv.base, "/v1/chat/completions", &body).await;
        assert_eq!(st, 200, "{v}");
        let m = &v["choices"][0]["message"];
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let (_, _, sse) = post_stream(&srv.base, "/v1/chat/completions", &sbody).await;
        let streamed_reasoning: String = (sse.chunks.iter())
            .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
            .collect();
        if reasoning {
            assert_eq!(m["reasoning_content"], "<think><think>", "{v}");
            assert_eq!(m["content"], "");
            assert_eq!(streamed_reasoning, "<think><think>");
            assert_eq!(sse.text(), "");
        } else {
            assert_eq!(m["content"], "<think><think><think>", "{v}");
            assert!(m.get("reasoning_content").is_none());
            assert_eq!(streamed_reasoning, "");
            assert_eq!(sse.text(), "<think><think><think>");
        }
    }
}

/// `tool_choice: "none"` is OpenAI's "no tool calls": the tools are left out of the prompt
/// (it was a 400 beside tools); `"auto"` renders them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_none_leaves_the_tools_out() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let mut prompt_tokens = vec![];
    for (tools, choice) in [
        (None, None),
        (Some(&tools), Some("none")),
        (Some(&tools), Some("auto")),
    ] {
        let mut b = chat_body("Weather in Paris?", 1, false);
        if let Some(t) = tools {
            b["tools"] = t.clone();
        }
        if let Some(c) = choice {
            b["tool_choice"] = json!(c);
        }
        let (st, v) = post(&srv.base, "/v1/chat/completions", &b).await;
        assert_eq!(st, 200, "{v}");
        prompt_tokens.push(v["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    assert_eq!(prompt_tokens[0], prompt_tokens[1]);
    assert!(
        prompt_tokens[2] > prompt_tokens[0] + 20,
        "{prompt_tokens:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_seeds() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let body = json!({"prompt": "The weather today", "max_tokens": 24, "temperature": 0});
    let (_, v) = post(&srv.base, "/v1/completions", &body).await;
    let full = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 12, "{full:?}");
    let stop: String = chars[8..11].iter().collect();
    let cut = &full[..full.find(&stop).unwrap()];
    let mut b = body.clone();
    b["stop"] = json!([stop, "\u{1}never"]);
    let (st, v) = post(&srv.base, "/v1/completions", &b).await;
    assert_eq!(st, 200);
    assert_eq!(v["choices"][0]["text"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Sampled with a seed: reproducible.
    let s = json!({"prompt": "The weather today", "max_tokens": 16, "temperature": 0.9, "top_k": 40, "min_p": 0.01, "seed": 7});
    let (_, a) = post(&srv.base, "/v1/completions", &s).await;
    let (_, b) = post(&srv.base, "/v1/completions", &s).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    // Seed -1 is llama.cpp's random seed (it was the fixed seed u64::MAX): three requests do
    // not all agree (16 ids at temperature 1.5 over the tiny model's near-flat logits).
    let r =
        json!({"prompt": "The weather today", "max_tokens": 16, "temperature": 1.5, "seed": -1});
    let mut texts = vec![];
    for _ in 0..3 {
        let (_, v) = post(&srv.base, "/v1/completions", &r).await;
        texts.push(v["choices"][0]["text"].clone());
    }
    assert!(texts.iter().any(|t| t != &texts[0]), "{texts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_guards_every_route_but_health_and_cors_preflights() {
    let Some(_) = model_path() else { return };
    let srv = start(
        nibble_server::ServerConfig {
            api_key: Some("sekrit".into()),
            ..cfg()
        },
        CTX,
    )
    .await;
    let (st, body) = get(&srv.base, "/v1/models", None).await;
    assert_eq!(st, 401);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("missing API key"));
    let (st, body) = get(&srv.base, "/v1/models", Some("wrong")).await;
    assert_eq!(st, 401);
    assert!(body.contains("incorrect API key"));
    // The scheme is case-insensitive; another scheme is named as such (it read "missing").
    for (auth, status, want) in [
        ("bearer sekrit", 200, ""),
        ("Basic c2Vrcml0", 401, "is not `Bearer KEY`"),
    ] {
        let r = client(30)
            .get(format!("{}/v1/models", srv.base))
            .header("authorization", auth)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{auth}");
        assert!(r.text().await.unwrap().contains(want), "{auth}");
    }
    let (st, _) = get(&srv.base, "/metrics", None).await;
    assert_eq!(st, 401);
    let (st, body) = get(&srv.base, "/v1/models", Some("sekrit")).await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["object"], "list");
    let (st, body) = get(&srv.base, "/health", None).await;
    assert_eq!((st, body.as_str()), (200, r#"{"status":"ok"}"#));
    let r = client(30)
        .post(format!("{}/v1/completions", srv.base))
        .bearer_auth("sekrit")
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client(30)
        .post(format!("{}/v1/completions", srv.base))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // CORS, as llama.cpp's and vLLM's servers answer: a browser's preflight carries no key and
    // is answered (it was a 401, so no web page on another origin could call the server) ...
    let r = client(30)
        .request(
            reqwest::Method::OPTIONS,
            format!("{}/v1/chat/completions", srv.base),
        )
        .header("origin", "http://localhost:3000")
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let h = |r: &reqwest::Response, k: &str| {
        r.headers()
            .get(k)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    assert_eq!(h(&r, "access-control-allow-origin"), "*");
    assert!(h(&r, "access-control-allow-methods").contains("POST"));
    // Named, not `*`: browsers do not let the wildcard cover Authorization.
    let allowed = h(&r, "access-control-allow-headers");
    assert!(
        allowed.contains("authorization") && allowed.contains("content-type"),
        "{allowed}"
    );
    // ... and the answers themselves name any origin; the key is still needed.
    for key in [Some("sekrit"), None] {
        let mut q = client(30)
            .get(format!("{}/v1/models", srv.base))
            .header("origin", "http://localhost:3000");
        if let Some(k) = key {
            q = q.bearer_auth(k);
        }
        let r = q.send().await.unwrap();
        assert_eq!(r.status(), if key.is_some() { 200 } else { 401 });
        assert_eq!(h(&r, "access-control-allow-origin"), "*");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_metrics_count_it() {
    let Some(_) = model_path() else { return };
    let cfg = nibble_server::ServerConfig {
        max_streams: 1,
        queue: 1,
        ..cfg()
    };
    let srv = start(cfg, CTX).await;
    let slow =
        json!({"prompt": "Count slowly:", "max_tokens": 4000, "temperature": 0, "stream": true});
    // A: admitted and decoding.
    let mut a = client(120)
        .post(format!("{}/v1/completions", srv.base))
        .json(&slow)
        .send()
        .await
        .unwrap();
    assert_eq!(a.status(), 200);
    a.chunk().await.unwrap().expect("first chunk");
    // B: waits in the single queue slot.
    let b = client(120)
        .post(format!("{}/v1/completions", srv.base))
        .json(&slow)
        .send()
        .await
        .unwrap();
    assert_eq!(b.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, m) = get(&srv.base, "/metrics", None).await;
        if metric(&m, "nibble_queue_depth") == 1.0 {
            assert_eq!(metric(&m, "nibble_active_streams"), 1.0);
            break;
        }
        assert!(Instant::now() < deadline, "B never queued:\n{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // C: no room.
    let (st, v) = post(
        &srv.base,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], "queue_full");
    drop(a);
    drop(b);
    // Both abandoned: the server notices at its next write to each, so a client retrying on 429
    // (as the openai client does) is served within moments.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut retries = 0;
    loop {
        let (st, v) = post(
            &srv.base,
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 3, "temperature": 0}),
        )
        .await;
        if st == 200 {
            break;
        }
        assert_eq!(st, 429, "{v}");
        assert!(
            Instant::now() < deadline,
            "the abandoned requests still hold the queue"
        );
        retries += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("served after {retries} retries");
    let (st, m) = get(&srv.base, "/metrics", None).await;
    assert_eq!(st, 200);
    assert!(
        m.contains(&format!(
            "nibble_requests_total{{status=\"429\"}} {}",
            1 + retries
        )),
        "{m}"
    );
    assert!(
        m.contains("# TYPE nibble_decode_tokens_per_second gauge"),
        "{m}"
    );
    assert!(metric(&m, "nibble_decode_tokens_per_second") > 0.0, "{m}");
    assert!(metric(&m, "nibble_prompt_tokens_total") >= 3.0, "{m}");
    assert!(metric(&m, "nibble_generated_tokens_total") >= 3.0, "{m}");
    assert_eq!(metric(&m, "nibble_queue_depth"), 0.0);
    // The /metrics requests before this one were counted as 200s.
    assert!(
        m.lines()
            .any(|l| l.starts_with("nibble_requests_total{status=\"200\"} ")),
        "{m}"
    );
}

/// A `developer` message (OpenAI's newer name for the system role, which current SDKs send)
/// is the system message: the same prompt and the same greedy text; text parts are the lines
/// of one message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_developer_message_is_the_system_message() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let system = chat_body("Name a color", 8, false);
    let mut developer = system.clone();
    developer["messages"][0]["role"] = "developer".into();
    let (st, a) = post(&srv.base, "/v1/chat/completions", &system).await;
    assert_eq!(st, 200, "{a}");
    let (st, b) = post(&srv.base, "/v1/chat/completions", &developer).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    // Text parts are the lines of one message, as vLLM joins them.
    let mut parts = system.clone();
    parts["messages"][1]["content"] =
        json!([{"type": "text", "text": "Name"}, {"type": "text", "text": "a color"}]);
    let mut lines = system.clone();
    lines["messages"][1]["content"] = json!("Name\na color");
    let (_, c) = post(&srv.base, "/v1/chat/completions", &parts).await;
    let (_, d) = post(&srv.base, "/v1/chat/completions", &lines).await;
    assert_eq!(
        c["usage"]["prompt_tokens"], d["usage"]["prompt_tokens"],
        "{c}"
    );
    assert_eq!(c["choices"][0]["message"], d["choices"][0]["message"]);
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`) describes the served model or answers
/// 404 `model_not_found`; the routes answer without the `/v1` prefix too, as llama.cpp's do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_is_retrieved_by_id_and_routes_work_without_v1() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let (st, body) = get(&srv.base, "/v1/models/tiny", None).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (st, &v["id"], &v["object"]),
        (200, &json!("tiny"), &json!("model"))
    );
    let (st, body) = get(&srv.base, "/v1/models/gpt-4", None).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("model_not_found")),
        "{v}"
    );
    let (st, body) = get(&srv.base, "/models", None).await;
    assert!(st == 200 && body.contains("\"tiny\""), "{body}");
    let request = chat_body("Name a color", 6, false);
    let (st, a) = post(&srv.base, "/v1/chat/completions", &request).await;
    assert_eq!(st, 200, "{a}");
    let (st, b) = post(&srv.base, "/chat/completions", &request).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    let text = json!({"prompt": "Once", "max_tokens": 3, "temperature": 0});
    let (st, c) = post(&srv.base, "/completions", &text).await;
    assert_eq!(st, 200, "{c}");
}
