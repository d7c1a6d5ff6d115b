// RMSNorm of one vector with optional fused residual add and fused int8 quantisation of the
// output, in one workgroup (the vector is a few thousand elements: the dispatch, not the math,
// is the cost). Prepended: state.wgsl.
//   if ADD:   h += r   (h is the residual stream, updated in place)
//   y = h / sqrt(mean(h^2) + eps) * w
//   if QUANT: (yq, ys) = int8 per block of 32 of y (tensor.rs layout)
struct Params { n: u32, eps: f32, flags: u32, pad: u32 };
const ADD: u32 = 1u;
const QUANT: u32 = 2u;
@group(0) @binding(0) var<storage, read_write> h: array<f32>;        // [n]
@group(0) @binding(1) var<storage, read> r: array<f32>;              // [n] (ADD only)
@group(0) @binding(2) var<storage, read> w: array<f32>;              // [n]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // [n]
@group(0) @binding(4) var<storage, read_write> yq: array<u32>;       // [n/4] (QUANT only)
@group(0) @binding(5) var<storage, read_write> ys: array<vec2<f32>>; // [n/32] (QUANT only)
@group(0) @binding(6) var<uniform> p: Params;
@group(0) @binding(7) var<storage, read> state: State;

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;

fn q8(v: f32, id: f32) -> i32 {
    let t = v * id;
    return i32(clamp(sign(t) * floor(abs(t) + 0.5), -127.0, 127.0));
}

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
        var amax = 0.0;
        for (var j = 0u; j < 32u; j++) { amax = max(amax, abs(y[b * 32u + j])); }
        let d = amax / 127.0;
        let id = select(0.0, 1.0 / d, d > 0.0);
        var sum = 0;
        for (var k = 0u; k < 8u; k++) {
            let e = b * 32u + k * 4u;
            let q = vec4<i32>(q8(y[e], id), q8(y[e + 1u], id), q8(y[e + 2u], id), q8(y[e + 3u], id));
            sum += q.x + q.y + q.z + q.w;
            yq[b * 8u + k] = pack4xI8(q);
        }
        ys[b] = vec2<f32>(d, d * f32(sum));
    }
}
