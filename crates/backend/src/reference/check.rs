//! Checking a tensor from a [`WeightSource`] against the config before any byte of it is read.
//!
//! After [`fetch`] succeeds, `Weight::row` cannot go out of bounds for any row of the canonical
//! shape: the shape matches the config, rows are whole quantisation blocks, every part holds whole
//! rows, and the parts add up to exactly the tensor's size.

use anyhow::{bail, ensure, Context};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::{TensorKey, Weight, WeightSource};

/// `key`'s weight from `src`, checked against `cfg`.
pub fn fetch<'a>(
    src: &'a dyn WeightSource,
    cfg: &Qwen3MoeConfig,
    key: TensorKey,
) -> anyhow::Result<Weight<'a>> {
    let w = src
        .weight(key)
        .with_context(|| format!("reading tensor {key:?}"))?;
    check(key, &w, cfg)?;
    Ok(w)
}

/// Validate `w` as the tensor `key` of a model with config `cfg`.
pub fn check(key: TensorKey, w: &Weight<'_>, cfg: &Qwen3MoeConfig) -> anyhow::Result<()> {
    let expected = key.shape(cfg);
    ensure!(
        w.shape == expected,
        "tensor {key:?} has shape {:?}, but the config implies {expected:?}",
        w.shape
    );
    let cols = *expected.last().unwrap_or(&1) as u64;
    let row_bytes = match w.dtype.byte_size(cols) {
        Ok(b) => b as usize,
        Err(e) => bail!(
            "tensor {key:?}: its rows cannot be stored as {}: {e}",
            w.dtype.name()
        ),
    };
    let total = w
        .dtype
        .byte_size(w.elements() as u64)
        .with_context(|| format!("tensor {key:?}"))?;
    ensure!(
        w.byte_len() as u64 == total,
        "tensor {key:?}: {} bytes of {} data, expected {total} for shape {:?}",
        w.byte_len(),
        w.dtype.name(),
        w.shape
    );
    for (i, p) in w.parts.iter().enumerate() {
        ensure!(
            row_bytes > 0 && p.len().is_multiple_of(row_bytes),
            "tensor {key:?}: part {i} ({} bytes) is not a whole number of {row_bytes}-byte rows",
            p.len()
        );
    }
    Ok(())
}

/// Check every tensor of the model once (the lm_head is the embedding when tied).
pub fn check_all(src: &dyn WeightSource, cfg: &Qwen3MoeConfig) -> anyhow::Result<()> {
    for key in TensorKey::all(cfg) {
        fetch(src, cfg, key)?;
    }
    Ok(())
}
