// The folded gate/up (moe_gate_up_f32.wgsl `gate_up_folded`) on bfp24 input converted once
// (`--tune moe_bfp=1`): the conversion dispatch before it (matvec_wgsl.rs `bfp_quant_wgsl(true)`)
// writes rmsnorm(h + a) as bfp24 blocks (numerics.rs `BfpActs`: parts [6, NB] part-major,
// records [NB] (d bits, 8 Σ q)) and 1 / rms(h + a); every workgroup copies the blocks into
// workgroup memory (no conversion of its own), routes on z / rms like `gate_up_folded`, and
// dots each weight block with integer `dot4*8Packed` (numerics.rs `BFP_DOT`, exact per block).
// Prepended by the host: consts E, K, WG, T, R, H, NB, I, NORM_TOPK, the `State` struct,
// moe_route.wgsl and BFP_DOT. Grid: (I / R, K); workgroup (b, k) computes rows [R b, R b + R)
// of slot k's expert, bindings as `gate_up_folded`'s where they share a meaning.

struct Params { e_lo: u32, e_hi: u32, write_route: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
// Declared for moe_route.wgsl's `route_select`, which this kernel does not call.
@group(0) @binding(2) var<storage, read> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> route: array<u32>;
@group(0) @binding(6) var<storage, read> gate_qs: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> gate_sc: array<u32>;
@group(0) @binding(8) var<storage, read> up_qs: array<vec4<u32>>;
@group(0) @binding(9) var<storage, read> up_sc: array<u32>;
@group(0) @binding(10) var<storage, read_write> h: array<f32>;       // [K, I] silu(gate) * up
@group(0) @binding(17) var<storage, read> fold_z: array<f32>;        // [E] pre-norm logits
@group(0) @binding(19) var<storage, read_write> pub_lg: array<f32>;  // [E] scaled logits
@group(0) @binding(20) var<storage, read> act_p: array<vec4<u32>>;   // [6, NB] parts
@group(0) @binding(21) var<storage, read> act_r: array<vec2<u32>>;   // [NB] records
@group(0) @binding(22) var<storage, read> nrm: array<f32>;           // [1] 1 / rms(h + a)

// Block b's 6 parts and record at slots 8b + (j + b) % 8, j = 0..6 (j = 6: the record): the
// swizzle of moe_stage_f32.wgsl, so 8 lanes reading part j of 8 consecutive blocks hit 8
// different bank groups.
var<workgroup> xs: array<vec4<u32>, NB * 8u>;
var<workgroup> red_g: array<f32, WG>;
var<workgroup> red_u: array<f32, WG>;

fn xs_slot(b: u32, j: u32) -> u32 {
    return b * 8u + ((j + b) & 7u);
}

fn xs_block(b: u32) -> BfpBlock {
    let r = xs[xs_slot(b, 6u)];
    return BfpBlock(array<vec4<u32>, 6>(xs[xs_slot(b, 0u)], xs[xs_slot(b, 1u)],
        xs[xs_slot(b, 2u)], xs[xs_slot(b, 3u)], xs[xs_slot(b, 4u)], xs[xs_slot(b, 5u)]),
        bitcast<f32>(r.x), bitcast<i32>(r.y));
}

fn gscale(i: u32) -> f32 {
    let v = unpack2x16float(gate_sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
fn uscale(i: u32) -> f32 {
    let v = unpack2x16float(up_sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

fn gu_block(wrow: u32, b: u32) -> vec2<f32> {
    let blk = wrow * NB + b;
    let g = gate_qs[blk];
    let u = up_qs[blk];
    let x = xs_block(b);
    return vec2<f32>(gscale(blk) * dq_block(g, x), uscale(blk) * dq_block(u, x));
}

@compute @workgroup_size(WG)
fn gate_up_folded_bfp(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    // Copy the blocks (consecutive lanes read consecutive 16 bytes of a part) and load z
    // together; the rank barriers publish both.
    for (var i = li; i < 6u * NB; i += WG) {
        xs[xs_slot(i % NB, i / NB)] = act_p[i];
    }
    for (var b = li; b < NB; b += WG) {
        let r = act_r[b];
        xs[xs_slot(b, 6u)] = vec4<u32>(r.x, r.y, 0u, 0u);
    }
    for (var e = li; e < E; e += WG) {
        lg[e] = fold_z[e];
    }
    // A NaN logit could leave a rank unclaimed: default to expert 0 so ids stay in range.
    for (var r = li; r < K; r += WG) {
        top_e[r] = 0u;
    }
    workgroupBarrier();
    // The ranks on the pre-norm logits z (their order is that of z / rms), route_rank's split
    // form written out as in gate_up_folded, so the weight loads wait for three barriers.
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
    let inv = nrm[0];
    for (var e = li; e < E; e += WG) {
        lg[e] = lg[e] * inv;
    }
    // Publishes top_e and the scaled logits (the route weights').
    workgroupBarrier();
    let k = wid.y;
    let e = top_e[k];
    let first = params.write_route != 0u && wid.x == 0u;
    if (li == 0u && first) {
        route[k] = e;
        route[K + k] = bitcast<u32>(route_weight(k));
    }
    if (first && k == 0u) {
        for (var j = li; j < E; j += WG) {
            pub_lg[j] = lg[j];
        }
    }
    let held = e >= params.e_lo && e < params.e_hi;
    let team = li / T;
    let lane = li % T;
    let row = wid.x * R + team;
    let wrow = (select(params.e_lo, e, held) - params.e_lo) * I + row;
    var acc = vec2<f32>(0.0);
    if (held) {
        for (var j = 0u; j < NB / T; j++) {
            acc += gu_block(wrow, lane + j * T);
        }
        if (lane < NB % T) {
            acc += gu_block(wrow, lane + (NB / T) * T);
        }
    }
    red_g[li] = acc.x;
    red_u[li] = acc.y;
    workgroupBarrier();
    // One barrier: lane 0 of each team adds its T partials (no subgroup-size assumption).
    if (held && lane == 0u) {
        var g = 0.0;
        var u = 0.0;
        for (var j = 0u; j < T; j++) {
            g += red_g[li + j];
            u += red_u[li + j];
        }
        h[k * I + row] = g / (1.0 + exp(-g)) * u;
    }
}
