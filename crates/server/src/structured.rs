//! Structured outputs: the grammar a request's answer must follow, if any, and its compiled
//! form (engine `grammar`: the logits are masked each step, on the host).
//!
//! Sources, at most one per request:
//! - OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
//! - OpenAI's forced tool calls (chat): `tool_choice: "required"` (one or more calls of the
//!   offered tools) or `{"type": "function", "function": {"name"}}` (exactly one call of that
//!   tool), written in Qwen3's Hermes form so the answer parser turns them into `tool_calls`;
//! - vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark, as vLLM's
//!   guidance backend reads it) and llama.cpp's `json_schema`.
//!
//! llama.cpp's `grammar` (GBNF) is refused by name. A chat answer of a thinking model may
//! reason first, unconstrained, where the server parses reasoning out (`--reasoning-format
//! auto`, vLLM's behaviour with a reasoning parser); a Lark grammar constrains the whole answer.

use std::sync::OnceLock;

use nibble_engine::grammar::{GrammarCompiler, GrammarSpec};
use nibble_engine::{Constraint, Tokenizer};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::protocol::{CompletionRequest, Kind};

/// The compiler for the model's tokenizer, built on the first constrained request (about half a
/// second: it indexes the whole vocabulary).
#[derive(Default)]
pub struct Grammars(OnceLock<Result<GrammarCompiler, String>>);

impl Grammars {
    fn get(&self, tok: &Tokenizer, eos: &[u32]) -> Result<&GrammarCompiler, ApiError> {
        self.0
            .get_or_init(|| GrammarCompiler::new(tok, eos).map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| ApiError::internal(format!("constrained decoding is unavailable: {e}")))
    }
}

/// The grammar `r` asks for, with the request field that asked (for errors), or `None`. `xml`:
/// forced tool calls take Qwen3-Coder's form (the model's template writes it).
pub fn requested(
    r: &CompletionRequest,
    kind: Kind,
    xml: bool,
) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    if r.grammar.as_ref().is_some_and(|g| !g.is_null()) {
        return Err(ApiError::invalid(
            "grammar",
            "GBNF grammars are not supported: send a Lark grammar as guided_grammar, or a JSON schema",
        ));
    }
    let mut found = Vec::new();
    if let Some(s) = response_format(r.response_format.as_ref())? {
        found.push((s, "response_format"));
    }
    if let Some(s) = forced_tools(r, kind, xml)? {
        found.push((s, "tool_choice"));
    }
    for (name, v) in [
        ("guided_json", &r.guided_json),
        ("json_schema", &r.json_schema),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
            found.push((GrammarSpec::JsonSchema(schema_value(name, v)?), name));
        }
    }
    if let Some(v) = r.guided_regex.as_ref().filter(|v| !v.is_null()) {
        let rx = v
            .as_str()
            .ok_or_else(|| ApiError::invalid("guided_regex", "guided_regex must be a string"))?;
        found.push((GrammarSpec::Regex(rx.to_owned()), "guided_regex"));
    }
    if let Some(v) = r.guided_choice.as_ref().filter(|v| !v.is_null()) {
        let texts: Option<Vec<String>> = v.as_array().and_then(|a| {
            a.iter()
                .map(|t| t.as_str().filter(|t| !t.is_empty()).map(str::to_owned))
                .collect()
        });
        match texts {
            Some(t) if !t.is_empty() => found.push((GrammarSpec::Choice(t), "guided_choice")),
            _ => {
                return Err(ApiError::invalid(
                    "guided_choice",
                    "guided_choice must be a non-empty list of non-empty strings",
                ))
            }
        }
    }
    if let Some(v) = r.guided_grammar.as_ref().filter(|v| !v.is_null()) {
        let g = v.as_str().ok_or_else(|| {
            ApiError::invalid(
                "guided_grammar",
                "guided_grammar must be a string (a Lark grammar)",
            )
        })?;
        found.push((GrammarSpec::Lark(g.to_owned()), "guided_grammar"));
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(
            found[1].1,
            format!(
                "{} and {} both constrain the answer: give one",
                found[0].1, found[1].1
            ),
        )),
    }
}

/// A schema given as JSON or as JSON text (vLLM accepts both for `guided_json`).
fn schema_value(param: &str, v: &Value) -> Result<Value, ApiError> {
    let v = match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::invalid(param, format!("{param} is not a JSON schema: {e}")))?,
        v => v.clone(),
    };
    if v.is_object() || v.is_boolean() {
        Ok(v)
    } else {
        Err(ApiError::invalid(
            param,
            format!("{param} must be a JSON schema (an object)"),
        ))
    }
}

/// OpenAI's `response_format`.
fn response_format(f: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(f) = f.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let bad = |msg: &str| ApiError::invalid("response_format", msg.to_owned());
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let js = f
                .get("json_schema")
                .filter(|j| j.is_object())
                .ok_or_else(|| {
                    bad("response_format json_schema needs a \"json_schema\" object with the schema")
                })?;
            let schema = js
                .get("schema")
                .ok_or_else(|| bad("response_format.json_schema needs its \"schema\""))?;
            Ok(Some(GrammarSpec::JsonSchema(schema_value(
                "response_format",
                schema,
            )?)))
        }
        _ => Err(bad(
            "response_format type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// `tool_choice` that forces calls: `"required"` or a named function (chat only), in
/// Qwen3-Coder's form where `xml`.
fn forced_tools(
    r: &CompletionRequest,
    kind: Kind,
    xml: bool,
) -> Result<Option<GrammarSpec>, ApiError> {
    let bad = |msg: String| ApiError::invalid("tool_choice", msg);
    let named = match r.tool_choice.as_ref() {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(c)) if c == "auto" || c == "none" => return Ok(None),
        Some(Value::String(c)) if c == "required" => None,
        Some(v @ Value::Object(_)) => {
            let name = (v.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| v.pointer("/function/name").and_then(Value::as_str))
                .flatten()
                .ok_or_else(|| {
                    bad("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}".into())
                })?;
            Some(name)
        }
        Some(v) => {
            return Err(bad(format!(
                "tool_choice {v} is not one of \"none\", \"auto\", \"required\" or a named function"
            )))
        }
    };
    if kind != Kind::Chat {
        return Err(bad(
            "tool_choice forces tool calls in chat completions only".into(),
        ));
    }
    let tools: Vec<&Value> = r
        .tools
        .as_ref()
        .and_then(Value::as_array)
        .map(|t| t.iter().collect())
        .unwrap_or_default();
    let fname = |t: &Value| {
        t.pointer("/function/name")
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let chosen: Vec<&Value> = match named {
        None => tools,
        Some(n) => tools
            .into_iter()
            .filter(|t| fname(t).as_deref() == Some(n))
            .take(1)
            .collect(),
    };
    if chosen.is_empty() {
        return Err(bad(match named {
            None => "tool_choice \"required\" needs tools".into(),
            Some(n) => format!("tool_choice names {n:?}, which is not among the tools"),
        }));
    }
    let tools = chosen
        .iter()
        .map(|t| {
            let params = t
                .pointer("/function/parameters")
                .filter(|p| !p.is_null())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            (fname(t).unwrap_or_default(), params)
        })
        .collect();
    Ok(Some(GrammarSpec::ToolCalls {
        tools,
        one: named.is_some(),
        xml,
    }))
}

/// Compiles `spec` for the answer to `prompt_text` (a rendered chat prompt; `None` for a
/// completion): a chat answer may reason first where the server parses reasoning out.
pub fn compile(
    grammars: &Grammars,
    tok: &Tokenizer,
    eos: &[u32],
    (spec, param): (GrammarSpec, &'static str),
    prompt_text: Option<&str>,
    reasoning: bool,
) -> Result<Constraint, ApiError> {
    let think = spec.think_after(prompt_text.filter(|_| reasoning));
    let gbnf = matches!(&spec, GrammarSpec::Lark(g) if g.contains("::="));
    let c = grammars.get(tok, eos)?;
    spec.compile(c, think).map_err(|e| {
        let hint = if gbnf {
            " (this looks like GBNF; guided_grammar is read as Lark)"
        } else {
            ""
        };
        ApiError::invalid(param, format!("{param}: {e:#}{hint}"))
    })
}
