// Multi-column forms of the chunked attention (attention.wgsl, whose body they share): grid
// (chunks, HKV, B), column c = wid.z attends at its own position over its own slot's cache rows
// and writes its own partials / output rows (Site offsets). Appended by the host after
// attention.wgsl, attention_rope.wgsl, attention_cols.wgsl and columns.wgsl.
// Entry points:
//   `chunk_cols`, `single_cols`            independent columns (multi-stream decode): the owning
//                                          workgroup writes the column's k/v row as the
//                                          single-token kernel does. Columns must not read each
//                                          other's new rows (distinct slots, or rows they do not
//                                          cover).
//   `kv_write_cols`                        grid (1, HKV, B): norm + rope k, copy raw v of every
//                                          live column into its cache row (prefill, first).
//   `chunk_cols_read`, `single_cols_read`  after `kv_write_cols` (prefill: one slot, consecutive
//                                          positions): every row, the column's own included,
//                                          comes from the cache, so column c sees the rows of
//                                          columns < c written in the same step.
//   `fused_cols`, `fused_cols_read`        the chunk forms with the combine fused in (per
//                                          column and kv head: attention.wgsl `fused`).

// Column c's site: its position, its q|k|v, its slot's rows, its partial / output heads.
fn col_site(c: u32) -> Site {
    let col = cols[c];
    return Site(col.pos, c * (HQ + 2u * HKV) * D, col.slot * CTX, c * HQ);
}

fn attend_col(wid: vec3<u32>, li: u32, single: bool, write_kv: bool) {
    if (state.done != 0u || !col_live(wid.z)) {
        return;
    }
    attend(wid, li, col_site(wid.z), single, write_kv);
}

@compute @workgroup_size(WG)
fn chunk_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_col(wid, li, false, true);
}

@compute @workgroup_size(WG)
fn single_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_col(wid, li, true, true);
}

@compute @workgroup_size(WG)
fn chunk_cols_read(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_col(wid, li, false, false);
}

@compute @workgroup_size(WG)
fn single_cols_read(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_col(wid, li, true, false);
}

// Workgroup (_, h, c): k of kv head h of column c normed and roped, v copied raw, into row pos of
// the column's slot (the same roped4 the owning chunk workgroup uses, so the rows are identical).
@compute @workgroup_size(WG)
fn kv_write_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let c = wid.z;
    if (state.done != 0u || !col_live(c)) {
        return;
    }
    let s = col_site(c);
    // Out-of-cache positions are skipped, as the single-token kernel skips the write.
    if (s.pos >= CTX) {
        return;
    }
    let h = wid.y;
    rope_prepare(s.qkv, h, s.pos, li, G);
    let row = ((s.row0 + s.pos) * HKV + h) * D4;
    let vb = s.qkv / 4u + (HQ + HKV + h) * D4;
    for (var d = li; d < D4; d += WG) {
        k_cache[row + d] = kv_out(roped4(s.qkv, h, G, d));
        v_cache[row + d] = kv_out(qkv[vb + d]);
    }
}

// The fused forms (`fused` in attention.wgsl, per column): the last chunk workgroup of (column
// c, kv head h) to finish merges that column's partials; counter c * HKV + h.
fn attend_col_fused(wid: vec3<u32>, li: u32, write_kv: bool) {
    if (state.done != 0u || !col_live(wid.z)) {
        return;
    }
    attend_fused(wid, li, col_site(wid.z), wid.z * HKV + wid.y, write_kv);
}

@compute @workgroup_size(WG)
fn fused_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_col_fused(wid, li, true);
}

@compute @workgroup_size(WG)
fn fused_cols_read(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_col_fused(wid, li, false);
}
