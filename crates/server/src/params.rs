//! Request validation: turns a [`CompletionRequest`] into prompt ids and [`GenParams`], or a 400.
//!
//! Defaults follow OpenAI, not the CLI: a request that gives no `temperature` is sampled at
//! temperature 1.0 with top_p 1.0 (send `temperature: 0` for greedy, deterministic output).
//! `max_tokens` (or `max_completion_tokens`) defaults to the rest of the context for chat and to
//! 16 for `/v1/completions`, as OpenAI's legacy completions endpoint does (capped by the context).
//! Ranges are OpenAI's: temperature in [0, 2], top_p in (0, 1], presence and frequency penalties
//! in [-2, 2], at most 4 stop strings (of at most 4096 bytes each), `n` from 1 to 16 choices
//! (each its own sequence, as vLLM generates them); extensions:
//! top_k (-1 or 0 = off), min_p in [0, 1], repetition_penalty > 0; `logit_bias` ids in the
//! vocabulary with biases in [-100, 100]; `skip_special_tokens` (vLLM's, default true);
//! logprobs (chat: `logprobs: true` and `top_logprobs` 0-20; completions: `logprobs` 0-5).
//! structured outputs ([`crate::structured`]); completions' `suffix` (fill-in-the-middle in
//! Qwen's form, [`FIM`]); completions' `echo` and vLLM's `prompt_logprobs`
//! (with either, `max_tokens` may be 0: the prompt alone). Features not implemented
//! (`best_of`, ...) are refused, never ignored. A prompt must leave room for one generated token
//! (a prompt alone, `max_tokens` 0, may fill the context), and prompt + max_tokens must fit the
//! context (`context_length_exceeded`).

use crate::error::ApiError;
use crate::protocol::{ChatMessage, CompletionRequest, Kind};
use crate::structured::{self, Grammars};
use nibble_engine::session::GenParams;
use nibble_engine::{ChatTemplate, Message, SamplingParams, Tokenizer};
use serde_json::Value;

/// Default `max_tokens` of `/v1/completions` (OpenAI's legacy default).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;
/// OpenAI accepts at most 4 stop sequences.
pub const MAX_STOP_STRINGS: usize = 4;
/// Bytes of one stop sequence: every generated token is checked against each, so megabytes of
/// stop text slowed every step of a request (35 ms a token for 8 MB).
const MAX_STOP_BYTES: usize = 4096;

/// What validation needs to know about the model.
pub struct ModelInfo {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// KV-cache capacity in tokens.
    pub context_len: usize,
    /// Rows of the model's embedding; ids at or above it are rejected.
    pub vocab_size: usize,
    /// The model's end-of-sequence ids (a grammar's end).
    pub eos_ids: Vec<u32>,
    /// Chat answers' `<think>` blocks are parsed out (`--reasoning-format auto`): a grammar
    /// leaves them free.
    pub reasoning: bool,
    /// Structured outputs' compiler, built on first use.
    pub grammars: Grammars,
    /// The chat template writes tool calls in Qwen3-Coder's XML form
    /// ([`tool_calls_are_xml`]): a forced `tool_choice` is constrained to that form.
    pub tool_xml: bool,
}

/// Whether `template` shows tool calls in Qwen3-Coder's form (`<function=NAME>` with
/// `<parameter=KEY>` blocks) rather than Qwen3's Hermes JSON: its template writes both tags.
pub fn tool_calls_are_xml(template: &str) -> bool {
    template.contains("<function=") && template.contains("<parameter=")
}

/// A validated request, ready for the engine.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub gen: GenParams,
    pub stream: bool,
    pub include_usage: bool,
    /// A chat request that offers tools: its answer's `<tool_call>` blocks are parsed.
    pub tools: bool,
    /// The offered functions' parameter types (Qwen3-Coder's XML calls are typed by them).
    pub tool_types: crate::parse::ToolTypes,
    /// A chat prompt that ends inside a thinking block (`<think>`, as Qwen3 Thinking-2507
    /// templates render the generation prompt): the answer starts as reasoning.
    pub thinking_open: bool,
    /// Completions' `echo`: the prompt's text, to go before the answer's.
    pub echo: Option<String>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token in that field.
    pub prompt_logprobs: Option<usize>,
    /// `n`: choices to generate, each its own sequence (choice `i` sampled from seed + `i`
    /// where a seed is given).
    pub choices: usize,
}

fn in_range(
    name: &str,
    v: Option<f32>,
    default: f32,
    ok: impl Fn(f32) -> bool,
    want: &str,
) -> Result<f32, ApiError> {
    let x = v.unwrap_or(default);
    if x.is_finite() && ok(x) {
        Ok(x)
    } else {
        Err(ApiError::invalid(
            name,
            format!("{name} = {x} is out of range: want {want}"),
        ))
    }
}

/// OpenAI's bound on one logit bias.
const MAX_LOGIT_BIAS: f32 = 100.0;

/// `logit_bias`: null or an object mapping token ids (as strings) to biases in [-100, 100],
/// each id in the vocabulary of `vocab`; returned in id order.
fn logit_bias(v: &Option<Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |msg: String| ApiError::invalid("logit_bias", msg);
    let map = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(bad(
                "logit_bias must be an object mapping token ids to biases".into(),
            ))
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, val) in map {
        let id = key
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias key {key:?} is not a token id of the vocabulary of {vocab}"
                ))
            })?;
        let b = val
            .as_f64()
            .map(|b| b as f32)
            .filter(|b| (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias for token {id} is {val}: want a number in [-100, 100]"
                ))
            })?;
        out.push((id, b));
    }
    out.sort_unstable_by_key(|&(id, _)| id);
    // Keys that differ as text but name one id ("1" and "01"): which bias was meant is unclear.
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("logit_bias names token {} twice", w[0].0)));
    }
    Ok(out)
}

/// The sampling part of the request (`vocab`: the model's vocabulary size).
fn sampling(r: &CompletionRequest, vocab: usize) -> Result<SamplingParams, ApiError> {
    // vLLM's convention: -1 (or 0) disables top-k; other negatives are mistakes.
    let top_k = r.top_k.unwrap_or(0);
    if top_k < -1 {
        return Err(ApiError::invalid(
            "top_k",
            format!("top_k = {top_k} is out of range: want -1 or 0 (off) or a count >= 1"),
        ));
    }
    Ok(SamplingParams {
        temperature: in_range(
            "temperature",
            r.temperature,
            1.0,
            |x| (0.0..=2.0).contains(&x),
            "0 <= temperature <= 2",
        )?,
        top_p: in_range(
            "top_p",
            r.top_p,
            1.0,
            |x| x > 0.0 && x <= 1.0,
            "0 < top_p <= 1",
        )?,
        top_k: usize::try_from(top_k.max(0)).unwrap_or(usize::MAX),
        min_p: in_range(
            "min_p",
            r.min_p,
            0.0,
            |x| (0.0..=1.0).contains(&x),
            "0 <= min_p <= 1",
        )?,
        repetition_penalty: in_range(
            "repetition_penalty",
            r.repetition_penalty,
            1.0,
            |x| x > 0.0,
            "> 0",
        )?,
        presence_penalty: in_range(
            "presence_penalty",
            r.presence_penalty,
            0.0,
            |x| (-2.0..=2.0).contains(&x),
            "-2 <= presence_penalty <= 2",
        )?,
        frequency_penalty: in_range(
            "frequency_penalty",
            r.frequency_penalty,
            0.0,
            |x| (-2.0..=2.0).contains(&x),
            "-2 <= frequency_penalty <= 2",
        )?,
        // OpenAI seeds are signed; the bit pattern is the sampler's seed. -1 is llama.cpp's
        // "random seed", as no seed is.
        seed: r.seed.filter(|s| *s != -1).map(|s| s as u64),
        logit_bias: logit_bias(&r.logit_bias, vocab)?,
    })
}

/// `stop`: null, a string or a list of at most 4 strings.
fn stop_strings(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid("stop", "stop must be a string or an array of strings");
    let list = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| x.as_str().map(str::to_owned).ok_or_else(bad))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(bad()),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop sequences are allowed, got {}",
                list.len()
            ),
        ));
    }
    if let Some(long) = list.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "a stop sequence may be at most {MAX_STOP_BYTES} bytes, got {}",
                long.len()
            ),
        ));
    }
    Ok(list)
}

/// Most alternatives per token of `/v1/completions`' `logprobs` (OpenAI's bound).
const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// `logprobs` (and chat's `top_logprobs`): how many alternatives each generated token's entry
/// lists, or `None` for no entries.
fn logprobs(r: &CompletionRequest, kind: Kind) -> Result<Option<usize>, ApiError> {
    let top = r.top_logprobs;
    match kind {
        Kind::Chat => {
            let on =
                match &r.logprobs {
                    None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                    Some(Value::Bool(true)) => true,
                    Some(_) => return Err(ApiError::invalid(
                        "logprobs",
                        "logprobs must be true or false (top_logprobs says how many alternatives)",
                    )),
                };
            match top {
                Some(k) if !(0..=nibble_engine::MAX_TOP_LOGPROBS as i64).contains(&k) => {
                    Err(ApiError::invalid(
                        "top_logprobs",
                        format!("top_logprobs = {k} is out of range: want 0 to 20"),
                    ))
                }
                Some(k) if k > 0 && !on => Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                )),
                _ => Ok(on.then(|| top.unwrap_or(0) as usize)),
            }
        }
        Kind::Text => match &r.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n))
                if n.as_i64()
                    .is_some_and(|k| (0..=MAX_COMPLETION_LOGPROBS).contains(&k)) =>
            {
                Ok(n.as_u64().map(|k| k as usize))
            }
            Some(v) => Err(ApiError::invalid(
                "logprobs",
                format!("logprobs = {v} is out of range: want an integer from 0 to 5"),
            )),
        },
    }
}

/// vLLM's `prompt_logprobs`: how many alternatives each prompt token's entry lists.
fn prompt_logprobs(r: &CompletionRequest) -> Result<Option<usize>, ApiError> {
    let k = match &r.prompt_logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => return Ok(None),
        Some(Value::Bool(true)) => 1,
        Some(Value::Number(n))
            if n.as_u64()
                .is_some_and(|k| k <= nibble_engine::MAX_TOP_LOGPROBS as u64) =>
        {
            n.as_u64().unwrap_or(0) as usize
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "prompt_logprobs",
                format!(
                    "prompt_logprobs = {v} is not valid: want an integer from 0 to 20 (or true)"
                ),
            ))
        }
    };
    if r.stream == Some(true) {
        return Err(ApiError::invalid(
            "prompt_logprobs",
            "prompt_logprobs is not supported with stream: true",
        ));
    }
    Ok(Some(k))
}

/// Most choices one request may ask for (`n`): each is a sequence of its own.
pub const MAX_CHOICES: i64 = 16;

/// `n`: how many choices (independent completions of the prompt) to generate.
fn choices(r: &CompletionRequest) -> Result<usize, ApiError> {
    match r.n.unwrap_or(1) {
        n @ 1..=MAX_CHOICES => Ok(n as usize),
        n => Err(ApiError::invalid(
            "n",
            format!("n = {n} is out of range: want 1 to {MAX_CHOICES} choices"),
        )),
    }
}

/// Features this server does not implement: rejected rather than silently ignored.
fn unsupported(r: &CompletionRequest) -> Result<(), ApiError> {
    if r.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid(
            "best_of",
            "best_of other than 1 is not supported",
        ));
    }
    if r.continue_final_message == Some(true) {
        return Err(ApiError::invalid(
            "continue_final_message",
            "continuing a final assistant message is not supported",
        ));
    }
    if r.add_generation_prompt == Some(false) {
        return Err(ApiError::invalid(
            "add_generation_prompt",
            "add_generation_prompt = false is not supported",
        ));
    }
    Ok(())
}

/// One message's text: a string, text parts, or null (assistant only).
fn message_text(i: usize, m: &ChatMessage) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match &m.content {
        Value::String(s) => Ok(s.clone()),
        Value::Null if m.role == "assistant" => Ok(String::new()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let at = format!("{param}[{j}]");
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(at, "a text part needs a \"text\" string"))
                    }
                    _ => return Err(ApiError::invalid(at, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")),
                }
            }
            // Parts are lines of one message, as vLLM joins them.
            Ok(texts.join("\n"))
        }
        Value::Null => Err(ApiError::invalid(
            param,
            format!("messages[{i}] ({}) has no content", m.role),
        )),
        _ => Err(ApiError::invalid(
            param,
            "content must be a string or an array of text parts",
        )),
    }
}

/// Renders the conversation with the model's template.
pub(crate) fn chat_prompt(r: &CompletionRequest, m: &ModelInfo) -> Result<String, ApiError> {
    let msgs = r
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages must hold at least one message",
        ));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, cm) in msgs.iter().enumerate() {
        let role = match cm.role.as_str() {
            r @ ("system" | "user" | "assistant" | "tool") => r,
            // OpenAI's newer name for the system role, which current SDKs send; Qwen3's
            // template knows only "system" (llama.cpp and vLLM pass it on likewise).
            "developer" => "system",
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                    "unknown role {other:?}: want system (or developer), user, assistant or tool"
                ),
                ))
            }
        };
        let mut msg = Message::new(role.to_owned(), message_text(i, cm)?);
        msg.reasoning_content = cm.reasoning_content.clone();
        msg.tool_calls = cm.tool_calls.clone();
        out.push(msg);
    }
    if r.tools
        .as_ref()
        .is_some_and(|t| !t.is_array() && !t.is_null())
    {
        return Err(ApiError::invalid("tools", "tools must be an array"));
    }
    // Each tool as OpenAI defines one (vLLM and OpenAI refuse others): a function with a name.
    let tools = r.tools.as_ref().and_then(Value::as_array);
    for (i, t) in tools.into_iter().flatten().enumerate() {
        let named = t.get("type").and_then(Value::as_str) == Some("function")
            && t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
        if !named {
            return Err(ApiError::invalid(
                format!("tools[{i}]"),
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        }
    }
    let tpl = m.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "the model has no chat template; use /v1/completions",
        )
    })?;
    let thinking = r
        .chat_template_kwargs
        .as_ref()
        .and_then(|k| k.enable_thinking);
    let tools = offered_tools(r);
    tpl.render(&out, true, thinking, tools)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}

/// Completions `prompt`: a string, `[string]`, a list of token ids, or `[[ids]]` (a batch of
/// one token list, as lm-eval-harness sends tokenized requests).
fn text_prompt(r: &CompletionRequest, m: &ModelInfo) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, an array with one string, or an array of token ids",
        )
    };
    let batched = |n: usize, what: &str| {
        ApiError::invalid(
            "prompt",
            format!("batched prompts ({n} {what}) are not supported: send one prompt per request"),
        )
    };
    if let Some(text) = prompt_text(r) {
        return encode(text, m);
    }
    match &r.prompt {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => token_ids(items, m),
        Some(Value::Array(items)) if items.iter().all(|x| x.is_array()) => match items.as_slice() {
            [Value::Array(ids)] if ids.iter().all(Value::is_u64) => token_ids(ids, m),
            [_] => Err(bad()),
            _ => Err(batched(items.len(), "token lists")),
        },
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
            Err(batched(items.len(), "strings"))
        }
        Some(_) => Err(bad()),
    }
}

/// A completions prompt given as text: a string, or an array of one string.
fn prompt_text(r: &CompletionRequest) -> Option<&str> {
    match &r.prompt {
        Some(Value::String(s)) => Some(s),
        Some(Value::Array(items)) if items.len() == 1 => items[0].as_str(),
        _ => None,
    }
}

/// Qwen's fill-in-the-middle tokens (Qwen2.5-Coder and Qwen3-Coder are trained on them; every
/// Qwen3 vocabulary has them).
const FIM: [&str; 3] = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];

/// Completions' `suffix` (OpenAI's insertion): the text between `prompt` and `suffix` is
/// asked for in Qwen's fill-in-the-middle form, `<|fim_prefix|>` prompt `<|fim_suffix|>`
/// suffix `<|fim_middle|>`, the ids of the three markers placed as such (text that spells a
/// marker inside the prompt or suffix is tokenized as it would be anywhere else).
fn fim_prompt(r: &CompletionRequest, suffix: &str, m: &ModelInfo) -> Result<Vec<u32>, ApiError> {
    let ids = FIM
        .iter()
        .map(|t| m.tokenizer.token_to_id(t))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| {
            ApiError::invalid(
                "suffix",
                "suffix needs a tokenizer with Qwen's fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>); this one lacks them",
            )
        })?;
    let Some(prefix) = prompt_text(r) else {
        // A prompt that is no prompt at all is named as such; token ids are not text.
        text_prompt(r, m)?;
        return Err(ApiError::invalid(
            "suffix",
            "suffix needs the prompt as one string (the text before the insertion)",
        ));
    };
    if r.echo == Some(true) {
        return Err(ApiError::invalid(
            "echo",
            "echo is not supported with suffix (an insertion is not a continuation)",
        ));
    }
    let mut out = vec![ids[0]];
    out.extend(encode(prefix, m)?);
    out.push(ids[1]);
    out.extend(encode_field(suffix, m, "suffix")?);
    out.push(ids[2]);
    Ok(out)
}

/// A prompt given as token ids, each checked against the vocabulary.
fn token_ids(items: &[Value], m: &ModelInfo) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|x| {
            let id = x.as_u64().unwrap_or(u64::MAX);
            u32::try_from(id)
                .ok()
                .filter(|&t| (t as usize) < m.vocab_size)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        format!(
                            "token id {id} is outside the vocabulary of {}",
                            m.vocab_size
                        ),
                    )
                })
        })
        .collect()
}

/// The text `echo` puts before the answer: the prompt as sent, or its token ids decoded.
fn echo_text(r: &CompletionRequest, ids: &[u32], m: &ModelInfo) -> String {
    match &r.prompt {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_owned()
        }
        _ => m.tokenizer.decode(ids),
    }
}

fn encode(text: &str, m: &ModelInfo) -> Result<Vec<u32>, ApiError> {
    encode_field(text, m, "prompt")
}

/// [`encode`] of the request field `param` (errors name it).
fn encode_field(text: &str, m: &ModelInfo, param: &str) -> Result<Vec<u32>, ApiError> {
    m.tokenizer
        .encode_within(text, m.context_len)
        .map_err(|e| match e {
            // Too long to be worth tokenizing: the same code as a prompt counted too long.
            nibble_engine::Error::PromptTooLong { .. } => {
                ApiError::invalid(param, e.to_string()).with_code("context_length_exceeded")
            }
            e => ApiError::invalid(param, e.to_string()),
        })
}

/// The request's tools as the model sees them: none with `tool_choice: "none"` (OpenAI's "the
/// model will not call a tool": they are left out of the prompt, and no call is parsed).
fn offered_tools(r: &CompletionRequest) -> Option<&Value> {
    let none = r.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
    r.tools.as_ref().filter(|t| t.is_array() && !none)
}

/// Validates `r` for the route `kind` and tokenizes its prompt (CPU work: call off the runtime).
pub fn prepare(r: &CompletionRequest, kind: Kind, m: &ModelInfo) -> Result<Prepared, ApiError> {
    unsupported(r)?;
    let choices = choices(r)?;
    let sampling = sampling(r, m.vocab_size)?;
    let stop = stop_strings(&r.stop)?;
    let mut thinking_open = false;
    let mut chat_text = None;
    if kind == Kind::Chat && r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "suffix",
            "suffix is supported on /v1/completions only",
        ));
    }
    let prompt = match kind {
        Kind::Chat => {
            let text = chat_prompt(r, m)?;
            thinking_open = nibble_engine::grammar::opens_thinking(&text);
            let ids = encode(&text, m)?;
            chat_text = Some(text);
            ids
        }
        Kind::Text => match r.suffix.as_deref().filter(|s| !s.is_empty()) {
            Some(suffix) => fim_prompt(r, suffix, m)?,
            None => text_prompt(r, m)?,
        },
    };
    let echo = match (kind, r.echo) {
        (_, None | Some(false)) => None,
        (Kind::Text, Some(true)) => Some(echo_text(r, &prompt, m)),
        (Kind::Chat, Some(true)) => {
            return Err(ApiError::invalid(
                "echo",
                "echo is supported on /v1/completions only",
            ))
        }
    };
    let prompt_k = prompt_logprobs(r)?;
    // After the prompt: the tools it renders are checked there first.
    let grammar = structured::requested(r, kind, m.tool_xml)?;
    let param = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            param,
            "the prompt is empty: nothing to condition on",
        ));
    }
    let ctx = m.context_len;
    let (max_param, asked) = match (r.max_completion_tokens, r.max_tokens) {
        (Some(v), _) => ("max_completion_tokens", Some(v)),
        (None, v) => ("max_tokens", v),
    };
    // A request that only scores or echoes its prompt may fill the context.
    let prompt_only = asked == Some(0) && (echo.is_some() || prompt_k.is_some());
    if prompt.len() > ctx || (prompt.len() == ctx && !prompt_only) {
        return Err(ApiError::invalid(param, format!("the prompt has {} tokens but the context holds {ctx} and one must be left to generate", prompt.len())).with_code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = match asked {
        None if kind == Kind::Text => COMPLETIONS_DEFAULT_MAX_TOKENS.min(room),
        None => room,
        // Zero only scores or echoes the prompt.
        Some(0) if prompt_only => 0,
        Some(v) if v < 1 => {
            return Err(ApiError::invalid(
                max_param,
                format!("{max_param} = {v} must be at least 1 (0 with echo or prompt_logprobs)"),
            ))
        }
        Some(v) if v as u64 > room as u64 => {
            return Err(ApiError::invalid(max_param, format!("this model's context is {ctx} tokens; the prompt uses {} and {max_param} asks for {v} more ({} at most)", prompt.len(), room)).with_code("context_length_exceeded"));
        }
        Some(v) => v as usize,
    };
    let gen_logprobs = logprobs(r, kind)?;
    let constraint = grammar
        .map(|g| {
            let tok = &m.tokenizer;
            structured::compile(
                &m.grammars,
                tok,
                &m.eos_ids,
                g,
                chat_text.as_deref(),
                m.reasoning,
            )
        })
        .transpose()?;
    Ok(Prepared {
        prompt,
        gen: GenParams {
            max_tokens,
            sampling,
            stop_strings: stop,
            skip_special_tokens: r.skip_special_tokens.unwrap_or(true),
            logprobs: gen_logprobs,
            constraint,
            // Echoed logprobs list the prompt's entries too.
            prompt_logprobs: match (prompt_k, gen_logprobs.filter(|_| echo.is_some())) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0).max(b.unwrap_or(0))),
            },
            ..GenParams::default()
        },
        echo,
        prompt_logprobs: prompt_k,
        choices,
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        tools: kind == Kind::Chat
            && offered_tools(r)
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty()),
        tool_types: offered_tools(r)
            .map(crate::parse::ToolTypes::from_tools)
            .unwrap_or_default(),
        thinking_open,
    })
}

#[cfg(test)]
mod tests {
    use super::tool_calls_are_xml;

    /// Qwen3's own template (the npm package's, where fetched) writes Hermes JSON calls;
    /// Qwen3-Coder's writes `<function=…>` with `<parameter=…>` blocks.
    #[test]
    fn the_tool_call_form_comes_from_the_template() {
        let coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for k, v in \
                     args|items %}{{- '<parameter=' + k + '>\\n' }}";
        assert!(tool_calls_are_xml(coder));
        assert!(!tool_calls_are_xml(
            "<tool_call>\n{\"name\": <function-name>}</tool_call>"
        ));
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../vendor/qwen3-tokenizer");
        if let Ok(cfg) = std::fs::read_to_string(format!("{dir}/tokenizer_config.json")) {
            let v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
            let t = v["chat_template"].as_str().unwrap();
            assert!(
                t.contains("<tool_call>"),
                "the Qwen3 template shows tool calls"
            );
            assert!(!tool_calls_are_xml(t));
        }
    }
}
