//! GPU-resident tensor layouts shared by all kernels: the repacked block matrix (Q4_0, MLX's
//! affine groups or Q8_0; split by rows across bindings when it is large) and int8-quantised
//! activations.
//!
//! Q4_0 matrix `[rows, cols]` (`cols % 32 == 0`, block `b` of row `r` is block `r * cols/32 + b`):
//! - `qs`: `array<vec4<u32>>`, one vec4 per block = the 16 Q4_0 nibble bytes in file order,
//!   little-endian. Byte `j` low nibble = element `j`, high nibble = element `j + 16`. So
//!   `word & 0x0F0F0F0F` is elements `4w..4w+3` and `(word >> 4) & 0x0F0F0F0F` is elements
//!   `4w+16..4w+19`, each as an unsigned byte: exactly the i8x4 lanes `dot4I8Packed` wants.
//! - `scales`: `array<u32>`, two f16 block scales per word (`unpack2x16float`), block `2k` in the
//!   low half; an odd count is padded with a zero half.
//! - Expert tensors `[E, out, in]` are the same with `rows = E * out`.
//!
//! The affine form ([`QForm::Affine4`], from MLX's `MLX_A4` groups of 64: weight = `s·q + b`,
//! `q` unsigned) keeps the same two buffers and sizes, so every binding and index is the same:
//! - `qs`: each group of 64 becomes two blocks of 32 with their nibbles moved into the Q4_0
//!   order above (block `2g` = the group's elements 0-31, `2g + 1` = 32-63);
//! - `scales`: word `g` (the word of blocks `2g`, `2g + 1`) = the group's bf16 scale bits in the
//!   low half and its bf16 bias bits in the high half: `bitcast<f32>(v << 16)` and
//!   `bitcast<f32>(v & 0xFFFF0000)` are exact.
//!
//! The byte form ([`QForm::Q8_0`], from ggml's Q8_0 blocks: weight = `q·d`, `q` a signed byte)
//! keeps the scales as Q4_0's and doubles the payload:
//! - `qs`: two vec4 per block (32 bytes), byte `j` = element `j` stored as `q + 128` (offset
//!   binary, so the mantissa trick that makes nibbles floats without a conversion works for
//!   bytes too: [`Q8_PAYLOAD`]); kernels declare the binding `array<QB>` and index it by block.
//!
//! The 8-bit affine form ([`QForm::Affine8`], MLX's `MLX_A8` groups of 64: weight = `s·q + b`,
//! `q` unsigned) is the byte form's payload (each group two blocks, the levels stored as they
//! are) with the affine form's scale words (one `scale | bias << 16` per group).
//!
//! The 6-bit form ([`QForm::Q6K`], from ggml's Q6_K super-blocks of 256: weight
//! `d · sc · (q - 32)` with an i8 scale `sc` per 16 weights and an f16 `d` per super-block)
//! splits each super-block into its eight blocks of 32:
//! - `qs`: seven words per block (28 bytes, [`Q6_PAYLOAD`]): the levels' low four bits as
//!   Q4_0's nibble words, their top two bits (elements 0-15 in word 4, 16-31 in word 5,
//!   element `4k + t` of the 16 at bits `8t + 2k`, so that nibble word `k`'s are byte-aligned
//!   already), and the two sub-blocks' `sc` in bytes 0 and 1 of word 6. The
//!   sub-scales ride in the payload so that a block keeps one coefficient, `d`, and every
//!   kernel's `c0 · dot` stays as it is: the form's `qb_dot` scales each half's sum by its
//!   `sc`. 7.5 bits per weight with the scales, against the file's 6.56.
//! - `scales`: Q4_0's f16 words, each block holding its super-block's `d`.
//!
//! The K form ([`QForm::Q4K`], from ggml's Q4_K super-blocks of 256: weight `d · sc · q - dmin
//! · m` with a 6-bit scale `sc` and min `m` per 32 weights under the super-block's f16 `d` and
//! `dmin`) keeps Q4_0's nibble payload (each super-block's eight blocks of 32 in Q4_0's order)
//! and widens the scale word of a pair of blocks to two u32 (`SW = vec2<u32>`): `x` = `d` |
//! `dmin` << 16 (f16 bits), `y` = `sc | m << 6` of the pair's first block, and of its second
//! `<< 12`. A pair never straddles two super-blocks, so the pair's `d` and `dmin` are one. The
//! products `d sc` and `dmin m` are exact in f32, so the form is affine with `(s, b) = (d sc,
//! -dmin m)` and every affine kernel path reads it; 5 bits per weight against the file's 4.5.
//!
//! The 5-bit K form ([`QForm::Q5K`], from ggml's Q5_K: Q4_K's super-block with a fifth bit per
//! weight) keeps each block's low four bits as Q4_0's nibble words and adds a fifth word of
//! the elements' fifth bits, element `16 half + 4k + t` at bit `8t + 4 half + k` so that nibble
//! word `k`'s are a byte apart (20 bytes per block, `QB` five u32: [`Q5_PAYLOAD`], whose
//! `qb_bytes` makes the byte form's two vec4s of it for the byte kernels' products), with the
//! K form's scale words: affine with `(s, b) = (d sc, -dmin m)` and `Q_OFF` 16, 6 bits per weight
//! against the file's 5.5.
//!
//! A kernel computes a block's dot as `c0 · Σ (q - off) x + c1 · Σ x` with `(c0, c1)` from
//! [`Q4_COEF`]: `(d, 0)` for Q4_0, Q8_0 and Q6_K, `(s, b + off s)` for the affine forms (the `Σ x`
//! term is skipped where `Q4_AFFINE` is false); `off` is 8 for nibbles, 128 for bytes, 32 for Q6_K,
//! 16 for Q5_K (`Q_OFF`). Every
//! pipeline that reads block matrices is compiled for one [`QForm`] ([`QForm::wgsl`]). The form
//! belongs to each part ([`Q4Part::form`]): the dense kernels (matvec, matmul, GEMM) pick a
//! pipeline per part, so a stacked matrix may mix forms; the MoE, embedding and folded-router
//! kernels read matrices of one form and refuse a mixed one by name.
//!
//! Activations feeding an int4 matvec, `x[n]` (`n % 32 == 0`), quantised per block of 32:
//! - `q`: `array<u32>` `[n/4]`, word `i` = `i8` values of elements `4i..4i+3` (byte k = element 4i+k);
//! - `s`: `array<vec2<f32>>` `[n/32]` = `(d, d * Σ q)` with `d = amax / 127`, `q = round(x / d)`;
//!   the second term lets the matvec subtract the Q4_0 offset of 8 with one multiply per block.

use crate::context::{Context, GpuError, Result};
pub use crate::qform::{
    QForm, Q4_COEF, Q4_PAYLOAD, Q4_SB, Q4_SB_K, Q5_PAYLOAD, Q6_PAYLOAD, Q8_PAYLOAD,
};
pub use crate::repack::{
    repack_mlx_a4, repack_mlx_a8, repack_q4_0, repack_q4_k, repack_q5_k, repack_q6_k, repack_q8_0,
};
use nibble_quant::DType;

/// Elements per quantisation block (Q4_0 and int8 activations).
pub const BLOCK: usize = 32;

/// One row range of a [`Q4Matrix`], small enough for one storage binding.
#[derive(Debug)]
pub struct Q4Part {
    /// First matrix row held by this part.
    pub row_start: u32,
    /// Rows held by this part.
    pub rows: u32,
    /// `[rows * cols/32]` `vec4<u32>` nibble blocks.
    pub qs: wgpu::Buffer,
    /// `[rows * cols/32]` f16 scales, two per u32 (the part's form's scale words).
    pub scales: wgpu::Buffer,
    /// How the kernels read this part's blocks and scale words (module docs). One per part,
    /// not per matrix: a stacked matrix ([`Q4Matrix::stack`]) may hold tensors of several
    /// forms, as a `Q4_K_M` file's qkv does (q and k Q4_K, v Q6_K).
    pub form: QForm,
}

/// A repacked block matrix `[rows, cols]` on the GPU: Q4_0, or one of the other [`QForm`]s
/// (see module docs for the layouts).
#[derive(Debug)]
pub struct Q4Matrix {
    pub rows: u32,
    pub cols: u32,
    /// Row ranges in order, each with its own form ([`Q4Part::form`]).
    pub parts: Vec<Q4Part>,
}

impl Q4Matrix {
    /// The form of every part, or `None` when the parts differ (a stacked matrix of several
    /// forms) or there are none.
    pub fn form(&self) -> Option<QForm> {
        let f = self.parts.first()?.form;
        self.parts.iter().all(|p| p.form == f).then_some(f)
    }

    /// The matrix's one form, for kernels compiled for one form (the MoE, the embedding, the
    /// folded router); an error naming `what` when its parts differ.
    pub fn one_form(&self, what: &str) -> Result<QForm> {
        self.form().ok_or_else(|| {
            GpuError::Shape(format!(
                "{what}: the matrix's parts are of several block forms ({}); this kernel reads \
                 one",
                self.form_names()
            ))
        })
    }

    /// The parts' forms in row order, each once, joined by `+` (e.g. `Q4_K+Q6_K`).
    pub fn form_names(&self) -> String {
        let mut names: Vec<&str> = Vec::new();
        for p in &self.parts {
            if names.last() != Some(&p.form.name()) {
                names.push(p.form.name());
            }
        }
        names.join("+")
    }

    /// Stack matrices of equal width by rows into one (`mats[0]`'s rows first), keeping each
    /// one's parts and forms: how a qkv whose tensors differ in type stays packed (each part
    /// is a dispatch of its own, so a stack costs one dispatch per form).
    pub fn stack(label: &str, mats: Vec<Q4Matrix>) -> Result<Q4Matrix> {
        let cols = mats.first().map_or(0, |m| m.cols);
        if mats.is_empty() || mats.iter().any(|m| m.cols != cols) {
            return Err(GpuError::Shape(format!(
                "{label}: stacked matrices must be one or more of equal width"
            )));
        }
        let mut rows = 0u32;
        let mut parts = Vec::new();
        for m in mats {
            for mut p in m.parts {
                p.row_start += rows;
                parts.push(p);
            }
            rows = rows
                .checked_add(m.rows)
                .ok_or_else(|| GpuError::Shape(format!("{label}: too many rows")))?;
        }
        Ok(Q4Matrix { rows, cols, parts })
    }

    /// Repack and upload a Q4_0 matrix whose blocks are `src` concatenated (ggml order).
    /// Parts hold a multiple of `row_multiple` rows (e.g. one expert's `out` rows, so that an
    /// expert never straddles two bindings) and each fits [`Context::max_binding_bytes`].
    pub fn upload(
        ctx: &Context,
        label: &str,
        rows: usize,
        cols: usize,
        row_multiple: usize,
        src: &[&[u8]],
    ) -> Result<Q4Matrix> {
        Self::upload_dtype(ctx, label, DType::Q4_0, rows, cols, row_multiple, src)
    }

    /// Upload a matrix of blocks in `dtype`, repacked into the form the kernels read (module
    /// docs; `Form::of` lists the types and their units): Q4_0, MLX's affine `MLX_A4` and
    /// `MLX_A8` (`cols % 64 == 0`), Q8_0, and the K-quants Q6_K, Q4_K and Q5_K (`cols % 256 ==
    /// 0`). A non-finite scale (or bias, or `dmin`) is an error naming its unit; any other
    /// dtype is an error. Parts as [`Self::upload`]'s.
    pub fn upload_dtype(
        ctx: &Context,
        label: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
        row_multiple: usize,
        src: &[&[u8]],
    ) -> Result<Q4Matrix> {
        let not_read = || {
            GpuError::Shape(format!(
                "{label}: {} is not a block type the GPU kernels read (Q4_0, MLX_A4, Q8_0, \
                 MLX_A8, Q6_K, Q4_K, Q5_K)",
                dtype.name()
            ))
        };
        let form = Form::of(dtype).ok_or_else(not_read)?;
        let (shape, f) = ((rows, cols, row_multiple), &form);
        // One arm per type: the repacked scale words differ in type (tensor.rs `QForm`).
        match dtype {
            DType::Q4_0 => upload_parts(ctx, label, shape, src, f, |u| {
                repack_q4_0(u.iter().copied())
            }),
            DType::MLX_A4 => upload_parts(ctx, label, shape, src, f, |u| {
                repack_mlx_a4(u.iter().copied())
            }),
            DType::Q8_0 => upload_parts(ctx, label, shape, src, f, |u| {
                repack_q8_0(u.iter().copied())
            }),
            DType::MLX_A8 => upload_parts(ctx, label, shape, src, f, |u| {
                repack_mlx_a8(u.iter().copied())
            }),
            DType::Q6_K => upload_parts(ctx, label, shape, src, f, |u| {
                repack_q6_k(u.iter().copied())
            }),
            DType::Q4_K => upload_parts(ctx, label, shape, src, f, |u| {
                repack_q4_k(u.iter().copied())
            }),
            DType::Q5_K => upload_parts(ctx, label, shape, src, f, |u| {
                repack_q5_k(u.iter().copied())
            }),
            _ => Err(not_read()),
        }
    }

    /// Error unless the parts tile rows `[0, rows)` in order and each part's buffers hold its
    /// blocks and scales: the kernels compiled without runtime bounds checks (matvec's int4 x
    /// f32 forms, the MoE's staged f32 kernels, the prefill's int4 GEMMs) index `qs` and
    /// `scales` up to exactly those
    /// sizes, and the fields are public, so a binding re-checks them instead of trusting
    /// [`Self::upload`].
    pub fn check_layout(&self, what: &str) -> Result<()> {
        if self.cols % BLOCK as u32 != 0 {
            return Err(GpuError::Shape(format!(
                "{what}: Q4 matrix [{}, {}] needs cols % 32 == 0",
                self.rows, self.cols
            )));
        }
        if self.parts.iter().any(|p| p.form.affine()) && self.cols % 64 != 0 {
            return Err(GpuError::Shape(format!(
                "{what}: affine Q4 matrix [{}, {}] needs cols % 64 == 0",
                self.rows, self.cols
            )));
        }
        let bpr = (self.cols / BLOCK as u32) as u64;
        let parts = self.parts.iter().map(|part| {
            let blocks = part.rows as u64 * bpr;
            let holds = part.qs.size() >= blocks * part.form.block_bytes()
                && part.scales.size() >= blocks.div_ceil(2) * part.form.scale_word_bytes();
            (part.row_start, part.rows, holds)
        });
        check_parts(what, "Q4", self.rows, self.cols, parts)
    }

    /// Bytes resident on the GPU.
    pub fn bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| p.qs.size() + p.scales.size())
            .sum()
    }
}

/// Rows per binding-sized part for a `[rows, cols]` matrix taking `bytes_per_block` bytes per
/// 32 elements in its largest buffer; a multiple of `row_multiple`. Validates the shape.
pub fn plan_rows(
    ctx: &Context,
    rows: usize,
    cols: usize,
    row_multiple: usize,
    bytes_per_block: u64,
) -> Result<usize> {
    if rows == 0 || cols == 0 || cols % BLOCK != 0 || row_multiple == 0 || rows % row_multiple != 0
    {
        return Err(GpuError::Shape(format!(
            "[{rows}, {cols}] with row groups of {row_multiple}: need rows, cols > 0, cols % 32 == 0, rows % group == 0"
        )));
    }
    if rows > u32::MAX as usize / 2 || cols > u32::MAX as usize / 2 {
        return Err(GpuError::Shape(format!("[{rows}, {cols}] is too large")));
    }
    let row_bytes = (cols / BLOCK) as u64 * bytes_per_block;
    let fit = (ctx.max_binding_bytes() / row_bytes) as usize / row_multiple * row_multiple;
    if fit == 0 {
        return Err(GpuError::TooLarge {
            label: format!("{row_multiple} rows of {cols} columns"),
            bytes: row_bytes * row_multiple as u64,
            limit: ctx.max_binding_bytes(),
        });
    }
    Ok(fit.min(rows))
}

/// What [`upload_parts`] needs of a file's block type.
struct Form {
    /// The dtype's name in errors.
    name: &'static str,
    /// Bytes and columns of one stored unit (a Q4_0 block, an MLX group).
    unit_bytes: usize,
    unit_cols: usize,
    /// The repacked matrix's form.
    form: QForm,
    /// The error for a non-finite unit, `{}` being its index in the matrix.
    bad: &'static str,
}

impl Form {
    /// The stored unit of each type the kernels read (`None` for the others): Q4_0 and Q8_0
    /// blocks of 32, MLX groups of 64, K-quant super-blocks of 256.
    fn of(dtype: DType) -> Option<Form> {
        let (unit_bytes, unit_cols, bad) = match dtype {
            DType::Q4_0 => (18, BLOCK, "block {} has a non-finite scale"),
            DType::Q8_0 => (34, BLOCK, "block {} has a non-finite scale"),
            DType::MLX_A4 => (36, 64, "group {} has a non-finite scale or bias"),
            DType::MLX_A8 => (68, 64, "group {} has a non-finite scale or bias"),
            DType::Q6_K => (210, 256, "super-block {} has a non-finite scale"),
            DType::Q4_K => (144, 256, "super-block {} has a non-finite scale"),
            DType::Q5_K => (176, 256, "super-block {} has a non-finite scale"),
            _ => return None,
        };
        Some(Form {
            name: dtype.name(),
            unit_bytes,
            unit_cols,
            form: QForm::of(dtype)?,
            bad,
        })
    }
}

/// Split `[rows, cols]` (shape `(rows, cols, row_multiple)`, as for [`Q4Matrix::upload`]) into
/// parts that each fit a binding, repack each part's units (`src` concatenated) with `repack`
/// into (`qs` words, scale words) and upload them. `repack` errors with the index of the part's
/// first non-finite unit.
fn upload_parts<'a, S: bytemuck::Pod>(
    ctx: &Context,
    label: &str,
    (rows, cols, row_multiple): (usize, usize, usize),
    src: &[&'a [u8]],
    form: &Form,
    repack: impl Fn(&[&'a [u8]]) -> std::result::Result<(Vec<u32>, Vec<S>), usize>,
) -> Result<Q4Matrix> {
    let rows_per_part = plan_rows(ctx, rows, cols, row_multiple, form.form.block_bytes())?;
    // A row is whole units (an MLX group of 64, a K-quant super-block of 256).
    if cols % form.unit_cols != 0 {
        return Err(GpuError::Shape(format!(
            "{label}: {} [{rows}, {cols}] needs cols % {} == 0",
            form.name, form.unit_cols
        )));
    }
    let (ub, upr) = (form.unit_bytes, cols / form.unit_cols);
    let total: usize = src.iter().map(|p| p.len()).sum();
    if src.iter().any(|p| p.len() % ub != 0) || total != rows * upr * ub {
        return Err(GpuError::Shape(format!(
            "{label}: {} [{rows}, {cols}] needs {} bytes in whole {ub}-byte {}, got {total}",
            form.name,
            rows * upr * ub,
            match form.form {
                QForm::Q6K | QForm::Q4K | QForm::Q5K => "super-blocks",
                f if f.affine() => "groups",
                _ => "blocks",
            }
        )));
    }
    let mut units = src.iter().flat_map(|p| p.chunks_exact(ub));
    let mut parts = Vec::new();
    let mut row_start = 0usize;
    while row_start < rows {
        let n = rows_per_part.min(rows - row_start);
        let part: Vec<&[u8]> = units.by_ref().take(n * upr).collect();
        let (qs, scales) = repack(&part).map_err(|u| {
            let at = (row_start * upr + u).to_string();
            GpuError::Data(format!("{label}: {}", form.bad.replacen("{}", &at, 1)))
        })?;
        parts.push(Q4Part {
            row_start: row_start as u32,
            rows: n as u32,
            qs: ctx.storage_init(&format!("{label}.qs"), bytemuck::cast_slice(&qs))?,
            scales: ctx.storage_init(&format!("{label}.scales"), bytemuck::cast_slice(&scales))?,
            form: form.form,
        });
        row_start += n;
    }
    Ok(Q4Matrix {
        rows: rows as u32,
        cols: cols as u32,
        parts,
    })
}

/// int8-quantised activations on the GPU (see module docs for the layout; the precise
/// two-part layout is documented in `numerics.rs`).
#[derive(Debug)]
pub struct QuantActs {
    /// Elements (a multiple of 32).
    pub n: u32,
    /// Two int8 parts per block ([`crate::numerics::Numerics::PreciseInt8`]).
    pub precise: bool,
    /// `[n/4]` u32, four i8 per word (`[n/2]` when precise).
    pub q: wgpu::Buffer,
    /// `[n/32]` `vec2<f32>` = (d, d * Σq) (vec4 `(d1, Σhi, d2, Σlo)` when precise).
    pub s: wgpu::Buffer,
}

impl QuantActs {
    /// Zeroed buffers for `n` plain int8 activations.
    pub fn new(ctx: &Context, label: &str, n: usize) -> Result<QuantActs> {
        Self::with_layout(ctx, label, n, false)
    }

    /// Buffers in the form `numerics` reads, or `None` for f32 activations.
    pub fn for_numerics(
        ctx: &Context,
        label: &str,
        n: usize,
        numerics: crate::numerics::Numerics,
    ) -> Result<Option<QuantActs>> {
        use crate::numerics::Numerics;
        match numerics.form() {
            Numerics::F32 | Numerics::Bfp24 => Ok(None),
            Numerics::Int8 => Self::with_layout(ctx, label, n, false).map(Some),
            Numerics::PreciseInt8 => Self::with_layout(ctx, label, n, true).map(Some),
        }
    }

    /// Zeroed buffers for `n` activations, two int8 parts per block when `precise`.
    pub fn with_layout(ctx: &Context, label: &str, n: usize, precise: bool) -> Result<QuantActs> {
        if n == 0 || n % BLOCK != 0 {
            return Err(GpuError::Shape(format!(
                "{label}: {n} activations is not a positive multiple of 32"
            )));
        }
        let parts = if precise { 2 } else { 1 };
        Ok(QuantActs {
            n: n as u32,
            precise,
            q: ctx.storage(&format!("{label}.q"), n as u64 * parts)?,
            s: ctx.storage(&format!("{label}.s"), (n / BLOCK) as u64 * 8 * parts)?,
        })
    }
}

/// Scalar reference of the activation quantisation: (`q[n]`, `[d, d * Σq]` per block).
pub fn quantize_acts_ref(x: &[f32]) -> (Vec<i8>, Vec<[f32; 2]>) {
    let mut q = Vec::with_capacity(x.len());
    let mut s = Vec::with_capacity(x.len() / BLOCK);
    for blk in x.chunks(BLOCK) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for v in blk {
            // Half away from zero, written out so the WGSL kernel can do exactly the same.
            let y = v * id;
            let t = (y.abs() + 0.5).floor().copysign(y).clamp(-127.0, 127.0) as i8;
            sum += t as i32;
            q.push(t);
        }
        s.push([d, d * sum as f32]);
    }
    (q, s)
}

/// Pack i8 activations four to a word (byte k of word i = element 4i + k).
pub fn pack_i8(q: &[i8]) -> Vec<u32> {
    q.chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (k, v)| w | ((*v as u8 as u32) << (8 * k)))
        })
        .collect()
}

/// One row range of an [`F32Matrix`], small enough for one storage binding.
#[derive(Debug)]
pub struct F32Part {
    pub row_start: u32,
    pub rows: u32,
    /// `[rows, cols]` f32.
    pub w: wgpu::Buffer,
}

/// A plain f32 matrix `[rows, cols]` (`cols % 4 == 0`) on the GPU, split by rows across bindings.
/// Non-Q4_0 matrices (the router, F16/BF16 checkpoints) are widened to f32 once at upload:
/// lossless, unlike re-quantising them.
#[derive(Debug)]
pub struct F32Matrix {
    pub rows: u32,
    pub cols: u32,
    pub parts: Vec<F32Part>,
}

/// Error unless `rows, cols > 0` and the `(row_start, rows, buffers hold them)` parts tile rows
/// `[0, rows)` in order with buffers that hold their rows: the check behind
/// [`Q4Matrix::check_layout`] and [`F32Matrix::check_layout`].
fn check_parts(
    what: &str,
    kind: &str,
    rows: u32,
    cols: u32,
    parts: impl Iterator<Item = (u32, u32, bool)>,
) -> Result<()> {
    let bad = |why: String| {
        Err(GpuError::Shape(format!(
            "{what}: {kind} matrix [{rows}, {cols}] {why}"
        )))
    };
    if rows == 0 || cols == 0 {
        return bad("needs rows, cols > 0".into());
    }
    let mut next = 0u32;
    for (n, (row_start, part_rows, holds)) in parts.enumerate() {
        if part_rows == 0 || row_start != next {
            return bad(format!(
                "part {n} starts at row {row_start} with {part_rows} rows (expected row {next}, rows > 0)"
            ));
        }
        if !holds {
            return bad(format!(
                "part {n}: its buffers do not hold its {part_rows} rows"
            ));
        }
        next = match row_start.checked_add(part_rows) {
            Some(v) => v,
            None => return bad(format!("part {n} overflows the row count")),
        };
    }
    if next != rows {
        return bad(format!("parts end at row {next}"));
    }
    Ok(())
}

impl F32Matrix {
    /// Error unless `cols % 4 == 0` and the parts tile the rows with buffers that hold them
    /// (`rows * cols` f32 each): the router over columns (compiled without runtime bounds
    /// checks) reads exactly that much, and the fields are public.
    pub fn check_layout(&self, what: &str) -> Result<()> {
        if self.cols % 4 != 0 {
            return Err(GpuError::Shape(format!(
                "{what}: f32 matrix [{}, {}] needs cols % 4 == 0",
                self.rows, self.cols
            )));
        }
        let parts = self.parts.iter().map(|part| {
            let holds = part.w.size() >= part.rows as u64 * self.cols as u64 * 4;
            (part.row_start, part.rows, holds)
        });
        check_parts(what, "f32", self.rows, self.cols, parts)
    }

    /// Upload `w` (`rows * cols` values, row-major).
    pub fn upload(
        ctx: &Context,
        label: &str,
        rows: usize,
        cols: usize,
        w: &[f32],
    ) -> Result<F32Matrix> {
        if rows == 0 || cols == 0 || cols % 4 != 0 || w.len() != rows * cols {
            return Err(GpuError::Shape(format!(
                "{label}: f32 [{rows}, {cols}] needs cols % 4 == 0 and {} values, got {}",
                rows * cols,
                w.len()
            )));
        }
        let row_bytes = cols as u64 * 4;
        let per = (ctx.max_binding_bytes() / row_bytes) as usize;
        if per == 0 {
            return Err(GpuError::TooLarge {
                label: label.to_string(),
                bytes: row_bytes,
                limit: ctx.max_binding_bytes(),
            });
        }
        let parts = (0..rows)
            .step_by(per)
            .map(|r0| {
                let n = per.min(rows - r0);
                Ok(F32Part {
                    row_start: r0 as u32,
                    rows: n as u32,
                    w: ctx.storage_init(
                        label,
                        bytemuck::cast_slice(&w[r0 * cols..(r0 + n) * cols]),
                    )?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(F32Matrix {
            rows: rows as u32,
            cols: cols as u32,
            parts,
        })
    }

    /// Bytes resident on the GPU.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.w.size()).sum()
    }
}
