//! Greedy argmax over the logits on the GPU, feeding the next step without a host round trip.
//!
//! Two dispatches per step in both forms: `partial` (one workgroup per 2048 logits, and per
//! column) and `finish` (one workgroup over the partials), which also advances the run:
//! next token, output id, `pos + 1`, `step + 1`, `done` on EOS or after the run's last step.
//! Ties go to the lowest index and NaN never wins over a number, exactly as [`argmax_ref`].
//!
//! - Single token ([`ArgmaxKernel::bind`]): `logits [V]`, the run [`crate::state::RunState`]
//!   advanced, `out_tokens [max_steps]`.
//! - Columns ([`ArgmaxKernel::bind_cols`]): `logits [nb, V]` (column `c` at `c * V`), each live
//!   column of the [`crate::columns`] buffer advanced on its own (`out_tokens [nb, cap]`, column
//!   `c`'s id of its step `s` at `c * cap + s`), and the shared run state's `done` set iff every
//!   column `< nb` is done, so column-agnostic kernels stop too. `finish` does all columns in
//!   one workgroup, so the run-wide flag needs no third dispatch.

use crate::columns::{Col, COLUMNS_WGSL};
use crate::context::{Context, GpuError, Result};
use crate::kernels::embed::check_cols;
use crate::state::with_state;

/// Logits reduced by one `partial` workgroup (must match `CHUNK` in argmax.wgsl).
const CHUNK: u32 = 256 * 8;

pub struct ArgmaxKernel {
    partial: wgpu::ComputePipeline,
    finish: wgpu::ComputePipeline,
    partial_cols: wgpu::ComputePipeline,
    finish_cols: wgpu::ComputePipeline,
}

/// What one argmax reads and writes.
pub struct ArgmaxArgs<'a> {
    /// `[n]` f32 logits.
    pub logits: &'a wgpu::Buffer,
    pub n: u32,
    /// The run state (read-write).
    pub state: &'a wgpu::Buffer,
    /// `[max_steps]` u32: the id chosen at step `s` lands in `out_tokens[s]`.
    pub out_tokens: &'a wgpu::Buffer,
    /// Steps of one run: `done` is set after this many.
    pub max_steps: u32,
    /// Ids that end generation.
    pub eos: &'a [u32],
}

/// What one column argmax reads and writes.
pub struct ArgmaxColsArgs<'a> {
    /// `[nb, n]` f32 logits, column `c` at `c * n`.
    pub logits: &'a wgpu::Buffer,
    /// Logits per column (the vocabulary).
    pub n: u32,
    /// Columns, `1..=MAX_COLUMNS`.
    pub nb: u32,
    /// The [`crate::columns`] buffer (read-write: token, pos, step, done of each column).
    pub cols: &'a wgpu::Buffer,
    /// The run state shared by the columns (read-write: only `done` is written).
    pub state: &'a wgpu::Buffer,
    /// `[nb, cap]` u32: column `c`'s id of its step `s` lands in `out_tokens[c * cap + s]`.
    pub out_tokens: &'a wgpu::Buffer,
    /// Ids per column in `out_tokens` (at least `max_steps`).
    pub cap: u32,
    /// Steps of one run for every column: a column is done after this many of its own steps.
    pub max_steps: u32,
    /// Ids that end generation (shared by all columns).
    pub eos: &'a [u32],
}

pub struct ArgmaxBinding {
    partial: wgpu::BindGroup,
    finish: wgpu::BindGroup,
    nparts: u32,
    n: u32,
    /// Columns (partial grid y); 1 for the single form.
    nb: u32,
    columns: bool,
    /// `{ n, nparts, neos, max_steps, nb, cap, 0, 0 }`, the first four rewritten per run by
    /// [`ArgmaxBinding::set_run`].
    params: wgpu::Buffer,
    eos: wgpu::Buffer,
    eos_capacity: usize,
    /// Ids per column in `out_tokens`.
    out_capacity: u32,
}

impl ArgmaxBinding {
    /// Change the run length and EOS ids for the next submission (at most as many ids as the
    /// binding was created with, and at most the `out_tokens` capacity in steps).
    pub fn set_run(&self, ctx: &Context, max_steps: u32, eos: &[u32]) -> Result<()> {
        if eos.len() > self.eos_capacity || max_steps > self.out_capacity {
            return Err(GpuError::Shape(format!(
                "argmax run: {} EOS ids (capacity {}), {max_steps} steps (capacity {})",
                eos.len(),
                self.eos_capacity,
                self.out_capacity
            )));
        }
        if !eos.is_empty() {
            ctx.write(&self.eos, 0, bytemuck::cast_slice(eos));
        }
        ctx.write(
            &self.params,
            0,
            bytemuck::cast_slice(&[self.n, self.nparts, eos.len() as u32, max_steps]),
        );
        Ok(())
    }

    /// The run parameters (`Params` of argmax.wgsl: run length, EOS count) and the EOS ids,
    /// which the GPU sampler (sample.rs) shares so [`ArgmaxBinding::set_run`] serves both.
    pub fn run_buffers(&self) -> (&wgpu::Buffer, &wgpu::Buffer) {
        (&self.params, &self.eos)
    }

    /// Dispatches [`ArgmaxKernel::record`] issues per step: always 2 (`partial` over
    /// `(ceil(n / 2048), nb)` workgroups, then `finish` in one workgroup).
    pub fn dispatch_count(&self) -> usize {
        2
    }
}

/// Buffers and sizes common to both forms (`cols` only for the column form).
struct Common<'a> {
    logits: &'a wgpu::Buffer,
    n: u32,
    nb: u32,
    state: &'a wgpu::Buffer,
    cols: Option<&'a wgpu::Buffer>,
    out_tokens: &'a wgpu::Buffer,
    cap: u32,
    max_steps: u32,
    eos: &'a [u32],
}

impl ArgmaxKernel {
    pub fn new(ctx: &Context) -> Result<ArgmaxKernel> {
        let src = with_state(&format!(
            "{COLUMNS_WGSL}\n{}\n{}",
            include_str!("../shaders/argmax.wgsl"),
            include_str!("../shaders/argmax_cols.wgsl")
        ));
        let m = ctx.module("argmax", &src)?;
        Ok(ArgmaxKernel {
            partial: ctx.pipeline("argmax.partial", &m, "partial")?,
            finish: ctx.pipeline("argmax.finish", &m, "finish")?,
            partial_cols: ctx.pipeline("argmax.partial_cols", &m, "partial_cols")?,
            finish_cols: ctx.pipeline("argmax.finish_cols", &m, "finish_cols")?,
        })
    }

    pub fn bind(&self, ctx: &Context, a: &ArgmaxArgs<'_>) -> Result<ArgmaxBinding> {
        let cap = (a.out_tokens.size() / 4).min(u32::MAX as u64) as u32;
        self.bind_common(
            ctx,
            &Common {
                logits: a.logits,
                n: a.n,
                nb: 1,
                state: a.state,
                cols: None,
                out_tokens: a.out_tokens,
                cap,
                max_steps: a.max_steps,
                eos: a.eos,
            },
        )
    }

    /// Column form: see the module docs.
    pub fn bind_cols(&self, ctx: &Context, a: &ArgmaxColsArgs<'_>) -> Result<ArgmaxBinding> {
        check_cols(a.cols, a.nb, "argmax")?;
        if a.max_steps > a.cap {
            return Err(GpuError::Shape(format!(
                "argmax: {} steps per column, but out_tokens holds {} per column",
                a.max_steps, a.cap
            )));
        }
        self.bind_common(
            ctx,
            &Common {
                logits: a.logits,
                n: a.n,
                nb: a.nb,
                state: a.state,
                cols: Some(a.cols),
                out_tokens: a.out_tokens,
                cap: a.cap,
                max_steps: a.max_steps,
                eos: a.eos,
            },
        )
    }

    fn bind_common(&self, ctx: &Context, a: &Common<'_>) -> Result<ArgmaxBinding> {
        let nb = a.nb as u64;
        if a.n == 0
            || a.logits.size() < nb * a.n as u64 * 4
            || a.out_tokens.size() < nb * a.cap as u64 * 4
            || a.out_tokens.size() < a.max_steps as u64 * 4
        {
            return Err(GpuError::Shape(format!(
                "argmax: n = {}, {} columns of {} ids, max_steps = {}: logits or out_tokens too small",
                a.n, a.nb, a.cap, a.max_steps
            )));
        }
        let nparts = a.n.div_ceil(CHUNK);
        if nparts > ctx.limits.max_compute_workgroups_per_dimension {
            return Err(GpuError::Shape(format!(
                "argmax: {} logits is too many",
                a.n
            )));
        }
        let part = ctx.storage("argmax.part", nb * nparts as u64 * 8)?;
        let eos_words: Vec<u32> = if a.eos.is_empty() {
            vec![u32::MAX]
        } else {
            a.eos.to_vec()
        };
        let eos = ctx.storage_init("argmax.eos", bytemuck::cast_slice(&eos_words))?;
        let p = ctx.uniform(
            "argmax.params",
            bytemuck::cast_slice(&[
                a.n,
                nparts,
                a.eos.len() as u32,
                a.max_steps,
                a.nb,
                a.cap,
                0,
                0,
            ]),
        )?;
        let mut entries = vec![
            a.logits.as_entire_binding(),
            part.as_entire_binding(),
            a.state.as_entire_binding(),
            a.out_tokens.as_entire_binding(),
            eos.as_entire_binding(),
            p.as_entire_binding(),
        ];
        // Derived layouts hold only what an entry point uses: `partial` has no out_tokens or eos,
        // `finish` no logits; `partial_cols` reads the columns instead of the state.
        let (partial, finish, ip, ifin): (_, _, &[u32], &[u32]) = match a.cols {
            None => (&self.partial, &self.finish, &[0, 1, 2, 5], &[1, 2, 3, 4, 5]),
            Some(cols) => {
                entries.push(cols.as_entire_binding());
                (
                    &self.partial_cols,
                    &self.finish_cols,
                    &[0, 1, 5, 6],
                    &[1, 2, 3, 4, 5, 6],
                )
            }
        };
        let pick = |ix: &[u32]| {
            ix.iter()
                .map(|i| entries[*i as usize].clone())
                .collect::<Vec<_>>()
        };
        Ok(ArgmaxBinding {
            n: a.n,
            nb: a.nb,
            columns: a.cols.is_some(),
            eos_capacity: eos_words.len(),
            out_capacity: a.cap,
            partial: ctx.bind_group_at("argmax.partial", partial, ip, &pick(ip))?,
            finish: ctx.bind_group_at("argmax.finish", finish, ifin, &pick(ifin))?,
            nparts,
            params: p,
            eos,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &ArgmaxBinding) {
        let (partial, finish) = if b.columns {
            (&self.partial_cols, &self.finish_cols)
        } else {
            (&self.partial, &self.finish)
        };
        pass.set_pipeline(partial);
        pass.set_bind_group(0, &b.partial, &[]);
        pass.dispatch_workgroups(b.nparts, b.nb, 1);
        pass.set_pipeline(finish);
        pass.set_bind_group(0, &b.finish, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
}

/// Scalar reference (the rule of `nibble_backend::argmax`): index of the largest value, the
/// lowest index on ties, NaN skipped (all NaN gives 0).
pub fn argmax_ref(x: &[f32]) -> u32 {
    let mut best: Option<(u32, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i as u32, v));
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// Scalar reference of one column argmax step: every live column `c` of `cols` takes
/// [`argmax_ref`] of `logits[c * n ..][..n]` as its next token, writes it to
/// `out[c * cap + step]` (while `step < max_steps`) and advances `pos`, `step` and `done` as
/// the kernel does. Returns the run state's `done`: whether every column is done.
pub fn argmax_cols_ref(
    logits: &[f32],
    n: usize,
    cols: &mut [Col],
    out: &mut [u32],
    cap: usize,
    max_steps: u32,
    eos: &[u32],
) -> bool {
    for (c, col) in cols.iter_mut().enumerate() {
        if col.done != 0 {
            continue;
        }
        let tok = argmax_ref(&logits[c * n..(c + 1) * n]);
        if col.step < max_steps {
            out[c * cap + col.step as usize] = tok;
        }
        col.token = tok;
        col.pos += 1;
        col.step += 1;
        col.done = (col.step >= max_steps || eos.contains(&tok)) as u32;
    }
    cols.iter().all(|c| c.done != 0)
}
