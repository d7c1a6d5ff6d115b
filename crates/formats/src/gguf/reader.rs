//! Parsing and validation of a whole GGUF file into a [`GgufFile`].
//!
//! The file is parsed once, front to back; metadata is copied into owned [`MetaValue`]s
//! (small), tensor data is never copied: [`GgufFile::tensor`] slices the backing bytes.

use super::cursor::Cursor;
use super::{
    checked_tensor_size, ggml_type_name, value_type, GgufTensorInfo, MetaValue, ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, MAX_META_ARRAY_ELEMENTS,
};
use crate::{FormatError, Result, TensorView};
use memmap2::Mmap;
use nibble_quant::DType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Fewest bytes a KV record can take: key length u64, value type u32, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Fewest bytes a tensor-info record can take: name length u64, n_dims u32 (0 dims),
/// type u32, offset u64.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// Most records preallocated for a count read from the file; beyond that vectors grow as
/// records are actually parsed, so memory tracks the bytes really present.
const MAX_PREALLOC: u64 = 1 << 12;

fn prealloc(count: u64) -> usize {
    count.min(MAX_PREALLOC) as usize
}

/// Where the file's bytes live.
enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed, validated GGUF file (see the module invariants in [`super`]).
pub struct GgufFile {
    path: PathBuf,
    backing: Backing,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The backing bytes and the whole metadata (tokenizer arrays) are far too big to print.
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-map and parse the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the map is read-only and lives as long as the GgufFile. Mapping is only
        // unsound if another process truncates or rewrites the file while it is mapped; model
        // files are treated as immutable while nibble runs (the same contract as llama.cpp's
        // mmap loader), and every offset is still bounds-checked against the mapped length.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        Self::parse(path.to_path_buf(), Backing::Mmap(map))
    }

    /// Parse a file already in memory; `path_for_errors` only labels error messages.
    pub fn from_bytes(path_for_errors: impl AsRef<Path>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(
            path_for_errors.as_ref().to_path_buf(),
            Backing::Owned(bytes),
        )
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All key/value pairs, in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// A zero-copy view of the tensor's bytes, or `None` if there is no such tensor.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = &self.tensors[*self.tensor_index.get(name)?];
        // parse() checked data_offset + offset + size <= file length, so these fit in usize.
        let start = (self.data_offset + info.offset) as usize;
        let end = start + info.size as usize;
        Some(TensorView {
            name: &info.name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            data: &self.backing.bytes()[start..end],
        })
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<GgufFile> {
        let bytes = backing.bytes();
        let mut cur = Cursor::new(bytes, &path);

        let magic = cur.array::<4>(&|| "magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(cur.err(format!(
                "not a GGUF file: magic is {magic:02x?} ({:?}), expected \"GGUF\"",
                String::from_utf8_lossy(&magic)
            )));
        }
        let version = cur.u32(&|| "version".into())?;
        check_version(&cur, version)?;
        let n_tensors = cur.u64(&|| "tensor count".into())?;
        let n_kv = cur.u64(&|| "metadata key/value count".into())?;
        // Bound both counts by what the rest of the file could hold, before any allocation.
        check_count(&cur, n_kv, MIN_KV_BYTES, "metadata key/value count")?;
        check_count(&cur, n_tensors, MIN_TENSOR_INFO_BYTES, "tensor count")?;

        // Preallocate only a little: a record in memory is several times its minimum size on
        // disk, so even a count bounded by the file size could ask for too much up front.
        let mut metadata = Vec::with_capacity(prealloc(n_kv));
        let mut key_index = HashMap::with_capacity(prealloc(n_kv));
        let mut array_budget = MAX_META_ARRAY_ELEMENTS;
        for i in 0..n_kv {
            let at = cur.pos();
            let key = cur.string(&|| format!("metadata key #{i}"))?;
            if key_index.contains_key(&key) {
                return Err(cur.err(format!("duplicate metadata key '{key}' at offset {at}")));
            }
            let ty = cur.u32(&|| format!("value type of metadata key '{key}'"))?;
            let value = read_value(&mut cur, ty, &key, &mut array_budget)?;
            key_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let alignment = match key_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(MetaValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(MetaValue::U32(a)) => {
                return Err(cur.err(format!(
                    "{ALIGNMENT_KEY} must be a non-zero power of two, got {a}"
                )))
            }
            Some(v) => {
                return Err(cur.err(format!(
                    "{ALIGNMENT_KEY} must be of type UINT32, found {}",
                    v.type_name()
                )))
            }
        };

        // Re-check against the bytes actually left after the metadata.
        check_count(&cur, n_tensors, MIN_TENSOR_INFO_BYTES, "tensor count")?;
        let mut tensors = Vec::with_capacity(prealloc(n_tensors));
        let mut tensor_index = HashMap::with_capacity(prealloc(n_tensors));
        for i in 0..n_tensors {
            let info = read_tensor_info(&mut cur, i, alignment)?;
            if tensor_index.contains_key(&info.name) {
                return Err(cur.err(format!("duplicate tensor name '{}'", info.name)));
            }
            tensor_index.insert(info.name.clone(), tensors.len());
            tensors.push(info);
        }

        // The data section starts at the first aligned offset after the infos. pos <= file
        // length and alignment <= 2^31, so this cannot overflow.
        let data_offset = cur.pos().next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|start| start.checked_add(t.size))
                .ok_or_else(|| {
                    cur.err(format!(
                        "tensor '{}': offset {} + size {} overflows u64",
                        t.name, t.offset, t.size
                    ))
                })?;
            if end > file_len {
                return Err(cur.err(format!(
                    "tensor '{}': data [{}, {end}) extends past end of file ({file_len} bytes)",
                    t.name,
                    data_offset + t.offset
                )));
            }
        }

        Ok(GgufFile {
            path,
            backing,
            version,
            alignment,
            data_offset,
            metadata,
            key_index,
            tensors,
            tensor_index,
        })
    }
}

fn check_version(cur: &Cursor<'_>, version: u32) -> Result<()> {
    match version {
        2 | 3 => Ok(()),
        1 => {
            Err(cur
                .err("GGUF version 1 is obsolete and not supported (supported: 2, 3)".to_string()))
        }
        // A big-endian file has the version in the high bytes when read as little-endian;
        // real versions are tiny, so zero low 16 bits mean the byte order is swapped.
        v if v != 0 && v & 0xffff == 0 => Err(cur.err(format!(
            "big-endian GGUF file (version field reads {v:#010x} little-endian, \
             i.e. version {} big-endian); only little-endian files are supported",
            v.swap_bytes()
        ))),
        v => Err(cur.err(format!("unsupported GGUF version {v} (supported: 2, 3)"))),
    }
}

/// Reject a count of items that cannot possibly fit in the bytes left.
fn check_count(cur: &Cursor<'_>, count: u64, min_item_bytes: u64, what: &str) -> Result<()> {
    let max = cur.remaining() / min_item_bytes;
    if count > max {
        return Err(cur.err(format!(
            "{what} {count} is impossible: each item needs at least {min_item_bytes} bytes \
             and only {} bytes are left",
            cur.remaining()
        )));
    }
    Ok(())
}

/// One metadata value of type id `ty` belonging to `key`.
fn read_value(cur: &mut Cursor<'_>, ty: u32, key: &str, budget: &mut u64) -> Result<MetaValue> {
    use value_type as t;
    let what = || format!("value of metadata key '{key}'");
    Ok(match ty {
        t::U8 => MetaValue::U8(cur.u8(&what)?),
        t::I8 => MetaValue::I8(cur.u8(&what)? as i8),
        t::U16 => MetaValue::U16(cur.u16(&what)?),
        t::I16 => MetaValue::I16(cur.u16(&what)? as i16),
        t::U32 => MetaValue::U32(cur.u32(&what)?),
        t::I32 => MetaValue::I32(cur.u32(&what)? as i32),
        t::F32 => MetaValue::F32(f32::from_bits(cur.u32(&what)?)),
        t::U64 => MetaValue::U64(cur.u64(&what)?),
        t::I64 => MetaValue::I64(cur.u64(&what)? as i64),
        t::F64 => MetaValue::F64(f64::from_bits(cur.u64(&what)?)),
        t::BOOL => match cur.u8(&what)? {
            0 => MetaValue::Bool(false),
            1 => MetaValue::Bool(true),
            b => {
                return Err(cur.err(format!(
                    "metadata key '{key}': bool byte is {b} (must be 0 or 1)"
                )))
            }
        },
        t::STRING => MetaValue::String(cur.string(&what)?),
        t::ARRAY => read_array(cur, key, budget)?,
        _ => return Err(cur.err(format!("metadata key '{key}' has unknown value type {ty}"))),
    })
}

fn read_array(cur: &mut Cursor<'_>, key: &str, budget: &mut u64) -> Result<MetaValue> {
    let elem_ty = cur.u32(&|| format!("array element type of metadata key '{key}'"))?;
    let count = cur.u64(&|| format!("array length of metadata key '{key}'"))?;
    let Some(elem_name) = value_type::name(elem_ty) else {
        return Err(cur.err(format!(
            "metadata key '{key}': array has unknown element type {elem_ty}"
        )));
    };
    if elem_ty == value_type::ARRAY {
        // ggml rejects these too; no model uses them.
        return Err(cur.err(format!(
            "metadata key '{key}': nested arrays are not supported"
        )));
    }
    let min = value_type::min_size(elem_ty);
    if count > cur.remaining() / min {
        return Err(cur.err(format!(
            "metadata key '{key}': array of {count} {elem_name} elements cannot fit in the {} \
             bytes left",
            cur.remaining()
        )));
    }
    if count > *budget {
        return Err(cur.err(format!(
            "metadata key '{key}': array of {count} elements exceeds the limit of \
             {MAX_META_ARRAY_ELEMENTS} metadata array elements per file"
        )));
    }
    *budget -= count;
    // count is bounded by both the bytes left and the element budget.
    let mut items = Vec::with_capacity(prealloc(count));
    for _ in 0..count {
        items.push(read_value(cur, elem_ty, key, budget)?);
    }
    Ok(MetaValue::Array(items))
}

/// Tensor-info record number `index`, with its shape, type and offset validated.
fn read_tensor_info(cur: &mut Cursor<'_>, index: u64, alignment: u64) -> Result<GgufTensorInfo> {
    let name = cur.string(&|| format!("name of tensor #{index}"))?;
    let n_dims = cur.u32(&|| format!("n_dims of tensor '{name}'"))?;
    if n_dims as usize > MAX_DIMS {
        return Err(cur.err(format!(
            "tensor '{name}': n_dims {n_dims} exceeds the maximum of {MAX_DIMS}"
        )));
    }
    let mut shape = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        shape.push(cur.u64(&|| format!("dim {d} of tensor '{name}'"))?);
    }
    // GGUF lists dims innermost first; ours are row-major.
    shape.reverse();
    let type_id = cur.u32(&|| format!("type of tensor '{name}'"))?;
    let offset = cur.u64(&|| format!("offset of tensor '{name}'"))?;
    let dtype = DType::from_ggml_id(type_id).map_err(|_| {
        cur.err(match ggml_type_name(type_id) {
            Some(n) => format!("tensor '{name}': ggml type {type_id} ({n}) is not supported"),
            None => format!("tensor '{name}': unknown ggml type id {type_id}"),
        })
    })?;
    let size = checked_tensor_size(dtype, &shape)
        .map_err(|msg| cur.err(format!("tensor '{name}': {msg}")))?;
    if !offset.is_multiple_of(alignment) {
        return Err(cur.err(format!(
            "tensor '{name}': offset {offset} is not a multiple of the alignment {alignment}"
        )));
    }
    Ok(GgufTensorInfo {
        name,
        dtype,
        shape,
        offset,
        size,
    })
}
