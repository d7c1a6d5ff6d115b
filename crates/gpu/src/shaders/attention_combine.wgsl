// Combine of the chunked attention (see attention.wgsl for the partial layouts).
// Prepended by the host: consts D, D4, HQ, C, CTX, NC, WG and the `State` struct.
// Grid: HQ workgroups, one per query head:
//   M = max_c m_c,  L = Σ_c l_c e^(m_c - M),  out[d] = Σ_c e^(m_c - M) part_o[c][d] / L.
// `combine` writes out [HQ*D] f32; `combine_q8` also writes it int8-quantised per block of 32
// (q: [HQ*D/4] u32 of packed i8, byte k of word i = element 4i+k; s: [HQ*D/32] (d, d*Σq)).

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read> part_o: array<f32>;
@group(0) @binding(2) var<storage, read> part_ml: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> out_q: array<u32>;
@group(0) @binding(5) var<storage, read_write> out_s: array<vec2<f32>>;

var<workgroup> ov: array<f32, D>;

// Round half away from zero (like quantize.wgsl and tensor::quantize_acts_ref), clamp to +-127.
fn q8(t: f32) -> i32 {
    return i32(clamp(sign(t) * floor(abs(t) + 0.5), -127.0, 127.0));
}

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
    // One thread per packed word: quantise 4 elements with their block's scale.
    for (var w = li; w < D / 4u; w += WG) {
        let b0 = (w / 8u) * 32u;
        var amax = 0.0;
        for (var j = 0u; j < 32u; j++) {
            amax = max(amax, abs(ov[b0 + j]));
        }
        let dq = amax / 127.0;
        let id = select(0.0, 1.0 / dq, dq > 0.0);
        var word = 0u;
        for (var k = 0u; k < 4u; k++) {
            let q = i32(q8(ov[w * 4u + k] * id));
            word |= (u32(q) & 0xFFu) << (8u * k);
        }
        out_q[qh * D / 4u + w] = word;
        if (w % 8u == 0u) {
            var sum = 0;
            for (var j = 0u; j < 32u; j++) {
                sum += i32(q8(ov[b0 + j] * id));
            }
            out_s[(qh * D + b0) / 32u] = vec2<f32>(dq, dq * f32(sum));
        }
    }
}
