//! A Hugging Face checkpoint: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {tensor: shard_file}}`).
//!
//! Invariants of an opened [`SafetensorsModel`]:
//! - Every shard named in `weight_map` is a plain file name inside the index's directory (no
//!   path separators, no `..`, not absolute), was opened and validated exactly once, and holds
//!   every tensor the index assigns to it.
//! - `weight_map` is the authority: a tensor present in a shard but absent from `weight_map` is
//!   not reachable through the model (HF transformers loads the same way; it also means a name
//!   duplicated across shards resolves to the one shard the index names).
//! - For a single-file checkpoint every tensor of the file is reachable.

use super::SafetensorsFile;
use crate::{FormatError, Result, TensorView};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

/// File name of a single-file checkpoint inside a model directory.
pub(super) const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index inside a model directory.
pub(super) const INDEX_FILE: &str = "model.safetensors.index.json";

/// The part of `model.safetensors.index.json` we need; `metadata` (total_size, ...) is ignored.
#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// A Hugging Face checkpoint: a directory with `model.safetensors` or
/// `model.safetensors.index.json` + shards, or a path to one .safetensors file (or to an
/// index file).
#[derive(Debug)]
pub struct SafetensorsModel {
    /// Paths of the opened .safetensors files, parallel to `shards`, in first-use order of the
    /// (sorted) weight map.
    files: Vec<PathBuf>,
    shards: Vec<SafetensorsFile>,
    /// Tensor name -> index into `shards`; sorted so `names()` is deterministic.
    owner: BTreeMap<String, usize>,
}

impl SafetensorsModel {
    /// Opens a checkpoint. `path` may be a directory (the index is preferred over
    /// `model.safetensors` when both exist), a `*.json` index file, or one `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| FormatError::io(path, e))?;
        if meta.is_dir() {
            let index = path.join(INDEX_FILE);
            if index.is_file() {
                return Self::open_index(&index);
            }
            let single = path.join(SINGLE_FILE);
            if single.is_file() {
                return Self::open_single(&single);
            }
            return Err(FormatError::new(
                path,
                format!("directory has neither {INDEX_FILE} nor {SINGLE_FILE}"),
            ));
        }
        if path.extension().is_some_and(|e| e == "json") {
            Self::open_index(path)
        } else {
            Self::open_single(path)
        }
    }

    fn open_single(path: &Path) -> Result<Self> {
        let file = SafetensorsFile::open(path)?;
        let owner = file.names.iter().map(|n| (n.clone(), 0)).collect();
        Ok(SafetensorsModel {
            files: vec![path.to_path_buf()],
            shards: vec![file],
            owner,
        })
    }

    fn open_index(index_path: &Path) -> Result<Self> {
        let text = std::fs::read(index_path).map_err(|e| FormatError::io(index_path, e))?;
        let index: Index = serde_json::from_slice(&text).map_err(|e| {
            FormatError::new(index_path, format!("invalid safetensors index JSON: {e}"))
        })?;
        if index.weight_map.is_empty() {
            return Err(FormatError::new(index_path, "weight_map is empty"));
        }
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut files = Vec::new();
        let mut shards: Vec<SafetensorsFile> = Vec::new();
        let mut shard_of_name: HashMap<&str, usize> = HashMap::new();
        let mut owner = BTreeMap::new();
        for (tensor, shard_name) in &index.weight_map {
            let s = match shard_of_name.get(shard_name.as_str()) {
                Some(&s) => s,
                None => {
                    check_shard_name(index_path, tensor, shard_name)?;
                    let shard_path = dir.join(shard_name);
                    let file = open_shard(index_path, &shard_path)?;
                    shards.push(file);
                    files.push(shard_path);
                    shard_of_name.insert(shard_name, shards.len() - 1);
                    shards.len() - 1
                }
            };
            if !shards[s].contains(tensor) {
                return Err(FormatError::new(
                    &files[s],
                    format!(
                        "{} lists tensor `{tensor}` in this shard, but the shard has no such tensor",
                        index_path.display()
                    ),
                ));
            }
            owner.insert(tensor.clone(), s);
        }
        Ok(SafetensorsModel {
            files,
            shards,
            owner,
        })
    }

    /// A zero-copy view of tensor `name` from whichever shard holds it; `Ok(None)` if the
    /// checkpoint has no such tensor, an error if its dtype is not F32, F16 or BF16.
    pub fn tensor(&self, name: &str) -> Result<Option<TensorView<'_>>> {
        match self.owner.get(name) {
            Some(&s) => self.shards[s].tensor(name),
            None => Ok(None),
        }
    }

    /// A raw view of tensor `name` whatever its dtype (see [`SafetensorsFile::raw`]).
    pub fn raw(&self, name: &str) -> Result<Option<super::RawView<'_>>> {
        match self.owner.get(name) {
            Some(&s) => self.shards[s].raw(name),
            None => Ok(None),
        }
    }

    /// Whether the checkpoint has a tensor `name` (whatever its dtype).
    pub fn contains(&self, name: &str) -> bool {
        self.owner.contains_key(name)
    }

    /// The `format` entry of the first shard's `__metadata__` (`"pt"` from PyTorch, `"mlx"`
    /// from mlx-lm), if any.
    pub fn format_tag(&self) -> Option<&str> {
        self.shards
            .first()?
            .metadata()?
            .get("format")
            .map(String::as_str)
    }

    /// All tensor names over all shards, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.owner.keys().map(String::as_str).collect()
    }

    /// The .safetensors files of this checkpoint (one for a single-file checkpoint).
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

/// Refuses shard names that would leave the index's directory or are not a file name.
fn check_shard_name(index_path: &Path, tensor: &str, shard: &str) -> Result<()> {
    let mut parts = Path::new(shard).components();
    let plain = matches!(
        (parts.next(), parts.next()),
        (Some(Component::Normal(_)), None)
    ) && !shard.contains(['/', '\\']);
    if plain {
        Ok(())
    } else {
        Err(FormatError::new(
            index_path,
            format!(
                "weight_map entry for `{tensor}` names shard {shard:?}, which is not a plain file \
                 name in the index's directory (path separators and `..` are refused)"
            ),
        ))
    }
}

fn open_shard(index_path: &Path, shard_path: &Path) -> Result<SafetensorsFile> {
    match SafetensorsFile::open(shard_path) {
        Err(FormatError {
            kind: crate::ErrorKind::Io(e),
            ..
        }) => Err(FormatError::new(
            shard_path,
            format!(
                "shard listed in {} cannot be opened: {e}",
                index_path.display()
            ),
        )),
        other => other,
    }
}
