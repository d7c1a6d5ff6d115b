//! Route handlers and middleware: completions (streamed as SSE or whole), models, health,
//! metrics, Bearer auth, per-status request counting, and JSON 404/405 fallbacks.

use crate::error::{ApiError, ApiJson};
use crate::metrics::{self, Metrics};
use crate::params::{prepare, ModelInfo};
use crate::parse::{parse_whole, ChatParser, ParseCfg, Part};
use crate::protocol::{Answer, CompletionRequest, Envelope, Kind, Usage};
use crate::scheduler::{Event, Job, Queue};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use nibble_engine::TokenLogprob;
use serde_json::json;
use serde_json::Value;
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
    /// Chat answers' `<think>` blocks go to `reasoning_content` (`--reasoning-format auto`).
    pub reasoning: bool,
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
    let (stream, include_usage) = (p.stream, p.include_usage);
    let skip_special = p.gen.skip_special_tokens;
    // What the chat answer's text is parsed for (a completion's text is left as it is).
    let parse = (kind == Kind::Chat).then_some(ParseCfg {
        reasoning: s.reasoning,
        tools: p.tools,
        thinking_open: p.thinking_open,
        types: Arc::new(p.tool_types.clone()),
    });
    let scoring = Scoring {
        echo: p.echo.clone(),
        first: p.prompt[0],
        echo_k: p.gen.logprobs.filter(|_| p.echo.is_some()),
        prompt_k: p.prompt_logprobs,
    };
    // One sequence per choice (`n`), each queued as a request of its own; choice i samples from
    // seed + i.
    let (mut rxs, mut jobs) = (Vec::with_capacity(p.choices), Vec::with_capacity(p.choices));
    for i in 0..p.choices {
        let (tx, rx) = unbounded_channel();
        let mut gen = p.gen.clone();
        gen.sampling.seed = gen.sampling.seed.map(|s| s.wrapping_add(i as u64));
        jobs.push(Job {
            prompt: p.prompt.clone(),
            gen,
            events: tx,
        });
        rxs.push(rx);
    }
    // All of the request's sequences enter the queue together, or none does.
    s.queue.submit_all(jobs)?;
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
        choice: 0,
    };
    let m = Arc::clone(&s.model);
    let tok: TokenText = Arc::new(move |id| {
        let shown = !(skip_special && m.tokenizer.is_skipped_special(id));
        (m.tokenizer.token_bytes(id), shown)
    });
    let of = |i: usize| Envelope {
        choice: i,
        ..env.clone()
    };
    if stream {
        if rxs.len() == 1 {
            let rx = rxs.remove(0);
            let st = sse_stream(env, rx, parse, tok, scoring, Tail::Whole { include_usage });
            return Ok(Sse::new(st).into_response());
        }
        // The choices' chunks interleaved as they come, then one usage chunk (the sum) and
        // one [DONE] after the last choice ends.
        let totals: Totals = Arc::default();
        let members = (rxs.into_iter().enumerate()).map(|(i, rx)| {
            let tail = Tail::Member(Arc::clone(&totals));
            let scoring = scoring.clone();
            sse_stream(of(i), rx, parse.clone(), Arc::clone(&tok), scoring, tail).boxed()
        });
        let members: Vec<_> = members.collect();
        let end = stream::once(async move {
            let mut last = vec![];
            if let Some(u) = include_usage
                .then(|| *totals.lock().unwrap_or_else(|p| p.into_inner()))
                .flatten()
            {
                last.push(env.usage_chunk(u).to_string());
            }
            last.push("[DONE]".to_owned());
            stream::iter(last.into_iter().map(|d| Ok(SseEvent::default().data(d))))
        })
        .flatten();
        Ok(Sse::new(stream::select_all(members).chain(end)).into_response())
    } else {
        let answers = rxs
            .into_iter()
            .enumerate()
            .map(|(i, rx)| collect(of(i), rx, parse.clone(), Arc::clone(&tok), scoring.clone()));
        let mut answers = futures_util::future::try_join_all(answers).await?;
        let (mut v, mut usage) = answers.remove(0);
        for (other, u) in answers {
            if let Some(list) = v["choices"].as_array_mut() {
                list.push(other["choices"][0].clone());
            }
            usage = usage.and(u);
        }
        v["usage"] = usage.json();
        Ok(Json(v).into_response())
    }
}

/// The usage of a request's choices so far (`n` > 1 streams): its prompt once, their
/// generated tokens summed.
type Totals = Arc<std::sync::Mutex<Option<Usage>>>;

/// How a chunk stream ends: as a whole response (its final chunk, a usage chunk if asked,
/// `[DONE]`), or as one choice of several (its final chunk only; its usage added to the
/// request's totals).
enum Tail {
    Whole { include_usage: bool },
    Member(Totals),
}

/// What a request asked of its prompt: completions' `echo` (its text, and with `logprobs` the
/// prompt's entries at `echo_k` alternatives), vLLM's `prompt_logprobs` (`prompt_k`).
#[derive(Debug, Clone, Default)]
struct Scoring {
    echo: Option<String>,
    /// The prompt's first token (it has no entry).
    first: u32,
    echo_k: Option<usize>,
    prompt_k: Option<usize>,
}

impl Scoring {
    /// The choice's `logprobs`: the generated entries, after the prompt's when echoed.
    fn logprobs(
        &self,
        env: &Envelope,
        prompt: &[TokenLogprob],
        entries: &[TokenLogprob],
        tok: &TokenText,
    ) -> Value {
        match (&self.echo, self.echo_k) {
            (Some(text), Some(k)) => {
                let at = (entries, text.chars().count());
                env.echoed_logprobs(self.first, prompt, k, at, tok.as_ref())
            }
            _ => logprobs_value(env, entries, tok),
        }
    }

    /// vLLM's `prompt_logprobs`, when asked.
    fn prompt_logprobs(&self, prompt: &[TokenLogprob], tok: &TokenText) -> Option<Value> {
        let k = self.prompt_k?;
        Some(Envelope::prompt_logprobs(prompt, k, tok.as_ref()))
    }
}

/// A token id's bytes (the tokenizer's) and whether the answer's text shows them, for logprob
/// entries.
type TokenText = Arc<dyn Fn(u32) -> (Vec<u8>, bool) + Send + Sync>;

/// The choice's `logprobs`: null unless entries were asked for.
fn logprobs_value(env: &Envelope, entries: &[TokenLogprob], tok: &TokenText) -> Value {
    if entries.is_empty() {
        return Value::Null;
    }
    env.logprobs(entries, tok.as_ref())
}

/// OpenAI's finish reason for an answer that made tool calls and then stopped.
fn finish_with_calls(finish: &'static str, calls: usize) -> &'static str {
    if calls > 0 && finish == "stop" {
        "tool_calls"
    } else {
        finish
    }
}

/// Waits for the whole answer: the response of `env`'s choice and its usage. Dropping this
/// future (client gone) drops `rx`, which cancels. `parse`: what a chat answer is parsed for;
/// `tok` writes logprob entries' tokens.
async fn collect(
    env: Envelope,
    mut rx: UnboundedReceiver<Event>,
    parse: Option<ParseCfg>,
    tok: TokenText,
    scoring: Scoring,
) -> Result<(Value, Usage), ApiError> {
    let mut text = scoring.echo.clone().unwrap_or_default();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done {
                finish,
                usage,
                logprobs,
                prompt_logprobs,
            } => {
                let (reasoning, content, calls) = match parse {
                    Some(cfg) => parse_whole(&text, &cfg),
                    None => (String::new(), text, vec![]),
                };
                let answer = Answer {
                    reasoning,
                    content,
                    calls,
                    logprobs: scoring.logprobs(&env, &prompt_logprobs, &logprobs, &tok),
                };
                let finish = finish_with_calls(finish, answer.calls.len());
                let mut v = env.response(&answer, finish, usage);
                if let Some(p) = scoring.prompt_logprobs(&prompt_logprobs, &tok) {
                    // vLLM's places: the choice's for completions, the response's for chat.
                    match env.kind {
                        Kind::Text => v["choices"][0]["prompt_logprobs"] = p,
                        Kind::Chat => v["prompt_logprobs"] = p,
                    }
                }
                return Ok((v, usage));
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
    tail: Tail,
    pending: VecDeque<String>,
    ended: bool,
    /// A chat answer's parser (reasoning and tool calls), when either is parsed.
    parser: Option<ChatParser>,
    /// Tool calls sent so far.
    calls: usize,
    /// Writes logprob entries' tokens.
    tok: TokenText,
    scoring: Scoring,
    /// Logprob entries not yet sent: they go with the next chunk the answer's text makes (a
    /// parser may hold text back), the rest in a chunk of their own before the final one.
    /// Unused when the prompt is echoed with its entries: those all come in one chunk then.
    entries: Vec<TokenLogprob>,
    /// Completions' `text_offset` of the next entry.
    offset: usize,
}

impl SseState {
    /// Whether the entries stream with the text (else they all come at the end).
    fn entries_stream(&self) -> bool {
        self.scoring.echo_k.is_none()
    }

    /// Queues the chunks of some answer text: as it is, or as its parser settles it, the
    /// entries not yet sent (`fresh` with them) in the first of them.
    fn queue_text(&mut self, t: &str, fresh: Vec<TokenLogprob>, end: bool) {
        if self.entries_stream() {
            self.entries.extend(fresh);
        }
        let mut chunks = self.text_chunks(t, end);
        if let Some(first) = chunks.first_mut() {
            if let Some(v) = self.take_entries() {
                first["choices"][0]["logprobs"] = v;
            }
        }
        (self.pending).extend(chunks.iter().map(Value::to_string));
    }

    /// The `logprobs` object of the entries not yet sent, if any.
    fn take_entries(&mut self) -> Option<Value> {
        if self.entries.is_empty() {
            return None;
        }
        let entries = std::mem::take(&mut self.entries);
        let (v, offset) = self
            .env
            .logprobs_at(&entries, self.tok.as_ref(), self.offset);
        self.offset = offset;
        Some(v)
    }

    /// The chunks of some answer text: as it is, or as its parser settles it.
    fn text_chunks(&mut self, t: &str, end: bool) -> Vec<Value> {
        let Some(p) = self.parser.as_mut() else {
            return match t.is_empty() {
                true => vec![],
                false => vec![self.env.chunk(Some(t), false, None)],
            };
        };
        let mut parts = p.push(t);
        if end {
            parts.extend(p.finish());
        }
        let mut chunks = Vec::with_capacity(parts.len());
        for part in parts {
            let c = match part {
                Part::Reasoning(r) => self.env.delta_chunk(json!({"reasoning_content": r})),
                Part::Content(c) => self.env.chunk(Some(&c), false, None),
                Part::ToolCall { name, arguments } => {
                    let mut call = self.env.tool_call(self.calls, &name, &arguments);
                    call["index"] = json!(self.calls);
                    self.calls += 1;
                    self.env.delta_chunk(json!({ "tool_calls": [call] }))
                }
            };
            chunks.push(c);
        }
        chunks
    }
}

/// The OpenAI chunk stream: (chat) a role chunk, content chunks (and, parsed from a chat
/// answer, `reasoning_content` and `tool_calls` deltas), a final chunk with `finish_reason` and
/// `usage` (null with `include_usage`, which adds a usage-only chunk after it), then `[DONE]`.
/// When the client disconnects hyper drops this stream and with it `rx`: the worker's next send
/// fails and generation is cancelled.
/// `tail` says how it ends (one choice of several leaves the usage and `[DONE]` to the caller).
fn sse_stream(
    env: Envelope,
    rx: UnboundedReceiver<Event>,
    parse: Option<ParseCfg>,
    tok: TokenText,
    scoring: Scoring,
    tail: Tail,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let mut pending = VecDeque::new();
    if env.kind == Kind::Chat {
        pending.push_back(env.chunk(None, true, None).to_string());
    }
    // Completions' echo: the prompt's text is the first chunk (vLLM's way).
    if let Some(t) = scoring.echo.as_deref().filter(|t| !t.is_empty()) {
        pending.push_back(env.chunk(Some(t), false, None).to_string());
    }
    let st = SseState {
        rx,
        env,
        tail,
        pending,
        ended: false,
        parser: parse.map(|cfg| cfg.parser()).filter(ChatParser::active),
        calls: 0,
        tok,
        scoring,
        entries: Vec::new(),
        offset: 0,
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
                Some(Event::Text { text, logprobs }) => st.queue_text(&text, logprobs, false),
                Some(Event::Done {
                    finish,
                    usage,
                    logprobs,
                    prompt_logprobs,
                }) => {
                    st.queue_text("", vec![], true);
                    // Entries no text chunk took (a stop string's ids, text a parser kept) in
                    // a chunk of their own; with an echoed prompt's, every entry in one chunk.
                    let v = match st.entries_stream() {
                        true => st.take_entries(),
                        false => {
                            Some(
                                st.scoring
                                    .logprobs(&st.env, &prompt_logprobs, &logprobs, &st.tok),
                            )
                        }
                    };
                    if let Some(v) = v.filter(|v| !v.is_null()) {
                        st.pending.push_back(st.env.logprobs_chunk(v).to_string());
                    }
                    let finish = finish_with_calls(finish, st.calls);
                    // The usage goes in one chunk only, so a client that adds up the chunks'
                    // usage counts it once: OpenAI's usage-only chunk when asked for, else
                    // the final chunk (as llama.cpp and vLLM put it).
                    match &st.tail {
                        Tail::Whole { include_usage } => {
                            let u = (!include_usage).then_some(usage);
                            st.pending
                                .push_back(st.env.final_chunk(finish, u).to_string());
                            if *include_usage {
                                st.pending.push_back(st.env.usage_chunk(usage).to_string());
                            }
                            st.pending.push_back("[DONE]".to_owned());
                        }
                        Tail::Member(totals) => {
                            let mut t = totals.lock().unwrap_or_else(|p| p.into_inner());
                            *t = Some(t.map_or(usage, |t| t.and(usage)));
                            st.pending
                                .push_back(st.env.final_chunk(finish, None).to_string());
                        }
                    }
                    st.ended = true;
                }
                Some(Event::Error(msg)) => {
                    // What the parser still holds goes out before the error.
                    st.queue_text("", vec![], true);
                    // Headers are sent already: report in-band, as OpenAI does.
                    st.pending
                        .push_back(ApiError::internal(msg).body().to_string());
                    // The stream still ends as every stream does (vLLM sends it too), so a
                    // client waiting for it is not left hanging (a choice of several: after
                    // the others).
                    if let Tail::Whole { .. } = st.tail {
                        st.pending.push_back("[DONE]".to_owned());
                    }
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
            let header = req
                .headers()
                .get(header::AUTHORIZATION)
                .map(|v| v.to_str().unwrap_or(""));
            // The scheme is case-insensitive (RFC 9110): `bearer KEY` is a key too.
            let given = header.and_then(|v| {
                let (scheme, key) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key)
            });
            match given {
                None => {
                    let why = if header.is_some() {
                        "the Authorization header is not `Bearer KEY`"
                    } else {
                        "missing API key: send the header `Authorization: Bearer KEY`"
                    };
                    return ApiError::unauthorized(why).into_response();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Usage;
    use serde_json::Value;

    const PIECES: [&str; 5] = [
        "<think>\nWeather",
        " wanted.\n</think>\n\nChecking.\n<tool",
        "_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "\n<tool_call>{\"name\": \"now\"}</tool_call>",
        "\n",
    ];

    fn env() -> Envelope {
        Envelope {
            kind: Kind::Chat,
            id: "chatcmpl-5".into(),
            created: 1,
            model: "tiny".into(),
            choice: 0,
        }
    }

    /// Token `id` written as `t{id}`.
    fn names() -> TokenText {
        Arc::new(|id| (format!("t{id}").into_bytes(), true))
    }

    fn events() -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        for p in PIECES {
            tx.send(Event::Text {
                text: p.into(),
                logprobs: vec![],
            })
            .unwrap();
        }
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 9,
            cached_tokens: 0,
        };
        tx.send(Event::Done {
            finish: "stop",
            usage,
            logprobs: vec![],
            prompt_logprobs: vec![],
        })
        .unwrap();
        rx
    }

    #[tokio::test]
    async fn a_chat_answer_is_split_into_reasoning_content_and_tool_calls() {
        let both = ParseCfg {
            reasoning: true,
            tools: true,
            thinking_open: false,
            types: Arc::default(),
        };
        let (v, _) = collect(
            env(),
            events(),
            Some(both.clone()),
            names(),
            Scoring::default(),
        )
        .await
        .unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        let m = &choice["message"];
        assert_eq!(m["reasoning_content"], "Weather wanted.");
        assert_eq!(m["content"], "Checking.\n");
        assert_eq!(m["tool_calls"][0]["id"], "call_5_0");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        let f = &m["tool_calls"][0]["function"];
        assert_eq!(f["name"], "get_weather");
        assert_eq!(f["arguments"], r#"{"city":"Paris"}"#);
        assert_eq!(m["tool_calls"][1]["function"]["arguments"], "{}");
        // The streamed chunks carry the same parts, the calls indexed.
        let mut st = SseState {
            rx: events(),
            env: env(),
            tail: Tail::Whole {
                include_usage: false,
            },
            pending: VecDeque::new(),
            ended: false,
            parser: Some(both.parser()),
            calls: 0,
            tok: names(),
            scoring: Scoring::default(),
            entries: vec![],
            offset: 0,
        };
        // Piece i came from ids 10 i and 10 i + 1.
        let ids = |i: u32| -> Vec<TokenLogprob> {
            (0..2)
                .map(|j| TokenLogprob {
                    id: 10 * i + j,
                    logprob: -0.5,
                    rank: 1,
                    top: vec![],
                })
                .collect()
        };
        for (i, p) in PIECES.iter().enumerate() {
            st.queue_text(p, ids(i as u32), false);
        }
        st.queue_text("", vec![], true);
        if let Some(v) = st.take_entries() {
            st.pending.push_back(st.env.logprobs_chunk(v).to_string());
        }
        let chunks: Vec<Value> = (st.pending.iter())
            .map(|c| serde_json::from_str::<Value>(c).unwrap())
            .collect();
        // Every entry is sent once, in order, each with the first chunk its text made (the
        // ids of a tool call's text with the call's chunk), the rest at the end.
        let tokens = |c: &Value| -> Vec<String> {
            let content = c["choices"][0]["logprobs"]["content"].as_array();
            (content.into_iter().flatten())
                .map(|e| e["token"].as_str().unwrap().to_owned())
                .collect()
        };
        let sent: Vec<String> = chunks.iter().flat_map(tokens).collect();
        let want: Vec<String> = (0..5).flat_map(ids).map(|e| format!("t{}", e.id)).collect();
        assert_eq!(sent, want);
        let first_call = (chunks.iter())
            .find(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
            .unwrap();
        assert_eq!(tokens(first_call), ["t20", "t21"]);
        let deltas: Vec<Value> = (chunks.iter())
            .map(|c| c["choices"][0]["delta"].clone())
            .collect();
        let joined =
            |key: &str| -> String { deltas.iter().filter_map(|d| d[key].as_str()).collect() };
        assert_eq!(joined("reasoning_content"), "Weather wanted.");
        assert_eq!(joined("content"), "Checking.\n");
        let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1][0]["index"], 1);
        assert_eq!(calls[1][0]["function"]["name"], "now");
        assert_eq!(st.calls, 2);
        // Neither switch: the text is the content, as generated.
        let (v, _) = collect(
            env(),
            events(),
            Some(ParseCfg::default()),
            names(),
            Scoring::default(),
        )
        .await
        .unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], PIECES.concat());
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
}
