//! safetensors: one file ([`SafetensorsFile`]), a Hugging Face checkpoint of one file or of
//! shards plus `model.safetensors.index.json` ([`SafetensorsModel`]), and a lazy writer
//! ([`write_model`]).
//!
//! File layout (spec §2.1): an 8-byte little-endian header length `N`, `N` bytes of JSON
//! header, then the byte buffer; every tensor's `data_offsets` are relative to the buffer.
//!
//! Invariants of an opened [`SafetensorsFile`]:
//! - The header was parsed and validated by the `safetensors` crate (`Metadata`): offsets are
//!   contiguous from 0 with no holes or overlaps, and each tensor's byte range is exactly
//!   `product(shape) × element size`, computed with overflow checks.
//! - The last tensor ends exactly at the end of the file (checked here with checked arithmetic;
//!   see `parse_header` for why this check is not left to the crate).
//! - Only F32, F16 and BF16 tensors can be viewed as floats (`tensor`); `raw` gives any tensor's
//!   bytes with its dtype name and shape (MLX's U32 words). Other dtypes (I64, F8, ...) do not
//!   stop a file from opening; asking for such a tensor as floats returns an error naming its
//!   dtype.
//!   An unknown dtype *string* is a malformed header and fails at open.
//! - Views borrow the memory map: no tensor byte is copied.

#[cfg(test)]
mod bad_input_tests;
mod sharded;
#[cfg(test)]
mod tests;
mod write;

pub use sharded::SafetensorsModel;
pub use write::{write_model, write_model_as, Element, TensorSpec};

use crate::{FormatError, Result, TensorView};
use ::safetensors::tensor::{Metadata, TensorInfo};
use ::safetensors::Dtype;
use memmap2::Mmap;
use nibble_quant::DType;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// Largest header the reference reader accepts (the `safetensors` crate's private
/// `MAX_HEADER_SIZE`); checked before any slice so a lying length costs nothing.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Size of the little-endian u64 that starts every file.
const LEN_PREFIX: usize = 8;

/// Where the file's bytes live: a read-only map for real files, a vector for tests and fuzzing.
enum Backing {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One .safetensors file, memory-mapped (or owned bytes for tests/fuzz).
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: Backing,
    /// Absolute file offset of the byte buffer (`8 + N`).
    data_start: usize,
    /// Tensor names in file order (ascending data offset).
    names: Vec<String>,
    /// Parallel to `names`: dtype, shape and buffer-relative byte range of each tensor.
    infos: Vec<TensorInfo>,
    /// Name -> index into `names`/`infos`.
    index: HashMap<String, usize>,
    metadata: Option<HashMap<String, String>>,
}

impl SafetensorsFile {
    /// Memory-maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the map is read-only and we never hand out anything but shared slices of it.
        // The remaining hazard is another process truncating or rewriting the file while it is
        // mapped (SIGBUS or changing bytes under validated offsets); checkpoints must not be
        // modified while a model is loaded. Writers in this crate replace files by rename,
        // which leaves an existing map intact.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        Self::from_backing(path, Backing::Map(map))
    }

    /// Parses a file already in memory; `path_for_errors` only labels error messages.
    pub fn from_bytes(path_for_errors: impl AsRef<Path>, bytes: Vec<u8>) -> Result<Self> {
        Self::from_backing(path_for_errors.as_ref(), Backing::Owned(bytes))
    }

    fn from_backing(path: &Path, bytes: Backing) -> Result<Self> {
        let (data_start, meta) = parse_header(&bytes).map_err(|msg| FormatError::new(path, msg))?;
        let names = meta.offset_keys();
        let mut infos = Vec::with_capacity(names.len());
        let mut index = HashMap::with_capacity(names.len());
        for (i, name) in names.iter().enumerate() {
            let info = meta.info(name).ok_or_else(|| {
                FormatError::new(path, format!("tensor `{name}` vanished from the header"))
            })?;
            infos.push(info.clone());
            index.insert(name.clone(), i);
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            bytes,
            data_start,
            names,
            infos,
            index,
            metadata: meta.metadata().clone(),
        })
    }

    /// The path given at open (or to [`SafetensorsFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names in file order (ascending data offset), including tensors of dtypes that
    /// [`SafetensorsFile::tensor`] refuses.
    pub fn names(&self) -> Vec<&str> {
        self.names.iter().map(String::as_str).collect()
    }

    /// Whether the header lists `name` (whatever its dtype).
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// A zero-copy view of tensor `name`; `Ok(None)` if the file has no such tensor, an error
    /// if its dtype is not F32, F16 or BF16.
    pub fn tensor(&self, name: &str) -> Result<Option<TensorView<'_>>> {
        let Some((name, &i)) = self.index.get_key_value(name) else {
            return Ok(None);
        };
        let info = &self.infos[i];
        let dtype = map_dtype(info.dtype).ok_or_else(|| {
            FormatError::new(
                &self.path,
                format!(
                    "tensor `{name}` has dtype {}, which nibble does not read \
                     (supported: F32, F16, BF16)",
                    info.dtype
                ),
            )
        })?;
        let data = self.data(name, info)?;
        Ok(Some(TensorView {
            name,
            dtype,
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            data,
        }))
    }

    /// A zero-copy view of tensor `name` whatever its dtype, for the tensors [`Self::tensor`]
    /// refuses (MLX's packed `U32` integers); `Ok(None)` if the file has no such tensor.
    pub fn raw(&self, name: &str) -> Result<Option<RawView<'_>>> {
        let Some(&i) = self.index.get(name) else {
            return Ok(None);
        };
        let info = &self.infos[i];
        let data = self.data(name, info)?;
        Ok(Some(RawView {
            dtype: dtype_name(info.dtype),
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            data,
        }))
    }

    /// The bytes of tensor `name` (its header entry `info`). Validated at open; re-checked
    /// without panicking so a logic slip cannot read out of bounds.
    fn data(&self, name: &str, info: &TensorInfo) -> Result<&[u8]> {
        let (begin, end) = info.data_offsets;
        self.data_start
            .checked_add(begin)
            .zip(self.data_start.checked_add(end))
            .and_then(|(b, e)| self.bytes.get(b..e))
            .ok_or_else(|| {
                FormatError::new(
                    &self.path,
                    format!("tensor `{name}`: data_offsets [{begin}, {end}] outside the file"),
                )
            })
    }

    /// The header's `__metadata__` map, if present (HF PyTorch files: `{"format": "pt"}`).
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.metadata.as_ref()
    }
}

impl std::fmt::Debug for SafetensorsFile {
    // Hand-written so debugging output never dumps the mapped bytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.names.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// A tensor of any dtype as raw little-endian bytes (see [`SafetensorsFile::raw`]).
#[derive(Debug, Clone)]
pub struct RawView<'a> {
    /// The header's dtype string (`"U32"`, `"BF16"`, ...).
    pub dtype: &'static str,
    /// Row-major shape, outermost first.
    pub shape: Vec<u64>,
    /// Exactly `product(shape) × element size` bytes.
    pub data: &'a [u8],
}

/// The header spelling of a safetensors dtype.
fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::BOOL => "BOOL",
        Dtype::U8 => "U8",
        Dtype::I8 => "I8",
        Dtype::I16 => "I16",
        Dtype::U16 => "U16",
        Dtype::F16 => "F16",
        Dtype::BF16 => "BF16",
        Dtype::I32 => "I32",
        Dtype::U32 => "U32",
        Dtype::F32 => "F32",
        Dtype::F64 => "F64",
        Dtype::I64 => "I64",
        Dtype::U64 => "U64",
        _ => "other",
    }
}

/// The nibble dtype of a safetensors dtype, `None` for the ones nibble does not read.
fn map_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// The first entry of a header that is a JSON object but that `Metadata` refuses, named: the
/// crate's own errors for a size that disagrees with the shape and dtype, an unknown dtype or
/// an overflow do not say which tensor. `None` where nothing is found (the crate's message
/// stands).
fn diagnose(header: &[u8]) -> Option<String> {
    let serde_json::Value::Object(entries) = serde_json::from_slice(header).ok()? else {
        return None;
    };
    entries.into_iter().find_map(|(name, entry)| {
        if name == "__metadata__" {
            let map = serde_json::from_value::<HashMap<String, String>>(entry);
            return map.err().map(|e| format!("`__metadata__`: {e}"));
        }
        let info: TensorInfo = match serde_json::from_value(entry) {
            Ok(info) => info,
            Err(e) => return Some(format!("tensor `{name}`: {e}")),
        };
        let (begin, end) = info.data_offsets;
        let bits = (info.shape.iter().copied()).try_fold(info.dtype.bitsize(), usize::checked_mul);
        match bits {
            None => Some(format!(
                "tensor `{name}`: shape {:?} of {} overflows",
                info.shape, info.dtype
            )),
            // Offsets that run backwards are the crate's to name (it does).
            Some(b) if end >= begin && (b % 8 != 0 || end - begin != b / 8) => {
                let need = match b % 8 {
                    0 => format!("{} bytes", b / 8),
                    _ => format!("{b} bits (not a whole number of bytes)"),
                };
                Some(format!(
                    "tensor `{name}`: dtype {} and shape {:?} need {need} but data_offsets \
                     [{begin}, {end}] hold {} bytes",
                    info.dtype,
                    info.shape,
                    end - begin
                ))
            }
            Some(_) => None,
        }
    })
}

/// Validates the whole file and returns (absolute start of the byte buffer, parsed header).
///
/// The JSON header goes through the crate's `Metadata` deserializer, which performs all of
/// the reference validation (dtype names, shapes, offsets contiguous from 0, sizes match,
/// overflow). We do not call `SafeTensors::read_metadata` because its final check computes
/// `buffer_end + 8 + N` unchecked: a header whose offsets end near `usize::MAX` panics there
/// in debug builds and wraps in release. The length prefix and the final check are therefore
/// done here with checked arithmetic.
fn parse_header(bytes: &[u8]) -> std::result::Result<(usize, Metadata), String> {
    let Some(prefix) = bytes.get(..LEN_PREFIX) else {
        return Err(format!(
            "file is {} bytes, too short for the 8-byte header length that starts a safetensors file",
            bytes.len()
        ));
    };
    let mut le = [0u8; LEN_PREFIX];
    le.copy_from_slice(prefix);
    let n = u64::from_le_bytes(le);
    if n > MAX_HEADER_BYTES {
        return Err(format!(
            "header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a safetensors file?)"
        ));
    }
    // n <= 1e8 fits usize on every supported target; the add cannot overflow.
    let header_end = LEN_PREFIX + n as usize;
    let Some(header) = bytes.get(LEN_PREFIX..header_end) else {
        return Err(format!(
            "header length {n} runs past the end of the file ({} bytes)",
            bytes.len()
        ));
    };
    let meta: Metadata = serde_json::from_slice(header).map_err(|e| match diagnose(header) {
        Some(problem) => format!("invalid safetensors header: {problem}"),
        None => format!("invalid safetensors header JSON: {e}"),
    })?;
    let data_len = bytes.len() - header_end;
    let needed = meta.data_len();
    if needed > data_len {
        return Err(format!(
            "tensor data needs {needed} bytes after the header but the file has only {data_len} \
             (file truncated, or data_offsets past the end)"
        ));
    }
    if needed < data_len {
        return Err(format!(
            "{} unexpected bytes after the last tensor (tensors cover {needed} of {data_len} data bytes)",
            data_len - needed
        ));
    }
    Ok((header_end, meta))
}
