//! GGUF v3 reader and writer (see formats-spec §2). Placeholder: being written.

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
