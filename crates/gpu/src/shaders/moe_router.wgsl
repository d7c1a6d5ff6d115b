// Standalone router: softmax + top-k (+ renormalise) of the E router logits, one workgroup.
// Prepended by the host: consts E, K, WG, NORM_TOPK, the `State` struct and moe_route.wgsl.
//
// logits [E] f32 (router matvec output)
// route  [2K] u32: ids [K] then the weights [K] as f32 bits, sorted by descending weight.

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> route: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    route_select(li, 0u);
    for (var r = li; r < K; r += WG) {
        route[r] = top_e[r];
        route[K + r] = bitcast<u32>(route_weight(r));
    }
}
