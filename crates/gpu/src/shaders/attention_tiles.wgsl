// The tiled chunk body of attention.wgsl (`AttnForm::Tiles`, appended by the host with `stage`'s
// and `prefetch`'s per-load lines written out, attention_wgsl.rs `tiles_body`): K and V pass
// through shared-memory tiles of P rows, K tiles first (scores of the whole chunk), then the
// softmax, then V tiles, one thread per (head, position) for the scores and per (head, vec4 of
// D) for the weighted sum of V. Needs the prelude's consts and attention.wgsl's bindings, `Site`,
// `qs`, `red`, `stat` and `kown`.

// One tile of P cache rows (K, then V), row stride DP vec4 so the score loop's rows hit
// different banks.
var<workgroup> tile: array<vec4<f32>, P * DP>;
// Scores, then probabilities, of the chunk: [G, CMAX] f32, held as vec4s so the V phase reads
// four rows' probabilities in one load where rows come in aligned fours (`SC4`, a host constant:
// CMAX and P multiples of 4); `sc_get` / `sc_set` address single elements.
var<workgroup> sc: array<vec4<f32>, (G * CMAX + 3u) / 4u>;
fn sc_get(i: u32) -> f32 {
    return sc[i >> 2u][i & 3u];
}
fn sc_set(i: u32, v: f32) {
    sc[i >> 2u][i & 3u] = v;
}

// Stage `rows` cache rows of site `s` starting at position t0 of kv head h into `tile`: element
// e < rows * D4 is row e / D4, vec4 e % D4; thread li takes elements li + j WG, j < LPT (P * D4
// <= LPT * WG). Position `own` (or none: 0xffffffff) comes from this workgroup's own k (`kown`)
// and raw v (qkv) rather than the cache. All the thread's loads are issued before any store.
fn stage(s: Site, is_v: bool, t0: u32, h: u32, rows: u32, li: u32, own: u32) {
    let n = rows * D4;
    // vec4 index of kv head h's raw v in qkv.
    let vb = s.qkv / 4u + (HQ + HKV + h) * D4;
    // STAGE_LOADS, STAGE_STORES: expanded by the host (attention_wgsl.rs `stage_body`) once per
    // load j < LPT into separate variables (e{j}, a{j}): a per-thread array indexed in a loop
    // may be placed in slow local memory by the driver's compiler.
    //STAGE_LOADS
    //STAGE_STORES
}

// The chunk's first tile of K and V rows (up to P), loaded into registers as `attend` begins:
// the cache does not depend on this step's q/k norms and RoPE, so those loads overlap that work
// instead of following it (two memory round trips off a short chunk's critical path). Row
// `own`'s v comes from qkv (final when the dispatch starts); its k is the roped one the owning
// workgroup computes later, substituted when the tile is stored (`stage_pre`). PRE_FIELDS,
// PRE_LOADS, PRE_STORES: expanded by the host per load j < LPT, like `stage`.
struct Pre {
    //PRE_FIELDS
};
fn prefetch(s: Site, t0: u32, h: u32, rows: u32, li: u32, own: u32) -> Pre {
    let n = rows * D4;
    let vb = s.qkv / 4u + (HQ + HKV + h) * D4;
    var p: Pre;
    //PRE_LOADS
    return p;
}
// `stage` for the prefetched first tile: K (with row `own` from `kown`) or V.
fn stage_pre(p: Pre, is_v: bool, t0: u32, rows: u32, li: u32, own: u32) {
    let n = rows * D4;
    //PRE_STORES
}

// The whole kernel for site `s` (the caller has checked the done flags). Constants per entry
// point: `single` picks the output; `write_kv` as `chunk_of` says.
fn attend(wid: vec3<u32>, li: u32, s: Site, single: bool, write_kv: bool) {
    let ch = chunk_of(wid, s, write_kv);
    if (ch.len == 0u) {
        return;
    }
    let c = ch.c;
    let h = ch.h;
    let t0 = ch.t0;
    let len = ch.len;
    let own = ch.own;

    let pre = prefetch(s, t0, h, min(P, len), li, own);
    prepare(s, ch, li);

    // Scores, one tile of P positions at a time: thread (g, t) dots query g with tile row t.
    for (var tt = 0u; tt < len; tt += P) {
        let rows = min(P, len - tt);
        workgroupBarrier();
        if (tt == 0u) {
            stage_pre(pre, false, t0, rows, li, own);
        } else {
            stage(s, false, t0 + tt, h, rows, li, own);
        }
        workgroupBarrier();
        for (var i = li; i < G * P; i += WG) {
            let g = i / P;
            let t = i % P;
            if (t < rows) {
                // Four independent partial sums: a one-accumulator chain of D4 dots is what
                // bounds this loop (shared-memory loads are cheap next to the dependent adds).
                let qb = g * D4;
                let kb = t * DP;
                var a = vec4<f32>(0.0);
                var d = 0u;
                for (; d + 4u <= D4; d += 4u) {
                    a += vec4<f32>(
                        dot(qs[qb + d], tile[kb + d]),
                        dot(qs[qb + d + 1u], tile[kb + d + 1u]),
                        dot(qs[qb + d + 2u], tile[kb + d + 2u]),
                        dot(qs[qb + d + 3u], tile[kb + d + 3u]));
                }
                for (; d < D4; d++) {
                    a.x += dot(qs[qb + d], tile[kb + d]);
                }
                sc_set(g * CMAX + tt + t, (a.x + a.y) + (a.z + a.w));
            }
        }
    }
    softmax(len, li);

    // Weighted sum of V, one tile at a time: output o = (head, vec4 of D), OPT per thread.
    var acc: array<vec4<f32>, OPT>;
    for (var j = 0u; j < OPT; j++) {
        acc[j] = vec4<f32>(0.0);
    }
    for (var tt = 0u; tt < len; tt += P) {
        let rows = min(P, len - tt);
        workgroupBarrier();
        if (tt == 0u) {
            stage_pre(pre, true, t0, rows, li, own);
        } else {
            stage(s, true, t0 + tt, h, rows, li, own);
        }
        workgroupBarrier();
        for (var j = 0u; j < OPT; j++) {
            let o = li + j * WG;
            if (o < G * D4) {
                let gg = o / D4;
                let d = o % D4;
                // Two chains (even and odd rows) instead of one.
                var a = acc[j];
                var b = vec4<f32>(0.0);
                var t = 0u;
                if (SC4) {
                    // The same fmas in the same order as the pairs below: even rows into a,
                    // odd into b.
                    for (; t + 4u <= rows; t += 4u) {
                        let p = sc[(gg * CMAX + tt + t) >> 2u];
                        a = fma(vec4<f32>(p.x), tile[t * DP + d], a);
                        b = fma(vec4<f32>(p.y), tile[(t + 1u) * DP + d], b);
                        a = fma(vec4<f32>(p.z), tile[(t + 2u) * DP + d], a);
                        b = fma(vec4<f32>(p.w), tile[(t + 3u) * DP + d], b);
                    }
                }
                for (; t + 2u <= rows; t += 2u) {
                    a = fma(vec4<f32>(sc_get(gg * CMAX + tt + t)), tile[t * DP + d], a);
                    b = fma(vec4<f32>(sc_get(gg * CMAX + tt + t + 1u)), tile[(t + 1u) * DP + d], b);
                }
                if (t < rows) {
                    a = fma(vec4<f32>(sc_get(gg * CMAX + tt + t)), tile[t * DP + d], a);
                }
                acc[j] = a + b;
            }
        }
    }
    if (single) {
        // One chunk: (m, l) are final; scale by 1/l as the combine does with a single partial.
        for (var j = 0u; j < OPT; j++) {
            let o = li + j * WG;
            if (o < G * D4) {
                out[(s.qh0 + h * G) * D4 + o] = acc[j] * (1.0 / stat[o / D4].y);
            }
        }
        return;
    }
    for (var j = 0u; j < OPT; j++) {
        let o = li + j * WG;
        if (o < G * D4) {
            let qh = s.qh0 + h * G + o / D4;
            part_o[(qh * NC + c) * D4 + o % D4] = acc[j];
        }
    }
    workgroupBarrier();
    if (li < G) {
        part_ml[(s.qh0 + h * G + li) * NC + c] = stat[li];
    }
}
