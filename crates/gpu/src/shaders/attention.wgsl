// Single-query GQA attention over the KV cache, split over the sequence (flash-decoding style).
// Prepended by the host: consts D, D4 (= D/4), HQ, HKV, G (= HQ/HKV), C (positions per chunk),
// CTX (cache rows), NC (= ceil(CTX / C)), WG (power of two), LG (power-of-two lanes per query head in
// the softmax reductions, LG * G <= WG), SCALE (= 1/sqrt(D)), and the `State` struct.
//
// Pass 1 `chunk`: grid (chunks, HKV). Workgroup (c, h) handles positions [c*C, min((c+1)*C, pos+1))
//   for the G query heads sharing kv head h, so each K/V row is read once for all G heads. It
//   writes the chunk's unnormalised output and its (max, sum) to the partial buffers.
// Pass 2 `combine`: grid (HQ). Rescales and sums the chunk partials of one query head.
//
// q        qkv[0 .. HQ*D] f32 (roped queries, head j at j*D)
// k/v      [CTX, HKV, D] f32 viewed as vec4
// part_o   [HQ, NC, D] f32 viewed as vec4: Σ_t exp(s_t - m_c) v_t over the chunk
// part_ml  [HQ, NC] vec2<f32>: (m_c, l_c) = (max_t s_t, Σ_t exp(s_t - m_c))
// out      [HQ*D] f32; `combine_q8` also writes it int8-quantised per block of 32 (tensor.rs layout).

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> v_cache: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> part_o: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> part_ml: array<vec2<f32>>;

var<workgroup> qs: array<vec4<f32>, G * D4>;
// Scores, then probabilities, of the chunk: [G, C].
var<workgroup> sc: array<f32, G * C>;
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<vec2<f32>, G>;

@compute @workgroup_size(WG)
fn chunk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    // Positions beyond the cache cannot have been written: clamp (the host keeps pos < CTX).
    let n = min(state.pos + 1u, CTX);
    let c = wid.x;
    let h = wid.y;
    let t0 = c * C;
    if (t0 >= n) {
        return;
    }
    let len = min(C, n - t0);

    // Queries of the G heads of this group, pre-scaled by 1/sqrt(D).
    for (var i = li; i < G * D4; i += WG) {
        qs[i] = qkv[h * G * D4 + i] * SCALE;
    }
    workgroupBarrier();

    // Scores: one thread per position, all G heads at once (the K row is read once).
    for (var t = li; t < len; t += WG) {
        let krow = ((t0 + t) * HKV + h) * D4;
        var acc: array<f32, G>;
        for (var g = 0u; g < G; g++) {
            acc[g] = 0.0;
        }
        for (var d = 0u; d < D4; d++) {
            let kv = k_cache[krow + d];
            for (var g = 0u; g < G; g++) {
                acc[g] += dot(qs[g * D4 + d], kv);
            }
        }
        for (var g = 0u; g < G; g++) {
            sc[g * C + t] = acc[g];
        }
    }
    workgroupBarrier();

    // Per-head max then exp-sum over the chunk: LG lanes per head, tree reductions.
    let g = li / LG;
    let lane = li % LG;
    var m = -3.4028235e38;
    if (g < G) {
        for (var t = lane; t < len; t += LG) {
            m = max(m, sc[g * C + t]);
        }
    }
    red[li] = m;
    workgroupBarrier();
    for (var st = LG / 2u; st > 0u; st >>= 1u) {
        if (lane < st) {
            red[li] = max(red[li], red[li + st]);
        }
        workgroupBarrier();
    }
    var l = 0.0;
    if (g < G) {
        m = red[g * LG];
        for (var t = lane; t < len; t += LG) {
            let p = exp(sc[g * C + t] - m);
            sc[g * C + t] = p;
            l += p;
        }
    }
    workgroupBarrier();
    red[li] = l;
    workgroupBarrier();
    for (var st = LG / 2u; st > 0u; st >>= 1u) {
        if (lane < st) {
            red[li] += red[li + st];
        }
        workgroupBarrier();
    }
    if (g < G && lane == 0u) {
        stat[g] = vec2<f32>(m, red[li]);
    }
    workgroupBarrier();

    // Weighted sum of V: one thread per (head, vec4 of D); V rows are shared through the cache.
    for (var o = li; o < G * D4; o += WG) {
        let gg = o / D4;
        let d = o % D4;
        var acc = vec4<f32>(0.0);
        for (var t = 0u; t < len; t++) {
            acc += sc[gg * C + t] * v_cache[((t0 + t) * HKV + h) * D4 + d];
        }
        let qh = h * G + gg;
        part_o[(qh * NC + c) * D4 + d] = acc;
    }
    if (li < G) {
        part_ml[(h * G + li) * NC + c] = stat[li];
    }
}
