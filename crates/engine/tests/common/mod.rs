//! Shared helpers for the engine's integration tests: fixture loading and locating the real
//! Qwen3 tokenizer (fetched by `scripts/fetch-tokenizer.sh`).
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

use nibble_engine::Tokenizer;

/// `<repo>/tests/fixtures/<name>` parsed as JSON.
pub fn fixture(name: &str) -> serde_json::Value {
    let path = repo_root().join("tests/fixtures").join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad fixture {}: {e}", path.display()))
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tokenizer directory: `$NIBBLE_TOKENIZER_DIR`, else `<repo>/vendor/qwen3-tokenizer`.
/// Returns `None` (after a loud message) when it is absent and `CI` is unset; under `CI` a
/// missing tokenizer fails the test.
pub fn tokenizer_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("NIBBLE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("vendor/qwen3-tokenizer"));
    if dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file() {
        return Some(dir);
    }
    let msg = format!(
        "Qwen3 tokenizer not found in {} (run scripts/fetch-tokenizer.sh or set NIBBLE_TOKENIZER_DIR)",
        dir.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; CI is set, so this is a failure");
    }
    eprintln!("\n!!!!!!!! SKIPPING TOKENIZER TEST: {msg} !!!!!!!!\n");
    None
}

/// The real tokenizer, or `None` if the test should be skipped.
pub fn qwen3_tokenizer() -> Option<Tokenizer> {
    let dir = tokenizer_dir()?;
    Some(Tokenizer::from_hf_dir(&dir).expect("load Qwen3 tokenizer"))
}

/// One tokenizer golden case.
pub struct TextCase {
    pub name: String,
    pub text: String,
    pub ids: Vec<u32>,
    pub decoded: String,
}

pub fn text_cases() -> Vec<TextCase> {
    let golden = fixture("tokenizer_golden.json");
    golden["cases"]
        .as_array()
        .expect("cases array")
        .iter()
        .map(|c| TextCase {
            name: c["name"].as_str().unwrap().to_owned(),
            text: c["text"].as_str().unwrap().to_owned(),
            ids: serde_json::from_value(c["ids"].clone()).unwrap(),
            decoded: c["decoded"].as_str().unwrap().to_owned(),
        })
        .collect()
}
