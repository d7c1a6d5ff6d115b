// RMSNorm of one vector with optional fused residual add and fused int8 quantisation of the
// output, in one workgroup (the vector is a few thousand elements: the dispatch, not the math,
// is the cost). Prepended: state.wgsl and the numerics snippets (`act_store8`, numerics.rs).
//   if ADD:   h += r   (h is the residual stream, updated in place)
//   y = h / sqrt(mean(h^2) + eps) * w
//   if QUANT: y int8-quantised per block of 32 into bindings 4, 5 by `act_store8` (plain or
//             precise int8 per the snippet); the host guarantees n % 32 == 0 then.
// Thread li owns the chunks c = li + 256j of 8 consecutive elements in every phase, so it only
// ever reads back its own writes to h, and four consecutive threads hold one quantisation block.
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
// [16][17]: the 16 groups of 16 partials 17 words apart, so the 16 adding threads read 16 banks.
var<workgroup> red: array<f32, 272>;
var<workgroup> red16: array<f32, 16>;

// h[i] (+ r[i], written back when `add`); 0 past n.
fn load_h(i: u32, add: bool) -> f32 {
    if (i >= p.n) { return 0.0; }
    var v = h[i];
    if (add) {
        v += r[i];
        h[i] = v;
    }
    return v;
}
fn load4(i: u32, add: bool) -> vec4<f32> {
    return vec4<f32>(load_h(i, add), load_h(i + 1u, add), load_h(i + 2u, add), load_h(i + 3u, add));
}
fn load_w(i: u32) -> f32 {
    if (i >= p.n) { return 0.0; }
    return w[i];
}
fn w4(i: u32) -> vec4<f32> {
    return vec4<f32>(load_w(i), load_w(i + 1u), load_w(i + 2u), load_w(i + 3u));
}
fn store4(i: u32, v: vec4<f32>) {
    for (var t = 0u; t < 4u; t++) {
        if (i + t < p.n) { y[i + t] = v[t]; }
    }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    let add = (p.flags & ADD) != 0u;
    let chunks = (p.n + 7u) / 8u;
    // Each thread's first chunk (every chunk when n <= 2048) stays in registers for the second phase, with
    // its weights loaded now: the second phase then waits on no memory.
    let a0 = load4(8u * li, add);
    let b0 = load4(8u * li + 4u, add);
    let wa0 = w4(8u * li);
    let wb0 = w4(8u * li + 4u);
    var ss = dot(a0, a0) + dot(b0, b0);
    for (var c = li + WG; c < chunks; c += WG) {
        let a = load4(8u * c, add);
        let b = load4(8u * c + 4u, add);
        ss += dot(a, a) + dot(b, b);
    }
    // Two-level sum (2 barriers instead of a log2(256)-step tree); every thread then adds the
    // 16 partials in the same order, so all see the same total.
    red[li + li / 16u] = ss;
    workgroupBarrier();
    if (li < 16u) {
        var s = 0.0;
        for (var j = 0u; j < 16u; j++) { s += red[17u * li + j]; }
        red16[li] = s;
    }
    workgroupBarrier();
    var tot = 0.0;
    for (var j = 0u; j < 16u; j++) { tot += red16[j]; }
    let inv = inverseSqrt(tot / f32(p.n) + p.eps);
    let quant = (p.flags & QUANT) != 0u;
    // Uniform loop (bounds from the uniform buffer): act_store8 has barriers.
    for (var base = 0u; base < chunks; base += WG) {
        let c = base + li;
        let i = 8u * c;
        var y0 = a0 * inv * wa0;
        var y1 = b0 * inv * wb0;
        if (base > 0u) {
            y0 = load4(i, false) * inv * w4(i);
            y1 = load4(i + 4u, false) * inv * w4(i + 4u);
        }
        store4(i, y0);
        store4(i + 4u, y1);
        if (quant) {
            act_store8(y0, y1, c, c < chunks, li);
        }
    }
}
