//! Streaming GGUF v3 writer.
//!
//! [`GgufWriter::new`] validates everything it can up front (unique keys and names, homogeneous
//! non-nested arrays, a valid `general.alignment`, shapes that fit their types), computes every
//! tensor's offset, and writes the header, metadata, tensor infos and padding. Tensor bytes then
//! arrive one tensor at a time in info order, so the whole file never sits in memory. The
//! layout is exactly what ggml writes (offsets = running sum of aligned sizes, zero padding after
//! every tensor), so llama.cpp's strict reader accepts the result.
//!
//! Empty arrays carry no element type in [`MetaValue`]; they are written as arrays of UINT8.

use super::{
    checked_tensor_size, value_type, MetaValue, TensorSpec, ALIGNMENT_KEY, DEFAULT_ALIGNMENT,
    GGUF_MAGIC, GGUF_VERSION, MAX_META_ARRAY_ELEMENTS, MAX_TENSOR_NAME_BYTES,
};
use crate::{FormatError, Result};
use std::collections::HashSet;
use std::io::Write;

/// Label used as the "path" of writer errors.
const WRITER_PATH: &str = "<gguf writer>";

fn err(msg: impl Into<String>) -> FormatError {
    FormatError::new(WRITER_PATH, msg)
}

/// One tensor still to be written: its name and exact byte size.
struct Pending {
    name: String,
    size: u64,
}

/// Writes one GGUF file to `W` (see the module docs for the protocol).
pub struct GgufWriter<W: Write> {
    out: W,
    alignment: u64,
    tensors: Vec<Pending>,
    /// Index of the next tensor `write_tensor` expects.
    next: usize,
    /// Set after an I/O error: the stream is then in an unknown state.
    failed: bool,
}

impl<W: Write> GgufWriter<W> {
    /// Validate the metadata and tensor list, then write everything up to the data section.
    pub fn new(
        out: W,
        metadata: Vec<(String, MetaValue)>,
        tensors: Vec<TensorSpec>,
    ) -> Result<Self> {
        let alignment = validate_metadata(&metadata)?;

        // header: magic, version, counts; then KVs, then infos, padded to the alignment.
        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC);
        head.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in &metadata {
            put_string(&mut head, key);
            head.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut head, value);
        }

        let mut names = HashSet::with_capacity(tensors.len());
        let mut pending = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in &tensors {
            if t.name.len() > MAX_TENSOR_NAME_BYTES {
                return Err(err(format!(
                    "tensor name '{}' is {} bytes, longer than ggml's limit of \
                     {MAX_TENSOR_NAME_BYTES}",
                    t.name,
                    t.name.len()
                )));
            }
            if !names.insert(t.name.as_str()) {
                return Err(err(format!("duplicate tensor name '{}'", t.name)));
            }
            let size = checked_tensor_size(t.dtype, &t.shape)
                .map_err(|m| err(format!("tensor '{}': {m}", t.name)))?;
            let type_id = t.dtype.ggml_id().ok_or_else(|| {
                err(format!(
                    "tensor '{}': type {} has no GGUF type id",
                    t.name,
                    t.dtype.name()
                ))
            })?;
            put_string(&mut head, &t.name);
            head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            // GGUF lists dims innermost first.
            for d in t.shape.iter().rev() {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&type_id.to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            pending.push(Pending {
                name: t.name.clone(),
                size,
            });
            offset = size
                .checked_next_multiple_of(alignment)
                .and_then(|s| offset.checked_add(s))
                .ok_or_else(|| err("total tensor data size overflows u64"))?;
        }
        let padded = (head.len() as u64).next_multiple_of(alignment);
        head.resize(padded as usize, 0);

        let mut w = GgufWriter {
            out,
            alignment,
            tensors: pending,
            next: 0,
            failed: false,
        };
        w.write_all(&head)?;
        Ok(w)
    }

    /// Write the bytes of the next tensor (it must be named `name`) and its padding.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        if self.failed {
            return Err(err("an earlier write failed; the output is incomplete"));
        }
        let Some(expected) = self.tensors.get(self.next) else {
            return Err(err(format!(
                "tensor '{name}' written but all {} tensors are already written",
                self.tensors.len()
            )));
        };
        if expected.name != name {
            return Err(err(format!(
                "tensor '{name}' written out of order: expected '{}' next",
                expected.name
            )));
        }
        if bytes.len() as u64 != expected.size {
            return Err(err(format!(
                "tensor '{name}': got {} bytes, its shape and type need {}",
                bytes.len(),
                expected.size
            )));
        }
        let pad = expected.size.next_multiple_of(self.alignment) - expected.size;
        self.write_all(bytes)?;
        // pad < alignment <= 2^31.
        self.write_all(&vec![0u8; pad as usize])?;
        self.next += 1;
        Ok(())
    }

    /// Check that every tensor was written, flush, and hand back the output.
    pub fn finish(mut self) -> Result<W> {
        if self.failed {
            return Err(err("an earlier write failed; the output is incomplete"));
        }
        if let Some(missing) = self.tensors.get(self.next) {
            return Err(err(format!(
                "finish() called with {} of {} tensors unwritten (next: '{}')",
                self.tensors.len() - self.next,
                self.tensors.len(),
                missing.name
            )));
        }
        self.out
            .flush()
            .map_err(|e| FormatError::io(WRITER_PATH, e))?;
        Ok(self.out)
    }

    fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).map_err(|e| {
            self.failed = true;
            FormatError::io(WRITER_PATH, e)
        })
    }
}

/// Check keys and values; returns the alignment to use.
fn validate_metadata(metadata: &[(String, MetaValue)]) -> Result<u64> {
    let mut keys = HashSet::with_capacity(metadata.len());
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut array_elements = 0u64;
    for (key, value) in metadata {
        if !keys.insert(key.as_str()) {
            return Err(err(format!("duplicate metadata key '{key}'")));
        }
        if let MetaValue::Array(items) = value {
            // The reader refuses files over this cap; do not write one it would refuse.
            array_elements += items.len() as u64;
            if array_elements > MAX_META_ARRAY_ELEMENTS {
                return Err(err(format!(
                    "metadata arrays hold more than {MAX_META_ARRAY_ELEMENTS} elements in total"
                )));
            }
            let Some(first) = items.first() else { continue };
            if matches!(first, MetaValue::Array(_)) {
                return Err(err(format!(
                    "metadata key '{key}': nested arrays are not supported"
                )));
            }
            if let Some(odd) = items.iter().find(|v| v.type_id() != first.type_id()) {
                return Err(err(format!(
                    "metadata key '{key}': array mixes {} and {} elements",
                    first.type_name(),
                    odd.type_name()
                )));
            }
        }
        if key == ALIGNMENT_KEY {
            alignment = match value {
                MetaValue::U32(a) if a.is_power_of_two() => u64::from(*a),
                MetaValue::U32(a) => {
                    return Err(err(format!(
                        "{ALIGNMENT_KEY} must be a non-zero power of two, got {a}"
                    )))
                }
                v => {
                    return Err(err(format!(
                        "{ALIGNMENT_KEY} must be of type UINT32, found {}",
                        v.type_name()
                    )))
                }
            };
        }
    }
    Ok(alignment)
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

/// Append the encoding of `value` (without its type id).
fn put_value(buf: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => buf.push(*v),
        MetaValue::I8(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => buf.push(u8::from(*v)),
        MetaValue::String(s) => put_string(buf, s),
        MetaValue::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Array(items) => {
            let elem = items.first().map_or(value_type::U8, MetaValue::type_id);
            buf.extend_from_slice(&elem.to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(buf, item);
            }
        }
    }
}
