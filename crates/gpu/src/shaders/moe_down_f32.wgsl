// Expert down matvecs + routing-weighted combine with f32 activations: the f32 form of
// moe_down.wgsl (same bindings, grid, parts and `accumulate`), y = Σ_k w_k · W_down[e_k] · h_k
// (formats-spec §1.7 steps 5-6) added into `out` (the residual stream) or written to it.
// Prepended by the host: consts E, K, WG, T (lanes per team, power of two), RT (rows per team),
// H (output rows per expert), I (input width), NB (= I / 32), KNB (= K * NB), DS (slot groups,
// dividing K), KS (= K / DS), KSNB (= KS * NB), NRB (row blocks = ceil(H / ROWS)), the `State`
// struct, F32_DEQ (numerics.rs: `dq_block`) and moe_stage_f32.wgsl.
// Grid: NRB * DS workgroups (spread over x, y: linear id = wid.x + wid.y * nwg.x; ids past that
// exit): workgroup (row block rb, group g) = linear rb + g * NRB; team t owns rows
// [RT t, RT t + RT) of the row block, over the K / DS slots [g KS, g KS + KS) of the route.
// Column form (`main_cols`, multi-column runs, columns.rs; also needs columns.wgsl): z is the
// column c: route [c*2K..], h [c*K*I..], out [c*H..]; a column whose `cols[c].done` is set is
// skipped (its out untouched).
//
// Row r of a group has KSNB items: item `it` = (slot g KS + it / NB, block it % NB). Lane l of a
// team takes items l, l + T, ... of each of the team's rows (expanded by the host into separate
// variables per item and row, see ITEMS_LOAD): one 16-byte weight load per item and row, issued
// before the staging below so the weight bytes are in flight while the workgroup copies the h
// slots of its group that its part holds (swizzled, moe_stage_f32.wgsl; item `it` reads staged
// block `it`, so the lanes of a phase read consecutive blocks, and each staged block read serves
// the RT rows). One barrier, the dots, then the row sums.
//
// Slot groups (DS > 1; Vulkan only, moe.rs `F32Tuning::for_context`): splitting the K slots over
// DS workgroups per row block gives DS times the workgroups, each with 1/DS of the items and of
// the staging (one workgroup per SM with all 8 slots at the real shape: too few warps to hide
// the dequantisation's latency). Each group writes its rows' sums to `dpart`, publishes them
// (storageBarrier: device-scope release in naga's SPIR-V) and counts itself in
// `darrive[column * NRB + rb]`; the last of the DS to count adds the DS sums in group order
// (fixed: every run and every column form gives the same bits) and stores the row, as
// attention.wgsl's fused combine does. DS = 1: no partials, no counter. `dpart` is `@coherent`
// (the host turns the marker into the attribute, Context::expand): with plain loads the last
// arriver read stale group sums on the H200 (the first dispatch of a fresh kernel, 2026-11-30).
//
// route  [2K] u32: ids then f32 weight bits (router or gate_up_routed output; column form [nb, 2K])
// h      [K*I] f32 at binding 3 (column form [nb, K*I])
// qs, sc [(e_hi-e_lo)*H*NB] Q4_0 blocks of the part (tensor.rs layout)
// out    [H] f32 (column form [nb, H])
// cols   [8] Col (column form only)
// dpart  [8, DS, H] f32 group sums (DS > 1)
// darrive [8, NRB] atomic u32 group arrivals, 0 between dispatches (DS > 1)

struct Params { e_lo: u32, e_hi: u32, accumulate: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> route: array<u32>;
@group(0) @binding(3) var<storage, read> h: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> qs: array<QB>;
@group(0) @binding(6) var<storage, read> sc: array<SW>; // [rows * bpr / 2] scale words (tensor.rs QForm)
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read> cols: array<Col, 8>;

var<workgroup> xs: array<vec4<f32>, KSNB * 8u>; // [KS*I/4] the group's h, swizzled (zeros for slots not held)
//XSUM_DECL
const ROWS: u32 = (WG / T) * RT;

// [ROWS, TP] per-lane partials (lane < T): rows TP = T + 1 words apart, so the ROWS readers of
// partial j hit different banks (T apart, they would share one or two of the 32).
const TP: u32 = T + 1u;
var<workgroup> red: array<f32, ROWS * TP>;
var<workgroup> ids: array<u32, KS>;            // the group's experts and weights
var<workgroup> wts: array<f32, KS>;
var<workgroup> dlast: u32;

fn scale(i: u32) -> f32 {
    return q4_coef(sc[i >> 1u], i).x;
}

fn held(e: u32) -> bool {
    return e >= params.e_lo && e < params.e_hi;
}

// The group's slot of item `it`, clamped (the last lanes' items may lie past KSNB).
fn item_k(it: u32) -> u32 {
    return min(it / NB, KS - 1u);
}

// Whether item `it` contributes: it exists and this part holds its slot's expert.
fn item_on(it: u32) -> bool {
    return it < KSNB && held(ids[item_k(it)]);
}

// Weight block of item `it` in row `crow` of the part; an in-range stand-in when the item is off
// (its product is discarded).
fn item_blk(it: u32, crow: u32) -> u32 {
    let e = ids[item_k(it)];
    let el = select(params.e_lo, e, held(e)) - params.e_lo;
    return (el * H + crow) * NB + it % NB;
}

// Thread li's row of linear workgroup wid.x + wid.y * nwg.x for column `col` and its sum (`ok`:
// the thread stores a row below H: with slot groups, only in the last group to finish). Every
// thread calls it (down_rows has barriers); every return is uniform per workgroup.
struct RowSum { row: u32, tot: f32, ok: bool };
/*COHERENT*/@group(0) @binding(10) var<storage, read_write> dpart: array<f32>;
@group(0) @binding(11) var<storage, read_write> darrive: array<atomic<u32>>;
fn row_sum(wid: vec3<u32>, nwg: vec3<u32>, li: u32, col: u32) -> RowSum {
    let wg = wid.x + wid.y * nwg.x;
    let rb = wg % NRB;
    let g = wg / NRB;
    let row = rb * ROWS + li;
    let mine = li < ROWS && row < H;
    if (g >= DS) {
        return RowSum(row, 0.0, false);
    }
    let tot = down_rows(rb, g, li, col);
    if (DS == 1u) {
        return RowSum(row, tot, mine);
    }
    if (mine) {
        dpart[(col * DS + g) * H + row] = tot;
    }
    storageBarrier();
    let ai = col * NRB + rb;
    if (li == 0u) {
        dlast = u32(atomicAdd(&darrive[ai], 1u) + 1u == DS);
    }
    if (workgroupUniformLoad(&dlast) == 0u) {
        return RowSum(row, 0.0, false);
    }
    storageBarrier();
    if (li == 0u) {
        atomicStore(&darrive[ai], 0u);
    }
    var sum = 0.0;
    if (mine) {
        for (var s = 0u; s < DS; s++) {
            sum += dpart[(col * DS + s) * H + row];
        }
    }
    return RowSum(row, sum, mine);
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

// `main_add` with warm workgroups after its own (kernels/warm.rs; the host appends the warm
// bindings): linear ids from NRB * DS on read another matrix (the next layer's qkv) into L2.
@compute @workgroup_size(WG)
fn main_add_warm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (state.done != 0u) {
        return;
    }
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= NRB * DS) {
        warm(wg - NRB * DS, li);
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

// The rows of row block `rb` over slot group `g` for column `col` (0 for one token): thread
// li < ROWS returns the group's sum of its row rb * ROWS + li (meaningful when that row is < H).
fn down_rows(rb: u32, g: u32, li: u32, col: u32) -> f32 {
    let rbase = col * 2u * K + g * KS;
    for (var k = li; k < KS; k += WG) {
        ids[k] = min(route[rbase + k], E - 1u);
        wts[k] = bitcast<f32>(route[rbase + K + k]);
    }
    workgroupBarrier();
    let team = li / T;
    let lane = li % T;
    let row0 = rb * ROWS + team * RT;
    // ITEMS_LOAD (host-expanded): per row r `crow{r}` (rows past H, in the last workgroup,
    // compute on row 0 and are not written: keeps barriers uniform) and `acc{r}`; per item j
    // `it{j}`, and per item and row the weight block `q{j}_{r}` and its scale `s{j}_{r}`.
    //ITEMS_LOAD
    // Stage the group's h slots this part holds; the others are zeros (never read uninitialised).
    // STAGE (host-expanded): one vec4 per thread and pass, or for the affine forms a whole block
    // per thread and pass with its sum `q4_xsum` into `xsum_s` (each block's sum computed once
    // for the workgroup's ROWS rows instead of once per team).
    let hb = (col * K + g * KS) * NB * 8u;
    //STAGE
    workgroupBarrier();
    // ITEMS_DOT: acc{r} += w_k * s{j}_{r} * (q{j}_{r} . staged block it{j}) for the items on.
    //ITEMS_DOT
    //ROWS_STORE
    workgroupBarrier();
    // One barrier: thread li < ROWS adds the T partials of the workgroup's row li.
    var tot = 0.0;
    if (li < ROWS) {
        for (var j = 0u; j < T; j++) {
            tot += red[li * TP + j];
        }
    }
    return tot;
}
