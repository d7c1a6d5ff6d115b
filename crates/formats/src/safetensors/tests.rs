//! Tests for the safetensors reader and writer: bit-exact round trips (single file and
//! sharded, through every entry point), a table of malformed files with the message each must
//! produce, random truncation/mutation (no panic), and sharded-index errors.

use super::*;
use nibble_quant::encode_float;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;

/// Random specs: every float dtype, 1 to 3 dims of 1..=9, with random non-zero values.
fn random_model(rng: &mut StdRng, count: usize) -> (Vec<TensorSpec>, Vec<Vec<u8>>) {
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
            dtype,
            shape,
        });
        bytes.push(encode_float(dtype, &values));
    }
    (specs, bytes)
}

/// Writes with a callback that must be called once per tensor, and checks that it was.
fn write(dir: &Path, specs: &[TensorSpec], data: &[Vec<u8>], max: u64) -> Vec<PathBuf> {
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
        assert_eq!(v.dtype, spec.dtype, "{}", spec.name);
        assert_eq!(v.shape, spec.shape, "{}", spec.name);
        assert_eq!(v.data, &bytes[..], "{}", spec.name);
        assert_eq!(v.data.len() as u64, spec.dtype.byte_size(v.elements()).unwrap());
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
        assert_eq!(m.files(), &[file_path.clone()]);
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
        assert!(bytes as u64 <= max || names.len() == 1, "{p:?}: {bytes} bytes");
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
        dtype,
        shape,
    };
    let cases = [
        (vec![spec("q", DType::Q4_0, vec![32])], "F32, F16, BF16 only"),
        (
            vec![spec("a", DType::F32, vec![2]), spec("a", DType::F16, vec![2])],
            "appears twice",
        ),
        (vec![spec("", DType::F32, vec![2])], "invalid tensor name"),
        (vec![spec("big", DType::F32, vec![u64::MAX, 2])], "too large"),
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
    assert!(err.contains("returned 11 bytes") && err.contains("expected 12"), "{err}");
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

/// An 8-byte length prefix, the header, then `data_len` non-zero data bytes.
fn raw(header: &str, data_len: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend((0..data_len).map(|i| (i % 251 + 1) as u8));
    b
}

fn with_len(len: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = len.to_le_bytes().to_vec();
    b.extend_from_slice(rest);
    b
}

#[test]
fn malformed_files_give_clear_errors() {
    let valid = raw(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 8);
    assert!(SafetensorsFile::from_bytes("v", valid.clone()).is_ok());
    // Offsets whose end is near usize::MAX: each tensor is valid on its own; the crate's own
    // reader would overflow `end + 8 + N` here.
    let huge = {
        let step = 1usize << 61;
        let mut entries = Vec::new();
        for k in 0..8usize {
            let begin = k * step;
            let end = if k == 7 { usize::MAX - 3 } else { begin + step };
            entries.push(format!(
                r#""t{k}":{{"dtype":"U8","shape":[{}],"data_offsets":[{begin},{end}]}}"#,
                end - begin
            ));
        }
        raw(&format!("{{{}}}", entries.join(",")), 0)
    };

    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("empty file", vec![], &["0 bytes", "too short"]),
        ("truncated header length", vec![1, 0, 0], &["3 bytes", "too short"]),
        ("header length larger than file", with_len(100, b"{}"), &["header length 100", "past the end"]),
        ("header length 2^60", with_len(1 << 60, b"{}"), &["1152921504606846976", "exceeds"]),
        ("header not JSON", raw("this is not json", 0), &["invalid safetensors header JSON"]),
        ("header not UTF-8", with_len(6, b"{\"\xff\":1}"), &["invalid safetensors header JSON"]),
        ("header JSON not an object", raw("[1, 2, 3]", 0), &["invalid safetensors header JSON", "invalid type"]),
        ("header is a number", raw("42", 0), &["invalid safetensors header JSON", "invalid type"]),
        ("data_offsets past end", raw(r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, 8), &["needs 16 bytes", "only 8"]),
        ("overlapping offsets", raw(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#, 12), &["invalid offset for tensor `b`"]),
        ("offsets with a hole", raw(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#, 20), &["invalid offset for tensor `b`"]),
        ("first offset not 0", raw(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#, 12), &["invalid offset for tensor `a`"]),
        ("end before begin", raw(r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#, 8), &["invalid offset"]),
        ("size not matching shape*dtype", raw(r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8), &["invalid shape, data type, or offset"]),
        ("shape product overflow", raw(r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#, 8), &["overflow"]),
        ("shape dim beyond u64", raw(r#"{"a":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}}"#, 8), &["invalid safetensors header JSON"]),
        ("negative offset", raw(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}"#, 8), &["invalid safetensors header JSON"]),
        ("dtype unknown string", raw(r#"{"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}}"#, 8), &["unknown variant `Q7`"]),
        ("missing dtype", raw(r#"{"a":{"shape":[2],"data_offsets":[0,8]}}"#, 8), &["missing field `dtype`"]),
        ("metadata value not a string", raw(r#"{"__metadata__":{"format":1}}"#, 0), &["invalid safetensors header JSON"]),
        ("file truncated in data", valid[..valid.len() - 1].to_vec(), &["needs 8 bytes", "only 7", "truncated"]),
        ("trailing bytes", [&valid[..], &[9, 9, 9]].concat(), &["3 unexpected bytes"]),
        ("offsets end near usize::MAX", huge, &["needs 18446744073709551612 bytes"]),
    ];
    for (what, bytes, wants) in cases {
        let err = match SafetensorsFile::from_bytes("bad.safetensors", bytes) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.starts_with("bad.safetensors: "), "{what}: {err}");
        for want in wants {
            assert!(err.contains(want), "{what}: {err:?} lacks {want:?}");
        }
    }
}

#[test]
fn open_reports_missing_and_empty_files() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.safetensors");
    let err = SafetensorsFile::open(&missing).unwrap_err().to_string();
    assert!(err.contains("nope.safetensors") && err.contains("I/O error"), "{err}");
    let empty = dir.path().join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    let err = SafetensorsFile::open(&empty).unwrap_err().to_string();
    assert!(err.contains("empty.safetensors") && err.contains("too short"), "{err}");
}

/// Bytes of a small valid file with three tensors of different dtypes.
fn small_file() -> (Vec<u8>, Vec<TensorSpec>) {
    let mut rng = StdRng::seed_from_u64(5);
    let (specs, data) = random_model(&mut rng, 3);
    let dir = tempfile::tempdir().unwrap();
    let paths = write(dir.path(), &specs, &data, u64::MAX);
    (std::fs::read(&paths[0]).unwrap(), specs)
}

/// Opening and reading every tensor must not panic; if it opens, views keep their invariant.
fn exercise(bytes: Vec<u8>) -> bool {
    let len = bytes.len();
    let Ok(f) = SafetensorsFile::from_bytes("fuzz", bytes) else {
        return false;
    };
    for name in f.names() {
        if let Ok(Some(v)) = f.tensor(name) {
            assert_eq!(v.data.len() as u64, v.dtype.byte_size(v.elements()).unwrap());
            assert!(v.data.len() <= len);
        }
    }
    true
}

#[test]
fn every_truncation_is_an_error() {
    let (bytes, _) = small_file();
    assert!(exercise(bytes.clone()));
    for cut in 0..bytes.len() {
        assert!(!exercise(bytes[..cut].to_vec()), "prefix of {cut} bytes accepted");
    }
}

#[test]
fn random_byte_flips_never_panic() {
    let (bytes, specs) = small_file();
    let mut rng = StdRng::seed_from_u64(6);
    let mut accepted = 0;
    for _ in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..rng.random_range(1..=4) {
            let i = rng.random_range(0..b.len());
            b[i] ^= rng.random_range(1..=255u8);
        }
        accepted += exercise(b) as usize;
    }
    // Flips inside tensor data leave a valid file, so some mutants must open; flips in the
    // header mostly must not.
    assert!(accepted > 0 && accepted < 3000, "accepted {accepted}");
    assert_eq!(specs.len(), 3);
}

/// A two-shard checkpoint written by `write_model`, returned with its directory and index text.
fn two_shards() -> (tempfile::TempDir, serde_json::Value) {
    let mut rng = StdRng::seed_from_u64(7);
    let (specs, data) = random_model(&mut rng, 4);
    let dir = tempfile::tempdir().unwrap();
    let total: u64 = data.iter().map(|d| d.len() as u64).sum();
    let paths = write(dir.path(), &specs, &data, total / 2 + 1);
    assert_eq!(paths.len(), 3, "{paths:?}");
    let index = serde_json::from_slice(&std::fs::read(&paths[2]).unwrap()).unwrap();
    (dir, index)
}

fn set_index(dir: &Path, text: &str) -> String {
    std::fs::write(dir.join("model.safetensors.index.json"), text).unwrap();
    match SafetensorsModel::open(dir) {
        Ok(_) => panic!("index accepted: {text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn sharded_index_errors() {
    let (dir, index) = two_shards();
    let d = dir.path();
    let first_tensor = index["weight_map"].as_object().unwrap().keys().next().unwrap().clone();

    let err = set_index(d, "{\"weight_map\": {");
    assert!(err.contains("model.safetensors.index.json") && err.contains("invalid safetensors index JSON"), "{err}");
    let err = set_index(d, r#"{"metadata": {}}"#);
    assert!(err.contains("missing field `weight_map`"), "{err}");
    let err = set_index(d, r#"{"weight_map": {}}"#);
    assert!(err.contains("weight_map is empty"), "{err}");

    let err = set_index(d, &format!(r#"{{"weight_map": {{"{first_tensor}": "model-00009-of-00009.safetensors"}}}}"#));
    assert!(err.contains("model-00009-of-00009.safetensors") && err.contains("cannot be opened"), "{err}");

    for bad in ["../model-00001-of-00002.safetensors", "sub/x.safetensors", "/etc/passwd", "..", "a\\\\b.safetensors", ""] {
        let err = set_index(d, &format!(r#"{{"weight_map": {{"{first_tensor}": "{bad}"}}}}"#));
        assert!(err.contains("not a plain file name") && err.contains(&first_tensor), "{bad}: {err}");
    }

    // A tensor the index puts in the wrong shard.
    let mut wm = index["weight_map"].as_object().unwrap().clone();
    let (name, shard) = wm.iter().find(|(_, s)| *s == "model-00001-of-00002.safetensors").unwrap();
    let name = name.clone();
    assert_eq!(shard, "model-00001-of-00002.safetensors");
    wm.insert(name.clone(), "model-00002-of-00002.safetensors".into());
    let err = set_index(d, &serde_json::json!({ "weight_map": wm }).to_string());
    assert!(err.contains("model-00002-of-00002.safetensors") && err.contains(&name) && err.contains("no such tensor"), "{err}");

    // A shard that is not a safetensors file: the error names the shard.
    std::fs::write(d.join("junk.safetensors"), b"\x05\0\0\0\0\0\0\0{}").unwrap();
    let err = set_index(d, &format!(r#"{{"weight_map": {{"{first_tensor}": "junk.safetensors"}}}}"#));
    assert!(err.contains("junk.safetensors") && err.contains("past the end"), "{err}");

    let empty = tempfile::tempdir().unwrap();
    let err = SafetensorsModel::open(empty.path()).unwrap_err().to_string();
    assert!(err.contains("neither"), "{err}");
}

#[test]
fn tensors_missing_from_weight_map_are_not_reachable() {
    let (dir, index) = two_shards();
    let mut wm = index["weight_map"].as_object().unwrap().clone();
    let dropped = wm.keys().next().unwrap().clone();
    wm.remove(&dropped);
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": wm }).to_string(),
    )
    .unwrap();
    let m = SafetensorsModel::open(dir.path()).unwrap();
    assert_eq!(m.names().len(), wm.len());
    assert!(!m.names().contains(&dropped.as_str()));
    assert!(m.tensor(&dropped).unwrap().is_none());
    let kept = wm.keys().next().unwrap();
    assert!(m.tensor(kept).unwrap().is_some());
}

#[test]
fn zero_sized_tensor_round_trips() {
    let specs = vec![
        TensorSpec { name: "empty".into(), dtype: DType::F16, shape: vec![0, 5] },
        TensorSpec { name: "w".into(), dtype: DType::BF16, shape: vec![2, 3] },
    ];
    let data = vec![vec![], encode_float(DType::BF16, &[0.5, -1.0, 2.0, 3.5, -7.25, 9.0])];
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &specs, &data, u64::MAX);
    let m = SafetensorsModel::open(dir.path()).unwrap();
    assert_same(&specs, &data, |n| m.tensor(n));
}
