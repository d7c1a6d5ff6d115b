// Expert gate/up matvecs + SiLU(gate) * up for the K routed experts (formats-spec §1.7 step 5).
// Prepended by the host: consts E, K, WG, T (lanes per row, power of two), R (= WG / T = 32 rows
// per workgroup = one int8 output block), H (input width), NB (= H / 32), I (expert inner size),
// NORM_TOPK, the `State` struct, and moe_route.wgsl.
// Grid: (I / 32, K). Workgroup (b, k) computes rows [32b, 32b + 32) of slot k's expert.
//
// Entry points:
//  `gate_up`        reads the expert id of slot k from `route` (written by the router kernel);
//  `gate_up_routed` computes the routing itself from `logits` (every workgroup, it is cheap) and
//                   workgroups (0, k) of the first part write slot k to `route` for the down kernel,
//                   which saves the router dispatch.
// A weight tensor larger than one binding is split into parts of whole experts; the host records
// one dispatch per part and `params` says which experts the bound part holds.
//
// x      [H] activation at bindings 4 (5) in the form of the numerics snippet (numerics.rs):
//        f32, int8 or precise int8; read through `act_dot2`
// gate_qs, up_qs   [(e_hi-e_lo)*I*NB] vec4<u32> Q4_0 nibbles, *_sc f16 scale pairs (tensor.rs)
// route  [2K] u32: ids then f32 weight bits
// h      [K, I] f32 = silu(gate) * up; bindings 11, 12: h quantised by `act_store` (int8 forms
//        only; the numerics snippet declares them)

struct Params { e_lo: u32, e_hi: u32, write_route: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> route: array<u32>;
@group(0) @binding(6) var<storage, read> gate_qs: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> gate_sc: array<u32>;
@group(0) @binding(8) var<storage, read> up_qs: array<vec4<u32>>;
@group(0) @binding(9) var<storage, read> up_sc: array<u32>;
@group(0) @binding(10) var<storage, read_write> h: array<f32>;

var<workgroup> red_g: array<f32, WG>;
var<workgroup> red_u: array<f32, WG>;
var<workgroup> hv: array<f32, R>;
var<workgroup> slot_e: u32;

fn gscale(i: u32) -> f32 {
    let v = unpack2x16float(gate_sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
fn uscale(i: u32) -> f32 {
    let v = unpack2x16float(up_sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

// One weight block b of row `wrow` for gate and up, scaled: (gate, up) partial sums.
fn gu_block(wrow: u32, b: u32) -> vec2<f32> {
    let blk = wrow * NB + b;
    let gu = act_dot2(gate_qs[blk], up_qs[blk], b);
    return vec2<f32>(gscale(blk) * gu.x, uscale(blk) * gu.y);
}

// Rows [32 wid.x, +32) of expert e for slot k. `e` is workgroup-uniform; every thread calls it
// (it has barriers), a part that does not hold e computes nothing.
fn expert_rows(e: u32, k: u32, bx: u32, li: u32) {
    let held = e >= params.e_lo && e < params.e_hi;
    let team = li / T;
    let lane = li % T;
    let row = bx * R + team;
    let wrow = (select(params.e_lo, e, held) - params.e_lo) * I + row;
    var acc = vec2<f32>(0.0);
    if (held) {
        // A constant trip count (NB / T) lets the compiler unroll and issue every weight load
        // of the lane at once: with only K * I / 32 workgroups, latency, not bandwidth, limits.
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
    // One barrier: lane 0 of each team adds its T partials (T is small).
    if (held && lane == 0u) {
        var g = 0.0;
        var u = 0.0;
        for (var j = 0u; j < T; j++) {
            g += red_g[li + j];
            u += red_u[li + j];
        }
        let v = g / (1.0 + exp(-g)) * u;
        h[k * I + row] = v;
        hv[team] = v;
    }
    workgroupBarrier();
    // Quantise the 32 outputs (one block) with four threads of 8 (a no-op for f32 numerics).
    let q = min(li, 3u);
    let v0 = vec4<f32>(hv[8u * q], hv[8u * q + 1u], hv[8u * q + 2u], hv[8u * q + 3u]);
    let v1 = vec4<f32>(hv[8u * q + 4u], hv[8u * q + 5u], hv[8u * q + 6u], hv[8u * q + 7u]);
    act_store8(v0, v1, (k * I + bx * R) / 8u + q, held && li < 4u, li);
}

@compute @workgroup_size(WG)
fn gate_up(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    let k = wid.y;
    if (li == 0u) {
        slot_e = min(route[k], E - 1u);
    }
    expert_rows(workgroupUniformLoad(&slot_e), k, wid.x, li);
}

@compute @workgroup_size(WG)
fn gate_up_routed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    let k = wid.y;
    route_select(li, 0u);
    if (li == 0u) {
        slot_e = top_e[k];
        if (params.write_route != 0u && wid.x == 0u) {
            route[k] = top_e[k];
            route[K + k] = bitcast<u32>(route_weight(k));
        }
    }
    expert_rows(workgroupUniformLoad(&slot_e), k, wid.x, li);
}
