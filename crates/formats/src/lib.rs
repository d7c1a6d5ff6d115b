//! Model file formats. This tier only parses: it knows byte layouts, never what a tensor means.
//!
//! Readers memory-map the file and hand out [`TensorView`]s that borrow from the map (zero copy).
//! Every offset and size read from a file is checked against the file length with overflow-safe
//! arithmetic before any slice is taken, so a truncated or lying file yields a
//! [`FormatError`] naming the file and the problem, never a panic or an out-of-bounds read.
//!
//! Shapes in [`TensorView`] are always row-major, outermost dimension first (PyTorch order),
//! whatever the file stores: GGUF lists dimensions innermost first, so its reader reverses them.

pub mod gguf;
pub mod safetensors;

use nibble_quant::DType;
use std::path::{Path, PathBuf};

/// A tensor inside a mapped file: no bytes are copied.
#[derive(Debug, Clone)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    /// Row-major shape, outermost first (e.g. `[out, in]` for a linear weight).
    pub shape: Vec<u64>,
    /// Exactly `dtype.byte_size(product(shape))` bytes.
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements (product of the shape).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Everything that can be wrong with a model file. Every message names the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {kind}")]
pub struct FormatError {
    pub path: PathBuf,
    pub kind: ErrorKind,
}

/// The problem itself, without the file name.
#[derive(Debug, thiserror::Error)]
pub enum ErrorKind {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Invalid(String),
}

impl FormatError {
    pub fn new(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        FormatError {
            path: path.as_ref().to_path_buf(),
            kind: ErrorKind::Invalid(msg.into()),
        }
    }
    pub fn io(path: impl AsRef<Path>, e: std::io::Error) -> Self {
        FormatError {
            path: path.as_ref().to_path_buf(),
            kind: ErrorKind::Io(e),
        }
    }
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
