//! GGUF v3 reader and streaming writer (formats-spec §3).
//!
//! Layout: magic `GGUF`, version u32, tensor count u64, key/value count u64, the key/value
//! records, the tensor-info records, zero padding up to the alignment, then the data section.
//! Everything is little-endian; big-endian files are detected and rejected.
//!
//! Invariants the reader guarantees for every [`GgufFile`] it hands out:
//! - metadata keys and tensor names are unique, valid UTF-8;
//! - every array is homogeneous and not nested (like ggml, nested arrays are rejected);
//! - every tensor's innermost dimension is a whole number of blocks of its type, its byte size
//!   is `dtype.byte_size(elements)`, its offset is a multiple of the alignment and its bytes
//!   lie inside the file, so [`GgufFile::tensor`] can slice without further checks.
//!
//! Shapes are stored in [`GgufTensorInfo`] row-major, outermost first: GGUF lists dimensions
//! innermost first and the reader reverses them (the memory order is the same, §3.2).
//!
//! Untrusted counts are never used to size an allocation: each count is first bounded by the
//! bytes left in the file (every item needs a known minimum number of bytes), and the total
//! number of metadata array elements is capped at [`MAX_META_ARRAY_ELEMENTS`], because one
//! in-memory [`MetaValue`] is much larger than its one-byte encoding.

mod cursor;
mod reader;
mod writer;

pub use reader::GgufFile;
pub use writer::GgufWriter;

use nibble_quant::DType;

/// `GGUF` as it appears in the first four bytes of the file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Version written by [`GgufWriter`]; the reader also accepts 2 (same structure).
pub const GGUF_VERSION: u32 = 3;
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Key holding a non-default alignment (must be UINT32).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// ggml's `GGML_MAX_NAME` minus the NUL: longer tensor names do not load in llama.cpp, so the
/// writer refuses them (the reader is tolerant).
pub const MAX_TENSOR_NAME_BYTES: usize = 63;
/// Cap on the total number of elements of all metadata arrays of one file. A real model's
/// tokenizer needs well under a million per array; the cap stops a small file from asking for
/// gigabytes of `MetaValue`s (each one is 32 bytes in memory).
pub const MAX_META_ARRAY_ELEMENTS: u64 = 1 << 24;

/// One metadata value, with its GGUF type.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Homogeneous array; all items share one GGUF type (checked by reader and writer).
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// GGUF value type ids (spec §3.1 table); the order matches the `MetaValue` variants.
pub(crate) mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;

    /// Spec name of a value type id, or `None` if the id is unknown.
    pub fn name(id: u32) -> Option<&'static str> {
        const NAMES: [&str; 13] = [
            "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING",
            "ARRAY", "UINT64", "INT64", "FLOAT64",
        ];
        NAMES.get(id as usize).copied()
    }

    /// Fewest bytes one value of this type can take (a string is at least its u64 length;
    /// an array at least its u32 type and u64 count).
    pub fn min_size(id: u32) -> u64 {
        match id {
            U8 | I8 | BOOL => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | STRING => 8,
            _ => 12,
        }
    }
}

impl MetaValue {
    /// The GGUF value type id of this value.
    pub(crate) fn type_id(&self) -> u32 {
        use value_type as t;
        match self {
            MetaValue::U8(_) => t::U8,
            MetaValue::I8(_) => t::I8,
            MetaValue::U16(_) => t::U16,
            MetaValue::I16(_) => t::I16,
            MetaValue::U32(_) => t::U32,
            MetaValue::I32(_) => t::I32,
            MetaValue::F32(_) => t::F32,
            MetaValue::Bool(_) => t::BOOL,
            MetaValue::String(_) => t::STRING,
            MetaValue::Array(_) => t::ARRAY,
            MetaValue::U64(_) => t::U64,
            MetaValue::I64(_) => t::I64,
            MetaValue::F64(_) => t::F64,
        }
    }

    /// GGUF spec name of the type (`UINT32`, `STRING`, `ARRAY`, ...), for error messages.
    pub fn type_name(&self) -> &'static str {
        // Every variant has an id in the table, so the fallback is never taken.
        value_type::name(self.type_id()).unwrap_or("UNKNOWN")
    }

    /// Any integer type holding a non-negative value (llama.cpp writes most counts as UINT32,
    /// some as INT32, the spec recommends UINT64: callers should not care).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// FLOAT32 or FLOAT64 (integers are not silently converted: a float key stored as an
    /// integer is a malformed file worth noticing).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor-info record, validated (see the module invariants).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub dtype: DType,
    /// Row-major, outermost first (= the GGUF dims reversed).
    pub shape: Vec<u64>,
    /// Byte offset relative to the start of the data section.
    pub offset: u64,
    /// Byte size: `dtype.byte_size(product(shape))`.
    pub size: u64,
}

/// A tensor to be written by [`GgufWriter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    /// Row-major, outermost first; the writer reverses it into GGUF order.
    pub shape: Vec<u64>,
}

/// Why a tensor's shape cannot be stored with its type; shared by reader and writer.
/// Returns the byte size. `shape` is row-major (innermost dimension last).
pub(crate) fn checked_tensor_size(dtype: DType, shape: &[u64]) -> Result<u64, String> {
    if shape.len() > MAX_DIMS {
        return Err(format!(
            "n_dims {} exceeds the maximum of {MAX_DIMS}",
            shape.len()
        ));
    }
    if let Some(&d) = shape.iter().find(|&&d| d > i64::MAX as u64) {
        // ggml reads dims as int64 and rejects negatives.
        return Err(format!("dimension {d} is negative as int64"));
    }
    let block = dtype.layout().block_elems;
    // A 0-dim tensor is a scalar: one element in one row of length 1.
    let row = shape.last().copied().unwrap_or(1);
    if !row.is_multiple_of(block) {
        return Err(format!(
            "row length {row} (innermost dim) is not a multiple of the {} block size {block}",
            dtype.name()
        ));
    }
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("element count of shape {shape:?} overflows u64"))?;
    dtype.byte_size(elements).map_err(|e| e.to_string())
}

/// Name of a ggml type id per the spec's table (§3.3), so that an unsupported but real type
/// (say Q3_K) is reported by name rather than as a bare number.
pub(crate) fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_accessors_cross_widths() {
        assert_eq!(MetaValue::U32(48).as_u64(), Some(48));
        assert_eq!(MetaValue::I32(48).as_u64(), Some(48));
        assert_eq!(MetaValue::I8(-3).as_u64(), None);
        assert_eq!(MetaValue::I8(-3).as_i64(), Some(-3));
        assert_eq!(MetaValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(MetaValue::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(MetaValue::F32(1.5).as_u64(), None);
        assert_eq!(MetaValue::F32(1.5).as_f64(), Some(1.5));
        assert_eq!(MetaValue::U8(1).as_f64(), None);
        assert_eq!(MetaValue::Bool(true).as_bool(), Some(true));
        assert_eq!(MetaValue::String("x".into()).as_str(), Some("x"));
        assert_eq!(MetaValue::U8(1).as_str(), None);
        let arr = MetaValue::Array(vec![MetaValue::I32(7)]);
        assert_eq!(arr.as_array(), Some(&[MetaValue::I32(7)][..]));
        assert_eq!(arr.type_name(), "ARRAY");
        assert_eq!(MetaValue::F64(0.0).type_name(), "FLOAT64");
        assert_eq!(MetaValue::U32(0).type_name(), "UINT32");
    }

    #[test]
    fn tensor_size_rules() {
        assert_eq!(checked_tensor_size(DType::Q4_0, &[3, 64]), Ok(3 * 2 * 18));
        assert_eq!(checked_tensor_size(DType::F32, &[]), Ok(4));
        assert_eq!(checked_tensor_size(DType::F16, &[0, 5]), Ok(0));
        let e = checked_tensor_size(DType::Q8_0, &[2, 33]).unwrap_err();
        assert!(e.contains("row length 33"), "{e}");
        let e = checked_tensor_size(DType::F32, &[1, 1, 1, 1, 1]).unwrap_err();
        assert!(e.contains("n_dims 5"), "{e}");
        let e = checked_tensor_size(DType::F32, &[1 << 40, 1 << 40]).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
        let e = checked_tensor_size(DType::F32, &[1 << 62]).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
    }
}
