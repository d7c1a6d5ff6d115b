//! Chat templates: render a conversation into a prompt string with the model's own Jinja
//! template (formats-spec §5.5), executed by `minijinja`.
//!
//! The environment mirrors the one Hugging Face `transformers` builds for `apply_chat_template`,
//! because templates are written against it:
//! * `trim_blocks` and `lstrip_blocks` on, trailing newline of the template dropped;
//! * Python string/dict methods (`.startswith`, `.split`, `.rstrip`, `.items()`, ...) through
//!   `minijinja-contrib`'s `pycompat`;
//! * `raise_exception(msg)` turns into an [`Error::Template`];
//! * `tojson` behaves like Python's `json.dumps(x, ensure_ascii=False)`: `", "`/`": "` separators,
//!   no HTML escaping, keys in insertion order (see `pyjson`).
//!
//! Context variables: `messages`, `add_generation_prompt`, `tools` (none when absent), and
//! `enable_thinking` only when given: Qwen's template tests `enable_thinking is defined`, so
//! "not given" and "true" must stay distinguishable.
//!
//! Messages are serialized with absent optional fields left out (not `null`), so
//! `message.reasoning_content is defined` and `message.tool_calls` behave as with Python dicts.

mod pyjson;

use std::collections::BTreeMap;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Name under which the template is stored in the environment.
const TEMPLATE_NAME: &str = "chat_template";

/// One chat message, as passed to the template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// The assistant's reasoning, if kept separately from `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// OpenAI-style tool calls of an assistant message
    /// (`[{"type": "function", "function": {"name", "arguments"}}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
}

impl Message {
    /// A message with the given role and content and no optional fields.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: None,
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// A `tool` (tool result) message.
    pub fn tool(content: impl Into<String>) -> Self {
        Self::new("tool", content)
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn template_error(e: minijinja::Error) -> Error {
    // `{:#}` includes the template line and the chain of causes.
    Error::Template(format!("{e:#}"))
}

/// `raise_exception(msg)`: templates call it to reject a conversation.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` filter with Python `json.dumps` semantics (see [`pyjson`]).
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let options = pyjson::Options {
        indent: kwargs.get::<Option<usize>>("indent")?,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    if value.is_undefined() {
        // Python's json.dumps fails on Jinja2's Undefined too.
        return Err(minijinja::Error::new(
            ErrorKind::UndefinedError,
            "tojson: value is undefined",
        ));
    }
    let json = serde_json::to_value(value).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON")
            .with_source(e)
    })?;
    Ok(Value::from(pyjson::dumps(&json, &options)))
}

/// Instructions a template may run per render (minijinja's fuel).
pub const TEMPLATE_FUEL: u64 = 20_000_000;

impl ChatTemplate {
    /// Compiles a template; syntax errors are reported here.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // A template comes with the model file: one that loops without end (or for 10^8
        // steps) must fail, not hang a request. Qwen3's renders a 1000-message conversation
        // with tools within a hundredth of it (chat_golden.rs; it rendered under 200,000).
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(template_error)?;
        Ok(Self { env })
    }

    /// Renders the conversation. `enable_thinking: None` leaves the variable undefined (Qwen3:
    /// thinking on); `tools` is a JSON array of tool schemas.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        // transformers refuses empty conversations before rendering; so do we.
        if messages.is_empty() {
            return Err(Error::Template(
                "cannot render an empty conversation".into(),
            ));
        }
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        ctx.insert(
            "tools",
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        if let Some(flag) = enable_thinking {
            ctx.insert("enable_thinking", Value::from(flag));
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        template.render(ctx).map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_that_runs_too_long_is_an_error() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        )
        .unwrap();
        let err = t
            .render(&[Message::user("u")], false, None, None)
            .unwrap_err();
        assert!(err.to_string().contains("fuel"), "{err}");
    }

    #[test]
    fn syntax_error_is_reported_at_construction() {
        let err = ChatTemplate::new("{% for m in messages %}").unwrap_err();
        assert!(matches!(err, Error::Template(_)), "{err:?}");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
        )
        .unwrap();
        let err = t
            .render(&[Message::system("s")], false, None, None)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
        assert_eq!(
            t.render(&[Message::user("u")], false, None, None).unwrap(),
            "ok"
        );
    }

    #[test]
    fn python_string_methods_and_whitespace_control() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {{ m.content.split('|')[-1].lstrip('\\n') }}\n{% endfor %}\n",
        )
        .unwrap();
        let out = t
            .render(
                &[Message::user("a|\n\nb"), Message::user("c")],
                false,
                None,
                None,
            )
            .unwrap();
        // trim_blocks eats the newline after each block tag, lstrip_blocks the indentation before.
        assert_eq!(out, "  b\n  c\n");
    }

    #[test]
    fn enable_thinking_is_undefined_unless_given() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is defined %}{{ enable_thinking }}{% else %}undef{% endif %}",
        )
        .unwrap();
        let m = [Message::user("u")];
        assert_eq!(t.render(&m, true, None, None).unwrap(), "undef");
        // Booleans print Python-style, as in Jinja2.
        assert_eq!(t.render(&m, true, Some(false), None).unwrap(), "False");
        assert_eq!(t.render(&m, true, Some(true), None).unwrap(), "True");
    }

    #[test]
    fn optional_message_fields_are_undefined_when_absent() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.reasoning_content is defined }},{{ m.tool_calls is defined }};{% endfor %}",
        )
        .unwrap();
        let mut with = Message::assistant("x");
        with.reasoning_content = Some("r".into());
        with.tool_calls = Some(serde_json::json!([]));
        let out = t
            .render(&[Message::user("u"), with], false, None, None)
            .unwrap();
        assert_eq!(out, "False,False;True,True;");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t =
            ChatTemplate::new("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}").unwrap();
        let tools = serde_json::json!([{"z": 1, "a": [true, null, 2.5], "s": "<é\"\n>"}]);
        let out = t
            .render(&[Message::user("u")], false, None, Some(&tools))
            .unwrap();
        assert_eq!(
            out,
            "{\"z\": 1, \"a\": [true, null, 2.5], \"s\": \"<é\\\"\\n>\"}|{\n  \"z\": 1,\n  \"a\": [\n    true,\n    null,\n    2.5\n  ],\n  \"s\": \"<é\\\"\\n>\"\n}"
        );
    }

    #[test]
    fn tojson_of_undefined_and_empty_conversation_are_errors() {
        let t = ChatTemplate::new("{{ messages[0].nope | tojson }}").unwrap();
        assert!(t.render(&[Message::user("u")], false, None, None).is_err());
        assert!(t.render(&[], false, None, None).is_err());
    }

    #[test]
    fn undefined_method_on_value_is_an_error() {
        let t = ChatTemplate::new("{{ messages[0].content.no_such_method() }}").unwrap();
        assert!(t.render(&[Message::user("x")], false, None, None).is_err());
    }
}
