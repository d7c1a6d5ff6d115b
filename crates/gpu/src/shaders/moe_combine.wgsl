// The weighted combine of a prefill chunk's MoE (moe_prefill.rs): h[t] += Σ_r w[t K + r] dn[j(t K + r)]
// over the token's experts in rank order (the oracle's order), then the residual add. Prepended by
// the host: consts K, H4 (H / 4), P_INV, TMAX (tokens the buffers hold). Grid (T, ceil(H4 / 256)).
// Compiled without runtime bounds checks (moe_prefill.rs): the token is clamped below TMAX and
// the list row read from the plan below TMAX K, whatever dims and the plan say.
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };

@group(0) @binding(0) var<storage, read> dn: array<vec4<f32>>;      // [T K, H/4] list order
@group(0) @binding(1) var<storage, read> rw: array<f32>;            // [T K] mixing weights
@group(0) @binding(2) var<storage, read> plan: array<u32>;          // moe_prefill.wgsl layout
@group(0) @binding(3) var<storage, read_write> h: array<vec4<f32>>; // [T, H/4] residual stream
@group(0) @binding(4) var<uniform> dims: Dims;

@compute @workgroup_size(256)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.x;
    let c = wid.y * 256u + li;
    if (t >= min(dims.m, TMAX) || c >= H4) {
        return;
    }
    var s = vec4<f32>(0.0);
    for (var r = 0u; r < K; r++) {
        let i = t * K + r;
        let j = min(plan[P_INV + i], TMAX * K - 1u);
        s = fma(vec4<f32>(rw[i]), dn[j * H4 + c], s);
    }
    h[t * H4 + c] += s;
}
