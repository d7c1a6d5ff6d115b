// Expert down matvecs + routing-weighted combine with f32 activations: the f32 form of
// moe_down.wgsl (same bindings, grid, parts and `accumulate`), y = Σ_k w_k · W_down[e_k] · h_k
// (formats-spec §1.7 steps 5-6) added into `out` (the residual stream) or written to it.
// Prepended by the host: consts E, K, WG, T (lanes per team, power of two), RT (rows per team),
// H (output rows per expert), I (input width), NB (= I / 32), KNB (= K * NB), the `State` struct,
// F32_DEQ (numerics.rs: `dq_block`) and moe_stage_f32.wgsl.
// Grid: ceil(H / ROWS) workgroups (spread over x, y: linear id = wid.x + wid.y * nwg.x); team t
// of a workgroup owns its rows [RT t, RT t + RT).
// Column form (`main_cols`, multi-column runs, columns.rs; also needs columns.wgsl): z is the
// column c: route [c*2K..], h [c*K*I..], out [c*H..]; a column whose `cols[c].done` is set is
// skipped (its out untouched).
//
// Row r of the output has KNB items: item `it` = (slot it / NB, block it % NB). Lane l of a team
// takes items l, l + T, ... of each of the team's rows (expanded by the host into separate
// variables per item and row, see ITEMS_LOAD): one 16-byte weight load per item and row, issued
// before the staging below so the weight bytes are in flight while the workgroup copies the h
// slots its part holds (swizzled, moe_stage_f32.wgsl; item `it` reads staged block `it`, so the
// lanes of a phase read consecutive blocks, and each staged block read serves the RT rows). One
// barrier, the dots, then the row sums.
//
// route  [2K] u32: ids then f32 weight bits (router or gate_up_routed output; column form [nb, 2K])
// h      [K*I] f32 at binding 3 (column form [nb, K*I])
// qs, sc [(e_hi-e_lo)*H*NB] Q4_0 blocks of the part (tensor.rs layout)
// out    [H] f32 (column form [nb, H])
// cols   [8] Col (column form only)

struct Params { e_lo: u32, e_hi: u32, accumulate: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> route: array<u32>;
@group(0) @binding(3) var<storage, read> h: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> qs: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> sc: array<u32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read> cols: array<Col, 8>;

var<workgroup> xs: array<vec4<f32>, KNB * 8u>; // [K*I/4] h, swizzled (zeros for slots not held)
const ROWS: u32 = (WG / T) * RT;

var<workgroup> red: array<f32, WG * RT>;       // [ROWS, T] per-lane partials
var<workgroup> ids: array<u32, K>;
var<workgroup> wts: array<f32, K>;

fn scale(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}

fn held(e: u32) -> bool {
    return e >= params.e_lo && e < params.e_hi;
}

// Slot of item `it`, clamped (the last lanes' items may lie past KNB).
fn item_k(it: u32) -> u32 {
    return min(it / NB, K - 1u);
}

// Whether item `it` contributes: it exists and this part holds its slot's expert.
fn item_on(it: u32) -> bool {
    return it < KNB && held(ids[item_k(it)]);
}

// Weight block of item `it` in row `crow` of the part; an in-range stand-in when the item is off
// (its product is discarded).
fn item_blk(it: u32, crow: u32) -> u32 {
    let e = ids[item_k(it)];
    let el = select(params.e_lo, e, held(e)) - params.e_lo;
    return (el * H + crow) * NB + it % NB;
}

// Thread li's row of linear workgroup wid.x + wid.y * nwg.x for column `col` and its sum (`ok`:
// the thread has a row below H). Every thread calls it (down_rows has barriers).
struct RowSum { row: u32, tot: f32, ok: bool };
fn row_sum(wid: vec3<u32>, nwg: vec3<u32>, li: u32, col: u32) -> RowSum {
    let wg = wid.x + wid.y * nwg.x;
    let tot = down_rows(wg, li, col);
    let row = wg * ROWS + li;
    return RowSum(row, tot, li < ROWS && row < H);
}

// Add `tot` into out[i] (the residual, or a later part) or write it, as params say.
fn store(i: u32, tot: f32) {
    if (params.accumulate != 0u) {
        out[i] += tot;
    } else {
        out[i] = tot;
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (state.done != 0u) {
        return;
    }
    let r = row_sum(wid, nwg, li, 0u);
    if (r.ok) {
        store(r.row, r.tot);
    }
}

// The folded plan's first part (router_fold.rs): out = (out + a) + y, the o-proj's residual add
// that its dispatch left to this one (same rounding as adding a first, as the oracle does).
@group(0) @binding(9) var<storage, read> add_a: array<f32>; // [H]

@compute @workgroup_size(WG)
fn main_add(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (state.done != 0u) {
        return;
    }
    let r = row_sum(wid, nwg, li, 0u);
    if (r.ok) {
        out[r.row] = (out[r.row] + add_a[r.row]) + r.tot;
    }
}

@compute @workgroup_size(WG)
fn main_cols(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    // `c` is workgroup-uniform, so the return keeps the barriers uniform.
    let c = wid.z;
    if (state.done != 0u || c >= 8u || cols[c].done != 0u) {
        return;
    }
    let r = row_sum(wid, nwg, li, c);
    if (r.ok) {
        store(c * H + r.row, r.tot);
    }
}

// The rows of linear workgroup `wg` for column `col` (0 for one token): thread li < ROWS
// returns the sum of its row wg * ROWS + li (meaningful when that row is < H).
fn down_rows(wg: u32, li: u32, col: u32) -> f32 {
    let rbase = col * 2u * K;
    for (var k = li; k < K; k += WG) {
        ids[k] = min(route[rbase + k], E - 1u);
        wts[k] = bitcast<f32>(route[rbase + K + k]);
    }
    workgroupBarrier();
    let team = li / T;
    let lane = li % T;
    let row0 = wg * ROWS + team * RT;
    // ITEMS_LOAD (host-expanded): per row r `crow{r}` (rows past H, in the last workgroup,
    // compute on row 0 and are not written: keeps barriers uniform) and `acc{r}`; per item j
    // `it{j}`, and per item and row the weight block `q{j}_{r}` and its scale `s{j}_{r}`.
    //ITEMS_LOAD
    // Stage the h slots this part holds; the others are zeros (never read uninitialised).
    for (var i = li; i < KNB * 8u; i += WG) {
        var v = vec4<f32>(0.0);
        if (held(ids[i / (NB * 8u)])) {
            v = h[col * KNB * 8u + i];
        }
        xs[xs_slot(i)] = v;
    }
    workgroupBarrier();
    // ITEMS_DOT: acc{r} += w_k * s{j}_{r} * (q{j}_{r} . staged block it{j}) for the items on.
    //ITEMS_DOT
    //ROWS_STORE
    workgroupBarrier();
    // One barrier: thread li < ROWS adds the T partials of the workgroup's row li.
    var tot = 0.0;
    if (li < ROWS) {
        for (var j = 0u; j < T; j++) {
            tot += red[li * T + j];
        }
    }
    return tot;
}
