//! Per-column state of a multi-column run: `B` tokens processed by every dispatch at once
//! (multi-stream decode: `B` independent sequences; batched prefill: `B` consecutive prompt
//! tokens of one sequence). Column `c` of every `[B, ...]` activation buffer belongs to
//! `cols[c]`. The host writes the columns before a run; afterwards only the per-column argmax
//! writes them (token, `pos + 1`, `step + 1`, `done`). Kernels skip done columns; the shared
//! [`crate::state::RunState`] of the run carries `done = 1` once every column is done, so
//! column-agnostic kernels (the matmuls) become no-ops too.

use crate::context::{Context, Result};

/// WGSL declaration of [`Col`], prepended to the multi-column kernels.
pub const COLUMNS_WGSL: &str = include_str!("shaders/columns.wgsl");

/// Most columns of one run (register and shared-memory budgets of the kernels are sized for it).
pub const MAX_COLUMNS: usize = 8;

/// Mirror of the WGSL `Col` struct (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Col {
    /// Position of `token` in its sequence (its KV-cache row within the slot).
    pub pos: u32,
    /// The token this column processes now.
    pub token: u32,
    /// Non-zero: the column is idle (finished, or unused in this run).
    pub done: u32,
    /// Steps this column completed in the run (index into its output ids).
    pub step: u32,
    /// KV-cache slot (sequence) of the column.
    pub slot: u32,
    pub pad: [u32; 3],
}

impl Col {
    /// An active column: `token` at `pos` of the sequence in `slot`.
    pub fn active(token: u32, pos: u32, slot: u32) -> Col {
        Col {
            pos,
            token,
            slot,
            ..Col::default()
        }
    }

    /// An idle column.
    pub fn idle() -> Col {
        Col {
            done: 1,
            ..Col::default()
        }
    }
}

/// A `[MAX_COLUMNS]` column buffer holding `cols` (idle past them).
pub fn buffer(ctx: &Context, cols: &[Col]) -> Result<wgpu::Buffer> {
    ctx.storage_init("columns", bytemuck::cast_slice(&padded(cols)))
}

/// Overwrite a column buffer with `cols` (idle past them).
pub fn write(ctx: &Context, buf: &wgpu::Buffer, cols: &[Col]) {
    ctx.write(buf, 0, bytemuck::cast_slice(&padded(cols)));
}

/// Read a column buffer back.
pub fn read(ctx: &Context, buf: &wgpu::Buffer) -> Result<Vec<Col>> {
    let b = ctx.read(buf, 0, (MAX_COLUMNS * std::mem::size_of::<Col>()) as u64)?;
    Ok(bytemuck::pod_collect_to_vec(&b))
}

fn padded(cols: &[Col]) -> Vec<Col> {
    let mut v: Vec<Col> = cols.iter().take(MAX_COLUMNS).copied().collect();
    v.resize(MAX_COLUMNS, Col::idle());
    v
}
