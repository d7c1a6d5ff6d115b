//! Qwen3 tokenizer: a thin wrapper over the Hugging Face `tokenizers` crate.
//!
//! Encoding is done entirely by `tokenizers` (added-token split → NFC → Qwen2 split regex →
//! byte-level map → rank-ordered BPE, formats-spec §5.2). No BOS/EOS is ever added: Qwen's
//! post-processor adds nothing, and `encode` asks for no special-token insertion.
//!
//! Decoding uses a per-id byte table built once from the wrapped tokenizer with exactly the rule of
//! the `tokenizers` `ByteLevel` decoder (§5.4): a token string whose characters all lie in the GPT-2
//! byte table becomes those bytes, any other token string its own UTF-8. Keeping the bytes (rather
//! than strings) is what lets [`StreamDecoder`] hold back a partial multi-byte character; tests
//! check the table against `tokenizers`' own `decode` on every golden string.
//!
//! Invariants:
//! * Only byte-level BPE tokenizers are accepted (checked at construction), so every id the
//!   tokenizer knows maps to a byte string.
//! * `vocab_size()` is one past the largest id the tokenizer knows (151 669 for Qwen3), which is
//!   smaller than the model's embedding rows (151 936). Ids at or beyond it, and holes below it,
//!   decode to the placeholder `<|unk:ID|>`; nothing panics on any `u32`.
//! * `eos_ids()` holds the configured EOS plus the end markers `<|im_end|>` and `<|endoftext|>`
//!   when present, mirroring Qwen's `generation_config.json` (`eos_token_id [151645, 151643]`).

mod bytes;
mod gguf;

use std::path::Path;
use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::normalizers::NormalizerWrapper;

pub use bytes::StreamDecoder;
use bytes::TokenTable;
pub use gguf::{token_type, GgufTokenizerData, GgufTokenizerMeta, QWEN2_PRETOKENIZER_REGEX};

use crate::error::{Error, Result};

/// Token texts treated as end-of-generation in addition to the configured EOS token.
const END_MARKERS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// How many bytes of text one token may cover, per byte of the longest token: NFC shrinks text
/// by at most 3x, and 4 leaves room ([`Tokenizer::encode_within`]).
const NORMALISED_SLACK: usize = 4;

/// A byte-level BPE tokenizer plus the bits of `tokenizer_config.json` the engine needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// id -> decoded bytes, for ids `0..vocab_size()`.
    table: Arc<TokenTable>,
    /// The configured EOS token (`tokenizer_config.json` `eos_token`, GGUF `eos_token_id`).
    eos_id: Option<u32>,
    /// `eos_id` followed by the end markers present in the vocabulary, deduplicated.
    eos_ids: Vec<u32>,
    bos_id: Option<u32>,
    pad_id: Option<u32>,
    chat_template: Option<String>,
    /// The most bytes of text one token may cover ([`Tokenizer::encode_within`]'s bound), or
    /// `None` under a normaliser that may delete text. Found once: it scans the vocabulary.
    bytes_per_token: Option<usize>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .field("bos_id", &self.bos_id)
            .field("pad_id", &self.pad_id)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// The special-token names and chat template read from `tokenizer_config.json`.
#[derive(Debug, Default)]
struct TokenizerConfig {
    eos_token: Option<String>,
    bos_token: Option<String>,
    pad_token: Option<String>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads a `tokenizer.json`. Without `tokenizer_config.json` there is no chat template and the
    /// EOS set is just the end markers found in the vocabulary.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = read_to_string(path)?;
        Self::from_json_str(&text, None)
    }

    /// Loads `tokenizer.json` and `tokenizer_config.json` from a Hugging Face model directory.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tokenizer_json = read_to_string(&dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        let config_json = read_to_string(&config_path)?;
        let config = parse_tokenizer_config(&config_json, &config_path.display().to_string())?;
        Self::from_json_str(&tokenizer_json, Some(config))
    }

    /// Builds from the text of a `tokenizer.json` and an optional parsed config.
    fn from_json_str(tokenizer_json: &str, config: Option<TokenizerConfig>) -> Result<Self> {
        let inner: tokenizers::Tokenizer =
            serde_json::from_str(tokenizer_json).map_err(|e| Error::Json {
                what: "tokenizer.json".into(),
                cause: e,
            })?;
        let config = config.unwrap_or_default();
        let lookup = |name: &Option<String>, what: &str| -> Result<Option<u32>> {
            match name {
                None => Ok(None),
                Some(text) => inner.token_to_id(text).map(Some).ok_or_else(|| {
                    Error::TokenizerMetadata(format!("{what} {text:?} is not in the vocabulary"))
                }),
            }
        };
        let eos_id = lookup(&config.eos_token, "eos_token")?;
        let bos_id = lookup(&config.bos_token, "bos_token")?;
        let pad_id = lookup(&config.pad_token, "pad_token")?;
        Self::from_parts(inner, eos_id, bos_id, pad_id, config.chat_template)
    }

    /// Validates the wrapped tokenizer and builds the decode table.
    fn from_parts(
        inner: tokenizers::Tokenizer,
        eos_id: Option<u32>,
        bos_id: Option<u32>,
        pad_id: Option<u32>,
        chat_template: Option<String>,
    ) -> Result<Self> {
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return Err(Error::TokenizerMetadata(
                "only byte-level BPE tokenizers (decoder ByteLevel) are supported".into(),
            ));
        }
        let table = Arc::new(TokenTable::build(&inner)?);
        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        for marker in END_MARKERS {
            if let Some(id) = inner.token_to_id(marker) {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        // A normaliser that may delete text (strip, replace, ...) gives no bound.
        let bounded = matches!(
            inner.get_normalizer(),
            None | Some(
                NormalizerWrapper::NFC(_)
                    | NormalizerWrapper::NFD(_)
                    | NormalizerWrapper::NFKC(_)
                    | NormalizerWrapper::NFKD(_)
                    | NormalizerWrapper::Lowercase(_)
            )
        );
        let bytes_per_token = bounded.then(|| table.max_token_bytes().max(1) * NORMALISED_SLACK);
        Ok(Self {
            inner,
            table,
            eos_id,
            eos_ids,
            bos_id,
            pad_id,
            chat_template,
            bytes_per_token,
        })
    }

    /// Encodes text to ids: no BOS, added tokens (`<|im_start|>`, `<think>`, ...) in the text are
    /// matched as single tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// [`Tokenizer::encode`] of a long text (a corpus to score) in pieces of about
    /// `piece_bytes`, so the tokenizer's working memory (~500 bytes per token) stays bounded.
    /// A piece ends after a line break followed by an ASCII letter: Qwen's pre-tokenizer never
    /// joins a run of line breaks to the letter after it, NFC never merges across an ASCII
    /// letter, and no special token spans a line break, so the ids are those of the whole
    /// text. A text without such a break is encoded whole.
    pub fn encode_long(&self, text: &str, piece_bytes: usize) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut rest = text;
        while rest.len() > piece_bytes {
            let cut = rest.as_bytes()[piece_bytes..]
                .windows(2)
                .position(|w| w[0] == b'\n' && w[1].is_ascii_alphabetic())
                .map(|i| piece_bytes + i + 1);
            let Some(cut) = cut else { break };
            // A line break and an ASCII letter: `cut` is a char boundary.
            ids.extend(self.encode(&rest[..cut])?);
            rest = &rest[cut..];
        }
        ids.extend(self.encode(rest)?);
        Ok(ids)
    }

    /// [`Tokenizer::encode`] for a context of `ctx` tokens: a text too long to fit is refused
    /// before it is tokenized (megabytes take seconds to tokenize, e.g. a chat template's
    /// output). The bound is safe: no token covers more than the longest token's bytes of
    /// normalised text, and Unicode normalisation (Qwen's NFC) shrinks text by at most 3x (a
    /// Hangul syllable from three jamo), so [`NORMALISED_SLACK`] of that per token is an upper
    /// bound; under a normaliser that may delete text there is none and the text is tokenized.
    /// A text under the bound may still be too long once tokenized; the caller checks the ids
    /// as before.
    pub fn encode_within(&self, text: &str, ctx: usize) -> Result<Vec<u32>> {
        if let Some(per_token) = self.bytes_per_token {
            if text.len() / per_token >= ctx {
                return Err(Error::PromptTooLong {
                    bytes: text.len(),
                    ctx,
                    per_token,
                });
            }
        }
        self.encode(text)
    }

    /// Decodes ids to text, keeping special tokens; invalid UTF-8 becomes U+FFFD and unknown ids
    /// become `<|unk:ID|>`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            self.table.append_bytes(id, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether output that skips special tokens leaves `id` out (a special token, or an id the
    /// tokenizer does not know).
    pub fn is_skipped_special(&self, id: u32) -> bool {
        self.table.skipped(id)
    }

    /// The bytes token `id` decodes to (`<|unk:ID|>` for an id the tokenizer does not know).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut b = Vec::new();
        self.table.append_bytes(id, &mut b);
        b
    }

    /// Decodes ids to text as [`Tokenizer::decode`] does, leaving out special tokens and
    /// unknown ids (what generated text shows by default).
    pub fn decode_skipping_special(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids.iter().filter(|&&id| !self.table.skipped(id)) {
            self.table.append_bytes(id, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A decoder that turns ids into text incrementally, never splitting a UTF-8 character,
    /// keeping special tokens.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(Arc::clone(&self.table), false)
    }

    /// [`Tokenizer::stream_decoder`] that leaves out special tokens and unknown ids where
    /// `skip_special` holds (generated text by default, as vLLM's `skip_special_tokens`).
    pub fn output_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(Arc::clone(&self.table), skip_special)
    }

    /// One past the largest token id the tokenizer knows (151 669 for Qwen3).
    pub fn vocab_size(&self) -> usize {
        self.table.len()
    }

    /// Ids that end generation: the configured EOS first, then `<|im_end|>` / `<|endoftext|>`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The configured EOS id (`eos_token` of `tokenizer_config.json`), if any.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The configured BOS id (Qwen: none in `tokenizer_config.json`; never prepended).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The configured padding id.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The token's stored string (byte-level form for BPE tokens, e.g. `Ġthe`), or `None` for
    /// ids the tokenizer does not know.
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token given its stored string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The Jinja chat template from `tokenizer_config.json` / GGUF, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The wrapped `tokenizers` tokenizer (for tests and tools that need the full API).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|cause| Error::Io {
        path: path.to_path_buf(),
        cause,
    })
}

/// Reads a special-token entry, which is either a string or an AddedToken object with `content`.
fn token_field(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// Parses the fields of `tokenizer_config.json` the engine uses.
fn parse_tokenizer_config(text: &str, what: &str) -> Result<TokenizerConfig> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Json {
        what: what.into(),
        cause: e,
    })?;
    // `chat_template` is either one string or a list of {name, template} (named templates);
    // the engine uses the one named "default".
    let chat_template = match value.get("chat_template") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_owned),
        Some(_) => {
            return Err(Error::TokenizerMetadata(format!(
                "{what}: chat_template is neither a string nor a list"
            )))
        }
    };
    Ok(TokenizerConfig {
        eos_token: token_field(value.get("eos_token")),
        bos_token: token_field(value.get("bos_token")),
        pad_token: token_field(value.get("pad_token")),
        chat_template,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_accepts_string_and_object_tokens() {
        let cfg = parse_tokenizer_config(
            r#"{"eos_token": "<|im_end|>", "bos_token": null,
                "pad_token": {"content": "<|endoftext|>", "special": true},
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
            "test",
        )
        .unwrap();
        assert_eq!(cfg.eos_token.as_deref(), Some("<|im_end|>"));
        assert_eq!(cfg.bos_token, None);
        assert_eq!(cfg.pad_token.as_deref(), Some("<|endoftext|>"));
        assert_eq!(cfg.chat_template.as_deref(), Some("D"));
    }

    #[test]
    fn config_rejects_bad_json_and_bad_template_type() {
        assert!(matches!(
            parse_tokenizer_config("{not json", "t"),
            Err(Error::Json { .. })
        ));
        assert!(matches!(
            parse_tokenizer_config(r#"{"chat_template": 5}"#, "t"),
            Err(Error::TokenizerMetadata(_))
        ));
    }

    #[test]
    fn an_error_names_its_cause_once() {
        let dir = std::env::temp_dir();
        let e = anyhow::Error::from(Tokenizer::from_file(&dir).unwrap_err());
        let text = format!("{e:#}");
        assert!(text.starts_with("cannot read "), "{text}");
        assert_eq!(text.matches("os error").count(), 1, "{text}");
        let e = anyhow::Error::from(Tokenizer::from_json_str("{", None).unwrap_err());
        let text = format!("{e:#}");
        assert_eq!(text.matches("EOF while parsing").count(), 1, "{text}");
    }

    #[test]
    fn malformed_tokenizer_json_is_an_error() {
        assert!(Tokenizer::from_json_str("{}", None).is_err());
        assert!(Tokenizer::from_json_str("[1,2", None).is_err());
    }
}
