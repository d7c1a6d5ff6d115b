//! Embedding lookup: dequantise a row of the Q4_0 embedding `[V, H]` into the residual stream.
//! The token id is read on the GPU, so the bind group is made once and a run never syncs with
//! the host. A matrix split across bindings is one dispatch per part; only the part holding the
//! token writes.
//!
//! Two forms share one shader (`shaders/embed.wgsl`):
//! - single token: `h[H] = table[state.token]` ([`EmbedKernel::bind`]);
//! - columns: `h[c] = table[cols[c].token]` for every column `c < nb` that is not done, with
//!   `h [nb, H]` (column `c` at `c * H`), grid `(H/32/64, nb)` ([`EmbedKernel::bind_cols`]).
//!
//! A token id outside the table is skipped (nothing read, nothing written).
//!
//! A kernel is compiled for one block form ([`EmbedKernel::new_for`]): Q4_0, or the affine
//! form of MLX checkpoints (`tensor.rs`), which it dequantises as the reference does
//! (`s·q + b`); binding a table of the other form is an error.

use crate::columns::{Col, COLUMNS_WGSL, MAX_COLUMNS};
use crate::context::{Context, GpuError, Result};
use crate::state::with_state;
use crate::tensor::{Q4Matrix, QForm, BLOCK};

pub struct EmbedKernel {
    /// The block form of the tables it reads.
    form: QForm,
    /// One token from the run state.
    pipeline: wgpu::ComputePipeline,
    /// One token per column.
    cols: wgpu::ComputePipeline,
}

/// Bind groups (one per embedding part) and the grid.
pub struct EmbedBinding {
    dispatches: Vec<wgpu::BindGroup>,
    groups: u32,
    /// Columns (grid y): 1 for the single-token form.
    nb: u32,
    columns: bool,
}

impl EmbedBinding {
    /// Dispatches [`EmbedKernel::record`] issues (one per embedding part).
    pub fn dispatch_count(&self) -> usize {
        self.dispatches.len()
    }
}

impl EmbedKernel {
    /// The kernel for Q4_0 tables.
    pub fn new(ctx: &Context) -> Result<EmbedKernel> {
        Self::new_for(ctx, QForm::Q4_0)
    }

    /// The kernel for tables of the given form.
    pub fn new_for(ctx: &Context, form: QForm) -> Result<EmbedKernel> {
        let src = with_state(&format!(
            "{COLUMNS_WGSL}\n{}{}",
            form.wgsl(),
            include_str!("../shaders/embed.wgsl")
        ));
        let m = ctx.module("embed", &src)?;
        Ok(EmbedKernel {
            form,
            pipeline: ctx.pipeline("embed", &m, "main")?,
            cols: ctx.pipeline("embed.cols", &m, "main_cols")?,
        })
    }

    /// `h[0..cols] = dequant(table[state.token])`.
    pub fn bind(
        &self,
        ctx: &Context,
        table: &Q4Matrix,
        h: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<EmbedBinding> {
        self.bind_parts(ctx, table, h, state, 1, false)
    }

    /// Column form: `h[c * H ..][..H] = dequant(table[cols[c].token])` for each column
    /// `c < nb` whose `done` is 0. `h` is `[nb, H]` f32, `cols` a [`crate::columns`] buffer.
    pub fn bind_cols(
        &self,
        ctx: &Context,
        table: &Q4Matrix,
        h: &wgpu::Buffer,
        cols: &wgpu::Buffer,
        nb: u32,
    ) -> Result<EmbedBinding> {
        check_cols(cols, nb, "embed")?;
        self.bind_parts(ctx, table, h, cols, nb, true)
    }

    /// `tokens` is the state buffer (single form) or the column buffer (column form).
    fn bind_parts(
        &self,
        ctx: &Context,
        table: &Q4Matrix,
        h: &wgpu::Buffer,
        tokens: &wgpu::Buffer,
        nb: u32,
        columns: bool,
    ) -> Result<EmbedBinding> {
        if table.form() != Some(self.form) {
            return Err(GpuError::Shape(format!(
                "embed: the kernel reads {} tables, this one is {}",
                self.form.name(),
                table.form_names()
            )));
        }
        if h.size() < nb as u64 * table.cols as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "embed: h holds {} bytes for {nb} x {} values",
                h.size(),
                table.cols
            )));
        }
        let bpr = table.cols / BLOCK as u32;
        let (pipeline, token_binding) = if columns {
            (&self.cols, 5)
        } else {
            (&self.pipeline, 4)
        };
        let dispatches = table
            .parts
            .iter()
            .map(|part| {
                let p = ctx.uniform(
                    "embed.params",
                    bytemuck::cast_slice(&[part.rows, bpr, part.row_start, 0]),
                )?;
                ctx.bind_group_at(
                    "embed",
                    pipeline,
                    &[0, 1, 2, 3, token_binding],
                    &[
                        part.qs.as_entire_binding(),
                        part.scales.as_entire_binding(),
                        h.as_entire_binding(),
                        p.as_entire_binding(),
                        tokens.as_entire_binding(),
                    ],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(EmbedBinding {
            dispatches,
            groups: bpr.div_ceil(64),
            nb,
            columns,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &EmbedBinding) {
        self.record_n(pass, b, b.nb);
    }

    /// [`Self::record`] over the first `nb` columns only (`nb <= ` the bound count; the prefill
    /// plan's last chunk is shorter than the rest).
    pub fn record_n(&self, pass: &mut wgpu::ComputePass<'_>, b: &EmbedBinding, nb: u32) {
        let nb = nb.min(b.nb);
        pass.set_pipeline(if b.columns {
            &self.cols
        } else {
            &self.pipeline
        });
        for bg in &b.dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(b.groups, nb, 1);
        }
    }
}

/// `nb` in `1..=65535` (the grid dimension) and `cols` holding at least `max(nb, MAX_COLUMNS)`
/// columns (the multi-stream plans bind `[MAX_COLUMNS]`, the prefill plan one per chunk token).
pub(crate) fn check_cols(cols: &wgpu::Buffer, nb: u32, what: &str) -> Result<()> {
    let need = (MAX_COLUMNS.max(nb as usize) * std::mem::size_of::<Col>()) as u64;
    if nb == 0 || nb > 65535 || cols.size() < need {
        return Err(GpuError::Shape(format!(
            "{what}: {nb} columns (1..=65535) with a column buffer of {} bytes (need {need})",
            cols.size()
        )));
    }
    Ok(())
}
