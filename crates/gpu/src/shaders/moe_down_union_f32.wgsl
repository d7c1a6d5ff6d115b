// Expert down matvecs + routing-weighted combine over columns (multi-column runs, columns.rs),
// reading each chosen expert's down rows once for all the columns that chose it; every output is
// bit-identical to moe_down_f32.wgsl run on its column alone.
// Prepended by the host: consts E, K, WG, T (lanes per row: the single-token kernel's, which
// fixes each row's summation order), H, I, NB (= I / 32), KNB (= K * NB), P (= 8 K column
// (column, rank) pairs), UMAX (= min(E, P) union experts), EB (union experts staged at once),
// G (h slots staged at once), J (items
// per lane = ceil(KNB / T)), the `State` struct, F32_DEQ (numerics.rs: `dq_block`),
// moe_stage_f32.wgsl and columns.wgsl.
// Grid: ceil(H / (WG / T)) workgroups (spread over x, y); team t of a workgroup owns row
// wg * (WG / T) + t for every column.
//
// Why this shape: in the single-token kernel lane l of a row's team accumulates its items
// it = l, l + T, ... (item = (rank it / NB, block it % NB)) in one fma chain that interleaves the
// K experts, so a column's row cannot be split across workgroups by expert without changing
// that order. Here one workgroup walks the union of the experts (held by this part) that the
// live columns chose, in batches of up to EB consecutive union experts (and G pairs): per batch
// it stages the experts' blocks of the workgroup's rows (one read of those bytes, loaded one
// batch ahead) and the h slots of the pairs that chose them, and each lane computes the block
// dots `dq_block(w, h)` of its items of those pairs into
// registers (d{c}_{j}, with the weight scale in s{c}_{j}; host-expanded per column c < 8 and
// item j). After the last expert each lane runs its chains in item order,
// acc = fma(w_k * s, d, acc) exactly as the single-token kernel, and the team sums are the same
// ordered sums.
//
// route  [nb, 2K] u32: per column ids then f32 weight bits (gate_up output)
// h      [nb, K*I] f32 (vec4 binding)
// qs, sc [(e_hi-e_lo)*H*NB] Q4_0 blocks of the part (tensor.rs layout)
// out    [nb, H] f32
// cols   [8] Col

struct Params { e_lo: u32, e_hi: u32, accumulate: u32, nb: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> route: array<u32>;
@group(0) @binding(3) var<storage, read> h: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> qs: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> sc: array<u32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read> cols: array<Col, 8>;

const TEAMS: u32 = WG / T;
const NONE: u32 = 0xFFFFFFFFu;

var<workgroup> xs: array<vec4<f32>, G * NB * 8u>; // [G, I/4] staged h slots, swizzled per block
var<workgroup> wq: array<vec4<u32>, EB * TEAMS * NB>; // [EB, TEAMS, NB] the batch's row blocks
var<workgroup> wsc: array<f32, EB * TEAMS * NB>;      // their scales
var<workgroup> red: array<f32, WG>;               // [TEAMS, T] per-lane partials of one column
// Pair p = c K + k (column c, rank k): its expert (NONE: done or absent column, or an expert
// this part does not hold), routing weight, whether it is its expert's first pair, and
// union index | position among its expert's pairs << 16.
var<workgroup> cid: array<u32, P>;
var<workgroup> cwt: array<f32, P>;
var<workgroup> pfirst: array<u32, P>;
var<workgroup> pu: array<u32, P>;
// Pairs ordered by (union index, pair); per union expert: id, first position there, count.
var<workgroup> sorted: array<u32, P>;
var<workgroup> ulist: array<u32, UMAX>;
var<workgroup> ustart: array<u32, UMAX>;
var<workgroup> ucount: array<u32, UMAX>;
var<workgroup> n_union: u32;
// Batches of consecutive union experts staged together (at most EB experts, and at most G
// pairs unless one expert alone has more): first union index | experts << 12 | pairs << 16.
var<workgroup> binfo: array<u32, UMAX>;
var<workgroup> n_batch: u32;

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

fn held(e: u32) -> bool {
    return e >= params.e_lo && e < params.e_hi;
}

// Rank (slot) of a lane's item `it`, clamped (the last lanes' items may lie past KNB).
fn item_k(it: u32) -> u32 {
    return min(it / NB, K - 1u);
}

// The union of the pairs' experts in first-occurrence order (over pairs p = c K + k), and each
// pair's place in it. Passes of O(P) per pair, separated by barriers (P = 64 at the real shape).
fn build_union(li: u32) {
    let nbc = min(params.nb, 8u);
    for (var p = li; p < P; p += WG) {
        let c = p / K;
        let k = p % K;
        var e = NONE;
        var w = 0.0;
        if (c < nbc && cols[c].done == 0u) {
            let id = min(route[c * 2u * K + k], E - 1u);
            w = bitcast<f32>(route[c * 2u * K + K + k]);
            e = select(NONE, id, held(id));
        }
        cid[p] = e;
        cwt[p] = w;
    }
    workgroupBarrier();
    for (var p = li; p < P; p += WG) {
        let e = cid[p];
        var first = u32(e != NONE);
        for (var q = 0u; q < p; q++) {
            first = select(first, 0u, cid[q] == e);
        }
        pfirst[p] = first;
    }
    workgroupBarrier();
    for (var p = li; p < P; p += WG) {
        let e = cid[p];
        if (e == NONE) {
            pu[p] = NONE;
            continue;
        }
        // u = first pairs before p's expert's first pair; pos = its pairs before p.
        var u = 0u;
        var pos = 0u;
        var seen = false;
        for (var q = 0u; q < p; q++) {
            let same = cid[q] == e;
            seen = seen || same;
            u += select(0u, pfirst[q], !seen);
            pos += u32(same);
        }
        pu[p] = u | (pos << 16u);
        if (pfirst[p] != 0u) {
            var n = 0u;
            for (var q = p; q < P; q++) {
                n += u32(cid[q] == e);
            }
            ulist[u] = e;
            ucount[u] = n;
        }
    }
    workgroupBarrier();
    for (var p = li; p < P; p += WG) {
        let v = pu[p];
        if (v == NONE) {
            continue;
        }
        let u = v & 0xFFFFu;
        var at = v >> 16u;
        for (var q = 0u; q < P; q++) {
            let w = pu[q];
            at += u32(w != NONE && (w & 0xFFFFu) < u);
        }
        sorted[at] = p;
        if ((v >> 16u) == 0u) {
            ustart[u] = at;
        }
    }
    if (li == 0u) {
        var n = 0u;
        for (var q = 0u; q < P; q++) {
            n += pfirst[q];
        }
        n_union = n;
        // Greedy batches in union order.
        var nb = 0u;
        var u0 = 0u;
        var np = 0u;
        for (var u = 0u; u < n; u++) {
            let c = ucount[u];
            if (u > u0 && (u - u0 == EB || np + c > G)) {
                binfo[nb] = u0 | ((u - u0) << 12u) | (np << 16u);
                nb += 1u;
                u0 = u;
                np = 0u;
            }
            np += c;
        }
        if (n > u0) {
            binfo[nb] = u0 | ((n - u0) << 12u) | (np << 16u);
            nb += 1u;
        }
        n_batch = nb;
    }
}

// Blocks of the workgroup's rows a thread stages per expert.
const NW: u32 = (TEAMS * NB + WG - 1u) / WG;

// The thread's share (items li + n WG) of the blocks and scales in the workgroup's rows of the
// `ne` experts of the batch starting at union index `u0`, at [eb * NW + n] (rows past H, in the
// last workgroup, read row H - 1 and are not written).
fn prefetch_w(
    u0: u32,
    ne: u32,
    wg: u32,
    li: u32,
    pq: ptr<function, array<vec4<u32>, EB * NW>>,
    ps: ptr<function, array<f32, EB * NW>>,
) {
    for (var eb = 0u; eb < EB; eb++) {
        if (eb < ne) {
            let e = ulist[u0 + eb];
            for (var n = 0u; n < NW; n++) {
                let i = li + n * WG;
                if (i < TEAMS * NB) {
                    let r = min(wg * TEAMS + i / NB, H - 1u);
                    let blk = ((e - params.e_lo) * H + r) * NB + i % NB;
                    (*pq)[eb * NW + n] = qs[blk];
                    (*ps)[eb * NW + n] = scale(blk);
                }
            }
        }
    }
}

@compute @workgroup_size(WG)
fn main_union(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (state.done != 0u) {
        return;
    }
    let wg = wid.x + wid.y * nwg.x;
    let team = li / T;
    let lane = li % T;
    let row = wg * TEAMS + team;
    build_union(li);
    // Per column c and item j: the block dot and the weight scale (host-expanded).
    //UNION_DECL
    let nbt = workgroupUniformLoad(&n_batch);
    // The thread's share of the next batch's blocks, loaded one batch ahead so the weight
    // reads are in flight during the previous batch's staging and dots.
    var pq: array<vec4<u32>, EB * NW>;
    var ps: array<f32, EB * NW>;
    if (nbt > 0u) {
        let b0 = binfo[0];
        prefetch_w(b0 & 0xFFFu, (b0 >> 12u) & 0xFu, wg, li, &pq, &ps);
    }
    for (var bt = 0u; bt < nbt; bt++) {
        // Also the barrier between the previous batch's dots and this batch's staging.
        let bi = workgroupUniformLoad(&binfo[bt]);
        let u0 = bi & 0xFFFu;
        let ne = (bi >> 12u) & 0xFu;
        let np = bi >> 16u;
        for (var eb = 0u; eb < EB; eb++) {
            for (var n = 0u; n < NW; n++) {
                let i = li + n * WG;
                if (eb < ne && i < TEAMS * NB) {
                    wq[eb * TEAMS * NB + i] = pq[eb * NW + n];
                    wsc[eb * TEAMS * NB + i] = ps[eb * NW + n];
                }
            }
        }
        if (bt + 1u < nbt) {
            let b1 = binfo[bt + 1u];
            prefetch_w(b1 & 0xFFFu, (b1 >> 12u) & 0xFu, wg, li, &pq, &ps);
        }
        // The batch's pairs are consecutive in `sorted`, G h slots at a time.
        for (var g0 = 0u; g0 < np; g0 += G) {
            if (g0 > 0u) {
                workgroupBarrier();
            }
            let ng = min(G, np - g0);
            let base = ustart[u0] + g0;
            for (var i = li; i < ng * NB * 8u; i += WG) {
                let s = i / (NB * 8u);
                let p = sorted[base + s];
                let c = p / K;
                let k = p % K;
                xs[xs_slot(i)] = h[c * KNB * 8u + k * NB * 8u + i % (NB * 8u)];
            }
            workgroupBarrier();
            for (var s = 0u; s < ng; s++) {
                let p = sorted[base + s];
                let c = p / K;
                let k = p % K;
                // The pair's expert's blocks in wq.
                let wb = ((pu[p] & 0xFFFFu) - u0) * TEAMS * NB + team * NB;
                // UNION_DOT: for each item j of the lane in rank k, the block dot with staged
                // slot s and the weight scale, into d{c}_{j} and s{c}_{j} (selected by c).
                //UNION_DOT
            }
        }
    }
    // The chains and ordered team sums, one column at a time (red is reused).
    //UNION_CHAIN
}
