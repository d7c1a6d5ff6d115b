//! Writes small valid seed files for the fuzz targets into `seeds/gguf/` and
//! `seeds/safetensors/` (run from the `fuzz/` directory: `cargo run --bin gen_seeds`). GGUF
//! seeds end in `.bin` because the repository ignores `*.gguf`.
//! Seeds give libFuzzer valid structure to mutate from, so it reaches the tensor-info and
//! data checks instead of dying on the magic.

use nibble_formats::gguf::{GgufWriter, MetaValue, TensorSpec};
use nibble_quant::{encode_float, DType};
use std::fs;

fn gguf(meta: Vec<(&str, MetaValue)>, tensors: &[(&str, DType, &[u64])]) -> Vec<u8> {
    let meta = meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let specs = tensors
        .iter()
        .map(|&(name, dtype, shape)| TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        })
        .collect();
    let mut w = GgufWriter::new(Vec::new(), meta, specs).expect("valid seed header");
    for (i, &(name, dtype, shape)) in tensors.iter().enumerate() {
        let n = shape.iter().product::<u64>() as usize;
        // Deterministic, non-constant values.
        let src: Vec<f32> = (0..n)
            .map(|j| ((j * 7 + i * 3) % 13) as f32 * 0.25 - 1.5)
            .collect();
        w.write_tensor(name, &encode_float(dtype, &src))
            .expect("seed tensor");
    }
    w.finish().expect("seed finish")
}

fn safetensors(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend((0..data_len).map(|i| (i * 37 % 251) as u8));
    out
}

fn main() {
    fs::create_dir_all("seeds/gguf").unwrap();
    fs::create_dir_all("seeds/safetensors").unwrap();

    let model = gguf(
        vec![
            ("general.architecture", MetaValue::String("qwen3moe".into())),
            ("qwen3moe.block_count", MetaValue::U32(48)),
            ("qwen3moe.rope.freq_base", MetaValue::F32(1e6)),
            ("tokenizer.ggml.add_bos_token", MetaValue::Bool(false)),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array(
                    ["a", "Ġb", "<|im_end|>"]
                        .map(|s| MetaValue::String(s.into()))
                        .to_vec(),
                ),
            ),
            (
                "tokenizer.ggml.token_type",
                MetaValue::Array(vec![
                    MetaValue::I32(1),
                    MetaValue::I32(1),
                    MetaValue::I32(3),
                ]),
            ),
        ],
        &[
            ("a.weight", DType::F32, &[2, 3]),
            ("b.weight", DType::Q4_0, &[1, 32]),
            ("c.weight", DType::Q8_0, &[2, 32]),
            ("d.weight", DType::F16, &[4]),
            ("e.weight", DType::BF16, &[2, 2, 2]),
        ],
    );
    let mut v2 = model.clone();
    v2[4..8].copy_from_slice(&2u32.to_le_bytes());
    fs::write("seeds/gguf/model.bin", &model).unwrap();
    fs::write("seeds/gguf/model_v2.bin", &v2).unwrap();

    fs::write(
        "seeds/gguf/align64.bin",
        gguf(
            vec![("general.alignment", MetaValue::U32(64))],
            &[("x", DType::Q4_0, &[2, 64]), ("y", DType::F32, &[3])],
        ),
    )
    .unwrap();

    fs::write(
        "seeds/gguf/meta_only.bin",
        gguf(
            vec![
                ("u8", MetaValue::U8(200)),
                ("i8", MetaValue::I8(-5)),
                ("u16", MetaValue::U16(60000)),
                ("i16", MetaValue::I16(-300)),
                ("u32", MetaValue::U32(7)),
                ("i32", MetaValue::I32(-7)),
                ("f32", MetaValue::F32(0.5)),
                ("bool", MetaValue::Bool(true)),
                ("str", MetaValue::String("héllo".into())),
                ("u64", MetaValue::U64(1 << 40)),
                ("i64", MetaValue::I64(-(1 << 40))),
                ("f64", MetaValue::F64(-2.5)),
                (
                    "arr_f32",
                    MetaValue::Array(vec![MetaValue::F32(1.0), MetaValue::F32(2.0)]),
                ),
                ("arr_bool", MetaValue::Array(vec![MetaValue::Bool(true)])),
                ("arr_empty", MetaValue::Array(vec![])),
            ],
            &[],
        ),
    )
    .unwrap();

    fs::write(
        "seeds/safetensors/two.safetensors",
        safetensors(
            r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]}}"#,
            32,
        ),
    )
    .unwrap();
    fs::write(
        "seeds/safetensors/f16_i64.safetensors",
        safetensors(
            r#"{"h":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},"i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}}"#,
            16,
        ),
    )
    .unwrap();
    println!("seeds written under seeds/");
}
