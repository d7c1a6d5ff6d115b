// The MoE of a prefill chunk around the expert GEMMs (moe_prefill.rs): routing of every token,
// the per-expert assignment lists and tiles (the plan), and the weighted combine. Prepended by the
// host: moe_route.wgsl, consts E, K, WG, NORM_TOPK, H4 (H / 4), MBM (tokens per GEMM tile), the
// plan layout (P_OFF, P_TILES, P_LIST, P_INV), and for `route` RS (router logit splits) and
// TMAX (token rows per split).
//
// Plan buffer (u32 words): [0] tile count; [P_OFF .. P_OFF + E + 1) the list offset of each expert
// (exclusive prefix sum of the counts, the last = T K); [P_TILES ..) tiles `e << 16 | m0` (rows m0 ..
// m0 + MBM of expert e's list); [P_LIST .. + T K) list: assignment i = t K + r at list position j;
// [P_INV .. + T K) its inverse, j of assignment i.
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };

@group(0) @binding(0) var<storage, read> logits: array<f32>;             // [RS, TMAX, E] partial router logits
@group(0) @binding(1) var<storage, read_write> rid: array<u32>;          // [T K] expert of assignment
@group(0) @binding(2) var<storage, read_write> rw: array<f32>;           // [T K] its mixing weight
@group(0) @binding(3) var<storage, read_write> cnt: array<atomic<u32>>;  // [E] zero between layers
@group(0) @binding(4) var<storage, read_write> plan: array<u32>;
@group(0) @binding(5) var<uniform> dims: Dims;

// Workgroup t: the router's top-K of token t (the decode kernels' rule: rank order, ties to the
// lower index, softmax weights renormalised iff NORM_TOPK), and a place in each chosen expert's
// list. The place depends on the order the workgroups run in, the values do not: every row of an
// expert GEMM is computed on its own, and the combine reads each token's rows in rank order.
@compute @workgroup_size(WG)
fn route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.x;
    if (t >= dims.m) {
        return;
    }
    // The logits: the RS partial sums of the router GEMM's K splits, added in split order.
    for (var e = li; e < E; e += WG) {
        var v = logits[t * E + e];
        for (var j = 1u; j < RS; j++) {
            v += logits[(j * TMAX + t) * E + e];
        }
        lg[e] = v;
    }
    route_rank(li);
    if (li < K) {
        let e = top_e[li];
        let i = t * K + li;
        rid[i] = e;
        rw[i] = route_weight(li);
        plan[P_INV + i] = atomicAdd(&cnt[e], 1u);
    }
}

var<workgroup> offs: array<u32, E>;

// One workgroup: offsets and tiles from the counts (thread 0, E steps), the counts zeroed for the
// next layer, then every assignment's list position.
@compute @workgroup_size(WG)
fn build(@builtin(local_invocation_index) li: u32) {
    if (li == 0u) {
        var o = 0u;
        var nt = 0u;
        for (var e = 0u; e < E; e++) {
            offs[e] = o;
            plan[P_OFF + e] = o;
            let c = atomicLoad(&cnt[e]);
            for (var m0 = 0u; m0 < c; m0 += MBM) {
                plan[P_TILES + nt] = (e << 16u) | m0;
                nt++;
            }
            o += c;
        }
        plan[P_OFF + E] = o;
        plan[0] = nt;
    }
    workgroupBarrier();
    for (var e = li; e < E; e += WG) {
        atomicStore(&cnt[e], 0u);
    }
    for (var i = li; i < dims.m * K; i += WG) {
        let j = offs[rid[i]] + plan[P_INV + i];
        plan[P_INV + i] = j;
        plan[P_LIST + j] = i;
    }
}
