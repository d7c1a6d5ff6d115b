// Column entry points of the argmax (appended to argmax.wgsl, whose header describes them).
@group(0) @binding(6) var<storage, read_write> cols: array<Col, 8>;

var<workgroup> winners: array<u32, 8>;

@compute @workgroup_size(256)
fn partial_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let c = wid.y;
    if (c >= p.nb || cols[c].done != 0u) { return; }
    let w = chunk_best(c * p.n, wid.x, li);
    if (li == 0u) { part[c * p.nparts + wid.x] = w; }
}

@compute @workgroup_size(256)
fn finish_cols(@builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    let nb = min(p.nb, 8u);
    // Every thread takes part in every column's reduction (barriers stay in uniform control
    // flow); a done column's stale partials are reduced but never used.
    for (var c = 0u; c < nb; c++) {
        let w = parts_best(c * p.nparts, li);
        if (li == 0u) { winners[c] = w.y; }
    }
    if (li != 0u) { return; }
    var all_done = true;
    for (var c = 0u; c < nb; c++) {
        var s = cols[c];
        if (s.done == 0u) {
            let tok = winners[c];
            if (s.step < p.max_steps) { out_tokens[c * p.cap + s.step] = tok; }
            s.token = tok;
            s.pos += 1u;
            s.step += 1u;
            s.done = select(0u, 1u, stops(tok, s.step));
            cols[c] = s;
        }
        all_done = all_done && s.done != 0u;
    }
    st.done = select(0u, 1u, all_done);
}
