//! Conversion between a [`Tokenizer`] and llama.cpp's GGUF tokenizer metadata (formats-spec §3.8).
//!
//! GGUF stores the tokenizer as parallel arrays indexed by id (`tokenizer.ggml.tokens`,
//! `tokenizer.ggml.token_type`), a merge list of `"left right"` strings (index = rank) and a few
//! scalar ids. This module takes those arrays as plain slices, so the engine does not depend on the
//! GGUF parser; the cli passes them in.
//!
//! Rebuilding (`from_gguf_metadata`): the arrays are turned into a `tokenizer.json` document with
//! the Qwen2 pipeline (NFC normaliser, Qwen2 split regex + ByteLevel pre-tokenizer, BPE, ByteLevel
//! post-processor and decoder) and loaded through `tokenizers`' own deserializer. Every token
//! except UNUSED padding goes into the BPE vocabulary with its GGUF id, so ids are explicit even
//! if the layout has holes; CONTROL (3) and USER_DEFINED (4) ids are also registered as added
//! tokens (special = CONTROL), which makes them match as whole tokens in input text. The result is
//! checked: every token string must map back to its own id.
//!
//! Exporting (`to_gguf_metadata`): ids below the model's vocabulary size with no token become
//! `[PAD<id>]` / UNUSED. Added tokens that are special or look like `<|…|>` become CONTROL,
//! other added tokens USER_DEFINED, as llama.cpp's converter does. A non-special `<|…|>` token
//! (e.g. `<|fim_prefix|>`) therefore comes back special after a round trip; encoding and
//! decoding are unaffected.

use serde_json::{json, Map, Value};

use super::Tokenizer;
use crate::error::{Error, Result};

/// The pre-tokenizer regex GGUF `tokenizer.ggml.pre = "qwen2"` stands for (formats-spec §5.2).
pub const QWEN2_PRETOKENIZER_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp `tokenizer.ggml.token_type` values.
pub mod token_type {
    /// An ordinary BPE token.
    pub const NORMAL: i32 = 1;
    /// The unknown token (not used by byte-level BPE).
    pub const UNKNOWN: i32 = 2;
    /// A special control token (`<|im_start|>`...).
    pub const CONTROL: i32 = 3;
    /// A user-defined added token (`<think>`...).
    pub const USER_DEFINED: i32 = 4;
    /// A padding id with no token.
    pub const UNUSED: i32 = 5;
    /// A raw byte token (SentencePiece byte fallback; not used by byte-level BPE).
    pub const BYTE: i32 = 6;
}

/// Owned GGUF tokenizer metadata, as written by the synthetic-model writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTokenizerData {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: `"qwen2"`.
    pub pre: String,
    /// `tokenizer.ggml.tokens`, index = id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, parallel to `tokens`.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, `"left right"`, index = rank.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding_token_id: Option<u32>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// The scalar GGUF tokenizer keys that accompany the arrays.
#[derive(Debug, Clone, Copy)]
pub struct GgufTokenizerMeta<'a> {
    /// `tokenizer.ggml.model`; only `"gpt2"` is supported.
    pub model: &'a str,
    /// `tokenizer.ggml.pre`; only `"qwen2"` is supported.
    pub pre: &'a str,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding_token_id: Option<u32>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<&'a str>,
}

impl Default for GgufTokenizerMeta<'_> {
    fn default() -> Self {
        Self {
            model: "gpt2",
            pre: "qwen2",
            eos_token_id: None,
            bos_token_id: None,
            padding_token_id: None,
            chat_template: None,
        }
    }
}

impl GgufTokenizerData {
    /// Rebuilds the tokenizer these arrays describe.
    pub fn to_tokenizer(&self) -> Result<Tokenizer> {
        let meta = GgufTokenizerMeta {
            model: &self.model,
            pre: &self.pre,
            eos_token_id: self.eos_token_id,
            bos_token_id: self.bos_token_id,
            padding_token_id: self.padding_token_id,
            chat_template: self.chat_template.as_deref(),
        };
        Tokenizer::from_gguf_metadata(&self.tokens, &self.token_types, &self.merges, &meta)
    }
}

fn meta_err(msg: String) -> Error {
    Error::TokenizerMetadata(msg)
}

/// Splits a GGUF merge at the first space searched from byte 1, as llama.cpp does.
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    let pos = merge.bytes().skip(1).position(|b| b == b' ')? + 1;
    // `pos` indexes an ASCII space, so both slices are on character boundaries.
    Some((&merge[..pos], &merge[pos + 1..]))
}

impl Tokenizer {
    /// Rebuilds a tokenizer from GGUF tokenizer arrays (`tokenizer.ggml.tokens`, `token_type`,
    /// `merges`) and scalar keys.
    pub fn from_gguf_metadata(
        tokens: &[String],
        token_types: &[i32],
        merges: &[String],
        meta: &GgufTokenizerMeta<'_>,
    ) -> Result<Self> {
        if meta.model != "gpt2" {
            return Err(meta_err(format!(
                "tokenizer.ggml.model {:?} is not supported (only \"gpt2\" byte-level BPE)",
                meta.model
            )));
        }
        if meta.pre != "qwen2" {
            return Err(meta_err(format!(
                "tokenizer.ggml.pre {:?} is not supported (only \"qwen2\")",
                meta.pre
            )));
        }
        if tokens.len() != token_types.len() {
            return Err(meta_err(format!(
                "{} tokens but {} token types",
                tokens.len(),
                token_types.len()
            )));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(meta_err(format!(
                "{} tokens do not fit u32 ids",
                tokens.len()
            )));
        }

        let mut vocab = Map::new();
        let mut added = Vec::new();
        for (id, (token, &ty)) in tokens.iter().zip(token_types).enumerate() {
            match ty {
                token_type::UNUSED => continue,
                token_type::NORMAL | token_type::UNKNOWN | token_type::BYTE => {}
                token_type::CONTROL | token_type::USER_DEFINED => added.push(json!({
                    "id": id,
                    "content": token,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": ty == token_type::CONTROL,
                })),
                other => {
                    return Err(meta_err(format!(
                        "token {id} ({token:?}) has unknown token type {other}"
                    )))
                }
            }
            if vocab.insert(token.clone(), json!(id)).is_some() {
                return Err(meta_err(format!("token {token:?} (id {id}) appears twice")));
            }
        }

        let merge_pairs = merges
            .iter()
            .enumerate()
            .map(|(rank, m)| {
                split_merge(m)
                    .map(|(a, b)| json!([a, b]))
                    .ok_or_else(|| meta_err(format!("merge {rank} {m:?} has no separating space")))
            })
            .collect::<Result<Vec<Value>>>()?;

        let byte_level = json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
        });
        let document = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": QWEN2_PRETOKENIZER_REGEX},
                        "behavior": "Isolated",
                        "invert": false
                    },
                    byte_level
                ]
            },
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": "",
                "end_of_word_suffix": "",
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": merge_pairs
            }
        });
        let inner: tokenizers::Tokenizer =
            // The document is built here, so a refusal is the arrays' fault (e.g. a merge of
            // a token the vocabulary lacks), not malformed JSON.
            serde_json::from_value(document).map_err(|e| {
                meta_err(format!("the GGUF token arrays do not form a BPE tokenizer: {e}"))
            })?;

        // Added tokens get their ids from the vocabulary; confirm nothing was renumbered.
        for (id, (token, &ty)) in tokens.iter().zip(token_types).enumerate() {
            if ty != token_type::UNUSED && inner.token_to_id(token) != Some(id as u32) {
                return Err(meta_err(format!(
                    "token {token:?} should have id {id} but the rebuilt tokenizer gives {:?}",
                    inner.token_to_id(token)
                )));
            }
        }
        let check_id = |id: Option<u32>, what: &str| -> Result<Option<u32>> {
            match id {
                Some(i)
                    if token_types
                        .get(i as usize)
                        .is_none_or(|&t| t == token_type::UNUSED) =>
                {
                    Err(meta_err(format!("{what} {i} is not a token")))
                }
                other => Ok(other),
            }
        };
        let eos = check_id(meta.eos_token_id, "eos_token_id")?;
        let bos = check_id(meta.bos_token_id, "bos_token_id")?;
        let pad = check_id(meta.padding_token_id, "padding_token_id")?;
        Self::from_parts(inner, eos, bos, pad, meta.chat_template.map(str::to_owned))
    }

    /// Exports the tokenizer as GGUF metadata with `vocab_size` entries (the model's embedding
    /// rows, e.g. 151 936); ids without a token become `[PAD<id>]` / UNUSED.
    pub fn to_gguf_metadata(&self, vocab_size: usize) -> Result<GgufTokenizerData> {
        if vocab_size < self.vocab_size() {
            return Err(meta_err(format!(
                "vocab size {vocab_size} is smaller than the tokenizer's {} ids",
                self.vocab_size()
            )));
        }
        if u32::try_from(vocab_size).is_err() {
            return Err(meta_err(format!(
                "vocab size {vocab_size} does not fit u32 ids"
            )));
        }
        let added = self.inner.get_added_tokens_decoder();
        let mut tokens = Vec::with_capacity(vocab_size);
        let mut token_types = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            let (text, ty) = match (added.get(&id), self.inner.id_to_token(id)) {
                (Some(tok), _) => {
                    let looks_control =
                        tok.content.starts_with("<|") && tok.content.ends_with("|>");
                    let ty = if tok.special || looks_control {
                        token_type::CONTROL
                    } else {
                        token_type::USER_DEFINED
                    };
                    (tok.content.clone(), ty)
                }
                (None, Some(text)) => (text, token_type::NORMAL),
                (None, None) => (format!("[PAD{id}]"), token_type::UNUSED),
            };
            tokens.push(text);
            token_types.push(ty);
        }

        Ok(GgufTokenizerData {
            model: "gpt2".into(),
            pre: "qwen2".into(),
            tokens,
            token_types,
            merges: self.merges()?,
            eos_token_id: self.eos_id,
            bos_token_id: self.bos_id,
            padding_token_id: self.pad_id,
            chat_template: self.chat_template.clone(),
        })
    }

    /// The BPE merges as `"left right"` strings in rank order, read through the model's own
    /// serialisation (which lists them by rank, as pairs or strings depending on version).
    fn merges(&self) -> Result<Vec<String>> {
        let model = serde_json::to_value(self.inner.get_model()).map_err(|e| Error::Json {
            what: "serialised tokenizer model".into(),
            cause: e,
        })?;
        if model.get("type").and_then(Value::as_str) != Some("BPE") {
            return Err(meta_err("only BPE models can be exported to GGUF".into()));
        }
        let Some(list) = model.get("merges").and_then(Value::as_array) else {
            return Err(meta_err("the BPE model has no merge list".into()));
        };
        list.iter()
            .enumerate()
            .map(|(rank, m)| {
                let (a, b) = match m {
                    Value::String(s) => split_merge(s).ok_or_else(|| {
                        meta_err(format!("merge {rank} {s:?} has no separating space"))
                    })?,
                    Value::Array(pair) => match pair.as_slice() {
                        [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                        _ => return Err(meta_err(format!("merge {rank} is not a string pair"))),
                    },
                    _ => return Err(meta_err(format!("merge {rank} has an unknown form"))),
                };
                // A literal space inside a side would make the GGUF string ambiguous.
                if a.contains(' ') || b.contains(' ') {
                    return Err(meta_err(format!(
                        "merge {rank} ({a:?}, {b:?}) contains a space"
                    )));
                }
                Ok(format!("{a} {b}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_split_follows_llama_cpp() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("ab cd"), Some(("ab", "cd")));
        // A leading space is part of the left side (search starts at byte 1).
        assert_eq!(split_merge("  x"), Some((" ", "x")));
        assert_eq!(split_merge("é x"), Some(("é", "x")));
        assert_eq!(split_merge("abc"), None);
        assert_eq!(split_merge(""), None);
    }
}
