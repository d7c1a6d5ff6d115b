//! Fuzz target: parse arbitrary bytes as safetensors and touch every tensor view.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nibble_formats::safetensors::SafetensorsFile;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = SafetensorsFile::from_bytes("fuzz.safetensors", data.to_vec()) else {
        return;
    };
    let mut n = f.metadata().map_or(0, |m| m.len());
    for name in f.names() {
        if let Ok(Some(t)) = f.tensor(name) {
            assert_eq!(
                t.dtype.byte_size(t.elements()).ok(),
                Some(t.data.len() as u64)
            );
            n += t.data.iter().map(|&b| b as usize).sum::<usize>();
        }
    }
    std::hint::black_box(n);
});
