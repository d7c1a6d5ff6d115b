//! The engine crate's error type.
//!
//! Every fallible public function returns [`Result`]; bad input (a malformed tokenizer file, an
//! inconsistent GGUF vocabulary, a chat template that fails to parse or raises) becomes an
//! [`Error`] with a message naming the offending item, never a panic.

use std::path::PathBuf;

/// Errors produced by the tokenizer, chat template and sampler.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    // The cause is printed in the message and not chained as a `source` too: an error
    // report that walks the chain (anyhow's `{:#}`) printed it twice.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        cause: std::io::Error,
    },
    /// A JSON document (tokenizer.json, tokenizer_config.json, tool schema) is malformed.
    #[error("invalid JSON in {what}: {cause}")]
    Json {
        /// What was being parsed.
        what: String,
        /// The underlying parse error.
        cause: serde_json::Error,
    },
    /// The `tokenizers` crate rejected the tokenizer or failed while encoding.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// Tokenizer metadata (e.g. from GGUF) is inconsistent or unsupported.
    #[error("invalid tokenizer metadata: {0}")]
    TokenizerMetadata(String),
    /// The chat template failed to compile or render (including `raise_exception`).
    #[error("chat template error: {0}")]
    Template(String),
    /// A text too long for the context to be worth tokenizing ([`crate::Tokenizer::encode_within`]).
    #[error(
        "a prompt of {bytes} bytes cannot fit the context of {ctx} tokens (no token covers more \
         than {per_token} bytes of it)"
    )]
    PromptTooLong {
        /// The text's length.
        bytes: usize,
        /// The context, in tokens.
        ctx: usize,
        /// The most bytes one token may cover.
        per_token: usize,
    },
    /// Sampling parameters are out of range.
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;
