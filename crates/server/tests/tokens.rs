//! `/tokenize` and `/detokenize` over the live server: the ids are the tokenizer's, a chat
//! conversation counts as the prompt a chat request would send, and the text comes back.

mod common;

use common::*;
use nibble_engine::Message;
use serde_json::json;

const CTX: usize = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tok = tokenizer();
    let text = "Hello, world! <|im_end|> 你好";
    let want = tok.encode(text).unwrap();
    for body in [json!({"prompt": text}), json!({"content": text})] {
        let (st, v) = post(&srv.base, "/tokenize", &body).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["tokens"], json!(want), "{v}");
        assert_eq!(v["count"], want.len());
        assert_eq!(v["max_model_len"], CTX);
    }
    // A text longer than the context is counted, not refused.
    let long = "word ".repeat(2 * CTX);
    let (st, v) = post(&srv.base, "/tokenize", &json!({"prompt": long})).await;
    assert_eq!(st, 200, "{v}");
    assert!(v["count"].as_u64().unwrap() > CTX as u64, "{v}");
    // With pieces (llama.cpp): each id with its text.
    let (_, v) = post(
        &srv.base,
        "/tokenize",
        &json!({"content": "Hello world", "with_pieces": true}),
    )
    .await;
    let pieces: String = (v["tokens"].as_array().unwrap().iter())
        .map(|p| p["piece"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(pieces, "Hello world");
    // A conversation: the ids a chat request's prompt has.
    let msgs = json!([{"role": "user", "content": "Hi there"}]);
    let (_, v) = post(
        &srv.base,
        "/tokenize",
        &json!({"messages": msgs,
        "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    let chat = chat_ids(&[Message::user("Hi there")], Some(false));
    assert_eq!(v["tokens"], json!(chat), "{v}");
    // Back to text, special tokens kept.
    let (st, v) = post(&srv.base, "/detokenize", &json!({"tokens": want})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["prompt"], text);
    assert_eq!(v["content"], text);
    // Bad requests name the field.
    for (path, body, param, msg) in [
        ("/tokenize", json!({}), "prompt", "give the text"),
        (
            "/tokenize",
            json!({"prompt": "a", "content": "b"}),
            "prompt",
            "one of",
        ),
        (
            "/tokenize",
            json!({"prompt": [1, 2]}),
            "prompt",
            "must be a string",
        ),
        (
            "/tokenize",
            json!({"messages": []}),
            "messages",
            "at least one message",
        ),
        ("/detokenize", json!({}), "tokens", "list of token ids"),
        (
            "/detokenize",
            json!({"tokens": [1, -1]}),
            "tokens",
            "tokens[1] = -1",
        ),
        (
            "/detokenize",
            json!({"tokens": [151936]}),
            "tokens",
            "0 to 151935",
        ),
    ] {
        let (st, v) = post(&srv.base, path, &body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(msg),
            "{body}: {v}"
        );
    }
}
