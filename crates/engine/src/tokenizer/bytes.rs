//! Per-token byte strings and incremental (streaming) decoding.
//!
//! [`TokenTable`] maps every id below the tokenizer's vocabulary size to the bytes the
//! `tokenizers` `ByteLevel` decoder emits for that token (formats-spec §5.3/§5.4): a token string
//! whose every character is in the GPT-2 byte-to-unicode table becomes the corresponding bytes,
//! any other token string its own UTF-8. Ids the tokenizer does not know have no entry and are
//! rendered as the ASCII placeholder `<|unk:ID|>`. The table also marks the special tokens (the
//! added tokens flagged `special`: Qwen's `<|im_end|>`, `<|vision_start|>`, ...; `<think>` is
//! not one), which output text skips by default as vLLM and llama.cpp do, unknown ids with them.
//!
//! [`StreamDecoder`] accumulates those bytes and releases only complete UTF-8: a trailing,
//! possibly-incomplete sequence (at most 3 bytes) is held until the next token completes it;
//! a sequence that can no longer become valid is replaced by one U+FFFD per maximal invalid
//! subpart, exactly as `String::from_utf8_lossy` does for the whole stream, so concatenated
//! stream output equals [`super::Tokenizer::decode`] of the same ids.

use std::sync::Arc;

use crate::error::{Error, Result};

/// Builds the inverse of GPT-2's `bytes_to_unicode`: code point -> byte, for code points
/// below 0x144 (the table's range). Printable Latin-1 bytes map to themselves; the other 68 bytes,
/// in increasing order, to U+0100.. U+0143.
fn char_to_byte_table() -> [Option<u8>; 0x144] {
    let mut table = [None; 0x144];
    let mut next_shifted = 0x100usize;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[usize::from(b)] = Some(b);
        } else {
            table[next_shifted] = Some(b);
            next_shifted += 1;
        }
    }
    table
}

/// id -> decoded bytes for every id in `0..len()`; `None` marks ids with no token.
#[derive(Debug)]
pub(crate) struct TokenTable {
    bytes: Vec<Option<Box<[u8]>>>,
    /// Whether each id of `bytes` is a special token (len = `bytes.len()`).
    special: Vec<bool>,
}

impl TokenTable {
    /// Reads every token string out of the tokenizer and converts it to bytes.
    pub(crate) fn build(inner: &tokenizers::Tokenizer) -> Result<Self> {
        let vocab = inner.get_vocab(true);
        let Some(&max_id) = vocab.values().max() else {
            return Err(Error::TokenizerMetadata("the vocabulary is empty".into()));
        };
        let char_to_byte = char_to_byte_table();
        let len = max_id as usize + 1;
        let mut bytes = Vec::with_capacity(len);
        for id in 0..=max_id {
            // id_to_token looks up added tokens first, then the model, as `decode` does.
            let entry = inner
                .id_to_token(id)
                .map(|token| token_to_bytes(&token, &char_to_byte));
            bytes.push(entry);
        }
        let mut special = vec![false; len];
        for (id, t) in inner.get_added_tokens_decoder() {
            if let Some(s) = special.get_mut(id as usize) {
                *s = t.special;
            }
        }
        Ok(Self { bytes, special })
    }

    /// Whether `id` is left out of text that skips special tokens: a special token, or an id
    /// the tokenizer does not know (the model's padding rows past the vocabulary).
    pub(crate) fn skipped(&self, id: u32) -> bool {
        self.special.get(id as usize).is_none_or(|&s| s)
            || self.bytes.get(id as usize).is_none_or(Option::is_none)
    }

    /// One past the largest known id.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Bytes of the longest token (128 for Qwen3: a run of spaces).
    pub(crate) fn max_token_bytes(&self) -> usize {
        self.bytes
            .iter()
            .flatten()
            .map(|b| b.len())
            .max()
            .unwrap_or(0)
    }

    /// Appends the bytes of `id`, or the `<|unk:ID|>` placeholder if the id is unknown.
    pub(crate) fn append_bytes(&self, id: u32, out: &mut Vec<u8>) {
        match self.bytes.get(id as usize) {
            Some(Some(b)) => out.extend_from_slice(b),
            _ => out.extend_from_slice(format!("<|unk:{id}|>").as_bytes()),
        }
    }
}

/// The `ByteLevel` decoder rule for one token.
fn token_to_bytes(token: &str, char_to_byte: &[Option<u8>; 0x144]) -> Box<[u8]> {
    let mapped: Option<Vec<u8>> = token
        .chars()
        .map(|c| char_to_byte.get(c as usize).copied().flatten())
        .collect();
    mapped
        .unwrap_or_else(|| token.as_bytes().to_vec())
        .into_boxed_slice()
}

/// Incremental detokenizer: feed ids one at a time, receive text that is always complete UTF-8.
#[derive(Debug)]
pub struct StreamDecoder {
    table: Arc<TokenTable>,
    /// Special tokens and unknown ids add no text ([`TokenTable::skipped`]).
    skip_special: bool,
    /// Bytes not yet returned: at most one incomplete UTF-8 sequence (< 4 bytes) between calls.
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub(crate) fn new(table: Arc<TokenTable>, skip_special: bool) -> Self {
        Self {
            table,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the newly completed text, or `None` if nothing is complete yet.
    pub fn push(&mut self, id: u32) -> Option<String> {
        if self.skip_special && self.table.skipped(id) {
            return None;
        }
        self.table.append_bytes(id, &mut self.pending);
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid_end = start + e.valid_up_to();
                    // The prefix is valid UTF-8, so the lossy conversion copies it unchanged.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid_end]));
                    match e.error_len() {
                        // Bytes that cannot start or continue a character: replace and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid_end + bad;
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            start = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        (!out.is_empty()).then_some(out)
    }

    /// Ends the stream: any held-back incomplete sequence becomes U+FFFD.
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(out)
    }

    /// Number of bytes currently held back (0..=3 between calls).
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2_examples() {
        let t = char_to_byte_table();
        // formats-spec §5.3 examples.
        assert_eq!(t[0x100], Some(0x00));
        assert_eq!(t[0x10A], Some(b'\n'));
        assert_eq!(t[0x120], Some(b' '));
        assert_eq!(t[0x121], Some(0x7F));
        assert_eq!(t[0x142], Some(0xA0));
        assert_eq!(t[0x143], Some(0xAD));
        assert_eq!(t[usize::from(b'A')], Some(b'A'));
        assert_eq!(t[0xE9], Some(0xE9));
        // Non-printable code points are not in the table.
        assert_eq!(t[0x20], None);
        assert_eq!(t[0xAD], None);
        // Bijective: 256 entries, each byte once.
        let mut seen = [false; 256];
        for b in t.iter().flatten() {
            assert!(!seen[usize::from(*b)]);
            seen[usize::from(*b)] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn token_rule_falls_back_to_utf8() {
        let t = char_to_byte_table();
        assert_eq!(&*token_to_bytes("Ġthe", &t), b" the");
        // 'ä' (U+00E4) is in the table: becomes the single byte 0xE4 (part of a 3-byte char).
        assert_eq!(&*token_to_bytes("ä½ł", &t), "你".as_bytes());
        // A character outside the table: the whole token is kept as UTF-8.
        assert_eq!(&*token_to_bytes("<think>€", &t), "<think>€".as_bytes());
    }

    fn table_of(tokens: &[&[u8]]) -> Arc<TokenTable> {
        Arc::new(TokenTable {
            bytes: tokens.iter().map(|b| Some(b.to_vec().into())).collect(),
            special: vec![false; tokens.len()],
        })
    }

    #[test]
    fn stream_holds_partial_characters() {
        // "é😀" split as [0xC3], [0xA9, 0xF0, 0x9F], [0x98], [0x80, b'!'].
        let table = table_of(&[&[0xC3], &[0xA9, 0xF0, 0x9F], &[0x98], &[0x80, b'!']]);
        let mut d = StreamDecoder::new(table, false);
        assert_eq!(d.push(0), None);
        assert_eq!(d.pending_bytes(), 1);
        assert_eq!(d.push(1).as_deref(), Some("é"));
        assert_eq!(d.pending_bytes(), 2);
        assert_eq!(d.push(2), None);
        assert_eq!(d.push(3).as_deref(), Some("😀!"));
        assert_eq!(d.flush(), None);
    }

    #[test]
    fn stream_replaces_invalid_bytes_like_lossy_decode() {
        // 0xFF is never valid; [0xE4, 0xBD] followed by 'A' can no longer complete; the final
        // [0xF0, 0x9F] is incomplete at the end of the stream.
        let pieces: &[&[u8]] = &[&[b'a', 0xFF], &[0xE4, 0xBD], b"A", &[0xF0, 0x9F]];
        let table = table_of(pieces);
        let mut d = StreamDecoder::new(table, false);
        let mut out = String::new();
        for id in 0..4 {
            out.push_str(&d.push(id).unwrap_or_default());
        }
        out.push_str(&d.flush().unwrap_or_default());
        let all: Vec<u8> = pieces.concat();
        assert_eq!(out, String::from_utf8_lossy(&all));
        assert_eq!(out, "a\u{FFFD}\u{FFFD}A\u{FFFD}");
    }

    #[test]
    fn unknown_ids_become_placeholders() {
        let table = table_of(&[b"x"]);
        let mut d = StreamDecoder::new(Arc::clone(&table), false);
        assert_eq!(d.push(151_700).as_deref(), Some("<|unk:151700|>"));
        assert_eq!(d.push(u32::MAX).as_deref(), Some("<|unk:4294967295|>"));
        let mut v = Vec::new();
        table.append_bytes(0, &mut v);
        assert_eq!(v, b"x");
    }
}
