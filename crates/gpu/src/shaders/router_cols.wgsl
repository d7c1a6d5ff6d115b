// f32 router over columns with RMSNorm on load, one matrix part: for each column c that is not
// done, y[c * y_stride + row_start + row] = W[row] . rmsnorm(h[c]), and the first part's
// workgroup 0 of column c publishes xn[c] = rmsnorm(h[c]) for the kernels after the router.
// Grid (gx, gy, nb): x/y fold ceil(rows / RPW) row groups as in matvec_f32.wgsl, z is the
// column. 256-thread workgroups of RPW rows x T lanes (prepended consts, RPW * T = 256; one row
// per workgroup for wide rows). Prepended: columns.wgsl, the consts, matvec.rs's NORM_ON_LOAD
// with its reads of nol_h offset by `nol_base` (the column's first vec4).
struct Params { rows: u32, c4: u32, row_start: u32, gx: u32, eps: f32, y_stride: u32, publish: u32, p3: u32 };
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;         // [rows * c4]
@group(0) @binding(1) var<storage, read> nol_h: array<vec4<f32>>;     // [nb, c4] residual streams
@group(0) @binding(2) var<storage, read_write> y: array<f32>;         // [nb, y_stride] logits
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> cols: array<Col>;
@group(0) @binding(5) var<storage, read> nol_w: array<vec4<f32>>;     // [c4] RMSNorm weight
@group(0) @binding(6) var<storage, read_write> xn: array<vec4<f32>>;  // [nb, c4] normalised

// First vec4 of this workgroup's column in nol_h (read by the patched nol_stage).
var<private> nol_base: u32;
fn nol_slot(i: u32) -> u32 { return i; }

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let col = wid.z;
    if (col >= arrayLength(&cols) || cols[col].done != 0u) { return; }
    nol_base = col * p.c4;
    nol_stage(li, p.c4, p.eps);
    if (p.publish != 0u && wid.x + wid.y == 0u) {
        for (var i = li; i < p.c4; i += 256u) { xn[nol_base + i] = nol_xs[i]; }
    }
    let team = li / T;
    let lane = li % T;
    let row = (wid.x + wid.y * p.gx) * RPW + team;
    var acc = 0.0;
    if (row < p.rows) {
        let base = row * p.c4;
        // Two accumulators so a lane keeps two loads in flight.
        var acc1 = 0.0;
        var c = lane;
        for (; c + T < p.c4; c += 2u * T) {
            acc += dot(w[base + c], nol_xs[c]);
            acc1 += dot(w[base + c + T], nol_xs[c + T]);
        }
        if (c < p.c4) {
            acc += dot(w[base + c], nol_xs[c]);
        }
        acc += acc1;
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = T / 2u; s > 0u; s >>= 1u) {
        if (lane < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[col * p.y_stride + p.row_start + row] = red[li];
    }
}
