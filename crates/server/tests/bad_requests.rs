//! A table of malformed or out-of-range requests: each must get its status and an OpenAI-style
//! error body (`error.message`, `error.type`, `error.param`, `error.code`), and the server must
//! keep serving afterwards.

mod common;

use common::*;
use serde_json::{json, Value};

/// A small context so that over-long prompts are cheap to send.
const CTX: usize = 64;

struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    body: String,
    status: u16,
    /// Expected `error.type`.
    kind: &'static str,
    /// Expected `error.param` (None = null).
    param: Option<&'static str>,
    /// A substring of `error.message`.
    msg: &'static str,
}

fn case(
    name: &'static str,
    path: &'static str,
    body: Value,
    param: Option<&'static str>,
    msg: &'static str,
) -> Case {
    Case {
        name,
        method: "POST",
        path,
        body: body.to_string(),
        status: 400,
        kind: "invalid_request_error",
        param,
        msg,
    }
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

const C: &str = "/v1/chat/completions";
const T: &str = "/v1/completions";

fn table() -> Vec<Case> {
    let long_ids: Vec<u32> = (0..CTX as u32).map(|i| 1000 + i).collect();
    let raw = |name, body: &str, param, msg| Case {
        body: body.to_owned(),
        ..case(name, C, json!(null), param, msg)
    };
    vec![
        raw(
            "malformed JSON",
            r#"{"messages": [{"role": "user""#,
            None,
            "malformed JSON",
        ),
        raw("empty body", "", None, "request body is empty"),
        raw("not an object", "[1, 2, 3]", None, "must be a JSON object"),
        case(
            "temperature of the wrong type",
            C,
            chat(json!({"temperature": "hot"})),
            Some("temperature"),
            "invalid type: string",
        ),
        case(
            "stream of the wrong type",
            C,
            chat(json!({"stream": "yes"})),
            Some("stream"),
            "invalid type: string",
        ),
        case(
            "top_k not an integer",
            C,
            chat(json!({"top_k": 1.5})),
            Some("top_k"),
            "1.5 is not an integer",
        ),
        case(
            "max_tokens a string",
            C,
            chat(json!({"max_tokens": "4"})),
            Some("max_tokens"),
            "invalid type: string",
        ),
        case(
            "messages missing",
            C,
            json!({"max_tokens": 4}),
            Some("messages"),
            "messages is required",
        ),
        case(
            "messages empty",
            C,
            json!({"messages": []}),
            Some("messages"),
            "at least one message",
        ),
        case(
            "messages not a list",
            C,
            json!({"messages": "hi"}),
            Some("messages"),
            "invalid type: string",
        ),
        case(
            "role missing",
            C,
            json!({"messages": [{"content": "hi"}]}),
            Some("messages[0]"),
            "missing field `role`",
        ),
        case(
            "unknown role",
            C,
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            Some("messages[0].role"),
            "unknown role \"wizard\"",
        ),
        case(
            "content of the wrong type",
            C,
            json!({"messages": [{"role": "user", "content": 42}]}),
            Some("messages[0].content"),
            "content must be a string",
        ),
        case(
            "image content part",
            C,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            Some("messages[0].content[0]"),
            "only text content parts",
        ),
        case(
            "text part without text",
            C,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]}),
            Some("messages[0].content[1]"),
            "a text part needs a \"text\" string",
        ),
        case(
            "negative temperature",
            C,
            chat(json!({"temperature": -0.5})),
            Some("temperature"),
            "temperature = -0.5 is out of range",
        ),
        case(
            "temperature above 2",
            C,
            chat(json!({"temperature": 2.5})),
            Some("temperature"),
            "out of range",
        ),
        case(
            "top_p zero",
            C,
            chat(json!({"top_p": 0})),
            Some("top_p"),
            "0 < top_p <= 1",
        ),
        case(
            "top_p above one",
            C,
            chat(json!({"top_p": 1.5})),
            Some("top_p"),
            "0 < top_p <= 1",
        ),
        case(
            "min_p above one",
            C,
            chat(json!({"min_p": 2})),
            Some("min_p"),
            "0 <= min_p <= 1",
        ),
        case(
            "presence_penalty out of range",
            C,
            chat(json!({"presence_penalty": 3})),
            Some("presence_penalty"),
            "out of range",
        ),
        case(
            "n = 17",
            C,
            chat(json!({"n": 17})),
            Some("n"),
            "n = 17 is out of range",
        ),
        case(
            "n = 0",
            C,
            chat(json!({"n": 0})),
            Some("n"),
            "n = 0 is out of range",
        ),
        case(
            "stop of the wrong type",
            C,
            chat(json!({"stop": 5})),
            Some("stop"),
            "stop must be a string or an array of strings",
        ),
        case(
            "stop list with a number",
            C,
            chat(json!({"stop": ["a", 1]})),
            Some("stop"),
            "stop must be a string or an array of strings",
        ),
        case(
            "five stop strings",
            C,
            chat(json!({"stop": ["a", "b", "c", "d", "e"]})),
            Some("stop"),
            "at most 4 stop sequences",
        ),
        case(
            "max_tokens zero",
            C,
            chat(json!({"max_tokens": 0})),
            Some("max_tokens"),
            "must be at least 1",
        ),
        case(
            "max_tokens over the context",
            C,
            chat(json!({"max_tokens": 100000})),
            Some("max_tokens"),
            "this model's context is 64 tokens",
        ),
        case(
            "max_completion_tokens over the context",
            C,
            chat(json!({"max_completion_tokens": 64})),
            Some("max_completion_tokens"),
            "asks for 64 more",
        ),
        case(
            "chat logprobs as a number",
            C,
            chat(json!({"logprobs": 3})),
            Some("logprobs"),
            "logprobs must be true or false",
        ),
        case(
            "top_logprobs over 20",
            C,
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            Some("top_logprobs"),
            "want 0 to 20",
        ),
        case(
            "top_logprobs without logprobs",
            C,
            chat(json!({"top_logprobs": 2})),
            Some("top_logprobs"),
            "needs logprobs: true",
        ),
        case(
            "completion logprobs over 5",
            T,
            json!({"prompt": "hi", "logprobs": 6}),
            Some("logprobs"),
            "want an integer from 0 to 5",
        ),
        case(
            "a stop sequence of 5000 bytes",
            C,
            chat(json!({"stop": ["x".repeat(5000)]})),
            Some("stop"),
            "at most 4096 bytes, got 5000",
        ),
        case(
            "top_k below -1",
            C,
            chat(json!({"top_k": -2})),
            Some("top_k"),
            "want -1 or 0 (off) or a count >= 1",
        ),
        case(
            "logit_bias as a list",
            C,
            chat(json!({"logit_bias": [[0, 1]]})),
            Some("logit_bias"),
            "must be an object mapping token ids",
        ),
        case(
            "a logit_bias key that is not an id",
            T,
            json!({"prompt": "hi", "logit_bias": {"hello": 1}}),
            Some("logit_bias"),
            "key \"hello\" is not a token id",
        ),
        case(
            "a logit_bias id outside the vocabulary",
            C,
            chat(json!({"logit_bias": {"999999": -100}})),
            Some("logit_bias"),
            "key \"999999\" is not a token id of the vocabulary",
        ),
        case(
            "a logit_bias over 100",
            C,
            chat(json!({"logit_bias": {"15": 101}})),
            Some("logit_bias"),
            "token 15 is 101: want a number in [-100, 100]",
        ),
        case(
            "a tool without a function name",
            C,
            chat(json!({"tools": [{"type": "function", "function": {}}]})),
            Some("tools[0]"),
            "tools[0] must be",
        ),
        case(
            "two logit_bias keys naming one token",
            C,
            chat(json!({"logit_bias": {"1": 5, "01": -5}})),
            Some("logit_bias"),
            "logit_bias names token 1 twice",
        ),
        case(
            "a logit_bias that is not a number",
            C,
            chat(json!({"logit_bias": {"15": "up"}})),
            Some("logit_bias"),
            "want a number in [-100, 100]",
        ),
        // Accepted and ignored, these gave output the client asked not to get (200 OK).
        case(
            "an unknown response_format",
            C,
            chat(json!({"response_format": {"type": "yaml"}})),
            Some("response_format"),
            "must be \"text\", \"json_object\" or \"json_schema\"",
        ),
        case(
            "a tool call forced without tools",
            C,
            chat(json!({"tool_choice": "required"})),
            Some("tool_choice"),
            "tool_choice \"required\" needs tools",
        ),
        case(
            "continue_final_message",
            C,
            chat(json!({"continue_final_message": true})),
            Some("continue_final_message"),
            "not supported",
        ),
        case(
            "tools not a list",
            C,
            chat(json!({"tools": {"a": 1}})),
            Some("tools"),
            "tools must be an array",
        ),
        case(
            "prompt missing",
            T,
            json!({"max_tokens": 2}),
            Some("prompt"),
            "prompt is required",
        ),
        case(
            "empty prompt",
            T,
            json!({"prompt": ""}),
            Some("prompt"),
            "the prompt is empty",
        ),
        case(
            "prompt of the wrong type",
            T,
            json!({"prompt": {"text": "x"}}),
            Some("prompt"),
            "prompt must be a string",
        ),
        case(
            "batched prompts",
            T,
            json!({"prompt": ["a", "b"]}),
            Some("prompt"),
            "batched prompts (2 strings) are not supported",
        ),
        case(
            "token id outside the vocabulary",
            T,
            json!({"prompt": [1, 999999999]}),
            Some("prompt"),
            "outside the vocabulary",
        ),
        case(
            "prompt over the context",
            T,
            json!({"prompt": long_ids}),
            Some("prompt"),
            "the prompt has 64 tokens but the context holds 64",
        ),
        case(
            "echo on chat",
            C,
            json!({"messages": [{"role": "user", "content": "a"}], "echo": true}),
            Some("echo"),
            "echo is supported on /v1/completions only",
        ),
        Case {
            method: "GET",
            status: 405,
            ..case(
                "wrong method",
                C,
                json!(null),
                None,
                "method GET is not allowed on /v1/chat/completions",
            )
        },
        // More bytes than 64 tokens can cover: refused before tokenizing.
        case(
            "prompt of too many bytes",
            T,
            json!({"prompt": "x".repeat(CTX * 512 + 1), "max_tokens": 4}),
            Some("prompt"),
            "bytes cannot fit the context of 64 tokens",
        ),
        Case {
            status: 404,
            ..case(
                "unknown route",
                "/v1/embeddings",
                json!({"input": "x"}),
                None,
                "no route POST /v1/embeddings",
            )
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let table = table();
    assert!(table.len() >= 15);
    let http = client(30);
    for c in &table {
        let rq = match c.method {
            "GET" => http.get(format!("{}{}", srv.base, c.path)),
            _ => http
                .post(format!("{}{}", srv.base, c.path))
                .header("content-type", "application/json")
                .body(c.body.clone()),
        };
        let r = rq.send().await.unwrap();
        let status = r.status().as_u16();
        let ctype = r
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned());
        let text = r.text().await.unwrap();
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {text}", c.name));
        assert_eq!(status, c.status, "{}: {text}", c.name);
        assert_eq!(ctype.as_deref(), Some("application/json"), "{}", c.name);
        let e = &v["error"];
        assert_eq!(e["type"], c.kind, "{}: {text}", c.name);
        assert_eq!(e["param"].as_str(), c.param, "{}: {text}", c.name);
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains(c.msg),
            "{}: message {msg:?} lacks {:?}",
            c.name,
            c.msg
        );
        assert!(e.as_object().unwrap().contains_key("code"), "{}", c.name);
    }
    // Over-context errors carry OpenAI's code.
    let (_, v) = post(&srv.base, C, &chat(json!({"max_tokens": 100000}))).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let long = json!({"prompt": "x".repeat(CTX * 512 + 1), "max_tokens": 4});
    let (_, v) = post(&srv.base, T, &long).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // Still serving; the defaults of the refused fields are accepted.
    let defaults = json!({"temperature": 0, "logit_bias": {}, "response_format": {"type": "text"}, "tool_choice": "auto"});
    let (st, v) = post(&srv.base, C, &chat(defaults)).await;
    assert_eq!(st, 200, "{v}");
    // Whole numbers written as floats are integers, as pydantic servers (vLLM) take them.
    let floats = json!({"max_tokens": 2.0, "seed": 7.0, "top_k": 4e1, "n": 1.0, "temperature": 1});
    let (st, v) = post(&srv.base, C, &chat(floats)).await;
    assert_eq!(st, 200, "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 2,
        "{v}"
    );
    // A compressed body: 415 naming the encoding (it was "must be a JSON object").
    let r = client(30)
        .post(format!("{}{C}", srv.base))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(vec![0x1f, 0x8b, 8, 0])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("Content-Encoding \"gzip\" is not supported"),
        "{msg}"
    );
    // A body over the limit: 413, still JSON.
    let big = format!(
        r#"{{"prompt": "{}"}}"#,
        "a".repeat(nibble_server::BODY_LIMIT + 10)
    );
    let (st, v) = post_raw(&srv.base, T, &big).await;
    assert_eq!(st, 413, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // Every one of them was counted by status.
    let (_, m) = get(&srv.base, "/metrics", None).await;
    // The table's, plus the two over-context requests after it.
    let n400 = table.iter().filter(|c| c.status == 400).count() + 2;
    assert!(
        m.contains(&format!("nibble_requests_total{{status=\"400\"}} {n400}")),
        "{m}"
    );
    assert!(m.contains("nibble_requests_total{status=\"413\"} 1"), "{m}");
}
