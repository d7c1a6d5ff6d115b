// The attention of one decode step folded into the qkv matvec's dispatch (qkv_attention.rs):
// appended by the host to matvec_q4f.wgsl in its norm-on-load form (bindings 0-6, `y` = the
// raw q|k|v, declared coherent here, and the workgroup array `red`) and to attention_rope.wgsl
// (its `qkv_at` reading `y`), whose `rope_prepare` / `roped4` give the very bits of the chunk
// kernel's q/k norm + RoPE.
// Prepended consts: D, D4 (= D/4), HQ, HKV, G (= HQ/HKV), CTX (cache rows), WG (= 256, the
// matvec's workgroup), LR (lanes per head vector in the norm reduction), LG (power-of-two lanes
// per query head in the softmax, LG * G <= WG), EPS, SCALE (= 1/sqrt(D)), MAXP (the most
// positions a step attends over: the host records this form only for pos < MAXP), QKV_RPW (rows
// per workgroup of the matvec, a divisor of D, so one workgroup's rows belong to one kv head) and
// ARRIVALS (= (G + 2) D / QKV_RPW, the workgroups whose rows feed one kv head).
//
// Every matvec workgroup, once its rows are stored, counts itself in its kv head's `arrive`
// counter (storageBarrier before: device-scope release in naga's SPIR-V; y is @coherent). The
// last of a kv head's ARRIVALS workgroups to arrive (after a device-scope acquire) has that
// head's q, k and v complete and attends alone over positions 0..=pos: q/k norm + RoPE, the
// KV-cache write of row pos, scores (one thread per position, the G heads' dots in named
// registers), the softmax (LG lanes per head), and the weighted sum of V (thread o = (c, head)
// with c = o / G, so the G threads of one V vec4 sit side by side and share its load). One
// workgroup per kv head replaces the chunk dispatch: below MAXP positions that is less time
// than a dispatch of its own (BENCHMARKS). Vulkan only (Context::publishes_across_workgroups).
//
// Shapes:
// q_norm, k_norm [D] f32; inv_freq [D/2] f32 (attention.rs `inv_freq`)
// k_cache, v_cache [CTX, HKV, D] KV (attention_wgsl.rs `kv_wgsl`); row pos receives the roped k
//          and raw v
// att      [HQ * D] f32 viewed as vec4: the attention output (normalised)
// arrive   [HKV] atomic u32: workgroups counted so far; 0 between dispatches (the last one puts
//          its counter back)

@group(0) @binding(7) var<storage, read> q_norm: array<f32>;
@group(0) @binding(8) var<storage, read> k_norm: array<f32>;
@group(0) @binding(9) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(10) var<storage, read_write> k_cache: array<KV>;
@group(0) @binding(11) var<storage, read_write> v_cache: array<KV>;
@group(0) @binding(12) var<storage, read_write> att: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> arrive: array<atomic<u32>>;

var<workgroup> fa_last: u32;
// The matvec's staging `nol_xs` (1024 vec4), which no thread reads once the row sums began,
// holds the tail's vectors: the roped queries pre-scaled by 1/sqrt(D) at [0, G D4) and this
// head's raw q | k | v copied from `y` at [QX0, QX0 + (G + 2) D4) (QX0 = G D4), then the
// partial sums of V over position groups ((2 G + 2) D4 and PG / 2 * G * D4 <= 1024, checked by
// the host).
const QX0: u32 = G * D4;
// The kv head being attended (uniform): where `qkv_at` finds an index of the projection.
var<private> fa_h: u32;

// Element i of the projection (an index into y, within head fa_h's q, k or v) from the copy.
fn fa_x(i: u32) -> f32 {
    var j: u32;
    if (i < HQ * D) {
        j = i - fa_h * G * D;
    } else if (i < (HQ + HKV) * D) {
        j = G * D + i - (HQ + fa_h) * D;
    } else {
        j = (G + 1u) * D + i - (HQ + HKV + fa_h) * D;
    }
    return nol_xs[QX0 + j / 4u][j % 4u];
}
// Scores, then exp(s - m): [MAXP, G] (position-major, so the G heads of one position are
// adjacent for the weighted sum).
var<workgroup> fa_p: array<f32, MAXP * G>;
// Per head: the max, then 1 / the sum of exps.
var<workgroup> fa_ml: array<f32, G>;

// The kv head that workgroup wg's rows (q, k or v) belong to.
fn kv_head_of(wg: u32) -> u32 {
    let r = wg * QKV_RPW;
    if (r < HQ * D) {
        return r / (G * D);
    }
    if (r < (HQ + HKV) * D) {
        return (r - HQ * D) / D;
    }
    return min((r - (HQ + HKV) * D) / D, HKV - 1u);
}

// Called by every thread of every matvec workgroup after its row stores (uniform control flow).
fn attn_tail(wg: u32, li: u32) {
    // Workgroups past the matrix (a grid rounded up to two dimensions) neither count nor attend.
    if (wg * QKV_RPW >= (HQ + 2u * HKV) * D) {
        return;
    }
    let h = kv_head_of(wg);
    storageBarrier();
    if (li == 0u) {
        fa_last = u32(atomicAdd(&arrive[h], 1u) + 1u == ARRIVALS);
    }
    if (workgroupUniformLoad(&fa_last) == 0u) {
        return;
    }
    storageBarrier();
    if (li == 0u) {
        atomicStore(&arrive[h], 0u);
    }
    attend_head(h, li);
}

fn attend_head(h: u32, li: u32) {
    //@STOP_START
    let pos = state.pos;
    // Positions beyond the cache cannot have been written: clamp (the host keeps pos < CTX).
    let n = min(pos + 1u, CTX);
    // One pass of loads of this head's q, k, v from y (coherent: each load goes to L2, so all
    // are issued before any is used, instead of a chain of them inside the norm and RoPE).
    fa_h = h;
    for (var j = li; j < (G + 2u) * D4; j += WG) {
        var e: u32;
        if (j < G * D4) {
            e = h * G * D + 4u * j;
        } else if (j < (G + 1u) * D4) {
            e = (HQ + h) * D + 4u * (j - G * D4);
        } else {
            e = (HQ + HKV + h) * D + 4u * (j - (G + 1u) * D4);
        }
        nol_xs[QX0 + j] = vec4<f32>(y[e], y[e + 1u], y[e + 2u], y[e + 3u]);
    }
    workgroupBarrier();
    rope_prepare(0u, h, pos, li, 0u);
    for (var o = li; o < G * D4; o += WG) {
        nol_xs[o] = roped4(0u, h, o / D4, o % D4) * SCALE;
    }
    if (pos < CTX) {
        let row = (pos * HKV + h) * D4;
        for (var d = li; d < D4; d += WG) {
            k_cache[row + d] = kv_out(roped4(0u, h, G, d));
            v_cache[row + d] = kv_out(nol_xs[QX0 + (G + 1u) * D4 + d]);
        }
    }
    // Row pos is read back below by other threads of this workgroup; the queries likewise.
    storageBarrier();
    workgroupBarrier();
    // kernel_bench's ablation rows end the tail at the //@STOP_ marks.
    //@STOP_ROPE

    // Scores: thread t dots the G queries with cache row t. Written out by the host: the row's
    // loads in groups of 8 issued before their dots (as a loop, one load per iteration, the
    // driver kept them in a chain: ~12 us at position 1 on the H200, BENCHMARKS run 100).
    for (var t = li; t < n; t += WG) {
        let row = (t * HKV + h) * D4;
        //SCORE_DECL
        //SCORE_BODY
        //SCORE_STORE
    }
    workgroupBarrier();
    //@STOP_SCORES

    // Softmax per head: LG lanes each take every LG-th position; lane 0 folds the LG partials.
    let g = li / LG;
    let lane = li % LG;
    var m = -3.4028235e38;
    if (g < G) {
        for (var t = lane; t < n; t += LG) {
            m = max(m, fa_p[t * G + g]);
        }
    }
    red[li] = m;
    workgroupBarrier();
    if (g < G && lane == 0u) {
        var mm = red[li];
        for (var j = 1u; j < LG; j++) {
            mm = max(mm, red[li + j]);
        }
        fa_ml[g] = mm;
    }
    workgroupBarrier();
    var l = 0.0;
    if (g < G) {
        m = fa_ml[g];
        for (var t = lane; t < n; t += LG) {
            let e = exp(fa_p[t * G + g] - m);
            fa_p[t * G + g] = e;
            l += e;
        }
    }
    red[li] = l;
    workgroupBarrier();
    if (g < G && lane == 0u) {
        var s = 0.0;
        for (var j = 0u; j < LG; j++) {
            s += red[li + j];
        }
        fa_ml[g] = 1.0 / s;
    }
    workgroupBarrier();
    //@STOP_SOFTMAX

    // Weighted sum of V: thread (c = li % D4, group pg = li / D4) sums positions pg, pg + PG,
    // .. for the G heads (each V vec4 loaded once, the loads of a thread independent of each
    // other), then the PG groups' partials meet in a tree through nol_xs (the queries are no
    // longer read).
    // Each round of a thread loads PVU rows before using them (written out by the host); rows
    // past n repeat row n - 1 with weight 0, which adds exactly nothing.
    let c = li % D4;
    let pg = li / D4;
    //PV_DECL
    if (pg < PG) {
        for (var t0 = pg; t0 < n; t0 += PVU * PG) {
            //PV_LOADS
            //PV_BODY
        }
    }
    for (var half = PG / 2u; half > 0u; half >>= 1u) {
        workgroupBarrier();
        if (pg >= half && pg < 2u * half) {
            //PV_PUT
        }
        workgroupBarrier();
        if (pg < half) {
            //PV_ADD
        }
    }
    if (pg == 0u) {
        //PV_STORE
    }
}
