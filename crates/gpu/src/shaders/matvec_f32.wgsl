// Plain f32 matrix x f32 vector (the router, or any non-quantised matrix), one matrix part.
// Same grid and reduction as matvec_q4_i8.wgsl. Prepended: state.wgsl.
struct Params { rows: u32, c4: u32, row_start: u32, gx: u32 };
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;       // [rows * c4]
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;       // [c4]
@group(0) @binding(2) var<storage, read_write> y: array<f32>;       // [row_start + rows ..]
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> state: State;

const T: u32 = 32u;
const RPW: u32 = 8u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    let team = li / T;
    let lane = li % T;
    let row = (wid.x + wid.y * p.gx) * RPW + team;
    var acc = 0.0;
    if (row < p.rows) {
        let base = row * p.c4;
        for (var c = lane; c < p.c4; c += T) {
            acc += dot(w[base + c], x[c]);
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var st = T / 2u; st > 0u; st >>= 1u) {
        if (lane < st) { red[li] += red[li + st]; }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[p.row_start + row] = red[li];
    }
}
