// f32 activations -> int8 per block of 32 (tensor.rs layout); one thread per block.
// Prepended: state.wgsl.
struct Params { blocks: u32, gx: u32, pad0: u32, pad1: u32 };
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;       // [blocks * 8]
@group(0) @binding(1) var<storage, read_write> xq: array<u32>;      // [blocks * 8]
@group(0) @binding(2) var<storage, read_write> xs: array<vec2<f32>>; // [blocks]
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> state: State;

// Round half away from zero (matches tensor::quantize_acts_ref), then clamp to +-127.
fn q8(v: vec4<f32>, id: f32) -> vec4<i32> {
    let t = v * id;
    return vec4<i32>(clamp(sign(t) * floor(abs(t) + 0.5), vec4<f32>(-127.0), vec4<f32>(127.0)));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    let b = (wid.x + wid.y * p.gx) * 64u + li;
    if (b >= p.blocks) { return; }
    var amax = 0.0;
    for (var k = 0u; k < 8u; k++) {
        let v = abs(x[b * 8u + k]);
        amax = max(amax, max(max(v.x, v.y), max(v.z, v.w)));
    }
    let d = amax / 127.0;
    let id = select(0.0, 1.0 / d, d > 0.0);
    var sum = 0;
    for (var k = 0u; k < 8u; k++) {
        let q = q8(x[b * 8u + k], id);
        sum += q.x + q.y + q.z + q.w;
        xq[b * 8u + k] = pack4xI8(q);
    }
    xs[b] = vec2<f32>(d, d * f32(sum));
}
