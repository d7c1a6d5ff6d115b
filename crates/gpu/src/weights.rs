//! Upload every tensor of a model from a [`WeightSource`] to the GPU once.
//!
//! Each matrix keeps its own stored type: a type the kernels read packed (Q4_0, MLX's
//! `MLX_A4`, Q8_0, `MLX_A8`, Q6_K, Q4_K or Q5_K) stays packed in its GPU form (`tensor.rs`
//! `QForm`), so a file that mixes them (llama.cpp's `Q4_K_M` and `Q5_K_M`: Q4_K or Q5_K with
//! Q6_K for the lm_head and for attn_v and ffn_down_exps in some layers; its `Q4_0` files' Q6_K
//! lm_head) runs with each tensor as stored. Any other matrix dtype (F32/F16/BF16) is decoded to f32
//! with the reference decoder, which is exact: nibble never re-quantises weights. Norm
//! weights become f32 vectors. The embedding and the expert tensors must be of a packed type,
//! and each layer's gate and up of one (the gate/up kernel reads both alike); anything else
//! is a clear error before any upload ([`check_supported`]).
//! q, k and v are stacked into one `[Hq*D + 2*Hkv*D, H]` matrix so the qkv matvec fills the
//! attention kernel's `qkv` buffer; where their types differ, each run of one type is a part
//! of its own form ([`Q4Matrix::stack`]).

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

/// Which dense matrices (qkv, o-proj, lm_head) stay packed: the f32-activation kernels read
/// every form, the quantised and bfp24 numerics' Q4_0 only (llama.cpp's Q4_0 files store the
/// lm_head as Q6_K: widened for them, exactly, as before per-tensor forms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseForms {
    Any,
    Q4_0Only,
}

/// Upload several weights with the same column count as one row-stacked matrix: if every one
/// is of a type the kernels read packed (and `dense` allows), each run of one type stays packed
/// as a part of its form ([`Q4Matrix::stack`]; one run, one upload, as before); otherwise all
/// are widened ([`widened`]).
fn matrix(ctx: &Context, label: &str, ws: &[Weight<'_>], dense: DenseForms) -> Result<Matrix> {
    let cols = rows_cols(&ws[0]).1;
    ensure!(
        ws.iter().all(|w| rows_cols(w).1 == cols),
        "{label}: stacked tensors differ in width"
    );
    let packed = |w: &Weight<'_>| match dense {
        DenseForms::Any => QForm::of(w.dtype).is_some(),
        DenseForms::Q4_0Only => w.dtype == DType::Q4_0,
    };
    if !ws.iter().all(packed) {
        return widened(ctx, label, ws);
    }
    let mut runs = Vec::new();
    for run in ws.chunk_by(|a, b| a.dtype == b.dtype) {
        let rows: usize = run.iter().map(|w| rows_cols(w).0).sum();
        let parts: Vec<&[u8]> = run.iter().flat_map(|w| w.parts.iter().copied()).collect();
        runs.push(Q4Matrix::upload_dtype(
            ctx,
            label,
            run[0].dtype,
            rows,
            cols,
            1,
            &parts,
        )?);
    }
    Ok(Matrix::Q4(Q4Matrix::stack(label, runs)?))
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

fn q4(ctx: &Context, label: &str, w: &Weight<'_>, row_multiple: usize) -> Result<Q4Matrix> {
    let (rows, cols) = rows_cols(w);
    Ok(Q4Matrix::upload_dtype(
        ctx,
        label,
        w.dtype,
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

/// Whether the GPU backend can hold `src`: the embedding and every expert tensor of a type
/// the kernels read packed (Q4_0, MLX_A4, Q8_0, MLX_A8, Q6_K, Q4_K or Q5_K; types may differ between
/// tensors, as in llama.cpp's `Q4_K_M` files), and each layer's gate and up of one type. The
/// error names the first tensor that is not and counts the others; the CPU backend runs such
/// a model. Checked before any upload.
pub fn check_supported(src: &dyn WeightSource) -> Result<()> {
    let cfg = src.config();
    let dtype_of =
        |k: TensorKey| -> Result<DType> { src.dtype(k).with_context(|| format!("loading {k:?}")) };
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
    let mut bad = Vec::new();
    for k in keys {
        let dtype = dtype_of(k)?;
        if QForm::of(dtype).is_none() {
            bad.push((k, dtype));
        }
    }
    if let Some((k, dtype)) = bad.first() {
        bail!(
            "the GPU backend reads the token embedding and the expert tensors packed, in \
             Q4_0, MLX_A4, Q8_0, MLX_A8, Q6_K, Q4_K or Q5_K, and {} of them are not ({} is {}); the \
             CPU backend (--backend cpu) runs this model",
            bad.len(),
            nibble_model::qwen3_moe::gguf_name(*k),
            dtype.name()
        );
    }
    for l in 0..cfg.num_layers {
        let gate = dtype_of(TensorKey::Layer(l, LayerTensor::ExpGate))?;
        let up = dtype_of(TensorKey::Layer(l, LayerTensor::ExpUp))?;
        if gate != up {
            bail!(
                "layer {l}'s expert gate is {} and its up is {}: the GPU's gate/up kernel reads \
                 both in one block type; the CPU backend (--backend cpu) runs this model",
                gate.name(),
                up.name()
            );
        }
    }
    Ok(())
}

/// `f` of `key`'s tensor, lent by the source for this one use ([`WeightSource::with_weight`]:
/// an MLX checkpoint's blocks are built for the upload and freed after it). An error names
/// the tensor.
fn lend<T>(
    src: &dyn WeightSource,
    key: TensorKey,
    f: impl FnOnce(&Weight<'_>) -> Result<T>,
) -> Result<T> {
    lend_unnamed(src, key, f).with_context(|| format!("loading {key:?}"))
}

/// [`lend`] without naming the tensor in an error: for lends nested in one another (the qkv),
/// which name all their tensors once, around the outermost.
fn lend_unnamed<T>(
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
    })?;
    out.with_context(|| format!("the weight source lent no tensor for {key:?}"))
}

impl GpuWeights {
    /// Upload every tensor of `src` (shapes were checked by the source against its config),
    /// every dense matrix of a packed type packed ([`DenseForms::Any`]).
    pub fn upload(ctx: &Context, src: &dyn WeightSource) -> Result<GpuWeights> {
        Self::upload_with(ctx, src, DenseForms::Any)
    }

    /// [`Self::upload`] with the dense matrices `dense` allows packed, the others widened.
    pub fn upload_with(
        ctx: &Context,
        src: &dyn WeightSource,
        dense: DenseForms,
    ) -> Result<GpuWeights> {
        let cfg = src.config().clone();
        cfg.validate()?;
        check_supported(src)?;
        // Every tensor is lent for its upload only (`lend`).
        let embed = lend(src, TensorKey::TokenEmbd, |w| q4(ctx, "token_embd", w, 1))?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let key = |t: LayerTensor| TensorKey::Layer(l, t);
            let name = |s: &str| format!("blk.{l}.{s}");
            let vec = |t: LayerTensor, s: &str| lend(src, key(t), |w| vector(ctx, &name(s), w));
            let mat = |t: LayerTensor, s: &str| {
                lend(src, key(t), |w| {
                    matrix(ctx, &name(s), std::slice::from_ref(w), dense)
                })
            };
            let experts = |t: LayerTensor, s: &str, row_multiple: usize| {
                lend(src, key(t), |w| q4(ctx, &name(s), w, row_multiple))
            };
            use LayerTensor as T;
            // q, k and v stack into one matrix, so all three are lent at once.
            let (q, k, v) = (key(T::AttnQ), key(T::AttnK), key(T::AttnV));
            let qkv = lend_unnamed(src, q, |qw| {
                lend_unnamed(src, k, |kw| {
                    lend_unnamed(src, v, |vw| {
                        matrix(
                            ctx,
                            &name("attn_qkv"),
                            &[qw.clone(), kw.clone(), vw.clone()],
                            dense,
                        )
                    })
                })
            })
            .with_context(|| format!("loading {q:?}, {k:?} and {v:?}"))?;
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
                matrix(ctx, "output", std::slice::from_ref(w), dense)
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
            embed,
            layers,
            out_norm,
            lm_head,
            resident_bytes: resident,
        })
    }

    /// Every block form the model's packed matrices have, each once, in [`QForm::ALL`] order.
    pub fn forms(&self) -> Vec<QForm> {
        let mut has = [false; QForm::ALL.len()];
        let mut mark = |m: &Q4Matrix| {
            for p in &m.parts {
                has[p.form.index()] = true;
            }
        };
        mark(&self.embed);
        for lw in &self.layers {
            for m in [&lw.qkv, &lw.o, &lw.router] {
                if let Matrix::Q4(m) = m {
                    mark(m);
                }
            }
            for m in [&lw.gate, &lw.up, &lw.down] {
                mark(m);
            }
        }
        if let Some(Matrix::Q4(m)) = &self.lm_head {
            mark(m);
        }
        QForm::ALL.into_iter().filter(|f| has[f.index()]).collect()
    }

    /// The forms' names joined by `+` (e.g. `Q4_K+Q6_K`), for summaries.
    pub fn form_names(&self) -> String {
        let names: Vec<&str> = self.forms().iter().map(|f| f.name()).collect();
        names.join("+")
    }

    /// Each layer's expert forms, `(gate and up, down)` (the MoE kernels to compile: a
    /// [`crate::kernels::moe::MoeSet`] per distinct pair). `check_supported` made them whole.
    pub fn moe_forms(&self) -> Vec<(QForm, QForm)> {
        self.layers
            .iter()
            .map(|lw| {
                let f = |m: &Q4Matrix| m.form().unwrap_or(QForm::Q4_0);
                (f(&lw.gate), f(&lw.down))
            })
            .collect()
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

#[cfg(test)]
#[path = "weights_tests.rs"]
mod tests;
