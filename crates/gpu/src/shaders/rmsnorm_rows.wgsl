// RMSNorm of every token row of a prefill chunk (norm.rs `RmsNormRowsKernel`): workgroup t writes
// y[t] = h[t] / sqrt(mean(h[t]^2) + eps) * w for t < dims.m. Prepended: consts H4 (H / 4), EPS.
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };
@group(0) @binding(0) var<storage, read> h: array<vec4<f32>>;        // [T, H/4]
@group(0) @binding(1) var<storage, read> w: array<vec4<f32>>;        // [H/4]
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;  // [T, H/4]
@group(0) @binding(3) var<uniform> dims: Dims;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.x;
    // Compiled without runtime bounds checks (norm.rs): rows past either buffer are skipped,
    // whatever dims and the grid say.
    if (t >= dims.m || t >= min(arrayLength(&h), arrayLength(&y)) / H4) {
        return;
    }
    var ss = 0.0;
    for (var i = li; i < H4; i += 256u) {
        let v = h[t * H4 + i];
        ss += dot(v, v);
    }
    red[li] = ss;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let inv = inverseSqrt(red[0] / f32(4u * H4) + EPS);
    for (var i = li; i < H4; i += 256u) {
        y[t * H4 + i] = h[t * H4 + i] * inv * w[i];
    }
}
