//! Golden tests: the Rust tokenizer against Hugging Face `transformers` output recorded in
//! `tests/fixtures/tokenizer_golden.json` (scripts/tokenizer_fixture.py), on the real Qwen3
//! tokenizer files.

mod common;

use common::{qwen3_tokenizer, text_cases};
use nibble_engine::{Error, Tokenizer};

/// Every mismatch is collected so one run reports all disagreements at once.
fn check_encode(tok: &Tokenizer, label: &str) {
    let mut failures = Vec::new();
    for case in text_cases() {
        let ids = tok.encode(&case.text).unwrap();
        if ids != case.ids {
            let first = ids.iter().zip(&case.ids).position(|(a, b)| a != b);
            failures.push(format!(
                "{label} {}: first differing index {first:?}\n  rust {ids:?}\n  hf   {:?}",
                case.name, case.ids
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "encode mismatches:\n{}",
        failures.join("\n")
    );
}

fn check_decode(tok: &Tokenizer, label: &str) {
    let mut failures = Vec::new();
    for case in text_cases() {
        let text = tok.decode(&case.ids);
        if text != case.decoded {
            failures.push(format!(
                "{label} {}: rust {text:?} hf {:?}",
                case.name, case.decoded
            ));
        }
        // The crate's own decoder must agree with our byte table.
        let crate_text = tok.inner().decode(&case.ids, false).unwrap();
        if crate_text != text {
            failures.push(format!(
                "{label} {}: tokenizers crate {crate_text:?}",
                case.name
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "decode mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn encode_matches_hugging_face() {
    let Some(tok) = qwen3_tokenizer() else { return };
    assert!(text_cases().len() >= 30);
    check_encode(&tok, "hf");
}

#[test]
fn decode_matches_hugging_face_and_round_trips() {
    let Some(tok) = qwen3_tokenizer() else { return };
    check_decode(&tok, "hf");
    for case in text_cases() {
        let round = tok.decode(&tok.encode(&case.text).unwrap());
        if case.name == "nfc_decomposed" {
            // The NFC normaliser composes "e\u{301}" into "é"; decoding returns the composed form.
            assert_ne!(round, case.text);
            assert_eq!(round, "Café naïve");
        } else {
            assert_eq!(round, case.text, "{}", case.name);
        }
    }
}

#[test]
fn special_ids_and_sizes() {
    let Some(tok) = qwen3_tokenizer() else { return };
    assert_eq!(tok.vocab_size(), 151_669);
    assert_eq!(tok.eos_id(), Some(151_645));
    assert_eq!(tok.eos_ids(), &[151_645, 151_643]);
    assert_eq!(tok.pad_id(), Some(151_643));
    assert_eq!(tok.bos_id(), None);
    assert!(tok.chat_template().unwrap().contains("enable_thinking"));
    assert_eq!(tok.token_str(151_667).as_deref(), Some("<think>"));
    assert_eq!(tok.token_str(785).as_deref(), Some("The"));
    assert_eq!(tok.token_str(220).as_deref(), Some("Ġ"));
    assert_eq!(tok.token_str(151_669), None);
    assert_eq!(tok.token_str(u32::MAX), None);
}

#[test]
fn ids_beyond_the_vocabulary_decode_to_placeholders() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let ids = tok.encode("ok").unwrap();
    let mut with_pad = ids.clone();
    with_pad.extend([151_700, 151_935, u32::MAX]);
    assert_eq!(
        tok.decode(&with_pad),
        "ok<|unk:151700|><|unk:151935|><|unk:4294967295|>"
    );
    let mut stream = tok.stream_decoder();
    assert_eq!(stream.push(151_935).as_deref(), Some("<|unk:151935|>"));
}

#[test]
fn stream_decoder_buffers_split_characters() {
    let Some(tok) = qwen3_tokenizer() else { return };
    for case in text_cases() {
        let mut stream = tok.stream_decoder();
        let mut out = String::new();
        let mut held_back = 0;
        for &id in &case.ids {
            match stream.push(id) {
                Some(piece) => out.push_str(&piece),
                None => held_back += 1,
            }
            assert!(stream.pending_bytes() < 4, "{}", case.name);
        }
        if let Some(rest) = stream.flush() {
            out.push_str(&rest);
        }
        assert_eq!(out, case.decoded, "{}", case.name);
        assert!(!out.contains('\u{FFFD}'), "{}", case.name);
        // These strings are known to have characters split over byte-level tokens.
        if ["emoji", "emoji_zwj", "emoji_flags", "math_symbols"].contains(&case.name.as_str()) {
            assert!(
                held_back > 0,
                "{}: expected a character split across tokens",
                case.name
            );
        }
    }
}

#[test]
fn stream_decoder_flushes_a_truncated_character_as_replacement() {
    let Some(tok) = qwen3_tokenizer() else { return };
    // " 🦀" encodes to three byte-level tokens (see the "emoji" golden case); dropping the last
    // one leaves an incomplete UTF-8 sequence.
    let ids = tok.encode("a 🦀").unwrap();
    assert!(ids.len() >= 3, "{ids:?}");
    let mut stream = tok.stream_decoder();
    let mut out = String::new();
    for &id in &ids[..ids.len() - 1] {
        out.push_str(&stream.push(id).unwrap_or_default());
    }
    assert_eq!(out, "a ");
    assert!(stream.pending_bytes() > 0);
    assert_eq!(stream.flush().as_deref(), Some("\u{FFFD}"));
    assert_eq!(tok.decode(&ids[..ids.len() - 1]), "a \u{FFFD}");
}

#[test]
fn gguf_round_trip_encodes_and_decodes_identically() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let data = tok.to_gguf_metadata(151_936).unwrap();
    assert_eq!(data.model, "gpt2");
    assert_eq!(data.pre, "qwen2");
    assert_eq!(data.tokens.len(), 151_936);
    assert_eq!(data.token_types.len(), 151_936);
    assert_eq!(data.merges.len(), 151_387);
    assert_eq!(data.merges[0], "Ġ Ġ");
    assert_eq!(data.tokens[151_644], "<|im_start|>");
    assert_eq!(data.tokens[151_669], "[PAD151669]");
    assert_eq!(data.tokens[151_935], "[PAD151935]");
    // formats-spec §3.8 token types.
    let ty = |id: usize| data.token_types[id];
    assert_eq!(ty(0), 1);
    assert_eq!(ty(151_642), 1);
    for id in 151_643..=151_656 {
        assert_eq!(ty(id), 3, "id {id}");
    }
    assert_eq!((ty(151_657), ty(151_658)), (4, 4));
    for id in 151_659..=151_664 {
        assert_eq!(ty(id), 3, "id {id}");
    }
    for id in 151_665..=151_668 {
        assert_eq!(ty(id), 4, "id {id}");
    }
    assert!(data.token_types[151_669..].iter().all(|&t| t == 5));
    assert_eq!(data.eos_token_id, Some(151_645));
    assert_eq!(data.padding_token_id, Some(151_643));
    assert_eq!(data.chat_template.as_deref(), tok.chat_template());

    let rebuilt = data.to_tokenizer().unwrap();
    assert_eq!(rebuilt.vocab_size(), tok.vocab_size());
    assert_eq!(rebuilt.eos_ids(), tok.eos_ids());
    check_encode(&rebuilt, "gguf");
    check_decode(&rebuilt, "gguf");
    // Exporting the rebuilt tokenizer gives the same metadata back.
    assert_eq!(rebuilt.to_gguf_metadata(151_936).unwrap(), data);
    // A vocabulary smaller than the tokenizer's ids cannot be exported.
    assert!(tok.to_gguf_metadata(151_668).is_err());
}

#[test]
fn gguf_qwen2_regex_is_the_one_in_tokenizer_json() {
    let Some(dir) = common::tokenizer_dir() else {
        return;
    };
    let text = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let split = &json["pre_tokenizer"]["pretokenizers"][0];
    assert_eq!(split["type"], "Split");
    assert_eq!(
        split["pattern"]["Regex"].as_str(),
        Some(nibble_engine::tokenizer::QWEN2_PRETOKENIZER_REGEX)
    );
}

#[test]
fn encode_within_refuses_only_texts_that_cannot_fit() {
    let Some(tok) = qwen3_tokenizer() else { return };
    // Texts that put the most bytes under one token: spaces (Qwen3's longest token is 128 of
    // them), Hangul jamo that NFC composes three to a syllable, accents it composes, and the
    // golden cases. Each fits a context of its own length plus one, so none is refused.
    let mut texts = vec![
        " ".repeat(20_000),
        "\u{1100}\u{1161}\u{11A8}".repeat(3000),
        "e\u{301}".repeat(5000),
    ];
    texts.extend(text_cases().into_iter().map(|c| c.text));
    for t in &texts {
        let n = tok.encode(t).unwrap().len();
        assert_eq!(tok.encode_within(t, n + 1).unwrap().len(), n);
    }
    // Under a normaliser that may delete text (here Strip) there is no bound: a megabyte of
    // spaces around one word is one token or two, so it is tokenized, not refused.
    let dir = tempfile::tempdir().unwrap();
    let src = common::tokenizer_dir().unwrap().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    json["normalizer"] =
        serde_json::json!({"type": "Strip", "strip_left": true, "strip_right": true});
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let strip = Tokenizer::from_file(&path).unwrap();
    let padded = format!("{}hello{}", " ".repeat(1 << 19), " ".repeat(1 << 19));
    assert!(strip.encode_within(&padded, 100).unwrap().len() < 100);
    // A megabyte cannot fit 100 tokens: refused by its length alone.
    let big = "x".repeat(1 << 20);
    match tok.encode_within(&big, 100) {
        Err(Error::PromptTooLong {
            bytes,
            ctx,
            per_token,
        }) => assert_eq!((bytes, ctx, per_token), (1 << 20, 100, 512)),
        other => panic!("{other:?}"),
    }
}

/// Generated text leaves special tokens and unknown ids out by default (vLLM's
/// `skip_special_tokens`, llama.cpp without `--special`); `<think>` is not special in Qwen3's
/// files and stays. The same from the tokenizer rebuilt out of GGUF metadata, whose CONTROL
/// tokens are its special ones (there `<|fim_prefix|>` is one too, as llama.cpp's converter
/// makes it).
#[test]
fn output_text_skips_special_tokens_unless_asked() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let rebuilt = tok
        .to_gguf_metadata(151_936)
        .unwrap()
        .to_tokenizer()
        .unwrap();
    let hi = tok.encode("hi").unwrap();
    let mut ids = vec![151_652]; // <|vision_start|>
    ids.extend(&hi);
    ids.extend([151_667, 151_644, 151_700]); // <think>, <|im_start|>, a padding row
    ids.extend(&hi);
    for (label, t) in [("json", &tok), ("gguf", &rebuilt)] {
        let kept = "<|vision_start|>hi<think><|im_start|><|unk:151700|>hi";
        assert_eq!(t.decode(&ids), kept, "{label}");
        assert_eq!(t.decode_skipping_special(&ids), "hi<think>hi", "{label}");
        for (skip, want) in [(true, "hi<think>hi"), (false, kept)] {
            let mut d = t.output_decoder(skip);
            let out: String = ids.iter().filter_map(|&id| d.push(id)).collect();
            assert_eq!(out, want, "{label} skip {skip}");
        }
    }
    // A non-special `<|...|>` token of the json files (kept), CONTROL after the GGUF round trip.
    assert_eq!(tok.decode_skipping_special(&[151_659]), "<|fim_prefix|>");
    assert_eq!(rebuilt.decode_skipping_special(&[151_659]), "");
}

/// A long text encoded in pieces cut after line breaks gives the ids of the whole text: every
/// golden case joined by line breaks (some followed by letters, where the pieces are cut), in
/// pieces of 1 to 64 bytes.
#[test]
fn a_text_encoded_in_pieces_gives_the_whole_texts_ids() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let mut text = String::new();
    for (i, case) in text_cases().iter().enumerate() {
        text.push_str(&case.text);
        text.push_str(["\nNext ", "\n\nword", "\n  \nx", "\r\nAb", "\n"][i % 5]);
    }
    let whole = tok.encode(&text).unwrap();
    for piece in [1, 7, 64, text.len()] {
        assert_eq!(
            tok.encode_long(&text, piece).unwrap(),
            whole,
            "pieces of {piece}"
        );
    }
}
