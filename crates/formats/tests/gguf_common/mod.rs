//! Shared by the GGUF integration tests: a tiny GGUF file built byte by byte from the spec
//! (no use of the writer), with the byte range of every field recorded so tests can mutate it.
#![allow(dead_code)] // each test binary uses a different part of this module

use std::collections::HashMap;
use std::ops::Range;

/// Little-endian byte pusher that remembers where named fields lie.
#[derive(Default)]
pub struct Builder {
    pub bytes: Vec<u8>,
    pub marks: HashMap<&'static str, Range<usize>>,
}

impl Builder {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(b);
        self
    }
    /// gguf_string: u64 length + bytes, no NUL.
    pub fn string(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    /// Record the byte range written by `f` under `name`.
    pub fn mark(&mut self, name: &'static str, f: impl FnOnce(&mut Self)) -> &mut Self {
        let start = self.bytes.len();
        f(self);
        let end = self.bytes.len();
        self.marks.insert(name, start..end);
        self
    }
    pub fn pad_to(&mut self, align: usize) -> &mut Self {
        while !self.bytes.len().is_multiple_of(align) {
            self.bytes.push(0);
        }
        self
    }
}

/// The six f32 values of tensor `a.weight` (row-major [2, 3]).
pub const A_VALUES: [f32; 6] = [1.5, -2.25, 3.0, 0.125, -7.5, 1e-3];

/// The Q4_0 block of tensor `b.weight`: scale 0.5 (f16 0x3800), byte j = j | (15 - j) << 4.
pub fn b_block() -> Vec<u8> {
    let mut blk = vec![0x00, 0x38];
    blk.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    blk
}

/// Element `j` of `b.weight` once dequantized (low nibbles hold 0..16, high nibbles 16..32).
pub fn b_expected(j: usize) -> f32 {
    let q = if j < 16 { j } else { 15 - (j - 16) };
    (q as f32 - 8.0) * 0.5
}

/// A valid GGUF v3 file:
/// - 6 KVs: general.architecture = "qwen3moe" (STRING), qwen3moe.block_count = 48 (UINT32),
///   qwen3moe.rope.freq_base = 1e6 (FLOAT32), tokenizer.ggml.add_bos_token = false (BOOL),
///   tokenizer.ggml.token_type = [1, 3, 4] (ARRAY of INT32), general.alignment = 32 (UINT32);
/// - 2 tensors: `a.weight` F32 GGUF dims [3, 2] (row-major [2, 3]) at offset 0 (24 bytes),
///   `b.weight` Q4_0 GGUF dims [32, 1] (row-major [1, 32]) at offset 32 (18 bytes);
/// - padding to 32 after the infos and after a.weight; the file ends right after b.weight, so
///   every truncation removes needed bytes.
pub fn handmade() -> Builder {
    let mut b = Builder::default();
    b.mark("magic", |b| {
        b.raw(b"GGUF");
    })
    .mark("version", |b| {
        b.u32(3);
    })
    .mark("n_tensors", |b| {
        b.u64(2);
    })
    .mark("n_kv", |b| {
        b.u64(6);
    });

    b.mark("kv0", |b| {
        b.mark("kv0.key", |b| {
            b.string("general.architecture");
        })
        .u32(8)
        .string("qwen3moe");
    });
    b.mark("kv1", |b| {
        b.mark("kv1.key", |b| {
            b.string("qwen3moe.block_count");
        })
        .mark("kv1.type", |b| {
            b.u32(4);
        })
        .mark("kv1.value", |b| {
            b.u32(48);
        });
    });
    b.string("qwen3moe.rope.freq_base").u32(6).f32(1e6);
    b.string("tokenizer.ggml.add_bos_token")
        .u32(7)
        .mark("kv3.value", |b| {
            b.u8(0);
        });
    b.string("tokenizer.ggml.token_type")
        .u32(9)
        .mark("kv4.elem_type", |b| {
            b.u32(5);
        })
        .mark("kv4.count", |b| {
            b.u64(3);
        })
        .i32(1)
        .i32(3)
        .i32(4);
    b.string("general.alignment")
        .mark("kv5.type", |b| {
            b.u32(4);
        })
        .mark("kv5.value", |b| {
            b.u32(32);
        });

    b.mark("t0", |b| {
        b.mark("t0.name", |b| {
            b.string("a.weight");
        })
        .mark("t0.n_dims", |b| {
            b.u32(2);
        })
        .mark("t0.dims", |b| {
            b.u64(3).u64(2);
        })
        .mark("t0.type", |b| {
            b.u32(0);
        })
        .mark("t0.offset", |b| {
            b.u64(0);
        });
    });
    b.mark("t1", |b| {
        b.mark("t1.name", |b| {
            b.string("b.weight");
        })
        .u32(2)
        .mark("t1.dims", |b| {
            b.u64(32).u64(1);
        })
        .mark("t1.type", |b| {
            b.u32(2);
        })
        .mark("t1.offset", |b| {
            b.u64(32);
        });
    });
    b.pad_to(32);

    let data_start = b.bytes.len();
    b.marks.insert("data", data_start..data_start);
    b.mark("a.data", |b| {
        for v in A_VALUES {
            b.f32(v);
        }
    });
    b.pad_to(32);
    b.mark("b.data", |b| {
        b.raw(&b_block());
    });
    b
}
