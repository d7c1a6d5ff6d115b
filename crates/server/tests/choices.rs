//! `n` choices per request over the live server (the reference backend on the tiny synthetic
//! model), as vLLM serves them: each choice is a sequence of its own (choice i sampled from
//! seed + i), the response lists them by `index` with the prompt counted once in `usage`, and a
//! stream interleaves every choice's chunks and ends with one usage chunk and one `[DONE]`.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;

const CTX: usize = 256;

fn chat(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12, "chat_template_kwargs": {"enable_thinking": false}});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn texts(v: &Value, field: &str) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            let t = match field {
                "text" => &c["text"],
                _ => &c["message"]["content"],
            };
            t.as_str().unwrap().to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_choices_repeat_the_single_answer() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let body = |n: u32| {
        json!({"prompt": "The capital of France is", "max_tokens": 10,
        "temperature": 0, "n": n})
    };
    let (st, one) = post(&srv.base, "/v1/completions", &body(1)).await;
    assert_eq!(st, 200, "{one}");
    let (st, three) = post(&srv.base, "/v1/completions", &body(3)).await;
    assert_eq!(st, 200, "{three}");
    let want = texts(&one, "text");
    assert_eq!(texts(&three, "text"), vec![want[0].clone(); 3]);
    let (u1, u3) = (&one["usage"], &three["usage"]);
    assert_eq!(u3["prompt_tokens"], u1["prompt_tokens"]);
    let c1 = u1["completion_tokens"].as_u64().unwrap();
    assert_eq!(u3["completion_tokens"].as_u64().unwrap(), 3 * c1);
    assert_eq!(
        u3["total_tokens"].as_u64().unwrap(),
        u1["prompt_tokens"].as_u64().unwrap() + 3 * c1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_choices_are_seeded_one_apart_and_stream_interleaved() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let path = "/v1/chat/completions";
    // Choice i is what a lone request with seed 7 + i answers.
    let single = |seed: u64| chat(json!({"temperature": 1.0, "seed": seed}));
    let mut want = vec![];
    for seed in [7, 8, 9] {
        let (st, v) = post(&srv.base, path, &single(seed)).await;
        assert_eq!(st, 200, "{v}");
        want.push(texts(&v, "content").remove(0));
    }
    assert!(want[0] != want[1] || want[1] != want[2], "{want:?}");
    let (st, v) = post(
        &srv.base,
        path,
        &chat(json!({"temperature": 1.0, "seed": 7, "n": 3})),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(texts(&v, "content"), want);
    let usage = v["usage"].clone();

    // Streamed: every choice's chunks under its index, one finish each, then one usage chunk
    // (the whole request's) and one [DONE].
    let body = chat(
        json!({"temperature": 1.0, "seed": 7, "n": 3, "stream": true,
        "stream_options": {"include_usage": true}}),
    );
    let (st, _, sse) = post_stream(&srv.base, path, &body).await;
    assert_eq!(st, 200);
    assert!(sse.done, "{}", sse.raw);
    let mut got: BTreeMap<u64, (String, usize, bool)> = BTreeMap::new();
    let mut usages = vec![];
    for c in &sse.chunks {
        if !c["usage"].is_null() {
            usages.push(c["usage"].clone());
        }
        let Some(ch) = c["choices"].get(0) else {
            continue;
        };
        let e = got.entry(ch["index"].as_u64().unwrap()).or_default();
        if ch["delta"]["role"] == "assistant" {
            assert!(e.0.is_empty() && !e.2, "role chunk first: {}", sse.raw);
            e.2 = true;
        }
        e.0.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        e.1 += usize::from(!ch["finish_reason"].is_null());
    }
    let streamed: Vec<String> = got.values().map(|e| e.0.clone()).collect();
    assert_eq!(streamed, want);
    assert!(got.values().all(|e| e.1 == 1 && e.2), "{got:?}");
    assert_eq!(usages, vec![usage.clone()], "{}", sse.raw);
    let last = sse.chunks.last().unwrap();
    assert!(last["choices"].as_array().unwrap().is_empty() && last["usage"] == usage);

    // Without include_usage a stream of several choices carries no usage at all.
    let body = chat(json!({"temperature": 0, "n": 2, "stream": true}));
    let (_, _, sse) = post_stream(&srv.base, path, &body).await;
    assert!(
        sse.done && sse.chunks.iter().all(|c| c["usage"].is_null()),
        "{}",
        sse.raw
    );
    let finishes = sse
        .chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 2);
}

/// A request's choices enter the queue together or not at all: more than the queue holds is a
/// 400 naming `n` (a 429 would never clear), as many as it holds on an idle server all run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_are_admitted_all_together() {
    let Some(_) = model_path() else { return };
    let cfg = nibble_server::ServerConfig {
        queue: 4,
        max_streams: 1,
        ..cfg()
    };
    let srv = start(cfg, CTX).await;
    let body = |n: u32| json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "n": n});
    for _ in 0..3 {
        let (st, v) = post(&srv.base, "/v1/completions", &body(5)).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "n", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("queue of 4"),
            "{v}"
        );
        let (st, v) = post(&srv.base, "/v1/completions", &body(4)).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"].as_array().unwrap().len(), 4);
    }
    // Nothing of the refused requests ran: 3 x 4 choices of 2 tokens were generated.
    let (_, m) = get(&srv.base, "/metrics", None).await;
    assert_eq!(metric(&m, "nibble_generated_tokens_total"), 24.0, "{m}");
    assert_eq!(metric(&m, "nibble_queue_depth"), 0.0);
}

/// Each choice's tool calls have ids of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_ids_are_unique_across_choices() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tools = json!([{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}},
        "required": ["side"], "additionalProperties": false}}}]);
    let body = chat(
        json!({"temperature": 0, "n": 2, "max_tokens": 40, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "pick"}}}),
    );
    let (st, v) = post(&srv.base, "/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let id = |i: usize| v["choices"][i]["message"]["tool_calls"][0]["id"].clone();
    assert!(id(0).is_string() && id(1).is_string(), "{v}");
    assert_ne!(id(0), id(1), "{v}");
}
