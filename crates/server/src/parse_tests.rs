//! Unit tests of the chat answer parser: whole answers, and the same answers cut into every
//! split of pieces (streamed output must settle into the same parts).

use super::*;

const ANSWER: &str = "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";

fn cfg(reasoning: bool, tools: bool) -> ParseCfg {
    ParseCfg {
        reasoning,
        tools,
        thinking_open: false,
        types: Arc::default(),
    }
}

/// Feeds `text` in pieces split at the given byte offsets and merges the settled parts.
fn streamed_with(text: &str, cuts: &[usize], c: &ParseCfg) -> Vec<Part> {
    let mut p = c.parser();
    let mut parts = Vec::new();
    let mut at = 0;
    for &cut in cuts.iter().chain([text.len()].iter()) {
        parts.extend(p.push(&text[at..cut]));
        at = cut;
    }
    parts.extend(p.finish());
    merge(parts)
}

fn streamed(text: &str, cuts: &[usize], reasoning: bool, tools: bool) -> Vec<Part> {
    streamed_with(text, cuts, &cfg(reasoning, tools))
}

/// Adjacent text parts of one kind joined (a stream settles text in any number of pieces).
fn merge(parts: Vec<Part>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::new();
    for p in parts {
        match (out.last_mut(), &p) {
            (Some(Part::Reasoning(a)), Part::Reasoning(b))
            | (Some(Part::Content(a)), Part::Content(b)) => a.push_str(b),
            _ => out.push(p),
        }
    }
    out
}

/// Every split into two pieces and into single characters gives the whole text's parts.
fn same_however_split(text: &str, c: ParseCfg) -> Vec<Part> {
    let whole = streamed_with(text, &[], &c);
    let cuts: Vec<usize> = (1..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &cut in &cuts {
        assert_eq!(
            streamed_with(text, &[cut], &c),
            whole,
            "{text:?} cut at {cut}"
        );
    }
    assert_eq!(
        streamed_with(text, &cuts, &c),
        whole,
        "{text:?} by characters"
    );
    whole
}

fn call(name: &str, arguments: &str) -> Part {
    Part::ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

#[test]
fn a_thinking_answer_with_tool_calls_splits_into_its_parts() {
    let want = vec![
        Part::Reasoning("The user wants the weather.".into()),
        Part::Content("Let me check.\n".into()),
        call("get_weather", r#"{"city":"Paris"}"#),
        call("get_time", r#"{"tz": "CET"}"#),
    ];
    assert_eq!(same_however_split(ANSWER, cfg(true, true)), want);
    let (r, c, calls) = parse_whole(ANSWER, &cfg(true, true));
    assert_eq!(r, "The user wants the weather.");
    assert_eq!(c, "Let me check.\n");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].0, "get_weather");
}

#[test]
fn text_around_calls_is_kept_as_generated() {
    // llama.cpp's result: the whitespace after a call goes, the rest of the text stays.
    let t = "I'll check.\n<tool_call>\n{\"name\":\"f\",\"arguments\":{}}\n</tool_call>\n\nDone, see above.";
    let want = vec![
        Part::Content("I'll check.\n".into()),
        call("f", "{}"),
        Part::Content("Done, see above.".into()),
    ];
    assert_eq!(same_however_split(t, cfg(true, true)), want);
    // Not calls: verbatim, spaces included.
    for t in [
        "See <tool_call>oops</tool_call> here",
        "Use the <tool_call> tag to call.",
        "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": [1, 2]}</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\"} trailing</tool_call> x",
        "Hi\n\n",
    ] {
        assert_eq!(
            same_however_split(t, cfg(true, true)),
            vec![Part::Content(t.into())],
            "{t:?}"
        );
    }
    // The closing tag inside an argument string does not end the call.
    let t = "<tool_call>{\"name\":\"f\",\"arguments\":{\"s\":\"</tool_call>\"}}</tool_call>";
    assert_eq!(
        same_however_split(t, cfg(false, true)),
        vec![call("f", r#"{"s":"</tool_call>"}"#)]
    );
    // No arguments: an empty object.
    assert_eq!(
        same_however_split(
            "<tool_call>{\"name\": \"now\"}</tool_call>",
            cfg(false, true)
        ),
        vec![call("now", "{}")]
    );
}

#[test]
fn without_tools_calls_stay_content_and_without_reasoning_thinking_does() {
    let (r, c, calls) = parse_whole(ANSWER, &cfg(true, false));
    assert_eq!(r, "The user wants the weather.");
    assert!(c.starts_with("Let me check.\n<tool_call>\n{\"name\": \"get_weather\""));
    assert!(calls.is_empty());
    let (r, c, calls) = parse_whole(ANSWER, &cfg(false, false));
    assert_eq!((r.as_str(), c.as_str(), calls.len()), ("", ANSWER, 0));
    // Not an active parser at all: the text passes unchanged, whitespace included.
    assert!(!ChatParser::new(false, false).active());
    assert_eq!(
        streamed("  a <think> b  ", &[3, 9], false, false),
        vec![Part::Content("  a <think> b  ".into())]
    );
}

#[test]
fn thinking_blocks_where_qwen3_puts_them() {
    // Whitespace before the block goes with it; only ASCII whitespace is trimmed.
    let t = "\n<think>\nr\n</think>\n\n\u{3000}日本";
    assert_eq!(
        same_however_split(t, cfg(true, false)),
        vec![
            Part::Reasoning("r".into()),
            Part::Content("\u{3000}日本".into())
        ]
    );
    // A prompt that opened the block (Thinking-2507 templates): the answer starts inside it.
    let open = ParseCfg {
        thinking_open: true,
        ..cfg(true, true)
    };
    assert_eq!(
        same_however_split("The user asks.\n</think>\n\nHi", open),
        vec![
            Part::Reasoning("The user asks.".into()),
            Part::Content("Hi".into())
        ]
    );
    // ... unless reasoning is not parsed.
    let off = ParseCfg {
        thinking_open: true,
        ..cfg(false, false)
    };
    assert_eq!(
        streamed_with("a</think>b", &[], &off),
        vec![Part::Content("a</think>b".into())]
    );
    // A block cut by the token limit is all reasoning.
    assert_eq!(
        same_however_split("<think>\nstill thinking\n", cfg(true, true)),
        vec![Part::Reasoning("still thinking".into())]
    );
    for text in [
        "Hello there.",
        "<thin",
        "<",
        "x <think> later",
        "x</think>y",
    ] {
        let (r, c, calls) = parse_whole(text, &cfg(true, false));
        assert_eq!(
            (r.as_str(), c.as_str(), calls.len()),
            ("", text, 0),
            "{text}"
        );
    }
}

#[test]
fn partial_tags_are_held_only_while_they_may_complete() {
    assert_eq!(partial_tag("abc</thi", THINK_END), 5);
    assert_eq!(partial_tag("abc<", CALL), 1);
    assert_eq!(partial_tag("abc", CALL), 0);
    // A whole tag is not partial; multi-byte text ends are never split.
    assert_eq!(partial_tag("</think>", THINK_END), 0);
    assert_eq!(partial_tag("é", THINK_END), 0);
    let mut p = ChatParser::new(true, true);
    assert_eq!(p.push("<thi"), vec![]);
    assert_eq!(p.push("nk>\nabc </th"), vec![Part::Reasoning("abc".into())]);
    assert_eq!(p.push("ink> x <tool"), vec![Part::Content("x ".into())]);
    assert_eq!(p.push("ing"), vec![Part::Content("<tooling".into())]);
}

/// Offered tools as a request gives them: `get_weather(city: string, days: integer, metric:
/// boolean, hours: array)` and `locate(lat: number|null)`.
fn coder_cfg() -> ParseCfg {
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}},
        {"type": "function", "function": {"name": "locate", "parameters": {"type": "object",
            "properties": {"lat": {"type": ["number", "null"]}}}}},
    ]);
    ParseCfg {
        types: Arc::new(ToolTypes::from_tools(&tools)),
        ..cfg(true, true)
    }
}

#[test]
fn qwen3_coder_xml_calls_are_typed_by_the_schema() {
    let text = "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=locate>\n<parameter=lat>\n37.5\n</parameter>\n</function>\n</tool_call>";
    let parts = same_however_split(text, coder_cfg());
    let args = |i: usize| match &parts[i] {
        Part::ToolCall { name, arguments } => (
            name.clone(),
            serde_json::from_str::<Value>(arguments).unwrap(),
        ),
        p => panic!("not a call: {p:?}"),
    };
    assert_eq!(parts[0], Part::Content("I'll check.\n".into()));
    let (name, a) = args(1);
    assert_eq!(name, "get_weather");
    // Typed by the schema; `note` is not in it, so it stays the text it is (as vLLM keeps it).
    assert_eq!(
        a,
        serde_json::json!({"city": "San Francisco", "days": 3, "metric": true,
            "hours": [9, 12], "note": "42"})
    );
    assert_eq!(args(2), ("locate".into(), serde_json::json!({"lat": 37.5})));
    // CRLF around a value is the format's too; an integral number stays an integer.
    let (_, _, calls) = parse_whole(
        "<tool_call><function=locate><parameter=lat>\r\n2\r\n</parameter></function></tool_call>",
        &coder_cfg(),
    );
    assert_eq!(calls[0].1, r#"{"lat":2}"#);
    assert_eq!(parts.len(), 3);
    // A value that does not read as its type stays a string; "null" is null for a
    // non-string type; a multi-line value keeps its inner newlines.
    let text = "<tool_call><function=get_weather><parameter=days>three</parameter><parameter=hours>null</parameter><parameter=city>\nline 1\nline 2\n</parameter></function></tool_call>";
    let (_, _, calls) = parse_whole(text, &coder_cfg());
    let a: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert_eq!(
        a,
        serde_json::json!({"days": "three", "hours": null, "city": "line 1\nline 2"})
    );
    // Without the schema every value is a string; no parameters is `{}`.
    let (_, _, calls) = parse_whole(text, &cfg(false, true));
    let a: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert_eq!(a["days"], "three");
    let (_, _, calls) = parse_whole(
        "<tool_call>\n<function=now>\n</function>\n</tool_call>",
        &cfg(false, true),
    );
    assert_eq!(calls, vec![("now".to_string(), "{}".to_string())]);
}

#[test]
fn qwen3_coder_calls_missing_closing_tags_and_malformed_bodies() {
    // vLLM's reading: a missing </parameter> ends at the next tag, a missing </function> at
    // </tool_call>.
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</tool_call>";
    let (_, c, calls) = parse_whole(text, &coder_cfg());
    assert_eq!(c, "");
    assert_eq!(calls[0].0, "get_weather");
    let a: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert_eq!(a, serde_json::json!({"city": "Paris", "days": 2}));
    // Not a call: the text stays content, tags included; an unclosed body is content at the end.
    for bad in [
        "<tool_call><function=>x</function></tool_call>",
        "<tool_call><function=f><param=a>1</param></function></tool_call>",
        "<tool_call><function=f></function> trailing</tool_call>",
        "<tool_call><function=f<parameter=a>1</parameter></function></tool_call>",
        "<tool_call><function=f><parameter=a>1</parameter>",
    ] {
        let parts = same_however_split(bad, coder_cfg());
        assert_eq!(parts, vec![Part::Content(bad.into())], "{bad}");
    }
    // The Hermes form still parses beside it, and a body that starts like neither waits for
    // more text only while it may still become one.
    let mixed = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call><function=b></function></tool_call>";
    let (_, _, calls) = parse_whole(mixed, &coder_cfg());
    let names: Vec<&str> = calls.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let mut p = coder_cfg().parser();
    assert_eq!(p.push("<tool_call>\n<func"), vec![]);
    assert_eq!(p.push("tion=f>\n"), vec![]);
    assert_eq!(
        p.push("</function></tool_call> ok"),
        vec![
            Part::ToolCall {
                name: "f".into(),
                arguments: "{}".into()
            },
            Part::Content("ok".into())
        ]
    );
}
