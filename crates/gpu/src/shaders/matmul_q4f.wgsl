// int4 (repacked Q4_0, tensor.rs layout) x f32 activations for up to C columns at once, one matrix
// part: Y[c, row] = W[row, :] . X[c, :] for c < p.nb <= C. Prepended by the host: state.wgsl,
// `dq_lo`/`dq_hi`/`DQ_SLO`/`DQ_SHI` (numerics.rs F32_DEQ), `const C: u32` (columns compiled),
// `const CS: u32` (columns staged at a time, dividing C), `const R: u32` (rows per team), `const
// ACC: bool` (add into Y: the residual add) and the input form (matmul.rs): `mm_stage(li)` (a
// no-op, or the nb RMSNorm reductions), `mm_w(i)` (the norm weight's vec4 i, or ones) and `mm_x(c,
// i, w)` (vec4 i of column c, normalised with `w` or not). 256 threads = 8 teams x 32 lanes; team t
// owns rows [R t, R t + R) of the workgroup's 8R rows. The blocks go by in chunks of 32, lane l
// taking block l of each chunk; each weight word is loaded and dequantised ONCE and used for all
// columns. A chunk's activations (C x 32 blocks) are first staged in shared memory by all 256
// threads, one coalesced vec4 each per column: read straight from global memory, the 32 lanes'
// loads sit 128 bytes apart and the H200 spent ~3x the matvec's time per column on them. Staged
// blocks are 9 vec4 apart (one of padding), so the 8 lanes of each 16-byte read phase hit distinct
// banks. CS columns are staged at a time (4 at most: 8 would need 36 KiB, past lavapipe's 32), the
// weights loaded once per chunk for all of them. Per (row, column) the block dot runs in exactly
// the order of `dq_block` and the lane/team reduction in exactly the order of matvec_q4f.wgsl, so
// column c equals the single-vector matvec of column c (up to the driver's fma contraction).
struct Params { rows: u32, bpr: u32, row_start: u32, gx: u32, eps: f32, nb: u32, y_stride: u32, cols4: u32 };
@group(0) @binding(0) var<storage, read> qs: array<vec4<u32>>;      // [rows * bpr] nibble blocks
@group(0) @binding(1) var<storage, read> sc: array<u32>;            // [rows * bpr] f16 scales, 2 per word
@group(0) @binding(4) var<storage, read_write> y: array<f32>;       // [nb, y_stride], rows at row_start
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read> state: State;

const T: u32 = 32u;
// Staged vec4s per block: 8 and one of padding (bank spread).
const XS: u32 = 9u;
// [8 teams * R rows * C columns][32 lanes] lane partials.
var<workgroup> red: array<f32, 256u * R * C>;
// [CS columns][32 blocks][XS] one chunk of the activations.
var<workgroup> xs: array<vec4<f32>, CS * T * XS>;

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Uniform across the dispatch, so no barrier is skipped by only part of a workgroup.
    if (state.done != 0u) { return; }
    mm_stage(li);
    let team = li / T;
    let lane = li % T;
    let row0 = (wid.x + wid.y * p.gx) * (8u * R) + team * R;
    var acc: array<f32, R * C>; // [R][C]
    // b0, c0 and p.nb are uniform, so every thread reaches every barrier.
    for (var b0 = 0u; b0 < p.bpr; b0 += T) {
        let b = b0 + lane;
        let live = b < p.bpr;
        var w: array<vec4<u32>, R>;
        var s: array<f32, R>;
        for (var r = 0u; r < R; r++) {
            // Rows past the end read row 0 and blocks past it the last (both always there);
            // neither is used.
            let row = select(0u, row0 + r, row0 + r < p.rows);
            let blk = row * p.bpr + min(b, p.bpr - 1u);
            w[r] = qs[blk];
            s[r] = scale(blk);
        }
        // Thread li stages vec4 li of the chunk (block li / 8, vec4 li % 8) of each column.
        let si = b0 * 8u + li;
        for (var c0 = 0u; c0 < C; c0 += CS) {
            // Uniform: staged column groups past nb cost neither loads nor math.
            if (c0 < p.nb) {
                if (si < p.bpr * 8u) {
                    let nw = mm_w(si);
                    for (var j = 0u; j < CS; j++) {
                        if (c0 + j < p.nb) {
                            xs[(j * T + li / 8u) * XS + li % 8u] = mm_x(c0 + j, si, nw);
                        }
                    }
                }
                workgroupBarrier();
                if (live) {
                    // dq_block's two vec4 partials per (row, staged column): [R][CS].
                    var lo: array<vec4<f32>, R * CS>;
                    var hi: array<vec4<f32>, R * CS>;
                    for (var k = 0u; k < 4u; k++) {
                        // Word k holds elements 4k..4k+3 and 4k+16..4k+19: vec4s k and k + 4.
                        var wl: array<vec4<f32>, R>;
                        var wh: array<vec4<f32>, R>;
                        for (var r = 0u; r < R; r++) {
                            wl[r] = dq_lo(w[r][k]);
                            wh[r] = dq_hi(w[r][k]);
                        }
                        for (var j = 0u; j < CS; j++) {
                            if (c0 + j < p.nb) {
                                let x0 = xs[(j * T + lane) * XS + k];
                                let x1 = xs[(j * T + lane) * XS + k + 4u];
                                let xl = vec4<f32>(x0.x, x1.x, x0.y, x1.y);
                                let xh = vec4<f32>(x0.z, x1.z, x0.w, x1.w);
                                for (var r = 0u; r < R; r++) {
                                    lo[r * CS + j] = fma(wl[r], xl, lo[r * CS + j]);
                                    hi[r * CS + j] = fma(wh[r], xh, hi[r * CS + j]);
                                }
                            }
                        }
                    }
                    for (var r = 0u; r < R; r++) {
                        for (var j = 0u; j < CS; j++) {
                            let d = dot(lo[r * CS + j], DQ_SLO) + dot(hi[r * CS + j], DQ_SHI);
                            acc[r * C + c0 + j] = fma(s[r], d, acc[r * C + c0 + j]);
                        }
                    }
                }
                // The next group or chunk overwrites xs.
                workgroupBarrier();
            }
        }
    }
    for (var rc = 0u; rc < R * C; rc++) {
        red[(team * R * C + rc) * T + lane] = acc[rc];
    }
    workgroupBarrier();
    if (li < 8u * R * C) {
        var sum = 0.0;
        for (var j = 0u; j < T; j++) {
            sum += red[li * T + j];
        }
        let c = li % C;
        let row = (wid.x + wid.y * p.gx) * (8u * R) + li / C;
        if (row < p.rows && c < p.nb) {
            let o = c * p.y_stride + p.row_start + row;
            if (ACC) {
                y[o] += sum;
            } else {
                y[o] = sum;
            }
        }
    }
}
