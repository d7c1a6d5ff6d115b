//! Scoring prompts over the live server (the reference backend on the tiny synthetic model):
//! completions' `echo` with `logprobs` (what lm-eval-harness's loglikelihood requests send),
//! `max_tokens: 0`, vLLM's `prompt_logprobs` on both routes, streams, and their bad requests.
//! Every prompt logprob is checked against the oracle stepped token by token.

mod common;

use common::*;
use serde_json::{json, Value};

const CTX: usize = 512;
const PROMPT: &str = "The capital of France is Paris, and the capital of Spain is";

/// `log p(ids[i] | ids[..i])` for i >= 1 from the oracle stepped token by token (f64 sums).
fn oracle_logprobs(ids: &[u32]) -> Vec<f64> {
    let mut b = backend(CTX);
    let mut out = Vec::new();
    for w in ids.windows(2) {
        let row = nibble_backend::Backend::step(&mut b, w[0]).unwrap();
        let max = row.iter().fold(f64::MIN, |a, &x| a.max(x as f64));
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        out.push(row[w[1] as usize] as f64 - lse);
    }
    out
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt_as_the_oracle_does() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tok = tokenizer();
    let ids = tok.encode(PROMPT).unwrap();
    let want = oracle_logprobs(&ids);
    // lm-eval-harness's loglikelihood form, and OpenAI's max_tokens 0.
    for max in [0, 3] {
        let body = json!({"prompt": PROMPT, "max_tokens": max, "temperature": 0, "echo": true,
            "logprobs": 2});
        let (st, v) = post(&srv.base, "/v1/completions", &body).await;
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        let text = c["text"].as_str().unwrap();
        assert!(text.starts_with(PROMPT), "{text}");
        assert_eq!(v["usage"]["prompt_tokens"], ids.len());
        assert_eq!(v["usage"]["completion_tokens"], max);
        let lp = &c["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), ids.len() + max);
        for (i, &id) in ids.iter().enumerate() {
            let t = String::from_utf8_lossy(&tok.token_bytes(id)).into_owned();
            assert_eq!(tokens[i], t.as_str(), "token {i}");
        }
        assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
        let got = floats(&Value::Array(
            lp["token_logprobs"].as_array().unwrap()[1..ids.len()].to_vec(),
        ));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 1e-4, "prompt token {}: {g} vs {w}", i + 1);
        }
        for i in 1..tokens.len() {
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert!(top.len() <= 3, "{top:?}");
            assert_eq!(top[tokens[i].as_str().unwrap()], lp["token_logprobs"][i]);
        }
        // Offsets: characters into the returned text, the generated tokens' after the prompt.
        let offsets = floats(&lp["text_offset"]);
        assert_eq!(offsets[0], 0.0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
        if max > 0 {
            assert_eq!(offsets[ids.len()], PROMPT.chars().count() as f64);
            // The generated part is what the request without echo generates.
            let plain = json!({"prompt": PROMPT, "max_tokens": max, "temperature": 0});
            let (_, p) = post(&srv.base, "/v1/completions", &plain).await;
            assert_eq!(
                &text[PROMPT.len()..],
                p["choices"][0]["text"].as_str().unwrap()
            );
        }
    }
    // Echo alone: the text, no logprobs; a prompt of ids echoes their decoded text.
    let body = json!({"prompt": ids, "max_tokens": 0, "echo": true});
    let (st, v) = post(&srv.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], tok.decode(&ids));
    assert!(v["choices"][0]["logprobs"].is_null());
    // Streamed: the prompt is the first text chunk, the entries come before the final chunk.
    let body = json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": true,
        "logprobs": 1, "stream": true});
    let (st, _, sse) = post_stream(&srv.base, "/v1/completions", &body).await;
    assert_eq!(st, 200);
    assert_eq!(sse.chunks[0]["choices"][0]["text"], PROMPT);
    assert!(sse.text().starts_with(PROMPT));
    let lp: Vec<&Value> = (sse.chunks.iter())
        .map(|c| &c["choices"][0]["logprobs"])
        .filter(|l| !l.is_null())
        .collect();
    assert_eq!(lp.len(), 1);
    assert_eq!(lp[0]["tokens"].as_array().unwrap().len(), ids.len() + 2);
    assert!(lp[0]["token_logprobs"][0].is_null());
}

/// lm-eval-harness's loglikelihood request as its `local-completions` model sends it: the
/// context and continuation as one batch of one token list, one token generated, echo and
/// logprobs 1; the continuation's loglikelihood (its entries, the generated one left out) and
/// greediness read from the answer equal the oracle's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_lm_eval_harness_loglikelihood_request() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let tok = tokenizer();
    let ctx = tok
        .encode("Question: what is the capital of France? Answer:")
        .unwrap();
    let cont = tok.encode(" Paris").unwrap();
    let all = [ctx.clone(), cont.clone()].concat();
    let body = json!({"prompt": [all], "max_tokens": 1, "temperature": 0, "logprobs": 1,
        "echo": true, "seed": 1234});
    let (st, v) = post(&srv.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let n = lp["token_logprobs"].as_array().unwrap().len();
    assert_eq!(n, all.len() + 1);
    let got: f64 = floats(&Value::Array(
        lp["token_logprobs"].as_array().unwrap()[ctx.len()..n - 1].to_vec(),
    ))
    .iter()
    .sum();
    let want: f64 = oracle_logprobs(&all)[ctx.len() - 1..].iter().sum();
    assert!((got - want).abs() < 1e-3, "{got} vs {want}");
    // Greedy: each continuation token is its row's favourite (the top alternative's value).
    let mut b = backend(CTX);
    let mut greedy = true;
    for (i, &t) in all.iter().enumerate().take(all.len() - 1) {
        let row = nibble_backend::Backend::step(&mut b, t).unwrap();
        if i + 1 >= ctx.len() {
            greedy &= nibble_backend::argmax(&row) == all[i + 1];
        }
    }
    let read = (ctx.len()..n - 1).all(|i| {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        (lp["token_logprobs"][i].as_f64().unwrap() - best).abs() < 1e-9
    });
    assert_eq!(read, greedy);
    // A batch of two token lists is refused by name.
    let two = json!({"prompt": [ctx, cont], "max_tokens": 1, "echo": true});
    let (st, v) = post(&srv.base, "/v1/completions", &two).await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 token lists"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_have_vllms_shape_on_both_routes() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let ids = tokenizer().encode(PROMPT).unwrap();
    let want = oracle_logprobs(&ids);
    let body = json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2});
    // Twice: the second request's prompt is cached, yet it is scored whole again.
    for round in 0..2 {
        let (st, v) = post(&srv.base, "/v1/completions", &body).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let p = v["choices"][0]["prompt_logprobs"].as_array().unwrap();
        assert_eq!(p.len(), ids.len(), "round {round}");
        assert!(p[0].is_null());
        for (i, e) in p[1..].iter().enumerate() {
            let m = e.as_object().unwrap();
            let own = &m[&ids[i + 1].to_string()];
            let x = own["logprob"].as_f64().unwrap();
            assert!(
                (x - want[i]).abs() < 1e-4,
                "token {}: {x} vs {}",
                i + 1,
                want[i]
            );
            assert!(own["rank"].as_u64().unwrap() >= 1);
            assert!(own["decoded_token"].is_string());
            // The token and its two most likely alternatives (ranks 1 and 2).
            assert!(m.len() == 2 || m.len() == 3, "{e}");
            let mut ranks: Vec<u64> = m.values().map(|x| x["rank"].as_u64().unwrap()).collect();
            ranks.sort();
            assert!(ranks.starts_with(&[1, 2]) || ranks == [1, 2], "{e}");
        }
    }
    // A prompt alone may fill the context (nothing is generated); one more token may not.
    let small = start(cfg(), 64).await;
    let full: Vec<u32> = (0..64).map(|i| (i * 7 + 3) % 5000).collect();
    let over = [full.clone(), vec![5]].concat();
    let body = json!({"prompt": full, "max_tokens": 0, "prompt_logprobs": 0, "echo": true,
        "logprobs": 0});
    let (st, v) = post(&small.base, "/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["prompt_logprobs"].as_array().unwrap().len(),
        64
    );
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        64
    );
    for b in [
        json!({"prompt": full, "max_tokens": 1, "prompt_logprobs": 0}),
        json!({"prompt": over, "max_tokens": 0, "echo": true}),
    ] {
        let (st, v) = post(&small.base, "/v1/completions", &b).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
    // Chat: at the response's top level, one entry per prompt token.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "temperature": 0, "prompt_logprobs": true});
    let (st, v) = post(&srv.base, "/v1/chat/completions", &chat).await;
    assert_eq!(st, 200, "{v}");
    let p = v["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        p.len() as u64,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(p[1..].iter().all(|e| {
        let n = e.as_object().unwrap().len();
        n == 1 || n == 2
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoring_requests_refuse_bad_fields() {
    let Some(_) = model_path() else { return };
    let srv = start(cfg(), CTX).await;
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}],
            "echo": true}),
            "echo",
            "/v1/completions only",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "prompt_logprobs": 21}),
            "prompt_logprobs",
            "from 0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "prompt_logprobs": -1}),
            "prompt_logprobs",
            "from 0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "prompt_logprobs": "2"}),
            "prompt_logprobs",
            "from 0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
            "stream",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 0}),
            "max_tokens",
            "0 with echo or prompt_logprobs",
        ),
    ];
    for (path, body, param, msg) in cases {
        let (st, v) = post(&srv.base, path, &body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(msg), "{body}: {m}");
    }
}
