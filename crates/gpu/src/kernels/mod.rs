//! WGSL kernels, one family per file. Every file holds the kernel, its scalar CPU reference and
//! its lavapipe tests; the WGSL sources live in `src/shaders/`.

pub mod attention;
pub mod matvec;
#[cfg(test)]
mod matvec_tests;
pub mod moe;
pub mod argmax;
pub mod embed;
pub mod norm;
#[cfg(test)]
mod step_tests;
