//! nibble-gpu: Qwen3-MoE decode on the GPU through wgpu (Vulkan / Metal) and WGSL kernels.
//!
//! Int4 weights stay packed in GPU memory and are dequantised inside the kernels; a run of N
//! greedy tokens is recorded into one command buffer and the host waits once per run.
//!
//! Code map:
//! - [`context`]: device setup and buffer / pipeline / bind-group helpers.
//! - [`tensor`]: GPU layouts shared by all kernels (repacked Q4_0 matrices split across
//!   bindings, int8-quantised activations). The layouts are documented there; [`repack`]
//!   turns each file block type into its layout, and [`qform`] holds the block forms
//!   (`QForm`) and the WGSL each compiles into the kernels that read it.
//! - [`numerics`]: the activation variants of the int4 matvecs (f32 / precise int8 / int8).
//! - [`kernels`]: one kernel family per file, each with a scalar CPU reference and tests.
//! - [`testing`]: the shared GPU test harness (one serialised adapter, random inputs).
//! - [`state`]: the run-state buffer (position, token, done, step) kernels read on the GPU.
//! - [`weights`]: one-time upload of a model from a `WeightSource`.
//! - [`plan`]: activations, KV cache, bind groups; recording one step / a run of N steps.
//! - [`stream`]: greedy requests in runs, run k+1 recorded while run k executes.
//! - [`plant`]: deliberate weight corruption, to test the parity localiser.
//! - [`profile`]: per-op GPU time of one decode step in the real plan (`nibble bench --profile`).
//! - [`backend`]: [`GpuBackend`], the `nibble_backend::Backend` implementation.
//!
//! Kernel API convention: `XxxKernel::new(&ctx, params) -> Result<Self>` compiles the
//! pipeline(s) once; `bind(&self, ctx, buffers...) -> XxxBinding` creates the bind groups once;
//! `record(&self, pass, &binding)` records the dispatches with no host sync. Dynamic values
//! (position, token, done flag) live in a GPU state buffer so bindings never change between steps.

pub mod backend;
#[cfg(test)]
mod backend_tests;
pub mod bandwidth;
pub mod batch;
#[cfg(test)]
mod batch_tests;
#[cfg(test)]
mod cache_tests;
pub mod columns;
pub mod context;
pub mod kernels;
pub mod numerics;
#[cfg(test)]
mod parity_tests;
pub mod plan;
pub mod plant;
pub mod prefill;
#[cfg(test)]
mod prefill_tests;
pub mod profile;
pub mod qform;
pub mod repack;
#[cfg(test)]
mod rope_tests;
#[cfg(test)]
mod rows_tests;
#[cfg(test)]
mod sampled_tests;
pub mod state;
pub mod stream;
#[cfg(test)]
mod stream_tests;
pub mod tensor;
pub mod testing;
#[cfg(test)]
mod trace_tests;
pub mod tune;
pub mod weights;

pub use backend::{GpuBackend, GpuOptions};
pub use context::{AdapterChoice, Context, GpuError};
pub use numerics::Numerics;
