// int4 (repacked Q4_0, tensor.rs layout) x f32 activations -> f32, one matrix part. The parity
// variant of matvec_q4_i8.wgsl (same grid and reduction). Prepended: state.wgsl.
struct Params { rows: u32, bpr: u32, row_start: u32, gx: u32 };
@group(0) @binding(0) var<storage, read> qs: array<vec4<u32>>;      // [rows * bpr] nibble blocks
@group(0) @binding(1) var<storage, read> sc: array<u32>;            // [rows * bpr] f16 scales, 2 per word
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;       // [bpr * 8]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;       // [row_start + rows ..]
@group(0) @binding(4) var<uniform> p: Params;
@group(0) @binding(5) var<storage, read> state: State;

const T: u32 = 32u;
const RPW: u32 = 8u;
var<workgroup> red: array<f32, 256>;

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
// Byte k of v, low nibble (element 4w + k) / high nibble (element 4w + 16 + k).
fn lo4(v: u32) -> vec4<f32> { return vec4<f32>((vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u)); }
fn hi4(v: u32) -> vec4<f32> { return vec4<f32>((vec4<u32>(v) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u)); }

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    let team = li / T;
    let lane = li % T;
    let row = (wid.x + wid.y * p.gx) * RPW + team;
    var acc = 0.0;
    if (row < p.rows) {
        let base = row * p.bpr;
        for (var b = lane; b < p.bpr; b += T) {
            let w = qs[base + b];
            let xb = b * 8u;
            let x0 = x[xb]; let x1 = x[xb + 1u]; let x2 = x[xb + 2u]; let x3 = x[xb + 3u];
            let x4 = x[xb + 4u]; let x5 = x[xb + 5u]; let x6 = x[xb + 6u]; let x7 = x[xb + 7u];
            let xsum = dot((x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7), vec4<f32>(1.0));
            let d = dot(lo4(w.x), x0) + dot(lo4(w.y), x1) + dot(lo4(w.z), x2) + dot(lo4(w.w), x3)
                  + dot(hi4(w.x), x4) + dot(hi4(w.y), x5) + dot(hi4(w.z), x6) + dot(hi4(w.w), x7);
            acc += scale(base + b) * (d - 8.0 * xsum);
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
