//! The MoE router over columns: `logits[c] = Wr · rmsnorm(h[c])` for every column `c < nb`
//! that is not done, with the RMSNorm fused on load (the column form of
//! [`crate::kernels::matvec::MatvecKernel::bind_f32_norm`]), also publishing
//! `xn[c] = rmsnorm(h[c])` for the experts after it.
//!
//! Buffers: `h [nb, H]` and `xn [nb, H]` f32 (column `c` at `c * H`), the norm weight `[H]`,
//! `Wr` an [`F32Matrix`] `[E, H]` (`H % 4 == 0`, `H <= NORM_ON_LOAD_MAX`), `logits [nb, E]`
//! (column `c` at `c * E`). Grid `(row groups, 1, nb)`: z is the column, so each column's
//! workgroups normalise their own column into shared memory (the matvec's `NORM_ON_LOAD` with
//! its reads offset to the column) and a done column costs one load per workgroup. A matrix
//! split across bindings is one dispatch per part; the first part publishes `xn`.

use crate::columns::COLUMNS_WGSL;
use crate::context::{Context, GpuError, Result};
use crate::kernels::embed::check_cols;
use crate::kernels::matvec::{NormInput, F32_WIDE_COLS, NORM_ON_LOAD, NORM_ON_LOAD_MAX};
use crate::tensor::F32Matrix;

/// The router-over-columns pipelines: narrow (8 rows x 32 lanes) and wide (one row x 256
/// lanes, from `F32_WIDE_COLS` columns), as the single-column f32 matvec picks them.
pub struct RouterColsKernel {
    narrow: wgpu::ComputePipeline,
    wide: wgpu::ComputePipeline,
}

/// What one router-over-columns dispatch reads and writes.
pub struct RouterColsArgs<'a> {
    /// `Wr [rows, cols]`.
    pub m: &'a F32Matrix,
    /// `h [nb, cols]`, the RMSNorm weight `[cols]` and its eps.
    pub x: NormInput<'a>,
    /// `[nb, cols]`: the normalised columns, for the kernels after the router.
    pub xn: &'a wgpu::Buffer,
    /// `[nb, rows]` router logits.
    pub logits: &'a wgpu::Buffer,
    /// The [`crate::columns`] buffer (read only).
    pub cols: &'a wgpu::Buffer,
    /// Columns, `1..=65535` (the grid's z; the column buffer holds at least as many).
    pub nb: u32,
}

/// Bind groups (one per matrix part) and their grids.
pub struct RouterColsBinding {
    wide: bool,
    dispatches: Vec<(wgpu::BindGroup, (u32, u32))>,
    nb: u32,
}

impl RouterColsBinding {
    /// Dispatches [`RouterColsKernel::record`] issues (one per matrix part; 1 for the router).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

/// `NORM_ON_LOAD` reading column `nol_base` of `nol_h [nb, n/4]` instead of `nol_h [n/4]`.
fn norm_on_load_cols() -> Result<String> {
    const READ: &str = "nol_h[i]";
    // Both reads (the sum of squares, the scaled copy) must move, or a column would be
    // normalised with another column's scale.
    if NORM_ON_LOAD.matches(READ).count() != 2 {
        return Err(GpuError::Validation {
            what: "router_cols".into(),
            msg: format!("matvec's NORM_ON_LOAD no longer reads `{READ}` exactly twice"),
        });
    }
    Ok(NORM_ON_LOAD.replace(READ, "nol_h[nol_base + i]"))
}

impl RouterColsKernel {
    pub fn new(ctx: &Context) -> Result<RouterColsKernel> {
        let norm = norm_on_load_cols()?;
        let build = |rpw: u32| {
            let src = format!(
                "{COLUMNS_WGSL}\nconst RPW: u32 = {rpw}u;\nconst T: u32 = {}u;\n{}\n{norm}",
                256 / rpw,
                include_str!("../shaders/router_cols.wgsl")
            );
            let label = format!("router_cols.rpw{rpw}");
            // Compiled without naga's runtime bounds checks (multi-stream decode, once per
            // layer; docs/BENCHMARKS.md run 115).
            // SAFETY: every index of router_cols.wgsl and the norm-on-load snippet stays in
            // bounds for every binding `bind` makes, because it checks on the host:
            // - `F32Matrix::check_layout`: the parts tile the rows and each part's w holds its
            //   rows * cols floats; w is read at row c4 + c with row < part rows (the guard)
            //   and c < c4 = cols / 4;
            // - the column col = wid.z < the recorded nb <= the bound nb (`record_n`), and
            //   cols[col] is read only below arrayLength(cols); h and xn hold nb cols floats,
            //   read / written at col c4 + i for i < c4; the norm weight holds cols;
            //   y (the logits) holds nb rows, written at col rows + row_start + row with
            //   row_start + row < rows (the layout);
            // - workgroup arrays: nol_xs (1024 vec4s) below c4 <= NORM_ON_LOAD_MAX / 4 = 1024,
            //   nol_red at li + li / 16 <= 270 < 272 and 17 li + j <= 270 (li, j < 16),
            //   nol_red16 below 16, red at li + s with lane < s <= T / 2 (inside the team's T);
            // - loops run to c4, 16, T or constants, and every divisor is a constant.
            unsafe { ctx.compute_unchecked(&label, &src, "main") }
        };
        Ok(RouterColsKernel {
            narrow: build(8)?,
            wide: build(1)?,
        })
    }

    pub fn bind(&self, ctx: &Context, a: &RouterColsArgs<'_>) -> Result<RouterColsBinding> {
        check_cols(a.cols, a.nb, "router_cols")?;
        a.m.check_layout("router_cols")?;
        let (rows, cols, nb) = (a.m.rows as u64, a.m.cols as u64, a.nb as u64);
        if a.m.cols > NORM_ON_LOAD_MAX || a.m.cols % 4 != 0 {
            return Err(GpuError::Shape(format!(
                "router_cols: {cols} columns (norm-on-load needs a multiple of 4 up to {NORM_ON_LOAD_MAX})"
            )));
        }
        if a.x.h.size() < nb * cols * 4
            || a.xn.size() < nb * cols * 4
            || a.x.weight.size() < cols * 4
            || a.logits.size() < nb * rows * 4
        {
            return Err(GpuError::Shape(format!(
                "router_cols: {nb} columns of [{rows}, {cols}]: h {} / xn {} / norm weight {} / logits {} bytes too small",
                a.x.h.size(),
                a.xn.size(),
                a.x.weight.size(),
                a.logits.size()
            )));
        }
        if !a.x.eps.is_finite() || a.x.eps < 0.0 {
            return Err(GpuError::Shape(format!(
                "router_cols: eps {} is not a finite >= 0",
                a.x.eps
            )));
        }
        let wide = a.m.cols >= F32_WIDE_COLS;
        let rpw = if wide { 1 } else { 8 };
        let pipeline = if wide { &self.wide } else { &self.narrow };
        let mut dispatches = Vec::with_capacity(a.m.parts.len());
        for (i, part) in a.m.parts.iter().enumerate() {
            let grid = ctx.grid(part.rows.div_ceil(rpw));
            let words = [
                part.rows,
                a.m.cols / 4,
                part.row_start,
                grid.0,
                a.x.eps.to_bits(),
                a.m.rows,
                (i == 0) as u32,
                0,
            ];
            let p = ctx.uniform("router_cols.params", bytemuck::cast_slice(&words))?;
            let bg = ctx.bind_group(
                "router_cols",
                pipeline,
                &[
                    part.w.as_entire_binding(),
                    a.x.h.as_entire_binding(),
                    a.logits.as_entire_binding(),
                    p.as_entire_binding(),
                    a.cols.as_entire_binding(),
                    a.x.weight.as_entire_binding(),
                    a.xn.as_entire_binding(),
                ],
            )?;
            dispatches.push((bg, grid));
        }
        Ok(RouterColsBinding {
            wide,
            dispatches,
            nb: a.nb,
        })
    }

    /// Record the dispatches (one per matrix part), each over `nb` columns in z.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &RouterColsBinding) {
        self.record_n(pass, b, b.nb);
    }

    /// [`Self::record`] over the first `nb` columns only (at most the bound count).
    pub fn record_n(&self, pass: &mut wgpu::ComputePass<'_>, b: &RouterColsBinding, nb: u32) {
        pass.set_pipeline(if b.wide { &self.wide } else { &self.narrow });
        for (bg, (gx, gy)) in &b.dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, nb.min(b.nb));
        }
    }
}
