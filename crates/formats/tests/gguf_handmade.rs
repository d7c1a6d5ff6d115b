//! The reader against a file built byte by byte from the spec, and the writer against the same
//! bytes: neither side is tested only against the other.

mod gguf_common;

use gguf_common::{b_block, b_expected, handmade, A_VALUES};
use nibble_formats::gguf::{GgufFile, GgufWriter, MetaValue, TensorSpec};
use nibble_quant::{dequantize, DType};

#[test]
fn reads_handmade_file() {
    let b = handmade();
    let data_start = b.marks["data"].start;
    let f = GgufFile::from_bytes("hand.gguf", b.bytes).unwrap();

    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset(), data_start as u64);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.path().to_str(), Some("hand.gguf"));

    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "general.architecture",
            "qwen3moe.block_count",
            "qwen3moe.rope.freq_base",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.token_type",
            "general.alignment",
        ]
    );
    assert_eq!(
        f.get("general.architecture").and_then(MetaValue::as_str),
        Some("qwen3moe")
    );
    assert_eq!(f.get("qwen3moe.block_count"), Some(&MetaValue::U32(48)));
    assert_eq!(
        f.get("qwen3moe.block_count").and_then(MetaValue::as_u64),
        Some(48)
    );
    assert_eq!(
        f.get("qwen3moe.rope.freq_base").and_then(MetaValue::as_f64),
        Some(1e6)
    );
    assert_eq!(
        f.get("tokenizer.ggml.add_bos_token")
            .and_then(MetaValue::as_bool),
        Some(false)
    );
    let tt = f
        .get("tokenizer.ggml.token_type")
        .and_then(MetaValue::as_array)
        .unwrap();
    assert_eq!(
        tt,
        &[MetaValue::I32(1), MetaValue::I32(3), MetaValue::I32(4)]
    );
    assert!(f.get("general.name").is_none());

    let infos = f.tensors();
    assert_eq!(infos.len(), 2);
    assert_eq!(infos[0].name, "a.weight");
    assert_eq!(infos[0].dtype, DType::F32);
    assert_eq!(infos[0].shape, [2, 3], "GGUF dims [3, 2] reversed");
    assert_eq!((infos[0].offset, infos[0].size), (0, 24));
    assert_eq!(infos[1].name, "b.weight");
    assert_eq!(infos[1].dtype, DType::Q4_0);
    assert_eq!(infos[1].shape, [1, 32]);
    assert_eq!((infos[1].offset, infos[1].size), (32, 18));

    let a = f.tensor("a.weight").unwrap();
    assert_eq!((a.name, a.dtype, a.elements()), ("a.weight", DType::F32, 6));
    let mut out = [0f32; 6];
    dequantize(a.dtype, a.data, &mut out).unwrap();
    assert_eq!(out, A_VALUES);

    let bv = f.tensor("b.weight").unwrap();
    assert_eq!(bv.data, &b_block()[..]);
    let mut out = [0f32; 32];
    dequantize(bv.dtype, bv.data, &mut out).unwrap();
    for (j, v) in out.iter().enumerate() {
        assert_eq!(*v, b_expected(j), "element {j}");
    }
    assert_eq!(out[0], -4.0);
    assert_eq!(out[16], 3.5);
    assert!(f.tensor("c.weight").is_none());
}

#[test]
fn version_2_is_accepted() {
    let mut b = handmade();
    b.bytes[b.marks["version"].clone()].copy_from_slice(&2u32.to_le_bytes());
    let f = GgufFile::from_bytes("v2.gguf", b.bytes).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensors().len(), 2);
}

#[test]
fn writer_produces_the_handmade_bytes() {
    // Same content through the writer: it must emit exactly the spec layout, plus the zero
    // padding ggml writes after the last tensor.
    let metadata = vec![
        (
            "general.architecture".to_string(),
            MetaValue::String("qwen3moe".into()),
        ),
        ("qwen3moe.block_count".to_string(), MetaValue::U32(48)),
        ("qwen3moe.rope.freq_base".to_string(), MetaValue::F32(1e6)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            MetaValue::Bool(false),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            MetaValue::Array(vec![
                MetaValue::I32(1),
                MetaValue::I32(3),
                MetaValue::I32(4),
            ]),
        ),
        ("general.alignment".to_string(), MetaValue::U32(32)),
    ];
    let tensors = vec![
        TensorSpec {
            name: "a.weight".into(),
            dtype: DType::F32,
            shape: vec![2, 3],
        },
        TensorSpec {
            name: "b.weight".into(),
            dtype: DType::Q4_0,
            shape: vec![1, 32],
        },
    ];
    let mut w = GgufWriter::new(Vec::new(), metadata, tensors).unwrap();
    let a_bytes: Vec<u8> = A_VALUES.iter().flat_map(|v| v.to_le_bytes()).collect();
    w.write_tensor("a.weight", &a_bytes).unwrap();
    w.write_tensor("b.weight", &b_block()).unwrap();
    let written = w.finish().unwrap();

    let mut expected = handmade();
    expected.pad_to(32);
    assert_eq!(written.len(), expected.bytes.len());
    assert_eq!(written, expected.bytes);
}
