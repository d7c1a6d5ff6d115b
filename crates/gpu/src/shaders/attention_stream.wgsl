// The streamed chunk body of attention.wgsl (`AttnForm::Stream`, appended by the host with its
// per-load and per-head lines written out, attention_wgsl.rs `stream_body`). The same math as
// the tiled body (attention_tiles.wgsl) with less shared-memory traffic and more loads in
// flight per thread, so a few long chunks per kv head keep the memory busy (the tiled body
// needs many short ones, and each pays its own q norm + RoPE and softmax trees):
// - K passes through a shared-memory block of P rows, as before, but the block's loads go to
//   registers one block ahead (the loads of block b + 1 are in flight while block b is scored),
//   and a score thread (row t, head slice) reads each key vec4 once for GH heads (the tiled
//   body reads it once per head): thread li scores row li % P for heads (li / P) * GH .. + GH.
// - V never enters shared memory: thread (vt, vd) = (li / D4, li % D4), vt < TS, reads vec4 vd
//   of rows vt, vt + TS, ... straight from the cache (a row is D4 consecutive vec4s: a
//   coalesced load across the lanes of one vt), LV rows per batch with the next batch in flight,
//   and accumulates all G heads (`acc{g}`, named registers) with the probabilities from `sc`
//   (one address per vt: a broadcast). The first batch is issued as the kernel begins. The TS
//   partial sums of each (head, vec4) then meet in `tile`, GR heads per round, and are added in
//   vt order.
// Host consts besides the prelude's: LK (key loads per thread per block: P * D4 <= LK * WG), TS
// (= WG / D4, V row lanes), LV (V rows per thread per batch), SGN (= WG / P head slices), GH (=
// ceil(G / SGN) heads per score thread), GR (heads per reduction round: GR * TS * D4 <= TILE_N),
// TILE_N (= max(P * DP, TS * D4): the key block, then the V partials).

// One block of P key rows (row stride DP vec4 so the score loop's rows hit different banks),
// then the V partial sums of the final reduction ([TS, GR, D4] per round).
var<workgroup> tile: array<vec4<f32>, TILE_N>;
// Scores, then probabilities, of the chunk: [G, CMAX].
var<workgroup> sc: array<f32, G * CMAX>;
fn sc_get(i: u32) -> f32 {
    return sc[i];
}
fn sc_set(i: u32, v: f32) {
    sc[i] = v;
}

// A thread's share of one key block in registers: element e = li + j WG (row e / D4, vec4
// e % D4) for j < LK. KB_FIELDS: `k{j}: vec4<f32>` per load, written out by the host (a
// per-thread array indexed in a loop may be placed in slow local memory).
struct KBlock {
    //KB_FIELDS
};

// Issue the loads of key rows [t0, t0 + rows) of kv head h (site s) into registers. Row `own`
// (or none: 0xffffffff) is not loaded: `store_k` puts this workgroup's own roped k there.
fn load_k(s: Site, t0: u32, h: u32, rows: u32, li: u32, own: u32) -> KBlock {
    let n = rows * D4;
    var b: KBlock;
    //KB_LOADS
    return b;
}

// Store a block loaded by `load_k` into `tile` (row `own` from `kown`).
fn store_k(b: KBlock, t0: u32, rows: u32, li: u32, own: u32) {
    let n = rows * D4;
    //KB_STORES
}

// A V thread's batch of LV rows: row base + vt + j TS holds `v{j}` (VB_FIELDS, written out).
struct VBatch {
    //VB_FIELDS
};

// Issue the loads of the batch at chunk row `base` (rows < len) for V lane (vt, vd) of kv head h;
// the chunk starts at position t0 and row `own` is this step's raw v from qkv (final when the
// dispatch starts), rounded as the cache holds it.
fn load_v(s: Site, t0: u32, base: u32, len: u32, h: u32, vt: u32, vd: u32, own: u32) -> VBatch {
    let vb = s.qkv / 4u + (HQ + HKV + h) * D4;
    var b: VBatch;
    //VB_LOADS
    return b;
}

// The whole kernel for site `s` (see attention_tiles.wgsl `attend`, whose contract this keeps:
// `single` picks the output, `write_kv` makes the owning workgroup norm, rope and write row pos).
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

    // The first key block's and the first V batch's loads overlap the q/k norms and RoPE and
    // the scores (the cache does not depend on them; row `own` is substituted, never read).
    var kb = load_k(s, t0, h, min(P, len), li, own);
    let vt = li / D4;
    let vd = li % D4;
    let vlive = vt < TS;
    var vbat: VBatch;
    if (vlive) {
        vbat = load_v(s, t0, 0u, len, h, vt, vd, own);
    }
    prepare(s, ch, li);

    // Scores, one key block at a time, the next block's loads in flight meanwhile.
    let st = li % P;
    let gs = li / P;
    for (var tt = 0u; tt < len; tt += P) {
        let rows = min(P, len - tt);
        workgroupBarrier();
        store_k(kb, t0 + tt, rows, li, own);
        workgroupBarrier();
        if (tt + P < len) {
            kb = load_k(s, t0 + tt + P, h, min(P, len - tt - P), li, own);
        }
        // Slices past the last head (16-row blocks at G = 8) have nothing to score.
        if (gs < SGN && gs * GH < G && st < rows) {
            score_row(st, tt, gs * GH);
        }
    }

    softmax(len, li);

    // Weighted sum of V: LV rows per batch per V lane, the next batch in flight.
    //ACC_DECL
    if (vlive) {
        for (var base = 0u; base < len; base += LV * TS) {
            let cur = vbat;
            if (base + LV * TS < len) {
                vbat = load_v(s, t0, base + LV * TS, len, h, vt, vd, own);
            }
            //VB_ACC
        }
    }

    // The TS partial sums of each (head, vec4) through `tile`, GR heads per round (the last
    // score reads of `tile` are behind the softmax's barriers), added in vt order.
    //ACC_ROUNDS
    workgroupBarrier();
    if (!single && li < G) {
        part_ml[(s.qh0 + h * G + li) * NC + c] = stat[li];
    }
}

// Scores of chunk row tt + t against query heads g0 .. g0 + GH (those below G) into `sc`:
// every key vec4 read once from `tile` serves the GH heads, and each head's dot is four
// independent chains (a vec4 of fmas) added at the end.
fn score_row(t: u32, tt: u32, g0: u32) {
    //SCORE_ROW
}

// One reduction round: heads g0 .. g0 + GR of `tile` ([TS, GR, D4], put there by every V lane)
// summed in vt order and written out (final and normalised when `single`, else chunk c's
// partials).
fn reduce_round(g0: u32, s: Site, h: u32, c: u32, li: u32, single: bool) {
    for (var o = li; o < GR * D4; o += WG) {
        let j = o / D4;
        let d = o % D4;
        let g = g0 + j;
        if (g < G) {
            var a = tile[j * D4 + d];
            for (var u = 1u; u < TS; u++) {
                a += tile[(u * GR + j) * D4 + d];
            }
            let qh = s.qh0 + h * G + g;
            if (single) {
                out[qh * D4 + d] = a * (1.0 / stat[g].y);
            } else {
                part_o[(qh * NC + c) * D4 + d] = a;
            }
        }
    }
}
