//! Writer for synthetic checkpoints: tensor bytes come from a callback, one tensor at a time,
//! so a multi-GB checkpoint never sits in memory.
//!
//! The `safetensors` crate does the serialisation: it asks each [`View`] for its bytes only
//! while writing that tensor (to a temporary sibling file that is renamed into place), so a
//! view that calls the user's callback from `data()` streams. The crate orders tensors inside a
//! file by descending dtype size, then name; the callback is keyed by index so order is free.
//!
//! Sharding follows Hugging Face: tensors are packed in the given order, a new shard starts
//! when adding the next tensor would push the current shard's *data* bytes past
//! `max_shard_bytes` (a tensor larger than the limit gets a shard of its own); shards are named
//! `model-00001-of-00003.safetensors` and listed in `model.safetensors.index.json`. One shard is
//! written as plain `model.safetensors` with no index.

use super::sharded::{INDEX_FILE, SINGLE_FILE};
use crate::{FormatError, Result};
use ::safetensors::{Dtype, SafeTensorError, View};
use nibble_quant::DType;
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// One tensor to write: name, element type and row-major shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Element,
    pub shape: Vec<u64>,
}

/// The element types the writer stores: nibble's float types, and the unsigned 32-bit words
/// MLX checkpoints pack their 4- and 8-bit integers into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    /// F32, F16 or BF16 (others are refused when planning).
    Float(DType),
    U32,
}

/// The user's byte source plus the first length mismatch it produced (a `View` cannot fail).
struct Source<'f> {
    produce: &'f mut dyn FnMut(usize) -> Vec<u8>,
    error: Option<String>,
}

/// A tensor whose bytes are produced on demand by `Source`.
struct LazyTensor<'s, 'f> {
    /// Index into the caller's `tensors` slice, passed to the callback.
    index: usize,
    name: &'s str,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Exact byte size: product(shape) × element size.
    len: usize,
    source: &'s RefCell<Source<'f>>,
}

impl View for LazyTensor<'_, '_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut src = self.source.borrow_mut();
        let bytes = (src.produce)(self.index);
        if bytes.len() != self.len && src.error.is_none() {
            src.error = Some(format!(
                "data callback returned {} bytes for tensor `{}` (index {}), expected {}",
                bytes.len(),
                self.name,
                self.index,
                self.len
            ));
        }
        Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// A spec checked and converted to what the crate needs.
struct Planned {
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
}

/// Writes `tensors` under `dir` (created if missing), asking `data(i)` for the little-endian
/// bytes of `tensors[i]` exactly once, as it is written. Returns the written paths: the
/// .safetensors files in shard order, then the index when there is more than one shard.
///
/// Writing a single file removes a stale `model.safetensors.index.json` from `dir`, since
/// readers prefer the index. `__metadata__` is `{"format": "pt"}`, as HF PyTorch writes it.
pub fn write_model(
    dir: &Path,
    tensors: &[TensorSpec],
    max_shard_bytes: u64,
    data: &mut dyn FnMut(usize) -> Vec<u8>,
) -> Result<Vec<PathBuf>> {
    write_model_as(dir, "pt", tensors, max_shard_bytes, data)
}

/// [`write_model`] with `__metadata__` `{"format": format}` (mlx-lm writes `"mlx"`).
pub fn write_model_as(
    dir: &Path,
    format: &str,
    tensors: &[TensorSpec],
    max_shard_bytes: u64,
    data: &mut dyn FnMut(usize) -> Vec<u8>,
) -> Result<Vec<PathBuf>> {
    let planned = plan(dir, tensors)?;

    // Greedy packing in the given order; each shard is a list of indices into `tensors`.
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes: u64 = 0;
    for (i, p) in planned.iter().enumerate() {
        let len = p.len as u64;
        if !current.is_empty() && current_bytes.saturating_add(len) > max_shard_bytes {
            shards.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes = current_bytes.saturating_add(len);
    }
    // Zero tensors still make one (empty) file, which readers accept.
    shards.push(current);

    std::fs::create_dir_all(dir).map_err(|e| FormatError::io(dir, e))?;
    let n = shards.len();
    let file_names: Vec<String> = if n == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=n)
            .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
            .collect()
    };

    let source = RefCell::new(Source {
        produce: data,
        error: None,
    });
    let meta: HashMap<String, String> = [("format".to_string(), format.to_string())].into();
    let mut written = Vec::with_capacity(n + 1);
    for (members, file_name) in shards.iter().zip(&file_names) {
        let path = dir.join(file_name);
        let views = members.iter().map(|&i| {
            let p = &planned[i];
            let view = LazyTensor {
                index: i,
                name: &tensors[i].name,
                dtype: p.dtype,
                shape: p.shape.clone(),
                len: p.len,
                source: &source,
            };
            (tensors[i].name.as_str(), view)
        });
        ::safetensors::serialize_to_file(views, Some(meta.clone()), &path).map_err(
            |e| match e {
                SafeTensorError::IoError(io) => FormatError::io(&path, io),
                other => {
                    FormatError::new(&path, format!("safetensors serialisation failed: {other}"))
                }
            },
        )?;
        if let Some(msg) = source.borrow_mut().error.take() {
            // The file on disk has wrong sizes; do not leave it where a reader would find it.
            let _ = std::fs::remove_file(&path);
            return Err(FormatError::new(&path, msg));
        }
        written.push(path);
    }

    let index_path = dir.join(INDEX_FILE);
    if n == 1 {
        match std::fs::remove_file(&index_path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(FormatError::io(&index_path, e)),
        }
        return Ok(written);
    }
    let mut weight_map = BTreeMap::new();
    for (members, file_name) in shards.iter().zip(&file_names) {
        for &i in members {
            weight_map.insert(tensors[i].name.as_str(), file_name.as_str());
        }
    }
    let total_size: u64 = planned.iter().map(|p| p.len as u64).sum();
    let index = serde_json::json!({
        "metadata": { "total_size": total_size },
        "weight_map": weight_map,
    });
    let text = serde_json::to_string_pretty(&index)
        .map_err(|e| FormatError::new(&index_path, format!("cannot encode index: {e}")))?;
    std::fs::write(&index_path, text).map_err(|e| FormatError::io(&index_path, e))?;
    written.push(index_path);
    Ok(written)
}

/// Checks every spec (dtype, unique name, size without overflow) before anything is written.
fn plan(dir: &Path, tensors: &[TensorSpec]) -> Result<Vec<Planned>> {
    let mut seen = HashSet::with_capacity(tensors.len());
    tensors
        .iter()
        .map(|t| {
            let bad = |msg: String| FormatError::new(dir, format!("tensor `{}`: {msg}", t.name));
            if t.name.is_empty() || t.name == "__metadata__" {
                return Err(bad("invalid tensor name".into()));
            }
            if !seen.insert(t.name.as_str()) {
                return Err(bad("name appears twice".into()));
            }
            let dtype = match t.dtype {
                Element::Float(DType::F32) => Dtype::F32,
                Element::Float(DType::F16) => Dtype::F16,
                Element::Float(DType::BF16) => Dtype::BF16,
                Element::U32 => Dtype::U32,
                Element::Float(other) => {
                    return Err(bad(format!(
                        "dtype {} cannot be written as safetensors (F32, F16, BF16 only)",
                        other.name()
                    )))
                }
            };
            let overflow = || bad(format!("shape {:?} is too large", t.shape));
            let shape: Vec<usize> = t
                .shape
                .iter()
                .map(|&d| usize::try_from(d).map_err(|_| overflow()))
                .collect::<Result<_>>()?;
            let elements = t
                .shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(overflow)?;
            // A U32 word is 4 bytes, as an F32 is.
            let per = match t.dtype {
                Element::Float(d) => d,
                Element::U32 => DType::F32,
            };
            let bytes = per.byte_size(elements).map_err(|e| bad(e.to_string()))?;
            let len = usize::try_from(bytes).map_err(|_| overflow())?;
            Ok(Planned { dtype, shape, len })
        })
        .collect()
}
