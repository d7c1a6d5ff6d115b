//! `POST /tokenize` and `POST /detokenize`, as vLLM's and llama.cpp's servers answer them (token
//! counting and debugging for clients): text or a chat conversation to ids, ids to text.
//!
//! `/tokenize` takes vLLM's `prompt` (a string) or `messages` (rendered by the chat template
//! with the generation prompt, as a chat request would be, tools and
//! `chat_template_kwargs` included), or llama.cpp's `content`; it answers `tokens`, `count` and
//! `max_model_len` (the context), with llama.cpp's `with_pieces` giving `{id, piece}` objects.
//! No size bound beyond the body limit: a text longer than the context is counted, not refused.
//! `/detokenize` takes `tokens` (ids in the model's vocabulary) and answers the text, special
//! tokens kept, as both `prompt` (vLLM) and `content` (llama.cpp).

use crate::error::{ApiError, ApiJson};
use crate::handlers::Shared;
use crate::params::chat_prompt;
use crate::protocol::CompletionRequest;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

/// The body of `/tokenize`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    /// llama.cpp's name for the text.
    content: Option<String>,
    /// llama.cpp: each id with its text.
    with_pieces: Option<bool>,
    /// vLLM's `prompt` and `messages` (and what renders them).
    #[serde(flatten)]
    req: CompletionRequest,
}

/// `POST /tokenize`.
pub async fn tokenize(
    State(s): State<Shared>,
    ApiJson(r): ApiJson<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let m = std::sync::Arc::clone(&s.model);
    // Rendering and tokenizing are CPU work: off the async workers.
    tokio::task::spawn_blocking(move || {
        let text = match (&r.content, &r.req.prompt, &r.req.messages) {
            (Some(c), None, None) => c.clone(),
            (None, Some(Value::String(p)), None) => p.clone(),
            (None, Some(_), None) => {
                return Err(ApiError::invalid("prompt", "prompt must be a string"))
            }
            (None, None, Some(_)) => chat_prompt(&r.req, &m)?,
            (None, None, None) => {
                return Err(ApiError::invalid(
                    "prompt",
                    "give the text as prompt (or content), or a conversation as messages",
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "give one of prompt, content and messages",
                ))
            }
        };
        let ids = m
            .tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
        let tokens: Vec<Value> = if r.with_pieces == Some(true) {
            (ids.iter())
                .map(|&id| json!({"id": id, "piece": m.tokenizer.decode(&[id])}))
                .collect()
        } else {
            ids.iter().map(|&id| json!(id)).collect()
        };
        Ok(Json(json!({
            "tokens": tokens,
            "count": ids.len(),
            "max_model_len": m.context_len,
        })))
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
}

/// The body of `/detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    tokens: Option<Value>,
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(s): State<Shared>,
    ApiJson(r): ApiJson<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let vocab = s.model.vocab_size;
    let list = r
        .tokens
        .as_ref()
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("tokens", "tokens must be a list of token ids"))?;
    let mut ids = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.as_u64().filter(|&id| id < vocab as u64) {
            Some(id) => ids.push(id as u32),
            None => {
                return Err(ApiError::invalid(
                    "tokens",
                    format!(
                        "tokens[{i}] = {t} is not a token id of this model (0 to {})",
                        vocab - 1
                    ),
                ))
            }
        }
    }
    let text = s.model.tokenizer.decode(&ids);
    Ok(Json(json!({"prompt": text, "content": text})))
}
