// Read-bandwidth probe: every thread sums a strided run of vec4 loads over the whole buffer
// (coalesced: consecutive threads read consecutive vec4) and writes its sum, so no load can be
// optimised away. Grid: (gx, gy) workgroups of 256 threads, linear id = wid.x + wid.y * gx.
struct Params { n4: u32, gx: u32, threads: u32, pad: u32 };
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;        // [n4]
@group(0) @binding(1) var<storage, read_write> sums: array<f32>;       // [threads]
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = (wid.x + wid.y * p.gx) * 256u + li;
    if (t >= p.threads) { return; }
    var acc = vec4<f32>(0.0);
    for (var i = t; i < p.n4; i += p.threads) {
        acc += src[i];
    }
    sums[t] = acc.x + acc.y + acc.z + acc.w;
}
