// Expert gate/up matvecs + SiLU(gate) * up with f32 activations (formats-spec §1.7 step 5): the
// f32 form of moe_gate_up.wgsl, with the same entry points, bindings, routing and parts.
// Prepended by the host: consts E, K, WG, T (lanes per row, power of two, 8..=256), RG (rows per
// team: 1 or 2), R (= WG / T * RG rows per workgroup), H (input width), NB (= H / 32), I,
// NORM_TOPK, the `State` struct,
// moe_route.wgsl, F32_DEQ (numerics.rs: `dq_block`), moe_stage_f32.wgsl and columns.wgsl.
// Grid: (I / R, K). Workgroup (b, k) computes rows [R b, R b + R) of slot k's expert; team t
// rows [R b + RG t, + RG).
//
// Column forms (multi-column runs, columns.rs): grid (I / R, K, nb); column c's data lie at
// logits [c*E..], x [c*H..], route [c*2K..], h [c*K*I..]; a column whose `cols[c].done` is set
// is skipped (its route and h untouched), and so is every column when `state.done` is set.
// - `gate_up_union_cols` (selectable, moe_cols.rs): workgroup (b, k, c) routes column c (writing its
//   route slot k from b = 0, as the single-token form) and takes e = column c's k-th expert.
//   It owns e when no live column before c chose e (a union slot in a deterministic order:
//   the first (column, rank) that chose the expert); a workgroup that does not own its expert
//   exits. The owner loads its lanes' gate/up blocks of e once into registers, then, for every
//   live column c' that chose e (at rank k'), stages x of c' and writes rows of h [c', k'] with
//   the dots of `expert_rows`, in the same order: each chosen expert's weights are read once
//   per step for all the columns that chose it, and every h value is bit-identical to the
//   single-token kernel's. Whether c' chose e is its rank of e among its E logits (one pass of
//   the `route_select` predicate), not a full routing of c'.
// - `gate_up_routed_cols` (the default, faster on the H200): workgroup (b, k, c) runs
//   `gate_up_routed` on column c, every column reading its own experts.
//
// Every workgroup first copies x into workgroup memory (swizzled, moe_stage_f32.wgsl); the
// barriers of the routing (or of the expert-id broadcast) publish it. Then lane l of a row's team
// takes blocks l, l + T, ...: one 16-byte load per block for gate and one for up, both dotted
// with the one staged activation block (int4 -> f32 by the mantissa trick of `dq_block`). The
// affine forms' `c1 Σ x` term reads each block's Σ x from `xsum_s`, summed once per workgroup:
// by the folded routing between its barriers (late norm), else by `expert_rows` before its
// dots (one barrier more). Per team and item, those sums cost Q4_K tg128 1.4% on the H100
// (BENCHMARKS run 152).
//
// logits [E] f32 (column form: [nb, E])
// x      [H] f32 at binding 4 (column form: [nb, H])
// gate_qs, up_qs   [(e_hi-e_lo)*I*NB] blocks of the form (tensor.rs QForm: `QB`, and `dq_block`
//                   read as the form's dot, QForm::with_dot), *_sc scale words
// route  [2K] u32: ids then f32 weight bits (column form: [nb, 2K])
// h      [K, I] f32 = silu(gate) * up (column form: [nb, K, I])
// cols   [8] Col (column form only)

struct Params { e_lo: u32, e_hi: u32, write_route: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> route: array<u32>;
@group(0) @binding(4) var<storage, read> act_x: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> gate_qs: array<QB>;
@group(0) @binding(7) var<storage, read> gate_sc: array<SW>;
@group(0) @binding(8) var<storage, read> up_qs: array<QB>;
@group(0) @binding(9) var<storage, read> up_sc: array<SW>;
@group(0) @binding(10) var<storage, read_write> h: array<f32>;
@group(0) @binding(13) var<storage, read> cols: array<Col, 8>;

var<workgroup> xs: array<vec4<f32>, NB * 8u>; // [H/4] x, swizzled
// [NB] the affine forms' block sums of xs (`q4_xsum`), once per workgroup (folded_route or
// expert_rows).
var<workgroup> xsum_s: array<f32, NB>;
// [WG] per-lane partials, thread i's at rp(i) = i + i / T: a team's T partials and one spare
// word, so the row sums' readers (lane 0 of every team, T apart) hit different banks instead of
// one or two (T = 16 or 32 on NVIDIA's 32 banks). WG / 8 spare words cover T >= 8 and the
// folded norm's NRED-apart form (`li + li / NRED`).
// With RG = 2, the second row of each team sits RS words further.
const RS: u32 = WG + WG / 8u;
var<workgroup> red_g: array<f32, RG * RS>;
var<workgroup> red_u: array<f32, RG * RS>;
var<workgroup> slot_e: u32;
// Union form: per column, #{logits above e's} (+ ties below e): e's rank in that column.
var<workgroup> col_rank: array<atomic<u32>, 8>;
// Union form: the (column | rank << 8) pairs that chose the workgroup's expert, their count
// (0 when the workgroup does not own it).
var<workgroup> users: array<u32, 8>;
var<workgroup> n_users: u32;

// Stage x [base..base + H/4) (vec4s; base = the column's first vec4, 0 for one token).
fn stage_x(li: u32, base: u32) {
    for (var i = li; i < NB * 8u; i += WG) {
        xs[xs_slot(i)] = act_x[base + i];
    }
}

fn rp(i: u32) -> u32 {
    return i + i / T;
}

fn gscale(i: u32) -> f32 {
    return q4_coef(gate_sc[i >> 1u], i).x;
}
fn uscale(i: u32) -> f32 {
    return q4_coef(up_sc[i >> 1u], i).x;
}

// One weight block b of row `wrow` for gate and up, scaled: (gate, up) partial sums.
fn gu_block(wrow: u32, b: u32) -> vec2<f32> {
    let blk = wrow * NB + b;
    let g = gate_qs[blk];
    let u = up_qs[blk];
    let x = xs_block(b);
    if (Q4_AFFINE) {
        // tensor.rs's affine form: c0 Σ (q - 8) x + c1 Σ x per block.
        let xsum = xsum_s[b];
        let cg = q4_coef(gate_sc[blk >> 1u], blk);
        let cu = q4_coef(up_sc[blk >> 1u], blk);
        return vec2<f32>(fma(cg.x, dq_block(g, x), cg.y * xsum),
                         fma(cu.x, dq_block(u, x), cu.y * xsum));
    }
    return vec2<f32>(gscale(blk) * dq_block(g, x), uscale(blk) * dq_block(u, x));
}

// The same for rows wrow and wrow + 1 (RG = 2): one staged block read for both rows' four dots;
// (gate, up) of wrow, then of wrow + 1.
fn gu_block2(wrow: u32, b: u32) -> vec4<f32> {
    let blk = wrow * NB + b;
    let g0 = gate_qs[blk];
    let u0 = up_qs[blk];
    let g1 = gate_qs[blk + NB];
    let u1 = up_qs[blk + NB];
    let x = xs_block(b);
    if (Q4_AFFINE) {
        let xsum = xsum_s[b];
        let cg0 = q4_coef(gate_sc[blk >> 1u], blk);
        let cu0 = q4_coef(up_sc[blk >> 1u], blk);
        let cg1 = q4_coef(gate_sc[(blk + NB) >> 1u], blk + NB);
        let cu1 = q4_coef(up_sc[(blk + NB) >> 1u], blk + NB);
        return vec4<f32>(fma(cg0.x, dq_block(g0, x), cg0.y * xsum),
                         fma(cu0.x, dq_block(u0, x), cu0.y * xsum),
                         fma(cg1.x, dq_block(g1, x), cg1.y * xsum),
                         fma(cu1.x, dq_block(u1, x), cu1.y * xsum));
    }
    return vec4<f32>(gscale(blk) * dq_block(g0, x), uscale(blk) * dq_block(u0, x),
                     gscale(blk + NB) * dq_block(g1, x), uscale(blk + NB) * dq_block(u1, x));
}

// Row `row` of h [hbase + k*I..] from the team's partials at red_g/red_u [o + rp(li) ..] (lane 0
// of the team): the T lane sums in lane order, times `sc`, then silu(gate) * up.
fn row_out(o: u32, li: u32, hbase: u32, k: u32, row: u32, sc: f32) {
    var g = 0.0;
    var u = 0.0;
    for (var j = 0u; j < T; j++) {
        g += red_g[o + rp(li) + j];
        u += red_u[o + rp(li) + j];
    }
    g *= sc;
    u *= sc;
    h[hbase + k * I + row] = g / (1.0 + exp(-g)) * u;
}

// Rows [R wid.x, +R) of expert e for slot k, written to h [hbase + k*I..] (hbase: the column's
// first h element), each row's gate and up sums multiplied by `sc` (the late norm's 1 / rms;
// 1.0, an exact no-op, elsewhere). `e` is workgroup-uniform; every thread calls it (it has a
// barrier), a part that does not hold e computes nothing. `sums_done` (uniform): the caller has
// already put the staged blocks' sums in `xsum_s` (the folded late-norm routing); else the
// affine forms sum them here.
fn expert_rows(e: u32, k: u32, bx: u32, li: u32, hbase: u32, sc: f32, sums_done: bool) {
    let held = e >= params.e_lo && e < params.e_hi;
    let team = li / T;
    let lane = li % T;
    let row = bx * R + team * RG;
    let wrow = (select(params.e_lo, e, held) - params.e_lo) * I + row;
    var acc = vec2<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    if (Q4_AFFINE && !sums_done) {
        // Each block's Σ x once for the workgroup rather than once per team and item.
        for (var b = li; b < NB; b += WG) {
            xsum_s[b] = q4_xsum(xs_block(b));
        }
        workgroupBarrier();
    }
    if (held) {
        // A constant trip count lets the compiler unroll and issue the lane's weight loads
        // together (few workgroups: latency, not bandwidth, limits).
        for (var j = 0u; j < NB / T; j++) {
            if (RG == 2u) {
                acc2 += gu_block2(wrow, lane + j * T);
            } else {
                acc += gu_block(wrow, lane + j * T);
            }
        }
        if (lane < NB % T) {
            if (RG == 2u) {
                acc2 += gu_block2(wrow, lane + (NB / T) * T);
            } else {
                acc += gu_block(wrow, lane + (NB / T) * T);
            }
        }
    }
    if (RG == 2u) {
        red_g[rp(li)] = acc2.x;
        red_u[rp(li)] = acc2.y;
        red_g[RS + rp(li)] = acc2.z;
        red_u[RS + rp(li)] = acc2.w;
    } else {
        red_g[rp(li)] = acc.x;
        red_u[rp(li)] = acc.y;
    }
    workgroupBarrier();
    // One barrier: lane 0 of each team adds its T partials per row (no subgroup-size
    // assumption).
    if (held && lane == 0u) {
        row_out(0u, li, hbase, k, row, sc);
        if (RG == 2u) {
            row_out(RS, li, hbase, k, row + 1u, sc);
        }
    }
}

@compute @workgroup_size(WG)
fn gate_up(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    stage_x(li, 0u);
    let k = wid.y;
    if (li == 0u) {
        slot_e = min(route[k], E - 1u);
    }
    // workgroupUniformLoad's barrier also publishes the staged x.
    expert_rows(workgroupUniformLoad(&slot_e), k, wid.x, li, 0u, 1.0, false);
}

@compute @workgroup_size(WG)
fn gate_up_routed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    routed(wid.xy, li, 0u);
}

@compute @workgroup_size(WG)
fn gate_up_routed_cols(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    // `c` is workgroup-uniform, so the return keeps the barriers uniform.
    let c = wid.z;
    if (state.done != 0u || c >= 8u || cols[c].done != 0u) {
        return;
    }
    routed(wid.xy, li, c);
}

// Routing + rows of workgroup (wid.x, wid.y) for column `col` (0 for one token).
fn routed(wid: vec2<u32>, li: u32, col: u32) {
    // Staged before the routing so the x loads overlap the logits loads; route_select's
    // barriers publish it.
    stage_x(li, col * NB * 8u);
    let k = wid.y;
    route_select(li, col * E);
    if (li == 0u) {
        slot_e = top_e[k];
        if (params.write_route != 0u && wid.x == 0u) {
            route[col * 2u * K + k] = top_e[k];
            route[col * 2u * K + K + k] = bitcast<u32>(route_weight(k));
        }
    }
    expert_rows(workgroupUniformLoad(&slot_e), k, wid.x, li, col * K * I, 1.0, false);
}

// Folded router (router_fold.rs, the fused single-token plan): the input is rmsnorm(h + a) and
// the logits are z / rms(h + a), z = fold · [att | h] from the o-proj dispatch. Params.pad holds
// the RMSNorm eps (f32 bits). With LATE_NORM (a host constant) the staged input is (h + a) ⊙ w
// and each row's gate and up sums are multiplied by 1 / rms(h + a) instead: rmsnorm(v) = inv
// (v ⊙ w) with one scalar inv, so W rmsnorm(v) = inv (W (v ⊙ w)), and the pass that would
// normalise the staged input between the norm's sum and the weight loads is gone.
@group(0) @binding(14) var<storage, read> fold_h: array<vec4<f32>>;  // [H/4] residual before the o-proj
@group(0) @binding(15) var<storage, read> fold_a: array<vec4<f32>>;  // [H/4] o-proj output
@group(0) @binding(16) var<storage, read> fold_w: array<vec4<f32>>;  // [H/4] RMSNorm weight
@group(0) @binding(17) var<storage, read> fold_z: array<f32>;        // [E] pre-norm logits
// Published by workgroup (0, 0) of the part that writes the route, for diagnostics (the
// plan's trace): the normalised input [H/4] and the logits [E].
@group(0) @binding(18) var<storage, read_write> pub_x: array<vec4<f32>>;
@group(0) @binding(19) var<storage, read_write> pub_lg: array<f32>;

// Partials of the sum of squares: WG / 16 per thread of the first level.
const NRED: u32 = WG / 16u;

// What the folded routing leaves a workgroup: its slot's expert and the rows' sum scale.
struct Folded { e: u32, sc: f32 };

@compute @workgroup_size(WG)
fn gate_up_folded(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    let f = folded_route(wid, li);
    expert_rows(f.e, wid.y, wid.x, li, 0u, f.sc, LATE_NORM);
}

// Expert e's down weights (the part bound at 20, 21: one binding of all experts) for
// `gate_up_folded_warm`: the next dispatch reads them (kernels/warm.rs).
@group(0) @binding(20) var<storage, read> dwarm_q: array<u32>;
@group(0) @binding(21) var<storage, read> dwarm_s: array<u32>;
@group(0) @binding(22) var<storage, read_write> dwarm_sink: array<u32>; // [1], never read

// Load one word of each 32-byte sector of workgroup bx's share (of nx) of expert e's down
// blocks and scales (H rows of I / 32 blocks), DW_LOADS per thread (a host constant), issued
// together; returns their xor (consumed after the rows, so nothing waits on them before).
fn down_warm(e: u32, bx: u32, nx: u32, li: u32) -> u32 {
    // DW_QB: bytes per block (16 nibbles, 32 bytes, 20 Q5_K; a host constant, QForm::block_bytes).
    let qsec = (H * (I / 32u) * DW_QB + 31u) / 32u; // sectors of 32 bytes
    // DW_SB: scale bytes per pair of blocks (4, Q4_K's 8; QForm::scale_word_bytes).
    let ssec = ((H * (I / 32u) + 1u) / 2u * DW_SB + 31u) / 32u;
    let tot = qsec + ssec;
    let per = (tot + nx - 1u) / nx;
    let end = min(tot, (bx + 1u) * per);
    let nq = arrayLength(&dwarm_q);
    let ns = arrayLength(&dwarm_s);
    var t = 0u;
    for (var k = 0u; k < DW_LOADS; k++) {
        let s = bx * per + k * WG + li;
        if (s < end) {
            if (s < qsec) {
                t ^= dwarm_q[min((e * H * (I / 32u) * DW_QB / 32u + s) * 8u, nq - 1u)];
            } else {
                t ^= dwarm_s[min((e * ssec + s - qsec) * 8u, ns - 1u)];
            }
        }
    }
    return t;
}

// `gate_up_folded` that also reads its expert's down weights into L2 for the down dispatch
// (`--tune warm` bit 4): the same rows, the same bits.
@compute @workgroup_size(WG)
fn gate_up_folded_warm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (state.done != 0u) {
        return;
    }
    let f = folded_route(wid, li);
    let t = down_warm(f.e, wid.x, nwg.x, li);
    expert_rows(f.e, wid.y, wid.x, li, 0u, f.sc, LATE_NORM);
    // Depends on every warm load; nothing reads the sink.
    if (t == 0x2545f491u) {
        dwarm_sink[0] = t;
    }
}

// The folded routing of workgroup (wid.x, wid.y): stages the input, routes (writing the route
// from the first part's workgroups of x = 0) and returns slot wid.y's expert and the scale.
// Every thread calls it (it has barriers).
fn folded_route(wid: vec3<u32>, li: u32) -> Folded {
    // Stage h + a and load z together; then the sum of squares in two levels (the shape of
    // matvec.rs NORM_ON_LOAD: every workgroup adds the same partials in the same order, so
    // all agree on the scale and on the route).
    var ss = 0.0;
    for (var i = li; i < NB * 8u; i += WG) {
        let v = fold_h[i] + fold_a[i];
        if (LATE_NORM) {
            xs[xs_slot(i)] = v * fold_w[i];
        } else {
            xs[xs_slot(i)] = v;
        }
        ss += dot(v, v);
    }
    for (var e = li; e < E; e += WG) {
        lg[e] = fold_z[e];
    }
    // A NaN logit could leave a rank unclaimed: default to expert 0 so ids stay in range.
    for (var r = li; r < K; r += WG) {
        top_e[r] = 0u;
    }
    // NRED + 1 apart per second-level thread (bank-spread, as rp).
    red_g[li + li / NRED] = ss;
    workgroupBarrier();
    // The second level of the sum and the experts' ranks in the same step: the ranks count on
    // the pre-norm logits z, since dividing all of them by rms(h + a) > 0 keeps their order
    // (rounding can only make two of them equal, a tie within one ulp that either order
    // resolves faithfully). So the weight loads wait for one barrier round less and the rank
    // loop overlaps the norm's sum instead of following it (route_rank's split form: thread e
    // counts the first RANK_SPLIT logits, thread E + e the rest).
    if (li < 16u) {
        var s = 0.0;
        for (var j = 0u; j < NRED; j++) {
            s += red_g[(NRED + 1u) * li + j];
        }
        red_u[li] = s;
    }
    var lo = 0u;
    if (2u * E <= WG) {
        if (li < E) {
            lo = rank_count(li, lg[li], 0u, RANK_SPLIT);
        } else if (li < 2u * E) {
            let e = li - E;
            rank_hi[e] = rank_count(e, lg[e], RANK_SPLIT, E);
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
    if (2u * E <= WG && li < E) {
        let rank = lo + rank_hi[li];
        if (rank < K) {
            top_e[rank] = li;
        }
    }
    var tot = 0.0;
    for (var j = 0u; j < 16u; j++) {
        tot += red_u[j];
    }
    let inv = inverseSqrt(tot / f32(H) + bitcast<f32>(params.pad));
    if (!LATE_NORM) {
        for (var i = li; i < NB * 8u; i += WG) {
            let s = xs_slot(i);
            xs[s] = xs[s] * inv * fold_w[i];
        }
    }
    for (var e = li; e < E; e += WG) {
        lg[e] = lg[e] * inv;
    }
    if (Q4_AFFINE && LATE_NORM) {
        // The staged (h + a) ⊙ w is final since the first barrier: its block sums here, so
        // expert_rows needs no barrier of its own for them.
        for (var b = li; b < NB; b += WG) {
            xsum_s[b] = q4_xsum(xs_block(b));
        }
    }
    // Publishes xs, lg (the normalised logits the weights use), top_e and xsum_s.
    workgroupBarrier();
    let k = wid.y;
    let e = top_e[k];
    let first = params.write_route != 0u && wid.x == 0u;
    if (li == 0u && first) {
        route[k] = e;
        route[K + k] = bitcast<u32>(route_weight(k));
    }
    if (first && k == 0u) {
        for (var i = li; i < NB * 8u; i += WG) {
            // The late form's staged (h + a) ⊙ w is scaled here (the trace compares within a
            // tolerance; the rows themselves scale their sums).
            pub_x[i] = xs[xs_slot(i)] * select(1.0, inv, LATE_NORM);
        }
        for (var e = li; e < E; e += WG) {
            pub_lg[e] = lg[e];
        }
    }
    return Folded(e, select(1.0, inv, LATE_NORM));
}

// Blocks per lane of one row (the last one only on lanes below NB % T).
const NBT: u32 = (NB + T - 1u) / T;

@compute @workgroup_size(WG)
fn gate_up_union_cols(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    // `c` is workgroup-uniform, so the return keeps the barriers uniform.
    let c = wid.z;
    let nbc = min(nwg.z, 8u);
    if (state.done != 0u || c >= nbc || cols[c].done != 0u) {
        return;
    }
    let k = wid.y;
    if (li < 8u) {
        atomicStore(&col_rank[li], 0u);
    }
    // route_select's barriers publish the zeroed ranks.
    route_select(li, c * E);
    let e = top_e[k];
    if (li == 0u && params.write_route != 0u && wid.x == 0u) {
        route[c * 2u * K + k] = e;
        route[c * 2u * K + K + k] = bitcast<u32>(route_weight(k));
    }
    // e's rank in every live column, WG / 8 threads per column: the predicate of route_select
    // (u > v, or u == v below e), so a rank below K means the column's route holds e there.
    let cc = li / (WG / 8u);
    if (cc < nbc && cols[cc].done == 0u) {
        let v = logits[cc * E + e];
        var n = 0u;
        for (var j = li % (WG / 8u); j < E; j += WG / 8u) {
            let u = logits[cc * E + j];
            n += u32(u > v) + u32(j < e && u == v);
        }
        atomicAdd(&col_rank[cc], n);
    }
    workgroupBarrier();
    if (li == 0u) {
        // Owner: this (column, rank) is e's first choice among the live columns (a NaN logit
        // can break rank == k; then no workgroup writes that slot of h). The part must hold e.
        var own = atomicLoad(&col_rank[c]) == k && e >= params.e_lo && e < params.e_hi;
        var n = 0u;
        for (var d = 0u; d < nbc; d++) {
            let r = atomicLoad(&col_rank[d]);
            if (cols[d].done != 0u || r >= K) {
                continue;
            }
            own = own && d >= c;
            users[n] = d | (r << 8u);
            n += 1u;
        }
        n_users = select(0u, n, own);
    }
    let nu = workgroupUniformLoad(&n_users);
    if (nu == 0u) {
        return;
    }
    union_rows(e, wid.x, li, nu);
}

// Rows [R bx, +R) of expert e (held by this part) for every column in `users[..nu]`: the lane's
// blocks of e are loaded once, then dotted with each column's staged x like `expert_rows`.
fn union_rows(e: u32, bx: u32, li: u32, nu: u32) {
    // The team's RG rows one after the other (RG is a constant: the barriers stay uniform).
    for (var rr = 0u; rr < RG; rr++) {
        union_row(e, bx * R + (li / T) * RG + rr, li, nu);
    }
}

// Row `row` of expert e for every column in `users[..nu]` (see `union_rows`).
fn union_row(e: u32, row: u32, li: u32, nu: u32) {
    let lane = li % T;
    let wrow = (e - params.e_lo) * I + row;
    let tail = lane < NB % T;
    // The lane's blocks lane + j T (the last only when `tail`): a constant trip count keeps
    // them in registers and issues the loads together.
    var gq: array<QB, NBT>;
    var uq: array<QB, NBT>;
    var gs: array<f32, NBT>;
    var us: array<f32, NBT>;
    for (var j = 0u; j < NBT; j++) {
        let b = lane + j * T;
        if (j < NB / T || tail) {
            let blk = wrow * NB + b;
            gq[j] = gate_qs[blk];
            uq[j] = up_qs[blk];
            gs[j] = gscale(blk);
            us[j] = uscale(blk);
        }
    }
    for (var t = 0u; t < nu; t++) {
        let d = users[t] & 0xFFu;
        let r = users[t] >> 8u;
        // The previous column's dots ended before its reduction barrier, so xs is free.
        stage_x(li, d * NB * 8u);
        workgroupBarrier();
        var acc = vec2<f32>(0.0);
        for (var j = 0u; j < NB / T; j++) {
            let x = xs_block(lane + j * T);
            acc += vec2<f32>(gs[j] * dq_block(gq[j], x), us[j] * dq_block(uq[j], x));
        }
        if (tail) {
            // NBT - 1 = NB / T whenever a lane has a tail block (the constant index stays in
            // bounds when NB % T == 0).
            let j = NBT - 1u;
            let x = xs_block(lane + j * T);
            acc += vec2<f32>(gs[j] * dq_block(gq[j], x), us[j] * dq_block(uq[j], x));
        }
        red_g[rp(li)] = acc.x;
        red_u[rp(li)] = acc.y;
        workgroupBarrier();
        if (lane == 0u) {
            row_out(0u, li, d * K * I, r, row, 1.0);
        }
    }
}
