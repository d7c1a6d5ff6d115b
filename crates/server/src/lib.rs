//! nibble-server: an OpenAI-compatible HTTP server (axum + tokio) over one engine [`Session`].
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (`stream` true: Server-Sent Events
//! in OpenAI's chunk format ending with `data: [DONE]`; false: one JSON answer), `GET /v1/models`,
//! `GET /health`, `GET /metrics` (Prometheus / OpenMetrics text). Errors are OpenAI-style JSON
//! (`{"error": {"message", "type", "param", "code"}}`) for every status the server sends. CORS:
//! any origin, as llama.cpp's and vLLM's servers answer by default.
//!
//! Architecture: the backend decodes one sequence, so one worker thread ([`scheduler`]) owns the
//! session and runs requests in arrival order; handlers validate and tokenize ([`params`]), then
//! submit to a bounded queue (429 beyond it) and relay the worker's text to the client. A
//! follow-up chat turn served right after the turn it extends reuses the cached prefix, reported
//! as `usage.prompt_tokens_details.cached_tokens`. Sampling defaults are OpenAI's (temperature 1,
//! top_p 1): send `temperature: 0` for greedy output. See [`params`] for every default and range.
//!
//! Modules: [`error`] (error body, JSON extractor), [`protocol`] (wire types), [`params`]
//! (validation), [`scheduler`] (the worker), [`handlers`] (routes, auth), [`parse`] (a chat
//! answer's reasoning and tool calls), [`metrics`].

pub mod error;
pub mod handlers;
pub mod metrics;
pub mod params;
pub mod parse;
pub mod protocol;
pub mod scheduler;
pub mod structured;
pub mod tokens;

use anyhow::{Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::http::Method;
use axum::routing::{get, post};
use axum::Router;
use handlers::AppState;
use nibble_backend::Backend;
use nibble_engine::session::Session;
use nibble_engine::{ChatTemplate, Tokenizer};
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use tower_http::cors::{AllowHeaders, Any, CorsLayer};

/// Largest request body accepted (413 beyond): room for prompts far longer than any context.
pub const BODY_LIMIT: usize = 8 << 20;

/// How the server admits and authenticates requests.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests the engine admits at once (today they still decode one after another).
    pub max_streams: usize,
    /// Requests that may wait for admission; beyond them a request gets 429.
    pub queue: usize,
    /// When set, every route but `/health` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// The id `/v1/models` lists and responses carry.
    pub model_id: String,
    /// A chat answer's thinking (`<think>…</think>`) goes to `reasoning_content` rather than
    /// `content`, as llama.cpp's server does by default (`--reasoning-format none`: false).
    pub reasoning: bool,
    /// How long a request body may take to arrive (408 beyond it).
    pub body_timeout: std::time::Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_streams: 4,
            queue: 64,
            api_key: None,
            model_id: "nibble".into(),
            reasoning: true,
            body_timeout: error::BodyTimeout::DEFAULT,
        }
    }
}

/// Builds the router and starts the engine worker, which owns `backend` from now on. The worker
/// stops when the router (and every clone of it) is dropped.
pub fn app(
    backend: Box<dyn Backend>,
    tokenizer: Tokenizer,
    chat_template: Option<&str>,
    cfg: ServerConfig,
) -> Result<Router> {
    anyhow::ensure!(cfg.max_streams >= 1, "--max-streams must be at least 1");
    anyhow::ensure!(cfg.queue >= 1, "--queue must be at least 1");
    let template = chat_template
        .map(ChatTemplate::new)
        .transpose()
        .context("the model's chat template does not compile")?;
    let model = Arc::new(params::ModelInfo {
        tokenizer: tokenizer.clone(),
        template,
        context_len: backend.context_len(),
        vocab_size: backend.config().vocab_size,
        eos_ids: backend.config().eos_token_ids.clone(),
        reasoning: cfg.reasoning,
        grammars: Default::default(),
        tool_xml: chat_template.is_some_and(params::tool_calls_are_xml),
    });
    let metrics = metrics::Metrics::new();
    let (queue, _worker) = scheduler::spawn(
        Session::new(backend),
        tokenizer,
        cfg.max_streams,
        cfg.queue,
        metrics.clone(),
    )
    .context("cannot start the engine thread")?;
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let state = Arc::new(AppState {
        model,
        queue,
        metrics,
        model_id: cfg.model_id,
        api_key: cfg.api_key.filter(|k| !k.is_empty()),
        started,
        reasoning: cfg.reasoning,
        next_id: AtomicU64::new(0),
    });
    let s = state.clone();
    Ok(Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        // llama.cpp's server answers without the /v1 prefix too; clients configured with a
        // bare base URL rely on it.
        .route("/chat/completions", post(handlers::chat))
        .route("/completions", post(handlers::completions))
        .route("/models", get(handlers::models))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::Extension(error::BodyTimeout(cfg.body_timeout)))
        .layer(axum::middleware::from_fn_with_state(
            s.clone(),
            handlers::auth,
        ))
        .layer(axum::middleware::from_fn_with_state(s, handlers::count))
        // Outermost, so a browser's preflight (an OPTIONS without the API key) is answered
        // before the auth check: any origin may call, as llama.cpp's and vLLM's servers allow
        // by default (web front ends on another port rely on it); no cookies are involved.
        .layer(
            CorsLayer::new()
                .allow_origin(Any)
                .allow_methods([Method::GET, Method::POST])
                // Mirrored rather than `*`: browsers do not let the wildcard cover
                // `Authorization`, which a key-guarded server needs.
                .allow_headers(AllowHeaders::mirror_request()),
        )
        .with_state(state))
}

/// How long a client may take to send a request's headers before its connection is closed
/// (hyper's default once a timer is set; a client that opens connections and never finishes
/// their headers would otherwise hold them, and their file descriptors, forever).
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves `router` on `listener` until `shutdown` resolves, then waits for the open
/// connections' requests to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, router, shutdown, HEADER_TIMEOUT).await
}

/// [`serve`] with the header-read timeout `header_timeout`. Each connection is served by
/// hyper's HTTP/1.1 server (HTTP/1 only, as the router's axum features) with a tokio timer,
/// which `axum::serve` does not set; the timer runs from the connection's first byte wait, so
/// a client that sends nothing is closed too. hyper-util's version-sniffing builder was not
/// used: it waits for the HTTP/2 preface with no timer at all. On `shutdown` the listener
/// closes first, then the open requests finish, unless a second Ctrl-C cuts them off.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_timeout: std::time::Duration,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: wait, as axum::serve does, rather
                // than spin.
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // A stream's chunks are small and one per token: sent at once, not held for Nagle's
        // coalescing (uvicorn, under vLLM, sets it too).
        let _ = stream.set_nodelay(true);
        // The router takes hyper's request bodies as they are (any `HttpBody`).
        let service = TowerToHyperService::new(router.clone());
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A client that left or timed out ends its connection; nothing to report.
            let _ = conn.await;
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
