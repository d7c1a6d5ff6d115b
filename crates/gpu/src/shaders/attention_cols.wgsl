// Column state shared by the multi-column attention kernels (attention_chunk_cols.wgsl,
// attention_combine_cols.wgsl), appended by the host after the single-token source together with
// the `Col` struct (columns.wgsl). Bindings 10 and 11 are unused by the single-token entry points,
// so both forms share one binding numbering.
// cols     [B] Col (B >= 8; the prefill plan binds one per chunk token): column c's position, KV slot and done flag
// cp       slots: KV slots the bound caches hold ([slots, CTX, HKV, D]); a column whose slot is
//          not below it is skipped like a done one, so a bad slot never reaches memory

struct ColsParams { slots: u32, pad0: u32, pad1: u32, pad2: u32 };

@group(0) @binding(10) var<storage, read> cols: array<Col>;
@group(0) @binding(11) var<uniform> cp: ColsParams;

// Whether column c (uniform per workgroup: it comes from the workgroup id) runs at all.
fn col_live(c: u32) -> bool {
    return c < arrayLength(&cols) && cols[c].done == 0u && cols[c].slot < cp.slots;
}
