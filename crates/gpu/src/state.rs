//! The run-state buffer: the dynamic values of a decode run that kernels read on the GPU, so
//! bind groups are created once and reused by every step (`shaders/state.wgsl`).
//!
//! Ownership: the host writes it once before a run; afterwards only the final argmax kernel
//! writes it (next token, `pos + 1`, `step + 1`, `done` on EOS or when the run's steps are
//! used up). Every decode kernel returns at once when `done != 0`, which turns the remaining
//! recorded steps of a run into no-ops.

use crate::context::{Context, Result};

/// WGSL declaration of [`RunState`], prepended to every kernel that reads it.
pub const STATE_WGSL: &str = include_str!("shaders/state.wgsl");

/// Mirror of the WGSL `State` struct.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RunState {
    /// Position of `token` in the sequence (its KV-cache row).
    pub pos: u32,
    /// The token being processed by the current step.
    pub token: u32,
    /// Non-zero once the run has ended (EOS or last step).
    pub done: u32,
    /// Steps completed in this run (index into the run's output ids).
    pub step: u32,
}

impl RunState {
    /// A state buffer holding `self`.
    pub fn buffer(&self, ctx: &Context) -> Result<wgpu::Buffer> {
        ctx.storage_init("state", bytemuck::bytes_of(self))
    }

    /// Read a state buffer back.
    pub fn read(ctx: &Context, buf: &wgpu::Buffer) -> Result<RunState> {
        let b = ctx.read(buf, 0, std::mem::size_of::<RunState>() as u64)?;
        Ok(bytemuck::pod_read_unaligned(&b))
    }
}

/// `STATE_WGSL` followed by `body`: the source of one kernel.
pub fn with_state(body: &str) -> String {
    format!("{STATE_WGSL}\n{body}")
}
