//! Matrix-vector products: int4 (repacked Q4_0) weights with activations in any
//! [`Numerics`] form (int8 via `dot4I8Packed` is the fastest: ~2.4x the f32-activation variant on
//! an H200; precise int8 is two int8 parts; f32), a plain f32 matvec (router), and the
//! activation quantiser.
//!
//! Every matvec uses 256-thread workgroups and a shared-memory reduction, so no subgroup
//! size is assumed: 8 rows x 32 lanes for int4 x int8; 8 teams x 32 lanes of 1, 2 or 4 rows each
//! for int4 x f32 (matvec_q4f.wgsl, conversion-free dequantisation, [`f32_rows_per_team`]); for f32, one row x 256 lanes when rows have at
//! least `F32_WIDE_COLS` (2048) columns (the router has only 128 rows, and 8 rows per workgroup left a
//! big GPU with 16 workgroups), else 8 rows x 32 lanes. A matrix split across bindings is one dispatch
//! per part, each writing its rows at `row_start` of the one output vector. All kernels return
//! immediately when the run state says `done`.

use crate::context::{Context, GpuError, Result};
use crate::numerics::{act_in_wgsl, act_out_wgsl, Numerics};
use crate::state::with_state;
use crate::tensor::{F32Matrix, Q4Matrix, QuantActs, BLOCK};

pub use crate::numerics::Act;

/// Rows per int4 x int8 matvec workgroup (must match `RPW` in the shader).
const ROWS_PER_WG: u32 = 8;
/// Rows per team of the int4 x f32 matvec (`R` in matvec_q4f.wgsl; 8 teams per workgroup).
pub const F32_ROWS_PER_TEAM: [u32; 3] = [1, 2, 4];

/// Rows per team for an int4 x f32 matrix of `rows` rows: more rows per team share each
/// activation load (the lm_head: ~3x on an H200 in the wgpu probe), fewer keep enough
/// workgroups in flight for the small projections.
pub fn f32_rows_per_team(rows: u32) -> u32 {
    if rows >= 32768 {
        4
    } else if rows >= 8192 {
        2
    } else {
        1
    }
}
/// Columns from which the f32 matvec gives each row a whole 256-lane workgroup (two vec4 per
/// lane at least); narrower rows use 8 rows x 32 lanes, which keeps small matrices from idling
/// most lanes (lavapipe, a CPU, pays for every one).
const F32_WIDE_COLS: u32 = 2048;

/// Bind groups (one per matrix part) of one matvec, ready to record.
pub struct MatvecBinding {
    pipeline: Which,
    dispatches: Vec<(wgpu::BindGroup, (u32, u32))>,
}

#[derive(Clone, Copy)]
enum Which {
    /// int4 x quantised activations.
    Q4(Numerics),
    /// int4 x f32 activations, index into [`F32_ROWS_PER_TEAM`].
    Q4F(usize),
    /// f32, wide (one row per workgroup) or not.
    F32(bool),
}

impl MatvecBinding {
    /// Dispatches [`MatvecKernel::record`] issues (one per matrix part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

/// Params uniform of every matvec shader: `{ rows, inner, row_start, gx }`.
fn params(
    ctx: &Context,
    rows: u32,
    inner: u32,
    row_start: u32,
    rows_per_wg: u32,
) -> Result<(wgpu::Buffer, (u32, u32))> {
    let grid = ctx.grid(rows.div_ceil(rows_per_wg));
    let buf = ctx.uniform(
        "matvec.params",
        bytemuck::cast_slice(&[rows, inner, row_start, grid.0]),
    )?;
    Ok((buf, grid))
}

fn check_out(y: &wgpu::Buffer, rows: u32, what: &str) -> Result<()> {
    if y.size() < rows as u64 * 4 {
        return Err(GpuError::Shape(format!(
            "{what}: output holds {} bytes, need {} rows",
            y.size(),
            rows
        )));
    }
    Ok(())
}

/// The matvec pipelines (compiled once per context).
pub struct MatvecKernel {
    /// One Q4 pipeline per activation form, in [`Numerics::ALL`] order (the f32 entry unused:
    /// f32 activations take `q4f`).
    q4: Vec<wgpu::ComputePipeline>,
    /// int4 x f32, one per [`F32_ROWS_PER_TEAM`].
    q4f: Vec<wgpu::ComputePipeline>,
    /// f32: 8 rows x 32 lanes, and one row x 256 lanes.
    f32: [wgpu::ComputePipeline; 2],
}

fn q4_index(n: Numerics) -> usize {
    Numerics::ALL.iter().position(|m| *m == n).unwrap_or(0)
}

impl MatvecKernel {
    pub fn new(ctx: &Context) -> Result<MatvecKernel> {
        let src = |s: &str| with_state(s);
        let body = include_str!("../shaders/matvec_q4.wgsl");
        let q4 = Numerics::ALL
            .into_iter()
            .map(|n| {
                let label = format!("matvec_q4.{n}");
                ctx.compute(
                    &label,
                    &src(&format!("{}{body}", act_in_wgsl(n, 2, 3))),
                    "main",
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let f32 = |rpw: u32| {
            let consts = format!("const RPW: u32 = {rpw}u;\nconst T: u32 = {}u;\n", 256 / rpw);
            ctx.compute(
                "matvec_f32",
                &src(&format!(
                    "{consts}{}",
                    include_str!("../shaders/matvec_f32.wgsl")
                )),
                "main",
            )
        };
        let q4f = F32_ROWS_PER_TEAM
            .iter()
            .map(|r| {
                ctx.compute(
                    &format!("matvec_q4f.r{r}"),
                    &src(&format!(
                        "{}const R: u32 = {r}u;\n{}",
                        act_in_wgsl(Numerics::F32, 2, 3),
                        include_str!("../shaders/matvec_q4f.wgsl")
                    )),
                    "main",
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MatvecKernel {
            q4,
            q4f,
            f32: [f32(8)?, f32(1)?],
        })
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
        self.bind_q4_with(ctx, m, x, y, state, f32_rows_per_team(m.rows))
    }

    /// [`Self::bind_q4`] with the f32 form's rows per team chosen (one of
    /// [`F32_ROWS_PER_TEAM`]; ignored for quantised activations). For tests and benchmarks.
    pub fn bind_q4_with(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: Act<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
        rows_per_team: u32,
    ) -> Result<MatvecBinding> {
        let ri = F32_ROWS_PER_TEAM
            .iter()
            .position(|r| *r == rows_per_team)
            .ok_or_else(|| {
                GpuError::Shape(format!(
                    "matvec_q4: {rows_per_team} rows per team (expected one of {F32_ROWS_PER_TEAM:?})"
                ))
            })?;
        let which = match x.numerics() {
            Numerics::F32 => Which::Q4F(ri),
            n => Which::Q4(n),
        };
        let rows_per_wg = match which {
            Which::Q4F(_) => 8 * rows_per_team,
            _ => ROWS_PER_WG,
        };
        check_out(y, m.rows, "matvec_q4")?;
        let bad = match x {
            Act::Int8(a) => a.n != m.cols,
            Act::F32(_) => x.len() < m.cols as u64,
        };
        if bad {
            return Err(GpuError::Shape(format!(
                "matvec_q4: {} activations for {} columns",
                x.len(),
                m.cols
            )));
        }
        let bpr = m.cols / BLOCK as u32;
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let (p, grid) = params(ctx, part.rows, bpr, part.row_start, rows_per_wg)?;
            let mut entries = vec![
                (0, part.qs.as_entire_binding()),
                (1, part.scales.as_entire_binding()),
                (4, y.as_entire_binding()),
                (5, p.as_entire_binding()),
                (6, state.as_entire_binding()),
            ];
            entries.extend(x.entries(2, 3));
            let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
            let bg = ctx.bind_group_at("matvec_q4", self.pipeline(which), &ids, &res)?;
            dispatches.push((bg, grid));
        }
        Ok(MatvecBinding {
            pipeline: which,
            dispatches,
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
        check_out(y, m.rows, "matvec_f32")?;
        if x.size() < m.cols as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "matvec_f32: x holds {} bytes for {} columns",
                x.size(),
                m.cols
            )));
        }
        let wide = m.cols >= F32_WIDE_COLS;
        let rpw = if wide { 1 } else { 8 };
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let (p, grid) = params(ctx, part.rows, m.cols / 4, part.row_start, rpw)?;
            let bg = ctx.bind_group(
                "matvec_f32",
                &self.f32[wide as usize],
                &[
                    part.w.as_entire_binding(),
                    x.as_entire_binding(),
                    y.as_entire_binding(),
                    p.as_entire_binding(),
                    state.as_entire_binding(),
                ],
            )?;
            dispatches.push((bg, grid));
        }
        Ok(MatvecBinding {
            pipeline: Which::F32(wide),
            dispatches,
        })
    }

    fn pipeline(&self, w: Which) -> &wgpu::ComputePipeline {
        match w {
            Which::Q4(n) => &self.q4[q4_index(n)],
            Which::Q4F(ri) => &self.q4f[ri],
            Which::F32(wide) => &self.f32[wide as usize],
        }
    }

    /// Record the dispatches (one per matrix part).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &MatvecBinding) {
        pass.set_pipeline(self.pipeline(b.pipeline));
        for (bg, (gx, gy)) in &b.dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, 1);
        }
    }
}

/// The activation quantiser: f32 `x[n]` -> [`QuantActs`] (one thread per block of 32).
pub struct QuantizeKernel {
    /// Plain and precise int8 outputs.
    plain: wgpu::ComputePipeline,
    precise: wgpu::ComputePipeline,
}

/// Bind group of one quantisation.
pub struct QuantizeBinding {
    precise: bool,
    bg: wgpu::BindGroup,
    grid: (u32, u32),
}

impl QuantizeKernel {
    pub fn new(ctx: &Context) -> Result<QuantizeKernel> {
        let src = |n: Numerics| {
            let body = include_str!("../shaders/quantize.wgsl");
            with_state(&format!("{}{body}", act_out_wgsl(n, 1, 2)))
        };
        Ok(QuantizeKernel {
            plain: ctx.compute("quantize", &src(Numerics::Int8), "main")?,
            precise: ctx.compute("quantize.precise", &src(Numerics::PreciseInt8), "main")?,
        })
    }

    /// Quantise the first `out.n` values of `x` into `out`.
    pub fn bind(
        &self,
        ctx: &Context,
        x: &wgpu::Buffer,
        out: &QuantActs,
        state: &wgpu::Buffer,
    ) -> Result<QuantizeBinding> {
        if x.size() < out.n as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "quantize: x holds {} bytes for {} values",
                x.size(),
                out.n
            )));
        }
        let blocks = out.n / BLOCK as u32;
        let grid = ctx.grid(blocks.div_ceil(64));
        let p = ctx.uniform(
            "quantize.params",
            bytemuck::cast_slice(&[blocks, grid.0, 0, 0]),
        )?;
        let pipe = if out.precise {
            &self.precise
        } else {
            &self.plain
        };
        let bg = ctx.bind_group(
            "quantize",
            pipe,
            &[
                x.as_entire_binding(),
                out.q.as_entire_binding(),
                out.s.as_entire_binding(),
                p.as_entire_binding(),
                state.as_entire_binding(),
            ],
        )?;
        Ok(QuantizeBinding {
            precise: out.precise,
            bg,
            grid,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &QuantizeBinding) {
        pass.set_pipeline(if b.precise {
            &self.precise
        } else {
            &self.plain
        });
        pass.set_bind_group(0, &b.bg, &[]);
        pass.dispatch_workgroups(b.grid.0, b.grid.1, 1);
    }
}

/// Scalar reference of the Q4 x int8 matvec: exactly the integer arithmetic of the kernel, in f64.
/// `w` is ggml Q4_0 `[rows, cols]`, `(q, s)` from [`crate::tensor::quantize_acts_ref`].
pub fn matvec_q4_i8_ref(w: &[u8], rows: usize, cols: usize, q: &[i8], s: &[[f32; 2]]) -> Vec<f32> {
    let bpr = cols / BLOCK;
    (0..rows)
        .map(|r| {
            let mut acc = 0f64;
            for b in 0..bpr {
                let blk = &w[(r * bpr + b) * 18..(r * bpr + b + 1) * 18];
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                let mut dot = 0i64;
                for j in 0..16 {
                    dot += (blk[2 + j] & 15) as i64 * q[b * 32 + j] as i64;
                    dot += (blk[2 + j] >> 4) as i64 * q[b * 32 + j + 16] as i64;
                }
                acc += d * (s[b][0] as f64 * dot as f64 - 8.0 * s[b][1] as f64);
            }
            acc as f32
        })
        .collect()
}

/// Scalar reference of an f32 matvec over already-dequantised weights `[rows, cols]`, in f64.
pub fn matvec_f32_ref(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}
