//! WGSL kernels, one family per file. Every file holds the kernel, its scalar CPU reference and
//! its lavapipe tests; the WGSL sources live in `src/shaders/`.

pub mod advance;
#[cfg(test)]
mod affine_tests;
pub mod argmax;
pub mod attention;
pub mod attention_prefill;
#[cfg(test)]
mod cols_tests;
pub mod embed;
pub mod gemm;
pub mod gemm_coop;
pub mod gemm_reduce;
mod gemm_wgsl;
pub mod matmul;
#[cfg(test)]
mod matmul_tests;
pub mod matvec;
#[cfg(test)]
mod matvec_norm_tests;
#[cfg(test)]
mod matvec_tests;
mod matvec_wgsl;
#[cfg(test)]
mod mixed_tests;
pub mod moe;
pub mod moe_prefill;
pub mod norm;
#[cfg(test)]
mod numerics_tests;
#[cfg(test)]
mod ordering_tests;
#[cfg(test)]
mod q8_tests;
pub mod qkv_attention;
pub mod quantize;
pub mod router_cols;
pub mod router_fold;
pub mod sample;
#[cfg(test)]
mod sample_tests;
#[cfg(test)]
mod step_tests;
#[cfg(test)]
mod unchecked_tests;
pub mod warm;
