//! GGUF tokenizer metadata on a small hand-made vocabulary (runs without the real tokenizer):
//! rebuilding, hand-computed BPE results, explicit ids across holes, round trip, bad input.

use nibble_engine::tokenizer::{token_type, GgufTokenizerData, GgufTokenizerMeta};
use nibble_engine::Tokenizer;

/// GPT-2 byte-to-unicode, written out independently of the crate for the test data.
fn byte_char(b: u8) -> char {
    if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
        return char::from(b);
    }
    let shifted = (0..b)
        .filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF))
        .count();
    char::from_u32(0x100 + shifted as u32).unwrap()
}

/// ids 0..=255: single bytes (id = byte value); 256..=260: merges; 261..=263: padding holes;
/// 264 `<|im_start|>`, 265 `<|im_end|>` (CONTROL), 266 `<think>` (USER_DEFINED); 267..=271: padding.
fn synthetic() -> GgufTokenizerData {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut token_types = vec![token_type::NORMAL; 256];
    let merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        token_types.push(token_type::NORMAL);
    }
    for id in 261..=263 {
        tokens.push(format!("[PAD{id}]"));
        token_types.push(token_type::UNUSED);
    }
    for (t, ty) in [
        ("<|im_start|>", token_type::CONTROL),
        ("<|im_end|>", token_type::CONTROL),
        ("<think>", token_type::USER_DEFINED),
    ] {
        tokens.push(t.into());
        token_types.push(ty);
    }
    for id in 267..=271 {
        tokens.push(format!("[PAD{id}]"));
        token_types.push(token_type::UNUSED);
    }
    GgufTokenizerData {
        model: "gpt2".into(),
        pre: "qwen2".into(),
        tokens,
        token_types,
        merges: merges.iter().map(|m| m.to_string()).collect(),
        eos_token_id: Some(265),
        bos_token_id: None,
        padding_token_id: Some(264),
        chat_template: Some("{{ messages[0].content }}".into()),
    }
}

#[test]
fn byte_char_spot_values() {
    assert_eq!(byte_char(b' '), 'Ġ');
    assert_eq!(byte_char(b'\n'), 'Ċ');
    assert_eq!(byte_char(0), 'Ā');
    assert_eq!(byte_char(b'x'), 'x');
}

#[test]
fn rebuilt_tokenizer_applies_merges_by_rank() {
    let tok = synthetic().to_tokenizer().unwrap();
    assert_eq!(tok.vocab_size(), 267);
    assert_eq!(tok.eos_ids(), &[265]);
    assert_eq!(tok.pad_id(), Some(264));
    assert_eq!(tok.chat_template(), Some("{{ messages[0].content }}"));
    // "hello": h e l l o -> (h e)=257 rank 1, (l l)=259 rank 3, then (ll o)=260 rank 4.
    // " the": (Ġ t)=256 rank 0, (h e)=257, then (Ġt he)=258 rank 2.
    // "<think>" and "<|im_end|>" are added tokens; "x" is byte 120; "\n" is byte 10.
    let text = "hello the<think>x\n<|im_end|>";
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids, vec![257, 260, 258, 266, 120, 10, 265]);
    assert_eq!(tok.decode(&ids), text);
    assert_eq!(tok.token_str(258).as_deref(), Some("Ġthe"));
    // Holes and padding have no token; decoding them gives placeholders.
    assert_eq!(tok.token_str(262), None);
    assert_eq!(tok.decode(&[262, 104]), "<|unk:262|>h");
    // Non-ASCII text falls back to byte tokens and decodes back exactly.
    let ids = tok.encode("é 😀").unwrap();
    assert_eq!(ids, vec![0xC3, 0xA9, 0x20, 0xF0, 0x9F, 0x98, 0x80]);
    assert_eq!(tok.decode(&ids), "é 😀");
}

#[test]
fn export_reproduces_the_metadata() {
    let data = synthetic();
    let tok = data.to_tokenizer().unwrap();
    assert_eq!(tok.to_gguf_metadata(272).unwrap(), data);
    // A larger model vocabulary adds padding entries.
    let bigger = tok.to_gguf_metadata(275).unwrap();
    assert_eq!(bigger.tokens[274], "[PAD274]");
    assert_eq!(bigger.token_types[272..], [token_type::UNUSED; 3]);
    assert!(tok.to_gguf_metadata(266).is_err());
}

fn rebuild(data: &GgufTokenizerData) -> nibble_engine::Result<Tokenizer> {
    let meta = GgufTokenizerMeta {
        model: &data.model,
        pre: &data.pre,
        eos_token_id: data.eos_token_id,
        bos_token_id: data.bos_token_id,
        padding_token_id: data.padding_token_id,
        chat_template: None,
    };
    Tokenizer::from_gguf_metadata(&data.tokens, &data.token_types, &data.merges, &meta)
}

/// A named corruption of the synthetic metadata.
type Mutation = (&'static str, Box<dyn Fn(&mut GgufTokenizerData)>);

#[test]
fn bad_metadata_is_an_error() {
    let cases: Vec<Mutation> = vec![
        ("model", Box::new(|d| d.model = "llama".into())),
        ("pre", Box::new(|d| d.pre = "llama-bpe".into())),
        (
            "lengths",
            Box::new(|d| {
                d.token_types.pop();
            }),
        ),
        ("type", Box::new(|d| d.token_types[5] = 9)),
        (
            "merge without space",
            Box::new(|d| d.merges[1] = "he".into()),
        ),
        (
            "merge of unknown token",
            Box::new(|d| d.merges.push("q z".into())),
        ),
        (
            "merge result missing",
            Box::new(|d| d.merges.push("a b".into())),
        ),
        ("duplicate token", Box::new(|d| d.tokens[266] = "a".into())),
        ("eos on padding", Box::new(|d| d.eos_token_id = Some(262))),
        (
            "eos out of range",
            Box::new(|d| d.eos_token_id = Some(10_000)),
        ),
    ];
    for (what, mutate) in cases {
        let mut data = synthetic();
        mutate(&mut data);
        match rebuild(&data) {
            Err(nibble_engine::Error::TokenizerMetadata(_)) => {}
            Err(e) => panic!("{what}: not named a metadata error: {e}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    }
    // The unmodified data is accepted by the same path.
    assert!(rebuild(&synthetic()).is_ok());
}
