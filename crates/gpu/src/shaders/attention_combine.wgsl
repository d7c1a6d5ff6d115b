// Combine of the chunked attention (see attention.wgsl for the partial layouts).
// Prepended by the host: consts D, D4, HQ, C, CTX, NC, WG and the `State` struct.
// Grid: HQ workgroups, one per query head:
//   M = max_c m_c,  L = Σ_c l_c e^(m_c - M),  out[d] = Σ_c e^(m_c - M) part_o[c][d] / L.
// `combine` writes out [HQ*D] f32; `combine_q8` also writes it int8-quantised per block of 32
// into bindings 4, 5 via `act_store` (plain or precise: the numerics snippet prepended by the
// host, numerics.rs).

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read> part_o: array<f32>;
@group(0) @binding(2) var<storage, read> part_ml: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> ov: array<f32, D>;

// Combine query head qh into ov[] and out[].
fn combine_head(qh: u32, li: u32) {
    let nc = (min(state.pos + 1u, CTX) + C - 1u) / C;
    var mx = -3.4028235e38;
    for (var c = 0u; c < nc; c++) {
        mx = max(mx, part_ml[qh * NC + c].x);
    }
    var l = 0.0;
    for (var c = 0u; c < nc; c++) {
        let ml = part_ml[qh * NC + c];
        l += ml.y * exp(ml.x - mx);
    }
    let inv_l = 1.0 / l;
    for (var d = li; d < D; d += WG) {
        var acc = 0.0;
        for (var c = 0u; c < nc; c++) {
            acc += exp(part_ml[qh * NC + c].x - mx) * part_o[(qh * NC + c) * D + d];
        }
        let v = acc * inv_l;
        ov[d] = v;
        out[qh * D + d] = v;
    }
}

@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    combine_head(wid.x, li);
}

@compute @workgroup_size(WG)
fn combine_q8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    let qh = wid.x;
    combine_head(qh, li);
    workgroupBarrier();
    // One thread per block of 32.
    for (var b = li; b < D / 32u; b += WG) {
        var v: array<f32, 32>;
        for (var j = 0u; j < 32u; j++) { v[j] = ov[b * 32u + j]; }
        act_store(v, qh * (D / 32u) + b);
    }
}
