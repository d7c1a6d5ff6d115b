// Sampling of the next token on the GPU (prepended: state.wgsl), so sampled runs fold like
// greedy ones. The rule is the host sampler's (nibble_engine::sampler, the top-k path): the
// penalised row; the k best finite values, ordered by value (descending) then id (ascending);
// softmax of value / temperature over those k; top-p keeps the shortest prefix whose mass
// reaches p; min-p keeps probabilities >= min_p * the largest; a uniform u from the host (one
// per step, the host sampler's own RNG draws) times the kept mass walks the kept prefix.
// Greedy with penalties is k = 1 with no draw. Four dispatches per step:
//   hist    (grid G): penalise, store the value in `vals`, count the finite values per bin of
//           their key's top 11 bits (workgroup histograms added into `work`).
//   scan    (1 workgroup): the bin B where the count from the top reaches k (or every finite
//           value when fewer than k), zeroes the histogram for the next step.
//   collect (grid G): appends the id of every finite value in a bin >= B to `list`.
//   finish  (1 workgroup): exact selection inside `list` by radix rounds over the rest of the
//           composite key (value key, then ~id, so every key is distinct), sorts the k kept by
//           rank, draws, and advances the run state as the argmax does (token, out_tokens[step],
//           pos + 1, step + 1, done on EOS or at the run's end); counts[token] += 1 for the
//           penalties of the next step. No finite value: out_tokens[step] = 0xffffffff, done.
//
// Column forms (multi-stream runs, prepended columns.wgsl): the same per live column c of
// `cols`, every buffer holding one slice per column and `sps[c]` its settings (a greedy column:
// k = 1, no draw), grids (G, nb) and (1, nb); `finish_cols` advances `cols[c]` as the argmax's
// `finish_cols` does, and a fifth dispatch (`done_cols`) sets the run's `done` once every column
// is done.
//
// Shapes (B = 1 for the single-token entry points): logits [B, n] f32; req [B, n + ucap] u32:
// counts per id, then the uniforms (f32 bits) per step; vals [B, n] f32; work [B, HB + 8]
// atomic u32: the histogram, then SEL_*; list [B, n] u32 ids; out_tokens [B, rp.cap].
struct SParams {
    n: u32,
    k: u32,
    greedy: u32,
    penalties: u32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    repetition: f32,
    presence: f32,
    frequency: f32,
    // Uniforms held per column (the stride of `req` is n + ucap).
    ucap: u32,
    p1: u32,
};
// The argmax's run parameters (argmax.wgsl `Params`): the run length and EOS ids are shared.
struct RParams { n: u32, nparts: u32, neos: u32, max_steps: u32, nb: u32, cap: u32, p0: u32, p1: u32 };

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> req: array<u32>;
@group(0) @binding(2) var<storage, read_write> vals: array<f32>;
@group(0) @binding(3) var<storage, read_write> work: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read_write> list: array<u32>;
@group(0) @binding(5) var<storage, read_write> st: State;
@group(0) @binding(6) var<storage, read_write> out_tokens: array<u32>;
@group(0) @binding(7) var<storage, read> eos: array<u32>;
@group(0) @binding(8) var<storage, read> sps: array<SParams>;
@group(0) @binding(9) var<uniform> rp: RParams;
@group(0) @binding(10) var<storage, read_write> cols: array<Col, 8>;

const WG: u32 = 256u;
const PER: u32 = 4u;
const CHUNK: u32 = WG * PER;
// Histogram bins of the first pass: the key's top 11 bits (sign, exponent, 2 mantissa bits).
const HB: u32 = 2048u;
const HSHIFT: u32 = 21u;
// work[HB + ...]: the crossing bin, how many the bins above it hold, the list length, the
// number of values kept (min(k, finite values)), and 1 when no value is finite.
const SEL_BIN: u32 = 2048u;
const SEL_ABOVE: u32 = 2049u;
const SEL_LEN: u32 = 2050u;
const SEL_KEEP: u32 = 2051u;
const SEL_NONE: u32 = 2052u;
// Words of `work` per column.
const WORKW: u32 = 2056u;
// Most candidates kept (the host sampler streams top-k up to 256).
const KMAX: u32 = 256u;

// Order-preserving key of a finite f32 (total order: -0.0 below +0.0, as `total_cmp`).
fn key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}
fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) < 0x7f800000u;
}

// The penalised value of id i of column col (the host sampler's `apply_penalties`, in f32).
fn value(col: u32, i: u32) -> f32 {
    let sp = sps[col];
    var x = logits[col * sp.n + i];
    if (sp.penalties != 0u && finite(x)) {
        let c = req[col * (sp.n + sp.ucap) + i];
        if (c > 0u) {
            if (x > 0.0) {
                x = x / sp.repetition;
            } else {
                x = x * sp.repetition;
            }
            x = x - (sp.presence + f32(c) * sp.frequency);
        }
    }
    return x;
}

var<workgroup> lh: array<atomic<u32>, HB>;

fn hist_body(col: u32, g: u32, li: u32) {
    let n = sps[col].n;
    for (var b = li; b < HB; b += WG) { atomicStore(&lh[b], 0u); }
    workgroupBarrier();
    for (var j = 0u; j < PER; j++) {
        let i = g * CHUNK + j * WG + li;
        if (i < n) {
            let x = value(col, i);
            vals[col * n + i] = x;
            if (finite(x)) { atomicAdd(&lh[key(x) >> HSHIFT], 1u); }
        }
    }
    workgroupBarrier();
    for (var b = li; b < HB; b += WG) {
        let c = atomicLoad(&lh[b]);
        if (c > 0u) { atomicAdd(&work[col * WORKW + b], c); }
    }
}

@compute @workgroup_size(256)
fn hist(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    hist_body(0u, wid.x, li);
}

// Whether column c of a column run is idle (past the run's columns, or done).
fn col_idle(c: u32) -> bool {
    return c >= min(rp.nb, 8u) || cols[c].done != 0u;
}

@compute @workgroup_size(256)
fn hist_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (col_idle(wid.y)) { return; }
    hist_body(wid.y, wid.x, li);
}

// Inclusive suffix sums over the workgroup: after it, sfx[t] = Σ_{u >= t} (thread u's value).
var<workgroup> sfx: array<u32, WG>;
fn suffix_sums(li: u32, v: u32) {
    sfx[li] = v;
    workgroupBarrier();
    for (var s = 1u; s < WG; s <<= 1u) {
        var add = 0u;
        if (li + s < WG) { add = sfx[li + s]; }
        workgroupBarrier();
        sfx[li] += add;
        workgroupBarrier();
    }
}

fn scan_body(col: u32, li: u32) {
    let sp = sps[col];
    let w0 = col * WORKW;
    // Thread t owns bins [8t, 8t + 8).
    const BPT: u32 = HB / WG;
    var h: array<u32, BPT>;
    var own = 0u;
    for (var j = 0u; j < BPT; j++) {
        h[j] = atomicLoad(&work[w0 + li * BPT + j]);
        own += h[j];
        atomicStore(&work[w0 + li * BPT + j], 0u);
    }
    suffix_sums(li, own);
    let total = sfx[0];
    var after = 0u;
    if (li + 1u < WG) { after = sfx[li + 1u]; }
    if (li == 0u) {
        atomicStore(&work[w0 + SEL_LEN], 0u);
        atomicStore(&work[w0 + SEL_NONE], select(0u, 1u, total == 0u));
        atomicStore(&work[w0 + SEL_KEEP], min(sp.k, total));
        if (total <= sp.k) {
            // Every finite value is kept: bin 0 and up, nothing above it.
            atomicStore(&work[w0 + SEL_BIN], 0u);
            atomicStore(&work[w0 + SEL_ABOVE], 0u);
        }
    }
    // The thread whose bins hold the k-th largest value (only when total > k).
    if (total > sp.k && after < sp.k && after + own >= sp.k) {
        var above = after;
        for (var j = BPT; j > 0u; j--) {
            let c = h[j - 1u];
            if (above + c >= sp.k) {
                atomicStore(&work[w0 + SEL_BIN], li * BPT + j - 1u);
                atomicStore(&work[w0 + SEL_ABOVE], above);
                break;
            }
            above += c;
        }
    }
}

@compute @workgroup_size(256)
fn scan(@builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    scan_body(0u, li);
}

@compute @workgroup_size(256)
fn scan_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (col_idle(wid.y)) { return; }
    scan_body(wid.y, li);
}

var<workgroup> wcount: atomic<u32>;
var<workgroup> wbase: u32;

fn collect_body(col: u32, g: u32, li: u32) {
    let n = sps[col].n;
    let w0 = col * WORKW;
    if (li == 0u) { atomicStore(&wcount, 0u); }
    workgroupBarrier();
    let bin = atomicLoad(&work[w0 + SEL_BIN]);
    var mine: array<u32, PER>;
    var at: array<u32, PER>;
    var nm = 0u;
    for (var j = 0u; j < PER; j++) {
        let i = g * CHUNK + j * WG + li;
        if (i < n) {
            let x = vals[col * n + i];
            if (finite(x) && (key(x) >> HSHIFT) >= bin) {
                mine[nm] = i;
                at[nm] = atomicAdd(&wcount, 1u);
                nm++;
            }
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        let c = atomicLoad(&wcount);
        wbase = 0u;
        if (c > 0u) { wbase = atomicAdd(&work[w0 + SEL_LEN], c); }
    }
    let base = workgroupUniformLoad(&wbase);
    for (var j = 0u; j < nm; j++) { list[col * n + base + at[j]] = mine[j]; }
}

@compute @workgroup_size(256)
fn collect(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    collect_body(0u, wid.x, li);
}

@compute @workgroup_size(256)
fn collect_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (col_idle(wid.y)) { return; }
    collect_body(wid.y, wid.x, li);
}

// The finish's selection: a histogram of the next digit, the threshold so far (composite key
// (tk, tn), tn = ~id) and the kept candidates.
var<workgroup> dh: array<atomic<u32>, 256>;
var<workgroup> sel: vec4<u32>; // (digit chosen, above it, resolved, -)
var<workgroup> ck: array<u32, KMAX>;   // kept: value key
var<workgroup> cn: array<u32, KMAX>;   // kept: ~id
var<workgroup> sx: array<f32, KMAX>;   // sorted by rank: value
var<workgroup> sid: array<u32, KMAX>;  // sorted by rank: id
var<workgroup> sp_e: array<f32, KMAX>; // exp(s - max), then probabilities
var<workgroup> nkept: atomic<u32>;

// Digit r of the composite key (key, ~id) below the first pass's 11 bits: key bits 13..21,
// 5..13, 0..5, then ~id bits 24..32, 16..24, 8..16, 0..8.
fn digit(r: u32, k: u32, nid: u32) -> u32 {
    switch (r) {
        case 0u: { return (k >> 13u) & 0xffu; }
        case 1u: { return (k >> 5u) & 0xffu; }
        case 2u: { return k & 0x1fu; }
        case 3u: { return nid >> 24u; }
        case 4u: { return (nid >> 16u) & 0xffu; }
        case 5u: { return (nid >> 8u) & 0xffu; }
        default: { return nid & 0xffu; }
    }
}
// Whether (k, nid) agrees with the prefix (pk, pn) on every digit before round r (and on the
// first pass's bin).
fn agrees(r: u32, k: u32, nid: u32, pk: u32, pn: u32) -> bool {
    var mk = 0xffe00000u;
    var mn = 0u;
    if (r >= 1u) { mk = 0xffffe000u; }
    if (r >= 2u) { mk = 0xffffffe0u; }
    if (r >= 3u) { mk = 0xffffffffu; }
    if (r >= 4u) { mn = 0xff000000u; }
    if (r >= 5u) { mn = 0xffff0000u; }
    if (r >= 6u) { mn = 0xffffff00u; }
    return (k & mk) == (pk & mk) && (nid & mn) == (pn & mn);
}
fn set_digit(r: u32, d: u32, pk: ptr<function, u32>, pn: ptr<function, u32>) {
    switch (r) {
        case 0u: { *pk |= d << 13u; }
        case 1u: { *pk |= d << 5u; }
        case 2u: { *pk |= d; }
        case 3u: { *pn |= d << 24u; }
        case 4u: { *pn |= d << 16u; }
        case 5u: { *pn |= d << 8u; }
        default: { *pn |= d; }
    }
}

// The id column `col` picks at its step `step` (every thread calls it; thread 0's result is
// the one to use): 0xffffffff when no value is finite.
fn pick(col: u32, step: u32, li: u32) -> u32 {
    let sp = sps[col];
    let w0 = col * WORKW;
    let l0 = col * sp.n;
    let len = atomicLoad(&work[w0 + SEL_LEN]);
    let keep = atomicLoad(&work[w0 + SEL_KEEP]);
    if (atomicLoad(&work[w0 + SEL_NONE]) != 0u) {
        return 0xffffffffu;
    }
    // Threshold (pk, pn): every candidate with a composite key >= it is kept. Start at the
    // crossing bin; `need` of the candidates agreeing with the prefix are still to be taken.
    var pk = atomicLoad(&work[w0 + SEL_BIN]) << HSHIFT;
    var pn = 0u;
    var need = keep - atomicLoad(&work[w0 + SEL_ABOVE]);
    var resolved = len == keep;
    for (var r = 0u; r < 7u && !resolved; r++) {
        atomicStore(&dh[li], 0u);
        workgroupBarrier();
        for (var e = li; e < len; e += WG) {
            let id = list[l0 + e];
            let k = key(vals[l0 + id]);
            if (agrees(r, k, ~id, pk, pn)) { atomicAdd(&dh[digit(r, k, ~id)], 1u); }
        }
        workgroupBarrier();
        let c = atomicLoad(&dh[li]);
        suffix_sums(li, c);
        var after = 0u;
        if (li + 1u < WG) { after = sfx[li + 1u]; }
        if (after < need && after + c >= need) {
            // Digit li holds the need-th candidate: all of it is taken when it holds exactly
            // what is still needed (then the zero bits below complete the threshold).
            sel = vec4<u32>(li, after, select(0u, 1u, after + c == need), 0u);
        }
        workgroupBarrier();
        let s = sel;
        set_digit(r, s.x, &pk, &pn);
        need -= s.y;
        resolved = s.z != 0u;
        workgroupBarrier();
    }
    // Gather the kept candidates (exactly `keep`), then place each by its rank.
    if (li == 0u) { atomicStore(&nkept, 0u); }
    workgroupBarrier();
    for (var e = li; e < len; e += WG) {
        let id = list[l0 + e];
        let k = key(vals[l0 + id]);
        if (k > pk || (k == pk && ~id >= pn)) {
            let at = atomicAdd(&nkept, 1u);
            if (at < KMAX) {
                ck[at] = k;
                cn[at] = ~id;
            }
        }
    }
    workgroupBarrier();
    let nk = min(atomicLoad(&nkept), KMAX);
    if (li < nk) {
        let k = ck[li];
        let n = cn[li];
        var rank = 0u;
        for (var j = 0u; j < nk; j++) {
            rank += select(0u, 1u, ck[j] > k || (ck[j] == k && cn[j] > n));
        }
        sid[rank] = ~n;
        sx[rank] = vals[l0 + ~n];
    }
    workgroupBarrier();
    if (sp.greedy == 0u) {
        // Softmax of value / temperature over the kept, max-subtracted (the first is the max).
        if (li < nk) { sp_e[li] = exp(sx[li] / sp.temperature - sx[0] / sp.temperature); }
        workgroupBarrier();
    }
    if (li != 0u) { return 0u; }
    var tok = sid[0];
    if (sp.greedy == 0u) {
        // Worked on the unnormalised weights e_j = exp(s_j - s_0) (the host's p_j times its
        // total): p_j >= min_p / total is e_j >= min_p, a prefix mass of p is Σ e_j >= p * total,
        // and the walk is scale-free. On tied values the e_j are exact (1.0), so the sums are
        // exact integers there and top-p cuts where the host's f64 sums cut.
        var total = 0.0;
        for (var j = 0u; j < nk; j++) { total += sp_e[j]; }
        let reach = sp.top_p * total;
        var cut = nk;
        var acc = 0.0;
        for (var j = 0u; j < nk; j++) {
            let e = sp_e[j];
            if (sp.min_p > 0.0 && e < sp.min_p) { cut = min(cut, j); }
            acc += e;
            if (sp.top_p < 1.0 && acc >= reach) { cut = min(cut, j + 1u); }
        }
        cut = max(cut, 1u);
        var mass = 0.0;
        for (var j = 0u; j < cut; j++) { mass += sp_e[j]; }
        var u = bitcast<f32>(req[col * (sp.n + sp.ucap) + sp.n + step]) * mass;
        tok = sid[cut - 1u];
        for (var j = 0u; j < cut; j++) {
            if (u < sp_e[j]) {
                tok = sid[j];
                break;
            }
            u -= sp_e[j];
        }
    }
    return tok;
}

// Whether a sequence that just produced `tok` as its step `step` (1-based) stops there.
fn stops(tok: u32, step: u32) -> bool {
    var stop = step >= rp.max_steps;
    for (var e = 0u; e < rp.neos; e++) { stop = stop || eos[e] == tok; }
    return stop;
}

@compute @workgroup_size(256)
fn finish(@builtin(local_invocation_index) li: u32) {
    if (st.done != 0u) { return; }
    let tok = pick(0u, st.step, li);
    if (li != 0u) { return; }
    var s = st;
    if (s.step < rp.max_steps) { out_tokens[s.step] = tok; }
    s.token = tok;
    s.pos += 1u;
    s.step += 1u;
    s.done = select(0u, 1u, tok == 0xffffffffu || stops(tok, s.step));
    st = s;
    if (tok != 0xffffffffu && sps[0].penalties != 0u) { req[tok] += 1u; }
}

// One workgroup per column: column c's pick advances `cols[c]` (out_tokens [nb, rp.cap]).
@compute @workgroup_size(256)
fn finish_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let c = wid.y;
    if (col_idle(c)) { return; }
    let tok = pick(c, cols[c].step, li);
    if (li != 0u) { return; }
    var s = cols[c];
    if (s.step < rp.max_steps) { out_tokens[c * rp.cap + s.step] = tok; }
    s.token = tok;
    s.pos += 1u;
    s.step += 1u;
    s.done = select(0u, 1u, tok == 0xffffffffu || stops(tok, s.step));
    cols[c] = s;
    let sp = sps[c];
    if (tok != 0xffffffffu && sp.penalties != 0u) { req[c * (sp.n + sp.ucap) + tok] += 1u; }
}

// The run's `done` once every column is.
@compute @workgroup_size(1)
fn done_cols() {
    var all = true;
    for (var c = 0u; c < min(rp.nb, 8u); c++) { all = all && cols[c].done != 0u; }
    st.done = select(0u, 1u, all);
}
