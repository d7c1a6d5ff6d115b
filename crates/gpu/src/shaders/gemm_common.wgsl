// Shared by the prefill GEMM kernels (gemm_q4.wgsl and gemm_coop.rs): their parameters, the
// activation bindings and the tile a workgroup works on (from the form's `gm_tile`).
// xrows / yrows: the rows X and Y hold (gemm.rs checks the buffers); every row index is clamped
// below them, so no plan or dims value can send a read or write past the buffers (the int4
// forms run without runtime bounds checks, gemm.rs `GemmKernel::pipeline`).
// ks, splits: K in `splits` (>= 1) slices of `ks` blocks, one per grid z (the `=` dense forms
// only: the router, a short chunk's qkv and o-proj; the expert forms and `+=` have one split of
// bpr blocks); split z's sums go to Y rows z yrows .. (z + 1) yrows, and their reader adds them
// up (moe_prefill.wgsl `route`, gemm_reduce.rs).
struct Params {
    n: u32, bpr: u32, xs4: u32, ys: u32, ycol: u32, e_lo: u32, e_hi: u32, xrows: u32,
    yrows: u32, ks: u32, splits: u32, p11: u32,
};
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;  // [rows of X, xs4]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;  // [rows of Y, ys]
@group(0) @binding(4) var<uniform> p: Params;
@group(0) @binding(5) var<uniform> dims: Dims;

// Tokens m0 .. mend of the tile (list positions for the expert forms); weight row offset wrow.
struct Tile { ok: bool, m0: u32, mend: u32, wrow: u32, list0: u32 };
