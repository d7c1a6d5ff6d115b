//! A bounds-checked little-endian reader over the file bytes.
//!
//! Every read first checks that enough bytes remain, so a truncated file turns into an error
//! that says what was being read and where, never a panic.

use crate::{FormatError, Result};
use std::path::Path;

pub(super) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8], path: &'a Path) -> Self {
        Cursor {
            bytes,
            pos: 0,
            path,
        }
    }

    pub fn pos(&self) -> u64 {
        self.pos as u64
    }

    pub fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// An error carrying this file's path.
    pub fn err(&self, msg: impl Into<String>) -> FormatError {
        FormatError::new(self.path, msg)
    }

    /// The next `n` bytes; `what` names the field for the error message.
    pub fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "unexpected end of file reading {} at offset {}: need {n} bytes, {} left",
                what(),
                self.pos,
                self.remaining()
            )));
        }
        // n <= remaining <= usize::MAX, so the cast is lossless.
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    pub fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.take(N as u64, what)?;
        // take returned exactly N bytes.
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    pub fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub fn u16(&mut self, what: &dyn Fn() -> String) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A `gguf_string`: u64 length then that many UTF-8 bytes. The length is checked against
    /// the bytes left before anything is allocated.
    pub fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let len = self.u64(&|| format!("length of {}", what()))?;
        if len > self.remaining() {
            return Err(self.err(format!(
                "unexpected end of file reading {} at offset {at}: string of {len} bytes, {} left",
                what(),
                self.remaining()
            )));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            self.err(format!(
                "{} at offset {at} is not valid UTF-8 ({e})",
                what()
            ))
        })
    }
}
