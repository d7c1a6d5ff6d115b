// Causal GQA attention of a prefill chunk with query tiles (attention_prefill.rs): workgroup
// (b, h) takes the BQ consecutive tokens of tile b and the G query heads of kv head h, R = BQ * G
// = 64 query rows, and streams the K/V rows 0 ..= (its last token's position) through shared
// memory once for all of them, BK rows per tile. The chunk's own K/V rows are already in the
// cache (`kv_write_cols` ran first). Tiles run longest first (tile b = last - workgroup x): under
// the causal mask the last tokens walk the most keys, and starting them first keeps the tail short.
// Prepended by the host: consts D, D4, HQ, HKV, G, CTX, EPS, SCALE, QKVW4 (vec4s per token of
// qkv), BQ, BK, R, KS (vec4 stride of a staged K/V row: D4 + 1, so 8 rows start in 8 different
// bank groups), PS (float stride of a score row: BK + 4), KPT (= BK / 8), DG, DV (= D4 / DG), QPV
// (= R DG / 256), and columns.wgsl (`Col`).
//
// Why this shape: the work per key is 2 D multiply-adds per query row, and a kernel that gives
// each thread one query row (its earlier form) pays one shared-memory load per 4 of them. Here a
// thread computes a small block of products from values it loads once and reuses:
// 1. Scores: thread (qg = li / 8, kq = li % 8) owns rows 2 qg, 2 qg + 1 and keys kq + 8 i
//    (i < KPT): per vec4 of D, 2 loads of q (from `part_o`, see below) and KPT of K, 2 KPT vec4
//    fmas. The raw scores go to `ps`.
// 2. Online softmax: thread (r = li / 4, part = li % 4) reads row r's BK scores, and the four
//    threads of a row compute the same running max m (same inputs, same order: no exchange
//    needed); after a barrier each rescales its own partial sum l and turns its BK / 4 scores
//    into weights exp(s - m) in place. The rescale factor of the row goes to `cr`.
// 3. Output: thread (qv = li / DG, dg = li % DG) owns rows QPV qv .. + QPV and the vec4s dg + DG i
//    (i < DV) of D: it scales its accumulators by `cr` and adds p V; each V vec4 it loads serves
//    its QPV rows.
// q is normed, roped and scaled by 1/sqrt(D) once per workgroup (as attention_rope.wgsl does,
// same cos_sin range reduction) and parked in this workgroup's own rows of `part_o` (split s's
// slice), which no other workgroup touches. Scores past a row's own position are masked.
// Five barriers per K/V tile. Each `// @GEN name` line is written out by the host as
// straight-line code over named registers (`unroll` in attention_prefill.rs: a0.., b0.. the
// scores, o0_0.. the output), for the reason given there.
//
// Splits (`dims.p1` = S, the grid's z): where the chunk has too few tiles to fill the GPU, the
// keys 0 ..= pmax of each tile are cut into S runs of whole K/V tiles, workgroup z = s takes run
// s and leaves its unnormalised output and (m, l) per row in `part_o` / `part_ml`, and `combine`
// merges the S partials of each row into `out`. With S = 1 the output goes to `out` directly.
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };

@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;        // [T, QKVW4]
@group(0) @binding(1) var<storage, read> q_norm: array<f32>;           // [D]
@group(0) @binding(2) var<storage, read> inv_freq: array<f32>;         // [D/2]
@group(0) @binding(3) var<storage, read> k_cache: array<KV>;    // [slots, CTX, HKV, D4] (kv_wgsl)
@group(0) @binding(4) var<storage, read> v_cache: array<KV>;    // [slots, CTX, HKV, D4]
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;  // [T, HQ * D4]
@group(0) @binding(6) var<storage, read> cols: array<Col>;             // [T] positions, slot
@group(0) @binding(7) var<uniform> dims: Dims;
@group(0) @binding(8) var<storage, read_write> part_o: array<vec4<f32>>; // [S, T, HQ * D4]
@group(0) @binding(9) var<storage, read_write> part_ml: array<vec2<f32>>; // [S, T, HQ] (m, l)

const HALF: u32 = D / 2u;
// Threads per query row in the q norm.
const NS: u32 = 256u / R;
const DS4: u32 = D4 / NS;
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;
const INV_TWO_PI: f32 = 0.15915494309189535;

var<workgroup> ks: array<vec4<f32>, BK * KS>;   // [BK][KS] the tile's K rows
var<workgroup> vs: array<vec4<f32>, BK * KS>;   // [BK][KS] the tile's V rows
var<workgroup> ps: array<f32, R * PS>;          // [R][PS] scores, then weights; norm sums first
var<workgroup> cr: array<f32, R>;               // [R] each row's rescale for this tile

fn cos_sin(a: f32) -> vec2<f32> {
    let k = round(a * INV_TWO_PI);
    let r = fma(-k, TWO_PI_LO, fma(-k, TWO_PI_HI, a));
    return vec2<f32>(cos(r), sin(r));
}

fn q_at(i: u32) -> f32 {
    return qkv[i / 4u][i % 4u];
}

// Row r of the workgroup: token t0 + r / G (clamped to the chunk: rows past it mirror the last
// token and are never written), query head h G + r % G; its first vec4 in a `[T, HQ * D4]` slice.
fn row_base(t0: u32, h: u32, r: u32) -> u32 {
    let t = min(t0 + r / G, mm - 1u);
    return t * HQ * D4 + (h * G + r % G) * D4;
}

// The chunk's tokens and key splits as `dims` says, clamped to what the bound buffers hold
// (the same values whenever the host is right, attention_prefill.rs `dims`): the module runs
// without runtime bounds checks (attention_prefill.rs `with_variant`), so no `dims` value may
// index past `out`, `part_o` or `part_ml`; `main` clamps mm by `cols` and `qkv` too.
var<private> mm: u32;
var<private> nsc: u32;
fn clamp_dims(m_more: u32) {
    mm = min(min(dims.m, m_more), arrayLength(&out) / (HQ * D4));
    let prow = min(arrayLength(&part_ml) / HQ, arrayLength(&part_o) / (HQ * D4));
    nsc = min(max(dims.p1, 1u), prow / max(mm, 1u));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    clamp_dims(min(arrayLength(&cols), arrayLength(&qkv) / QKVW4));
    let tiles = (mm + BQ - 1u) / BQ;
    let ns = nsc;
    let sid = wid.z;
    // Uniform: the whole workgroup leaves or stays.
    if (wid.x >= tiles || sid >= ns) {
        return;
    }
    let t0 = (tiles - 1u - wid.x) * BQ;
    let h = wid.y;
    // This split's slice of part_o and part_ml.
    let so = sid * mm * HQ * D4;
    let sm = sid * mm * HQ;
    // The tile's last position and its slot's first cache row (uniform).
    // Clamped into the cache (the host keeps positions below CTX and slots below the cache's):
    // K/V rows are read at row0 + min(kb + j, pmax) only.
    let pmax = min(cols[min(t0 + BQ, mm) - 1u].pos, CTX - 1u);
    let slots = min(arrayLength(&k_cache), arrayLength(&v_cache)) / (CTX * HKV * D4);
    let row0 = min(cols[t0].slot, slots - 1u) * CTX;

    // q norm + RoPE: NS threads per row, the NS partial sums of squares summed in slot order.
    {
        let r = li / NS;
        let sl = li % NS;
        let tq = t0 + r / G;
        let tc = min(tq, mm - 1u);
        let hq = h * G + r % G;
        let qb = tc * QKVW4 * 4u + hq * D;
        var ss = 0.0;
        for (var k4 = 0u; k4 < DS4; k4++) {
            let v = qkv[qb / 4u + k4 * NS + sl];
            ss += dot(v, v);
        }
        ps[r * PS + sl] = ss;
        workgroupBarrier();
        var tot = 0.0;
        for (var s = 0u; s < NS; s++) {
            tot += ps[r * PS + s];
        }
        let inv = inverseSqrt(tot / f32(D) + EPS);
        let p = f32(cols[tc].pos);
        if (tq < mm) {
            for (var k4 = 0u; k4 < DS4; k4++) {
                var v: vec4<f32>;
                for (var j = 0u; j < 4u; j++) {
                    let d = 4u * (k4 * NS + sl) + j;
                    let i = d % HALF;
                    let a = q_at(qb + i) * inv * q_norm[i];
                    let b = q_at(qb + i + HALF) * inv * q_norm[i + HALF];
                    let cs = cos_sin(p * inv_freq[i]);
                    if (d < HALF) {
                        v[j] = a * cs.x - b * cs.y;
                    } else {
                        v[j] = b * cs.x + a * cs.y;
                    }
                }
                part_o[so + tc * HQ * D4 + hq * D4 + k4 * NS + sl] = v * SCALE;
            }
        }
    }
    // The q rows in `part_o` are visible to the whole workgroup from here on.
    storageBarrier();

    // Phase 1 roles: rows sa, sa + 1 (their q in `part_o`, their positions) and keys kq + 8 i.
    let kq = li % 8u;
    let sa = 2u * (li / 8u);
    let qa = so + row_base(t0, h, sa);
    let qb2 = so + row_base(t0, h, sa + 1u);
    let pos_a = cols[min(t0 + sa / G, mm - 1u)].pos;
    let pos_b = cols[min(t0 + (sa + 1u) / G, mm - 1u)].pos;
    // Phase 2 roles: row sr, part sp of its scores; m and l of the row.
    let sr = li / 4u;
    let sp = li % 4u;
    var m = -3.0e38;
    var l = 0.0;
    // Phase 3 roles: rows QPV ov .. + QPV, vec4s dg + DG i.
    let dg = li % DG;
    let ov = QPV * (li / DG);
    // @GEN out_init

    // This split's K/V tiles (uniform): run sid of ns over the tiles 0 .. nk.
    let nk = pmax / BK + 1u;
    let per = (nk + ns - 1u) / ns;
    let kb_end = min(nk, (sid + 1u) * per) * BK;
    for (var kb = sid * per * BK; kb < kb_end; kb += BK) {
        // The last tile's weights and V rows (and, first time round, the norm sums) are free.
        workgroupBarrier();
        for (var i = li; i < select(BK * D4, 0u, (VARIANT & 8u) != 0u); i += 256u) {
            let j = i / D4;
            let c = i % D4;
            let kp = min(kb + j, pmax);
            let src = ((row0 + kp) * HKV + h) * D4 + c;
            ks[j * KS + c] = kv_in(k_cache[src]);
            vs[j * KS + c] = kv_in(v_cache[src]);
        }
        workgroupBarrier();
        // 1. Scores of rows sa, sa + 1 against keys kq + 8 i.
        // @GEN scores_init
        for (var c = 0u; c < select(D4, 0u, (VARIANT & 1u) != 0u); c++) {
            let x = part_o[qa + c];
            let y = part_o[qb2 + c];
            // @GEN scores_body
        }
        let one = vec4<f32>(1.0);
        // @GEN scores_store
        workgroupBarrier();
        // 2. Row sr: the new running max over all BK scores, then this part's weights.
        var mt = m;
        for (var c = 0u; c < BK / 4u; c++) {
            let s = vec4<f32>(ps[sr * PS + 4u * c], ps[sr * PS + 4u * c + 1u],
                              ps[sr * PS + 4u * c + 2u], ps[sr * PS + 4u * c + 3u]);
            mt = max(mt, max(max(s.x, s.y), max(s.z, s.w)));
        }
        // Every part of the row has read all its scores before any part overwrites its own with
        // weights: without this barrier the parts' reads race the other parts' writes (benign
        // only while a row's four threads run in lockstep, which nothing guarantees).
        workgroupBarrier();
        // Masked keys: exp(-3e38 - mt) is 0 once mt is finite. A row's masked keys come after
        // its others, so mt stays -3e38 only in a split where all of the row's keys are
        // masked; its (m = -3e38, l, o) then weigh exp(-3e38 - M) = 0 in `combine`.
        let corr = exp(m - mt);
        l *= corr;
        for (var j = sp * (BK / 4u); j < (sp + 1u) * (BK / 4u); j++) {
            let e = select(exp(ps[sr * PS + j] - mt), 1.0, (VARIANT & 4u) != 0u);
            l += e;
            ps[sr * PS + j] = e;
        }
        if (sp == 0u) {
            cr[sr] = corr;
        }
        m = mt;
        workgroupBarrier();
        // 3. Rows ov.., vec4s dg + DG i: rescale, then add the tile's weighted V rows.
        // @GEN out_rescale
        for (var j = 0u; j < select(BK, 0u, (VARIANT & 2u) != 0u); j++) {
            // @GEN out_body
        }
    }
    // Each row's sum is split over its 4 parts: gather them in `cr`-sized slices of `ps`.
    workgroupBarrier();
    ps[sr * 4u + sp] = l;
    workgroupBarrier();
    // Split partials: (m, l) of row sr from its part 0 (every part holds the same m).
    if (ns > 1u && sp == 0u && t0 + sr / G < mm) {
        let lt = (ps[sr * 4u] + ps[sr * 4u + 1u]) + (ps[sr * 4u + 2u] + ps[sr * 4u + 3u]);
        part_ml[sm + (t0 + sr / G) * HQ + h * G + sr % G] = vec2<f32>(m, lt);
    }
    // @GEN out_store
}

// Merge the S split partials of token wid.x's rows: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s -
// M) l_s with M the largest m_s. A split that saw none of a row's keys left m = -3e38: its
// weight is 0. Every row has key 0 in split 0, so M is finite and the sum positive.
@compute @workgroup_size(256)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    clamp_dims(dims.m);
    let t = wid.x;
    if (t >= mm) {
        return;
    }
    let ns = nsc;
    for (var i = li; i < HQ * D4; i += 256u) {
        let hq = i / D4;
        var mx = -3.0e38;
        for (var s = 0u; s < ns; s++) {
            mx = max(mx, part_ml[(s * mm + t) * HQ + hq].x);
        }
        var l = 0.0;
        var o = vec4<f32>(0.0);
        for (var s = 0u; s < ns; s++) {
            let ml = part_ml[(s * mm + t) * HQ + hq];
            let w = exp(ml.x - mx);
            l += w * ml.y;
            o += w * part_o[(s * mm + t) * HQ * D4 + i];
        }
        out[t * HQ * D4 + i] = o / l;
    }
}
