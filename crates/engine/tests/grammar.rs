//! Constrained decoding against the real Qwen3 tokenizer: each grammar form lets through the
//! texts it should and refuses the rest, id by id, through the masks a generation sees; a
//! session whose model prefers noise still answers in the schema; bad grammars are errors.

mod common;

use anyhow::Result;
use nibble_backend::{Backend, Qwen3MoeConfig};
use nibble_engine::session::{FinishReason, GenParams, Session};
use nibble_engine::{Constraint, GrammarCompiler, GrammarSpec, StopReason, Think, Tokenizer};
use serde_json::{json, Value};

const VOCAB: usize = 151_936;
const IM_END: u32 = 151_645;
const ENDOFTEXT: u32 = 151_643;

fn compiler() -> Option<(Tokenizer, GrammarCompiler)> {
    let tok = common::qwen3_tokenizer()?;
    let c = GrammarCompiler::new(&tok, tok.eos_ids()).expect("compiler");
    Some((tok, c))
}

/// Feeds `ids` one by one, each checked against the mask before it: `None` if one is refused,
/// else the mask that follows them (finite entries: the ids allowed next).
fn walk(c: &mut Constraint, ids: &[u32]) -> Option<Vec<f32>> {
    for &id in ids {
        let mut l = vec![0.0f32; VOCAB];
        c.mask(&mut l).expect("mask");
        if l[id as usize] == f32::NEG_INFINITY {
            return None;
        }
        c.commit(id).expect("commit");
    }
    let mut l = vec![0.0f32; VOCAB];
    c.mask(&mut l).expect("mask");
    Some(l)
}

fn allowed(mask: &[f32]) -> Vec<u32> {
    (0..mask.len() as u32)
        .filter(|&i| mask[i as usize] > f32::NEG_INFINITY)
        .collect()
}

/// (the text passes, an EOS may follow it, only EOS ids may follow it)
fn judge(
    tok: &Tokenizer,
    c: &GrammarCompiler,
    spec: &GrammarSpec,
    think: Think,
    text: &str,
) -> (bool, bool, bool) {
    let mut con = spec.compile(c, think).expect("compile");
    match walk(&mut con, &tok.encode(text).unwrap()) {
        None => (false, false, false),
        Some(m) => {
            let next = allowed(&m);
            let eos = next.contains(&IM_END) && next.contains(&ENDOFTEXT);
            (
                true,
                eos,
                next.iter().all(|&i| i == IM_END || i == ENDOFTEXT),
            )
        }
    }
}

#[test]
fn a_schema_admits_its_json_and_ends_there() {
    let Some((tok, c)) = compiler() else { return };
    let s = GrammarSpec::JsonSchema(json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": false
    }));
    let cases = [
        ("{\"a\": 5}", (true, true, true)), // a whole object may only end
        ("{\"a\": 5, \"b\": \"y\"}", (true, true, true)),
        ("{\"a\": 5, ", (true, false, false)),
        ("{\"a\": -12", (true, false, false)), // unfinished: no EOS yet
        ("{\"a\": \"5\"}", (false, false, false)), // wrong type
        ("{\"b\": \"y\"}", (false, false, false)), // missing required key
        ("{\"a\": 1, \"c\": 2}", (false, false, false)), // no other keys
        ("{\"a\": 1, \"b\": \"z\"}", (false, false, false)), // not in the enum
        (" {\"a\": 5}", (false, false, false)), // nothing before the object
        ("{\"a\": 5}x", (false, false, false)), // nothing after it but space
        ("Sure! {\"a\": 5}", (false, false, false)),
    ];
    for (text, want) in cases {
        assert_eq!(judge(&tok, &c, &s, Think::No, text), want, "{text:?}");
    }
    // Whitespace between tokens is bounded as in llama.cpp's JSON grammars: a space, or a line
    // break and up to 20 columns of indent.
    let pretty = "{\n  \"a\": 5,\n\t\"b\": \"x\"\n}";
    assert_eq!(judge(&tok, &c, &s, Think::No, pretty), (true, true, true));
    let deep = format!("{{\n{}\"a\": 5}}", " ".repeat(21));
    assert!(!judge(&tok, &c, &s, Think::No, &deep).0);
    assert!(
        !judge(&tok, &c, &s, Think::No, "{\"a\":  5}").0,
        "two spaces"
    );
    // A schema's own whitespace setting wins.
    let compact = GrammarSpec::JsonSchema(json!({"type": "object",
        "x-guidance": {"whitespace_flexible": false}}));
    assert!(judge(&tok, &c, &compact, Think::No, "{\"a\":5}").1);
    assert!(!judge(&tok, &c, &compact, Think::No, "{\"a\": 5}").0);
}

#[test]
fn json_object_regex_and_lark_forms() {
    let Some((tok, c)) = compiler() else { return };
    let obj = GrammarSpec::JsonObject;
    assert!(judge(&tok, &c, &obj, Think::No, "{\"k\": [1, {\"z\": null}]}").1);
    assert!(!judge(&tok, &c, &obj, Think::No, "[1, 2]").0);
    assert!(!judge(&tok, &c, &obj, Think::No, "\"text\"").0);
    let rx = GrammarSpec::Regex(r"\d{3}-[a-z]+".into());
    assert_eq!(
        judge(&tok, &c, &rx, Think::No, "123-abc"),
        (true, true, false)
    );
    assert_eq!(
        judge(&tok, &c, &rx, Think::No, "123-"),
        (true, false, false)
    );
    assert!(!judge(&tok, &c, &rx, Think::No, "12-abc").0);
    assert!(!judge(&tok, &c, &rx, Think::No, "123-abC").0);
    let rx = GrammarSpec::Regex("(yes|no)".into());
    // A finished answer may only end.
    assert_eq!(judge(&tok, &c, &rx, Think::No, "yes"), (true, true, true));
    // Choices are literal texts: regex characters in them mean themselves.
    let choice = GrammarSpec::Choice(vec!["a+b".into(), "(c)".into(), "a".into()]);
    for text in ["a+b", "(c)", "a"] {
        assert!(judge(&tok, &c, &choice, Think::No, text).1, "{text:?}");
    }
    for text in ["aab", "c", "b"] {
        assert!(!judge(&tok, &c, &choice, Think::No, text).1, "{text:?}");
    }
    assert!(GrammarSpec::Choice(vec![]).compile(&c, Think::No).is_err());
    let lark = GrammarSpec::Lark("start: \"answer: \" NUM\nNUM: /[0-9]+/\n".into());
    assert_eq!(
        judge(&tok, &c, &lark, Think::No, "answer: 42"),
        (true, true, false)
    );
    assert!(!judge(&tok, &c, &lark, Think::No, "answer: x").0);
}

#[test]
fn a_think_block_may_come_first_and_is_not_constrained() {
    let Some((tok, c)) = compiler() else { return };
    let s = GrammarSpec::JsonSchema(
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    );
    for text in [
        "{\"a\": 5}",
        "<think>\nThe user wants {\"a\": \"text\"}... no.\n</think>\n\n{\"a\": 5}",
        "<think>\n\n</think>\n\n{\"a\": 5}",
        "<think></think>{\"a\": 5}",
    ] {
        assert_eq!(
            judge(&tok, &c, &s, Think::May, text),
            (true, true, true),
            "{text:?}"
        );
    }
    for text in [
        "<think>\n</think>xx{\"a\": 5}",
        "hello <think></think>{\"a\": 5}",
    ] {
        assert!(!judge(&tok, &c, &s, Think::May, text).0, "{text:?}");
    }
    // Without `think`, the block is refused.
    assert!(!judge(&tok, &c, &s, Think::No, "<think></think>{\"a\": 5}").0);
    // After a prompt that opened the block, the answer closes it first.
    assert!(Think::after_chat_prompt("<|im_start|>assistant\n<think>\n") == Think::Open);
    assert!(Think::after_chat_prompt("<|im_start|>assistant\n") == Think::May);
    assert!(
        Think::after_chat_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n") == Think::No
    );
    for text in ["reasoning\n</think>\n\n{\"a\": 5}", "</think>{\"a\": 5}"] {
        assert_eq!(
            judge(&tok, &c, &s, Think::Open, text),
            (true, true, true),
            "{text:?}"
        );
    }
    // Still reasoning: that JSON is not the answer yet.
    assert_eq!(
        judge(&tok, &c, &s, Think::Open, "{\"a\": 5}"),
        (true, false, false)
    );
    assert!(
        !judge(
            &tok,
            &c,
            &s,
            Think::Open,
            "<think>x</think>{\"a\": 5}</think>"
        )
        .0
    );
}

#[test]
fn tool_calls_in_the_hermes_form() {
    let Some((tok, c)) = compiler() else { return };
    // The weather tool's parameters refer to their own `$defs` (as pydantic writes them).
    let weather = (
        "get_weather".to_owned(),
        json!({"$defs": {"City": {"type": "string"}}, "type": "object",
               "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}),
    );
    let time = ("get_time".to_owned(), json!({"type": "object"}));
    let one = GrammarSpec::ToolCalls {
        tools: vec![weather.clone()],
        one: true,
        xml: false,
    };
    let any = GrammarSpec::ToolCalls {
        tools: vec![weather, time],
        one: false,
        xml: false,
    };
    let w = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    let t = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(judge(&tok, &c, &one, Think::May, w), (true, true, true));
    assert_eq!(
        judge(
            &tok,
            &c,
            &one,
            Think::May,
            &format!("<think>\nweather?\n</think>\n\n{w}")
        ),
        (true, true, true)
    );
    assert!(!judge(&tok, &c, &one, Think::May, t).0, "another tool");
    assert!(
        !judge(&tok, &c, &one, Think::May, &format!("{w}\n{w}")).0,
        "one call only"
    );
    assert!(
        !judge(&tok, &c, &one, Think::May, "The weather in Oslo").0,
        "text instead of a call"
    );
    // The arguments follow the tool's parameters: extra keys pass (the schema allows them), a
    // number for the string does not.
    let extra = w.replace("Oslo\"", "Oslo\", \"x\": 1");
    assert_eq!(judge(&tok, &c, &one, Think::No, &extra), (true, true, true));
    assert!(!judge(&tok, &c, &one, Think::No, &w.replace("\"Oslo\"", "5")).0);
    // Several calls: one after another, any of the tools, then only the end.
    assert_eq!(
        judge(&tok, &c, &any, Think::May, &format!("{w}\n{t}")),
        (true, true, false)
    );
    assert_eq!(judge(&tok, &c, &any, Think::May, t), (true, true, false));
    assert!(
        !judge(
            &tok,
            &c,
            &any,
            Think::May,
            &w.replace("get_weather", "get_date")
        )
        .0
    );
    assert!(GrammarSpec::ToolCalls {
        tools: vec![],
        one: false,
        xml: false,
    }
    .compile(&c, Think::No)
    .is_err());
}

/// Qwen3-Coder's calls (`xml`): the function and its parameters as its template writes them;
/// text values free up to `</parameter>`, typed ones JSON under their schema (with the tool's
/// `$defs`), the declared order with the required ones present; a tool without properties
/// takes any named parameters.
#[test]
fn tool_calls_in_the_qwen3_coder_form() {
    let Some((tok, c)) = compiler() else { return };
    let search = (
        "search".to_owned(),
        json!({"$defs": {"Limit": {"type": "integer", "minimum": 1}}, "type": "object",
               "properties": {"query": {"type": "string"}, "limit": {"$ref": "#/$defs/Limit", "type": "integer"},
                              "exact": {"type": ["boolean", "null"]}, "lang": {"enum": ["en", "de"]}},
               "required": ["query"]}),
    );
    let free = ("run".to_owned(), json!({"type": "object"}));
    let spec = |tools: Vec<(String, Value)>, one| GrammarSpec::ToolCalls {
        tools,
        one,
        xml: true,
    };
    let one = spec(vec![search.clone()], true);
    let any = spec(vec![search, free], false);
    let call =
        |params: &str| format!("<tool_call>\n<function=search>\n{params}</function>\n</tool_call>");
    let q = "<parameter=query>\nrust <generics> & \"traits\"\nline two\n</parameter>\n";
    let lim = "<parameter=limit>\n5\n</parameter>\n";
    let ex = "<parameter=exact>\ntrue\n</parameter>\n";
    let full = call(&format!("{q}{lim}{ex}"));
    assert_eq!(judge(&tok, &c, &one, Think::No, &full), (true, true, true));
    assert_eq!(
        judge(
            &tok,
            &c,
            &one,
            Think::May,
            &format!("<think>\nsearch\n</think>\n\n{full}")
        ),
        (true, true, true)
    );
    // Optional parameters may be left out; the required one may not.
    assert_eq!(
        judge(&tok, &c, &one, Think::No, &call(q)),
        (true, true, true)
    );
    assert!(
        !judge(&tok, &c, &one, Think::No, &call(lim)).0,
        "query missing"
    );
    // Declared order; typed values follow their schema (the $ref'd minimum included).
    assert!(!judge(&tok, &c, &one, Think::No, &call(&format!("{lim}{q}"))).0);
    assert!(
        !judge(
            &tok,
            &c,
            &one,
            Think::No,
            &call(&format!("{q}{}", lim.replace('5', "five")))
        )
        .0
    );
    assert!(
        !judge(
            &tok,
            &c,
            &one,
            Think::No,
            &call(&format!("{q}{}", lim.replace('5', "0")))
        )
        .0
    );
    assert!(
        !judge(
            &tok,
            &c,
            &one,
            Think::No,
            &call(&format!("{q}<parameter=other>\nx\n</parameter>\n"))
        )
        .0
    );
    // Text from a list: one of its strings.
    let lang = |l: &str| call(&format!("{q}<parameter=lang>\n{l}\n</parameter>\n"));
    assert_eq!(
        judge(&tok, &c, &one, Think::No, &lang("de")),
        (true, true, true)
    );
    assert!(!judge(&tok, &c, &one, Think::No, &lang("fr")).0);
    // Not the Hermes form, and one call only.
    let hermes =
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}\n</tool_call>";
    assert!(!judge(&tok, &c, &one, Think::No, hermes).0);
    assert!(!judge(&tok, &c, &one, Think::No, &format!("{full}\n{full}")).0);
    // Several calls, the untyped tool with any parameters.
    let run = "<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=dir>\n/tmp\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        judge(&tok, &c, &any, Think::No, &format!("{full}\n{run}")),
        (true, true, false)
    );
    assert!(!judge(&tok, &c, &any, Think::No, &run.replace("run>", "walk>")).0);
}

#[test]
fn special_tokens_never_pass_as_text() {
    let Some((tok, c)) = compiler() else { return };
    let mut con = GrammarSpec::Regex("(.|\n)*".into())
        .compile(&c, Think::No)
        .unwrap();
    let next = allowed(&walk(&mut con, &[]).unwrap());
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    assert!(!next.contains(&im_start));
    // Ids past the tokenizer (the model's padding rows) are never allowed.
    assert!(next.iter().all(|&i| (i as usize) < tok.vocab_size()));
    // Plain text ids are.
    let hello = tok.encode("hello").unwrap();
    assert!(next.contains(&hello[0]));
}

#[test]
fn bad_grammars_are_errors_that_say_why() {
    let Some((_, c)) = compiler() else { return };
    let bad = [
        (GrammarSpec::JsonSchema(json!({"type": 5})), "grammar"),
        (GrammarSpec::JsonSchema(json!([1])), "object or a boolean"),
        (GrammarSpec::Regex("(".into()), "grammar"),
        (GrammarSpec::Lark("root: \"a\"".into()), "start"),
    ];
    for (spec, want) in bad {
        let e = spec
            .compile(&c, Think::No)
            .expect_err("bad grammar compiled")
            .to_string();
        assert!(e.contains(want), "{spec:?}: {e}");
    }
    let e = GrammarSpec::Lark("start: \"a\"".into())
        .compile(&c, Think::May)
        .unwrap_err();
    assert!(e.to_string().contains("think"), "{e}");
    // A compiler needs an end token.
    let tok = common::qwen3_tokenizer().unwrap();
    assert!(GrammarCompiler::new(&tok, &[]).is_err());
}

/// Logits of seeded noise: the model would say anything.
struct Noise {
    cfg: Qwen3MoeConfig,
    pos: usize,
}

impl Backend for Noise {
    fn name(&self) -> String {
        "noise".into()
    }
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn context_len(&self) -> usize {
        4096
    }
    fn position(&self) -> usize {
        self.pos
    }
    fn truncate(&mut self, pos: usize) -> Result<()> {
        anyhow::ensure!(pos <= self.pos);
        self.pos = pos;
        Ok(())
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.pos += tokens.len();
        let mut x = (self.pos as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        Ok((0..self.cfg.vocab_size)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0
            })
            .collect())
    }
}

#[test]
fn noise_answers_in_the_schema_greedy_and_sampled() {
    let Some((tok, c)) = compiler() else { return };
    let schema = json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"}
        },
        "required": ["color", "n", "ok"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false}
    });
    let con = GrammarSpec::JsonSchema(schema)
        .compile(&c, Think::No)
        .unwrap();
    for (temperature, logprobs) in [(0.0, None), (0.8, None), (0.0, Some(2))] {
        let mut s = Session::new(Box::new(Noise {
            cfg: Qwen3MoeConfig::tiny(),
            pos: 0,
        }));
        let mut p = GenParams {
            max_tokens: 64,
            constraint: Some(con.clone()),
            logprobs,
            ..Default::default()
        };
        p.sampling.temperature = temperature;
        p.sampling.seed = Some(3);
        let mut out = String::new();
        let st = s
            .generate(&tok, &[1, 2, 3], &p, &mut |t, _| {
                out.push_str(t);
                true
            })
            .unwrap();
        assert!(
            matches!(st.finish, FinishReason::Stop(StopReason::Eos(_))),
            "{:?}: {out:?}",
            st.finish
        );
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(
            ["red", "green", "blue"].contains(&v["color"].as_str().unwrap()),
            "{out}"
        );
        assert!(v["n"].as_u64().unwrap() <= 9, "{out}");
        assert!(v["ok"].is_boolean(), "{out}");
        if let Some(k) = logprobs {
            // Logprobs are of the raw row: the grammar's choice is rarely the row's favourite.
            assert_eq!(st.logprobs.len(), st.generated.len());
            assert!(st.logprobs.iter().all(|e| e.top.len() == k));
        }
    }
    // Unconstrained, the same noise is no JSON.
    let mut s = Session::new(Box::new(Noise {
        cfg: Qwen3MoeConfig::tiny(),
        pos: 0,
    }));
    let p = GenParams {
        max_tokens: 16,
        ..Default::default()
    };
    let mut out = String::new();
    s.generate(&tok, &[1, 2, 3], &p, &mut |t, _| {
        out.push_str(t);
        true
    })
    .unwrap();
    assert!(serde_json::from_str::<Value>(&out).is_err(), "{out:?}");
}

/// Grammars from a bad-input hunt: each is an error in bounded time, or works, and none takes
/// the process down (a deep chain overflowed the compiling thread's stack; a lexer dead end
/// looped forever; text spelling `<|im_end|>` became the end token).
#[test]
fn hostile_grammars_fail_fast_and_cleanly() {
    let Some((tok, c)) = compiler() else { return };
    // A chain of 5000 `$ref`s (600 overflowed a 2 MiB stack) compiles.
    let mut defs = serde_json::Map::new();
    for i in 0..5000 {
        defs.insert(
            format!("a{i}"),
            json!({"$ref": format!("#/$defs/a{}", i + 1)}),
        );
    }
    defs.insert("a5000".into(), json!({"type": "integer"}));
    let chain = GrammarSpec::JsonSchema(json!({"$defs": defs, "$ref": "#/$defs/a0"}));
    assert!(judge(&tok, &c, &chain, Think::No, "42").1);
    // So does a Lark rule chain of 5000.
    let mut lark = String::from("start: r0\n");
    for i in 0..5000 {
        lark.push_str(&format!("r{i}: r{}\n", i + 1));
    }
    lark.push_str("r5000: \"a\"\n");
    assert!(judge(&tok, &c, &GrammarSpec::Lark(lark), Think::No, "a").1);
    // Past the size bound: refused before compiling.
    let huge = GrammarSpec::Lark(format!("start: \"{}\"", "a".repeat(300_000)));
    let e = huge.compile(&c, Think::No).unwrap_err().to_string();
    assert!(e.contains("at most 262144"), "{e}");
    // A lexer dead end (llguidance forces `a` bytes forever): an error after the step limit.
    let t = std::time::Instant::now();
    let dead = GrammarSpec::Lark("start: A B\nA: /a+/\nB: /a/\n".into());
    let e = dead.compile(&c, Think::No).unwrap_err().to_string();
    assert!(e.contains("did not end within 2 s"), "{e}");
    assert!(t.elapsed().as_secs() < 10, "{:?}", t.elapsed());
    // An empty language is an error at compile time, in a few hundred characters.
    let e = GrammarSpec::Regex("[^\\s\\S]".into())
        .compile(&c, Think::No)
        .unwrap_err()
        .to_string();
    assert!(e.contains("admits no answer"), "{e}");
    // Behind a think block too (the model would reason to its limit first).
    let e = GrammarSpec::Regex("[^\\s\\S]".into())
        .compile(&c, Think::May)
        .unwrap_err()
        .to_string();
    assert!(e.contains("admits no answer"), "{e}");
    // One found only after a token is an error of that step, as short.
    let late = GrammarSpec::Lark("start: \"a\" b\nb: b \"c\"\n".into());
    let mut con = late.compile(&c, Think::No).unwrap();
    let a = tok.encode("a").unwrap();
    let mut l = vec![0.0f32; VOCAB];
    con.mask(&mut l).unwrap();
    con.commit(a[0]).unwrap();
    let e = con.mask(&mut l).unwrap_err().to_string();
    assert!(e.starts_with("grammar"), "{e}");
    assert!(e.chars().count() < 500, "{e}");
    // An item-limit error mid-answer (3000 alternatives in a row): without the parser's state
    // dump (its tokens, its rules).
    let wide: Vec<String> = (0..3000).map(|i| format!("w{i}")).collect();
    let spec = GrammarSpec::JsonSchema(json!({"anyOf": wide.iter()
        .map(|w| json!({"type": "object", "properties": {w: {"type": "integer"}}, "required": [w]}))
        .collect::<Vec<_>>()}));
    let mut con = spec.compile(&c, Think::No).unwrap();
    let brace = tok.encode("{").unwrap();
    con.mask(&mut vec![0.0f32; VOCAB]).unwrap();
    let e = con.commit(brace[0]).unwrap_err().to_string();
    assert!(e.contains("max is 2000"), "{e}");
    assert!(!e.contains("Tokens:") && !e.contains("<state>"), "{e}");
    // Text that spells a special token is text: `<|im_end|>` in a constant is not the end.
    let s = GrammarSpec::JsonSchema(json!({"const": "<|im_end|>x"}));
    let mut con = s.compile(&c, Think::No).unwrap();
    let mut text = String::new();
    for _ in 0..40 {
        let mut l = vec![0.0f32; VOCAB];
        con.mask(&mut l).unwrap();
        // The lowest allowed id (every id equal: the grammar alone decides).
        let id = allowed(&l)[0];
        if id == IM_END || id == ENDOFTEXT {
            break;
        }
        text.push_str(&String::from_utf8_lossy(&tok.token_bytes(id)));
        con.commit(id).unwrap();
    }
    assert_eq!(text, "\"<|im_end|>x\"");
}
