//! Shared test fixtures: a tiny synthetic GGUF (Q4_0 weights, seeded) embedding the real Qwen3
//! tokenizer and chat template, a live server on a loopback port with the reference backend, and
//! small HTTP helpers with bounded timeouts.
//!
//! The tokenizer comes from scripts/fetch-tokenizer.sh (vendor/qwen3-tokenizer); without it the
//! tests skip loudly, unless `CI` is set, where its absence fails them.
#![allow(dead_code)]

use nibble_backend::RefBackend;
use nibble_engine::{ChatTemplate, Message, Tokenizer};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::loader::{self, LoadedModel};
use nibble_model::synth::{self, SynthParams};
use nibble_server::ServerConfig;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

pub fn tokenizer_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("NIBBLE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vendor/qwen3-tokenizer")
        });
    if dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI: tokenizer missing at {}",
        dir.display()
    );
    eprintln!(
        "SKIP: no tokenizer at {} (run scripts/fetch-tokenizer.sh)",
        dir.display()
    );
    None
}

/// The tiny GGUF, written once per test binary.
pub fn model_path() -> Option<&'static Path> {
    static MODEL: OnceLock<Option<(tempfile::TempDir, PathBuf)>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let dir = tokenizer_dir()?;
            let cfg = Qwen3MoeConfig::tiny();
            let tok = Tokenizer::from_hf_dir(&dir).unwrap();
            let d = tok.to_gguf_metadata(cfg.vocab_size).unwrap();
            let meta = synth::GgufTokenizerMeta {
                model: d.model,
                pre: d.pre,
                tokens: d.tokens,
                token_types: d.token_types,
                merges: d.merges,
                bos: d.bos_token_id,
                eos: d.eos_token_id,
                pad: d.padding_token_id,
                chat_template: d.chat_template,
            };
            let tmp = tempfile::tempdir().unwrap();
            let path = tmp.path().join("tiny.gguf");
            let params = SynthParams {
                seed: 1,
                ..SynthParams::default()
            };
            synth::write_gguf(&cfg, &params, Some(&meta), &path, true).unwrap();
            Some((tmp, path))
        })
        .as_ref()
        .map(|(_, p)| p.as_path())
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_hf_dir(tokenizer_dir().unwrap()).unwrap()
}

fn open() -> LoadedModel {
    loader::open(model_path().unwrap()).unwrap()
}

/// The chat prompt ids the server should build for `msgs` (thinking as given).
pub fn chat_ids(msgs: &[Message], thinking: Option<bool>) -> Vec<u32> {
    let m = open();
    let t = ChatTemplate::new(m.chat_template.as_deref().unwrap()).unwrap();
    tokenizer()
        .encode(&t.render(msgs, true, thinking, None).unwrap())
        .unwrap()
}

/// A fresh reference backend over the tiny model with a `ctx`-token cache.
pub fn backend(ctx: usize) -> RefBackend {
    RefBackend::new(open().weights.clone(), ctx).unwrap()
}

/// A running server; `base` is `http://127.0.0.1:PORT`.
pub struct TestServer {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Starts a server on 127.0.0.1:0 (call inside a multi-thread tokio runtime).
pub async fn start(cfg: ServerConfig, ctx: usize) -> TestServer {
    start_with(cfg, ctx, nibble_server::HEADER_TIMEOUT).await
}

/// [`start`] with a header-read timeout of `header_timeout`.
pub async fn start_with(cfg: ServerConfig, ctx: usize, header_timeout: Duration) -> TestServer {
    let m = open();
    serve(cfg, ctx, header_timeout, m.chat_template.as_deref()).await
}

/// [`start`] with `template` as the model's chat template.
#[allow(dead_code)]
pub async fn start_with_template(cfg: ServerConfig, ctx: usize, template: &str) -> TestServer {
    serve(cfg, ctx, nibble_server::HEADER_TIMEOUT, Some(template)).await
}

/// [`start`] on the CPU backend's stream slots (`cfg.max_streams` of them): requests take the
/// multi-stream path (`StreamSeq`) instead of running alone.
#[allow(dead_code)]
pub async fn start_streams(cfg: ServerConfig, ctx: usize) -> TestServer {
    let m = open();
    let cpu = nibble_cpu::CpuBackend::with_streams(m.weights.clone(), ctx, cfg.max_streams);
    let template = m.chat_template.as_deref();
    serve_on(
        Box::new(cpu.unwrap()),
        cfg,
        nibble_server::HEADER_TIMEOUT,
        template,
    )
    .await
}

async fn serve(
    cfg: ServerConfig,
    ctx: usize,
    header_timeout: Duration,
    template: Option<&str>,
) -> TestServer {
    let backend = RefBackend::new(open().weights.clone(), ctx).unwrap();
    serve_on(Box::new(backend), cfg, header_timeout, template).await
}

async fn serve_on(
    backend: Box<dyn nibble_backend::Backend>,
    cfg: ServerConfig,
    header_timeout: Duration,
    template: Option<&str>,
) -> TestServer {
    let router = nibble_server::app(backend, tokenizer(), template, cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let stop = async {
        let _ = rx.await;
    };
    tokio::spawn(nibble_server::serve_with(
        listener,
        router,
        stop,
        header_timeout,
    ));
    TestServer {
        base: format!("http://{addr}"),
        stop: Some(tx),
    }
}

pub fn cfg() -> ServerConfig {
    ServerConfig {
        model_id: "tiny".into(),
        ..ServerConfig::default()
    }
}

/// A client that never uses a proxy and gives up after `secs`.
pub fn client(secs: u64) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(secs))
        .build()
        .unwrap()
}

/// POST `body` (already JSON text) to `path`; returns status and parsed JSON.
pub async fn post_raw(base: &str, path: &str, body: &str) -> (u16, Value) {
    let r = client(60)
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    (status, v)
}

pub async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    post_raw(base, path, &body.to_string()).await
}

/// One parsed SSE stream: the JSON chunks in order, and whether `[DONE]` ended it.
pub struct Sse {
    pub chunks: Vec<Value>,
    pub done: bool,
    pub raw: String,
}

impl Sse {
    /// Concatenated text: chat `delta.content` or completion `text`.
    pub fn text(&self) -> String {
        self.chunks
            .iter()
            .filter_map(|c| {
                let ch = c["choices"].get(0)?;
                ch["delta"]["content"]
                    .as_str()
                    .or(ch["text"].as_str())
                    .map(str::to_owned)
            })
            .collect()
    }
}

/// Parses a whole SSE body, checking that every event is exactly `data: PAYLOAD\n\n`.
pub fn parse_sse(raw: &str) -> Sse {
    let mut chunks = vec![];
    let mut done = false;
    assert!(
        raw.ends_with("\n\n"),
        "stream must end with a blank line: {raw:?}"
    );
    for ev in raw.trim_end_matches("\n\n").split("\n\n") {
        let payload = ev
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("bad event {ev:?}"));
        assert!(!payload.contains('\n'), "multi-line event {ev:?}");
        assert!(!done, "event after [DONE]: {ev:?}");
        if payload == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(payload).unwrap());
        }
    }
    Sse {
        chunks,
        done,
        raw: raw.to_owned(),
    }
}

/// POSTs a streaming request and reads the whole stream.
pub async fn post_stream(base: &str, path: &str, body: &Value) -> (u16, String, Sse) {
    let r = client(60)
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let raw = r.text().await.unwrap();
    (status, ctype, parse_sse(&raw))
}

/// GET `path`; returns status and body text.
pub async fn get(base: &str, path: &str, key: Option<&str>) -> (u16, String) {
    let mut rq = client(30).get(format!("{base}{path}"));
    if let Some(k) = key {
        rq = rq.bearer_auth(k);
    }
    let r = rq.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The value of an unlabelled metric line `name value`.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}
