//! Tiled int4 x f32 GEMM for the batched prefill: many tokens per dispatch, so each dequantised
//! weight block feeds `BM` tokens out of shared memory instead of one (the matvec) or up to 8
//! (the column matmul, `matmul.rs`). Prefill is bound by arithmetic, not by weight bytes: a
//! 512-token chunk reads every weight of the model about once in ~4 ms on an H200, and does
//! ~2.8 TFLOP of multiply-adds.
//!
//! Forms ([`GemmForm`], one pipeline each; shaders/gemm_q4.wgsl):
//! - `Dense` / `DenseAcc` / `DenseF32`: `Y[m, ycol + n] (+)= W[n, :] · X[m, :]` for tokens
//!   `m < dims.m` and the rows `n` of one matrix part (a split matrix is one dispatch per part).
//!   `DenseAcc` is the residual add after `o_proj`; `DenseF32` reads an f32 matrix (the router).
//! - `GateUp` and `Down`: one MoE layer over a chunk, on the tiles of a [`crate::kernels::moe_prefill`]
//!   plan (a tile = up to `BM` rows of one expert's assignment list). `GateUp` gathers X by token
//!   and stores `silu(gate · x) * (up · x)` per assignment; `Down` reads and writes in list order.
//!
//! Buffers: `X [rows, xs4 * 4]` f32, `Y [rows, ys]` f32 (row-major, token or assignment rows).
//! `dims` is a uniform `[m, 0, 0, 0]` (tokens in the chunk) shared by every dense dispatch of a
//! plan, so one recording serves any chunk length up to the bound buffers' rows.
//!
//! Int4 weights are Q4_0 or, for a kernel built [`GemmKernel::with_form`] affine, MLX's affine
//! groups (tensor.rs), on either kernel. The f32 kernel's WGSL is generated in gemm_wgsl.rs.
//!
//! Numerics: per (token, output) the sum runs over the inputs in order with one f32 fma each,
//! on exactly dequantised weights: the oracle's dot up to f32 rounding (tested against an f64
//! reference to 1e-5 of Σ|w||x|). A K-split binding ([`GemmKernel::bind_split`]) sums each
//! slice so, and its reader adds the slices in split order: the same bound, other roundings.

pub(crate) use super::gemm_wgsl::{prelude, shader};
use crate::context::{Context, GpuError, Result};
use crate::tensor::{F32Matrix, Q4Matrix, QForm, BLOCK};

/// Weight rows (tile columns) of one workgroup; `GateUp` uses 64 gate + the same 64 up rows.
pub const TILE_ROWS: u32 = 128;

/// The f32 kernel in words (for `--verbose`).
pub const DESCRIPTION: &str = "int4 GEMM, f32 fmas";

/// Whether the int4 forms run on matrix units (gemm_coop.rs) on `ctx` when `wanted`.
pub fn on_matrix_units(ctx: &Context, wanted: bool) -> bool {
    wanted && super::gemm_coop::supported(ctx)
}

/// The int4 GEMM kernel in words: on matrix units (and whether its 32-token tiles are
/// double-buffered) or on f32 fmas.
pub fn describe(matrix_units: bool, double_buffer: bool) -> String {
    match (matrix_units, double_buffer) {
        (true, true) => format!(
            "{}, 32-token tiles double-buffered",
            super::gemm_coop::DESCRIPTION
        ),
        (true, false) => super::gemm_coop::DESCRIPTION.to_string(),
        (false, _) => DESCRIPTION.to_string(),
    }
}

/// Whether this device's workgroup memory holds the matrix-unit kernel's double-buffered tiles.
pub fn double_buffer_fits(ctx: &Context) -> bool {
    super::gemm_coop::workgroup_bytes(2, true)
        <= ctx.limits.max_compute_workgroup_storage_size as u64
}
/// Threads per workgroup (16 x 16).
pub(crate) const WG: u32 = 256;

/// What one GEMM pipeline computes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmForm {
    Dense,
    DenseAcc,
    /// `Dense` over an f32 matrix (the router).
    DenseF32,
    GateUp,
    Down,
}

impl GemmForm {
    fn expert(self) -> bool {
        matches!(self, GemmForm::GateUp | GemmForm::Down)
    }

    /// Output columns one workgroup covers.
    pub fn cols_per_tile(self) -> u32 {
        match self {
            GemmForm::GateUp => TILE_ROWS / 2,
            _ => TILE_ROWS,
        }
    }
}

/// The MoE plan geometry the expert forms read (kernels/moe_prefill.rs lays the buffer out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLayout {
    /// Experts per token (`K`): assignment `i` belongs to token `i / K`.
    pub k: u32,
    /// Word offsets of the per-expert list offsets `[E + 1]`, the tiles and the list.
    pub off: u32,
    pub tiles: u32,
    pub list: u32,
}

/// One binding part of a GEMM's weights: first row, rows, its block form (the f32 router's
/// is Q4_0, unread), and its `(binding, resource)`s.
type WeightPart<'a> = (u32, u32, QForm, Vec<(u32, wgpu::BindingResource<'a>)>);

/// Compiled pipelines by (GEMM form, tokens per thread, plan layout, block form).
type Pipes = Vec<(
    (GemmForm, u32, Option<PlanLayout>, QForm),
    wgpu::ComputePipeline,
)>;

/// The weights of a GEMM: an int4 matrix (`Dense`, `DenseAcc`, `Down`), the gate and up
/// matrices (`GateUp`, split alike) or an f32 matrix (`DenseF32`: the router).
#[derive(Clone, Copy)]
pub enum GemmWeights<'a> {
    Q4(&'a Q4Matrix),
    GateUp {
        gate: &'a Q4Matrix,
        up: &'a Q4Matrix,
    },
    F32(&'a F32Matrix),
}

impl GemmWeights<'_> {
    /// `(rows, inputs)`.
    fn shape(&self) -> (u32, u32) {
        match self {
            GemmWeights::Q4(m) | GemmWeights::GateUp { gate: m, .. } => (m.rows, m.cols),
            GemmWeights::F32(f) => (f.rows, f.cols),
        }
    }

    /// Whether these are the weights `form` reads.
    fn fit(&self, form: GemmForm) -> bool {
        matches!(
            (self, form),
            (
                GemmWeights::Q4(_),
                GemmForm::Dense | GemmForm::DenseAcc | GemmForm::Down
            ) | (GemmWeights::GateUp { .. }, GemmForm::GateUp)
                | (GemmWeights::F32(_), GemmForm::DenseF32)
        )
    }

    /// Per binding part: first row, rows, and the weight bindings.
    fn parts(&self) -> Result<Vec<WeightPart<'_>>> {
        Ok(match self {
            GemmWeights::Q4(m) => m
                .parts
                .iter()
                .map(|p| {
                    let e = vec![
                        (0, p.qs.as_entire_binding()),
                        (1, p.scales.as_entire_binding()),
                    ];
                    (p.row_start, p.rows, p.form, e)
                })
                .collect(),
            GemmWeights::GateUp { gate, up } => {
                if up.rows != gate.rows
                    || up.cols != gate.cols
                    || up.parts.len() != gate.parts.len()
                    || up
                        .parts
                        .iter()
                        .zip(&gate.parts)
                        .any(|(u, g)| u.rows != g.rows || u.form != g.form)
                {
                    return Err(GpuError::Shape(
                        "gemm gate_up: gate and up must have the same shape, parts and forms"
                            .into(),
                    ));
                }
                gate.parts
                    .iter()
                    .zip(&up.parts)
                    .map(|(g, u)| {
                        let e = vec![
                            (0, g.qs.as_entire_binding()),
                            (1, g.scales.as_entire_binding()),
                            (6, u.qs.as_entire_binding()),
                            (7, u.scales.as_entire_binding()),
                        ];
                        (g.row_start, g.rows, g.form, e)
                    })
                    .collect()
            }
            GemmWeights::F32(f) => f
                .parts
                .iter()
                .map(|p| {
                    let e = vec![(0, p.w.as_entire_binding())];
                    (p.row_start, p.rows, QForm::Q4_0, e)
                })
                .collect(),
        })
    }
}

/// One GEMM to bind.
pub struct GemmArgs<'a> {
    pub form: GemmForm,
    pub w: GemmWeights<'a>,
    /// `X [x_rows, cols]` f32.
    pub x: &'a wgpu::Buffer,
    /// `Y [y_rows, y_stride]` f32.
    pub y: &'a wgpu::Buffer,
    pub y_stride: u32,
    /// Rows X holds: tokens (dense, gate_up) or assignments `T * K` (down).
    pub x_rows: u32,
    /// Rows Y holds: tokens (dense) or assignments (expert forms).
    pub y_rows: u32,
    /// Dense: the `[4]` u32 uniform holding `m` (at most `x_rows` and `y_rows`).
    pub dims: Option<&'a wgpu::Buffer>,
    /// Expert forms: the MoE plan buffer and the experts per weight-matrix row block (`n` rows
    /// each, `E * n` rows in all).
    pub plan: Option<(&'a wgpu::Buffer, PlanLayout)>,
    /// Expert forms: output rows per expert (`I` for gate/up, `H` for down).
    pub rows_per_expert: u32,
    /// Expert forms: grid rows (tiles) to launch: a bound on the plan's tile count.
    pub max_tiles: u32,
}

/// Bind groups (one per weight-matrix part) of one GEMM.
pub struct GemmBinding {
    /// `(pipeline of the part's block form, bind group, grid x)`; grid y is the token tiles
    /// (dense) or `max_tiles` (experts).
    parts: Vec<(wgpu::ComputePipeline, wgpu::BindGroup, u32)>,
    form: GemmForm,
    tm: u32,
    max_tiles: u32,
    /// K splits: grid z ([`GemmKernel::bind_split`]).
    splits: u32,
}

impl GemmBinding {
    pub fn dispatch_count(&self) -> usize {
        self.parts.len()
    }
}

/// GEMM pipelines, compiled on first use per (form, tokens per thread, plan layout, block
/// form): a matrix's parts may differ in block form (tensor.rs), each part's dispatch takes
/// its own form's pipeline.
pub struct GemmKernel {
    /// Whether the int4 forms run on matrix units (gemm_coop.rs) rather than f32 fmas (the
    /// block forms [`QForm::on_matrix_units`] admits; the others take f32 fmas regardless).
    coop: bool,
    /// The matrix-unit kernel's 32-token tiles with two staging buffers (gemm_coop.rs
    /// `LOOP_DOUBLE`; the prefill's default, `--tune prefill_dbuf=0` turns it off).
    dbuf: bool,
    pipes: std::sync::Mutex<Pipes>,
}

impl GemmKernel {
    /// [`GemmKernel::with_coop`] with matrix units wherever the device has them.
    pub fn new(ctx: &Context) -> Result<GemmKernel> {
        Self::with_coop(ctx, true)
    }

    /// Whether the GEMMs read matrices of `form` (the prefill takes the columns otherwise):
    /// every form on f32 fmas; the matrix units read Q4_0 and MLX's affine groups only
    /// ([`QForm::on_matrix_units`]; [`Self::with_form`] keeps the others on f32 fmas).
    pub fn reads(form: QForm) -> bool {
        matches!(
            form,
            QForm::Q4_0
                | QForm::Affine4
                | QForm::Q8_0
                | QForm::Affine8
                | QForm::Q6K
                | QForm::Q4K
                | QForm::Q5K
        )
    }

    /// Check the shared memory fits (24 KiB at 4 tokens per thread for the f32 kernel, 42 KiB
    /// for the matrix-unit one); `coop`: run the int4 forms on matrix units where
    /// [`super::gemm_coop::supported`] (the f32 router GEMM always takes f32 fmas).
    pub fn with_coop(ctx: &Context, coop: bool) -> Result<GemmKernel> {
        Self::with_form(ctx, coop, QForm::Q4_0)
    }

    /// [`GemmKernel::with_coop`] for weights of the given block form: Q4_0 or the affine (MLX)
    /// one (gemm_wgsl.rs and gemm_coop.rs's `WSTORE_COOP_AFFINE`), or another on f32 fmas only
    /// (gemm_wgsl.rs, e.g. `WSTORE_F32_Q8`; `coop` is ignored for it,
    /// [`QForm::on_matrix_units`]); any other is an error ([`Self::reads`]).
    pub fn with_form(ctx: &Context, coop: bool, form: QForm) -> Result<GemmKernel> {
        Self::with_forms(ctx, coop, &[form])
    }

    /// [`Self::with_form`] for a model whose matrices come in several block forms: the parts
    /// of a form that runs on matrix units take them (with `coop`), the others f32 fmas (a
    /// llama.cpp Q4_0 file's Q6_K lm_head does not cost its Q4_0 matrices the units).
    pub fn with_forms(ctx: &Context, coop: bool, forms: &[QForm]) -> Result<GemmKernel> {
        if let Some(f) = forms.iter().find(|f| !Self::reads(**f)) {
            return Err(GpuError::Shape(format!(
                "gemm: no kernel reads {} weights",
                f.name()
            )));
        }
        let coop = on_matrix_units(ctx, coop) && forms.iter().any(|f| f.on_matrix_units());
        let need = if coop {
            super::gemm_coop::workgroup_bytes(4, false)
        } else {
            (32 * 64 * 4 + 32 * 128 * 4) as u64
        };
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        if need > limit {
            return Err(GpuError::TooLarge {
                label: "gemm workgroup memory".into(),
                bytes: need,
                limit,
            });
        }
        Ok(GemmKernel {
            coop,
            dbuf: false,
            pipes: Default::default(),
        })
    }

    /// The matrix-unit kernel's 32-token tiles with two staging buffers (the prefill's default
    /// where they fit, run 133; `--tune prefill_dbuf=0` gives one). An error where the
    /// device's workgroup memory cannot hold them; nothing changes without matrix units.
    pub fn with_double_buffer(mut self, ctx: &Context, on: bool) -> Result<GemmKernel> {
        let need = super::gemm_coop::workgroup_bytes(2, true);
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        if on && self.coop && need > limit {
            return Err(GpuError::TooLarge {
                label: "double-buffered gemm workgroup memory".into(),
                bytes: need,
                limit,
            });
        }
        self.dbuf = on;
        Ok(self)
    }

    /// Whether the matrix-unit form's 32-token tiles are double-buffered.
    pub fn double_buffered(&self) -> bool {
        self.coop && self.dbuf
    }

    /// Whether the int4 forms run on matrix units.
    pub fn coop(&self) -> bool {
        self.coop
    }

    /// Whether a `form` GEMM of `qform` weights runs on matrix units.
    fn units(&self, form: GemmForm, qform: QForm) -> bool {
        self.coop && form != GemmForm::DenseF32 && qform.on_matrix_units()
    }

    /// The WGSL of one pipeline: the matrix-unit kernel for int4 forms where chosen.
    fn source(&self, form: GemmForm, tm: u32, plan: Option<PlanLayout>, qform: QForm) -> String {
        if self.units(form, qform) {
            super::gemm_coop::shader(form, tm, plan, self.dbuf, qform.affine())
        } else {
            shader(form, tm, plan, qform)
        }
    }

    fn pipeline(
        &self,
        ctx: &Context,
        form: GemmForm,
        tm: u32,
        plan: Option<PlanLayout>,
        qform: QForm,
    ) -> Result<wgpu::ComputePipeline> {
        let units = self.units(form, qform);
        let kind = if units { "gemm_coop" } else { "gemm_q4" };
        let db = if units && super::gemm_coop::double_buffered(tm, self.dbuf) {
            ".double"
        } else {
            ""
        };
        let aff = match qform {
            QForm::Q4_0 => String::new(),
            f => format!(".{f:?}"),
        };
        let label = format!("{kind}.{form:?}.tm{tm}{db}{aff}");
        // Every form is compiled without naga's runtime bounds checks (pp512 +71% for the
        // whole prefill with every module unchecked, docs/BENCHMARKS.md run 115). SAFETY (of
        // `compile`): every index of gemm_q4.wgsl / gemm_coop.rs's body and this file's prelude
        // stays in bounds for every binding `bind` makes, because:
        // - rows: X and Y hold x_rows and y_rows rows of xs4 vec4s / ys floats (`need`), and
        //   Params carries both: a dense tile's tokens stop at min(dims.m, x_rows, y_rows);
        //   an expert tile's list [list0, hi) is clamped into [0, y_rows) whatever the plan
        //   says; X rows are clamped below x_rows (`gm_xrow`), list reads below list + y_rows
        //   (`gm_lrow`, the plan holds list + y_rows words), so the staging loads of a tile
        //   without rows (m0 + sr past mend - 1, or mend - 1 wrapping) stay inside too;
        // - K splits (both kernels): kb = min(min(z, splits - 1) ks, bpr - 1) and the blocks
        //   run to kend = min(kb + ks, bpr) (the coop kernel's next-block loads at min(kb + b +
        //   1, bpr - 1), or with two staging buffers at min(kb + 1, kend - 1) and min(kb + b +
        //   2, kend - 1)), so every block index stays below bpr whatever the grid's z; the dense
        //   tiles' Y rows start at min(z, splits - 1) y_rows, and `bind` checks Y holds splits
        //   x y_rows rows (splits = 1 for the expert forms and `+=`);
        // - X columns: b < bpr (the next-block loads use b + 1 < kend <= bpr, or min(kb + b + 1,
        //   bpr - 1), or min(.., kend - 1) with kend - 1 >= kb because ks >= 1 (ks = ceil(bpr /
        //   splits), bpr >= 1)) and
        //   sv + i < 8 (XPT = 8 BM / 256 vec4s per thread at sv = (li / BM) XPT), so below
        //   bpr 8 = xs4; Y columns: ycol + na with na < p.n, ycol + p.n <= the weight rows <=
        //   y_stride (dense: ycol = the part's first row; experts: ycol = 0, p.n = I or H);
        // - weights: blk = (wrow + n) bpr + b with n <= p.n - 1 and b < bpr; wrow = 0 (dense,
        //   p.n = the part's rows) or (e - e_lo) p.n for e_lo <= e < e_hi (a tile whose expert
        //   the part does not hold is not ok and keeps wrow = 0), and `Q4Matrix::check_layout`
        //   makes each part's qs / scales hold its rows x bpr blocks (gate and up alike);
        //   the f32 router (`DenseF32`, dense only) reads wf at blk 8 + 4 h + 3 with h < 2,
        //   below the part's rows bpr 8 vec4s, which `F32Matrix::check_layout` makes its w hold;
        // - the plan: word 0, the tile word at tiles + wid.y for wid.y < plan[0] and wid.y <
        //   max_tiles (the grid), with tiles + max_tiles <= list, and the offsets at off + e,
        //   off + e + 1 <= off + E <= tiles (checked in `bind`);
        // - workgroup arrays: the f32 kernel's xs at ((k..k + 3) BM + sr) / TM with k <= 31,
        //   sr < BM, and ws at (k + c (+ 16)) 32 + nn / 4 <= 31 * 32 + 31 (f32 weights:
        //   (16 h + 12 + i) 32 + nn / 4 with h < 2, i < 4: the same bound); the coop kernel's
        //   xh / xl at u 32 SX + k SX + sr and their matrix loads up to u 32 SX + (kk + 15) SX +
        //   16 ti + 15 with ti < MT = BM / 16, wh / wl at u 32 SW + (k + c + 16) SW + nn and
        //   matrix loads up to u 32 SW + (kk + 15) SW + 127 (SW = 136), for buffer u < NBUF
        //   (u = 0, or b & 1 and its complement with NBUF = 2: `gemm_coop::LOOP_DOUBLE`), all
        //   below NBUF 32 SX / NBUF 32 SW; cs at sg 512 + 511 for its 8 subgroups of 32 (the
        //   only shape `gemm_coop::supported` admits), or with two buffers (CSW = 512) at li
        //   and li + 256 (zeroing) and the one subgroup's tiles at 0 and 256 with e = li < 256;
        // - loops run to kend (f32) / nblocks = kend - kb (coop), both <= bpr, or constants;
        //   every divisor is a constant (K >= 1 is checked).
        let compile = |src: &str| -> Result<wgpu::ComputePipeline> {
            // SAFETY: the audit above.
            unsafe { ctx.compute_unchecked(&label, src, "main") }
        };
        let plan = match (form, plan) {
            (GemmForm::Dense | GemmForm::DenseAcc | GemmForm::DenseF32, _) => None,
            (_, Some(pl)) => Some(pl),
            _ => return Err(GpuError::Shape(format!("gemm {form:?} needs a MoE plan"))),
        };
        let key = (form, tm, plan, qform);
        let mut cache = self.pipes.lock().expect("gemm pipeline cache poisoned");
        if let Some((_, p)) = cache.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone());
        }
        let p = compile(&self.source(form, tm, plan, qform))?;
        cache.push((key, p.clone()));
        Ok(p)
    }

    /// Check the shapes and create one bind group per weight part, `tm` tokens per thread (2:
    /// 32-token tiles, 4: 64-token tiles).
    pub fn bind(&self, ctx: &Context, a: &GemmArgs<'_>, tm: u32) -> Result<GemmBinding> {
        self.bind_split(ctx, a, tm, 1)
    }

    /// [`GemmKernel::bind`] with K cut into `splits` slices of whole blocks, one workgroup
    /// each (the `=` dense forms: the router, whose 128 outputs make one tile column, and a
    /// short chunk's qkv and o-proj, which take few tiles; without a split a few workgroups
    /// each walk all of K while the GPU's other SMs idle). Split `z` writes its partial sums to
    /// Y rows `z * y_rows ..` (their reader adds them: the MoE route, `gemm_reduce.rs`);
    /// `splits` must be [`k_splits`]`(cols / 32, splits)` (no empty slice), and Y hold
    /// `splits * y_rows` rows.
    pub fn bind_split(
        &self,
        ctx: &Context,
        a: &GemmArgs<'_>,
        tm: u32,
        splits: u32,
    ) -> Result<GemmBinding> {
        if tm != 2 && tm != 4 {
            return Err(GpuError::Shape(format!("gemm: {tm} tokens per thread")));
        }
        if !a.w.fit(a.form) {
            return Err(GpuError::Shape(format!(
                "gemm {:?}: the wrong kind of weights",
                a.form
            )));
        }
        let (wrows, wcols) = a.w.shape();
        let cols = wcols as u64;
        if cols == 0 || cols % BLOCK as u64 != 0 {
            return Err(GpuError::Shape(format!(
                "gemm: {cols} inputs is not a positive multiple of 32"
            )));
        }
        if a.x_rows == 0 || a.y_rows == 0 {
            return Err(GpuError::Shape("gemm: zero rows".into()));
        }
        need(a.x, a.x_rows as u64 * cols, "X")?;
        let expert = a.form.expert();
        let (out_cols, plan) = if expert {
            let (buf, pl) = a
                .plan
                .ok_or_else(|| GpuError::Shape(format!("gemm {:?} needs a plan", a.form)))?;
            let n = a.rows_per_expert;
            if n == 0 || wrows % n != 0 {
                return Err(GpuError::Shape(format!(
                    "gemm: {wrows} weight rows are not whole experts of {n}"
                )));
            }
            // In u64: the layout's fields are public, and a wrapped u32 sum would pass a check
            // the unchecked kernel relies on.
            let (off, tiles, list) = (pl.off as u64, pl.tiles as u64, pl.list as u64);
            need(buf, list + a.y_rows as u64, "plan")?;
            // The list offsets [E + 1] lie before the tiles (the kernels read them at off + e
            // and off + e + 1 for the part's experts e < E).
            if off + (wrows / n) as u64 + 1 > tiles || tiles > list || pl.k == 0 {
                return Err(GpuError::Shape(format!(
                    "gemm: plan layout {pl:?} does not hold {} experts' offsets",
                    wrows / n
                )));
            }
            if a.max_tiles == 0 || tiles + a.max_tiles as u64 > list {
                return Err(GpuError::Shape(format!(
                    "gemm: {} tiles do not fit the plan layout",
                    a.max_tiles
                )));
            }
            (n as u64, Some((buf, pl)))
        } else {
            (wrows as u64, None)
        };
        if (a.y_stride as u64) < out_cols {
            return Err(GpuError::Shape(format!(
                "gemm: Y stride {} is less than the {out_cols} outputs",
                a.y_stride
            )));
        }
        let bpr = wcols / BLOCK as u32;
        let splittable = matches!(a.form, GemmForm::Dense | GemmForm::DenseF32);
        if splits == 0 || (splits > 1 && !splittable) || k_splits(bpr, splits) != splits {
            return Err(GpuError::Shape(format!(
                "gemm {:?}: {splits} K splits of {bpr} blocks (only the `=` dense forms split, \
                 into non-empty slices)",
                a.form
            )));
        }
        let ks = bpr.div_ceil(splits);
        let y_need = splits as u64 * a.y_rows as u64 * a.y_stride as u64;
        if y_need > u32::MAX as u64 {
            return Err(GpuError::Shape("gemm: Y too large for u32 indices".into()));
        }
        need(a.y, y_need, "Y")?;
        let readable = |m: &Q4Matrix| match m.parts.iter().find(|p| !Self::reads(p.form)) {
            Some(p) => Err(GpuError::Shape(format!(
                "gemm: no kernel reads {} weights",
                p.form.name()
            ))),
            None => Ok(()),
        };
        match a.w {
            GemmWeights::Q4(m) => {
                readable(m)?;
                m.check_layout("gemm")?
            }
            GemmWeights::GateUp { gate, up } => {
                readable(gate)?;
                gate.check_layout("gemm gate")?;
                up.check_layout("gemm up")?;
            }
            GemmWeights::F32(f) => f.check_layout("gemm router")?,
        }
        let wparts = a.w.parts()?;
        let mut parts = Vec::with_capacity(wparts.len());
        for (row_start, rows, qform, wentries) in wparts {
            let pipeline = self.pipeline(ctx, a.form, tm, plan.map(|p| p.1), qform)?;
            let (n, ycol, e_lo, e_hi) = if expert {
                let per = a.rows_per_expert;
                if row_start % per != 0 || rows % per != 0 {
                    return Err(GpuError::Shape(
                        "gemm: a matrix part splits an expert".into(),
                    ));
                }
                let lo = row_start / per;
                (per, 0, lo, lo + rows / per)
            } else {
                (rows, row_start, 0, 0)
            };
            let words = [
                n,
                bpr,
                wcols / 4,
                a.y_stride,
                ycol,
                e_lo,
                e_hi,
                a.x_rows,
                a.y_rows,
                ks,
                splits,
                0,
            ];
            let params = ctx.uniform("gemm.params", bytemuck::cast_slice(&words))?;
            let mut entries = wentries;
            entries.extend([
                (2, a.x.as_entire_binding()),
                (3, a.y.as_entire_binding()),
                (4, params.as_entire_binding()),
            ]);
            match (plan, a.dims) {
                (Some((buf, _)), _) => entries.push((8, buf.as_entire_binding())),
                (None, Some(d)) => entries.push((5, d.as_entire_binding())),
                (None, None) => {
                    return Err(GpuError::Shape("gemm: a dense form needs dims".into()))
                }
            }
            let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
            let bg = ctx.bind_group_at("gemm_q4", &pipeline, &ids, &res)?;
            parts.push((pipeline, bg, n.div_ceil(a.form.cols_per_tile())));
        }
        Ok(GemmBinding {
            parts,
            form: a.form,
            tm,
            max_tiles: a.max_tiles,
            splits,
        })
    }

    /// Record the dispatches for `tokens` tokens (dense forms; the expert forms launch the
    /// binding's `max_tiles` and read the real count from the plan).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &GemmBinding, tokens: u32) {
        let gy = if b.form.expert() {
            b.max_tiles
        } else {
            tokens.div_ceil(16 * b.tm)
        };
        if gy == 0 {
            return;
        }
        for (pipeline, bg, gx) in &b.parts {
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, gy, b.splits);
        }
    }
}

/// The K splits [`GemmKernel::bind_split`] takes for `bpr` blocks when `want` are asked for:
/// slices of `ceil(bpr / want)` blocks, as many as it takes to cover K (none empty), at least 1.
pub fn k_splits(bpr: u32, want: u32) -> u32 {
    let ks = bpr.div_ceil(want.clamp(1, bpr.max(1)));
    bpr.div_ceil(ks.max(1)).max(1)
}

fn need(buf: &wgpu::Buffer, elems: u64, what: &str) -> Result<()> {
    if buf.size() < elems * 4 {
        return Err(GpuError::Shape(format!(
            "gemm: {what} holds {} bytes, need {elems} words",
            buf.size()
        )));
    }
    Ok(())
}

#[cfg(test)]
#[path = "gemm_tests.rs"]
pub(crate) mod tests;
