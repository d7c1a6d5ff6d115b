// int4 (repacked Q4_0, tensor.rs layout) x f32 activations -> f32, one matrix part, R rows per
// team (or two parts in two forms: matvec_wgsl.rs q4f_pair_body). The rows themselves are
// `mv_rows` (matvec_q4f_rows.wgsl, put at ROWS_FNS with `const RED_R`, the most rows per team
// of its copies; ROWS_CALL calls it for the dispatch's part or parts). Prepended by the host: state.wgsl, `dq_block` (numerics.rs F32_DEQ), `const R: u32`,
// `const ACC: bool` (add into y: the o-proj's residual add) and the input form: either the plain
// f32 vector (`act_x` at binding 2 read from global memory, `nol_stage` a no-op) or the
// norm-on-load form (matvec.rs NORM_ON_LOAD: binding 2 is the residual stream h, binding 3 the
// RMSNorm weight, and `nol_stage` writes h / rms(h) * w into shared memory first: the RMSNorm
// dispatch before this matvec is gone, every workgroup recomputes the 2-8 KiB reduction).
// 256 threads = NT teams x T lanes (T set by the host: 32, or a lane per block for rows
// of fewer than 32 blocks, matvec.rs lanes_per_row); team t owns rows [R t, R t + R) of the
// workgroup's NT R rows.
// First every workgroup stages the input vector (normalised, in the Norm form) into shared memory;
// then lane l takes blocks l, l + T, ...: one 16-byte weight load per block and lane (wide loads
// keep enough bytes in flight), and the block's 32 activations from shared memory, used for the
// team's R rows. The staging is swizzled (vec4 k of block b at slot 8b + (k + b) % 8) so the 8
// lanes of a memory phase reading vec4 k of 8 consecutive blocks hit 8 different bank groups;
// unswizzled, or straight from global memory, those reads stride 128 bytes across lanes (32
// cache lines or a 32-way bank conflict per instruction), which is what limited the f32 matvec.
// Partials meet in shared memory; one barrier, then one thread per row adds its team's T lanes
// (no subgroup-size assumption). Each row's partials sit TP = T + 1 words apart, so the NT R
// threads reading partial j of their rows hit different banks (at a stride of 32 words they
// all hit one: an 8R-way conflict per load on NVIDIA's 32 banks at T = 32); the sums and
// their order are unchanged. The input snippet also declares `extra_rows(wg, li) -> bool`
// (false, except for the folded router's workgroups), `nol_scale(eps, n4)` (the late norm's
// 1 / rms, else 1.0) and `xblock(b)`, block b of the staged input
// in the form `dq_block` takes: 8 vec4<f32> (f32 numerics), or a `BfpBlock` (bfp24: the staging
// turned the input into block floating point, numerics.rs BFP_DOT).
struct Params { rows: u32, bpr: u32, row_start: u32, gx: u32, eps: f32, p1: u32, p2: u32, p3: u32 };
@group(0) @binding(4) var<storage, read_write> y: array<f32>;       // [row_start + rows ..]
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read> state: State;

const T: u32 = LANES_PER_ROWu;
const NT: u32 = 256u / T;
const TP: u32 = T + 1u;
var<workgroup> red: array<f32, NT * RED_R * TP>; // [NT R rows, TP] per-lane partials (lane < T)

//ROWS_FNS

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Uniform across the dispatch, so no barrier is skipped by only part of a workgroup.
    if (state.done != 0u) { return; }
    // Workgroups past the matrix's (the folded router's rows, matvec.rs Fused::Router; the
    // warm workgroups, Fused::NormWarm) run `extra_rows` instead; the test is uniform per
    // workgroup.
    if (extra_rows(wid.x + wid.y * p.gx, li)) { return; }
    //ROWS_CALL
    // TAIL: the qkv + attention form (qkv_attention.rs) calls its attention tail here; every
    // other form leaves this comment.
}
