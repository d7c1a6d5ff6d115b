// Router top-k shared by `moe_router.wgsl` and `moe_gate_up.wgsl` (formats-spec §1.7).
// Needs consts E, K, WG, NORM_TOPK (bool) and a `logits: array<f32>` binding: [E], or [B, E] for
// the column forms, which pass the column's first logit as `base`.
//
// Selection by rank instead of K sequential arg-max passes: rank(e) = #{e' : r_e' > r_e} +
// #{e' < e : r_e' == r_e}, a strict order (ties -> lower index) computed in one pass with no
// reductions; the expert of rank r < K is the r-th choice, so the output is sorted by descending
// probability like HF. Weights: softmax over all E in f32, then renormalised over the K chosen iff
// NORM_TOPK; since p_e = exp(r_e - m) / Σ_all exp(r - m), both are computed from exp(r_e - m).

var<workgroup> lg: array<f32, E>;
var<workgroup> top_e: array<u32, K>;

// Fill top_e[0..K] (expert ids by rank) from logits[base..base + E]. Call from uniform control
// flow by the whole workgroup.
fn route_select(li: u32, base: u32) {
    for (var e = li; e < E; e += WG) {
        lg[e] = logits[base + e];
    }
    route_rank(li);
}

// Fill top_e[0..K] from `lg` as the caller filled it (the barrier here publishes it). Call from
// uniform control flow by the whole workgroup.
fn route_rank(li: u32) {
    // A NaN logit could leave a rank unclaimed: default to expert 0 so ids stay in range.
    for (var r = li; r < K; r += WG) {
        top_e[r] = 0u;
    }
    workgroupBarrier();
    for (var e = li; e < E; e += WG) {
        let v = lg[e];
        // Below e ties count (u >= v), above they do not (u > v): the predicate
        // (u > v || (u == v && j < e)), NaN included; j = e adds 0. One loop with the constant
        // trip count E (not two split at e): the compiler can unroll it and keep many of the
        // (broadcast) shared loads in flight, where the dependent per-thread bounds left a
        // serial chain of E load latencies in every workgroup before any weight was read.
        // Four partial counts (integer: the order does not matter): one counter would make the
        // E adds a dependent chain.
        var rk = vec4<u32>(0u);
        var j = 0u;
        for (; j + 4u <= E; j += 4u) {
            let u = vec4<f32>(lg[j], lg[j + 1u], lg[j + 2u], lg[j + 3u]);
            let jj = vec4<u32>(j, j + 1u, j + 2u, j + 3u);
            rk += select(vec4<u32>(u > vec4<f32>(v)), vec4<u32>(u >= vec4<f32>(v)), jj < vec4<u32>(e));
        }
        for (; j < E; j++) {
            let u = lg[j];
            rk.x += select(u32(u > v), u32(u >= v), j < e);
        }
        let rank = (rk.x + rk.y) + (rk.z + rk.w);
        if (rank < K) {
            top_e[rank] = e;
        }
    }
    workgroupBarrier();
}

// Routing weight of the expert of rank r (every thread may call it; same result everywhere).
fn route_weight(r: u32) -> f32 {
    let m = lg[top_e[0]];
    var denom = 0.0;
    if (NORM_TOPK) {
        for (var j = 0u; j < K; j++) {
            denom += exp(lg[top_e[j]] - m);
        }
    } else {
        for (var j = 0u; j < E; j++) {
            denom += exp(lg[j] - m);
        }
    }
    return exp(lg[top_e[r]] - m) / denom;
}
