//! Canonical tensor keys and the [`WeightSource`] trait.
//!
//! Whatever the file format, the model is seen through one layout:
//! - linear weights are `[out, in]` row-major (`y = x · Wᵀ`);
//! - expert weights are stacked `[experts, out, in]`, expert-major;
//! - norms are `[n]`; the router is `[experts, hidden]`.
//!
//! A [`Weight`] is zero-copy: it lists the byte ranges of the mapped file(s) that, concatenated in
//! order, form the tensor. GGUF stores a stacked expert tensor as one range; Hugging Face
//! checkpoints store one tensor per expert, which become one range per expert. Quantisation is
//! visible only as the `dtype` of the bytes; consumers decode through `nibble_quant`.

use crate::config::Qwen3MoeConfig;
use nibble_quant::DType;

/// Which tensor of the model, independent of any file's naming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKey {
    /// `[V, H]` token embedding.
    TokenEmbd,
    /// `[H]` final RMSNorm weight.
    OutputNorm,
    /// `[V, H]` lm_head (the embedding again when `tie_word_embeddings`).
    Output,
    /// Per-layer tensors.
    Layer(usize, LayerTensor),
}

/// Tensors of one decoder layer, with their canonical shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    /// `[H]` input_layernorm.
    AttnNorm,
    /// `[Hq*D, H]`.
    AttnQ,
    /// `[Hkv*D, H]`.
    AttnK,
    /// `[Hkv*D, H]`.
    AttnV,
    /// `[H, Hq*D]`.
    AttnOut,
    /// `[D]` shared by all query heads.
    QNorm,
    /// `[D]` shared by all kv heads.
    KNorm,
    /// `[H]` post_attention_layernorm.
    FfnNorm,
    /// `[E, H]` router (mlp.gate).
    Router,
    /// `[E, I, H]` expert gate_proj.
    ExpGate,
    /// `[E, I, H]` expert up_proj.
    ExpUp,
    /// `[E, H, I]` expert down_proj.
    ExpDown,
}

impl LayerTensor {
    pub const ALL: [LayerTensor; 12] = [
        LayerTensor::AttnNorm,
        LayerTensor::AttnQ,
        LayerTensor::AttnK,
        LayerTensor::AttnV,
        LayerTensor::AttnOut,
        LayerTensor::QNorm,
        LayerTensor::KNorm,
        LayerTensor::FfnNorm,
        LayerTensor::Router,
        LayerTensor::ExpGate,
        LayerTensor::ExpUp,
        LayerTensor::ExpDown,
    ];
}

impl TensorKey {
    /// Every tensor of a model with this config, in file order (embedding, layers, norm, head).
    pub fn all(cfg: &Qwen3MoeConfig) -> Vec<TensorKey> {
        let mut keys = vec![TensorKey::TokenEmbd];
        for l in 0..cfg.num_layers {
            keys.extend(LayerTensor::ALL.iter().map(|t| TensorKey::Layer(l, *t)));
        }
        keys.push(TensorKey::OutputNorm);
        if !cfg.tie_word_embeddings {
            keys.push(TensorKey::Output);
        }
        keys
    }

    /// Canonical row-major shape of this tensor under `cfg`.
    pub fn shape(&self, cfg: &Qwen3MoeConfig) -> Vec<usize> {
        let (h, v, d, e, i) = (
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.head_dim,
            cfg.num_experts,
            cfg.moe_intermediate_size,
        );
        match self {
            TensorKey::TokenEmbd | TensorKey::Output => vec![v, h],
            TensorKey::OutputNorm => vec![h],
            TensorKey::Layer(_, t) => match t {
                LayerTensor::AttnNorm | LayerTensor::FfnNorm => vec![h],
                LayerTensor::AttnQ => vec![cfg.q_dim(), h],
                LayerTensor::AttnK | LayerTensor::AttnV => vec![cfg.kv_dim(), h],
                LayerTensor::AttnOut => vec![h, cfg.q_dim()],
                LayerTensor::QNorm | LayerTensor::KNorm => vec![d],
                LayerTensor::Router => vec![e, h],
                LayerTensor::ExpGate | LayerTensor::ExpUp => vec![e, i, h],
                LayerTensor::ExpDown => vec![e, h, i],
            },
        }
    }
}

/// A zero-copy tensor: `parts` concatenated in order are its bytes in the canonical layout.
#[derive(Debug, Clone)]
pub struct Weight<'a> {
    pub dtype: DType,
    /// Canonical row-major shape (see module docs).
    pub shape: Vec<usize>,
    pub parts: Vec<&'a [u8]>,
}

impl<'a> Weight<'a> {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Total bytes over all parts.
    pub fn byte_len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// Bytes of one row (the last dim) in this dtype.
    pub fn row_bytes(&self) -> usize {
        let cols = *self.shape.last().unwrap_or(&1) as u64;
        self.dtype.byte_size(cols).expect("validated at load") as usize
    }

    /// Bytes of row `r` of the tensor viewed as `[rows, cols]` (all leading dims flattened).
    /// Rows never straddle parts: every part is a whole number of rows (checked at load).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        let mut r = r;
        for p in &self.parts {
            let rows_here = p.len() / rb;
            if r < rows_here {
                return &p[r * rb..(r + 1) * rb];
            }
            r -= rows_here;
        }
        panic!(
            "row index out of range for tensor of shape {:?}",
            self.shape
        )
    }
}

/// Where the model's tensors come from (a GGUF file, a Hugging Face directory, memory).
pub trait WeightSource: Send + Sync {
    /// The validated config of the model.
    fn config(&self) -> &Qwen3MoeConfig;
    /// The tensor for `key`, in canonical layout, shape checked against the config. A source
    /// that has to build a tensor (an MLX checkpoint interleaves three arrays) keeps what it
    /// builds here, for backends that read their weights at every step.
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>>;

    /// The storage type of `key`'s tensor, without building it.
    fn dtype(&self, key: TensorKey) -> anyhow::Result<DType> {
        Ok(self.weight(key)?.dtype)
    }

    /// Lend `key`'s tensor to `f` for one use (an upload that copies it): a source that has to
    /// build the tensor builds it for this call and frees it after, so a backend that copies
    /// every tensor once (the GPU's upload) never has the host hold a second copy of the model.
    fn with_weight(
        &self,
        key: TensorKey,
        f: &mut dyn FnMut(&Weight<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        f(&self.weight(key)?)
    }
}

/// Another source's tensors under a changed config (a start-up override such as the CLI's
/// RoPE scaling flags): only the RoPE scaling may differ.
pub struct Reconfigured {
    inner: std::sync::Arc<dyn WeightSource>,
    cfg: Qwen3MoeConfig,
}

impl Reconfigured {
    /// `inner` under `cfg`; an error if `cfg` is invalid or changes a shape of `inner`'s.
    pub fn new(
        inner: std::sync::Arc<dyn WeightSource>,
        cfg: Qwen3MoeConfig,
    ) -> anyhow::Result<Self> {
        cfg.validate()?;
        let shapes = |c: &Qwen3MoeConfig| {
            let mut c = c.clone();
            c.rope_scaling = None;
            c
        };
        anyhow::ensure!(
            shapes(&cfg) == shapes(inner.config()),
            "a config override may change the RoPE scaling only"
        );
        Ok(Reconfigured { inner, cfg })
    }
}

impl WeightSource for Reconfigured {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        self.inner.weight(key)
    }
    fn dtype(&self, key: TensorKey) -> anyhow::Result<DType> {
        self.inner.dtype(key)
    }
    fn with_weight(
        &self,
        key: TensorKey,
        f: &mut dyn FnMut(&Weight<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        self.inner.with_weight(key, f)
    }
}
