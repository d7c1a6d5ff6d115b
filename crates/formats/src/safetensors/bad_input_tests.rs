//! Malformed input: a table of broken files with the message each must produce, every
//! truncation and random byte flips of a valid file (no panic), and sharded-index errors.

use super::tests::{random_model, write};
use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
    let valid = raw(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        8,
    );
    assert!(SafetensorsFile::from_bytes("v", valid.clone()).is_ok());
    // Offsets whose end is near usize::MAX: each tensor is valid on its own; the crate's own
    // reader would overflow `end + 8 + N` here.
    let huge = {
        // U8 tensors are at most 2^61 - 1 bytes (bits must fit usize), so 9 are needed.
        let step = (1usize << 61) - 2;
        let mut entries = Vec::new();
        for k in 0..9usize {
            let begin = k * step;
            let end = if k == 8 { usize::MAX - 3 } else { begin + step };
            entries.push(format!(
                r#""t{k}":{{"dtype":"U8","shape":[{}],"data_offsets":[{begin},{end}]}}"#,
                end - begin
            ));
        }
        raw(&format!("{{{}}}", entries.join(",")), 0)
    };

    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("empty file", vec![], &["0 bytes", "too short"]),
        (
            "truncated header length",
            vec![1, 0, 0],
            &["3 bytes", "too short"],
        ),
        (
            "header length larger than file",
            with_len(100, b"{}"),
            &["header length 100", "past the end"],
        ),
        (
            "header length 2^60",
            with_len(1 << 60, b"{}"),
            &["1152921504606846976", "exceeds"],
        ),
        (
            "header not JSON",
            raw("this is not json", 0),
            &["invalid safetensors header JSON"],
        ),
        (
            "header not UTF-8",
            with_len(6, b"{\"\xff\":1}"),
            &["invalid safetensors header JSON"],
        ),
        (
            "header JSON not an object",
            raw("[1, 2, 3]", 0),
            &["invalid safetensors header JSON", "invalid type"],
        ),
        (
            "header is a number",
            raw("42", 0),
            &["invalid safetensors header JSON", "invalid type"],
        ),
        (
            "data_offsets past end",
            raw(
                r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
                8,
            ),
            &["needs 16 bytes", "only 8"],
        ),
        (
            "overlapping offsets",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
            ),
            &["invalid offset for tensor `b`"],
        ),
        (
            "offsets with a hole",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#,
                20,
            ),
            &["invalid offset for tensor `b`"],
        ),
        (
            "first offset not 0",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
            ),
            &["invalid offset for tensor `a`"],
        ),
        (
            "end before begin",
            raw(
                r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
                8,
            ),
            &["invalid offset"],
        ),
        (
            "size not matching shape*dtype",
            raw(
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
            &["tensor `a`: dtype F32 and shape [3] need 12 bytes but data_offsets [0, 8] hold 8 bytes"],
        ),
        (
            "dtype edited, size no longer matching",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F64","shape":[2],"data_offsets":[8,16]}}"#,
                16,
            ),
            &["tensor `b`: dtype F64 and shape [2] need 16 bytes but data_offsets [8, 16] hold 8 bytes"],
        ),
        (
            "a size of a fraction of a byte",
            raw(
                r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#,
                2,
            ),
            &["tensor `a`: dtype F4 and shape [3] need 12 bits (not a whole number of bytes)"],
        ),
        (
            "shape product overflow",
            raw(
                r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#,
                8,
            ),
            &["tensor `a`: shape [4294967296, 4294967296, 16] of F32 overflows"],
        ),
        (
            "shape dim beyond u64",
            raw(
                r#"{"a":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}}"#,
                8,
            ),
            &["invalid safetensors header: tensor `a`: invalid type"],
        ),
        (
            "negative offset",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}"#,
                8,
            ),
            &["tensor `a`: invalid value: integer `-8`"],
        ),
        (
            "dtype unknown string",
            raw(
                r#"{"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
            &["tensor `a`: unknown variant `Q7`"],
        ),
        (
            "missing dtype",
            raw(r#"{"a":{"shape":[2],"data_offsets":[0,8]}}"#, 8),
            &["tensor `a`: missing field `dtype`"],
        ),
        (
            "metadata value not a string",
            raw(r#"{"__metadata__":{"format":1}}"#, 0),
            &["`__metadata__`: invalid type: integer `1`"],
        ),
        (
            "file truncated in data",
            valid[..valid.len() - 1].to_vec(),
            &["needs 8 bytes", "only 7", "truncated"],
        ),
        (
            "trailing bytes",
            [&valid[..], &[9, 9, 9]].concat(),
            &["3 unexpected bytes"],
        ),
        (
            "offsets end near usize::MAX",
            huge,
            &["needs 18446744073709551612 bytes"],
        ),
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
    assert!(
        err.contains("nope.safetensors") && err.contains("I/O error"),
        "{err}"
    );
    let empty = dir.path().join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    let err = SafetensorsFile::open(&empty).unwrap_err().to_string();
    assert!(
        err.contains("empty.safetensors") && err.contains("too short"),
        "{err}"
    );
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
            assert_eq!(
                v.data.len() as u64,
                v.dtype.byte_size(v.elements()).unwrap()
            );
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
        assert!(
            !exercise(bytes[..cut].to_vec()),
            "prefix of {cut} bytes accepted"
        );
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
    let first_tensor = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();

    let err = set_index(d, "{\"weight_map\": {");
    assert!(
        err.contains("model.safetensors.index.json")
            && err.contains("invalid safetensors index JSON"),
        "{err}"
    );
    let err = set_index(d, r#"{"metadata": {}}"#);
    assert!(err.contains("missing field `weight_map`"), "{err}");
    let err = set_index(d, r#"{"weight_map": {}}"#);
    assert!(err.contains("weight_map is empty"), "{err}");

    let err = set_index(
        d,
        &format!(r#"{{"weight_map": {{"{first_tensor}": "model-00009-of-00009.safetensors"}}}}"#),
    );
    assert!(
        err.contains("model-00009-of-00009.safetensors") && err.contains("cannot be opened"),
        "{err}"
    );

    for bad in [
        "../model-00001-of-00002.safetensors",
        "sub/x.safetensors",
        "/etc/passwd",
        "..",
        "a\\\\b.safetensors",
        "",
    ] {
        let err = set_index(
            d,
            &format!(r#"{{"weight_map": {{"{first_tensor}": "{bad}"}}}}"#),
        );
        assert!(
            err.contains("not a plain file name") && err.contains(&first_tensor),
            "{bad}: {err}"
        );
    }

    // A tensor the index puts in the wrong shard.
    let mut wm = index["weight_map"].as_object().unwrap().clone();
    let (name, shard) = wm
        .iter()
        .find(|(_, s)| *s == "model-00001-of-00002.safetensors")
        .unwrap();
    let name = name.clone();
    assert_eq!(shard, "model-00001-of-00002.safetensors");
    wm.insert(name.clone(), "model-00002-of-00002.safetensors".into());
    let err = set_index(d, &serde_json::json!({ "weight_map": wm }).to_string());
    assert!(
        err.contains("model-00002-of-00002.safetensors")
            && err.contains(&name)
            && err.contains("no such tensor"),
        "{err}"
    );

    // A shard that is not a safetensors file: the error names the shard.
    std::fs::write(d.join("junk.safetensors"), b"\x05\0\0\0\0\0\0\0{}").unwrap();
    let err = set_index(
        d,
        &format!(r#"{{"weight_map": {{"{first_tensor}": "junk.safetensors"}}}}"#),
    );
    assert!(
        err.contains("junk.safetensors") && err.contains("past the end"),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    let err = SafetensorsModel::open(empty.path())
        .unwrap_err()
        .to_string();
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
