//! Round-trip tests for the safetensors writer and readers: bit-exact bytes, dtypes and shapes
//! for single-file and sharded checkpoints through every entry point, plus writer checks.
//! Malformed input is tested in `bad_input_tests.rs`.

use super::*;
use nibble_quant::encode_float;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;

/// Random specs: every float dtype, 1 to 3 dims of 1..=9, with random non-zero values.
pub(super) fn random_model(rng: &mut StdRng, count: usize) -> (Vec<TensorSpec>, Vec<Vec<u8>>) {
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    let mut specs = Vec::new();
    let mut bytes = Vec::new();
    for i in 0..count {
        let dtype = dtypes[i % 3];
        let ndim = 1 + (i / 3) % 3;
        let shape: Vec<u64> = (0..ndim).map(|_| rng.random_range(1..=9)).collect();
        let n: u64 = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect();
        specs.push(TensorSpec {
            name: format!("model.layers.{i}.w{ndim}"),
            dtype: Element::Float(dtype),
            shape,
        });
        bytes.push(encode_float(dtype, &values));
    }
    (specs, bytes)
}

/// Writes with a callback that must be called once per tensor, and checks that it was.
pub(super) fn write(dir: &Path, specs: &[TensorSpec], data: &[Vec<u8>], max: u64) -> Vec<PathBuf> {
    let mut calls = vec![0usize; specs.len()];
    let paths = write_model(dir, specs, max, &mut |i| {
        calls[i] += 1;
        data[i].clone()
    })
    .unwrap();
    assert!(calls.iter().all(|&c| c == 1), "callback calls {calls:?}");
    paths
}

/// Every spec'd tensor is present with the same dtype, shape and bytes.
fn assert_same<'a>(
    specs: &[TensorSpec],
    data: &[Vec<u8>],
    get: impl Fn(&str) -> Result<Option<TensorView<'a>>>,
) {
    for (spec, bytes) in specs.iter().zip(data) {
        let v = get(&spec.name).unwrap().expect(&spec.name);
        assert_eq!(v.name, spec.name);
        assert_eq!(Element::Float(v.dtype), spec.dtype, "{}", spec.name);
        assert_eq!(v.shape, spec.shape, "{}", spec.name);
        assert_eq!(v.data, &bytes[..], "{}", spec.name);
        assert_eq!(
            v.data.len() as u64,
            v.dtype.byte_size(v.elements()).unwrap()
        );
    }
}

fn sorted_names(specs: &[TensorSpec]) -> Vec<&str> {
    let set: BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    set.into_iter().collect()
}

#[test]
fn round_trip_single_file() {
    let mut rng = StdRng::seed_from_u64(1);
    let (specs, data) = random_model(&mut rng, 12);
    assert!(data.iter().all(|b| b.iter().any(|&x| x != 0)));
    let dir = tempfile::tempdir().unwrap();
    let paths = write(dir.path(), &specs, &data, u64::MAX);
    let file_path = dir.path().join("model.safetensors");
    assert_eq!(paths, vec![file_path.clone()]);
    assert!(!dir.path().join("model.safetensors.index.json").exists());

    let f = SafetensorsFile::open(&file_path).unwrap();
    assert_same(&specs, &data, |n| f.tensor(n));
    let mut names = f.names();
    assert_eq!(names.len(), specs.len());
    names.sort();
    assert_eq!(names, sorted_names(&specs));
    let meta = f.metadata().unwrap();
    assert_eq!(meta.len(), 1);
    assert_eq!(meta["format"], "pt");
    assert!(f.tensor("absent").unwrap().is_none());

    // The same bytes through from_bytes.
    let owned = SafetensorsFile::from_bytes("mem", std::fs::read(&file_path).unwrap()).unwrap();
    assert_same(&specs, &data, |n| owned.tensor(n));

    for open_at in [dir.path().to_path_buf(), file_path.clone()] {
        let m = SafetensorsModel::open(&open_at).unwrap();
        assert_eq!(m.files(), std::slice::from_ref(&file_path));
        assert_eq!(m.names(), sorted_names(&specs));
        assert_same(&specs, &data, |n| m.tensor(n));
        assert!(m.tensor("absent").unwrap().is_none());
    }
}

#[test]
fn names_are_in_file_order() {
    let mut rng = StdRng::seed_from_u64(2);
    let (specs, data) = random_model(&mut rng, 9);
    let dir = tempfile::tempdir().unwrap();
    let paths = write(dir.path(), &specs, &data, u64::MAX);
    let f = SafetensorsFile::open(&paths[0]).unwrap();
    let offsets: Vec<usize> = f
        .names()
        .iter()
        .map(|n| f.tensor(n).unwrap().unwrap().data.as_ptr() as usize)
        .collect();
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");
}

#[test]
fn round_trip_sharded() {
    let mut rng = StdRng::seed_from_u64(3);
    let (specs, data) = random_model(&mut rng, 15);
    let max = 300u64;
    let dir = tempfile::tempdir().unwrap();
    let paths = write(dir.path(), &specs, &data, max);
    let index_path = dir.path().join("model.safetensors.index.json");
    assert_eq!(paths.last(), Some(&index_path));
    let shards = &paths[..paths.len() - 1];
    let n = shards.len();
    assert!(n >= 3, "only {n} shards");
    for (k, p) in shards.iter().enumerate() {
        let want = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        assert_eq!(p.file_name().unwrap().to_str().unwrap(), want);
    }

    // Each shard respects the limit (unless it holds one oversized tensor); shards partition
    // the tensors.
    let mut seen = BTreeSet::new();
    for p in shards {
        let f = SafetensorsFile::open(p).unwrap();
        let names = f.names();
        let bytes: usize = names
            .iter()
            .map(|nm| f.tensor(nm).unwrap().unwrap().data.len())
            .sum();
        assert!(
            bytes as u64 <= max || names.len() == 1,
            "{p:?}: {bytes} bytes"
        );
        for nm in names {
            assert!(seen.insert(nm.to_string()), "{nm} in two shards");
        }
        assert_eq!(f.metadata().unwrap()["format"], "pt");
    }
    assert_eq!(seen.len(), specs.len());

    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let total: usize = data.iter().map(Vec::len).sum();
    assert_eq!(index["metadata"]["total_size"], total as u64);
    assert_eq!(index["weight_map"].as_object().unwrap().len(), specs.len());

    for open_at in [dir.path().to_path_buf(), index_path] {
        let m = SafetensorsModel::open(&open_at).unwrap();
        let files: BTreeSet<&PathBuf> = m.files().iter().collect();
        assert_eq!(files, shards.iter().collect());
        assert_eq!(m.names(), sorted_names(&specs));
        assert_same(&specs, &data, |nm| m.tensor(nm));
    }
}

#[test]
fn rewriting_as_single_file_removes_stale_index() {
    let mut rng = StdRng::seed_from_u64(4);
    let (specs, data) = random_model(&mut rng, 6);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &specs, &data, 64);
    assert!(dir.path().join("model.safetensors.index.json").exists());
    let (specs2, data2) = random_model(&mut rng, 4);
    write(dir.path(), &specs2, &data2, u64::MAX);
    let m = SafetensorsModel::open(dir.path()).unwrap();
    assert_eq!(m.files(), &[dir.path().join("model.safetensors")]);
    assert_same(&specs2, &data2, |nm| m.tensor(nm));
}

#[test]
fn writer_rejects_bad_specs_and_wrong_lengths() {
    let dir = tempfile::tempdir().unwrap();
    let spec = |name: &str, dtype, shape: Vec<u64>| TensorSpec {
        name: name.into(),
        dtype: Element::Float(dtype),
        shape,
    };
    let cases = [
        (
            vec![spec("q", DType::Q4_0, vec![32])],
            "F32, F16, BF16 only",
        ),
        (
            vec![
                spec("a", DType::F32, vec![2]),
                spec("a", DType::F16, vec![2]),
            ],
            "appears twice",
        ),
        (vec![spec("", DType::F32, vec![2])], "invalid tensor name"),
        (
            vec![spec("big", DType::F32, vec![u64::MAX, 2])],
            "too large",
        ),
    ];
    for (specs, want) in cases {
        let mut calls = 0;
        let err = write_model(dir.path(), &specs, u64::MAX, &mut |_| {
            calls += 1;
            vec![1; 8]
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
        assert_eq!(calls, 0, "nothing is produced before the specs are checked");
    }

    let specs = [spec("w", DType::BF16, vec![3, 2])];
    let err = write_model(dir.path(), &specs, u64::MAX, &mut |_| vec![7; 11])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("returned 11 bytes") && err.contains("expected 12"),
        "{err}"
    );
    assert!(!dir.path().join("model.safetensors").exists());
}

#[test]
fn unsupported_dtype_fails_only_when_requested() {
    use ::safetensors::tensor::TensorView as StView;
    let f32_bytes = encode_float(DType::F32, &[1.5, -2.25]);
    let i64_bytes: Vec<u8> = [7i64, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
    let u32_bytes: Vec<u8> = [3u32].iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        ("f", StView::new(Dtype::F32, vec![2], &f32_bytes).unwrap()),
        ("i", StView::new(Dtype::I64, vec![2], &i64_bytes).unwrap()),
        ("u", StView::new(Dtype::U32, vec![1], &u32_bytes).unwrap()),
    ];
    let bytes = ::safetensors::serialize(views, None).unwrap();
    let f = SafetensorsFile::from_bytes("mixed.safetensors", bytes).unwrap();
    assert!(f.metadata().is_none());
    let mut names = f.names();
    names.sort();
    assert_eq!(names, ["f", "i", "u"]);
    let v = f.tensor("f").unwrap().unwrap();
    assert_eq!((v.dtype, v.data), (DType::F32, &f32_bytes[..]));
    for (name, dt) in [("i", "I64"), ("u", "U32")] {
        let err = f.tensor(name).unwrap_err().to_string();
        assert!(
            err.contains("mixed.safetensors") && err.contains(dt) && err.contains(name),
            "{err}"
        );
    }
}

#[test]
fn zero_sized_tensor_round_trips() {
    let specs = vec![
        TensorSpec {
            name: "empty".into(),
            dtype: Element::Float(DType::F16),
            shape: vec![0, 5],
        },
        TensorSpec {
            name: "w".into(),
            dtype: Element::Float(DType::BF16),
            shape: vec![2, 3],
        },
    ];
    let data = vec![
        vec![],
        encode_float(DType::BF16, &[0.5, -1.0, 2.0, 3.5, -7.25, 9.0]),
    ];
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &specs, &data, u64::MAX);
    let m = SafetensorsModel::open(dir.path()).unwrap();
    assert_same(&specs, &data, |n| m.tensor(n));
}

#[test]
fn u32_words_and_the_format_tag_round_trip_through_raw() {
    let specs = vec![
        TensorSpec {
            name: "w.weight".into(),
            dtype: Element::U32,
            shape: vec![2, 3],
        },
        TensorSpec {
            name: "w.scales".into(),
            dtype: Element::Float(DType::BF16),
            shape: vec![2, 1],
        },
    ];
    let words: Vec<u8> = (1..=6u32)
        .flat_map(|v| v.wrapping_mul(0x1234_5679).to_le_bytes())
        .collect();
    let scales = encode_float(DType::BF16, &[0.5, -2.0]);
    let data = [words.clone(), scales];
    let dir = tempfile::tempdir().unwrap();
    write_model_as(dir.path(), "mlx", &specs, u64::MAX, &mut |i| {
        data[i].clone()
    })
    .unwrap();
    let m = SafetensorsModel::open(dir.path()).unwrap();
    assert_eq!(m.format_tag(), Some("mlx"));
    let r = m.raw("w.weight").unwrap().unwrap();
    assert_eq!(
        (r.dtype, r.shape.as_slice(), r.data),
        ("U32", &[2u64, 3][..], &words[..])
    );
    let e = m.tensor("w.weight").unwrap_err().to_string();
    assert!(e.contains("U32"), "{e}");
    assert_eq!(m.raw("w.scales").unwrap().unwrap().dtype, "BF16");
    assert!(m.raw("nope").unwrap().is_none());
    assert!(m.contains("w.scales") && !m.contains("nope"));
}
