// Embedding lookup from one part of a block matrix [V, H] (tensor.rs layout): writes the
// dequantised row of a token into h. One dispatch per matrix part; only the part holding the
// token writes. One thread per block of 32. Prepended: state.wgsl, columns.wgsl and the form
// (tensor.rs `QForm::wgsl`: `Q4_AFFINE`, `Q_OFF`, `SW`, `q4_sb`, `QB`, `qb_levels`; the affine form's weight
// = s·q + b with the group's bf16 scale and bias in the two halves of the scale word, as the
// reference computes it).
//   main:      token state.token -> h[H]; grid x = blocks / 64.
//   main_cols: token cols[c].token -> h[c * H ..][H] for each column c that is not done;
//              grid (blocks / 64, nb): y is the column.
struct Params { rows: u32, bpr: u32, row_start: u32, pad: u32 };
@group(0) @binding(0) var<storage, read> qs: array<QB>;         // [rows * bpr] blocks (tensor.rs QForm)
@group(0) @binding(1) var<storage, read> sc: array<SW>;          // [rows * bpr / 2] scale words (tensor.rs QForm)
@group(0) @binding(2) var<storage, read_write> h: array<vec4<f32>>; // [nb, bpr * 8]
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> state: State;           // main only
@group(0) @binding(5) var<storage, read> cols: array<Col>;    // main_cols only

// Four weights from their stored levels q: Q4_0's (q - 8) d, Q8_0's (q - 128) d, or the
// affine s q + b.
fn lvl(q: vec4<f32>, d: f32, off: f32) -> vec4<f32> {
    if (Q4_AFFINE) { return q * d + off; }
    return (q - Q_OFF) * d;
}

// Block b of `token`'s row into h[o4 .. o4 + 8] (vec4 units), if this part holds the token.
fn embed_block(token: u32, b: u32, o4: u32) {
    // The host validates token ids, but a stray id must not read out of bounds: it is skipped.
    if (b >= p.bpr || token < p.row_start || token - p.row_start >= p.rows) { return; }
    let blk = (token - p.row_start) * p.bpr + b;
    let w = qs[blk];
    // (scale, bias): the affine weight is scale q + bias, the others scale (q - Q_OFF).
    let sb = q4_sb(sc[blk >> 1u], blk);
    let o = o4 + b * 8u;
    for (var k = 0u; k < 8u; k++) {
        h[o + k] = lvl(qb_levels(w, k), sb.x, sb.y);
    }
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
