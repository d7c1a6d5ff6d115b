// Combine of the chunked attention (see attention.wgsl for the partial layouts).
// Prepended by the host: consts D, D4, HQ, C, CTX, NC, NW, WG (power of two, >= D4), the `State`
// struct and `chunk_len(n)` (attention.rs).
// Grid: HQ workgroups, one per query head (x B columns for `combine_cols`, appended by the host
// from attention_combine_cols.wgsl; partials and output then carry a leading column dimension):
//   M = max_c m_c,  L = Σ_c l_c e^(m_c - M),  out[d] = Σ_c e^(m_c - M) part_o[c][d] / L.
// `combine` writes out [HQ*D] f32; `combine_q8` also writes it int8-quantised per block of 32
// into bindings 4, 5 via `act_store` (plain or precise: the numerics snippet prepended by the
// host, numerics.rs).

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read> part_o: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> part_ml: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> ov: array<f32, D>;
// Chunk weights e^(m_c - M) (NW >= the most chunks any position uses).
var<workgroup> wts: array<f32, NW>;
var<workgroup> red: array<vec2<f32>, WG>;
var<workgroup> acc4: array<vec4<f32>, WG>;

// Merge two (max, sum) softmax partials.
fn merge(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// Combine query head qh (of the partials and output rows [B, HQ] flattened: column * HQ + head)
// at position pos into ov[] and out[]. All threads take part: (M, L) by a tree reduction over the
// chunks, then S = WG / D4 slices of the chunks per vec4 of D, summed in shared memory, so no
// thread walks all chunks serially.
fn combine_head(qh: u32, pos: u32, li: u32) {
    let n = min(pos + 1u, CTX);
    let cl = chunk_len(n);
    let nc = (n + cl - 1u) / cl;
    var ml = vec2<f32>(-3.4028235e38, 0.0);
    // Thread li's first chunk's (max, sum), kept for its weight below (one L2 round trip less).
    var own = vec2<f32>(0.0);
    for (var c = li; c < nc; c += WG) {
        let v = part_ml[qh * NC + c];
        if (c == li) {
            own = v;
        }
        ml = merge(ml, v);
    }
    red[li] = ml;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (li < st) {
            red[li] = merge(red[li], red[li + st]);
        }
        workgroupBarrier();
    }
    let mx = red[0].x;
    let inv_l = 1.0 / red[0].y;
    if (li < nc) {
        wts[li] = exp(own.x - mx);
    }
    for (var c = li + WG; c < nc; c += WG) {
        wts[c] = exp(part_ml[qh * NC + c].x - mx);
    }
    workgroupBarrier();
    let S = WG / D4;
    let s = li / D4;
    let d4 = li % D4;
    var a = vec4<f32>(0.0);
    if (s < S) {
        // Four chunks' loads in flight at a time; the sums keep chunk order.
        var c = s;
        for (; c + 3u * S < nc; c += 4u * S) {
            let b = (qh * NC + c) * D4 + d4;
            let o0 = part_o[b];
            let o1 = part_o[b + S * D4];
            let o2 = part_o[b + 2u * S * D4];
            let o3 = part_o[b + 3u * S * D4];
            a += wts[c] * o0;
            a += wts[c + S] * o1;
            a += wts[c + 2u * S] * o2;
            a += wts[c + 3u * S] * o3;
        }
        for (; c < nc; c += S) {
            a += wts[c] * part_o[(qh * NC + c) * D4 + d4];
        }
    }
    acc4[li] = a;
    workgroupBarrier();
    for (var d = li; d < D4; d += WG) {
        var v = vec4<f32>(0.0);
        for (var k = 0u; k < S; k++) {
            v += acc4[k * D4 + d];
        }
        v *= inv_l;
        for (var e = 0u; e < 4u; e++) {
            ov[4u * d + e] = v[e];
            out[qh * D + 4u * d + e] = v[e];
        }
    }
}

@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    combine_head(wid.x, state.pos, li);
}

@compute @workgroup_size(WG)
fn combine_q8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    let qh = wid.x;
    combine_head(qh, state.pos, li);
    workgroupBarrier();
    // One thread per block of 32.
    for (var b = li; b < D / 32u; b += WG) {
        var v: array<f32, 32>;
        for (var j = 0u; j < 32u; j++) { v[j] = ov[b * 32u + j]; }
        act_store(v, qh * (D / 32u) + b);
    }
}
