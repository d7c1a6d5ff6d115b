//! Upload every tensor of a model from a [`WeightSource`] to the GPU once.
//!
//! Matrices in the model's block type (one per model, the embedding's: Q4_0, MLX's `MLX_A4`,
//! Q8_0, `MLX_A8`, Q6_K or Q4_K) stay packed in its GPU form (`tensor.rs` `QForm`); any other
//! matrix dtype (F32/F16/BF16, another K-quant, e.g. the Q6_K `output.weight` of llama.cpp's
//! Q4_0 files, or a Q8_0 matrix in a Q4_0 model) is decoded to f32 with the reference decoder, which is exact:
//! nibble never re-quantises weights. Norm weights become f32 vectors. The embedding and the
//! expert tensors must be in that block type; anything else is a clear error.
//! q, k and v are fused into one `[Hq*D + 2*Hkv*D, H]` matrix so one matvec produces the
//! attention kernel's `qkv` buffer.

use crate::context::Context;
use crate::tensor::{F32Matrix, Q4Matrix, QForm};
use anyhow::{bail, ensure, Context as _, Result};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use nibble_quant::DType;

/// A matrix in whichever GPU form its dtype allows.
#[derive(Debug)]
pub enum Matrix {
    Q4(Q4Matrix),
    F32(F32Matrix),
}

impl Matrix {
    pub fn bytes(&self) -> u64 {
        match self {
            Matrix::Q4(m) => m.bytes(),
            Matrix::F32(m) => m.bytes(),
        }
    }
}

/// One decoder layer on the GPU.
#[derive(Debug)]
pub struct LayerWeights {
    /// `[H]` f32.
    pub attn_norm: wgpu::Buffer,
    /// `[Hq*D + 2*Hkv*D, H]`: q, k, v rows stacked.
    pub qkv: Matrix,
    /// `[H, Hq*D]`.
    pub o: Matrix,
    /// `[D]` f32.
    pub q_norm: wgpu::Buffer,
    pub k_norm: wgpu::Buffer,
    /// `[H]` f32.
    pub ffn_norm: wgpu::Buffer,
    /// `[E, H]`.
    pub router: Matrix,
    /// `[E*I, H]`, `[E*I, H]`, `[E*H, I]`, split on whole experts.
    pub gate: Q4Matrix,
    pub up: Q4Matrix,
    pub down: Q4Matrix,
}

/// All weights of a model on the GPU.
#[derive(Debug)]
pub struct GpuWeights {
    pub cfg: Qwen3MoeConfig,
    /// The block form of every int matrix (`tensor.rs`): the embedding's type decides it.
    pub form: QForm,
    /// `[V, H]`.
    pub embed: Q4Matrix,
    pub layers: Vec<LayerWeights>,
    /// `[H]` f32.
    pub out_norm: wgpu::Buffer,
    /// `[V, H]`; `None` when tied to `embed`.
    pub lm_head: Option<Matrix>,
    /// Bytes resident on the GPU.
    pub resident_bytes: u64,
}

/// Decode any dtype to f32 row by row with the reference decoder.
fn to_f32(w: &Weight<'_>) -> Result<Vec<f32>> {
    let cols = *w.shape.last().unwrap_or(&1);
    let rows = w.elements() / cols.max(1);
    let mut out = vec![0f32; w.elements()];
    for r in 0..rows {
        nibble_quant::dequantize(w.dtype, w.row(r), &mut out[r * cols..(r + 1) * cols])?;
    }
    Ok(out)
}

fn rows_cols(w: &Weight<'_>) -> (usize, usize) {
    let cols = *w.shape.last().unwrap_or(&1);
    (w.elements() / cols.max(1), cols)
}

/// Upload several weights with the same column count as one row-stacked matrix: blocks in the
/// model's block type `int4` (Q4_0, MLX_A4, Q8_0, MLX_A8, Q6_K or Q4_K) stay packed, anything else is
/// widened ([`widened`]).
fn matrix(ctx: &Context, label: &str, ws: &[Weight<'_>], int4: DType) -> Result<Matrix> {
    let cols = rows_cols(&ws[0]).1;
    ensure!(
        ws.iter().all(|w| rows_cols(w).1 == cols),
        "{label}: stacked tensors differ in width"
    );
    let rows: usize = ws.iter().map(|w| rows_cols(w).0).sum();
    if ws.iter().all(|w| w.dtype == int4) {
        let parts: Vec<&[u8]> = ws.iter().flat_map(|w| w.parts.iter().copied()).collect();
        return Ok(Matrix::Q4(Q4Matrix::upload_dtype(
            ctx, label, int4, rows, cols, 1, &parts,
        )?));
    }
    widened(ctx, label, ws)
}

/// Upload several weights with the same column count as one row-stacked f32 matrix, each
/// decoded with the reference decoder (exact).
fn widened(ctx: &Context, label: &str, ws: &[Weight<'_>]) -> Result<Matrix> {
    let cols = rows_cols(&ws[0]).1;
    ensure!(
        ws.iter().all(|w| rows_cols(w).1 == cols),
        "{label}: stacked tensors differ in width"
    );
    let rows: usize = ws.iter().map(|w| rows_cols(w).0).sum();
    let mut vals = Vec::with_capacity(rows * cols);
    for w in ws {
        vals.extend(to_f32(w)?);
    }
    Ok(Matrix::F32(F32Matrix::upload(
        ctx, label, rows, cols, &vals,
    )?))
}

fn q4(
    ctx: &Context,
    label: &str,
    w: &Weight<'_>,
    row_multiple: usize,
    int4: DType,
) -> Result<Q4Matrix> {
    if w.dtype != int4 {
        bail!(
            "{label} is {}: the GPU backend needs {} here (the model's int4 type)",
            w.dtype.name(),
            int4.name()
        );
    }
    let (rows, cols) = rows_cols(w);
    Ok(Q4Matrix::upload_dtype(
        ctx,
        label,
        int4,
        rows,
        cols,
        row_multiple,
        &w.parts,
    )?)
}

fn vector(ctx: &Context, label: &str, w: &Weight<'_>) -> Result<wgpu::Buffer> {
    let v = to_f32(w)?;
    Ok(ctx.storage_init(label, bytemuck::cast_slice(&v))?)
}

/// Whether the GPU backend can hold `src`, and in which block type: its embedding and expert
/// kernels read Q4_0, MLX's affine `MLX_A4`, Q8_0, `MLX_A8`, Q6_K or Q4_K, one type for all of
/// them (llama.cpp's mixed K-quant files, `Q4_K_M` and the like, are refused here, before any
/// upload; the CPU backend runs them). The error names the first other tensor and counts the others.
pub fn check_supported(src: &dyn WeightSource) -> Result<DType> {
    let cfg = src.config();
    let mut keys = vec![TensorKey::TokenEmbd];
    for l in 0..cfg.num_layers {
        for t in [
            LayerTensor::ExpGate,
            LayerTensor::ExpUp,
            LayerTensor::ExpDown,
        ] {
            keys.push(TensorKey::Layer(l, t));
        }
    }
    let dtype_of =
        |k: TensorKey| -> Result<DType> { src.dtype(k).with_context(|| format!("loading {k:?}")) };
    // The embedding's type decides; MLX files are all MLX_A4 where they are 4-bit.
    let int4 = match dtype_of(TensorKey::TokenEmbd)? {
        t @ (DType::MLX_A4 | DType::Q8_0 | DType::MLX_A8 | DType::Q6_K | DType::Q4_K) => t,
        _ => DType::Q4_0,
    };
    let mut bad = Vec::new();
    for k in keys {
        let dtype = dtype_of(k)?;
        if dtype != int4 {
            bad.push((k, dtype));
        }
    }
    if let Some((k, dtype)) = bad.first() {
        bail!(
            "the GPU backend reads the token embedding and the expert tensors in one block \
             type only (Q4_0, MLX_A4, Q8_0, MLX_A8, Q6_K or Q4_K), and {} of them are not {} ({} is {}); the CPU \
             backend (--backend cpu) runs this model",
            bad.len(),
            int4.name(),
            nibble_model::qwen3_moe::gguf_name(*k),
            dtype.name()
        );
    }
    Ok(int4)
}

/// `f` of `key`'s tensor, lent by the source for this one use ([`WeightSource::with_weight`]:
/// an MLX checkpoint's blocks are built for the upload and freed after it).
fn lend<T>(
    src: &dyn WeightSource,
    key: TensorKey,
    f: impl FnOnce(&Weight<'_>) -> Result<T>,
) -> Result<T> {
    let mut f = Some(f);
    let mut out = None;
    src.with_weight(key, &mut |w| {
        if let Some(f) = f.take() {
            out = Some(f(w)?);
        }
        Ok(())
    })
    .with_context(|| format!("loading {key:?}"))?;
    out.with_context(|| format!("the weight source lent no tensor for {key:?}"))
}

impl GpuWeights {
    /// Upload every tensor of `src` (shapes were checked by the source against its config).
    pub fn upload(ctx: &Context, src: &dyn WeightSource) -> Result<GpuWeights> {
        let cfg = src.config().clone();
        cfg.validate()?;
        let int4 = check_supported(src)?;
        // Every tensor is lent for its upload only (`lend`).
        let embed = lend(src, TensorKey::TokenEmbd, |w| {
            q4(ctx, "token_embd", w, 1, int4)
        })?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let key = |t: LayerTensor| TensorKey::Layer(l, t);
            let name = |s: &str| format!("blk.{l}.{s}");
            let vec = |t: LayerTensor, s: &str| lend(src, key(t), |w| vector(ctx, &name(s), w));
            let mat = |t: LayerTensor, s: &str| {
                lend(src, key(t), |w| {
                    matrix(ctx, &name(s), std::slice::from_ref(w), int4)
                })
            };
            let experts = |t: LayerTensor, s: &str, row_multiple: usize| {
                lend(src, key(t), |w| q4(ctx, &name(s), w, row_multiple, int4))
            };
            use LayerTensor as T;
            // q, k and v stack into one matrix, so all three are lent at once.
            let qkv = lend(src, key(T::AttnQ), |q| {
                lend(src, key(T::AttnK), |k| {
                    lend(src, key(T::AttnV), |v| {
                        matrix(
                            ctx,
                            &name("attn_qkv"),
                            &[q.clone(), k.clone(), v.clone()],
                            int4,
                        )
                    })
                })
            })?;
            layers.push(LayerWeights {
                attn_norm: vec(T::AttnNorm, "attn_norm")?,
                qkv,
                o: mat(T::AttnOut, "attn_output")?,
                q_norm: vec(T::QNorm, "attn_q_norm")?,
                k_norm: vec(T::KNorm, "attn_k_norm")?,
                ffn_norm: vec(T::FfnNorm, "ffn_norm")?,
                // The router is f32 on the GPU whatever its type (the fold and the routing
                // kernels read f32; an 8-bit MLX checkpoint's router is MLX_A8 like its
                // matrices).
                router: lend(src, key(T::Router), |w| {
                    widened(ctx, &name("ffn_gate_inp"), std::slice::from_ref(w))
                })?,
                gate: experts(T::ExpGate, "ffn_gate_exps", cfg.moe_intermediate_size)?,
                up: experts(T::ExpUp, "ffn_up_exps", cfg.moe_intermediate_size)?,
                down: experts(T::ExpDown, "ffn_down_exps", cfg.hidden_size)?,
            });
        }
        let out_norm = lend(src, TensorKey::OutputNorm, |w| {
            vector(ctx, "output_norm", w)
        })?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(lend(src, TensorKey::Output, |w| {
                matrix(ctx, "output", std::slice::from_ref(w), int4)
            })?)
        };
        let vec_bytes = |b: &wgpu::Buffer| b.size();
        let mut resident =
            embed.bytes() + vec_bytes(&out_norm) + lm_head.as_ref().map_or(0, Matrix::bytes);
        for lw in &layers {
            resident += [&lw.attn_norm, &lw.q_norm, &lw.k_norm, &lw.ffn_norm]
                .into_iter()
                .map(vec_bytes)
                .sum::<u64>();
            resident += lw.qkv.bytes() + lw.o.bytes() + lw.router.bytes();
            resident += lw.gate.bytes() + lw.up.bytes() + lw.down.bytes();
        }
        Ok(GpuWeights {
            cfg,
            form: match int4 {
                DType::MLX_A4 => QForm::Affine4,
                DType::Q8_0 => QForm::Q8_0,
                DType::MLX_A8 => QForm::Affine8,
                DType::Q6_K => QForm::Q6K,
                DType::Q4_K => QForm::Q4K,
                _ => QForm::Q4_0,
            },
            embed,
            layers,
            out_norm,
            lm_head,
            resident_bytes: resident,
        })
    }

    /// The lm_head matrix (the embedding when tied).
    pub fn head(&self) -> HeadRef<'_> {
        match &self.lm_head {
            Some(Matrix::Q4(m)) => HeadRef::Q4(m),
            Some(Matrix::F32(m)) => HeadRef::F32(m),
            None => HeadRef::Q4(&self.embed),
        }
    }
}

/// A borrowed lm_head.
pub enum HeadRef<'a> {
    Q4(&'a Q4Matrix),
    F32(&'a F32Matrix),
}
