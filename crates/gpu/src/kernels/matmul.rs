//! Multi-column int4 x f32 matmul: `Y[b, row] = W[row, :] · X[b, :]` for a [`Q4Matrix`] `W`
//! `[rows, cols]` and up to [`B_MAX`] f32 columns (tokens) at once, the building block of
//! batched prefill and multi-stream decode.
//!
//! The point is the memory traffic: each weight block is loaded and dequantised once per
//! workgroup and used for all `nb` columns, so `nb` columns cost about one matvec's weight
//! traffic instead of `nb`. Layout as the int4 x f32 matvec (matvec_q4f.wgsl): 256-thread
//! workgroups of 8 teams x 32 lanes, `R` rows per team, a shared-memory reduction (no subgroup
//! size assumed), plus the activations staged through shared memory 32 blocks at a time
//! (coalesced loads; see the shader); pipelines are compiled for `C` in [`COLUMN_VARIANTS`] columns and the smallest
//! `C >= nb` runs (`nb` is a uniform, so one binding serves one `nb`). `R * C <= 8` keeps the
//! per-thread partials (`dq_block`'s two vec4 per row and column) in registers.
//!
//! Buffers: `X [nb, cols]` row-major (column `b` at `b * cols`), `Y [nb, y_stride]` (column `b`,
//! row `r` at `b * y_stride + r`). Forms ([`MatmulInput`]): plain, `Y += W X` (the residual add),
//! and norm-on-load (`X[b] = H[b] / rms(H[b]) * w`, every workgroup recomputing the `nb`
//! reductions, `cols <= 4096` like the matvec's). A matrix split across bindings is one dispatch
//! per part. Every dispatch returns at once when the run state says `done`.
//!
//! Per (row, column) the arithmetic is the matvec's, in the same order, so column `b` of a
//! matmul equals [`super::matvec::MatvecKernel`] on column `b` up to the driver's fma contraction
//! (tested to 1e-6 of the row's Σ|w||x|).

use crate::context::{Context, GpuError, Result};
use crate::numerics::F32_DEQ;
use crate::state::with_state;
use crate::tensor::{Q4Matrix, BLOCK};

use super::matvec::{NormInput, NORM_ON_LOAD_MAX};

/// Most columns one binding may carry.
pub const B_MAX: u32 = 8;
/// Columns the pipelines are compiled for (`C` in matmul_q4f.wgsl); the smallest `>= nb` runs.
pub const COLUMN_VARIANTS: [u32; 3] = [2, 4, 8];
/// Rows per team the pipelines are compiled for (`R`), those with `R * C <= 8`.
pub const ROWS_PER_TEAM: [u32; 3] = [1, 2, 4];
/// Most per-thread (row, column) partials: each is two vec4 plus an accumulator in registers.
const MAX_TILE: u32 = 8;

/// The compiled tile of one dispatch: `cols` columns (`C`) x `rows_per_team` rows (`R`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    pub cols: u32,
    pub rows_per_team: u32,
}

impl Tile {
    /// The tile for `nb` columns of a `rows`-row matrix: the fewest columns that hold `nb`, one
    /// row per team. More rows per team (compiled, for [`MatmulKernel::bind_tiled`]) were slower
    /// in every case measured on an H200 (wgpu/Vulkan, 2048 to 151936 rows: R=2 1.3-1.5x,
    /// R=4 up to 2x the R=1 time), unlike the matvec's; `rows` stays for a future rule.
    pub fn for_shape(_rows: u32, nb: u32) -> Result<Tile> {
        check_nb(nb)?;
        let cols = COLUMN_VARIANTS
            .into_iter()
            .find(|c| *c >= nb)
            .unwrap_or(B_MAX);
        Ok(Tile {
            cols,
            rows_per_team: 1,
        })
    }

    /// Columns staged in shared memory at a time (`CS`): at most 4, to fit 32 KiB.
    fn staged_cols(&self) -> u32 {
        self.cols.min(4)
    }

    /// Workgroup memory of the tile's widest form (norm-on-load): the lane partials, one staged
    /// chunk of 32 blocks x 9 vec4 per staged column, and the norm's per-column sums.
    pub fn shared_bytes(&self) -> u64 {
        let (c, r, cs) = (
            self.cols as u64,
            self.rows_per_team as u64,
            self.staged_cols() as u64,
        );
        4 * 256 * r * c + 16 * cs * 32 * 9 + 4 * (16 * c + c)
    }

    /// Every compiled tile, in pipeline order.
    pub fn all() -> impl Iterator<Item = Tile> {
        COLUMN_VARIANTS.into_iter().flat_map(|cols| {
            ROWS_PER_TEAM
                .into_iter()
                .filter(move |r| r * cols <= MAX_TILE)
                .map(move |rows_per_team| Tile {
                    cols,
                    rows_per_team,
                })
        })
    }
}

/// The activations of a matmul and what it does around the product.
#[derive(Clone, Copy)]
pub enum MatmulInput<'a> {
    /// `Y = W X`, `X [nb, cols]`.
    Plain(&'a wgpu::Buffer),
    /// `Y += W X`, `X [nb, cols]`: the residual add after the product.
    Acc(&'a wgpu::Buffer),
    /// `Y = W rmsnorm(H)`: `h` is `H [nb, cols]`, each column normalised on load with the one
    /// `[cols]` weight.
    Norm(NormInput<'a>),
}

impl MatmulInput<'_> {
    fn form(&self) -> usize {
        match self {
            MatmulInput::Plain(_) => 0,
            MatmulInput::Acc(_) => 1,
            MatmulInput::Norm(_) => 2,
        }
    }
}

/// One matmul to bind.
#[derive(Clone, Copy)]
pub struct MatmulArgs<'a> {
    /// `W [rows, cols]`.
    pub m: &'a Q4Matrix,
    pub input: MatmulInput<'a>,
    /// Columns (tokens), `1..=B_MAX`.
    pub nb: u32,
    /// `Y [nb, y_stride]` f32; column `b` of the product lands at `b * y_stride + row`.
    pub y: &'a wgpu::Buffer,
    /// Elements between columns of `Y` (at least `rows`).
    pub y_stride: u32,
    /// The run state (`done` turns the dispatches into no-ops).
    pub state: &'a wgpu::Buffer,
}

/// Bind groups (one per matrix part) of one matmul, ready to record.
pub struct MatmulBinding {
    pipeline: usize,
    dispatches: Vec<(wgpu::BindGroup, (u32, u32))>,
}

impl MatmulBinding {
    /// Dispatches [`MatmulKernel::record`] issues (one per matrix part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

/// The matmul pipelines (compiled once per context): `[form][tile]`, forms plain, acc, norm,
/// tiles in [`Tile::all`] order.
pub struct MatmulKernel {
    pipes: Vec<wgpu::ComputePipeline>,
}

/// Plain/acc activation snippet: `X [nb, cols]` read from global memory.
fn plain_input(acc: bool) -> String {
    format!(
        "@group(0) @binding(2) var<storage, read> mm_xs: array<vec4<f32>>; // [nb, cols/4]
fn mm_stage(li: u32) {{}}
fn mm_w(i: u32) -> vec4<f32> {{ return vec4<f32>(1.0); }}
fn mm_x(c: u32, i: u32, w: vec4<f32>) -> vec4<f32> {{ return mm_xs[c * p.cols4 + i]; }}
const ACC: bool = {acc};
"
    )
}

/// Norm-on-load snippet: `mm_stage` leaves `1 / rms(H[c])` in `mm_inv[c]` for every column,
/// with the matvec's partition and summation order (matvec.rs NORM_ON_LOAD: 256 strided
/// partials, 16 sums of 16, one sum of 16), so the normalised activations are the matvec's.
/// `mm_x` then normalises on load, `(h * inv) * w` as the matvec does. The `[C][256]` partials
/// borrow the shader's `red` (at least `256 * C` floats, not yet in use): shared memory is tight.
const NORM_INPUT: &str = "
@group(0) @binding(2) var<storage, read> mm_h: array<vec4<f32>>;  // [nb, cols/4] residual streams
@group(0) @binding(3) var<storage, read> mm_nw: array<vec4<f32>>; // [cols/4] RMSNorm weight
var<workgroup> mm_red16: array<f32, 16u * C>; // [C][16]
var<workgroup> mm_inv: array<f32, C>;          // [C] 1 / rms
fn mm_stage(li: u32) {
    for (var c = 0u; c < C; c++) {
        var ss = 0.0;
        if (c < p.nb) {
            for (var i = li; i < p.cols4; i += 256u) {
                let v = mm_h[c * p.cols4 + i];
                ss += dot(v, v);
            }
        }
        red[c * 256u + li] = ss;
    }
    workgroupBarrier();
    if (li < 16u * C) {
        var s = 0.0;
        for (var j = 0u; j < 16u; j++) { s += red[16u * li + j]; }
        mm_red16[li] = s;
    }
    workgroupBarrier();
    if (li < C) {
        var tot = 0.0;
        for (var j = 0u; j < 16u; j++) { tot += mm_red16[16u * li + j]; }
        mm_inv[li] = inverseSqrt(tot / f32(4u * p.cols4) + p.eps);
    }
    workgroupBarrier();
}
fn mm_w(i: u32) -> vec4<f32> { return mm_nw[i]; }
fn mm_x(c: u32, i: u32, w: vec4<f32>) -> vec4<f32> { return mm_h[c * p.cols4 + i] * mm_inv[c] * w; }
const ACC: bool = false;
";

impl MatmulKernel {
    /// Compile every form and tile; errors when the device's workgroup memory cannot hold the
    /// widest tile (27 KiB; lavapipe has 32, an H200 under Vulkan 48).
    pub fn new(ctx: &Context) -> Result<MatmulKernel> {
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        if let Some(t) = Tile::all().find(|t| t.shared_bytes() > limit) {
            return Err(GpuError::TooLarge {
                label: format!("matmul tile {t:?} workgroup memory"),
                bytes: t.shared_bytes(),
                limit,
            });
        }
        let body = include_str!("../shaders/matmul_q4f.wgsl");
        let inputs = [
            plain_input(false),
            plain_input(true),
            NORM_INPUT.to_string(),
        ];
        let mut pipes = Vec::new();
        for (form, input) in inputs.iter().enumerate() {
            for t in Tile::all() {
                let (c, r) = (t.cols, t.rows_per_team);
                let cs = t.staged_cols();
                let consts =
                    format!("const C: u32 = {c}u;\nconst CS: u32 = {cs}u;\nconst R: u32 = {r}u;\n");
                let src = format!("{F32_DEQ}{consts}{input}{body}");
                pipes.push(ctx.compute(
                    &format!("matmul_q4f.f{form}.c{c}.r{r}"),
                    &with_state(&src),
                    "main",
                )?);
            }
        }
        Ok(MatmulKernel { pipes })
    }

    /// Bind `a` with the tile [`Tile::for_shape`] picks.
    pub fn bind(&self, ctx: &Context, a: &MatmulArgs<'_>) -> Result<MatmulBinding> {
        self.bind_tiled(ctx, a, Tile::for_shape(a.m.rows, a.nb)?)
    }

    /// [`Self::bind`] with the tile chosen (one of [`Tile::all`] with `cols >= nb`). For tests
    /// and benchmarks.
    pub fn bind_tiled(
        &self,
        ctx: &Context,
        a: &MatmulArgs<'_>,
        tile: Tile,
    ) -> Result<MatmulBinding> {
        check_nb(a.nb)?;
        let tile_index = Tile::all()
            .position(|t| t == tile)
            .ok_or_else(|| GpuError::Shape(format!("matmul: no pipeline for tile {tile:?}")))?;
        if tile.cols < a.nb {
            return Err(GpuError::Shape(format!(
                "matmul: tile of {} columns for nb = {}",
                tile.cols, a.nb
            )));
        }
        let (rows, cols, nb) = (a.m.rows as u64, a.m.cols as u64, a.nb as u64);
        if cols == 0 || cols % BLOCK as u64 != 0 {
            return Err(GpuError::Shape(format!(
                "matmul: {cols} columns is not a positive multiple of 32"
            )));
        }
        check_out(a, rows, nb)?;
        let (x_entries, eps) = match a.input {
            MatmulInput::Plain(x) | MatmulInput::Acc(x) => {
                check_len(x, nb * cols, "X")?;
                (vec![(2, x.as_entire_binding())], 0.0)
            }
            MatmulInput::Norm(n) => {
                check_norm(&n, a.m.cols, nb)?;
                (
                    vec![
                        (2, n.h.as_entire_binding()),
                        (3, n.weight.as_entire_binding()),
                    ],
                    n.eps,
                )
            }
        };
        let pipeline = a.input.form() * Tile::all().count() + tile_index;
        let rows_per_wg = 8 * tile.rows_per_team;
        let bpr = a.m.cols / BLOCK as u32;
        let mut dispatches = Vec::with_capacity(a.m.parts.len());
        for part in &a.m.parts {
            let grid = ctx.grid(part.rows.div_ceil(rows_per_wg));
            // Params of matmul_q4f.wgsl.
            let words = [
                part.rows,
                bpr,
                part.row_start,
                grid.0,
                eps.to_bits(),
                a.nb,
                a.y_stride,
                a.m.cols / 4,
            ];
            let p = ctx.uniform("matmul.params", bytemuck::cast_slice(&words))?;
            let mut entries = vec![
                (0, part.qs.as_entire_binding()),
                (1, part.scales.as_entire_binding()),
                (4, a.y.as_entire_binding()),
                (5, p.as_entire_binding()),
                (6, a.state.as_entire_binding()),
            ];
            entries.extend(x_entries.iter().cloned());
            let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
            let bg = ctx.bind_group_at("matmul_q4f", &self.pipes[pipeline], &ids, &res)?;
            dispatches.push((bg, grid));
        }
        Ok(MatmulBinding {
            pipeline,
            dispatches,
        })
    }

    /// Record the dispatches (one per matrix part).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &MatmulBinding) {
        pass.set_pipeline(&self.pipes[b.pipeline]);
        for (bg, (gx, gy)) in &b.dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, 1);
        }
    }
}

fn check_nb(nb: u32) -> Result<()> {
    if nb == 0 || nb > B_MAX {
        return Err(GpuError::Shape(format!(
            "matmul: {nb} columns (expected 1..={B_MAX})"
        )));
    }
    Ok(())
}

fn check_len(buf: &wgpu::Buffer, elems: u64, what: &str) -> Result<()> {
    if buf.size() < elems * 4 {
        return Err(GpuError::Shape(format!(
            "matmul: {what} holds {} bytes, need {elems} f32",
            buf.size()
        )));
    }
    Ok(())
}

/// `Y [nb, y_stride]`: columns must not overlap (a race under `+=`) and every index the shader
/// forms must fit a u32.
fn check_out(a: &MatmulArgs<'_>, rows: u64, nb: u64) -> Result<()> {
    let stride = a.y_stride as u64;
    if stride < rows {
        return Err(GpuError::Shape(format!(
            "matmul: Y stride {stride} is less than the {rows} rows"
        )));
    }
    let need = (nb - 1) * stride + rows;
    if need > u32::MAX as u64 {
        return Err(GpuError::Shape(format!(
            "matmul: Y of {need} elements is too large"
        )));
    }
    check_len(a.y, need, "Y")
}

fn check_norm(n: &NormInput<'_>, cols: u32, nb: u64) -> Result<()> {
    if cols > NORM_ON_LOAD_MAX {
        return Err(GpuError::Shape(format!(
            "matmul (norm): {cols} columns (norm-on-load allows up to {NORM_ON_LOAD_MAX})"
        )));
    }
    check_len(n.h, nb * cols as u64, "H")?;
    check_len(n.weight, cols as u64, "the norm weight")?;
    if !n.eps.is_finite() || n.eps < 0.0 {
        return Err(GpuError::Shape(format!(
            "matmul (norm): eps {} is not a finite >= 0",
            n.eps
        )));
    }
    Ok(())
}

/// Scalar reference over already-dequantised weights `w [rows, cols]` and `x [nb, cols]`, in
/// f64: `[nb, rows]`.
pub fn matmul_f32_ref(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    x.chunks_exact(cols)
        .flat_map(|xb| super::matvec::matvec_f32_ref(w, rows, cols, xb))
        .collect()
}
