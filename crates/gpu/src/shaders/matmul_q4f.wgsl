// int4 (repacked Q4_0, tensor.rs layout) x f32 activations for up to C columns at once, one matrix
// part: Y[c, row] = W[row, :] . X[c, :] for c < p.nb <= C. Prepended by the host (matmul.rs):
// state.wgsl, `dq_lo`/`dq_hi`/`DQ_SLO`/`DQ_SHI` (numerics.rs F32_DEQ), the tile constants (`C`
// columns compiled, `R` rows per team, `L` lanes per team, `WL` of them in one warp, `KC` blocks per
// staged chunk, `RW` rows per workgroup, `CG` columns per reduction round, `RED` floats of `red`, `LP` its line stride),
// `const ACC: bool` (add into Y: the residual add) and the input form: `mm_stage(li)` (a no-op, or
// the nb RMSNorm reductions) and `mm_x(c, i)` (vec4 i of column c, normalised or not).
//
// 256 threads = 256 / L teams of L lanes; team t owns rows [R t, R t + R) of the workgroup's RW.
// Inside a warp the lanes form (32 / WL) rows x WL consecutive blocks (a team wider than a warp
// spans L / WL warps), so the WL distinct activation vec4s one shared-memory read instruction
// touches sit in distinct banks (swizzle below) and the other lanes of the warp read the same
// addresses (a broadcast): one wavefront per read, where 32 lanes on 32 blocks took four. Each
// weight row segment a warp loads is WL x 16 contiguous bytes.
//
// The blocks go by in chunks of KC (C * KC * 128 bytes = 16 KiB of staging whatever C): all 256
// threads stage the chunk's activations of the nb columns (coalesced, normalised in the Norm form),
// then lane l of a team takes blocks l, l + L, .. of the chunk. Staged vec4 k of chunk block b sits
// at slot 8 b + (k + b) % 8 of its column (the matvec's swizzle). Each weight block is loaded
// once (prefetched one block ahead, so the load of the next overlaps the math and the staging),
// dequantised once and used for all nb columns. The per-(row, column) lines are written out by the
// host (MM_SETUP, MM_NEXT, MM_BODY, MM_REDUCE) with one variable each (a{r}_{c}, q{r}_{k}l, ..):
// per-thread arrays indexed in loops may be placed in slow local memory by the driver's compiler.
//
// Per (row, column) a block's dot runs in exactly the order of `dq_block`, accumulated as the
// matvec does (`acc = fma(scale, dot, acc)`); the blocks are partitioned over L lanes (the matvec:
// 32) and the L partials summed in lane order, so a column agrees with the single-vector matvec to
// f32 rounding of the row's magnitude.
struct Params { rows: u32, bpr: u32, row_start: u32, gx: u32, eps: f32, nb: u32, y_stride: u32, cols4: u32 };
@group(0) @binding(0) var<storage, read> qs: array<QB>;             // [rows * bpr] blocks (tensor.rs QForm)
@group(0) @binding(1) var<storage, read> sc: array<SW>;             // [rows * bpr / 2] scale words (tensor.rs QForm)
@group(0) @binding(4) var<storage, read_write> y: array<f32>;       // [nb, y_stride], rows at row_start
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read> state: State;

// [C columns][KC blocks][8 vec4, swizzled] one chunk of the activations.
var<workgroup> xs: array<vec4<f32>, C * KC * 8u>;
// [CG columns][RW rows][LP = L + 1] partials of one reduction round (lines an odd stride apart:
// the adding threads read distinct banks); the norm's [C][16][17] sums first.
var<workgroup> red: array<f32, RED>;

fn scale(i: u32) -> f32 {
    return q4_coef(sc[i >> 1u], i).x;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Uniform across the dispatch, so no barrier is skipped by only part of a workgroup.
    if (state.done != 0u) { return; }
    mm_stage(li);
    let warp = li / 32u;
    let lane = li % 32u;
    // Block lane within the team, and the team.
    let g = lane % WL + WL * (warp % (L / WL));
    let team = lane / WL + (32u / WL) * (warp / (L / WL));
    let wg_row0 = (wid.x + wid.y * p.gx) * RW;
    let row0 = wg_row0 + team * R;
    // Rows past the end read row 0 and blocks past it the last (both always there); neither is
    // used. MM_SETUP: row bases rb{r}, the first block's weights nw{r}/ns{r}, accumulators.
    let first = min(g, p.bpr - 1u);
    //MM_SETUP
    // b0 and p.nb are uniform, so every thread reaches every barrier.
    for (var b0 = 0u; b0 < p.bpr; b0 += KC) {
        for (var t = li; t < C * KC * 8u; t += 256u) {
            let c = t / (KC * 8u);
            let bl = (t / 8u) % KC;
            let k = t % 8u;
            // Uniform in c: staged columns past nb cost no loads.
            if (c < p.nb && b0 + bl < p.bpr) {
                xs[(c * KC + bl) * 8u + ((k + bl) & 7u)] = mm_x(c, (b0 + bl) * 8u + k);
            }
        }
        workgroupBarrier();
        for (var u = 0u; u < KC / L; u++) {
            let bl = u * L + g;
            let b = b0 + bl;
            // MM_NEXT: take the prefetched block (w{r}, s{r}), load the lane's next one.
            let bn = min(b + L, p.bpr - 1u);
            //MM_NEXT
            if (b < p.bpr) {
                let sw = bl & 7u;
                //MM_BODY
            }
        }
        // The next chunk overwrites xs.
        workgroupBarrier();
    }
    //MM_REDUCE
}
