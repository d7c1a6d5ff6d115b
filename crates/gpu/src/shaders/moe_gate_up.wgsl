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

// Rows [32 wid.x, +32) of expert e for slot k. `e` is workgroup-uniform.
fn expert_rows(e: u32, k: u32, bx: u32, li: u32) {
    if (e < params.e_lo || e >= params.e_hi) {
        return;
    }
    let team = li / T;
    let lane = li % T;
    let row = bx * R + team;
    let wrow = (e - params.e_lo) * I + row;
    var ag = 0.0;
    var au = 0.0;
    for (var b = lane; b < NB; b += T) {
        let blk = wrow * NB + b;
        let gu = act_dot2(gate_qs[blk], up_qs[blk], b);
        ag += gscale(blk) * gu.x;
        au += uscale(blk) * gu.y;
    }
    red_g[li] = ag;
    red_u[li] = au;
    workgroupBarrier();
    for (var st = T / 2u; st > 0u; st >>= 1u) {
        if (lane < st) {
            red_g[li] += red_g[li + st];
            red_u[li] += red_u[li + st];
        }
        workgroupBarrier();
    }
    if (lane == 0u) {
        let g = red_g[li];
        let v = g / (1.0 + exp(-g)) * red_u[li];
        h[k * I + row] = v;
        hv[team] = v;
    }
    workgroupBarrier();
    // Quantise the 32 outputs (one block; a no-op for f32 numerics).
    if (li == 0u) {
        var v: array<f32, 32>;
        for (var j = 0u; j < R; j++) {
            v[j] = hv[j];
        }
        act_store(v, (k * I + bx * R) / 32u);
    }
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
    route_select(li);
    if (li == 0u) {
        slot_e = top_e[k];
        if (params.write_route != 0u && wid.x == 0u) {
            route[k] = top_e[k];
            route[K + k] = bitcast<u32>(route_weight(k));
        }
    }
    expert_rows(workgroupUniformLoad(&slot_e), k, wid.x, li);
}
