//! Unit tests of the chat answer parser: whole answers, and the same answers cut into every
//! split of pieces (streamed output must settle into the same parts).

use super::*;

const ANSWER: &str = "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";

fn cfg(reasoning: bool, tools: bool) -> ParseCfg {
    ParseCfg {
        reasoning,
        tools,
        thinking_open: false,
    }
}

/// Feeds `text` in pieces split at the given byte offsets and merges the settled parts.
fn streamed_with(text: &str, cuts: &[usize], c: ParseCfg) -> Vec<Part> {
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
    streamed_with(text, cuts, cfg(reasoning, tools))
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
    let whole = streamed_with(text, &[], c);
    let cuts: Vec<usize> = (1..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &cut in &cuts {
        assert_eq!(
            streamed_with(text, &[cut], c),
            whole,
            "{text:?} cut at {cut}"
        );
    }
    assert_eq!(
        streamed_with(text, &cuts, c),
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
    let (r, c, calls) = parse_whole(ANSWER, cfg(true, true));
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
    let (r, c, calls) = parse_whole(ANSWER, cfg(true, false));
    assert_eq!(r, "The user wants the weather.");
    assert!(c.starts_with("Let me check.\n<tool_call>\n{\"name\": \"get_weather\""));
    assert!(calls.is_empty());
    let (r, c, calls) = parse_whole(ANSWER, cfg(false, false));
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
        streamed_with("a</think>b", &[], off),
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
        let (r, c, calls) = parse_whole(text, cfg(true, false));
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
