//! JSON text exactly as Python's `json.dumps` writes it, for the `tojson` template filter.
//!
//! `transformers` replaces Jinja's `tojson` with `json.dumps(x, ensure_ascii=False, indent=...,
//! sort_keys=False)`. That differs from `serde_json`'s compact output in the separators (`", "`
//! and `": "` without indent, `","` and `": "` with it) and from minijinja's built-in filter in
//! that `<`, `>`, `&`, `'` are not HTML-escaped. String escaping is the same as `serde_json`'s
//! (`\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control characters as lowercase `\u00XX`).
//! Known gap: floats use Rust's shortest round-trip form, so an exponent is written `1e20`
//! where Python writes `1e+20`; ordinary decimals (`2.5`, `0.1`) agree.

use serde_json::Value;

/// The `json.dumps` keyword arguments that templates use.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// `indent=N`: pretty-print with N spaces per level.
    pub indent: Option<usize>,
    /// `ensure_ascii=True`: escape every non-ASCII character as `\uXXXX` (surrogate pairs).
    pub ensure_ascii: bool,
    /// `sort_keys=True`: object keys in sorted order instead of insertion order.
    pub sort_keys: bool,
}

/// Serialises `value` the way Python's `json.dumps` would.
pub(crate) fn dumps(value: &Value, options: &Options) -> String {
    let mut out = String::new();
    write_value(value, options, 0, &mut out);
    out
}

fn newline_indent(options: &Options, level: usize, out: &mut String) {
    if let Some(width) = options.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', width * level));
    }
}

fn item_separator(options: &Options) -> &'static str {
    if options.indent.is_some() {
        ","
    } else {
        ", "
    }
}

fn write_value(value: &Value, options: &Options, level: usize, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(s, options.ensure_ascii, out),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator(options));
                }
                newline_indent(options, level + 1, out);
                write_value(item, options, level + 1, out);
            }
            newline_indent(options, level, out);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator(options));
                }
                newline_indent(options, level + 1, out);
                write_string(key, options.ensure_ascii, out);
                out.push_str(": ");
                write_value(item, options, level + 1, out);
            }
            newline_indent(options, level, out);
            out.push('}');
        }
    }
}

fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn compact_form_uses_python_separators() {
        let v = json!({"b": [1, "x"], "a": {}, "c": []});
        assert_eq!(
            dumps(&v, &Options::default()),
            r#"{"b": [1, "x"], "a": {}, "c": []}"#
        );
    }

    #[test]
    fn sort_keys_and_ensure_ascii() {
        let v = json!({"b": "é😀", "a": "\u{1}"});
        let opts = Options {
            indent: None,
            ensure_ascii: true,
            sort_keys: true,
        };
        assert_eq!(
            dumps(&v, &opts),
            r#"{"a": "\u0001", "b": "\u00e9\ud83d\ude00"}"#
        );
    }

    #[test]
    fn indent_nests() {
        let v = json!({"a": [1, {"b": null}]});
        let opts = Options {
            indent: Some(1),
            ..Options::default()
        };
        assert_eq!(
            dumps(&v, &opts),
            "{\n \"a\": [\n  1,\n  {\n   \"b\": null\n  }\n ]\n}"
        );
    }
}
