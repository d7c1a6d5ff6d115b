// int4 (repacked Q4_0, tensor.rs layout) x activations -> f32, one matrix part. The activation
// form (f32, int8, precise int8) comes from the numerics snippet prepended by the host, which
// declares bindings 2 (and 3) and `act_dot` (numerics.rs). Prepended too: state.wgsl.
// 256 threads = RPW teams x T lanes (T set by the host: 32, or a lane per block for rows
// of fewer than 32 blocks, matvec.rs lanes_per_row); team t owns rows [R2 t, R2 t + R2) of the workgroup's
// RPW R2 (R2 = 1 or 2, prepended by the host); lanes stride over the row's blocks, then a shared-memory
// tree reduction (no subgroup-size assumption). With R2 = 2 each activation block a lane loads
// serves both rows (`act_dot2`: the same per-row dots as `act_dot`, so the same bits), halving
// the activation loads per weight byte: the bfp24 lm_head's lanes load 7 words of activations
// per 4-word weight block.
struct Params { rows: u32, bpr: u32, row_start: u32, gx: u32 };
@group(0) @binding(0) var<storage, read> qs: array<vec4<u32>>;      // [rows * bpr] nibble blocks
@group(0) @binding(1) var<storage, read> sc: array<u32>;            // [rows * bpr] f16 scales, 2 per word
@group(0) @binding(4) var<storage, read_write> y: array<f32>;       // [row_start + rows ..]
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read> state: State;

const T: u32 = LANES_PER_ROWu;
const RPW: u32 = 256u / T;
var<workgroup> red: array<f32, 256u * R2>; // [R2, 256] per-lane partials

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Uniform across the dispatch, so no barrier is skipped by only part of a workgroup.
    if (state.done != 0u) { return; }
    let team = li / T;
    let lane = li % T;
    let row = (wid.x + wid.y * p.gx) * (RPW * R2) + team * R2;
    var acc = 0.0;
    var acc1 = 0.0;
    if (row < p.rows) {
        let base = row * p.bpr;
        if (R2 == 2u) {
            // A second row past the end repeats the first (loaded, never written).
            let base1 = select(base, base + p.bpr, row + 1u < p.rows);
            for (var b = lane; b < p.bpr; b += T) {
                let d = act_dot2(qs[base + b], qs[base1 + b], b);
                acc += scale(base + b) * d.x;
                acc1 += scale(base1 + b) * d.y;
            }
        } else {
            for (var b = lane; b < p.bpr; b += T) {
                acc += scale(base + b) * act_dot(qs[base + b], b);
            }
        }
    }
    red[li] = acc;
    if (R2 == 2u) {
        red[256u + li] = acc1;
    }
    workgroupBarrier();
    for (var st = T / 2u; st > 0u; st >>= 1u) {
        if (lane < st) {
            red[li] += red[li + st];
            if (R2 == 2u) {
                red[256u + li] += red[256u + li + st];
            }
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[p.row_start + row] = red[li];
        if (R2 == 2u && row + 1u < p.rows) {
            y[p.row_start + row + 1u] = red[256u + li];
        }
    }
}
