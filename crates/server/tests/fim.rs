//! Completions' `suffix` (OpenAI's insertion) as Qwen's fill-in-the-middle prompt, over the
//! live server (the reference backend on the tiny synthetic model, real Qwen3 tokenizer): the
//! request answers as the same prompt spelled out in token ids does, and what cannot be an
//! insertion is refused by name.

mod common;

use common::*;
use serde_json::json;

const CTX: usize = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suffix_is_a_fill_in_the_middle_prompt() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tok = tokenizer();
    let (prefix, suffix) = ("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n");
    let id = |t: &str| tok.token_to_id(t).unwrap();
    let mut ids = vec![id("<|fim_prefix|>")];
    ids.extend(tok.encode(prefix).unwrap());
    ids.push(id("<|fim_suffix|>"));
    ids.extend(tok.encode(suffix).unwrap());
    ids.push(id("<|fim_middle|>"));
    assert_eq!(ids[0], 151659, "Qwen's <|fim_prefix|>");
    let body = json!({"prompt": prefix, "suffix": suffix, "max_tokens": 8, "temperature": 0});
    let (st, v) = post(&srv.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    let spelled = json!({"prompt": [ids], "max_tokens": 8, "temperature": 0});
    let (st, w) = post(&srv.base, "/v1/completions", &spelled).await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(v["choices"][0]["text"], w["choices"][0]["text"]);
    // An empty suffix is no insertion: a plain completion.
    let plain = json!({"prompt": prefix, "suffix": "", "max_tokens": 8, "temperature": 0});
    let (_, p) = post(&srv.base, "/v1/completions", &plain).await;
    assert_eq!(
        p["usage"]["prompt_tokens"],
        tok.encode(prefix).unwrap().len()
    );

    for (path, body, param, says) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "suffix": "x"}),
            "suffix",
            "/v1/completions only",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "suffix": "b", "echo": true}),
            "echo",
            "not supported with suffix",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "suffix": "b"}),
            "suffix",
            "prompt as one string",
        ),
        // The prompt's own faults name the prompt.
        (
            "/v1/completions",
            json!({"suffix": "b"}),
            "prompt",
            "prompt is required",
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"], "suffix": "c"}),
            "prompt",
            "batched prompts",
        ),
        // A suffix too long for the context names the suffix.
        (
            "/v1/completions",
            json!({"prompt": "a", "suffix": "word ".repeat(40_000)}),
            "suffix",
            "cannot fit",
        ),
    ] {
        let (st, v) = post(&srv.base, path, &body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{v}"
        );
    }
}
