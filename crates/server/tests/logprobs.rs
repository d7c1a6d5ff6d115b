//! Logprobs over the live server (the reference backend on the tiny synthetic model): each
//! generated token gets its entry, the greedy choice is the most likely alternative, the text
//! is the greedy text served without logprobs, and streams carry the same entries.

mod common;

use common::*;
use serde_json::{json, Value};

const CTX: usize = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_gets_its_logprob_and_alternatives() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let plain = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0});
    let (_, want) = post(&srv.base, "/v1/completions", &plain).await;
    let mut body = plain.clone();
    body["logprobs"] = json!(3);
    let (st, v) = post(&srv.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    // Stepped on the host for its logits, the greedy text is the folded one's.
    assert_eq!(c["text"], want["choices"][0]["text"]);
    assert!(want["choices"][0]["logprobs"].is_null());
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = (lp["tokens"].as_array().unwrap().iter())
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        tokens.len(),
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    if c["finish_reason"] == "length" {
        assert_eq!(tokens.concat(), c["text"].as_str().unwrap());
    }
    for (i, t) in tokens.iter().enumerate() {
        let x = lp["token_logprobs"][i].as_f64().unwrap();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(x <= 0.0 && top.len() <= 3 && !top.is_empty(), "{lp}");
        // Greedy: the chosen token is the most likely one.
        let best = top
            .values()
            .map(|y| y.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - x).abs() < 1e-6, "token {i} {t:?}: {x} vs {best}");
    }
    // The sampled token is always listed among the alternatives (OpenAI's "up to logprobs + 1"):
    // with logprobs 0 it alone, with 1 beside the favourite when it was not that.
    for k in [0, 1] {
        let sampled = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 2.0,
            "seed": 9, "logprobs": k});
        let (st, v) = post(&srv.base, "/v1/completions", &sampled).await;
        assert_eq!(st, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let mut extra = 0;
        for (i, t) in lp["tokens"].as_array().unwrap().iter().enumerate() {
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert_eq!(top[t.as_str().unwrap()], lp["token_logprobs"][i], "{lp}");
            assert!(top.len() <= k + 1, "{lp}");
            extra += usize::from(top.len() == k + 1);
        }
        // Sampled at temperature 2, some tokens are not the favourite.
        assert!(k == 0 || extra > 0, "{lp}");
    }
    // A special token the text leaves out (<|im_start|>, forced) has its entries, but moves
    // no text offset (they pointed past the returned text).
    let forced = json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 1,
        "logit_bias": {"151644": 100}});
    let (_, v) = post(&srv.base, "/v1/completions", &forced).await;
    assert_eq!(v["choices"][0]["text"], "");
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"],
        json!(vec!["<|im_start|>"; 3])
    );
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"], json!([0, 0, 0]));
    // Chat: `logprobs: true` with top_logprobs; a stream carries the same entries.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
        "temperature": 0, "logprobs": true, "top_logprobs": 2,
        "chat_template_kwargs": {"enable_thinking": false}});
    let (st, v) = post(&srv.base, "/v1/chat/completions", &chat).await;
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in &content {
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2, "{e}");
        assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"], "{e}");
        let bytes: Vec<u8> = (e["bytes"].as_array().unwrap().iter())
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
    }
    let mut s = chat.clone();
    s["stream"] = json!(true);
    let (_, _, sse) = post_stream(&srv.base, "/v1/chat/completions", &s).await;
    let streamed: Vec<Value> = (sse.chunks.iter())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed, content);
    assert_eq!(
        sse.text(),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

/// The `logprobs` objects of a stream's chunks, in order (chunks without entries left out).
fn streamed(sse: &common::Sse) -> Vec<Value> {
    (sse.chunks.iter())
        .map(|c| c["choices"][0]["logprobs"].clone())
        .filter(|v| !v.is_null())
        .collect()
}

/// One key's lists of several completions `logprobs` objects, joined.
fn joined(parts: &[Value], key: &str) -> Vec<Value> {
    (parts.iter())
        .flat_map(|v| v[key].as_array().unwrap().clone())
        .collect()
}

/// Alone on the main sequence (the reference backend) and on the CPU's stream slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_entries_come_with_their_text() {
    let Some(_) = model_path() else { return };
    streamed_entries_on(start(cfg(), CTX).await).await;
    streamed_entries_on(start_streams(cfg(), CTX).await).await;
}

async fn streamed_entries_on(srv: TestServer) {
    let body = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
        "logprobs": 2});
    let (_, v) = post(&srv.base, "/v1/completions", &body).await;
    let whole = &v["choices"][0]["logprobs"];
    let mut s = body.clone();
    s["stream"] = json!(true);
    let (_, _, sse) = post_stream(&srv.base, "/v1/completions", &s).await;
    let parts = streamed(&sse);
    // Token by token, not all at the end; together the non-streamed answer's entries, the
    // text offsets counting from the answer's start.
    assert!(parts.len() > 1, "{}", sse.raw);
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(joined(&parts, key), whole[key].as_array().unwrap().clone());
    }
    // Each chunk's text is what the entries so far spell, less a character they end inside of.
    let (mut spelt, mut text) = (String::new(), String::new());
    for c in &sse.chunks {
        let choice = &c["choices"][0];
        text.push_str(choice["text"].as_str().unwrap_or(""));
        for t in choice["logprobs"]["tokens"]
            .as_array()
            .into_iter()
            .flatten()
        {
            spelt.push_str(t.as_str().unwrap());
        }
        if choice["logprobs"].is_object() {
            assert_eq!(spelt.trim_end_matches('\u{FFFD}'), text, "{c}");
        }
    }
    // A stop string that is a whole token's text: its id's entry still comes (in a chunk of
    // its own before the final one), as it does unstreamed.
    let tokens: Vec<&str> = (whole["tokens"].as_array().unwrap().iter())
        .map(|t| t.as_str().unwrap())
        .collect();
    let text = v["choices"][0]["text"].as_str().unwrap();
    let offsets = whole["text_offset"].as_array().unwrap();
    let k = (3..tokens.len())
        .find(|&k| {
            let t = tokens[k].trim();
            let at = offsets[k].as_u64().unwrap() as usize;
            t.chars().count() >= 2
                && t.chars().all(char::is_alphanumeric)
                // Not complete in the text before token k's last character.
                && !(text.chars().take(at + tokens[k].chars().count() - 1))
                    .collect::<String>()
                    .contains(tokens[k])
        })
        .expect("some token to stop at");
    let stop = tokens[k];
    let mut body = body.clone();
    body["stop"] = json!([stop]);
    let (_, v) = post(&srv.base, "/v1/completions", &body).await;
    let whole = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(whole["tokens"].as_array().unwrap().len(), k + 1, "{v}");
    body["stream"] = json!(true);
    let (_, _, sse) = post_stream(&srv.base, "/v1/completions", &body).await;
    assert_eq!(sse.text(), v["choices"][0]["text"].as_str().unwrap());
    let parts = streamed(&sse);
    for key in ["tokens", "token_logprobs", "text_offset"] {
        assert_eq!(joined(&parts, key), whole[key].as_array().unwrap().clone());
    }
}
