//! Structured outputs over the live server (the reference backend on the tiny synthetic model,
//! whose free text is noise): a JSON schema, JSON mode, vLLM's guided forms and forced tool
//! calls shape the answer, whole and streamed, greedy and sampled.

mod common;

use common::*;
use nibble_server::ServerConfig;
use serde_json::{json, Value};

const CTX: usize = 1024;

/// A schema whose every answer is short, so the noise model finishes it well within the limit.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"}
        },
        "required": ["color", "n", "ok"],
        "additionalProperties": false
    })
}

fn fits(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["color", "n", "ok"], "{text}");
    assert!(["red", "green", "blue"].contains(&v["color"].as_str().unwrap()));
    assert!(v["n"].as_u64().unwrap() <= 99);
    assert!(v["ok"].is_boolean());
}

/// A chat request with thinking off: the noise model, free to reason first, would never close
/// its `<think>` block.
fn chat(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "Describe a ball."}],
        "max_tokens": 200, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_schema_shapes_the_answer() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    // Unconstrained, the model's answer is no JSON.
    let (st, free) = post(
        &srv.base,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 24})),
    )
    .await;
    assert_eq!(st, 200, "{free}");
    let free = free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(serde_json::from_str::<Value>(&free).is_err(), "{free:?}");
    let rf = json!({"type": "json_schema", "json_schema": {"name": "ball", "schema": schema(), "strict": true}});
    for extra in [
        json!({"response_format": rf}),
        json!({"response_format": rf, "temperature": 1.0, "seed": 7}),
        json!({"guided_json": schema()}),
        json!({"guided_json": schema().to_string()}),
        json!({"json_schema": schema()}),
    ] {
        let (st, v) = post(&srv.base, "/v1/chat/completions", &chat(extra.clone())).await;
        assert_eq!(st, 200, "{extra}: {v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{extra}: {v}");
        fits(c["message"]["content"].as_str().unwrap());
    }
    // Streamed: the chunks join to the same answer.
    let body = chat(json!({"response_format": rf}));
    let (_, whole) = post(&srv.base, "/v1/chat/completions", &body).await;
    let mut s = body.clone();
    s["stream"] = json!(true);
    let (st, _, sse) = post_stream(&srv.base, "/v1/chat/completions", &s).await;
    assert_eq!(st, 200);
    assert_eq!(
        sse.text(),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // Thinking on, the answer may reason first (the noise model does, endlessly); with the
    // server's reasoning parsing off, the schema binds from the first token.
    let mut think = chat(json!({"response_format": rf, "max_tokens": 30}));
    think["chat_template_kwargs"] = json!({});
    let (_, v) = post(&srv.base, "/v1/chat/completions", &think).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(
        v["choices"][0]["message"]["reasoning_content"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{v}"
    );
    let raw = start(
        ServerConfig {
            reasoning: false,
            ..cfg()
        },
        CTX,
    )
    .await;
    think["max_tokens"] = json!(200);
    let (_, v) = post(&raw.base, "/v1/chat/completions", &think).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    fits(v["choices"][0]["message"]["content"].as_str().unwrap());
    // JSON mode: any object.
    let (_, v) = post(
        &srv.base,
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 400})),
    )
    .await;
    let c = &v["choices"][0];
    if c["finish_reason"] == "stop" {
        let o: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        assert!(o.is_object(), "{o}");
    } else {
        assert!(
            c["message"]["content"].as_str().unwrap().starts_with('{'),
            "{v}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guided_regex_choice_and_grammar_on_completions() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let text = |extra: Value| {
        let mut b = json!({"prompt": "The answer is", "max_tokens": 40, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (st, v) = post(
        &srv.base,
        "/v1/completions",
        &text(json!({"guided_regex": "[0-9]{3}-[a-c]{2}"})),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t.len() == 6 && t.as_bytes()[3] == b'-', "{t:?}");
    assert!(
        t[..3].bytes().all(|b| b.is_ascii_digit()) && t[4..].bytes().all(|b| b"abc".contains(&b)),
        "{t:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let choices = ["yes (certainly)", "no", "maybe?"];
    for seed in 0..4 {
        let (_, v) = post(
            &srv.base,
            "/v1/completions",
            &text(json!({"guided_choice": choices, "temperature": 1.0, "seed": seed})),
        )
        .await;
        let t = v["choices"][0]["text"].as_str().unwrap();
        assert!(choices.contains(&t), "{t:?}");
    }
    // Text that spells a special token is text: it neither ends the answer nor fails it
    // (`<|im_end|>` was encoded as the end token and ended the answer early).
    let specials = ["a<|im_start|>b", "<|im_end|>x"];
    for seed in 0..2 {
        let (st, v) = post(
            &srv.base,
            "/v1/completions",
            &text(json!({"guided_choice": specials, "temperature": 1.0, "seed": seed})),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let t = v["choices"][0]["text"].as_str().unwrap();
        assert!(specials.contains(&t), "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    }
    let lark = "start: \"x=\" NUM \";\"\nNUM: /[1-9][0-9]?/\n";
    let (_, v) = post(
        &srv.base,
        "/v1/completions",
        &text(json!({"guided_grammar": lark})),
    )
    .await;
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        t.starts_with("x=") && t.ends_with(';') && t.len() <= 5,
        "{t:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_calls_come_back_as_tool_calls() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
            "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time"}}
    ]);
    // The tool's parameters here leave the noise model little to write.
    let named = chat(json!({"tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}));
    let (st, v) = post(&srv.base, "/v1/chat/completions", &named).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["unit"] == "c" || args["unit"] == "f", "{args}");
    // Streamed, the same call.
    let mut s = named.clone();
    s["stream"] = json!(true);
    let (_, _, sse) = post_stream(&srv.base, "/v1/chat/completions", &s).await;
    let name: String = sse
        .chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"].as_str())
        .collect();
    assert_eq!(name, "get_weather");
    // "required": the calls are among the tools (get_time takes any object, so the noise model
    // may write a long one: only what was finished is checked).
    let req = chat(json!({"tools": tools, "tool_choice": "required", "max_tokens": 300}));
    let (st, v) = post(&srv.base, "/v1/chat/completions", &req).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    if c["finish_reason"] == "tool_calls" {
        for call in c["message"]["tool_calls"].as_array().unwrap() {
            let n = call["function"]["name"].as_str().unwrap();
            assert!(n == "get_weather" || n == "get_time", "{v}");
        }
    } else {
        assert_eq!(c["finish_reason"], "length", "{v}");
    }
}

/// A chat template that shows tool calls in Qwen3-Coder's form (`<function=…>` with
/// `<parameter=…>` blocks), as that model's own does; its answers open with an empty think
/// block (as Qwen3's with thinking off), so the noise model does not reason first.
const CODER_TEMPLATE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{%- if tools %}<|im_start|>system\nCall a tool as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}";

/// Under a template that writes Qwen3-Coder's calls, a forced call is constrained to that form
/// (a Hermes JSON call would be off the model's format) and comes back as a typed tool call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_calls_take_the_coder_form_under_its_template() {
    let Some(_) = model_path() else { return };
    let srv = start_with_template(cfg(), CTX, CODER_TEMPLATE).await;
    let tools = json!([
        {"type": "function", "function": {"name": "roll", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 6},
            "die": {"enum": ["d6", "d20"]}}, "required": ["n", "die"]}}}
    ]);
    // logprobs: the answer's tokens show its raw text.
    let named = json!({"messages": [{"role": "user", "content": "Roll."}], "max_tokens": 60,
        "temperature": 0, "tools": tools, "logprobs": true,
        "tool_choice": {"type": "function", "function": {"name": "roll"}}});
    let (st, v) = post(&srv.base, "/v1/chat/completions", &named).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "roll");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    // Typed by the schema: an integer in range and one of the listed strings.
    let n = args["n"].as_u64().unwrap_or_else(|| panic!("{args}"));
    assert!((1..=6).contains(&n), "{args}");
    assert!(args["die"] == "d6" || args["die"] == "d20", "{args}");
    // Nothing but the call, in the Coder form.
    assert!(
        c["message"]["content"].is_null() || c["message"]["content"] == "",
        "{v}"
    );
    let raw: String = c["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert!(
        raw.starts_with("<tool_call>\n<function=roll>\n<parameter=n>\n"),
        "{raw:?}"
    );
    let raw = raw.trim_end_matches("<|im_end|>");
    assert!(raw.ends_with("</function>\n</tool_call>"), "{raw:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_structured_requests_are_400s() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let cases = [
        (
            chat(json!({"response_format": {"type": "xml"}})),
            "response_format",
            "\"text\", \"json_object\" or \"json_schema\"",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema"}})),
            "response_format",
            "\"json_schema\" object",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            "response_format",
            "needs its \"schema\"",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}),
            ),
            "response_format",
            "invalid grammar",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}),
            ),
            "response_format",
            "must be a JSON schema",
        ),
        (
            chat(json!({"guided_json": "{not json"})),
            "guided_json",
            "not a JSON schema",
        ),
        (
            chat(json!({"guided_regex": "("})),
            "guided_regex",
            "invalid grammar",
        ),
        (
            chat(json!({"guided_regex": 5})),
            "guided_regex",
            "must be a string",
        ),
        (
            chat(json!({"guided_choice": []})),
            "guided_choice",
            "non-empty list",
        ),
        (
            chat(json!({"guided_choice": ["a", 1]})),
            "guided_choice",
            "non-empty list",
        ),
        (
            chat(json!({"guided_grammar": "root: \"a\""})),
            "guided_grammar",
            "start",
        ),
        (
            chat(json!({"grammar": "root ::= \"a\""})),
            "grammar",
            "GBNF",
        ),
        (
            chat(json!({"guided_grammar": "root ::= \"a\""})),
            "guided_grammar",
            "looks like GBNF",
        ),
        (
            chat(json!({"tools": {"a": 1}, "tool_choice": "required"})),
            "tools",
            "must be an array",
        ),
        // A lexer dead end (llguidance looped forever) and an empty language: 400s in time.
        (
            chat(json!({"guided_grammar": "start: A B\nA: /a+/\nB: /a/"})),
            "guided_grammar",
            "did not end within",
        ),
        (
            chat(json!({"guided_regex": "[^\\s\\S]"})),
            "guided_regex",
            "admits no answer",
        ),
        (
            chat(json!({"guided_regex": "a", "response_format": {"type": "json_object"}})),
            "guided_regex",
            "both constrain",
        ),
        (
            chat(json!({"tool_choice": "required"})),
            "tool_choice",
            "needs tools",
        ),
        (
            chat(
                json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
            "tool_choice",
            "not among the tools",
        ),
        (
            chat(json!({"tools": tools, "tool_choice": {"type": "function"}})),
            "tool_choice",
            "a named tool_choice is",
        ),
        (
            chat(json!({"tools": tools, "tool_choice": "always"})),
            "tool_choice",
            "is not one of",
        ),
        (
            json!({"prompt": "x", "tool_choice": "required", "tools": tools}),
            "tool_choice",
            "chat completions only",
        ),
    ];
    for (body, param, msg) in cases {
        let path = if body.get("prompt").is_some() {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let (st, v) = post(&srv.base, path, &body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(msg), "{body}: {m:?} lacks {msg:?}");
    }
    // A grammar that fails mid-answer: a short 500, and streamed, an in-band error that still
    // ends with [DONE].
    let late = json!({"prompt": "x", "max_tokens": 5, "temperature": 0,
        "guided_grammar": "start: \"a\" b\nb: b \"c\"\n"});
    let (st, v) = post(&srv.base, "/v1/completions", &late).await;
    assert_eq!(st, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("admits no answer"),
        "{v}"
    );
    let mut s = late.clone();
    s["stream"] = json!(true);
    let (st, _, sse) = post_stream(&srv.base, "/v1/completions", &s).await;
    assert_eq!(st, 200);
    let last = sse.chunks.last().unwrap();
    let msg = last["error"]["message"].as_str().unwrap();
    assert!(msg.contains("admits no answer"), "{}", sse.raw);
    assert!(sse.done, "{}", sse.raw);
    // The server still answers.
    let (st, _) = post(
        &srv.base,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 2})),
    )
    .await;
    assert_eq!(st, 200);
}
