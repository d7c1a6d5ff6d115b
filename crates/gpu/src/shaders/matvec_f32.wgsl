// Plain f32 matrix x f32 vector (the router, or any non-quantised matrix), one matrix part.
// 256-thread workgroups of RPW rows x T lanes (prepended consts, RPW * T = 256): wide rows use one
// row per workgroup (the router's 128 rows fill 128 SMs instead of 16 workgroups), narrow ones 8
// rows x 32 lanes. Lanes stride the row by vec4 (coalesced) with two independent accumulators so
// a lane keeps two loads in flight, then a shared-memory tree reduction per row (no subgroup size
// assumed). Grid: ceil(rows / RPW) workgroups folded into (gx, gy). Prepended: state.wgsl and
// the input form: the plain vector (`xv` reads binding 1) or norm-on-load (matvec.rs: binding 1
// is the residual stream h, binding 5 the RMSNorm weight; `nol_stage` normalises into shared
// memory and `nol_publish` has workgroup 0 write the normalised vector to binding 6 for the
// kernels after this one: the RMSNorm dispatch before the router is gone).
struct Params { rows: u32, c4: u32, row_start: u32, gx: u32, eps: f32, p1: u32, p2: u32, p3: u32 };
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;       // [rows * c4]
@group(0) @binding(2) var<storage, read_write> y: array<f32>;       // [row_start + rows ..]
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> state: State;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) { return; }
    nol_stage(li, p.c4, p.eps);
    nol_publish(wid.x + wid.y, li, p.c4);
    let team = li / T;
    let lane = li % T;
    let row = (wid.x + wid.y * p.gx) * RPW + team;
    var acc = 0.0;
    if (row < p.rows) {
        let base = row * p.c4;
        var acc1 = 0.0;
        var c = lane;
        for (; c + T < p.c4; c += 2u * T) {
            acc += dot(w[base + c], xv(c));
            acc1 += dot(w[base + c + T], xv(c + T));
        }
        if (c < p.c4) {
            acc += dot(w[base + c], xv(c));
        }
        acc += acc1;
    }
    red[li] = acc;
    workgroupBarrier();
    for (var st = T / 2u; st > 0u; st >>= 1u) {
        if (lane < st) { red[li] += red[li + st]; }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[p.row_start + row] = red[li];
    }
}
