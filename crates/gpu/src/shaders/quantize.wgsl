// f32 activations -> int8 per block of 32 (plain or precise: the numerics snippet prepended by
// the host declares bindings 1, 2 and `act_store`); one thread per block. Prepended: state.wgsl.
struct Params { blocks: u32, gx: u32, pad0: u32, pad1: u32 };
@group(0) @binding(0) var<storage, read> x: array<f32>;             // [blocks * 32]
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> state: State;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    let b = (wid.x + wid.y * p.gx) * 64u + li;
    if (b >= p.blocks) { return; }
    var v: array<f32, 32>;
    for (var j = 0u; j < 32u; j++) { v[j] = x[b * 32u + j]; }
    act_store(v, b);
}
