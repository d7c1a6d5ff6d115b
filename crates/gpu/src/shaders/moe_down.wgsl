// Expert down matvecs + routing-weighted combine: y = Σ_k w_k · W_down[e_k] · h_k
// (formats-spec §1.7 steps 5-6), added into `out` (the residual stream) or written to it.
// Prepended by the host: consts E, K, WG, T (lanes per row, power of two), R (= WG / T rows per
// workgroup), H (output rows per expert), I (input width), NB (= I / 32), the `State` struct.
// Grid: ceil(H / R) workgroups (spread over x, y: linear id = wid.x + wid.y * nwg.x).
// One dispatch per weight part (parts hold whole experts); `params.accumulate` = 1 adds into
// `out` (every part of the residual variant, and parts after the first otherwise).
//
// route  [2K] u32: ids then f32 weight bits (router or gate_up_routed output)
// h      [K*I] activation at bindings 3 (4) in the form of the numerics snippet (numerics.rs):
//        f32, int8 or precise int8; read through `act_dot`
// qs, sc [(e_hi-e_lo)*H*NB] Q4_0 blocks of the part (tensor.rs layout)
// out    [H] f32

struct Params { e_lo: u32, e_hi: u32, accumulate: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> route: array<u32>;
@group(0) @binding(5) var<storage, read> qs: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> sc: array<u32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, WG>;
var<workgroup> ids: array<u32, K>;
var<workgroup> wts: array<f32, K>;

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

// Item `it` = (slot k, block b) of row `crow`: w_k * scale * (block · h_k block b).
fn item(it: u32, crow: u32) -> f32 {
    let k = it / NB;
    let b = it % NB;
    let e = ids[k];
    if (e < params.e_lo || e >= params.e_hi) {
        return 0.0;
    }
    let blk = ((e - params.e_lo) * H + crow) * NB + b;
    return wts[k] * scale(blk) * act_dot(qs[blk], k * NB + b);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (state.done != 0u) {
        return;
    }
    for (var k = li; k < K; k += WG) {
        ids[k] = min(route[k], E - 1u);
        wts[k] = bitcast<f32>(route[K + k]);
    }
    workgroupBarrier();
    let team = li / T;
    let lane = li % T;
    let row = (wid.x + wid.y * nwg.x) * R + team;
    // Rows past H (last workgroup) compute on row 0 and are not written: keeps barriers uniform.
    let crow = select(0u, row, row < H);
    // Lane `lane` takes items it = lane + j*T of the K*NB (slot, block) pairs; a constant trip
    // count lets the compiler unroll and issue the lane's weight loads together.
    var acc = 0.0;
    for (var j = 0u; j < (K * NB) / T; j++) {
        acc += item(lane + j * T, crow);
    }
    if (lane < (K * NB) % T) {
        acc += item(lane + ((K * NB) / T) * T, crow);
    }
    red[li] = acc;
    workgroupBarrier();
    // One barrier: lane 0 of each team adds the team's T partials.
    var tot = 0.0;
    if (lane == 0u) {
        for (var j = 0u; j < T; j++) {
            tot += red[li + j];
        }
    }
    if (lane == 0u && row < H) {
        if (params.accumulate != 0u) {
            out[row] += tot;
        } else {
            out[row] = tot;
        }
    }
}
