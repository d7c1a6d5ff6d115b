//! Matrix-vector products: int4 (repacked Q4_0) weights with activations in any
//! [`Numerics`] form (int8 via `dot4I8Packed` is the fastest: ~2.4x the f32-activation variant on
//! an H200; precise int8 is two int8 parts; f32) and a plain f32 matvec (router). The activation
//! quantiser the int8 forms read from is in quantize.rs (re-exported here).
//!
//! Every matvec uses 256-thread workgroups and a shared-memory reduction, so no subgroup
//! size is assumed: the int4 forms put 256 / T teams of T lanes in a workgroup (T = 32, or 8 or 2
//! for short rows: [`lanes_per_row`]), a row per team for int4 x int8 and 1, 2 or 4 rows per
//! team for int4 x f32 (matvec_q4f.wgsl,
//! conversion-free dequantisation, [`f32_rows_per_team`]); for f32, one row x 256 lanes when rows have at
//! least `F32_WIDE_COLS` (2048) columns (the router has only 128 rows, and 8 rows per workgroup left a
//! big GPU with 16 workgroups), else 8 rows x 32 lanes. A matrix split across bindings is one dispatch
//! per part, each writing its rows at `row_start` of the one output vector. All kernels return
//! immediately when the run state says `done`.
//!
//! The int4 x f32 form has fused variants ([`Fused`]): RMSNorm on load (the qkv), the residual
//! add (the o-proj of the fused plan), and the o-proj with the folded router's logits computed in
//! extra workgroups of the same dispatch (`Fused::Router`, kernels/router_fold.rs). The WGSL
//! those forms are assembled from is in matvec_wgsl.rs.

use super::matvec_wgsl::f32_input;
use super::warm;
use crate::context::{Context, GpuError, Result};
use crate::numerics::Numerics;
use crate::state::with_state;
use crate::tensor::{F32Matrix, Q4Matrix, QForm, BLOCK};
use std::sync::{Arc, Mutex, OnceLock};

/// The norm-on-load WGSL, which the multi-stream router (router_cols.rs) adapts.
pub(crate) use super::matvec_wgsl::NORM_ON_LOAD;
/// The activation quantiser lives in quantize.rs; re-exported where its users look for it.
pub use super::quantize::{QuantizeBinding, QuantizeKernel};
pub use crate::numerics::Act;

/// Bindings of the warm workgroups in [`Fused::NormWarm`] (matvec_wgsl.rs `WARM_ROWS`).
pub(crate) const WARM_BINDINGS: (u32, u32, u32) = (7, 8, 9);
/// Rows per team of the int4 x quantised-activation matvec (`R2` in matvec_q4.wgsl).
pub const Q4_ROWS_PER_TEAM: [u32; 2] = [1, 2];
/// Rows per team of the int4 x f32 matvec (`R` in matvec_q4f.wgsl; 256 / lanes teams per
/// workgroup).
pub const F32_ROWS_PER_TEAM: [u32; 3] = [1, 2, 4];
/// Lanes per row of the int4 matvecs (`T` in matvec_q4f.wgsl and matvec_q4.wgsl),
/// [`lanes_per_row`].
pub const LANES: [u32; 5] = [32, 16, 8, 4, 2];

/// Lanes per row of the int4 matvecs for rows of `bpr` blocks: 32 (8 teams per workgroup) from
/// 32 blocks on, which every matrix of the real models has (2048 columns and more: the kernels
/// measured on the H200); for shorter rows the power of two from 2 that holds a block per lane
/// (256 / T teams). Lane l takes blocks l, l + T, .., so at 32 lanes a row of 8 blocks (the
/// small synthetic model's 256 columns) idles 24 lanes of 32, and lavapipe, a CPU, pays for
/// idle lanes: on the 2-core dev machine the small `Q4_K_M` model decoded 3.3x faster at 8
/// lanes (with the MoE's, `F32Tuning::for_shapes`), the tiny Q4_0 model (64 columns: 2 blocks)
/// about 7x faster at 2, its lm_head from 233 to 17 ms a step. With a block per lane the sums
/// add the same partials in the same order as at 32 lanes (the idle lanes' zeros last): the
/// same bits (the qkv + attention form, built at 32 lanes, checks them).
pub fn lanes_per_row(bpr: u32) -> u32 {
    bpr.clamp(2, 32).next_power_of_two()
}

/// Rows per team for an int4 x f32 matrix of `rows` rows: more rows per team share each
/// staged activation block; measured on an H200 (kernel_bench, 2026-11-29): qkv `[5120x2048]`
/// 11.4 / 9.6 / 8.9 us at 1 / 2 / 4 rows, o-proj `[2048x4096]` 7.5 / 7.5 / 9.3 us, lm_head
/// `[151936x2048]` 255 / 161 / 116 us. In the whole decode step (docs/BENCHMARKS.md runs 42-44,
/// tg128 side by side with the base of the same call) qkv at 1 / 2 / 8 rows lost 8.6% / 3.5% /
/// 2.3% against 4, and the o-proj at 2 rows gained 4.1% over 1 and 3.5% over 4: the step, not
/// the kernel alone, decides. Small matrices keep 1 row so enough workgroups are in flight.
pub fn f32_rows_per_team(rows: u32) -> u32 {
    if rows >= 4096 {
        4
    } else if rows >= 2048 {
        2
    } else {
        1
    }
}

/// Columns from which the f32 matvec gives each row a whole 256-lane workgroup (two vec4 per
/// lane at least); narrower rows use 8 rows x 32 lanes, which keeps small matrices from idling
/// most lanes (lavapipe, a CPU, pays for every one).
pub(crate) const F32_WIDE_COLS: u32 = 2048;

/// Bind groups (one per matrix part) of one matvec, ready to record.
pub struct MatvecBinding {
    /// Per matrix part: its pipeline (the int4 x f32 forms' for the part's block form), bind
    /// group and grid.
    dispatches: Vec<(Which, wgpu::BindGroup, (u32, u32))>,
    /// The pipeline of a [`Which::Pair`] dispatch (compiled for the matrix's two forms).
    pair: Option<Arc<wgpu::ComputePipeline>>,
}

/// What an int4 x f32 matvec does around the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    /// `y = m · x`.
    Plain,
    /// `y = m · rmsnorm(h)`: the RMSNorm before the matvec, recomputed by every workgroup.
    Norm,
    /// `y += m · x`: the residual add after the matvec.
    Acc,
    /// `y = m · x` plus, in E extra workgroups, the folded router's pre-norm logits
    /// `z = fold · [x | h]` (router_fold.rs): h is the residual stream, which nothing in the
    /// dispatch writes.
    Router,
    /// [`Fused::Norm`] plus extra workgroups that read another matrix into L2 for a later
    /// dispatch (kernels/warm.rs; the qkv warming the o-proj).
    NormWarm,
}

impl Fused {
    const ALL: [Fused; 5] = [
        Fused::Plain,
        Fused::Norm,
        Fused::Acc,
        Fused::Router,
        Fused::NormWarm,
    ];
    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Which {
    /// int4 x quantised activations: numerics, two rows per team ([`Q4_ROWS_PER_TEAM`]), and
    /// lanes per row ([`lanes_per_row`]).
    Q4(Numerics, bool, u32),
    /// int4 x f32 activations: index into [`F32_ROWS_PER_TEAM`], fused op, the block form's
    /// slot in [`MatvecKernel`]'s `forms`, and lanes per row ([`lanes_per_row`]).
    Q4F(usize, Fused, usize, u32),
    /// f32 matrix: wide (one row per workgroup) or not, norm-on-load or not.
    F32(bool, bool),
    /// Both parts of a two-form stack in one dispatch: the binding's own pipeline.
    Pair,
}

impl MatvecBinding {
    /// Dispatches [`MatvecKernel::record`] issues (one per matrix part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

/// Params uniform of every matvec shader: `{ rows, inner, row_start, gx, eps, pad x3 }` (the
/// int8 shader reads the first four).
pub(crate) fn params(
    ctx: &Context,
    rows: u32,
    inner: u32,
    row_start: u32,
    rows_per_wg: u32,
    eps: f32,
) -> Result<(wgpu::Buffer, (u32, u32))> {
    let grid = ctx.grid(rows.div_ceil(rows_per_wg));
    let words = [rows, inner, row_start, grid.0, eps.to_bits(), 0, 0, 0];
    let buf = ctx.uniform("matvec.params", bytemuck::cast_slice(&words))?;
    Ok((buf, grid))
}

/// An f32 input of `cols` elements must fit in `x`.
fn check_x(x: &wgpu::Buffer, cols: u32, what: &str) -> Result<()> {
    if x.size() < cols as u64 * 4 {
        return Err(GpuError::Shape(format!(
            "{what}: x holds {} bytes for {cols} columns",
            x.size()
        )));
    }
    Ok(())
}

pub(crate) fn check_out(y: &wgpu::Buffer, rows: u32, what: &str) -> Result<()> {
    if y.size() < rows as u64 * 4 {
        return Err(GpuError::Shape(format!(
            "{what}: output holds {} bytes, need {} rows",
            y.size(),
            rows
        )));
    }
    Ok(())
}

/// Most elements a norm-on-load input may have (its normalised copy lives in shared memory).
pub const NORM_ON_LOAD_MAX: u32 = 4096;

/// The matvec pipelines (compiled once per context).
pub struct MatvecKernel {
    /// The block-per-lane pipelines, `[q4_table_index(..)]` (activation form in
    /// [`Numerics::ALL`] order, rows per team, lanes), each compiled at its first binding (f32
    /// activations take `q4f`, and this form only past [`NORM_ON_LOAD_MAX`] columns).
    q4: Vec<OnceLock<wgpu::ComputePipeline>>,
    /// int4 x f32, `[form slot][q4f_index(..)]` (lanes, fused op, rows per team), each
    /// compiled at the first binding that uses it: a model uses a few of the 30 per lane count.
    q4f: Vec<Vec<OnceLock<wgpu::ComputePipeline>>>,
    /// f32 matrix: `[wide as usize * 2 + norm as usize]` (8 rows x 32 lanes, or one row x 256).
    f32: Vec<wgpu::ComputePipeline>,
    /// `(rows, rows per team)`: the int4 x f32 split for matrices of that many rows instead of
    /// [`f32_rows_per_team`] (comparisons: [`crate::tune::Tune`]).
    rows_override: Vec<(u32, u32)>,
    /// The block forms of the matrices the int4 x f32 forms read, one `q4f` slot each (a
    /// matrix's parts may differ: each part's dispatch takes its own); the
    /// quantised-activation forms (`q4`) read Q4_0 only.
    forms: Vec<QForm>,
    /// The norm-on-load pipelines over a two-form stack in one dispatch
    /// ([`MatvecKernel::bind_q4_norm`]), compiled at a model's first such matrix: key (rows per
    /// team, forms, warm) of its two parts.
    pairs: Mutex<Vec<(PairKey, Arc<wgpu::ComputePipeline>)>>,
    /// Whether the norm-on-load forms scale late (`with_options`; never in bfp24).
    late_norm: bool,
    /// Whether the int4 x f32 forms multiply in bfp24 ([`Numerics::Bfp24`]).
    bfp: bool,
    /// Whether a two-form stack takes one norm-on-load dispatch (true unless turned off by
    /// [`MatvecKernel::with_pair_forms`]).
    pair_forms: bool,
}

/// What a two-form pipeline is compiled for: each part's rows per team and form, whether it
/// warms, and the lanes per row.
type PairKey = ((u32, u32), (QForm, QForm), bool, u32);

/// Index of the block-per-lane pipeline for activations `n`, two rows per team or one, and
/// `t` lanes per row.
fn q4_table_index(n: Numerics, two: bool, t: u32) -> usize {
    let ni = Numerics::ALL.iter().position(|m| *m == n).unwrap_or(0);
    let ti = LANES.iter().position(|l| *l == t).unwrap_or(0);
    (ni * Q4_ROWS_PER_TEAM.len() + two as usize) * LANES.len() + ti
}

/// The f32 norm-on-load inputs of a fused matvec.
#[derive(Clone, Copy)]
pub struct NormInput<'a> {
    /// `[cols]` the residual stream.
    pub h: &'a wgpu::Buffer,
    /// `[cols]` the RMSNorm weight.
    pub weight: &'a wgpu::Buffer,
    pub eps: f32,
}

impl MatvecKernel {
    /// The kernels with f32 activations multiplied in f32 ([`Numerics::F32`]).
    pub fn new(ctx: &Context) -> Result<MatvecKernel> {
        Self::with_numerics(ctx, Numerics::F32)
    }

    /// The kernels whose int4 x f32 forms multiply as `numerics` says: in bfp24 for
    /// [`Numerics::Bfp24`], in f32 otherwise (quantised activations take the `q4` forms).
    pub fn with_numerics(ctx: &Context, numerics: Numerics) -> Result<MatvecKernel> {
        Self::with_options(ctx, numerics, false)
    }

    /// [`Self::with_numerics`] with the f32 norm-on-load form scaling late when `late_norm`
    /// ([`crate::tune::Tune::late_norm`]; bfp24 ignores it).
    pub fn with_options(
        ctx: &Context,
        numerics: Numerics,
        late_norm: bool,
    ) -> Result<MatvecKernel> {
        Self::with_form(ctx, numerics, late_norm, QForm::Q4_0)
    }

    /// [`Self::with_options`] whose int4 x f32 forms read matrices of the given block form
    /// (tensor.rs); bfp24 reads Q4_0 only.
    pub fn with_form(
        ctx: &Context,
        numerics: Numerics,
        late_norm: bool,
        form: QForm,
    ) -> Result<MatvecKernel> {
        Self::with_forms(ctx, numerics, late_norm, &[form])
    }

    /// [`Self::with_form`] for matrices of any of `forms` (a model whose tensors differ in
    /// type): the int4 x f32 pipelines are compiled once per form.
    pub fn with_forms(
        ctx: &Context,
        numerics: Numerics,
        late_norm: bool,
        forms: &[QForm],
    ) -> Result<MatvecKernel> {
        let bfp = numerics == Numerics::Bfp24;
        if let Some(f) = forms.iter().find(|f| bfp && **f != QForm::Q4_0) {
            return Err(GpuError::Shape(format!(
                "matvec: the bfp24 numerics read Q4_0 matrices only, not {}",
                f.name()
            )));
        }
        let mut forms = forms.to_vec();
        forms.dedup();
        let src = |s: &str| with_state(s);
        let q4_count = Numerics::ALL.len() * Q4_ROWS_PER_TEAM.len() * LANES.len();
        let q4 = (0..q4_count).map(|_| OnceLock::new()).collect();
        let mut f32 = Vec::with_capacity(4);
        for rpw in [8u32, 1] {
            for norm in [false, true] {
                let consts = format!("const RPW: u32 = {rpw}u;\nconst T: u32 = {}u;\n", 256 / rpw);
                f32.push(ctx.compute(
                    "matvec_f32",
                    &src(&format!(
                        "{consts}{}{}",
                        f32_input(norm),
                        include_str!("../shaders/matvec_f32.wgsl")
                    )),
                    "main",
                )?);
            }
        }
        let per_form = LANES.len() * Fused::ALL.len() * F32_ROWS_PER_TEAM.len();
        let q4f = forms
            .iter()
            .map(|_| (0..per_form).map(|_| OnceLock::new()).collect())
            .collect();
        Ok(MatvecKernel {
            q4,
            q4f,
            f32,
            rows_override: Vec::new(),
            forms,
            pairs: Mutex::new(Vec::new()),
            late_norm: late_norm && !bfp,
            bfp,
            pair_forms: true,
        })
    }

    /// `which` for a part of block form `form`: the int4 x f32 pipelines of that form; an
    /// error unless this kernel reads it (the quantised-activation ones read Q4_0 only).
    fn for_form(&self, which: Which, form: QForm, what: &str) -> Result<Which> {
        let reads = |names: String| {
            GpuError::Shape(format!(
                "{what}: this pipeline reads {names} matrices, the matrix is {}",
                form.name()
            ))
        };
        match which {
            Which::Q4F(r, f, _, t) => match self.forms.iter().position(|g| *g == form) {
                Some(slot) => Ok(Which::Q4F(r, f, slot, t)),
                None => {
                    let names: Vec<&str> = self.forms.iter().map(|f| f.name()).collect();
                    Err(reads(names.join(" or ")))
                }
            },
            w if form == QForm::Q4_0 => Ok(w),
            _ => Err(reads(QForm::Q4_0.name().into())),
        }
    }

    /// This kernel with a norm-on-load matrix stacked from two forms bound as one dispatch
    /// (`on`, the default) or one per part ([`crate::tune::Tune::qkv_pair`]).
    pub fn with_pair_forms(mut self, on: bool) -> Self {
        self.pair_forms = on;
        self
    }

    /// This kernel with matrices of `rows` rows bound at `rows_per_team` (int4 x f32 forms;
    /// `None` keeps [`f32_rows_per_team`]). A count outside [`F32_ROWS_PER_TEAM`] makes the
    /// binding fail with a clear error.
    pub fn with_rows_per_team(mut self, rows: u32, rows_per_team: Option<u32>) -> Self {
        if let Some(r) = rows_per_team {
            self.rows_override.retain(|(n, _)| *n != rows);
            self.rows_override.push((rows, r));
        }
        self
    }

    /// Rows per team the int4 x f32 forms use for a matrix of `rows` rows.
    pub fn rows_per_team(&self, rows: u32) -> u32 {
        self.rows_override
            .iter()
            .find(|(n, _)| *n == rows)
            .map_or(f32_rows_per_team(rows), |(_, r)| *r)
    }

    /// `y[0..rows] = m · x` for a Q4 matrix `[rows, cols]` and `x` of `cols` elements.
    pub fn bind_q4(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: Act<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        // Quantised activations: one row per team unless asked ([`Self::bind_q4_with`]).
        let rows = match x {
            Act::F32(_) => self.rows_per_team(m.rows),
            _ => 1,
        };
        self.bind_q4_with(ctx, m, x, y, state, rows)
    }

    /// [`Self::bind_q4`] with the rows per team chosen: one of [`F32_ROWS_PER_TEAM`] for the
    /// f32 form; for quantised activations 1, or 2 and more for two rows per team
    /// ([`Q4_ROWS_PER_TEAM`]; the same bits, since each row's dots are the same).
    pub fn bind_q4_with(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: Act<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
        rows_per_team: u32,
    ) -> Result<MatvecBinding> {
        let bad = match x {
            Act::Int8(a) => a.n != m.cols,
            Act::Bfp(a) => a.n != m.cols,
            Act::F32(_) => x.len() < m.cols as u64,
        };
        if bad {
            return Err(GpuError::Shape(format!(
                "matvec_q4: {} activations for {} columns",
                x.len(),
                m.cols
            )));
        }
        let (which, entries) = match x {
            // The staged form holds at most NORM_ON_LOAD_MAX activations in shared memory.
            Act::F32(xb) if m.cols <= NORM_ON_LOAD_MAX => (
                q4f(rows_per_team, Fused::Plain, m.cols)?,
                vec![(2, xb.as_entire_binding())],
            ),
            _ => {
                let t = lanes_per_row(m.cols / BLOCK as u32);
                (
                    Which::Q4(x.numerics(), rows_per_team >= 2, t),
                    x.entries(2, 3),
                )
            }
        };
        self.bind_q4_parts(ctx, m, which, entries, y, state, rows_per_team)
    }

    /// `y[0..rows] += m · x` (f32 `x[cols]`): the matvec with the residual add after it.
    pub fn bind_q4_acc(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        check_x(x, m.cols, "matvec_q4 (+=)")?;
        if m.cols > NORM_ON_LOAD_MAX {
            return Err(GpuError::Shape(format!(
                "matvec_q4 (+=): {} columns (the fused residual add stages at most {NORM_ON_LOAD_MAX})",
                m.cols
            )));
        }
        let rpt = self.rows_per_team(m.rows);
        let which = q4f(rpt, Fused::Acc, m.cols)?;
        let entries = vec![(2, x.as_entire_binding())];
        self.bind_q4_parts(ctx, m, which, entries, y, state, rpt)
    }

    /// `a[0..rows] = m · x` (f32 `x[cols]`) and, in the same dispatch, the folded router's
    /// `z[0..E] = fold · [x | h]` (`fold` `[E, cols + rows]` from router_fold.rs, `h [rows]` the
    /// residual stream, read only).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_q4_router(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: &wgpu::Buffer,
        h: &wgpu::Buffer,
        fold: &wgpu::Buffer,
        experts: u32,
        a: &wgpu::Buffer,
        z: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        m.check_layout("matvec_q4 (router)")?;
        check_x(x, m.cols, "matvec_q4 (router)")?;
        check_x(h, m.rows, "matvec_q4 (router) residual")?;
        check_out(a, m.rows, "matvec_q4 (router)")?;
        check_out(z, experts, "matvec_q4 (router) logits")?;
        let fold_bytes = experts as u64 * (m.cols + m.rows) as u64 * 4;
        if m.cols > NORM_ON_LOAD_MAX || m.parts.len() != 1 || fold.size() < fold_bytes {
            return Err(GpuError::Shape(format!(
                "matvec_q4 (router): [{}, {}] in {} parts with a fold of {} bytes (need one \
                 part, at most {NORM_ON_LOAD_MAX} columns and {fold_bytes} bytes)",
                m.rows,
                m.cols,
                m.parts.len(),
                fold.size()
            )));
        }
        let rpt = self.rows_per_team(m.rows);
        let part = &m.parts[0];
        let which = self.for_form(
            q4f(rpt, Fused::Router, m.cols)?,
            part.form,
            "matvec_q4 (router)",
        )?;
        let n_rows = m.rows.div_ceil(q4f_rows_per_wg(which, rpt));
        let grid = ctx.grid(n_rows + experts);
        let words = [
            m.rows,
            m.cols / BLOCK as u32,
            0,
            grid.0,
            0,
            n_rows,
            experts,
            m.cols / 4,
        ];
        let p = ctx.uniform("matvec.params", bytemuck::cast_slice(&words))?;
        let entries = [
            (0, part.qs.as_entire_binding()),
            (1, part.scales.as_entire_binding()),
            (2, x.as_entire_binding()),
            (4, a.as_entire_binding()),
            (5, p.as_entire_binding()),
            (6, state.as_entire_binding()),
            (7, h.as_entire_binding()),
            (8, fold.as_entire_binding()),
            (9, z.as_entire_binding()),
        ];
        let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
        let bg = ctx.bind_group_at("matvec_q4.router", self.ready(ctx, which)?, &ids, &res)?;
        Ok(MatvecBinding {
            dispatches: vec![(which, bg, grid)],
            pair: None,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn bind_q4_parts(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        which: Which,
        x_entries: Vec<(u32, wgpu::BindingResource<'_>)>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
        rows_per_team: u32,
    ) -> Result<MatvecBinding> {
        m.check_layout("matvec_q4")?;
        check_out(y, m.rows, "matvec_q4")?;
        let rows_per_wg = match which {
            Which::Q4F(..) => q4f_rows_per_wg(which, rows_per_team),
            Which::Q4(_, two, t) => 256 / t * (1 + two as u32),
            _ => 8,
        };
        let bpr = m.cols / BLOCK as u32;
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let which = self.for_form(which, part.form, "matvec_q4")?;
            let (p, grid) = params(ctx, part.rows, bpr, part.row_start, rows_per_wg, 0.0)?;
            let mut entries = vec![
                (0, part.qs.as_entire_binding()),
                (1, part.scales.as_entire_binding()),
                (4, y.as_entire_binding()),
                (5, p.as_entire_binding()),
                (6, state.as_entire_binding()),
            ];
            entries.extend(x_entries.iter().cloned());
            let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
            let bg = ctx.bind_group_at("matvec_q4", self.ready(ctx, which)?, &ids, &res)?;
            dispatches.push((which, bg, grid));
        }
        Ok(MatvecBinding {
            dispatches,
            pair: None,
        })
    }

    /// `y[0..rows] = m · x` for an f32 matrix `[rows, cols]` and f32 `x[cols]`.
    pub fn bind_f32(
        &self,
        ctx: &Context,
        m: &F32Matrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        check_x(x, m.cols, "matvec_f32")?;
        self.bind_f32_parts(
            ctx,
            m,
            vec![(1, x.as_entire_binding())],
            false,
            0.0,
            y,
            state,
        )
    }

    /// `y[0..rows] = m · rmsnorm(h)` for an f32 matrix, the normalised vector also written to
    /// `xn_out [cols]` (by one workgroup) for the kernels after this one.
    pub fn bind_f32_norm(
        &self,
        ctx: &Context,
        m: &F32Matrix,
        x: NormInput<'_>,
        xn_out: &wgpu::Buffer,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        check_norm_input(&x, m.cols, "matvec_f32 (norm)")?;
        if xn_out.size() < m.cols as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "matvec_f32 (norm): normalised output holds {} bytes for {} columns",
                xn_out.size(),
                m.cols
            )));
        }
        let entries = vec![
            (1, x.h.as_entire_binding()),
            (5, x.weight.as_entire_binding()),
            (6, xn_out.as_entire_binding()),
        ];
        self.bind_f32_parts(ctx, m, entries, true, x.eps, y, state)
    }

    #[allow(clippy::too_many_arguments)]
    fn bind_f32_parts(
        &self,
        ctx: &Context,
        m: &F32Matrix,
        x_entries: Vec<(u32, wgpu::BindingResource<'_>)>,
        norm: bool,
        eps: f32,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        check_out(y, m.rows, "matvec_f32")?;
        if norm && m.parts.len() > 1 {
            // Workgroup 0 of the one dispatch publishes the normalised vector.
            return Err(GpuError::Shape(
                "matvec_f32 (norm): a split matrix cannot publish its input".into(),
            ));
        }
        let wide = m.cols >= F32_WIDE_COLS;
        let rpw = if wide { 1 } else { 8 };
        let which = Which::F32(wide, norm);
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let (p, grid) = params(ctx, part.rows, m.cols / 4, part.row_start, rpw, eps)?;
            let mut entries = vec![
                (0, part.w.as_entire_binding()),
                (2, y.as_entire_binding()),
                (3, p.as_entire_binding()),
                (4, state.as_entire_binding()),
            ];
            entries.extend(x_entries.iter().cloned());
            let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
            let bg = ctx.bind_group_at("matvec_f32", self.ready(ctx, which)?, &ids, &res)?;
            dispatches.push((which, bg, grid));
        }
        Ok(MatvecBinding {
            dispatches,
            pair: None,
        })
    }

    /// The pipeline of `w` from the tables ([`Which::Pair`] dispatches carry their own); an
    /// int4 x f32 one only once [`Self::ready`] has compiled it.
    fn pipeline(&self, w: Which) -> Result<&wgpu::ComputePipeline> {
        Ok(match w {
            Which::Q4(n, two, t) => self.q4[q4_table_index(n, two, t)].get().ok_or_else(|| {
                GpuError::Shape("matvec: a pipeline used before its binding".into())
            })?,
            Which::Q4F(ri, f, slot, t) => {
                self.q4f[slot][q4f_index(ri, f, t)].get().ok_or_else(|| {
                    GpuError::Shape("matvec: a pipeline used before its binding".into())
                })?
            }
            Which::F32(wide, norm) => &self.f32[wide as usize * 2 + norm as usize],
            Which::Pair => {
                return Err(GpuError::Shape(
                    "matvec: a two-form dispatch has no table pipeline".into(),
                ))
            }
        })
    }

    /// Record the dispatches (one per matrix part).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &MatvecBinding) {
        let mut last = None;
        for (which, bg, (gx, gy)) in &b.dispatches {
            // Parts of one form share a pipeline: set it once for them.
            if last != Some(*which) {
                let pipe = match (which, &b.pair) {
                    (Which::Pair, Some(p)) => p.as_ref(),
                    (w, _) => match self.pipeline(*w) {
                        Ok(p) => p,
                        // Not reached: every binding holds the pipelines it names.
                        Err(_) => continue,
                    },
                };
                pass.set_pipeline(pipe);
                last = Some(*which);
            }
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, 1);
        }
    }
}

/// The int4 x f32 matvec at `rpt` rows per team doing `f`, for rows of `cols` columns (its
/// lanes per row, [`lanes_per_row`]); form slot 0 until [`MatvecKernel::for_form`].
fn q4f(rpt: u32, f: Fused, cols: u32) -> Result<Which> {
    Ok(Which::Q4F(
        rows_index(rpt)?,
        f,
        0,
        lanes_per_row(cols / BLOCK as u32),
    ))
}

/// Rows per workgroup of an int4 x f32 `which` at `rpt` rows per team: its 256 / lanes teams'.
fn q4f_rows_per_wg(which: Which, rpt: u32) -> u32 {
    match which {
        Which::Q4F(_, _, _, t) => 256 / t * rpt,
        _ => 8 * rpt,
    }
}

/// Index of the int4 x f32 pipeline at rows-per-team index `ri`, op `f` and `t` lanes per
/// row in a form's table.
fn q4f_index(ri: usize, f: Fused, t: u32) -> usize {
    let ti = LANES.iter().position(|l| *l == t).unwrap_or(0);
    (ti * Fused::ALL.len() + f.index()) * F32_ROWS_PER_TEAM.len() + ri
}

pub(crate) fn rows_index(rows_per_team: u32) -> Result<usize> {
    F32_ROWS_PER_TEAM
        .iter()
        .position(|r| *r == rows_per_team)
        .ok_or_else(|| {
            GpuError::Shape(format!(
                "matvec_q4: {rows_per_team} rows per team (expected one of {F32_ROWS_PER_TEAM:?})"
            ))
        })
}

pub(crate) fn check_norm_input(x: &NormInput<'_>, cols: u32, what: &str) -> Result<()> {
    if cols > NORM_ON_LOAD_MAX || cols % 4 != 0 {
        return Err(GpuError::Shape(format!(
            "{what}: {cols} columns (norm-on-load needs a multiple of 4 up to {NORM_ON_LOAD_MAX})"
        )));
    }
    if x.h.size() < cols as u64 * 4 || x.weight.size() < cols as u64 * 4 {
        return Err(GpuError::Shape(format!(
            "{what}: h holds {} and the norm weight {} bytes for {cols} columns",
            x.h.size(),
            x.weight.size()
        )));
    }
    if !x.eps.is_finite() || x.eps < 0.0 {
        return Err(GpuError::Shape(format!(
            "{what}: eps {} is not a finite >= 0",
            x.eps
        )));
    }
    Ok(())
}

#[path = "matvec_ref.rs"]
mod reference;
pub use reference::{matvec_f32_ref, matvec_q4_i8_ref};

#[path = "matvec_norm.rs"]
mod norm;

#[path = "matvec_compile.rs"]
mod compile;

#[path = "matvec_bfp.rs"]
mod bfp;
pub use bfp::{BfpQuantBinding, BfpQuantKernel};
