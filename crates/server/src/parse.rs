//! The chat answer's structure, parsed from its text as it streams: Qwen3's thinking
//! (`<think>…</think>` at the start of the answer) becomes `reasoning_content`, and, when the
//! request offers tools, each `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (the Hermes
//! form Qwen3's template asks for) becomes an OpenAI tool call, as llama.cpp's server does by
//! default and vLLM's with `--reasoning-parser qwen3 --tool-call-parser hermes`.
//!
//! [`ChatParser::push`] takes the text in any pieces and returns what is settled; text that may
//! still be the start of a tag is held back until the next piece or [`ChatParser::finish`].
//! Whitespace around the thinking and the tool calls is dropped, as those servers trim it. A
//! tool call whose body is not a JSON object with a string `name` stays content, tags included;
//! so does an unclosed one, and an unclosed thinking block stays reasoning.

use serde_json::Value;

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

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
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag` (text that the
/// next piece may turn into the tag).
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
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
        }
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
                let t = self.held.trim_start();
                if t.is_empty() {
                    self.held.clear();
                    return out;
                }
                self.held = t.to_owned();
                self.trim_start = false;
            }
            match self.state {
                State::Start => {
                    if let Some(rest) = self.held.strip_prefix(THINK) {
                        self.held = rest.to_owned();
                        self.state = State::Reasoning;
                        self.trim_start = true;
                    } else if THINK.starts_with(self.held.as_str()) {
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.held.find(THINK_END) {
                    Some(at) => {
                        let text = self.held[..at].trim_end().to_owned();
                        self.held.drain(..at + THINK_END.len());
                        emit(&mut out, Part::Reasoning(text));
                        self.state = State::Content;
                        self.trim_start = true;
                    }
                    None => {
                        // Trailing whitespace waits too: the block's end trims it.
                        let keep = partial_tag(&self.held, THINK_END);
                        let end = self.held[..self.held.len() - keep].trim_end().len();
                        let text: String = self.held.drain(..end).collect();
                        emit(&mut out, Part::Reasoning(text));
                        return out;
                    }
                },
                State::Content => {
                    let found = self.tools.then(|| self.held.find(CALL)).flatten();
                    match found {
                        Some(at) => {
                            let text = self.held[..at].trim_end().to_owned();
                            self.held.drain(..at);
                            emit(&mut out, Part::Content(text));
                            self.state = State::Call;
                        }
                        None => {
                            let keep = if self.tools {
                                let keep = partial_tag(&self.held, CALL);
                                // Whitespace before a possible call waits: a call trims it.
                                self.held.len()
                                    - self.held[..self.held.len() - keep].trim_end().len()
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
                State::Call => match self.held.find(CALL_END) {
                    Some(at) => {
                        let body = &self.held[CALL.len()..at];
                        let part = tool_call(body).unwrap_or_else(|| {
                            Part::Content(self.held[..at + CALL_END.len()].to_owned())
                        });
                        self.held.drain(..at + CALL_END.len());
                        out.push(part);
                        self.state = State::Content;
                        self.trim_start = true;
                    }
                    None => return out,
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
            State::Reasoning => emit(&mut out, Part::Reasoning(text.trim_end().to_owned())),
            State::Start | State::Content | State::Call => {
                let text = if self.state == State::Content {
                    text.trim_end().to_owned()
                } else {
                    text
                };
                emit(&mut out, Part::Content(text))
            }
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

/// `{"name": "...", "arguments": {...}}` (arguments may also be a JSON string) as a tool call.
fn tool_call(body: &str) -> Option<Part> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = match v.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(Part::ToolCall { name, arguments })
}

/// The parts of a whole answer, merged: (reasoning, content, tool calls).
pub fn parse_whole(
    text: &str,
    reasoning: bool,
    tools: bool,
) -> (String, String, Vec<(String, String)>) {
    let mut p = ChatParser::new(reasoning, tools);
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
