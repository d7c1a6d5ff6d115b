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

// Rank counts of the second half of the logits (`route_rank`'s split form).
var<workgroup> rank_hi: array<u32, E>;

// Where the split form's first half of the logits ends (a multiple of 4 near E / 2).
const RANK_SPLIT: u32 = (E / 8u) * 4u;

// #{j in [j0, j1) : lg[j] ranks above lg[e]}: the predicate (u > v || (u == v && j < e)), NaN
// included (j = e adds 0). A constant-stride loop over vec4s of broadcast shared loads, four
// partial counts (integer, so the order does not matter; one counter would make the adds a
// dependent chain); the bounds are workgroup constants, so the compiler can unroll it.
fn rank_count(e: u32, v: f32, j0: u32, j1: u32) -> u32 {
    var rk = vec4<u32>(0u);
    var j = j0;
    for (; j + 4u <= j1; j += 4u) {
        let u = vec4<f32>(lg[j], lg[j + 1u], lg[j + 2u], lg[j + 3u]);
        let jj = vec4<u32>(j, j + 1u, j + 2u, j + 3u);
        rk += select(vec4<u32>(u > vec4<f32>(v)), vec4<u32>(u >= vec4<f32>(v)), jj < vec4<u32>(e));
    }
    for (; j < j1; j++) {
        let u = lg[j];
        rk.x += select(u32(u > v), u32(u >= v), j < e);
    }
    return (rk.x + rk.y) + (rk.z + rk.w);
}

// Fill top_e[0..K] from `lg` as the caller filled it (the barrier here publishes it). Call from
// uniform control flow by the whole workgroup.
//
// Selection by rank (above): every expert's rank is a count over all E logits, with no
// reductions. When the workgroup has two threads per expert (WG >= 2E: Qwen3's 128 experts in
// 256 threads), thread e counts the first RANK_SPLIT logits and thread E + e the rest, and one
// more barrier adds the halves: the serial loop every workgroup runs before it can read a weight
// is half as long (the counts, so the ranks, are the same): tg128 +1.4% on the H200
// (docs/BENCHMARKS.md run 30).
fn route_rank(li: u32) {
    // A NaN logit could leave a rank unclaimed: default to expert 0 so ids stay in range.
    for (var r = li; r < K; r += WG) {
        top_e[r] = 0u;
    }
    workgroupBarrier();
    if (2u * E <= WG) {
        var lo = 0u;
        if (li < E) {
            lo = rank_count(li, lg[li], 0u, RANK_SPLIT);
        } else if (li < 2u * E) {
            let e = li - E;
            rank_hi[e] = rank_count(e, lg[e], RANK_SPLIT, E);
        }
        workgroupBarrier();
        if (li < E) {
            let rank = lo + rank_hi[li];
            if (rank < K) {
                top_e[rank] = li;
            }
        }
    } else {
        for (var e = li; e < E; e += WG) {
            let rank = rank_count(e, lg[e], 0u, E);
            if (rank < K) {
                top_e[rank] = e;
            }
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
