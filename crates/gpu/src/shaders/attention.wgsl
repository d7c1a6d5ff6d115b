// Single-query GQA attention over the KV cache, split over the sequence (flash-decoding style),
// with the q/k RMSNorm + RoPE and the KV-cache write of the step folded in (attention_rope.wgsl,
// appended by the host).
// Prepended by the host: consts D, D4 (= D/4), HQ, HKV, G (= HQ/HKV), C (minimum chunk length),
// CTX (cache rows), NC (the partial stride: the most chunks any position uses), WG (power of
// two), LG (power-of-two lanes per query head in the softmax reductions, LG * G <= WG), LR (lanes
// per head in the norm reduction), P (positions per tile; P * D4 <= LPT * WG, LPT the cache
// loads per thread per tile that the host writes out in `stage`), DP (= D4 + 1, padded tile
// row), CMAX (maximum chunk length), SC4 (bool: CMAX and P multiples of 4), OPT (= ceil(G * D4 / WG) outputs per thread), SCALE (=
// 1/sqrt(D)), EPS, the `State` struct and `chunk_len(n)` (the chunk length used for n positions,
// shared with the combine).
//
// Grid (chunks, HKV). Workgroup (c, h) handles positions [c*L, min((c+1)*L, pos+1)) with
// L = chunk_len(pos+1) for the G query heads sharing kv head h, so each K/V row is read once for
// all G heads. It first norms and ropes its G query heads itself (G*D values, cheap). The one
// workgroup per kv head whose chunk holds `pos` (the last one) also norms and ropes k of head h,
// writes it and the raw v to cache row `pos`, and uses these values for that row instead of
// reading the cache (writes of the same dispatch are not guaranteed visible to loads). The host
// appends one of two bodies defining `attend` and the workgroup arrays `tile` (at least P * DP
// vec4s) and `sc`: attention_tiles.wgsl (K and V through shared-memory tiles of P rows) or
// attention_stream.wgsl (key blocks one ahead in registers, V straight into registers).
// The body (`attend`) works on one `Site`: the position and the offsets of one token's data. The
// single-token entry points below take the run state's position at offset 0; the column forms
// (attention_chunk_cols.wgsl) take column `wid.z`'s position, slot and offsets.
// Entry points:
//   `chunk`  writes the chunk's unnormalised output and its (max, sum); `combine`
//            (attention_combine.wgsl) merges the chunks.
//   `single` for a grid of one chunk per kv head (the host guarantees pos + 1 <= chunk_len):
//            normalises and writes the final f32 output itself.
//   `fused`  `chunk`, then the last chunk of each kv head to finish combines (f32 output only,
//            Vulkan only): one dispatch where the host uses it (few chunks).
//
// Shapes for B columns (B = 1 for the single-token entry points):
// qkv      [B, HQ*D | HKV*D | HKV*D] f32 viewed as vec4: raw q|k|v projection (read only)
// q_norm, k_norm [D] f32; inv_freq [D/2] f32: theta^(-2i/D) from the host (f64, rounded)
// k/v      [slots, CTX, HKV, D] KV (f32 viewed as vec4, or f16 as vec2<u32>: the host's `kv_wgsl`
//          with kv_in / kv_out / kv_round); row pos of the site's slot receives the roped k and
//          the raw v (single token: one slot), and rows substituted for it go through kv_round
// part_o   [B, HQ, NC, D] f32 viewed as vec4: Σ_t exp(s_t - m_c) v_t over the chunk
// part_ml  [B, HQ, NC] vec2<f32>: (m_c, l_c) = (max_t s_t, Σ_t exp(s_t - m_c))
// out      [B, HQ*D] f32 viewed as vec4 (`single`, `fused`)
// arrive   [B, HKV] atomic u32 (`fused`)

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> q_norm: array<f32>;
@group(0) @binding(3) var<storage, read> k_norm: array<f32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<KV>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<KV>;
/*COHERENT*/@group(0) @binding(7) var<storage, read_write> part_o: array<vec4<f32>>;
/*COHERENT*/@group(0) @binding(8) var<storage, read_write> part_ml: array<vec2<f32>>;
@group(0) @binding(9) var<storage, read_write> out: array<vec4<f32>>;

// Where one token's attention reads and writes.
struct Site {
    // Position of the token (its cache row within the slot).
    pos: u32,
    // Element offset of its q|k|v in qkv (column * (HQ + 2 HKV) * D).
    qkv: u32,
    // Cache row of its slot's position 0 (slot * CTX).
    row0: u32,
    // Its first query head in part_o / part_ml / out (column * HQ).
    qh0: u32,
};

// Roped queries of the G heads, pre-scaled by 1/sqrt(D): [G, D4].
var<workgroup> qs: array<vec4<f32>, G * D4>;
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<vec2<f32>, G>;
// Roped k of this step's row `pos` as the cache holds it (owning workgroup only): [D4].
var<workgroup> kown: array<vec4<f32>, D4>;

// The chunk workgroup (c, h) = wid.xy of site `s` attends over: positions [t0, t0 + len), and
// `own`, the position whose k/v this workgroup writes and substitutes (0xffffffff: none).
struct Chunk {
    c: u32,
    h: u32,
    t0: u32,
    // 0: past the positions (the workgroup has nothing to do).
    len: u32,
    own: u32,
};

// The chunk of workgroup `wid` for site `s`; `write_kv`: the workgroup whose chunk holds `pos`
// (the last one) norms, ropes and writes row pos itself (else a previous dispatch wrote it and
// it is read from the cache like the rest).
fn chunk_of(wid: vec3<u32>, s: Site, write_kv: bool) -> Chunk {
    let pos = s.pos;
    // Positions beyond the cache cannot have been written: clamp (the host keeps pos < CTX).
    let n = min(pos + 1u, CTX);
    let cl = chunk_len(n);
    let t0 = wid.x * cl;
    if (t0 >= n) {
        return Chunk(wid.x, wid.y, t0, 0u, 0xffffffffu);
    }
    let len = min(cl, n - t0);
    // t0 <= pos here, so this is "the chunk holds pos" (the last chunk), with pos in the cache.
    var own = 0xffffffffu;
    if (write_kv && pos < CTX && pos - t0 < len) {
        own = pos;
    }
    return Chunk(wid.x, wid.y, t0, len, own);
}

// The G query heads of kv head ch.h normed, roped and pre-scaled into `qs`; the owning
// workgroup's roped k (as the cache holds it) into `kown`, and its k and raw v into cache row
// pos. Called in uniform control flow (rope_prepare's barriers).
fn prepare(s: Site, ch: Chunk, li: u32) {
    let h = ch.h;
    rope_prepare(s.qkv, h, s.pos, li, 0u);
    for (var o = li; o < G * D4; o += WG) {
        qs[o] = roped4(s.qkv, h, o / D4, o % D4) * SCALE;
    }
    if (ch.own != 0xffffffffu) {
        let row = ((s.row0 + s.pos) * HKV + h) * D4;
        let vb = s.qkv / 4u + (HQ + HKV + h) * D4;
        for (var d = li; d < D4; d += WG) {
            let k = roped4(s.qkv, h, G, d);
            kown[d] = kv_round(k);
            k_cache[row + d] = kv_out(k);
            v_cache[row + d] = kv_out(qkv[vb + d]);
        }
    }
}

// The chunk's softmax over the `len` scores of each head in `sc` (the body's `sc_get` /
// `sc_set`): per-head max, then exp(s - max) in place and its sum, LG lanes per head in tree
// reductions over `red`; (max, sum) into `stat`. Starts with a barrier (the scores are all
// written), ends with `stat` written (a barrier before it is read).
fn softmax(len: u32, li: u32) {
    workgroupBarrier();
    let g = li / LG;
    let lane = li % LG;
    var m = -3.4028235e38;
    if (g < G) {
        for (var t = lane; t < len; t += LG) {
            m = max(m, sc_get(g * CMAX + t));
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
            let p = exp(sc_get(g * CMAX + t) - m);
            sc_set(g * CMAX + t, p);
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
}

// The single token of the run state: offsets 0, one slot.
fn state_site() -> Site {
    return Site(state.pos, 0u, 0u, 0u);
}

@compute @workgroup_size(WG)
fn chunk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    attend(wid, li, state_site(), false, true);
}

@compute @workgroup_size(WG)
fn single(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    attend(wid, li, state_site(), true, true);
}

// Fused forms only: chunks that have finished, per (column, kv head) [B * HKV]; 0 between
// dispatches (the last chunk of a kv head puts its counter back). Binding 12: the column forms
// take 10 and 11.
@group(0) @binding(12) var<storage, read_write> arrive: array<atomic<u32>>;
var<workgroup> last_in: u32;

// Merge the nc chunk partials of the G query heads of kv head h into `out`, as `combine` does
// (attention_combine.wgsl) but inside the chunk dispatch: thread (g, d4) walks the chunks itself
// (two passes: the max, then the weighted sums), so each chunk's part_o costs a round trip to L2
// (~0.3 us per chunk on the H200): the host keeps this to few chunks (attention.rs
// FUSED_MAX_CHUNKS). The (max, sum) pairs are first copied into the tile (free once `attend` has
// returned), all in parallel, so the two walks read them from workgroup memory: part_ml is
// `@coherent` (loads go to L2), and walking it twice in series from there cost ~0.8% of a token
// (H200, 2026-11-30). Where they do not fit the tile, the walks read them from part_ml. The
// second walk loads four chunks' part_o at a time (the sums still in chunk order, so the bits
// are those of one chunk at a time): with both, the coherent form is as fast as the plain one
// was (BENCHMARKS run 53).
// Kept lean on purpose: the combine's registers count against the whole chunk kernel's
// occupancy (loading 8 chunks at a time made every position slower, BENCHMARKS run 34).
fn combine_group(s: Site, h: u32, nc: u32, li: u32) {
    let staged = G * nc <= P * DP;
    if (staged) {
        for (var i = li; i < G * nc; i += WG) {
            tile[i] = vec4<f32>(part_ml[(s.qh0 + h * G + i / nc) * NC + i % nc], 0.0, 0.0);
        }
    }
    workgroupBarrier();
    for (var j = 0u; j < OPT; j++) {
        let o = li + j * WG;
        if (o < G * D4) {
            let gi = o / D4;
            let qh = s.qh0 + h * G + gi;
            let d4 = o % D4;
            var m = -3.4028235e38;
            for (var c = 0u; c < nc; c++) {
                m = max(m, chunk_ml(staged, gi * nc + c, qh * NC + c).x);
            }
            var l = 0.0;
            var a = vec4<f32>(0.0);
            // Four chunks' part_o loads in flight at a time; the sums keep chunk order.
            var c = 0u;
            for (; c + 4u <= nc; c += 4u) {
                let b = (qh * NC + c) * D4 + d4;
                let o0 = part_o[b];
                let o1 = part_o[b + D4];
                let o2 = part_o[b + 2u * D4];
                let o3 = part_o[b + 3u * D4];
                let ml0 = chunk_ml(staged, gi * nc + c, qh * NC + c);
                let ml1 = chunk_ml(staged, gi * nc + c + 1u, qh * NC + c + 1u);
                let ml2 = chunk_ml(staged, gi * nc + c + 2u, qh * NC + c + 2u);
                let ml3 = chunk_ml(staged, gi * nc + c + 3u, qh * NC + c + 3u);
                let w0 = exp(ml0.x - m);
                l += w0 * ml0.y;
                a = fma(vec4<f32>(w0), o0, a);
                let w1 = exp(ml1.x - m);
                l += w1 * ml1.y;
                a = fma(vec4<f32>(w1), o1, a);
                let w2 = exp(ml2.x - m);
                l += w2 * ml2.y;
                a = fma(vec4<f32>(w2), o2, a);
                let w3 = exp(ml3.x - m);
                l += w3 * ml3.y;
                a = fma(vec4<f32>(w3), o3, a);
            }
            for (; c < nc; c++) {
                let ml = chunk_ml(staged, gi * nc + c, qh * NC + c);
                let w = exp(ml.x - m);
                l += w * ml.y;
                a = fma(vec4<f32>(w), part_o[(qh * NC + c) * D4 + d4], a);
            }
            out[qh * D4 + d4] = a * (1.0 / l);
        }
    }
}

// One chunk's (max, sum): from the tile at `t` when staged, else from part_ml at `g`.
fn chunk_ml(staged: bool, t: u32, g: u32) -> vec2<f32> {
    if (staged) {
        return tile[t].xy;
    }
    return part_ml[g];
}

// `chunk` then, in the last chunk workgroup of each kv head to finish, the combine: one
// dispatch per layer (the host uses it up to FUSED_MAX_CHUNKS chunks per kv head). Each chunk publishes its partials (storageBarrier:
// device-scope release in naga's SPIR-V), then counts itself in `arrive[ai]`; the one that
// counts last (after a device-scope acquire) reads every chunk's partials. Vulkan only
// (attention.rs `Combine`): other backends' barriers are not guaranteed to order memory across
// workgroups. One chunk: `single`'s path (no partials, no count).
fn attend_fused(wid: vec3<u32>, li: u32, s: Site, ai: u32, write_kv: bool) {
    let n = min(s.pos + 1u, CTX);
    let cl = chunk_len(n);
    let nc = (n + cl - 1u) / cl;
    if (nc == 1u) {
        attend(wid, li, s, true, write_kv);
        return;
    }
    // Workgroups past the last chunk neither attend nor count.
    if (wid.x >= nc) {
        return;
    }
    attend(wid, li, s, false, write_kv);
    storageBarrier();
    if (li == 0u) {
        last_in = u32(atomicAdd(&arrive[ai], 1u) + 1u == nc);
    }
    if (workgroupUniformLoad(&last_in) == 0u) {
        return;
    }
    storageBarrier();
    if (li == 0u) {
        atomicStore(&arrive[ai], 0u);
    }
    combine_group(s, wid.y, nc, li);
}

@compute @workgroup_size(WG)
fn fused(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    attend_fused(wid, li, state_site(), wid.y, true);
}
