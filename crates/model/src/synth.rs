//! Seeded synthetic Qwen3-MoE models with the exact architecture (no real weights exist here).
//!
//! Every value is chosen so that all file formats hold *exactly* the same weights:
//! - matrices are Q4_0 blocks whose scale is a power of two and whose nibbles lie in 1..=15
//!   (symmetric ±7, mean zero), so `(q - 8) * 2^k` is exact in Q4_0, BF16, F16 and F32;
//! - norms and the router are drawn and then rounded to BF16, so F32 (GGUF) and BF16 (safetensors)
//!   agree bit for bit once decoded.
//!
//! Scaling keeps activations O(1) over 48 layers: each matrix has entry std `gain / sqrt(fan_in)`;
//! pre-norm residual blocks then add O(1) per layer. The lm_head std is `logit_scale / sqrt(H)`
//! so logits have std ~`logit_scale`: the knob that sets greedy top-1 margins.
//!
//! Generation is deterministic per (seed, tensor, chunk of rows) and parallel over chunks, so a
//! 17 GB model is written in minutes on two cores and identical whatever the thread count.

mod mlx_writer;
pub use mlx_writer::{mlx_bits, mlx_dtype, write_mlx, write_mlx_sharded};

use crate::config::Qwen3MoeConfig;
use crate::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use half::{bf16, f16};
use nibble_quant::DType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::collections::HashMap;

/// Knobs of the synthetic weights.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthParams {
    pub seed: u64,
    /// Std of the logits (top-1 margins grow with it); 8 gives trained-model-like margins.
    pub logit_scale: f32,
    /// Std multiplier of every projection relative to `1/sqrt(fan_in)`.
    pub gain: f32,
    /// Std of router logits (higher = more decisive routing).
    pub router_scale: f32,
    /// Storage types of the matrices.
    pub mix: QuantMix,
}

/// Which storage types synth writes for the weight matrices (vectors and the router are F32
/// in every mix, as llama.cpp keeps them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantMix {
    /// Q4_0 everywhere (the default; its values are exact in BF16, so the safetensors copy of
    /// the same seed holds the same weights).
    #[default]
    Q4_0,
    /// Like llama.cpp's `Q4_K_M`: Q4_K, with Q6_K for the lm_head and for attn_v and
    /// ffn_down_exps in the layers llama.cpp gives more bits (the first and last eighth and
    /// every third between); a matrix whose rows are not whole 256-weight super-blocks falls
    /// back to Q4_0. GGUF only: the weights are quantised from random f32 values.
    Q4KM,
    /// Q8_0 wherever the default mix has Q4_0, holding exactly the Q4_0 mix's values (each
    /// block re-encoded: levels `16 (n - 8)` under the scale `d / 16`, both exact, so the
    /// bytes span the signed range), as llama.cpp's `Q8_0` files store every matrix.
    Q8_0,
    /// Q6_K wherever the default mix has Q4_0, as llama.cpp's `Q6_K` files store every matrix
    /// (a matrix whose rows are not whole 256-weight super-blocks falls back to Q4_0). GGUF
    /// only: the weights are quantised from random f32 values.
    Q6K,
    /// Q4_K wherever the default mix has Q4_0, as `llama-quantize --pure` writes a Q4_K_M file
    /// (no mixture; rows that are not whole super-blocks fall back to Q4_0). GGUF only: the
    /// weights are quantised from random f32 values.
    Q4K,
    /// Like llama.cpp's `Q5_K_M`: [`QuantMix::Q4KM`]'s mixture with Q5_K where it has Q4_K.
    /// GGUF only.
    Q5KM,
}

impl Default for SynthParams {
    fn default() -> Self {
        SynthParams {
            seed: 0,
            logit_scale: 8.0,
            gain: 1.0,
            router_scale: 2.0,
            mix: QuantMix::Q4_0,
        }
    }
}

/// Rows generated per parallel work item (bounds memory and sets the determinism grain).
const CHUNK_ROWS: usize = 256;

/// The storage type synth uses for `key` in a GGUF file (llama.cpp's choices: Q4_0 matrices,
/// F32 norms and router).
pub fn gguf_dtype(key: TensorKey) -> DType {
    match key {
        TensorKey::OutputNorm
        | TensorKey::Layer(
            _,
            LayerTensor::AttnNorm
            | LayerTensor::FfnNorm
            | LayerTensor::QNorm
            | LayerTensor::KNorm
            | LayerTensor::Router,
        ) => DType::F32,
        _ => DType::Q4_0,
    }
}

/// The storage type of `key` under `mix` ([`gguf_dtype`] for [`QuantMix::Q4_0`]).
pub fn storage_dtype(cfg: &Qwen3MoeConfig, mix: QuantMix, key: TensorKey) -> DType {
    let base = gguf_dtype(key);
    if mix == QuantMix::Q4_0 || base != DType::Q4_0 {
        return base;
    }
    if mix == QuantMix::Q8_0 {
        return DType::Q8_0;
    }
    if key.shape(cfg).last().is_none_or(|c| c % 256 != 0) {
        return DType::Q4_0;
    }
    if mix == QuantMix::Q6K {
        return DType::Q6_K;
    }
    if mix == QuantMix::Q4K {
        return DType::Q4_K;
    }
    let base = match mix {
        QuantMix::Q5KM => DType::Q5_K,
        _ => DType::Q4_K,
    };
    let n = cfg.num_layers;
    let more_bits = |l: usize| l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2;
    match key {
        TensorKey::Output => DType::Q6_K,
        TensorKey::Layer(l, LayerTensor::AttnV | LayerTensor::ExpDown) if more_bits(l) => {
            DType::Q6_K
        }
        _ => base,
    }
}

/// Stable index of a key, used to derive its RNG stream.
fn key_index(key: TensorKey) -> u64 {
    match key {
        TensorKey::TokenEmbd => 0,
        TensorKey::OutputNorm => 1,
        TensorKey::Output => 2,
        TensorKey::Layer(l, t) => {
            let ti = LayerTensor::ALL.iter().position(|x| *x == t).unwrap_or(0) as u64;
            16 + l as u64 * 16 + ti
        }
    }
}

fn rng_for(seed: u64, key: TensorKey, chunk: usize) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    r.set_stream(key_index(key).wrapping_mul(1 << 24) + chunk as u64);
    r
}

/// Entry std of `key` under `p` (see module docs).
fn target_std(cfg: &Qwen3MoeConfig, p: &SynthParams, key: TensorKey) -> f32 {
    let h = cfg.hidden_size as f32;
    match key {
        // Embedding rows feed an RMSNorm first, so their scale only sets the residual's start.
        TensorKey::TokenEmbd => 1.0,
        TensorKey::Output => p.logit_scale / h.sqrt(),
        TensorKey::Layer(_, t) => match t {
            LayerTensor::AttnQ | LayerTensor::AttnK | LayerTensor::AttnV => p.gain / h.sqrt(),
            LayerTensor::AttnOut => p.gain / (cfg.q_dim() as f32).sqrt(),
            LayerTensor::ExpGate | LayerTensor::ExpUp => p.gain / h.sqrt(),
            // The SwiGLU product shrinks the signal; give down_proj extra gain to compensate.
            LayerTensor::ExpDown => 2.0 * p.gain / (cfg.moe_intermediate_size as f32).sqrt(),
            LayerTensor::Router => p.router_scale / h.sqrt(),
            _ => 0.0,
        },
        TensorKey::OutputNorm => 0.0,
    }
}

/// Generate Q4_0 bytes for rows `[r0, r1)` of a matrix with `cols` columns.
fn q4_rows(rng: &mut ChaCha8Rng, rows: usize, cols: usize, std: f32, out: &mut Vec<u8>) {
    // Uniform nibbles in 1..=15 have std sqrt((15^2-1)/12) = 4.32 in units of the scale.
    let base = (std / 4.32).log2().round() as i32;
    for _ in 0..rows {
        for _ in 0..cols / 32 {
            // Per-block exponent jitter gives realistic scale variation (and outlier blocks).
            let e = base + [-1, 0, 0, 0, 0, 0, 0, 1][rng.random_range(0..8usize)];
            let d = half::f16::from_f32((e as f32).exp2());
            out.extend_from_slice(&d.to_le_bytes());
            for _ in 0..16 {
                let lo: u8 = rng.random_range(1..=15);
                let hi: u8 = rng.random_range(1..=15);
                out.push(lo | (hi << 4));
            }
        }
    }
}

/// Bytes of rows `[r0, r1)` of `key` in GGUF storage (Q4_0 matrices, F32 vectors/router).
fn gguf_rows(
    cfg: &Qwen3MoeConfig,
    p: &SynthParams,
    key: TensorKey,
    chunk: usize,
    rows: usize,
    cols: usize,
) -> Vec<u8> {
    let mut rng = rng_for(p.seed, key, chunk);
    let std = target_std(cfg, p, key);
    let dtype = storage_dtype(cfg, p.mix, key);
    if dtype == DType::Q4_0 {
        let mut out = Vec::with_capacity(rows * cols / 32 * 18);
        q4_rows(&mut rng, rows, cols, std, &mut out);
        return out;
    }
    if dtype == DType::Q8_0 && p.mix == QuantMix::Q8_0 {
        let mut q4 = Vec::with_capacity(rows * cols / 32 * 18);
        q4_rows(&mut rng, rows, cols, std, &mut q4);
        return q4_0_as_q8_0(&q4);
    }
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| {
            let v = if std == 0.0 {
                // Norm weights: around 1 with a little spread, as trained norms are.
                1.0 + rng.random_range(-0.25f32..0.25)
            } else {
                // Sum of uniforms ~ Gaussian; std of U(-1,1)*3 sum is 1.
                let s: f32 = (0..3).map(|_| rng.random_range(-1.0f32..1.0)).sum();
                s * std
            };
            // Round to BF16 so the safetensors copy is exact.
            bf16::from_f32(v).to_f32()
        })
        .collect();
    nibble_quant::encode_float(dtype, &vals)
}

/// Q4_0 blocks re-encoded as Q8_0 blocks of the same values: level `16 (n - 8)` under `d / 16`
/// where that scale is exact in f16 (synth's scales are powers of two), else `n - 8` under `d`.
fn q4_0_as_q8_0(q4: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(q4.len() / 18 * 34);
    for b in q4.chunks_exact(18) {
        let d = f16::from_le_bytes([b[0], b[1]]);
        let d16 = f16::from_f32(d.to_f32() / 16.0);
        let (scale, mul) = match d16.to_f32() * 16.0 == d.to_f32() {
            true => (d16, 16),
            false => (d, 1),
        };
        out.extend_from_slice(&scale.to_le_bytes());
        let level = |n: u8| ((n as i32 - 8) * mul) as i8 as u8;
        out.extend(b[2..18].iter().map(|&x| level(x & 0xF)));
        out.extend(b[2..18].iter().map(|&x| level(x >> 4)));
    }
    out
}

/// The full GGUF-storage bytes of `key`, generated in parallel chunks of rows. Deterministic.
pub fn tensor_bytes(cfg: &Qwen3MoeConfig, p: &SynthParams, key: TensorKey) -> Vec<u8> {
    let shape = key.shape(cfg);
    let cols = *shape.last().expect("non-empty shape");
    let rows: usize = shape[..shape.len() - 1].iter().product();
    let chunks: Vec<Vec<u8>> = (0..rows.div_ceil(CHUNK_ROWS))
        .into_par_iter()
        .map(|c| {
            let r0 = c * CHUNK_ROWS;
            let n = CHUNK_ROWS.min(rows - r0);
            gguf_rows(cfg, p, key, c, n, cols)
        })
        .collect();
    chunks.concat()
}

/// A synthetic model held in memory, as synth would write it to GGUF (one part per tensor): for
/// tests and benchmarks that want a model without a file.
pub struct MemModel {
    pub cfg: Qwen3MoeConfig,
    /// The storage types ([`storage_dtype`]).
    pub mix: QuantMix,
    /// GGUF-storage bytes of every tensor.
    pub tensors: HashMap<TensorKey, Vec<u8>>,
}

impl MemModel {
    /// Every tensor of `cfg`, generated with `p`.
    pub fn new(cfg: &Qwen3MoeConfig, p: &SynthParams) -> Self {
        let tensors = TensorKey::all(cfg)
            .into_iter()
            .map(|k| (k, tensor_bytes(cfg, p, k)))
            .collect();
        MemModel {
            cfg: cfg.clone(),
            mix: p.mix,
            tensors,
        }
    }
}

impl WeightSource for MemModel {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let b = self
            .tensors
            .get(&key)
            .ok_or_else(|| anyhow::anyhow!("the in-memory model has no tensor {key:?}"))?;
        Ok(Weight {
            dtype: storage_dtype(&self.cfg, self.mix, key),
            shape: key.shape(&self.cfg),
            parts: vec![b.as_slice()],
        })
    }
}

/// Decode GGUF-storage bytes of a synthetic tensor into BF16 bytes for safetensors (exact).
pub fn to_bf16_bytes(key: TensorKey, gguf_bytes: &[u8], elements: usize) -> Vec<u8> {
    let mut vals = vec![0f32; elements];
    nibble_quant::dequantize(gguf_dtype(key), gguf_bytes, &mut vals)
        .expect("synth writes valid blocks");
    vals.iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect()
}

/// Apply `f` to exact BF16 of `key` and check (debug aid for tests): every synth value is exact in BF16.
pub fn is_exact_in_bf16(vals: &[f32]) -> bool {
    vals.iter().all(|v| bf16::from_f32(*v).to_f32() == *v)
}

/// Tokenizer data to embed in a synthetic GGUF (`tokenizer.ggml.*`, formats-spec §3.8), as plain
/// values so this tier does not depend on the tokenizer implementation.
#[derive(Debug, Clone, Default)]
pub struct GgufTokenizerMeta {
    /// "gpt2" for byte-level BPE.
    pub model: String,
    /// "qwen2" selects the Qwen2 pre-tokenizer regex.
    pub pre: String,
    /// One string per id, `vocab_size` entries.
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    /// "left right" per merge, rank order.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub chat_template: Option<String>,
}

impl GgufTokenizerMeta {
    fn metadata(&self) -> Vec<(String, MetaValue)> {
        let strings = |v: &[String]| {
            MetaValue::Array(v.iter().map(|s| MetaValue::String(s.clone())).collect())
        };
        let mut m = vec![
            (
                "tokenizer.ggml.model".to_string(),
                MetaValue::String(self.model.clone()),
            ),
            (
                "tokenizer.ggml.pre".to_string(),
                MetaValue::String(self.pre.clone()),
            ),
            ("tokenizer.ggml.tokens".to_string(), strings(&self.tokens)),
            (
                "tokenizer.ggml.token_type".to_string(),
                MetaValue::Array(
                    self.token_types
                        .iter()
                        .map(|t| MetaValue::I32(*t))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.merges".to_string(), strings(&self.merges)),
            (
                "tokenizer.ggml.add_bos_token".to_string(),
                MetaValue::Bool(false),
            ),
        ];
        for (k, v) in [
            ("tokenizer.ggml.bos_token_id", self.bos),
            ("tokenizer.ggml.eos_token_id", self.eos),
            ("tokenizer.ggml.padding_token_id", self.pad),
        ] {
            if let Some(id) = v {
                m.push((k.to_string(), MetaValue::U32(id)));
            }
        }
        if let Some(t) = &self.chat_template {
            m.push((
                "tokenizer.chat_template".to_string(),
                MetaValue::String(t.clone()),
            ));
        }
        m
    }
}

use indicatif::{ProgressBar, ProgressStyle};
use nibble_formats::gguf::{GgufWriter, MetaValue, TensorSpec as GgufSpec};
use nibble_formats::safetensors::{write_model, TensorSpec as StSpec};
use std::io::BufWriter;
use std::path::{Path, PathBuf};

fn progress(total: u64, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})")
            .expect("static template"),
    );
    pb
}

/// Total bytes of the GGUF tensor data for `cfg` (for progress and `inspect` cross-checks).
pub fn gguf_tensor_bytes(cfg: &Qwen3MoeConfig, mix: QuantMix) -> u64 {
    TensorKey::all(cfg)
        .into_iter()
        .map(|k| {
            let n: usize = k.shape(cfg).iter().product();
            storage_dtype(cfg, mix, k)
                .byte_size(n as u64)
                .expect("whole blocks")
        })
        .sum()
}

/// Write a complete synthetic GGUF (matrices in `p.mix`, F32 norms and router, optional
/// tokenizer).
pub fn write_gguf(
    cfg: &Qwen3MoeConfig,
    p: &SynthParams,
    tokenizer: Option<&GgufTokenizerMeta>,
    path: &Path,
    quiet: bool,
) -> anyhow::Result<()> {
    cfg.validate()?;
    let keys = TensorKey::all(cfg);
    let specs: Vec<GgufSpec> = keys
        .iter()
        .map(|k| GgufSpec {
            name: crate::qwen3_moe::gguf_name(*k),
            dtype: storage_dtype(cfg, p.mix, *k),
            shape: k.shape(cfg).iter().map(|d| *d as u64).collect(),
        })
        .collect();
    let mut meta = crate::qwen3_moe::gguf_metadata(cfg, "nibble synthetic Qwen3-MoE");
    // llama.cpp's file-type enum: 15 = MOSTLY_Q4_K_M (also what `--pure` keeps), 17 =
    // MOSTLY_Q5_K_M, 7 =
    // MOSTLY_Q8_0, 18 = MOSTLY_Q6_K.
    let file_type = match p.mix {
        QuantMix::Q4_0 => None,
        QuantMix::Q4KM | QuantMix::Q4K => Some(15),
        QuantMix::Q8_0 => Some(7),
        QuantMix::Q6K => Some(18),
        QuantMix::Q5KM => Some(17),
    };
    if let Some(t) = file_type {
        for (k, v) in meta.iter_mut() {
            if k == "general.file_type" {
                *v = MetaValue::U32(t);
            }
        }
    }
    meta.push(("nibble.synth.seed".into(), MetaValue::U64(p.seed)));
    meta.push((
        "nibble.synth.logit_scale".into(),
        MetaValue::F32(p.logit_scale),
    ));
    meta.push((
        format!("{}.vocab_size", crate::qwen3_moe::GGUF_ARCH),
        MetaValue::U32(cfg.vocab_size as u32),
    ));
    if let Some(t) = tokenizer {
        meta.extend(t.metadata());
    }
    // Written beside `path` and renamed over it at the end: a model already at `path` stays
    // whole for whoever has it mapped (a server), and a failed write leaves no partial file.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = tempfile::NamedTempFile::new_in(dir)
        .map_err(|e| anyhow::anyhow!("{}: cannot create: {e}", path.display()))?;
    let file = tmp.as_file().try_clone()?;
    let mut w = GgufWriter::new(BufWriter::with_capacity(1 << 22, file), meta, specs)?;
    let pb = progress(gguf_tensor_bytes(cfg, p.mix), quiet);
    for (k, name) in keys.iter().map(|k| (*k, crate::qwen3_moe::gguf_name(*k))) {
        let bytes = tensor_bytes(cfg, p, k);
        w.write_tensor(&name, &bytes)?;
        pb.inc(bytes.len() as u64);
    }
    let out = w.finish()?;
    out.into_inner()
        .map_err(|e| anyhow::anyhow!("{}: flush failed: {e}", path.display()))?
        .sync_all()?;
    #[cfg(unix)]
    {
        // A temporary file is created owner-only; a model file is readable by all, as
        // `File::create` makes it under the usual umask.
        use std::os::unix::fs::PermissionsExt;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    tmp.persist(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot rename into place: {e}", path.display()))?;
    pb.finish_and_clear();
    Ok(())
}

/// Write a Hugging Face checkpoint directory: config.json + BF16 safetensors (sharded at 4 GiB)
/// holding exactly the weights of the GGUF made with the same seed. Tokenizer files are copied
/// beside it by the caller.
pub fn write_safetensors(
    cfg: &Qwen3MoeConfig,
    p: &SynthParams,
    dir: &Path,
    quiet: bool,
) -> anyhow::Result<Vec<PathBuf>> {
    cfg.validate()?;
    anyhow::ensure!(
        p.mix == QuantMix::Q4_0,
        "the safetensors copy holds the Q4_0 mix's weights exactly; {:?} is GGUF only",
        p.mix
    );
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&cfg.to_hf_json())?,
    )?;
    // One safetensors tensor per HF name; experts are split out of the stacked synthetic tensor.
    let mut specs = vec![];
    let mut origin = vec![]; // (key, expert index or None)
    for k in TensorKey::all(cfg) {
        let names = crate::qwen3_moe::hf_names(k, cfg);
        let shape = k.shape(cfg);
        let stacked = names.len() > 1;
        for (e, name) in names.into_iter().enumerate() {
            let s: Vec<u64> = if stacked { &shape[1..] } else { &shape[..] }
                .iter()
                .map(|d| *d as u64)
                .collect();
            specs.push(StSpec {
                name,
                dtype: nibble_formats::safetensors::Element::Float(DType::BF16),
                shape: s,
            });
            origin.push((k, stacked.then_some(e)));
        }
    }
    let pb = progress(
        specs
            .iter()
            .map(|s| s.shape.iter().product::<u64>() * 2)
            .sum(),
        quiet,
    );
    // Cache the last stacked tensor so its experts are not regenerated once per expert.
    let mut cache: Option<(TensorKey, Vec<u8>)> = None;
    let mut data = |i: usize| -> Vec<u8> {
        let (k, expert) = origin[i];
        if cache.as_ref().map(|c| c.0) != Some(k) {
            let n: usize = k.shape(cfg).iter().product();
            cache = Some((k, to_bf16_bytes(k, &tensor_bytes(cfg, p, k), n)));
        }
        let all = &cache.as_ref().expect("just filled").1;
        let out = match expert {
            None => all.clone(),
            Some(e) => {
                let per = all.len() / cfg.num_experts;
                all[e * per..(e + 1) * per].to_vec()
            }
        };
        pb.inc(out.len() as u64);
        out
    };
    let files = write_model(dir, &specs, 4 << 30, &mut data)?;
    pb.finish_and_clear();
    Ok(files)
}
