//! Glue between model files and the engine's tokenizer: build a tokenizer from what a loaded
//! model carries, and turn a `tokenizer.json` into GGUF metadata for `synth`.

use anyhow::{anyhow, Result};
use nibble_engine::tokenizer::{GgufTokenizerMeta, Tokenizer};
use nibble_model::loader::{LoadedModel, TokenizerSource};
use nibble_model::synth;
use std::path::Path;

/// The tokenizer of a loaded model, if it has one.
pub fn from_model(m: &LoadedModel) -> Result<Option<Tokenizer>> {
    Ok(match &m.tokenizer {
        TokenizerSource::Absent => None,
        TokenizerSource::HfDir(dir) => Some(Tokenizer::from_hf_dir(dir)?),
        TokenizerSource::Gguf {
            model,
            pre,
            tokens,
            token_types,
            merges,
            eos,
            bos,
            pad,
        } => {
            let meta = GgufTokenizerMeta {
                model,
                pre,
                eos_token_id: *eos,
                bos_token_id: *bos,
                padding_token_id: *pad,
                chat_template: m.chat_template.as_deref(),
            };
            Some(Tokenizer::from_gguf_metadata(
                tokens,
                token_types,
                merges,
                &meta,
            )?)
        }
    })
}

/// The tokenizer of a loaded model; commands that turn text into ids cannot run without one.
pub fn required(m: &LoadedModel) -> Result<Tokenizer> {
    from_model(m)?.ok_or_else(|| anyhow!("{}: the model carries no tokenizer", m.path.display()))
}

/// GGUF tokenizer metadata for `synth` from a Hugging Face `tokenizer.json` (its
/// `tokenizer_config.json` sibling, if present, supplies the chat template and EOS).
pub fn gguf_meta(tokenizer_json: &Path, vocab_size: usize) -> Result<synth::GgufTokenizerMeta> {
    let dir = tokenizer_json
        .parent()
        .ok_or_else(|| anyhow!("{}: no parent directory", tokenizer_json.display()))?;
    let tok = if dir.join("tokenizer_config.json").is_file()
        && tokenizer_json.file_name() == Some("tokenizer.json".as_ref())
    {
        Tokenizer::from_hf_dir(dir)?
    } else {
        Tokenizer::from_file(tokenizer_json)?
    };
    let d = tok.to_gguf_metadata(vocab_size)?;
    Ok(synth::GgufTokenizerMeta {
        model: d.model,
        pre: d.pre,
        tokens: d.tokens,
        token_types: d.token_types,
        merges: d.merges,
        bos: d.bos_token_id,
        eos: d.eos_token_id,
        pad: d.padding_token_id,
        chat_template: d.chat_template,
    })
}
