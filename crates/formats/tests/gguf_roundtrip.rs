//! Writer -> reader round trips over every metadata type and every tensor type, plus the
//! writer's own refusals.

use nibble_formats::gguf::{GgufFile, GgufWriter, MetaValue, TensorSpec};
use nibble_quant::{dequantize, encode_float, DType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random_string(rng: &mut StdRng, max_len: usize) -> String {
    let len = rng.random_range(0..=max_len);
    // Mix ASCII with multi-byte characters so byte length != char count.
    (0..len)
        .map(|_| match rng.random_range(0..4) {
            0 => 'é',
            1 => 'Ġ',
            _ => rng.random_range(b'a'..=b'z') as char,
        })
        .collect()
}

/// One value of every type, including arrays of several element types and an empty array.
fn all_metadata(rng: &mut StdRng, alignment: Option<u32>) -> Vec<(String, MetaValue)> {
    let mut m = vec![
        ("t.u8".to_string(), MetaValue::U8(rng.random())),
        ("t.i8".into(), MetaValue::I8(rng.random())),
        ("t.u16".into(), MetaValue::U16(rng.random())),
        ("t.i16".into(), MetaValue::I16(rng.random())),
        ("t.u32".into(), MetaValue::U32(rng.random())),
        ("t.i32".into(), MetaValue::I32(rng.random())),
        ("t.f32".into(), MetaValue::F32(rng.random_range(-1e6..1e6))),
        ("t.bool_true".into(), MetaValue::Bool(true)),
        ("t.bool_false".into(), MetaValue::Bool(false)),
        ("t.string".into(), MetaValue::String(random_string(rng, 40))),
        ("t.empty_string".into(), MetaValue::String(String::new())),
        ("t.u64".into(), MetaValue::U64(rng.random())),
        ("t.i64".into(), MetaValue::I64(rng.random())),
        (
            "t.f64".into(),
            MetaValue::F64(rng.random_range(-1e300..1e300)),
        ),
        (
            "t.arr_i32".into(),
            MetaValue::Array((0..17).map(|_| MetaValue::I32(rng.random())).collect()),
        ),
        (
            "t.arr_f32".into(),
            MetaValue::Array((0..9).map(|_| MetaValue::F32(rng.random())).collect()),
        ),
        (
            "t.arr_str".into(),
            MetaValue::Array(
                (0..12)
                    .map(|_| MetaValue::String(random_string(rng, 12)))
                    .collect(),
            ),
        ),
        (
            "t.arr_bool".into(),
            MetaValue::Array((0..5).map(|_| MetaValue::Bool(rng.random())).collect()),
        ),
        (
            "t.arr_u64".into(),
            MetaValue::Array((0..3).map(|_| MetaValue::U64(rng.random())).collect()),
        ),
        ("t.arr_empty".into(), MetaValue::Array(vec![])),
    ];
    if let Some(a) = alignment {
        m.push(("general.alignment".into(), MetaValue::U32(a)));
    }
    m
}

/// Tensors of every DType in 1-, 2- and 3-D, with valid random contents.
fn all_tensors(rng: &mut StdRng) -> Vec<(TensorSpec, Vec<u8>)> {
    let cases: [(&str, DType, &[u64]); 9] = [
        ("f32.1d", DType::F32, &[7]),
        ("f32.3d", DType::F32, &[2, 3, 5]),
        ("f16.2d", DType::F16, &[3, 5]),
        ("bf16.3d", DType::BF16, &[2, 3, 4]),
        ("q8_0.2d", DType::Q8_0, &[4, 64]),
        ("q8_0.1d", DType::Q8_0, &[32]),
        ("q4_0.3d", DType::Q4_0, &[2, 3, 96]),
        ("q4_0.1d", DType::Q4_0, &[32]),
        ("empty.2d", DType::F16, &[0, 4]),
    ];
    cases
        .iter()
        .map(|&(name, dtype, shape)| {
            let n = shape.iter().product::<u64>() as usize;
            let src: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
            let bytes = encode_float(dtype, &src);
            let spec = TensorSpec {
                name: name.into(),
                dtype,
                shape: shape.to_vec(),
            };
            (spec, bytes)
        })
        .collect()
}

fn write_file(meta: &[(String, MetaValue)], tensors: &[(TensorSpec, Vec<u8>)]) -> Vec<u8> {
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::new(Vec::new(), meta.to_vec(), specs).unwrap();
    for (s, b) in tensors {
        w.write_tensor(&s.name, b).unwrap();
    }
    w.finish().unwrap()
}

fn check_file(
    f: &GgufFile,
    meta: &[(String, MetaValue)],
    tensors: &[(TensorSpec, Vec<u8>)],
    align: u64,
) {
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), align);
    assert_eq!(f.metadata(), meta);
    for (k, v) in meta {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.data_offset() % align, 0);
    assert_eq!(f.tensors().len(), tensors.len());
    // ggml's strict layout: offsets are the running sum of aligned sizes, in info order.
    let mut expect_offset = 0;
    for (info, (spec, bytes)) in f.tensors().iter().zip(tensors) {
        assert_eq!(info.name, spec.name);
        assert_eq!(info.dtype, spec.dtype, "{}", spec.name);
        assert_eq!(info.shape, spec.shape, "{}", spec.name);
        assert_eq!(info.size, bytes.len() as u64, "{}", spec.name);
        assert_eq!(info.offset, expect_offset, "{}", spec.name);
        expect_offset += info.size.next_multiple_of(align);

        let view = f.tensor(&spec.name).unwrap();
        assert_eq!(view.shape, spec.shape);
        assert_eq!(view.dtype, spec.dtype);
        assert!(view.data == bytes.as_slice(), "{}: bytes differ", spec.name);
        let mut out = vec![0f32; view.elements() as usize];
        dequantize(view.dtype, view.data, &mut out).unwrap();
    }
}

#[test]
fn round_trip_every_type_and_alignment() {
    let mut rng = StdRng::seed_from_u64(0x6767_7566);
    for alignment in [None, Some(64), Some(1), Some(4096)] {
        let meta = all_metadata(&mut rng, alignment);
        let tensors = all_tensors(&mut rng);
        let bytes = write_file(&meta, &tensors);
        let align = alignment.map_or(32, u64::from);
        assert_eq!(bytes.len() as u64 % align, 0, "file ends padded");

        let f = GgufFile::from_bytes("mem.gguf", bytes.clone()).unwrap();
        check_file(&f, &meta, &tensors, align);

        // The same through a real file and mmap.
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut tmp, &bytes).unwrap();
        let f = GgufFile::open(tmp.path()).unwrap();
        assert_eq!(f.path(), tmp.path());
        check_file(&f, &meta, &tensors, align);
    }
}

#[test]
fn writer_streams_into_a_file() {
    let mut rng = StdRng::seed_from_u64(7);
    let meta = all_metadata(&mut rng, None);
    let tensors = all_tensors(&mut rng);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.gguf");
    let out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::new(out, meta.clone(), specs).unwrap();
    for (s, b) in &tensors {
        w.write_tensor(&s.name, b).unwrap();
    }
    drop(w.finish().unwrap());
    check_file(&GgufFile::open(&path).unwrap(), &meta, &tensors, 32);
}

fn spec(name: &str, dtype: DType, shape: &[u64]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

fn new_err(meta: Vec<(String, MetaValue)>, tensors: Vec<TensorSpec>) -> String {
    match GgufWriter::new(Vec::new(), meta, tensors) {
        Ok(_) => panic!("writer accepted invalid input"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn writer_rejects_invalid_headers() {
    let kv = |k: &str, v: MetaValue| (k.to_string(), v);
    type Case = (Vec<(String, MetaValue)>, Vec<TensorSpec>, &'static str);
    let cases: Vec<Case> = vec![
        (
            vec![kv("a", MetaValue::U8(1)), kv("a", MetaValue::U8(2))],
            vec![],
            "duplicate metadata key 'a'",
        ),
        (
            vec![kv(
                "n",
                MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::U8(1)])]),
            )],
            vec![],
            "metadata key 'n': nested arrays are not supported",
        ),
        (
            vec![kv(
                "m",
                MetaValue::Array(vec![MetaValue::I32(1), MetaValue::U32(2)]),
            )],
            vec![],
            "metadata key 'm': array mixes INT32 and UINT32 elements",
        ),
        (
            vec![kv("general.alignment", MetaValue::U32(24))],
            vec![],
            "general.alignment must be a non-zero power of two, got 24",
        ),
        (
            vec![kv("general.alignment", MetaValue::U64(32))],
            vec![],
            "general.alignment must be of type UINT32, found UINT64",
        ),
        (
            vec![],
            vec![spec("x", DType::F32, &[2]), spec("x", DType::F16, &[2])],
            "duplicate tensor name 'x'",
        ),
        (
            vec![],
            vec![spec("q", DType::Q4_0, &[32, 16])],
            "tensor 'q': row length 16 (innermost dim) is not a multiple of the Q4_0 block size",
        ),
        (
            vec![],
            vec![spec("d", DType::F32, &[1, 1, 1, 1, 1])],
            "tensor 'd': n_dims 5 exceeds the maximum of 4",
        ),
        (
            vec![],
            vec![spec(&"n".repeat(64), DType::F32, &[1])],
            "is 64 bytes, longer than ggml's limit of 63",
        ),
    ];
    for (meta, tensors, expected) in cases {
        let e = new_err(meta, tensors);
        assert!(e.starts_with("<gguf writer>: "), "{e}");
        assert!(e.contains(expected), "got {e}\nexpected {expected}");
    }
}

#[test]
fn writer_enforces_order_sizes_and_completeness() {
    let tensors = vec![spec("a", DType::F32, &[2]), spec("b", DType::Q8_0, &[32])];
    let mut w = GgufWriter::new(Vec::new(), vec![], tensors).unwrap();
    let e = w.write_tensor("b", &[0; 34]).unwrap_err().to_string();
    assert!(
        e.contains("tensor 'b' written out of order: expected 'a' next"),
        "{e}"
    );
    let e = w.write_tensor("a", &[0; 7]).unwrap_err().to_string();
    assert!(
        e.contains("tensor 'a': got 7 bytes, its shape and type need 8"),
        "{e}"
    );
    w.write_tensor("a", &1.0f32.to_le_bytes().repeat(2))
        .unwrap();
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("1 of 2 tensors unwritten (next: 'b')"), "{e}");

    let mut w = GgufWriter::new(Vec::new(), vec![], vec![spec("a", DType::F32, &[1])]).unwrap();
    w.write_tensor("a", &2.5f32.to_le_bytes()).unwrap();
    let e = w.write_tensor("a", &2.5f32.to_le_bytes()).unwrap_err();
    assert!(
        e.to_string().contains("all 1 tensors are already written"),
        "{e}"
    );
    let f = GgufFile::from_bytes("one", w.finish().unwrap()).unwrap();
    assert_eq!(f.tensor("a").unwrap().data, 2.5f32.to_le_bytes());
}

#[test]
fn writer_reports_io_errors_and_stays_failed() {
    /// Accepts `room` bytes, then fails.
    struct Full {
        room: usize,
    }
    impl std::io::Write for Full {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(std::io::Error::other("disk full"));
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let tensors = vec![spec("a", DType::F32, &[64]), spec("b", DType::F32, &[1])];
    // Header + padding is 96 bytes here (24 + two 33-byte infos, padded); room for 64 of
    // tensor a's 256 bytes.
    let mut w = GgufWriter::new(Full { room: 160 }, vec![], tensors).unwrap();
    let e = w.write_tensor("a", &[1; 256]).unwrap_err().to_string();
    assert!(e.contains("disk full"), "{e}");
    let e = w.write_tensor("a", &[1; 256]).unwrap_err().to_string();
    assert!(e.contains("an earlier write failed"), "{e}");
    assert!(w.finish().is_err());

    assert!(GgufWriter::new(Full { room: 10 }, vec![], vec![]).is_err());
}
