// Swizzled staging of f32 activations in workgroup memory, shared by the f32 MoE kernels
// (moe_gate_up_f32.wgsl, moe_down_f32.wgsl; the layout of matvec_q4f.wgsl). The includer
// declares `xs: array<vec4<f32>, N>` (workgroup) and fills it through `xs_slot`.
//
// vec4 k of block b (32 activations = 8 vec4) lives at slot 8b + (k + b) % 8: the 8 lanes of a
// memory phase that read vec4 k of 8 consecutive blocks hit 8 different bank groups. Unswizzled,
// or straight from global memory, those reads stride 128 bytes across the lanes (a 32-way bank
// conflict, or 32 cache lines per load instruction), which is what limited the f32 kernels.

fn xs_slot(i: u32) -> u32 {
    return (i & ~7u) | (((i & 7u) + (i >> 3u)) & 7u);
}

// The 32 staged activations of block b, in element order (vec4 k = elements 4k..4k+3).
fn xs_block(b: u32) -> array<vec4<f32>, 8> {
    let o = b * 8u;
    let s = b & 7u;
    return array<vec4<f32>, 8>(
        xs[o + s], xs[o + ((s + 1u) & 7u)], xs[o + ((s + 2u) & 7u)], xs[o + ((s + 3u) & 7u)],
        xs[o + ((s + 4u) & 7u)], xs[o + ((s + 5u) & 7u)], xs[o + ((s + 6u) & 7u)],
        xs[o + ((s + 7u) & 7u)]);
}
