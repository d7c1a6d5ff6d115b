//! The model tier: everything that knows Qwen3-MoE, and nothing that knows a file layout or a GPU.
//!
//! - [`config`]: the typed, validated hyper-parameters, read from a Hugging Face `config.json` or
//!   from GGUF `qwen3moe.*` metadata.
//! - [`weights`]: the canonical tensor keys of the model and the [`weights::WeightSource`] trait
//!   through which every consumer (oracle, GPU upload, inspect) reads them, whatever the file.
//! - [`qwen3_moe`]: the name mapping from GGUF and Hugging Face checkpoints to those keys.
//! - [`kv_cache`]: the KV cache's element type and the rounding every backend applies to it.
//! - [`rope`]: RoPE frequency scalings (YaRN, linear) and the rotation table backends apply.
//! - [`synth`]: seeded synthetic models with the real architecture.

pub mod config;
pub mod kv_cache;
pub mod loader;
pub mod mlx;
pub mod qwen3_moe;
pub mod rope;
pub mod synth;
pub mod weights;
