//! Multi-column int4 x f32 matmul: `Y[b, row] = W[row, :] · X[b, :]` for a [`Q4Matrix`] `W`
//! `[rows, cols]` and up to [`B_MAX`] f32 columns (tokens) at once, the building block of
//! batched prefill and multi-stream decode.
//!
//! The point is the memory traffic: each weight block is loaded and dequantised once and used
//! for all `nb` columns, so `nb` columns cost about one matvec's weight traffic instead of `nb`.
//! 256-thread workgroups of teams of `L` lanes, `R` rows per team (a [`Tile`]); the activations
//! of all columns are staged chunk by chunk in swizzled shared memory, read conflict-free as
//! broadcasts (see matmul_q4f.wgsl); a shared-memory reduction (no subgroup size assumed).
//! The per-(row, column) lines are generated here with one variable each ([`shader`]): the
//! NVIDIA compiler puts per-thread arrays indexed in loops into slow local memory. Pipelines
//! exist for `C` in [`COLUMN_VARIANTS`] columns (the smallest `C >= nb` runs; `nb` is a
//! uniform, so one binding serves one `nb`) and every tile of [`Tile::all`]; each is compiled
//! on its first bind.
//!
//! Buffers: `X [nb, cols]` row-major (column `b` at `b * cols`), `Y [nb, y_stride]` (column `b`,
//! row `r` at `b * y_stride + r`). Forms ([`MatmulInput`]): plain, `Y += W X` (the residual add),
//! and norm-on-load (`X[b] = H[b] / rms(H[b]) * w`, every workgroup recomputing the `nb`
//! reductions, `cols <= 4096` like the matvec's). A matrix split across bindings is one dispatch
//! per part. Every dispatch returns at once when the run state says `done`.
//!
//! Per (row, column) each block's dot is the matvec's `dq_block`, in the same order; the blocks
//! are spread over `L` lanes instead of 32, so column `b` equals
//! [`super::matvec::MatvecKernel`] on column `b` up to f32 rounding (tested to 1e-6 of the row's
//! Σ|w||x|).

use std::sync::OnceLock;

use crate::context::{Context, GpuError, Result};
use crate::numerics::F32_DEQ;
use crate::state::with_state;
use crate::tensor::{Q4Matrix, QForm, BLOCK};

use super::matvec::{NormInput, NORM_ON_LOAD_MAX};

/// Most columns one binding may carry.
pub const B_MAX: u32 = 8;
/// Columns the pipelines are compiled for (`C` in matmul_q4f.wgsl); the smallest `>= nb` runs.
pub const COLUMN_VARIANTS: [u32; 3] = [2, 4, 8];
/// Rows per team (`R`); tiles keep `R * C <= MAX_TILE`.
pub const ROWS_PER_TEAM: [u32; 3] = [1, 2, 4];
/// Lanes per team (`L`): the blocks of a row are spread over them; tiles keep `C * L <= 128`
/// (a staged chunk of `128 / C` blocks gives every lane at least one).
pub const LANES_PER_TEAM: [u32; 4] = [4, 8, 16, 32];
/// Most per-thread (row, column) accumulators (`R * C`).
const MAX_TILE: u32 = 16;
/// Blocks x columns of one staged chunk: `C * KC = 128`, 16 KiB of f32 activations.
const CHUNK_BLOCK_COLS: u32 = 128;
/// Rows from which a matrix gets the tall tile (128 rows per workgroup): with fewer rows per
/// workgroup the activations each one stages (L2 traffic, `4 cols C` bytes per workgroup) rival
/// the weight bytes (`0.56 cols` per row); below it, more workgroups keep the GPU busy.
const TALL_ROWS: u32 = 32768;
/// Rows of at most this many int4 blocks of 32 get 8 lanes x 2 rows per team ([`Tile::for_shape`]).
const SHORT_ROW_BLOCKS: u32 = 64;

/// The compiled tile of one dispatch: `cols` columns (`C`) x `rows_per_team` rows (`R`), each
/// row's blocks spread over `lanes` lanes (`L`); a workgroup covers `256 / L * R` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    pub cols: u32,
    pub rows_per_team: u32,
    pub lanes: u32,
}

impl Tile {
    /// The tile for `nb` columns of a `rows` x `inputs` matrix: the fewest columns that hold
    /// `nb`; for tall matrices (the lm_head) 128 rows per workgroup (4 lanes x 2 rows per team),
    /// so the staged activations stay small next to the weights; for rows of at most 64 blocks
    /// (qkv: 2048 inputs) 8 lanes x 2 rows per team (8 blocks per lane); else the most
    /// workgroups (one row per team, as many lanes as the chunk allows: 8 or 16 rows per
    /// workgroup). Measured on the H200 over every compiled tile
    /// (docs/runs/2026-11-29-h200-matmul-tiles.txt): qkv `[5120x2048]` at nb = 1/2/4/8 takes
    /// 9.9/11.2/15.2/23.1 us with 8 lanes x 2 rows against 15.6/17.2/23.6/34.3 with the widest
    /// teams, while o_proj `[2048x4096]` is fastest with the widest teams.
    pub fn for_shape(rows: u32, inputs: u32, nb: u32) -> Result<Tile> {
        check_nb(nb)?;
        let cols = COLUMN_VARIANTS
            .into_iter()
            .find(|c| *c >= nb)
            .unwrap_or(B_MAX);
        Ok(if rows >= TALL_ROWS {
            Tile {
                cols,
                rows_per_team: 2,
                lanes: 4,
            }
        } else if inputs <= SHORT_ROW_BLOCKS * 32 {
            Tile {
                cols,
                rows_per_team: 2,
                lanes: 8,
            }
        } else {
            Tile {
                cols,
                rows_per_team: 1,
                lanes: (CHUNK_BLOCK_COLS / cols).min(32),
            }
        })
    }

    /// Blocks per staged chunk (`KC`).
    fn chunk(&self) -> u32 {
        CHUNK_BLOCK_COLS / self.cols
    }

    /// Rows per workgroup (`RW`).
    pub fn rows_per_workgroup(&self) -> u32 {
        256 / self.lanes * self.rows_per_team
    }

    /// Floats of `red` the reduction's columns are counted on (`CG`): `256 R` per column,
    /// at least the norm's `[C][256]` sums.
    fn red_base(&self) -> u32 {
        256 * self.rows_per_team.max(self.cols)
    }

    /// Floats of the shader's `red`: one reduction round of `CG` columns with its lines
    /// `L + 1` words apart, at least the norm's `[C][16][17]` padded sums.
    fn red_floats(&self) -> u32 {
        let padded = self.red_base() / self.lanes * (self.lanes + 1);
        padded.max(272 * self.cols)
    }

    /// Workgroup memory of the tile's widest form (norm-on-load): the staged chunk, `red`, and
    /// the norm's per-column sums.
    pub fn shared_bytes(&self) -> u64 {
        let c = self.cols as u64;
        16 * c * self.chunk() as u64 * 8 + 4 * self.red_floats() as u64 + 4 * (17 * c + c)
    }

    /// Every compiled tile, in pipeline order.
    pub fn all() -> impl Iterator<Item = Tile> {
        COLUMN_VARIANTS.into_iter().flat_map(|cols| {
            ROWS_PER_TEAM
                .into_iter()
                .filter(move |r| r * cols <= MAX_TILE)
                .flat_map(move |rows_per_team| {
                    LANES_PER_TEAM
                        .into_iter()
                        .filter(move |l| cols * l <= CHUNK_BLOCK_COLS)
                        .map(move |lanes| Tile {
                            cols,
                            rows_per_team,
                            lanes,
                        })
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
    /// Per matrix part: the pipeline of its block form, its bind group and grid.
    dispatches: Vec<(wgpu::ComputePipeline, wgpu::BindGroup, (u32, u32))>,
}

impl MatmulBinding {
    /// Dispatches [`MatmulKernel::record`] issues (one per matrix part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

/// The matmul pipelines: `[form][tile]`, forms plain, acc, norm, tiles in [`Tile::all`] order,
/// each compiled on its first bind (90 of them; a run uses a few).
pub struct MatmulKernel {
    pipes: Vec<OnceLock<wgpu::ComputePipeline>>,
}

/// Plain/acc activation snippet: `X [nb, cols]` read from global memory.
fn plain_input(acc: bool) -> String {
    format!(
        "@group(0) @binding(2) var<storage, read> mm_xs: array<vec4<f32>>; // [nb, cols/4]
fn mm_stage(li: u32) {{}}
fn mm_x(c: u32, i: u32) -> vec4<f32> {{ return mm_xs[c * p.cols4 + i]; }}
const ACC: bool = {acc};
"
    )
}

/// Norm-on-load snippet: `mm_stage` leaves `1 / rms(H[c])` in `mm_inv[c]` for every column,
/// with the matvec's partition and summation order (matvec.rs NORM_ON_LOAD: 256 strided
/// partials, 16 sums of 16, one sum of 16), so the normalised activations are the matvec's.
/// `mm_x` then normalises on load, `(h * inv) * w` as the matvec does. The `[C][256]` partials
/// borrow the shader's `red` (`272 * C` floats: 16-word groups 17 apart; not yet in use): shared memory is tight.
const NORM_INPUT: &str = "
@group(0) @binding(2) var<storage, read> mm_h: array<vec4<f32>>;  // [nb, cols/4] residual streams
@group(0) @binding(3) var<storage, read> mm_nw: array<vec4<f32>>; // [cols/4] RMSNorm weight
var<workgroup> mm_red16: array<f32, 17u * C>; // [C][16] sums, 17 words apart
var<workgroup> mm_inv: array<f32, C>;          // [C] 1 / rms
fn mm_stage(li: u32) {
    // Groups of 16 partials sit 17 words apart (group g at 17 g): the 16 C threads that each
    // add one group read 16 C distinct banks instead of two.
    for (var c = 0u; c < C; c++) {
        var ss = 0.0;
        if (c < p.nb) {
            for (var i = li; i < p.cols4; i += 256u) {
                let v = mm_h[c * p.cols4 + i];
                ss += dot(v, v);
            }
        }
        red[c * 272u + li + li / 16u] = ss;
    }
    workgroupBarrier();
    if (li < 16u * C) {
        var s = 0.0;
        for (var j = 0u; j < 16u; j++) { s += red[17u * li + j]; }
        mm_red16[li + li / 16u] = s;
    }
    workgroupBarrier();
    if (li < C) {
        var tot = 0.0;
        for (var j = 0u; j < 16u; j++) { tot += mm_red16[17u * li + j]; }
        mm_inv[li] = inverseSqrt(tot / f32(4u * p.cols4) + p.eps);
    }
    workgroupBarrier();
}
fn mm_x(c: u32, i: u32) -> vec4<f32> { return mm_h[c * p.cols4 + i] * mm_inv[c] * mm_nw[i]; }
const ACC: bool = false;
";

/// The full WGSL of `form` (0 plain, 1 acc, 2 norm) and tile `t`: the tile constants, the input
/// snippet and matmul_q4f.wgsl with its per-(row, column) lines written out.
pub fn shader(form: usize, t: Tile) -> String {
    shader_for(form, t, QForm::Q4_0)
}

/// [`shader`] for matrices of the given block form (`qform`; the affine form's blocks add
/// `c1 · Σ x` per column).
pub fn shader_for(form: usize, t: Tile, qform: QForm) -> String {
    let affine = qform.affine();
    let (c, r, l) = (t.cols, t.rows_per_team, t.lanes);
    let consts = format!(
        "const C: u32 = {c}u;\nconst R: u32 = {r}u;\nconst L: u32 = {l}u;\nconst WL: u32 = {}u;\n\
         const KC: u32 = {}u;\nconst RW: u32 = {}u;\nconst CG: u32 = {}u;\nconst RED: u32 = {}u;\n\
         const LP: u32 = {}u;\n",
        l.min(8),
        t.chunk(),
        t.rows_per_workgroup(),
        reduce_cols(t),
        t.red_floats(),
        l + 1
    );
    let input = match form {
        0 => plain_input(false),
        1 => plain_input(true),
        _ => NORM_INPUT.to_string(),
    };
    let body = include_str!("../shaders/matmul_q4f.wgsl")
        .replace("//MM_SETUP", &setup_lines(r, c, affine))
        .replace("//MM_NEXT", &next_lines(r, affine))
        .replace("//MM_BODY", &body_lines(r, c, qform))
        .replace("//MM_REDUCE", &reduce_lines(t));
    let form = qform.wgsl();
    with_state(&format!("{F32_DEQ}{form}{consts}{input}{body}"))
}

/// Columns per reduction round (`CG`): as many as `red` holds next to the `R` rows.
fn reduce_cols(t: Tile) -> u32 {
    t.red_base() / (256 * t.rows_per_team)
}

/// Per row: its base block `rb{r}`, the first block's weights `nw{r}`/`ns{r}` and the
/// accumulators `a{r}_{c}`.
fn setup_lines(r: u32, c: u32, affine: bool) -> String {
    let mut s = String::new();
    for i in 0..r {
        s += &format!(
            "let rb{i} = select(0u, row0 + {i}u, row0 + {i}u < p.rows) * p.bpr;
    var nw{i} = qs[rb{i} + first];
    var ns{i} = {};
    ",
            coef(&format!("rb{i} + first"), affine)
        );
        for j in 0..c {
            s += &format!("var a{i}_{j} = 0.0;\n    ");
        }
    }
    s
}

/// Per row: take the prefetched block and issue the load of block `bn`.
fn next_lines(r: u32, affine: bool) -> String {
    (0..r)
        .map(|i| {
            format!(
                "let w{i} = nw{i};
            let s{i} = ns{i};
            nw{i} = qs[rb{i} + bn];
            ns{i} = {};
            ",
                coef(&format!("rb{i} + bn"), affine)
            )
        })
        .collect()
}

/// WGSL: the scale of block `blk` (an expression): Q4_0's f16, or the affine form's
/// `(c0, c1)` (tensor.rs `Q4_COEF`).
fn coef(blk: &str, affine: bool) -> String {
    match affine {
        true => format!("q4_coef(sc[({blk}) >> 1u], {blk})"),
        false => format!("scale({blk})"),
    }
}

/// One block for every (row, column): each row's words dequantised once (nibbles: 4 words,
/// `q{r}_{k}l/h` by `dq_lo`/`dq_hi`; bytes: 8 words of `qb_bytes`, `q{r}_{k}` by `dq8`), then per column its 8
/// staged vec4s (`x0..x7`, swizzled slots) and per row the form's exact sequence of products
/// (`dq_block`'s or `qb_dot`'s), then `a = fma(scale, dot, a)` as the matvec.
fn body_lines(r: u32, c: u32, form: QForm) -> String {
    let affine = form.affine();
    let mut s = String::new();
    for i in 0..r {
        if form.wide() {
            // The block as bytes (`qb_bytes`: itself for the byte forms, Q5_K's nibbles with
            // their fifth bits).
            s += &format!("let y{i} = qb_bytes(w{i});\n                ");
        }
        for (k, comp) in ["x", "y", "z", "w"].iter().enumerate() {
            s += &match form.wide() {
                true => format!(
                    "let q{i}_{k} = dq8(y{i}.lo.{comp}); let q{i}_{} = dq8(y{i}.hi.{comp});
                ",
                    k + 4
                ),
                false => format!(
                    "let q{i}_{k}l = dq_lo(w{i}.{comp}); let q{i}_{k}h = dq_hi(w{i}.{comp});
                "
                ),
            };
        }
    }
    // Q6_K scales each half's sum by its sub-scale (tensor.rs `Q6_PAYLOAD`), `t{i}` per row.
    let block_dot = match form {
        QForm::Q6K => "fma(t{i}.x, dot(lo, DQ8_S), t{i}.y * dot(hi, DQ8_S))",
        f if f.wide() => "dot(lo, DQ8_S) + dot(hi, DQ8_S)",
        _ => "dot(lo, DQ_SLO) + dot(hi, DQ_SHI)",
    };
    if form == QForm::Q6K {
        for i in 0..r {
            s += &format!(
                "let t{i} = vec2<f32>(q6_sub(w{i}, 0u), q6_sub(w{i}, 1u));
                "
            );
        }
    }
    for j in 0..c {
        // Column 0 always runs (nb >= 1); the others only below nb (uniform).
        let guard = if j == 0 {
            String::new()
        } else {
            format!("if ({j}u < p.nb) ")
        };
        s += &format!("{guard}{{\n                    let xb = ({j}u * KC + bl) * 8u;\n");
        for k in 0..8 {
            s += &format!("                    let x{k} = xs[xb + ((sw + {k}u) & 7u)];\n");
        }
        if affine {
            s += "                    let xsum = dot(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), vec4<f32>(1.0));\n";
        }
        let acc = if affine {
            format!("fma(s{{i}}.x, {block_dot}, fma(s{{i}}.y, xsum, a{{i}}_{j}))")
        } else {
            format!("fma(s{{i}}, {block_dot}, a{{i}}_{j})")
        };
        for i in 0..r {
            if form.wide() {
                s += &format!(
                    "                    {{
                        var lo = q{i}_0 * x0;
                        var hi = q{i}_4 * x4;
                        lo = fma(q{i}_1, x1, lo);
                        hi = fma(q{i}_5, x5, hi);
                        lo = fma(q{i}_2, x2, lo);
                        hi = fma(q{i}_6, x6, hi);
                        lo = fma(q{i}_3, x3, lo);
                        hi = fma(q{i}_7, x7, hi);
                        a{i}_{j} = {};
                    }}
",
                    acc.replace("{i}", &i.to_string())
                );
                continue;
            }
            s += &format!(
                "                    {{
                        var lo = q{i}_0l * vec4<f32>(x0.x, x4.x, x0.y, x4.y);
                        var hi = q{i}_0h * vec4<f32>(x0.z, x4.z, x0.w, x4.w);
                        lo = fma(q{i}_1l, vec4<f32>(x1.x, x5.x, x1.y, x5.y), lo);
                        hi = fma(q{i}_1h, vec4<f32>(x1.z, x5.z, x1.w, x5.w), hi);
                        lo = fma(q{i}_2l, vec4<f32>(x2.x, x6.x, x2.y, x6.y), lo);
                        hi = fma(q{i}_2h, vec4<f32>(x2.z, x6.z, x2.w, x6.w), hi);
                        lo = fma(q{i}_3l, vec4<f32>(x3.x, x7.x, x3.y, x7.y), lo);
                        hi = fma(q{i}_3h, vec4<f32>(x3.z, x7.z, x3.w, x7.w), hi);
                        a{i}_{j} = {};
                    }}
",
                acc.replace("{i}", &i.to_string())
            );
        }
        s += "                }\n                ";
    }
    s
}

/// The reduction, `C / CG` rounds: every thread writes its `R x CG` partials to
/// `red [CG][RW][LP]`, then one thread per (column, row) adds the `L` lanes in order and stores.
/// The lines sit `LP = L + 1` words apart (odd), so a warp's 32 adding threads read 32 distinct
/// banks; `L` apart put `L` of them on each bank it touched (an L-way conflict on every read).
fn reduce_lines(t: Tile) -> String {
    let (c, r) = (t.cols, t.rows_per_team);
    let cg = reduce_cols(t);
    let mut s = String::new();
    for round in 0..c / cg {
        if round > 0 {
            // The previous round's sums are read before red is overwritten.
            s += "workgroupBarrier();\n    ";
        }
        for j in 0..cg {
            for i in 0..r {
                s += &format!(
                    "red[({j}u * RW + team * R + {i}u) * LP + g] = a{i}_{};\n    ",
                    round * cg + j
                );
            }
        }
        s += &format!(
            "workgroupBarrier();
    for (var it = li; it < CG * RW; it += 256u) {{
        var sum = 0.0;
        for (var k = 0u; k < L; k++) {{ sum += red[it * LP + k]; }}
        let c = {}u + it / RW;
        let row = wg_row0 + it % RW;
        if (row < p.rows && c < p.nb) {{
            let o = c * p.y_stride + p.row_start + row;
            if (ACC) {{ y[o] += sum; }} else {{ y[o] = sum; }}
        }}
    }}
    ",
            round * cg
        );
    }
    s
}

impl MatmulKernel {
    /// Check every tile fits the device's workgroup memory (at most 25 KiB; lavapipe has 32, an
    /// H200 under Vulkan 48); the pipelines are compiled on first use.
    pub fn new(ctx: &Context) -> Result<MatmulKernel> {
        let limit = ctx.limits.max_compute_workgroup_storage_size as u64;
        if let Some(t) = Tile::all().find(|t| t.shared_bytes() > limit) {
            return Err(GpuError::TooLarge {
                label: format!("matmul tile {t:?} workgroup memory"),
                bytes: t.shared_bytes(),
                limit,
            });
        }
        let pipes = (0..QForm::ALL.len() * 3 * Tile::all().count())
            .map(|_| OnceLock::new())
            .collect();
        Ok(MatmulKernel { pipes })
    }

    /// The pipeline of `form` and the tile at `tile_index`, compiled now if it is the first use
    /// (a race compiles it twice and keeps one: harmless).
    fn pipeline(
        &self,
        ctx: &Context,
        form: usize,
        tile_index: usize,
        qform: QForm,
    ) -> Result<wgpu::ComputePipeline> {
        let n = Tile::all().count();
        let slot = &self.pipes[(qform.index() * 3 + form) * n + tile_index];
        if let Some(p) = slot.get() {
            return Ok(p.clone());
        }
        let t = Tile::all()
            .nth(tile_index)
            .ok_or_else(|| GpuError::Shape(format!("matmul: no tile {tile_index}")))?;
        let label = format!(
            "matmul_q4f.f{form}.c{}.r{}.l{}{}",
            t.cols,
            t.rows_per_team,
            t.lanes,
            match qform {
                QForm::Q4_0 => String::new(),
                f => format!(".{f:?}"),
            }
        );
        // Compiled without naga's runtime bounds checks (multi-stream decode and the batched
        // prefill's projections; docs/BENCHMARKS.md run 115: +15% aggregate with every module
        // unchecked).
        // SAFETY: every index of matmul_q4f.wgsl and its input snippets stays in bounds for
        // every binding this kernel makes, because its one binder (`bind_tiled`) checks on the
        // host:
        // - `Q4Matrix::check_layout`: cols % 32 == 0 (so bpr >= 1 and `bpr - 1` does not wrap),
        //   parts tiling the rows, each part's qs >= part rows * bpr blocks of the form (`QB`s) and scales >=
        //   ceil(that / 2) words (the affine form reads the same word, blk >> 1); a block
        //   index is rb + b with rb = row * bpr for a row below
        //   the part's rows (rows past the end select row 0) and b = min(.., bpr - 1);
        // - Y: stores only for row < part rows and c < nb, at c y_stride + row_start + row <
        //   (nb - 1) y_stride + m.rows, which `check_out` makes fit Y (y_stride >= m.rows, and
        //   row_start + part rows <= m.rows by the layout);
        // - X / H: read at c cols4 + i with c < nb (`check_nb`: nb <= C, the tile's columns)
        //   and i = (b0 + bl) 8 + k < bpr 8 = cols4; `check_len` / `check_norm` make X and H
        //   hold nb cols floats and the norm weight cols;
        // - xs: (c KC + bl) 8 + ((k + bl) & 7) with c < C, bl < KC; the body reads
        //   (j KC + bl) 8 + s with j < C and bl = u L + g < KC (u < KC / L, g < L since WL
        //   divides L);
        // - red: the norm's c 272 + li + li / 16 <= 272 C - 2 and 17 li + j with li < 16 C,
        //   j < 16, both below RED >= 272 C; mm_red16 at li + li / 16 < 17 C and 17 li + j
        //   for li < C; the reduction's (j RW + team R + i) LP + g with j < CG, team < 256 / L
        //   (so team R + i < RW), g < L, below CG RW LP <= RED (`red_floats`), read back at
        //   it LP + k for it < CG RW, k < L;
        // - loops run to bpr, cols4, C, L or constants, and every divisor is a constant.
        let p = unsafe { ctx.compute_unchecked(&label, &shader_for(form, t, qform), "main")? };
        Ok(slot.get_or_init(|| p).clone())
    }

    /// Bind `a` with the tile [`Tile::for_shape`] picks.
    pub fn bind(&self, ctx: &Context, a: &MatmulArgs<'_>) -> Result<MatmulBinding> {
        self.bind_tiled(ctx, a, Tile::for_shape(a.m.rows, a.m.cols, a.nb)?)
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
        a.m.check_layout("matmul")?;
        let tile_index = Tile::all()
            .position(|t| t == tile)
            .ok_or_else(|| GpuError::Shape(format!("matmul: no pipeline for tile {tile:?}")))?;
        if tile.cols < a.nb {
            return Err(GpuError::Shape(format!(
                "matmul: tile of {} columns for nb = {}",
                tile.cols, a.nb
            )));
        }
        // `check_layout` above: cols is a positive multiple of 32.
        let (rows, cols, nb) = (a.m.rows as u64, a.m.cols as u64, a.nb as u64);
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
        let bpr = a.m.cols / BLOCK as u32;
        let mut dispatches = Vec::with_capacity(a.m.parts.len());
        for part in &a.m.parts {
            // Every block form: each part says which (pipelines compiled on first use).
            let pipeline = self.pipeline(ctx, a.input.form(), tile_index, part.form)?;
            let grid = ctx.grid(part.rows.div_ceil(tile.rows_per_workgroup()));
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
            let bg = ctx.bind_group_at("matmul_q4f", &pipeline, &ids, &res)?;
            dispatches.push((pipeline, bg, grid));
        }
        Ok(MatmulBinding { dispatches })
    }

    /// Record the dispatches (one per matrix part).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &MatmulBinding) {
        for (pipeline, bg, (gx, gy)) in &b.dispatches {
            pass.set_pipeline(pipeline);
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
