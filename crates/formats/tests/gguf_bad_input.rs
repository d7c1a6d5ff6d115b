//! Table of malformed GGUF files, each made by mutating the valid hand-built file, and the
//! error message each must produce.

mod gguf_common;

use gguf_common::{handmade, Builder};
use nibble_formats::gguf::GgufFile;
use nibble_quant::{dequantize, DType, QuantError};

/// Overwrite field `mark` with `new` (same length).
fn patch(mut b: Builder, mark: &str, new: &[u8]) -> Vec<u8> {
    let r = b.marks[mark].clone();
    assert_eq!(r.len(), new.len(), "patch of {mark} must keep its length");
    b.bytes[r].copy_from_slice(new);
    b.bytes
}

/// Overwrite bytes at `mark`'s start + `skip`.
fn poke(mut b: Builder, mark: &str, skip: usize, new: &[u8]) -> Vec<u8> {
    let at = b.marks[mark].start + skip;
    b.bytes[at..at + new.len()].copy_from_slice(new);
    b.bytes
}

fn cut(mut b: Builder, len: impl FnOnce(&Builder) -> usize) -> Vec<u8> {
    let n = len(&b);
    b.bytes.truncate(n);
    b.bytes
}

fn le32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn le64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn gguf_string(s: &[u8]) -> Vec<u8> {
    let mut v = le64(s.len() as u64);
    v.extend_from_slice(s);
    v
}

/// A file whose only KV is an array of `count` UINT8 that really has `count` bytes.
fn huge_u8_array(count: u64) -> Vec<u8> {
    let mut b = Builder::default();
    b.raw(b"GGUF").u32(3).u64(0).u64(1);
    b.string("big").u32(9).u32(0).u64(count);
    b.bytes.resize(b.bytes.len() + count as usize, 7);
    b.bytes
}

#[test]
fn malformed_files_are_rejected_with_clear_messages() {
    let h = handmade();
    let data = h.marks["data"].start;
    let kv1_at = h.marks["kv1"].start;
    let t0_at = h.marks["t0"].start;
    let mk = handmade;

    let big_endian = {
        let mut b = mk();
        for (mark, v) in [("version", 3u64), ("n_tensors", 2), ("n_kv", 6)] {
            let r = b.marks[mark].clone();
            let be = v.to_be_bytes();
            let n = r.len();
            b.bytes[r].copy_from_slice(&be[8 - n..]);
        }
        b.bytes
    };

    let rows: Vec<(&str, Vec<u8>, String)> =
        vec![
        ("empty file", vec![], "unexpected end of file reading magic at offset 0".into()),
        (
            "truncated in header",
            cut(mk(), |_| 12),
            "unexpected end of file reading tensor count at offset 8: need 8 bytes, 4 left".into(),
        ),
        (
            "truncated in a KV value",
            cut(mk(), |b| b.marks["kv1.value"].start + 2),
            "unexpected end of file reading value of metadata key 'qwen3moe.block_count'".into(),
        ),
        (
            "truncated in tensor infos",
            cut(mk(), |b| b.marks["t1.dims"].start + 4),
            "unexpected end of file reading dim 0 of tensor 'b.weight'".into(),
        ),
        (
            "truncated in data",
            cut(mk(), |b| b.marks["b.data"].start + 10),
            format!(
                "tensor 'b.weight': data [{}, {}) extends past end of file ({} bytes)",
                data + 32,
                data + 50,
                data + 42
            ),
        ),
        ("wrong magic", patch(mk(), "magic", b"GGUG"), "not a GGUF file: magic is".into()),
        ("unknown version", patch(mk(), "version", &le32(7)), "unsupported GGUF version 7".into()),
        ("version 1", patch(mk(), "version", &le32(1)), "GGUF version 1 is obsolete".into()),
        ("version 0", patch(mk(), "version", &le32(0)), "unsupported GGUF version 0".into()),
        ("big-endian", big_endian, "big-endian GGUF file".into()),
        (
            "tensor offset past end",
            patch(mk(), "t1.offset", &le64(1024)),
            format!("tensor 'b.weight': data [{}, {})", data + 1024, data + 1042),
        ),
        (
            "offset + size overflows u64",
            patch(mk(), "t1.offset", &le64(u64::MAX - 31)),
            "tensor 'b.weight': offset 18446744073709551584 + size 18 overflows u64".into(),
        ),
        (
            "misaligned offset",
            patch(mk(), "t1.offset", &le64(40)),
            "tensor 'b.weight': offset 40 is not a multiple of the alignment 32".into(),
        ),
        (
            "row length not a multiple of the block",
            patch(mk(), "t1.dims", &[le64(48), le64(1)].concat()),
            "tensor 'b.weight': row length 48 (innermost dim) is not a multiple of the Q4_0 \
             block size 32"
                .into(),
        ),
        (
            "n_dims 5",
            patch(mk(), "t0.n_dims", &le32(5)),
            "tensor 'a.weight': n_dims 5 exceeds the maximum of 4".into(),
        ),
        (
            "dims product overflows",
            patch(mk(), "t0.dims", &[le64(1 << 40), le64(1 << 40)].concat()),
            "tensor 'a.weight': element count of shape [1099511627776, 1099511627776] overflows"
                .into(),
        ),
        (
            "byte size overflows",
            patch(mk(), "t0.dims", &[le64(1 << 31), le64(1 << 31)].concat()),
            "tensor 'a.weight': F32: byte size of 4611686018427387904 elements overflows".into(),
        ),
        (
            "dim negative as int64",
            patch(mk(), "t0.dims", &[le64(3), le64(u64::MAX)].concat()),
            "tensor 'a.weight': dimension 18446744073709551615 is negative as int64".into(),
        ),
        (
            "unknown ggml type",
            patch(mk(), "t0.type", &le32(99)),
            "tensor 'a.weight': unknown ggml type id 99".into(),
        ),
        (
            "known but unsupported ggml type",
            patch(mk(), "t0.type", &le32(11)),
            "tensor 'a.weight': ggml type 11 (Q3_K) is not supported".into(),
        ),
        (
            "duplicate tensor name",
            patch(mk(), "t1.name", &gguf_string(b"a.weight")),
            "duplicate tensor name 'a.weight'".into(),
        ),
        (
            "duplicate key",
            patch(mk(), "kv1.key", &gguf_string(b"general.architecture")),
            format!("duplicate metadata key 'general.architecture' at offset {kv1_at}"),
        ),
        (
            "2^60 tensors",
            patch(mk(), "n_tensors", &le64(1 << 60)),
            "tensor count 1152921504606846976 is impossible".into(),
        ),
        (
            "2^60 keys",
            patch(mk(), "n_kv", &le64(1 << 60)),
            "metadata key/value count 1152921504606846976 is impossible".into(),
        ),
        (
            "2^40-byte string",
            poke(mk(), "kv0.key", 0, &le64(1 << 40)),
            "reading metadata key #0 at offset 24: string of 1099511627776 bytes".into(),
        ),
        (
            "array count 2^62",
            patch(mk(), "kv4.count", &le64(1 << 62)),
            "metadata key 'tokenizer.ggml.token_type': array of 4611686018427387904 INT32 \
             elements cannot fit"
                .into(),
        ),
        (
            "array over the element cap",
            huge_u8_array((1 << 24) + 1),
            "metadata key 'big': array of 16777217 elements exceeds the limit".into(),
        ),
        (
            "bool value 2",
            patch(mk(), "kv3.value", &[2]),
            "metadata key 'tokenizer.ggml.add_bos_token': bool byte is 2 (must be 0 or 1)".into(),
        ),
        (
            "non-UTF-8 key",
            poke(mk(), "kv1.key", 8, &[0xff]),
            format!("metadata key #1 at offset {kv1_at} is not valid UTF-8"),
        ),
        (
            "non-UTF-8 tensor name",
            poke(mk(), "t0.name", 9, &[0xc3]),
            format!("name of tensor #0 at offset {t0_at} is not valid UTF-8"),
        ),
        (
            "unknown value type",
            patch(mk(), "kv1.type", &le32(13)),
            "metadata key 'qwen3moe.block_count' has unknown value type 13".into(),
        ),
        (
            "nested array",
            patch(mk(), "kv4.elem_type", &le32(9)),
            "metadata key 'tokenizer.ggml.token_type': nested arrays are not supported".into(),
        ),
        (
            "unknown array element type",
            patch(mk(), "kv4.elem_type", &le32(42)),
            "metadata key 'tokenizer.ggml.token_type': array has unknown element type 42".into(),
        ),
        (
            "alignment 0",
            patch(mk(), "kv5.value", &le32(0)),
            "general.alignment must be a non-zero power of two, got 0".into(),
        ),
        (
            "alignment 3",
            patch(mk(), "kv5.value", &le32(3)),
            "general.alignment must be a non-zero power of two, got 3".into(),
        ),
        (
            "alignment of the wrong type",
            patch(mk(), "kv5.type", &le32(5)),
            "general.alignment must be of type UINT32, found INT32".into(),
        ),
        (
            "alignment 64 makes offset 32 misaligned",
            patch(mk(), "kv5.value", &le32(64)),
            "tensor 'b.weight': offset 32 is not a multiple of the alignment 64".into(),
        ),
    ];

    for (desc, bytes, expected) in rows {
        let err = match GgufFile::from_bytes("bad.gguf", bytes) {
            Ok(_) => panic!("{desc}: parsed without error"),
            Err(e) => e.to_string(),
        };
        assert!(err.starts_with("bad.gguf: "), "{desc}: {err}");
        assert!(
            err.contains(&expected),
            "{desc}:\n  got      {err}\n  expected {expected}"
        );
    }
}

#[test]
fn nan_scale_reads_but_does_not_dequantize() {
    // The reader checks layout, not values: a NaN scale (f16 0x7e00) is caught by dequantize.
    let f = GgufFile::from_bytes("nan.gguf", poke(handmade(), "b.data", 0, &[0x00, 0x7e])).unwrap();
    let t = f.tensor("b.weight").unwrap();
    assert_eq!(t.dtype, DType::Q4_0);
    let mut out = [0f32; 32];
    let e = dequantize(t.dtype, t.data, &mut out).unwrap_err();
    assert!(
        matches!(e, QuantError::NonFiniteScale { block: 0, scale, .. } if scale.is_nan()),
        "{e}"
    );
}

#[test]
fn open_reports_missing_file_and_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.gguf");
    let e = GgufFile::open(&missing).unwrap_err().to_string();
    assert!(e.contains("missing.gguf") && e.contains("I/O error"), "{e}");

    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = GgufFile::open(&empty).unwrap_err().to_string();
    assert!(
        e.contains("empty.gguf: unexpected end of file reading magic"),
        "{e}"
    );
}
