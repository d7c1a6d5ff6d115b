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
    var acc = 0.0;
    for (var it = lane; it < K * NB; it += T) {
        let k = it / NB;
        let b = it % NB;
        let e = ids[k];
        if (e >= params.e_lo && e < params.e_hi) {
            let blk = ((e - params.e_lo) * H + crow) * NB + b;
            acc += wts[k] * scale(blk) * act_dot(qs[blk], k * NB + b);
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var st = T / 2u; st > 0u; st >>= 1u) {
        if (lane < st) {
            red[li] += red[li + st];
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < H) {
        if (params.accumulate != 0u) {
            out[row] += red[li];
        } else {
            out[row] = red[li];
        }
    }
}
