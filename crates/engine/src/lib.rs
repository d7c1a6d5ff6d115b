//! nibble-engine: the text side of inference: tokenizer, chat template, sampler, stop checks.
//!
//! This crate knows nothing about model internals. It turns chat messages into a prompt string
//! ([`chat`]), the prompt into token ids and ids back into text ([`tokenizer`]), picks the next id
//! from a row of logits ([`sampler`]) and decides when generation ends ([`stop`]).

pub mod chat;
pub mod deadline;
pub mod error;
pub mod grammar;
pub mod logprobs;
pub mod sampler;
pub mod score;
pub mod session;
pub mod stop;
pub mod streams;
pub mod tokenizer;

pub use chat::{ChatTemplate, Message};
pub use error::{Error, Result};
pub use grammar::{Constraint, GrammarCompiler, GrammarSpec, Think};
pub use logprobs::{token_logprob, TokenLogprob, MAX_TOP_LOGPROBS};
pub use sampler::{Sampler, SamplingParams};
pub use stop::{StopChecker, StopReason, StopStep};
pub use tokenizer::{GgufTokenizerData, GgufTokenizerMeta, StreamDecoder, Tokenizer};
