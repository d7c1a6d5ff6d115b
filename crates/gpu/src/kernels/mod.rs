//! WGSL kernels, one family per file. Every file holds the kernel, its scalar CPU reference and
//! its lavapipe tests; the WGSL sources live in `src/shaders/`.
