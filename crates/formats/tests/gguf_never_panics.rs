//! Robustness: every truncation and random corruption of a valid file yields `Ok` or `Err`,
//! never a panic, and whatever parses is internally consistent.

mod gguf_common;

use gguf_common::handmade;
use nibble_formats::gguf::GgufFile;
use proptest::prelude::*;

/// Touch everything a parsed file exposes, checking the invariants the reader promises.
fn exercise(f: &GgufFile) {
    for (k, v) in f.metadata() {
        assert!(std::ptr::eq(f.get(k).unwrap(), v));
        let _ = (v.as_u64(), v.as_i64(), v.as_f64(), v.as_str(), v.as_bool());
        let _ = v.type_name();
    }
    assert_eq!(f.data_offset() % f.alignment(), 0);
    for info in f.tensors() {
        let t = f.tensor(&info.name).unwrap();
        assert_eq!(t.data.len() as u64, info.size);
        assert_eq!(info.dtype.byte_size(t.elements()), Ok(info.size));
        assert_eq!(info.offset % f.alignment(), 0);
    }
}

#[test]
fn every_truncation_is_an_error() {
    // The hand-built file ends exactly where b.weight ends, so no strict prefix is valid.
    let full = handmade().bytes;
    exercise(&GgufFile::from_bytes("full", full.clone()).unwrap());
    for len in 0..full.len() {
        let r = GgufFile::from_bytes("cut", full[..len].to_vec());
        assert!(r.is_err(), "prefix of {len} bytes parsed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_byte_edits_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut bytes = handmade().bytes;
        for (at, v) in &edits {
            let i = at.index(bytes.len());
            bytes[i] = *v;
        }
        if do_cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(f) = GgufFile::from_bytes("fuzz", bytes) {
            exercise(&f);
        }
    }

    #[test]
    fn random_u64_in_count_fields_never_panic(
        field in prop::sample::select(vec![
            "n_tensors", "n_kv", "kv4.count", "t0.dims", "t0.offset", "t1.offset", "t1.dims",
        ]),
        value in prop_oneof![any::<u64>(), 0u64..4096, Just(u64::MAX), (0u32..64).prop_map(|s| 1u64 << s)],
    ) {
        let mut b = handmade();
        let r = b.marks[field].clone();
        b.bytes[r.start..r.start + 8].copy_from_slice(&value.to_le_bytes());
        if let Ok(f) = GgufFile::from_bytes("fuzz", b.bytes) {
            exercise(&f);
        }
    }
}
