//! Golden tests: chat-template rendering against Hugging Face `apply_chat_template(...,
//! tokenize=False)` output recorded in `tests/fixtures/chat_golden.json`.
//! The template source is stored in the fixture, so these run without the tokenizer download.

mod common;

use nibble_engine::{ChatTemplate, Message};

#[test]
fn renders_match_hugging_face() {
    let golden = common::fixture("chat_golden.json");
    let template = ChatTemplate::new(golden["meta"]["chat_template"].as_str().unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 9);
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let tools = (!case["tools"].is_null()).then_some(&case["tools"]);
        let rendered = template
            .render(
                &messages,
                case["add_generation_prompt"].as_bool().unwrap(),
                case["enable_thinking"].as_bool(),
                tools,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = case["rendered"].as_str().unwrap();
        if rendered != want {
            let at = rendered
                .char_indices()
                .zip(want.chars())
                .find(|((_, a), b)| a != b)
                .map_or(rendered.len().min(want.len()), |((i, _), _)| i);
            failures.push(format!(
                "{name}: differs at byte {at}\n--- rust\n{rendered}\n--- hf\n{want}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn fixture_template_is_the_shipped_one() {
    let Some(tok) = common::qwen3_tokenizer() else {
        return;
    };
    let golden = common::fixture("chat_golden.json");
    assert_eq!(
        tok.chat_template(),
        golden["meta"]["chat_template"].as_str()
    );
}

#[test]
fn qwen3_template_examples_from_the_spec() {
    // formats-spec §5.5 rendered examples.
    let golden = common::fixture("chat_golden.json");
    let t = ChatTemplate::new(golden["meta"]["chat_template"].as_str().unwrap()).unwrap();
    let hi = [Message::user("Hi")];
    assert_eq!(
        t.render(&hi, true, None, None).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&hi, true, Some(false), None).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    let convo = [Message::user("Hi"), Message::assistant("Hello")];
    assert!(t
        .render(&convo, false, None, None)
        .unwrap()
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"));
}

#[test]
fn template_errors_are_errors_not_panics() {
    let golden = common::fixture("chat_golden.json");
    let t = ChatTemplate::new(golden["meta"]["chat_template"].as_str().unwrap()).unwrap();
    // transformers: "Cannot apply chat template to an empty conversation".
    assert!(t.render(&[], true, None, None).is_err());
    // transformers: `tojson` of an undefined `arguments` fails ("Undefined is not JSON
    // serializable"); here it is an error too.
    let mut m = Message::assistant("x");
    m.tool_calls = Some(serde_json::json!([{"function": 3}]));
    let err = t
        .render(&[Message::user("q"), m], false, None, None)
        .unwrap_err();
    assert!(err.to_string().contains("undefined"), "{err}");
}

/// The fuel limit (`TEMPLATE_FUEL`) leaves room for real conversations: the shipped template
/// renders 1000 messages with the golden cases' tools.
#[test]
fn a_long_conversation_with_tools_renders_within_the_fuel() {
    let golden = common::fixture("chat_golden.json");
    let t = ChatTemplate::new(golden["meta"]["chat_template"].as_str().unwrap()).unwrap();
    let tools = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| !c["tools"].is_null())
        .map(|c| c["tools"].clone())
        .expect("a golden case with tools");
    let mut msgs = vec![Message::system("You are helpful.")];
    for i in 0..500 {
        msgs.push(Message::user(format!("question {i}")));
        msgs.push(Message::new("assistant", format!("answer {i}")));
    }
    let out = t.render(&msgs, true, Some(false), Some(&tools)).unwrap();
    assert!(out.contains("question 499") && out.contains("answer 0"));
}
