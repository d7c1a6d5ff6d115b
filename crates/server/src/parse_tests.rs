//! Unit tests of the chat answer parser: whole answers, and the same answers cut into every
//! split of pieces (streamed output must settle into the same parts).

use super::*;

const ANSWER: &str = "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";

/// Feeds `text` in pieces split at the given byte offsets and merges the settled parts.
fn streamed(text: &str, cuts: &[usize], reasoning: bool, tools: bool) -> Vec<Part> {
    let mut p = ChatParser::new(reasoning, tools);
    let mut parts = Vec::new();
    let mut at = 0;
    for &c in cuts.iter().chain([text.len()].iter()) {
        parts.extend(p.push(&text[at..c]));
        at = c;
    }
    parts.extend(p.finish());
    merge(parts)
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

#[test]
fn a_thinking_answer_with_tool_calls_splits_into_its_parts() {
    let want = vec![
        Part::Reasoning("The user wants the weather.".into()),
        Part::Content("Let me check.".into()),
        Part::ToolCall {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        },
        Part::ToolCall {
            name: "get_time".into(),
            arguments: r#"{"tz": "CET"}"#.into(),
        },
    ];
    assert_eq!(streamed(ANSWER, &[], true, true), want);
    // Every split into two pieces, and into single bytes where they are characters.
    for cut in (1..ANSWER.len()).filter(|&c| ANSWER.is_char_boundary(c)) {
        assert_eq!(streamed(ANSWER, &[cut], true, true), want, "cut at {cut}");
    }
    let bytes: Vec<usize> = (1..ANSWER.len()).collect();
    assert_eq!(streamed(ANSWER, &bytes, true, true), want);
    let (r, c, calls) = parse_whole(ANSWER, true, true);
    assert_eq!(r, "The user wants the weather.");
    assert_eq!(c, "Let me check.");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].0, "get_weather");
}

#[test]
fn without_tools_calls_stay_content_and_without_reasoning_thinking_does() {
    let (r, c, calls) = parse_whole(ANSWER, true, false);
    assert_eq!(r, "The user wants the weather.");
    assert!(c.starts_with("Let me check.\n<tool_call>\n{\"name\": \"get_weather\""));
    assert!(calls.is_empty());
    let (r, c, calls) = parse_whole(ANSWER, false, false);
    assert_eq!((r.as_str(), c.as_str(), calls.len()), ("", ANSWER, 0));
    // Not an active parser at all: the text passes unchanged, whitespace included.
    let p = ChatParser::new(false, false);
    assert!(!p.active());
    assert_eq!(
        streamed("  a <think> b  ", &[3, 9], false, false),
        vec![Part::Content("  a <think> b  ".into())]
    );
}

#[test]
fn plain_answers_pass_through() {
    for text in ["Hello there.", "<thin", "<", " <think> later", "x</think>y"] {
        let (r, c, calls) = parse_whole(text, true, false);
        assert_eq!(
            (r.as_str(), c.as_str(), calls.len()),
            ("", text, 0),
            "{text}"
        );
    }
    // With tools offered, trailing whitespace is trimmed (a call could have followed).
    let (_, c, _) = parse_whole("Hi.\n\n", true, true);
    assert_eq!(c, "Hi.");
}

#[test]
fn unfinished_or_malformed_blocks_keep_their_text() {
    // A thinking block cut by the token limit is all reasoning.
    assert_eq!(
        streamed("<think>\nstill thinking\n", &[4, 12], true, true),
        vec![Part::Reasoning("still thinking".into())]
    );
    // A call that never closes, or whose body is not a call, stays content with its tags.
    let open = "ok <tool_call>{\"name\": \"f\"";
    assert_eq!(
        streamed(open, &[5], false, true),
        vec![Part::Content("ok<tool_call>{\"name\": \"f\"".into())]
    );
    let bad = "<tool_call>not json</tool_call> after";
    assert_eq!(
        streamed(bad, &[12], false, true),
        vec![Part::Content("<tool_call>not json</tool_call>after".into())]
    );
    let nameless = "<tool_call>{\"arguments\": {}}</tool_call>";
    assert_eq!(
        streamed(nameless, &[], false, true),
        vec![Part::Content(nameless.into())]
    );
    // No arguments: an empty object.
    assert_eq!(
        streamed(
            "<tool_call>{\"name\": \"now\"}</tool_call>",
            &[],
            false,
            true
        ),
        vec![Part::ToolCall {
            name: "now".into(),
            arguments: "{}".into()
        }]
    );
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
    assert_eq!(p.push("ink> x <tool"), vec![Part::Content("x".into())]);
    assert_eq!(p.push("ing"), vec![Part::Content(" <tooling".into())]);
}
