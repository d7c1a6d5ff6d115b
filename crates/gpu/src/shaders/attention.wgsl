// Single-query GQA attention over the KV cache, split over the sequence (flash-decoding style).
// Prepended by the host: consts D, D4 (= D/4), HQ, HKV, G (= HQ/HKV), C (minimum chunk length),
// CTX (cache rows), NC (= ceil(CTX / C), the partial stride), WG (power of two), LG (power-of-two
// lanes per query head in the softmax reductions, LG * G <= WG), P (positions per tile,
// P * D4 <= 2 * WG), DP (= D4 + 1, padded tile row), CMAX (maximum chunk length), OPT (=
// ceil(G * D4 / WG) outputs per thread), SCALE (= 1/sqrt(D)), the `State` struct and
// `chunk_len(n)` (the chunk length used for n positions, shared with the combine).
//
// Pass 1 `chunk`: grid (chunks, HKV). Workgroup (c, h) handles positions [c*L, min((c+1)*L, pos+1))
//   with L = chunk_len(pos+1) for the G query heads sharing kv head h, so each K/V row is read
//   once for all G heads. K and V come through shared-memory tiles of P rows loaded coalesced
//   (at most two loads in flight per thread, no long serial chains); scores are one thread per
//   (head, position). It writes the chunk's unnormalised output and its (max, sum).
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
// One tile of P cache rows (K, then V), row stride DP vec4 so the score loop's rows hit
// different banks.
var<workgroup> tile: array<vec4<f32>, P * DP>;
// Scores, then probabilities, of the chunk: [G, CMAX].
var<workgroup> sc: array<f32, G * CMAX>;
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<vec2<f32>, G>;

// Stage `rows` cache rows starting at position t0 of kv head h into `tile`: element e < rows * D4
// is row e / D4, vec4 e % D4. Both loads are issued before either store.
fn stage(is_v: bool, t0: u32, h: u32, rows: u32, li: u32) {
    let n = rows * D4;
    let e0 = li;
    let e1 = li + WG;
    let r0 = e0 / D4;
    let r1 = e1 / D4;
    let s0 = ((t0 + r0) * HKV + h) * D4 + e0 % D4;
    let s1 = ((t0 + r1) * HKV + h) * D4 + e1 % D4;
    var a = vec4<f32>(0.0);
    var b = vec4<f32>(0.0);
    if (is_v) {
        if (e0 < n) { a = v_cache[s0]; }
        if (e1 < n) { b = v_cache[s1]; }
    } else {
        if (e0 < n) { a = k_cache[s0]; }
        if (e1 < n) { b = k_cache[s1]; }
    }
    if (e0 < n) {
        tile[r0 * DP + e0 % D4] = a;
    }
    if (e1 < n) {
        tile[r1 * DP + e1 % D4] = b;
    }
}

@compute @workgroup_size(WG)
fn chunk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    // Positions beyond the cache cannot have been written: clamp (the host keeps pos < CTX).
    let n = min(state.pos + 1u, CTX);
    let cl = chunk_len(n);
    let c = wid.x;
    let h = wid.y;
    let t0 = c * cl;
    if (t0 >= n) {
        return;
    }
    let len = min(cl, n - t0);

    // Queries of the G heads of this group, pre-scaled by 1/sqrt(D).
    for (var i = li; i < G * D4; i += WG) {
        qs[i] = qkv[h * G * D4 + i] * SCALE;
    }

    // Scores, one tile of P positions at a time: thread (g, t) dots query g with tile row t.
    for (var tt = 0u; tt < len; tt += P) {
        let rows = min(P, len - tt);
        workgroupBarrier();
        stage(false, t0 + tt, h, rows, li);
        workgroupBarrier();
        for (var i = li; i < G * P; i += WG) {
            let g = i / P;
            let t = i % P;
            if (t < rows) {
                var acc = 0.0;
                for (var d = 0u; d < D4; d++) {
                    acc += dot(qs[g * D4 + d], tile[t * DP + d]);
                }
                sc[g * CMAX + tt + t] = acc;
            }
        }
    }
    workgroupBarrier();

    // Per-head max then exp-sum over the chunk: LG lanes per head, tree reductions.
    let g = li / LG;
    let lane = li % LG;
    var m = -3.4028235e38;
    if (g < G) {
        for (var t = lane; t < len; t += LG) {
            m = max(m, sc[g * CMAX + t]);
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
            let p = exp(sc[g * CMAX + t] - m);
            sc[g * CMAX + t] = p;
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

    // Weighted sum of V, one tile at a time: output o = (head, vec4 of D), OPT per thread.
    var acc: array<vec4<f32>, OPT>;
    for (var j = 0u; j < OPT; j++) {
        acc[j] = vec4<f32>(0.0);
    }
    for (var tt = 0u; tt < len; tt += P) {
        let rows = min(P, len - tt);
        workgroupBarrier();
        stage(true, t0 + tt, h, rows, li);
        workgroupBarrier();
        for (var j = 0u; j < OPT; j++) {
            let o = li + j * WG;
            if (o < G * D4) {
                let gg = o / D4;
                let d = o % D4;
                var a = acc[j];
                for (var t = 0u; t < rows; t++) {
                    a += sc[gg * CMAX + tt + t] * tile[t * DP + d];
                }
                acc[j] = a;
            }
        }
    }
    for (var j = 0u; j < OPT; j++) {
        let o = li + j * WG;
        if (o < G * D4) {
            let qh = h * G + o / D4;
            part_o[(qh * NC + c) * D4 + o % D4] = acc[j];
        }
    }
    workgroupBarrier();
    if (li < G) {
        part_ml[(h * G + li) * NC + c] = stat[li];
    }
}
