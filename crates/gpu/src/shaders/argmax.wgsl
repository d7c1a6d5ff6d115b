// Greedy argmax over logits in two dispatches (prepended: state.wgsl, columns.wgsl).
// Single token, logits[V]:
//   partial: workgroup g reduces elements [g*CHUNK, (g+1)*CHUNK) to (key, index) in part[g];
//   finish:  one workgroup reduces the partials, then thread 0 advances the run state:
//            token = winner, out_tokens[step] = winner, pos += 1, step += 1,
//            done = 1 when the winner is an EOS id or `step` reaches the run's length.
// Columns, logits [nb, V] (column c at c * V; argmax_cols.wgsl):
//   partial_cols: grid (nparts, nb), workgroup (g, c) -> part[c * nparts + g]; done columns skip;
//   finish_cols:  one workgroup reduces every live column in turn, then thread 0 advances each
//                 live column as above (out_tokens [nb, cap]: column c's id of step s at
//                 c * cap + s) and sets the shared state's done iff every column is done.
// Order (same as nibble_backend::argmax): larger value wins; equal values -> lower index; NaN
// never beats a number (all NaN -> index 0); -0.0 equals +0.0. Values are compared as
// order-preserving u32 keys, NaN mapped to key 0 below -inf, so no float NaN rules are involved.
struct Params { n: u32, nparts: u32, neos: u32, max_steps: u32, nb: u32, cap: u32, p0: u32, p1: u32 };
@group(0) @binding(0) var<storage, read> logits: array<f32>;          // [nb, n]
@group(0) @binding(1) var<storage, read_write> part: array<vec2<u32>>; // [nb, nparts] (key, index)
@group(0) @binding(2) var<storage, read_write> st: State;
@group(0) @binding(3) var<storage, read_write> out_tokens: array<u32>; // [nb, cap]
@group(0) @binding(4) var<storage, read> eos: array<u32>;             // [max(neos, 1)]
@group(0) @binding(5) var<uniform> p: Params;

const WG: u32 = 256u;
const PER_THREAD: u32 = 8u;
const CHUNK: u32 = WG * PER_THREAD;
var<workgroup> rk: array<u32, 256>;
var<workgroup> ri: array<u32, 256>;

// Order-preserving key: negative floats flip all bits, positive ones set the sign bit.
fn key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) { return 0u; } // NaN
    if ((b & 0x7fffffffu) == 0u) { return 0x80000000u; } // -0.0 == +0.0
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}
fn better(k: u32, i: u32, bk: u32, bi: u32) -> bool {
    return k > bk || (k == bk && i < bi);
}
// Tree-reduce this thread's (bk, bi) with the workgroup's; every thread gets the winner.
fn reduce(li: u32, bk: u32, bi: u32) -> vec2<u32> {
    rk[li] = bk;
    ri[li] = bi;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s && better(rk[li + s], ri[li + s], rk[li], ri[li])) {
            rk[li] = rk[li + s];
            ri[li] = ri[li + s];
        }
        workgroupBarrier();
    }
    let w = vec2<u32>(rk[0], ri[0]);
    // The slots are reused by the next reduction of the same workgroup.
    workgroupBarrier();
    return w;
}
// Best (key, index) of chunk g of the n logits at `off`; index relative to `off`.
fn chunk_best(off: u32, g: u32, li: u32) -> vec2<u32> {
    var bk = 0u;
    var bi = 0xffffffffu;
    let base = g * CHUNK;
    // Strided so neighbouring threads read neighbouring words.
    for (var k = 0u; k < PER_THREAD; k++) {
        let i = base + k * WG + li;
        if (i < p.n) {
            let kv = key(logits[off + i]);
            if (better(kv, i, bk, bi)) { bk = kv; bi = i; }
        }
    }
    return reduce(li, bk, bi);
}
// Best of the nparts partials at `off`.
fn parts_best(off: u32, li: u32) -> vec2<u32> {
    var bk = 0u;
    var bi = 0xffffffffu;
    for (var g = li; g < p.nparts; g += WG) {
        let c = part[off + g];
        if (better(c.x, c.y, bk, bi)) { bk = c.x; bi = c.y; }
    }
    return reduce(li, bk, bi);
}
// Whether a sequence that just produced `tok` as its step `step` (1-based) stops there.
fn stops(tok: u32, step: u32) -> bool {
    var stop = step >= p.max_steps;
    for (var e = 0u; e < p.neos; e++) { stop = stop || eos[e] == tok; }
    return stop;
}

@compute @workgroup_size(256)
fn partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    let w = chunk_best(0u, wid.x, li);
    if (li == 0u) { part[wid.x] = w; }
}

@compute @workgroup_size(256)
fn finish(@builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    // n > 0, so the winner is a real index.
    let tok = parts_best(0u, li).y;
    if (li != 0u) { return; }
    var s = st;
    if (s.step < p.max_steps) { out_tokens[s.step] = tok; }
    s.token = tok;
    s.pos += 1u;
    s.step += 1u;
    s.done = select(0u, 1u, stops(tok, s.step));
    st = s;
}
