// Multi-column combine (attention_combine.wgsl, whose body it shares): grid (HQ, 1, B), column
// c = wid.z merges the partials of its query heads c * HQ + h at its own position into its
// output row. Appended by the host after attention_combine.wgsl, attention_cols.wgsl and
// columns.wgsl. Live columns are exactly those the chunk kernel ran for (same `col_live`), so
// no stale partial is ever combined.

@compute @workgroup_size(WG)
fn combine_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let c = wid.z;
    if (state.done != 0u || !col_live(c)) {
        return;
    }
    combine_head(c * HQ + wid.x, cols[c].pos, li);
}
