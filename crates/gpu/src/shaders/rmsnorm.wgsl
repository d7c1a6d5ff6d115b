// RMSNorm of one vector with optional fused residual add and fused int8 quantisation of the
// output, in one workgroup (the vector is a few thousand elements: the dispatch, not the math,
// is the cost). Prepended: state.wgsl.
//   if ADD:   h += r   (h is the residual stream, updated in place)
//   y = h / sqrt(mean(h^2) + eps) * w
//   if QUANT: y int8-quantised per block of 32 into bindings 4, 5 by `act_store` (the numerics
//             snippet prepended by the host picks plain or precise int8, numerics.rs)
struct Params { n: u32, eps: f32, flags: u32, pad: u32 };
const ADD: u32 = 1u;
const QUANT: u32 = 2u;
@group(0) @binding(0) var<storage, read_write> h: array<f32>;        // [n]
@group(0) @binding(1) var<storage, read> r: array<f32>;              // [n] (ADD only)
@group(0) @binding(2) var<storage, read> w: array<f32>;              // [n]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // [n]
@group(0) @binding(6) var<uniform> p: Params;
@group(0) @binding(7) var<storage, read> state: State;

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    let add = (p.flags & ADD) != 0u;
    var ss = 0.0;
    for (var i = li; i < p.n; i += WG) {
        var v = h[i];
        if (add) {
            v += r[i];
            h[i] = v;
        }
        ss += v * v;
    }
    red[li] = ss;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (li < st) { red[li] += red[li + st]; }
        workgroupBarrier();
    }
    let inv = inverseSqrt(red[0] / f32(p.n) + p.eps);
    // Each thread rescales the elements it summed, so it reads back only its own writes to h.
    for (var i = li; i < p.n; i += WG) {
        y[i] = h[i] * inv * w[i];
    }
    if ((p.flags & QUANT) == 0u) { return; }
    // Blocks are quantised by one thread each from y, written by other threads above.
    storageBarrier();
    for (var b = li; b < p.n / 32u; b += WG) {
        var v: array<f32, 32>;
        for (var j = 0u; j < 32u; j++) { v[j] = y[b * 32u + j]; }
        act_store(v, b);
    }
}
