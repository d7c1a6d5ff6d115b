//! Route handlers and middleware: completions (streamed as SSE or whole), models, health,
//! metrics, Bearer auth, per-status request counting, and JSON 404/405 fallbacks.

use crate::error::{ApiError, ApiJson};
use crate::metrics::{self, Metrics};
use crate::params::{prepare, ModelInfo};
use crate::protocol::{CompletionRequest, Envelope, Kind};
use crate::scheduler::{Event, Job, Queue};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use serde_json::json;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What every handler shares.
pub struct AppState {
    pub model: Arc<ModelInfo>,
    pub queue: Queue,
    pub metrics: Metrics,
    pub model_id: String,
    pub api_key: Option<String>,
    /// Server start, Unix seconds (the model's `created`).
    pub started: u64,
    pub next_id: AtomicU64,
}

pub type Shared = Arc<AppState>;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(s): State<Shared>, ApiJson(req): ApiJson<CompletionRequest>) -> Response {
    complete(s, req, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(s): State<Shared>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Response {
    complete(s, req, Kind::Text)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn complete(s: Shared, req: CompletionRequest, kind: Kind) -> Result<Response, ApiError> {
    let model = Arc::clone(&s.model);
    // Template rendering and tokenization are CPU work: keep them off the async workers.
    let p = tokio::task::spawn_blocking(move || prepare(&req, kind, &model))
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))??;
    let (tx, rx) = unbounded_channel();
    let (stream, include_usage) = (p.stream, p.include_usage);
    s.queue.submit(Job {
        prompt: p.prompt,
        gen: p.gen,
        events: tx,
    })?;
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let env = Envelope {
        kind,
        id: format!("{prefix}-{:x}{n:06x}", s.started),
        created: now(),
        model: s.model_id.clone(),
    };
    if stream {
        Ok(Sse::new(sse_stream(env, rx, include_usage)).into_response())
    } else {
        collect(env, rx).await
    }
}

/// Waits for the whole answer. Dropping this future (client gone) drops `rx`, which cancels.
async fn collect(env: Envelope, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done { finish, usage } => {
                return Ok(Json(env.response(&text, finish, usage)).into_response())
            }
            Event::Error(msg) => return Err(ApiError::internal(msg)),
        }
    }
    Err(ApiError::internal("the engine dropped the request"))
}

/// State of one SSE stream: chunks ready to send, and whether the end was reached.
struct SseState {
    rx: UnboundedReceiver<Event>,
    env: Envelope,
    include_usage: bool,
    pending: VecDeque<String>,
    ended: bool,
}

/// The OpenAI chunk stream: (chat) a role chunk, content chunks, a final chunk with
/// `finish_reason` and `usage` (null with `include_usage`, which adds a usage-only chunk after
/// it), then `[DONE]`.
/// When the client disconnects hyper drops this stream and with it `rx`: the worker's next send
/// fails and generation is cancelled.
fn sse_stream(
    env: Envelope,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let mut pending = VecDeque::new();
    if env.kind == Kind::Chat {
        pending.push_back(env.chunk(None, true, None).to_string());
    }
    let st = SseState {
        rx,
        env,
        include_usage,
        pending,
        ended: false,
    };
    stream::unfold(st, |mut st| async move {
        loop {
            if let Some(data) = st.pending.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.ended {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Text(t)) => {
                    let c = st.env.chunk(Some(&t), false, None);
                    st.pending.push_back(c.to_string());
                }
                Some(Event::Done { finish, usage }) => {
                    // The usage goes in one chunk only, so a client that adds up the chunks'
                    // usage counts it once: OpenAI's usage-only chunk when asked for, else
                    // the final chunk (as llama.cpp and vLLM put it).
                    let last = st
                        .env
                        .final_chunk(finish, (!st.include_usage).then_some(usage));
                    st.pending.push_back(last.to_string());
                    if st.include_usage {
                        st.pending.push_back(st.env.usage_chunk(usage).to_string());
                    }
                    st.pending.push_back("[DONE]".to_owned());
                    st.ended = true;
                }
                Some(Event::Error(msg)) => {
                    // Headers are sent already: report in-band, as OpenAI does.
                    st.pending
                        .push_back(ApiError::internal(msg).body().to_string());
                    st.ended = true;
                }
                None => st.ended = true,
            }
        }
    })
}

/// `GET /v1/models`.
pub async fn models(State(s): State<Shared>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_card(&s)]}))
}

/// The served model as OpenAI describes a model.
fn model_card(s: &AppState) -> serde_json::Value {
    json!({
        "id": s.model_id,
        "object": "model",
        "created": s.started,
        "owned_by": "nibble",
        "context_length": s.model.context_len,
    })
}

/// `GET /v1/models/{id}` (the OpenAI SDKs' `models.retrieve`): the served model, or 404 with
/// OpenAI's `model_not_found`.
pub async fn model(
    State(s): State<Shared>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id != s.model_id {
        let message = format!(
            "the model {id:?} does not exist: this server serves {:?}",
            s.model_id
        );
        return ApiError::status(StatusCode::NOT_FOUND, "invalid_request_error", message)
            .with_code("model_not_found")
            .into_response();
    }
    Json(model_card(&s)).into_response()
}

/// `GET /health`: always open, even with `--api-key`.
pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /metrics`.
pub async fn metrics(State(s): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        s.metrics.render(),
    )
        .into_response()
}

/// Unknown routes.
pub async fn not_found(req: Request) -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

/// Known route, wrong method.
pub async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

/// `Authorization: Bearer KEY` on every route but `/health`, when a key is configured.
pub async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            match given {
                None => {
                    return ApiError::unauthorized(
                        "missing API key: send the header `Authorization: Bearer KEY`",
                    )
                    .into_response()
                }
                Some(k) if k.trim() != key => {
                    return ApiError::unauthorized("incorrect API key").into_response()
                }
                Some(_) => {}
            }
        }
    }
    next.run(req).await
}

/// Counts every answer by status (outermost layer, so 401s and 404s count too).
pub async fn count(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    s.metrics.count_request(r.status().as_u16());
    r
}
