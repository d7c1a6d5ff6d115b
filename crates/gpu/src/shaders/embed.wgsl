// Embedding lookup from one part of a Q4_0 matrix [V, H] (tensor.rs layout): writes the
// dequantised row of a token into h. One dispatch per matrix part; only the part holding the
// token writes. One thread per block of 32. Prepended: state.wgsl, columns.wgsl.
//   main:      token state.token -> h[H]; grid x = blocks / 64.
//   main_cols: token cols[c].token -> h[c * H ..][H] for each column c that is not done;
//              grid (blocks / 64, nb): y is the column.
struct Params { rows: u32, bpr: u32, row_start: u32, pad: u32 };
@group(0) @binding(0) var<storage, read> qs: array<vec4<u32>>;   // [rows * bpr]
@group(0) @binding(1) var<storage, read> sc: array<u32>;         // [rows * bpr] f16, 2 per word
@group(0) @binding(2) var<storage, read_write> h: array<vec4<f32>>; // [nb, bpr * 8]
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> state: State;           // main only
@group(0) @binding(5) var<storage, read> cols: array<Col>;    // main_cols only

fn lo4(v: u32) -> vec4<f32> { return vec4<f32>((vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u)); }
fn hi4(v: u32) -> vec4<f32> { return vec4<f32>((vec4<u32>(v) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u)); }

// Block b of `token`'s row into h[o4 .. o4 + 8] (vec4 units), if this part holds the token.
fn embed_block(token: u32, b: u32, o4: u32) {
    // The host validates token ids, but a stray id must not read out of bounds: it is skipped.
    if (b >= p.bpr || token < p.row_start || token - p.row_start >= p.rows) { return; }
    let blk = (token - p.row_start) * p.bpr + b;
    let w = qs[blk];
    let s = unpack2x16float(sc[blk >> 1u]);
    let d = select(s.x, s.y, (blk & 1u) == 1u);
    let o = o4 + b * 8u;
    h[o] = (lo4(w.x) - 8.0) * d;
    h[o + 1u] = (lo4(w.y) - 8.0) * d;
    h[o + 2u] = (lo4(w.z) - 8.0) * d;
    h[o + 3u] = (lo4(w.w) - 8.0) * d;
    h[o + 4u] = (hi4(w.x) - 8.0) * d;
    h[o + 5u] = (hi4(w.y) - 8.0) * d;
    h[o + 6u] = (hi4(w.z) - 8.0) * d;
    h[o + 7u] = (hi4(w.w) - 8.0) * d;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (state.done != 0u) { return; }
    embed_block(state.token, gid.x, 0u);
}

@compute @workgroup_size(64)
fn main_cols(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.y;
    if (c >= arrayLength(&cols) || cols[c].done != 0u) { return; }
    embed_block(cols[c].token, gid.x, c * p.bpr * 8u);
}
