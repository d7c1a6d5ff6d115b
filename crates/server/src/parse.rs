//! The chat answer's structure, parsed from its text as it streams: Qwen3's thinking
//! (`<think>…</think>` at the start of the answer) becomes `reasoning_content`, and, when the
//! request offers tools, each `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (the Hermes
//! form Qwen3's template asks for) becomes an OpenAI tool call, as llama.cpp's server does by
//! default and vLLM's with `--reasoning-parser qwen3 --tool-call-parser hermes`.
//!
//! [`ChatParser::push`] takes the text in any pieces and returns what is settled; text that may
//! still be the start of a tag is held back until the next piece or [`ChatParser::finish`].
//! A thinking block may also open in the prompt (Qwen3 Thinking-2507 templates end it with
//! `<think>\n`: [`ChatParser::thinking_open`]), so the answer starts inside it. The content is
//! kept as generated, but for the ASCII whitespace after `</think>` and after each parsed call,
//! as llama.cpp trims it. A call is the JSON value after `<tool_call>` followed by
//! `</tool_call>` (so the closing tag may appear inside an argument string); one whose value is
//! not an object with a non-empty string `name` (and object or string `arguments`) stays
//! content, tags included, and so does an unclosed one; an unclosed thinking block stays
//! reasoning. Until a call's JSON is complete, the text after `<tool_call>` is held back.
//!
//! Qwen3-Coder models (same architecture, their own template) write a call's body as XML
//! instead: `<function=NAME>` then `<parameter=KEY>\nVALUE\n</parameter>` for each argument,
//! `</function>` (vLLM's `qwen3_coder` tool parser, llama.cpp's Qwen3-Coder format). Its values
//! are text: each is typed by the offered function's JSON schema ([`ToolTypes`]: integers,
//! numbers, booleans, objects and arrays parsed, strings kept; an argument the schema does not
//! describe stays a string, as vLLM keeps it). The body is held until `</tool_call>`; a missing
//! `</parameter>` or `</function>` ends at the next tag, as vLLM's parser reads it.

use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";
/// Qwen3-Coder's XML call body.
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// The JSON-schema `type` of each offered function's parameters (function name -> parameter ->
/// type), for typing the text values of Qwen3-Coder's XML calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolTypes(HashMap<String, HashMap<String, String>>);

impl ToolTypes {
    /// From a request's `tools` (`[{"type": "function", "function": {"name", "parameters"}}]`);
    /// a `type` list (`["integer", "null"]`) gives its first non-null entry.
    pub fn from_tools(tools: &Value) -> Self {
        let mut out = HashMap::new();
        for t in tools.as_array().into_iter().flatten() {
            let f = &t["function"];
            let Some(name) = f["name"].as_str() else {
                continue;
            };
            let params = f["parameters"]["properties"].as_object().map(|props| {
                props
                    .iter()
                    .filter_map(|(k, schema)| {
                        let ty = match &schema["type"] {
                            Value::String(s) => Some(s.as_str()),
                            Value::Array(a) => {
                                a.iter().filter_map(Value::as_str).find(|s| *s != "null")
                            }
                            _ => None,
                        }?;
                        Some((k.clone(), ty.to_ascii_lowercase()))
                    })
                    .collect()
            });
            out.insert(name.to_owned(), params.unwrap_or_default());
        }
        ToolTypes(out)
    }

    fn of(&self, function: &str, param: &str) -> Option<&str> {
        self.0.get(function)?.get(param).map(String::as_str)
    }
}

/// A Qwen3-Coder argument's text as the JSON value its schema type says (vLLM's conversions);
/// text that does not read as that type stays a string.
fn typed(text: &str, ty: Option<&str>) -> Value {
    let string = || Value::String(text.to_owned());
    let Some(ty) = ty else {
        return string();
    };
    if matches!(ty, "string" | "str" | "text" | "varchar" | "char" | "enum") {
        return string();
    }
    let t = text.trim();
    if t.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    let parsed = if ty.starts_with("int") || ty.starts_with("uint") || ty == "long" {
        t.parse::<i64>().ok().map(Value::from)
    } else if matches!(ty, "number" | "float" | "double" | "num") {
        // An integer stays one (`1`, not `1.0`), as vLLM gives it.
        t.parse::<i64>().ok().map(Value::from).or_else(|| {
            t.parse::<f64>()
                .ok()
                .and_then(serde_json::Number::from_f64)
                .map(Value::Number)
        })
    } else if matches!(ty, "boolean" | "bool") {
        match t.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        }
    } else {
        // object, array, or a type named otherwise: its JSON if it is JSON.
        serde_json::from_str(t).ok()
    };
    parsed.unwrap_or_else(string)
}

/// The first of `tags` in `s`: (its offset, its length); `s.len()` and 0 if none occurs.
fn first_of(s: &str, tags: &[&str]) -> (usize, usize) {
    tags.iter()
        .filter_map(|t| s.find(t).map(|at| (at, t.len())))
        .min()
        .unwrap_or((s.len(), 0))
}

/// A Qwen3-Coder call body (the text between `<tool_call>` and `</tool_call>`), or `None`
/// where it is not one.
fn xml_call(body: &str, types: &ToolTypes) -> Option<Part> {
    let rest = body.trim_matches(ws).strip_prefix(FUNCTION)?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim_matches(ws);
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut args = serde_json::Map::new();
    loop {
        rest = rest.trim_start_matches(ws);
        if rest.is_empty() {
            break;
        }
        if let Some(after) = rest.strip_prefix(FUNCTION_END) {
            if !after.trim_matches(ws).is_empty() {
                return None;
            }
            break;
        }
        let (key, after) = rest.strip_prefix(PARAMETER)?.split_once('>')?;
        let key = key.trim_matches(ws);
        if key.is_empty() || key.contains('<') {
            return None;
        }
        let (end, tag) = first_of(after, &[PARAMETER_END, PARAMETER, FUNCTION_END]);
        let raw = &after[..end];
        // The line breaks around a value are the format's.
        let raw = (raw.strip_prefix("\r\n").or_else(|| raw.strip_prefix('\n'))).unwrap_or(raw);
        let raw = (raw.strip_suffix("\r\n").or_else(|| raw.strip_suffix('\n'))).unwrap_or(raw);
        args.insert(key.to_owned(), typed(raw, types.of(name, key)));
        rest = if after[end..].starts_with(PARAMETER_END) {
            &after[end + tag..]
        } else {
            &after[end..]
        };
    }
    Some(Part::ToolCall {
        name: name.to_owned(),
        arguments: Value::Object(args).to_string(),
    })
}

/// A settled part of the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Reasoning(String),
    Content(String),
    /// A tool call: the function's name and its arguments as JSON text.
    ToolCall {
        name: String,
        arguments: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the answer's first text: it may open a thinking block.
    Start,
    Reasoning,
    Content,
    /// Inside `<tool_call>`, collecting the body.
    Call,
}

/// Splits an answer into reasoning, content and tool calls as its text arrives.
#[derive(Debug)]
pub struct ChatParser {
    state: State,
    /// Text not settled yet.
    held: String,
    /// Parse tool calls (the request offered tools).
    tools: bool,
    /// Parse the thinking block.
    reasoning: bool,
    /// Drop whitespace at the start of the next reasoning or content text.
    trim_start: bool,
    /// The offered functions' parameter types (Qwen3-Coder's XML calls).
    types: Arc<ToolTypes>,
}

/// Whitespace as llama.cpp trims it (ASCII only: U+3000 and U+00A0 are text).
fn ws(c: char) -> bool {
    c.is_ascii_whitespace()
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag` (text that the
/// next piece may turn into the tag).
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// What the text held after `<tool_call>` amounts to so far.
enum CallScan {
    /// More text is needed to tell.
    Open,
    /// A call (or, when its value is no call, its text as content) and the bytes it takes,
    /// closing tag included.
    Done(Part, usize),
}

/// Reads `held` (starting with `<tool_call>`): the JSON value, then `</tool_call>`; or
/// Qwen3-Coder's XML body up to `</tool_call>`.
fn scan_call(held: &str, types: &ToolTypes) -> CallScan {
    let body = &held[CALL.len()..];
    let value = body.trim_start_matches(ws);
    if value.starts_with(FUNCTION) {
        return match held.find(CALL_END) {
            Some(at) => {
                let used = at + CALL_END.len();
                let part = xml_call(&held[CALL.len()..at], types)
                    .unwrap_or_else(|| Part::Content(held[..used].to_owned()));
                CallScan::Done(part, used)
            }
            None => CallScan::Open,
        };
    }
    if !value.is_empty() && FUNCTION.starts_with(value) {
        return CallScan::Open;
    }
    let mut it = serde_json::Deserializer::from_str(value).into_iter::<Value>();
    let parsed = match it.next() {
        None => return CallScan::Open,
        Some(Err(e)) if e.is_eof() => return CallScan::Open,
        Some(r) => r.ok().map(|v| (v, it.byte_offset())),
    };
    if let Some((v, off)) = parsed {
        let rest = &value[off..];
        let after = rest.trim_start_matches(ws);
        if let Some(tail) = after.strip_prefix(CALL_END) {
            let used = held.len() - tail.len();
            let part = tool_call(&v).unwrap_or_else(|| Part::Content(held[..used].to_owned()));
            return CallScan::Done(part, used);
        }
        if CALL_END.starts_with(after) {
            return CallScan::Open;
        }
    }
    // Not JSON, or JSON followed by something else: text up to the first closing tag.
    match held.find(CALL_END) {
        Some(at) => {
            let used = at + CALL_END.len();
            CallScan::Done(Part::Content(held[..used].to_owned()), used)
        }
        None => CallScan::Open,
    }
}

impl ChatParser {
    pub fn new(reasoning: bool, tools: bool) -> Self {
        ChatParser {
            state: if reasoning {
                State::Start
            } else {
                State::Content
            },
            held: String::new(),
            tools,
            reasoning,
            trim_start: false,
            types: Arc::default(),
        }
    }

    /// The prompt opened the thinking block (it ends with `<think>`): the answer starts as
    /// reasoning. No effect unless reasoning is parsed.
    pub fn thinking_open(mut self) -> Self {
        if self.reasoning {
            self.state = State::Reasoning;
            self.trim_start = true;
        }
        self
    }

    /// Whether the parser changes anything: without either switch the text is the content.
    pub fn active(&self) -> bool {
        self.tools || self.reasoning
    }

    /// Feeds the next piece of the answer; returns the parts it settles, in order.
    pub fn push(&mut self, piece: &str) -> Vec<Part> {
        self.held.push_str(piece);
        let mut out = Vec::new();
        loop {
            if self.trim_start {
                let t = self.held.trim_start_matches(ws);
                if t.is_empty() {
                    self.held.clear();
                    return out;
                }
                self.held = t.to_owned();
                self.trim_start = false;
            }
            match self.state {
                State::Start => {
                    // Whitespace before the block is dropped with it.
                    let t = self.held.trim_start_matches(ws);
                    if let Some(rest) = t.strip_prefix(THINK) {
                        self.held = rest.to_owned();
                        self.state = State::Reasoning;
                        self.trim_start = true;
                    } else if THINK.starts_with(t) {
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.held.find(THINK_END) {
                    Some(at) => {
                        let text = self.held[..at].trim_end_matches(ws).to_owned();
                        self.held.drain(..at + THINK_END.len());
                        emit(&mut out, Part::Reasoning(text));
                        self.state = State::Content;
                        self.trim_start = true;
                    }
                    None => {
                        // Trailing whitespace waits too: the block's end trims it.
                        let keep = partial_tag(&self.held, THINK_END);
                        let end = self.held[..self.held.len() - keep]
                            .trim_end_matches(ws)
                            .len();
                        let text: String = self.held.drain(..end).collect();
                        emit(&mut out, Part::Reasoning(text));
                        return out;
                    }
                },
                State::Content => {
                    let found = self.tools.then(|| self.held.find(CALL)).flatten();
                    match found {
                        Some(at) => {
                            let text: String = self.held.drain(..at).collect();
                            emit(&mut out, Part::Content(text));
                            self.state = State::Call;
                        }
                        None => {
                            let keep = if self.tools {
                                partial_tag(&self.held, CALL)
                            } else {
                                0
                            };
                            let end = self.held.len() - keep;
                            let text: String = self.held.drain(..end).collect();
                            emit(&mut out, Part::Content(text));
                            return out;
                        }
                    }
                }
                State::Call => match scan_call(&self.held, &self.types) {
                    CallScan::Open => return out,
                    CallScan::Done(part, used) => {
                        self.held.drain(..used);
                        // The whitespace after a call separates it; after text, it is text.
                        self.trim_start = matches!(part, Part::ToolCall { .. });
                        out.push(part);
                        self.state = State::Content;
                    }
                },
            }
        }
    }

    /// Ends the answer: whatever is held is settled as its state says (an unclosed tool call
    /// is content, an unclosed thinking block reasoning).
    pub fn finish(&mut self) -> Vec<Part> {
        let text = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Reasoning => emit(
                &mut out,
                Part::Reasoning(text.trim_end_matches(ws).to_owned()),
            ),
            State::Start | State::Content | State::Call => emit(&mut out, Part::Content(text)),
        }
        out
    }
}

/// Pushes a text part unless it is empty.
fn emit(out: &mut Vec<Part>, part: Part) {
    match &part {
        Part::Reasoning(t) | Part::Content(t) if t.is_empty() => {}
        _ => out.push(part),
    }
}

/// `{"name": "...", "arguments": {...}}` as a tool call: a non-empty name, and arguments that
/// are an object (a string is taken as the JSON text it holds; none is `{}`).
fn tool_call(v: &Value) -> Option<Part> {
    let name = v
        .get("name")?
        .as_str()
        .filter(|n| !n.is_empty())?
        .to_owned();
    let arguments = match v.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(Part::ToolCall { name, arguments })
}

/// What a chat answer is parsed for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParseCfg {
    /// A leading thinking block is reasoning (`--reasoning-format auto`).
    pub reasoning: bool,
    /// The request offered tools: calls are parsed.
    pub tools: bool,
    /// The prompt ended inside a thinking block.
    pub thinking_open: bool,
    /// The offered functions' parameter types, for Qwen3-Coder's XML calls.
    pub types: Arc<ToolTypes>,
}

impl ParseCfg {
    /// A parser for one answer.
    pub fn parser(&self) -> ChatParser {
        let mut p = ChatParser::new(self.reasoning, self.tools);
        p.types = Arc::clone(&self.types);
        if self.thinking_open {
            p.thinking_open()
        } else {
            p
        }
    }
}

/// The parts of a whole answer, merged: (reasoning, content, tool calls).
pub fn parse_whole(text: &str, cfg: &ParseCfg) -> (String, String, Vec<(String, String)>) {
    let mut p = cfg.parser();
    let mut parts = p.push(text);
    parts.extend(p.finish());
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
    for part in parts {
        match part {
            Part::Reasoning(t) => r.push_str(&t),
            Part::Content(t) => c.push_str(&t),
            Part::ToolCall { name, arguments } => calls.push((name, arguments)),
        }
    }
    (r, c, calls)
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
