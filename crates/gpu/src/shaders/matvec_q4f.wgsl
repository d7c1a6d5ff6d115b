// int4 (repacked Q4_0, tensor.rs layout) x f32 activations -> f32, one matrix part, R rows per
// team. Prepended by the host: state.wgsl, `dq_block` (numerics.rs F32_DEQ), `const R: u32`,
// `const ACC: bool` (add into y: the o-proj's residual add) and the input form: either the plain
// f32 vector (`act_x` at binding 2 read from global memory, `nol_stage` a no-op) or the
// norm-on-load form (matvec.rs NORM_ON_LOAD: binding 2 is the residual stream h, binding 3 the
// RMSNorm weight, and `nol_stage` writes h / rms(h) * w into shared memory first: the RMSNorm
// dispatch before this matvec is gone, every workgroup recomputes the 2-8 KiB reduction).
// 256 threads = 8 teams x 32 lanes; team t owns rows [R t, R t + R) of the workgroup's 8R rows.
// A lane strides over the row's blocks and loads each block's 32 activations ONCE for its R rows:
// the activation loads, not the weights, limit the one-row form (8 vec4 per 16-byte weight block).
// Partials meet in shared memory; one barrier, then one thread per row adds its team's 32 lanes
// (no subgroup-size assumption).
struct Params { rows: u32, bpr: u32, row_start: u32, gx: u32, eps: f32, p1: u32, p2: u32, p3: u32 };
@group(0) @binding(0) var<storage, read> qs: array<vec4<u32>>;      // [rows * bpr] nibble blocks
@group(0) @binding(1) var<storage, read> sc: array<u32>;            // [rows * bpr] f16 scales, 2 per word
@group(0) @binding(4) var<storage, read_write> y: array<f32>;       // [row_start + rows ..]
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read> state: State;

const T: u32 = 32u;
var<workgroup> red: array<f32, 256u * R>;

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Uniform across the dispatch, so no barrier is skipped by only part of a workgroup.
    if (state.done != 0u) { return; }
    nol_stage(li, p.bpr * 8u, p.eps);
    let team = li / T;
    let lane = li % T;
    let row0 = (wid.x + wid.y * p.gx) * (8u * R) + team * R;
    var acc: array<f32, R>;
    for (var b = lane; b < p.bpr; b += T) {
        let x = act_xblock(b);
        for (var r = 0u; r < R; r++) {
            // Rows past the end read row 0 (always there) and are never written.
            let row = select(0u, row0 + r, row0 + r < p.rows);
            let blk = row * p.bpr + b;
            acc[r] = fma(scale(blk), dq_block(qs[blk], x), acc[r]);
        }
    }
    for (var r = 0u; r < R; r++) {
        red[(team * R + r) * T + lane] = acc[r];
    }
    workgroupBarrier();
    if (li < 8u * R) {
        var s = 0.0;
        for (var j = 0u; j < T; j++) {
            s += red[li * T + j];
        }
        let row = (wid.x + wid.y * p.gx) * (8u * R) + li;
        if (row < p.rows) {
            if (ACC) {
                y[p.row_start + row] += s;
            } else {
                y[p.row_start + row] = s;
            }
        }
    }
}
