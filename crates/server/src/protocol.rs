//! The OpenAI wire format: the request body both completion routes accept, and the JSON of the
//! responses and stream chunks they send.
//!
//! One request struct serves `/v1/chat/completions` (which reads `messages`) and
//! `/v1/completions` (which reads `prompt`). Fields whose JSON type varies (`stop`, `prompt`,
//! message `content`) are kept as raw JSON and checked in [`crate::params`], so a wrong type gets
//! a specific message instead of serde's "did not match any variant". Unknown fields are ignored,
//! as OpenAI-compatible servers do (clients send `user`, `metadata`, ...).

use nibble_engine::TokenLogprob;
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};

/// The body of a completion request (chat or plain).
#[derive(Debug, Default, Deserialize)]
pub struct CompletionRequest {
    /// Echoed back only through our own model id; any value is accepted.
    pub model: Option<String>,
    /// Chat: the conversation.
    pub messages: Option<Vec<ChatMessage>>,
    /// Completions: a string, a list with one string, or a list of token ids.
    pub prompt: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Extension (llama.cpp, vLLM): `<= 0` disables.
    #[serde(default, deserialize_with = "whole")]
    pub top_k: Option<i64>,
    /// Extension (llama.cpp, vLLM).
    pub min_p: Option<f32>,
    /// Extension (vLLM `repetition_penalty`, llama.cpp `repeat_penalty`).
    #[serde(alias = "repeat_penalty")]
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    #[serde(default, deserialize_with = "whole")]
    pub max_tokens: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_completion_tokens: Option<i64>,
    /// A string or a list of strings.
    pub stop: Option<Value>,
    #[serde(default, deserialize_with = "whole")]
    pub seed: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub n: Option<i64>,
    pub chat_template_kwargs: Option<ChatTemplateKwargs>,
    /// Tool schemas, passed to the chat template; `<tool_call>` blocks in the answer are
    /// parsed into `tool_calls` ([`crate::parse`]).
    pub tools: Option<Value>,
    /// Chat: `true` asks for each token's logprob; completions: how many alternatives (0-5).
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token (0-20), with `logprobs: true`.
    #[serde(default, deserialize_with = "whole")]
    pub top_logprobs: Option<i64>,
    /// Completions: the prompt's text goes before the answer's (with `logprobs`, its tokens'
    /// entries too, the first one null), as OpenAI's legacy endpoint and lm-eval-harness use it.
    pub echo: Option<bool>,
    /// vLLM's: each prompt token's logprob with this many alternatives (0-20; `true` is 1), in
    /// `prompt_logprobs` (the choice's for completions, the response's for chat).
    pub prompt_logprobs: Option<Value>,
    /// Completions: unsupported above 1.
    #[serde(default, deserialize_with = "whole")]
    pub best_of: Option<i64>,
    /// Completions: unsupported when non-empty.
    pub suffix: Option<String>,
    /// Token id (a string) -> bias in [-100, 100], added to the logits before sampling.
    pub logit_bias: Option<Value>,
    /// vLLM's switch: `false` keeps special tokens (`<|vision_start|>`, ...) in the text.
    pub skip_special_tokens: Option<bool>,
    /// `{"type": "text"}` (the default), `json_object` or `json_schema` ([`crate::structured`]).
    pub response_format: Option<Value>,
    /// `"auto"` (the model decides), `"none"` (the tools are left out), `"required"` or a named
    /// function (calls forced by a grammar).
    pub tool_choice: Option<Value>,
    /// vLLM's structured outputs: a JSON schema (or its text), a regex, a list of texts, a Lark
    /// grammar.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// llama.cpp's JSON schema field.
    pub json_schema: Option<Value>,
    /// llama.cpp's GBNF grammar: refused by name.
    pub grammar: Option<Value>,
    /// vLLM's continuation of a final assistant message: unsupported when true.
    pub continue_final_message: Option<bool>,
    /// vLLM's switch for the assistant header: unsupported when false.
    pub add_generation_prompt: Option<bool>,
}

/// An integer field: a JSON integer, or a number with no fraction (`2.0`, `1e3`), as the
/// pydantic-based servers (vLLM) accept; `2.5` is an error.
fn whole<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    use serde::de::Error;
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    if let Some(i) = n.as_i64() {
        return Ok(Some(i));
    }
    match n.as_f64() {
        // The bounds keep the cast exact (i64::MAX is not an f64).
        Some(x) if x.fract() == 0.0 && x.abs() < 9.2e18 => Ok(Some(x as i64)),
        _ => Err(D::Error::custom(format!(
            "{n} is not an integer (or is beyond 64 bits)"
        ))),
    }
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send an extra chunk with `choices: []` and the usage, as OpenAI does.
    pub include_usage: Option<bool>,
}

/// `chat_template_kwargs` (vLLM / llama.cpp extension); other keys are ignored.
#[derive(Debug, Default, Deserialize)]
pub struct ChatTemplateKwargs {
    /// Qwen3: `false` renders the empty think block (no reasoning).
    pub enable_thinking: Option<bool>,
}

/// One message of a chat request.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// A string, a list of `{"type": "text", "text"}` parts, or null (assistant with tool calls).
    #[serde(default)]
    pub content: Value,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Value>,
}

/// `usage`, with `prompt_tokens_details.cached_tokens` as OpenAI reports prefix-cache hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    /// This usage and another choice's of the same request: the prompt counted once, the
    /// generated tokens summed.
    pub fn and(self, other: Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.max(other.prompt_tokens),
            completion_tokens: self.completion_tokens + other.completion_tokens,
            cached_tokens: self.cached_tokens.max(other.cached_tokens),
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// A whole answer's parts: the reasoning and tool calls are parsed from a chat answer's text
/// ([`crate::parse`]); otherwise everything is content.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub reasoning: String,
    pub content: String,
    /// (function name, arguments as JSON text).
    pub calls: Vec<(String, String)>,
    /// The choice's `logprobs` object ([`Envelope::logprobs`]), or null.
    pub logprobs: Value,
}

/// Characters of a byte stream fed in pieces: complete UTF-8 characters count as they end, an
/// invalid sequence as the replacement characters lossy decoding gives it, and a character
/// still incomplete at the end of the bytes so far not yet.
#[derive(Debug, Default)]
struct CharCount {
    total: usize,
    pending: Vec<u8>,
}

impl CharCount {
    fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                self.total += s.chars().count();
                self.pending.clear();
            }
            // Incomplete at the end: count the valid part, keep the tail.
            Err(e) if e.error_len().is_none() => {
                let valid = e.valid_up_to();
                self.total += String::from_utf8_lossy(&self.pending[..valid])
                    .chars()
                    .count();
                self.pending.drain(..valid);
            }
            Err(_) => {
                self.total += String::from_utf8_lossy(&self.pending).chars().count();
                self.pending.clear();
            }
        }
    }
}

/// Which route a response belongs to; it fixes the `object` names and the choice shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

/// What every response and chunk of one request shares.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub kind: Kind,
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// Which of the request's choices (`n`) these chunks and responses carry: every choice's
    /// `index`.
    pub choice: usize,
}

impl Envelope {
    fn wrap(&self, object: &str, mut choices: Value) -> Value {
        if let Some(c) = choices.get_mut(0) {
            c["index"] = json!(self.choice);
        }
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// The whole answer of a non-streaming request (a text completion's is `a.content`).
    pub fn response(&self, a: &Answer, finish: &str, usage: Usage) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({"role": "assistant", "content": a.content});
                if !a.reasoning.is_empty() {
                    message["reasoning_content"] = json!(a.reasoning);
                }
                if !a.calls.is_empty() {
                    let calls: Vec<Value> = (a.calls.iter().enumerate())
                        .map(|(i, (name, args))| self.tool_call(i, name, args))
                        .collect();
                    message["tool_calls"] = json!(calls);
                    // OpenAI's shape: no text beside the calls is null content.
                    if a.content.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": a.logprobs,
                    "finish_reason": finish,
                })
            }
            Kind::Text => json!({
                "index": 0, "text": a.content, "logprobs": a.logprobs, "finish_reason": finish,
            }),
        };
        let object = match self.kind {
            Kind::Chat => "chat.completion",
            Kind::Text => "text_completion",
        };
        let mut v = self.wrap(object, json!([choice]));
        v["usage"] = usage.json();
        v
    }

    /// The `logprobs` object of the generated tokens `entries` in this route's shape, tokens
    /// written by `text_of` (their bytes, lossily as text, and whether the answer's text shows
    /// them: a skipped special token adds nothing to `text_offset`). Chat: `{"content": [{token,
    /// logprob, bytes, top_logprobs: [...]}]}`; completions: `{tokens, token_logprobs,
    /// top_logprobs: [{token: logprob}], text_offset}`. -inf is written as -9999.0, as OpenAI
    /// and vLLM write it (JSON has no infinity).
    pub fn logprobs(
        &self,
        entries: &[TokenLogprob],
        text_of: &dyn Fn(u32) -> (Vec<u8>, bool),
    ) -> Value {
        self.logprobs_at(entries, text_of, 0).0
    }

    /// [`Envelope::logprobs`] for entries whose text starts `at` characters into the answer (a
    /// stream's later chunk: completions' `text_offset` counts from the answer's start, as
    /// vLLM's streams do), and the offset after them.
    pub fn logprobs_at(
        &self,
        entries: &[TokenLogprob],
        text_of: &dyn Fn(u32) -> (Vec<u8>, bool),
        at: usize,
    ) -> (Value, usize) {
        let lp = |x: f32| if x.is_finite() { f64::from(x) } else { -9999.0 };
        let token = |id: u32| {
            let (b, _) = text_of(id);
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = (entries.iter())
                    .map(|e| {
                        let (t, b) = token(e.id);
                        let top: Vec<Value> = (e.top.iter())
                            .map(|&(id, x)| {
                                let (t, b) = token(id);
                                json!({"token": t, "logprob": lp(x), "bytes": b})
                            })
                            .collect();
                        json!({"token": t, "logprob": lp(e.logprob), "bytes": b, "top_logprobs": top})
                    })
                    .collect();
                (json!({ "content": content }), at)
            }
            Kind::Text => {
                let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
                let mut offset = at;
                for e in entries {
                    let (b, shown) = text_of(e.id);
                    let t = String::from_utf8_lossy(&b).into_owned();
                    offsets.push(offset);
                    if shown {
                        offset += t.chars().count();
                    }
                    tokens.push(t);
                    lps.push(lp(e.logprob));
                    let mut top: serde_json::Map<String, Value> = (e.top.iter())
                        .map(|&(id, x)| (token(id).0, json!(lp(x))))
                        .collect();
                    // OpenAI and vLLM always list the sampled token too (up to logprobs + 1
                    // entries; logprobs 0 gives just it).
                    if !e.top.iter().any(|&(id, _)| id == e.id) {
                        top.insert(token(e.id).0, json!(lp(e.logprob)));
                    }
                    tops.push(Value::Object(top));
                }
                let v = json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets});
                (v, offset)
            }
        }
    }

    /// A completion's `logprobs` with `echo`: the prompt's tokens first (token `first` with
    /// null entries, then `prompt`'s), then the generated `entries`, whose offsets start after
    /// `echo_chars`, the echoed text's length. A prompt token's offset is the characters of the
    /// prompt's bytes before it (a character split over tokens counts once, where it starts),
    /// at most `echo_chars`, so the offsets never go back. Alternatives are cut to `k`.
    pub fn echoed_logprobs(
        &self,
        first: u32,
        prompt: &[TokenLogprob],
        k: usize,
        (entries, echo_chars): (&[TokenLogprob], usize),
        text_of: &dyn Fn(u32) -> (Vec<u8>, bool),
    ) -> Value {
        let cut: Vec<TokenLogprob> = (prompt.iter())
            .map(|e| TokenLogprob {
                top: e.top.iter().take(k).copied().collect(),
                ..e.clone()
            })
            .collect();
        let literal = |id: u32| (text_of(id).0, true);
        let p = self.logprobs(&cut, &literal);
        let g = self.logprobs(entries, text_of);
        let first_bytes = text_of(first).0;
        let first_text = String::from_utf8_lossy(&first_bytes).into_owned();
        let list = |v: &Value, key: &str| v[key].as_array().cloned().unwrap_or_default();
        let shifted = |v: &Value, by: usize| -> Vec<Value> {
            (list(v, "text_offset").iter())
                .map(|o| json!(o.as_u64().unwrap_or(0) as usize + by))
                .collect()
        };
        let mut chars = CharCount::default();
        chars.push(&first_bytes);
        let mut offsets = vec![json!(0)];
        for e in prompt {
            offsets.push(json!(chars.total.min(echo_chars)));
            chars.push(&text_of(e.id).0);
        }
        let join = |head: Value, key: &str| -> Value {
            let mut all = vec![head];
            all.extend(list(&p, key));
            all.extend(list(&g, key));
            Value::Array(all)
        };
        offsets.extend(shifted(&g, echo_chars));
        json!({
            "tokens": join(json!(first_text), "tokens"),
            "token_logprobs": join(Value::Null, "token_logprobs"),
            "top_logprobs": join(Value::Null, "top_logprobs"),
            "text_offset": offsets,
        })
    }

    /// vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from
    /// token id (as a string) to `{logprob, rank, decoded_token}` holding the prompt's token and
    /// its `k` most likely alternatives.
    pub fn prompt_logprobs(
        prompt: &[TokenLogprob],
        k: usize,
        text_of: &dyn Fn(u32) -> (Vec<u8>, bool),
    ) -> Value {
        let lp = |x: f32| if x.is_finite() { f64::from(x) } else { -9999.0 };
        let item = |id: u32, logprob: f32, rank: u32| {
            let t = String::from_utf8_lossy(&text_of(id).0).into_owned();
            json!({"logprob": lp(logprob), "rank": rank, "decoded_token": t})
        };
        let mut out = vec![Value::Null];
        for e in prompt {
            let mut m = serde_json::Map::new();
            m.insert(e.id.to_string(), item(e.id, e.logprob, e.rank));
            for (r, &(id, x)) in e.top.iter().take(k).enumerate() {
                m.entry(id.to_string())
                    .or_insert_with(|| item(id, x, r as u32 + 1));
            }
            out.push(Value::Object(m));
        }
        Value::Array(out)
    }

    /// Tool call `index` of this answer, as OpenAI writes one (the id is unique per answer).
    pub fn tool_call(&self, index: usize, name: &str, arguments: &str) -> Value {
        json!({
            // Unique within the response: a second choice's calls name their choice too.
            "id": match self.choice {
                0 => format!("call_{}_{index}", self.id.trim_start_matches("chatcmpl-")),
                c => format!("call_{}_{c}_{index}", self.id.trim_start_matches("chatcmpl-")),
            },
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        })
    }

    /// A stream chunk with no text that carries the `logprobs` object.
    pub fn logprobs_chunk(&self, logprobs: Value) -> Value {
        let mut v = self.chunk(Some(""), false, None);
        if self.kind == Kind::Chat {
            v["choices"][0]["delta"] = json!({});
        }
        v["choices"][0]["logprobs"] = logprobs;
        v
    }

    /// A chat stream chunk carrying `delta` (e.g. `{"reasoning_content": …}`, or
    /// `{"tool_calls": [{"index": i, …}]}`).
    pub fn delta_chunk(&self, delta: Value) -> Value {
        let choice = json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null});
        self.wrap(self.chunk_object(), json!([choice]))
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        }
    }

    /// A stream chunk. Chat: `delta` is `{"role": "assistant", "content": ""}` for the first
    /// chunk (`role_first`), `{"content": text}` after, `{}` on the final one.
    pub fn chunk(&self, piece: Option<&str>, role_first: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let delta = match (role_first, piece) {
                    (true, _) => json!({"role": "assistant", "content": ""}),
                    (false, Some(t)) => json!({"content": t}),
                    (false, None) => json!({}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Text => json!({
                "index": 0, "text": piece.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
        };
        self.wrap(self.chunk_object(), json!([choice]))
    }

    /// The final chunk: empty delta, `finish_reason` and `usage` (llama.cpp and vLLM put it
    /// here; null where a usage-only chunk follows).
    pub fn final_chunk(&self, finish: &str, usage: Option<Usage>) -> Value {
        let mut v = self.chunk(None, false, Some(finish));
        v["usage"] = usage.map_or(Value::Null, |u| u.json());
        v
    }

    /// OpenAI's `stream_options.include_usage` chunk: no choices, just the usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.wrap(self.chunk_object(), json!([]));
        v["usage"] = usage.json();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kind: Kind) -> Envelope {
        Envelope {
            kind,
            id: "chatcmpl-7".into(),
            created: 1_700_000_000,
            model: "tiny".into(),
            choice: 0,
        }
    }

    #[test]
    fn chat_chunks_have_the_openai_shape() {
        let e = env(Kind::Chat);
        let first = e.chunk(None, true, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert!(first["choices"][0]["finish_reason"].is_null());
        let piece = e.chunk(Some("hé"), false, None);
        assert_eq!(piece["choices"][0]["delta"], json!({"content": "hé"}));
        let u = Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
            cached_tokens: 2,
        };
        let last = e.final_chunk("length", Some(u));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"]["total_tokens"], 8);
        assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(e.usage_chunk(u)["choices"], json!([]));
    }

    #[test]
    fn logprobs_have_each_routes_shape() {
        let entries = [
            TokenLogprob {
                id: 7,
                rank: 1,
                logprob: -0.25,
                top: vec![(7, -0.25), (9, f32::NEG_INFINITY)],
            },
            TokenLogprob {
                id: 8,
                rank: 2,
                logprob: -1.5,
                top: vec![(3, -0.5), (8, -1.5)],
            },
        ];
        let text_of = |id: u32| {
            let b = if id == 9 {
                vec![0xff]
            } else {
                format!("é{id}").into_bytes()
            };
            (b, true)
        };
        let c = env(Kind::Chat).logprobs(&entries, &text_of);
        let first = &c["content"][0];
        assert_eq!(first["token"], "é7");
        assert_eq!(first["logprob"], -0.25);
        assert_eq!(first["bytes"], json!([0xc3, 0xa9, b'7']));
        assert_eq!(first["top_logprobs"][1]["token"], "\u{fffd}");
        assert_eq!(first["top_logprobs"][1]["bytes"], json!([0xff]));
        // JSON has no -inf: OpenAI's -9999.0.
        assert_eq!(first["top_logprobs"][1]["logprob"], -9999.0);
        assert_eq!(c["content"][1]["top_logprobs"][0]["token"], "é3");
        let t = env(Kind::Text).logprobs(&entries, &text_of);
        assert_eq!(t["tokens"], json!(["é7", "é8"]));
        assert_eq!(t["token_logprobs"], json!([-0.25, -1.5]));
        assert_eq!(t["top_logprobs"][1], json!({"é3": -0.5, "é8": -1.5}));
        // Offsets in characters: "é7" is two.
        assert_eq!(t["text_offset"], json!([0, 2]));
        // A token the text does not show (a skipped special one) moves no offset.
        let hidden = |id: u32| (format!("<{id}>").into_bytes(), id != 7);
        let t = env(Kind::Text).logprobs(&entries, &hidden);
        assert_eq!(t["text_offset"], json!([0, 0]));
        let chunk = env(Kind::Chat).logprobs_chunk(c.clone());
        assert_eq!(chunk["choices"][0]["delta"], json!({}));
        assert_eq!(chunk["choices"][0]["logprobs"], c);
    }

    /// Echoed offsets: a character split over prompt tokens counts once, where it starts, so
    /// the offsets never go back and the generated ones start at the echoed text's end;
    /// the first token's entries are null.
    #[test]
    fn echoed_offsets_never_go_back() {
        // " 🤖x" as the tokens " ", F0 9F, A4 96, "x"; then "y" generated.
        let bytes: [&[u8]; 5] = [b" ", &[0xf0, 0x9f], &[0xa4, 0x96], b"x", b"y"];
        let text_of = |id: u32| (bytes[id as usize].to_vec(), true);
        let entry = |id: u32| TokenLogprob {
            id,
            rank: 1,
            logprob: -0.5,
            top: vec![(id, -0.5), (0, -1.0)],
        };
        let prompt = [entry(1), entry(2), entry(3)];
        let v = env(Kind::Text).echoed_logprobs(0, &prompt, 1, (&[entry(4)], 3), &text_of);
        assert_eq!(v["text_offset"], json!([0, 1, 1, 2, 3]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5, -0.5, -0.5, -0.5]));
        assert!(v["top_logprobs"][0].is_null());
        // Alternatives cut to k = 1 for the prompt's entries.
        assert_eq!(v["top_logprobs"][3], json!({"x": -0.5}));
        assert_eq!(v["tokens"][4], "y");
        let mut c = CharCount::default();
        for b in [&b"a\xff"[..], &[0xe2, 0x82], &[0xac]] {
            c.push(b);
        }
        // "a", one replacement character, then the euro sign once complete.
        assert_eq!(c.total, 3);
    }

    #[test]
    fn text_response_has_text_and_usage() {
        let u = Usage {
            prompt_tokens: 4,
            completion_tokens: 16,
            cached_tokens: 0,
        };
        let a = Answer {
            reasoning: String::new(),
            content: "abc".into(),
            calls: vec![],
            logprobs: Value::Null,
        };
        let r = env(Kind::Text).response(&a, "stop", u);
        assert_eq!(r["object"], "text_completion");
        assert_eq!(r["choices"][0]["text"], "abc");
        assert_eq!(r["usage"]["completion_tokens"], 16);
        let c = env(Kind::Chat).response(&a, "stop", u);
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["choices"][0]["message"]["content"], "abc");
    }
}
