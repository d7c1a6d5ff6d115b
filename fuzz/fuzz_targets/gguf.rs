//! Fuzz target: parse arbitrary bytes as GGUF; whatever parses must hand out consistent views.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nibble_formats::gguf::{GgufFile, MetaValue};

fn touch(v: &MetaValue) -> usize {
    let _ = (
        v.as_u64(),
        v.as_i64(),
        v.as_f64(),
        v.as_bool(),
        v.type_name(),
    );
    match v {
        MetaValue::String(s) => s.len(),
        MetaValue::Array(items) => items.iter().map(touch).sum(),
        _ => 1,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    let mut n = 0;
    for (k, v) in f.metadata() {
        assert!(f.get(k).is_some());
        n += touch(v);
    }
    assert!(f.data_offset().is_multiple_of(f.alignment()));
    for info in f.tensors() {
        let t = f.tensor(&info.name).expect("listed tensor has a view");
        assert_eq!(t.data.len() as u64, info.size);
        assert_eq!(info.dtype.byte_size(t.elements()).ok(), Some(info.size));
        // Read every byte so an out-of-bounds view would fault under the sanitizer.
        n += t.data.iter().map(|&b| b as usize).sum::<usize>();
    }
    std::hint::black_box(n);
});
