// Causal GQA attention of a prefill chunk with query tiles (attention_prefill.rs): workgroup
// (b, h) takes the BQ consecutive tokens b*BQ .. b*BQ + BQ of the chunk and the G query heads of kv
// head h, R = BQ * G query rows, and streams the K/V rows 0 ..= (its last token's position) through
// shared memory once for all of them, BK rows per tile (the decode kernel reads them once per
// token). The chunk's own K/V rows are already in the cache (`kv_write_cols` ran first).
// Prepended by the host: consts D, D4, HQ, HKV, G, CTX, EPS, SCALE, QKVW4 (vec4s per token of
// qkv), NS (threads per query row), BQ, BK, R (= BQ G), RS (floats per row of `part`), and
// columns.wgsl (`Col`).
//
// Thread li owns query row r = li / NS (token r / G of the tile, query head h G + r % G) and the
// vec4s sl, sl + NS, .. of its D (sl = li % NS): interleaved, so the NS threads of a row read NS
// consecutive vec4s of a K or V row (one wavefront, the other rows of the warp read the same:
// broadcasts). Per tile: each thread's partial dots over its vec4s for every key; the NS partials
// of a row meet in `part`; every thread of the row then sums them in the same order and runs the
// same online-softmax update (so the NS copies of (m, l) agree without another barrier), and adds
// p V over its own vec4s to its output accumulators.
//
// q is normed, roped and scaled by 1/sqrt(D) as attention_rope.wgsl does (same cos_sin range
// reduction); scores past a row's own position are masked.
struct Dims { m: u32, p1: u32, p2: u32, p3: u32 };

@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;        // [T, QKVW4]
@group(0) @binding(1) var<storage, read> q_norm: array<f32>;           // [D]
@group(0) @binding(2) var<storage, read> inv_freq: array<f32>;         // [D/2]
@group(0) @binding(3) var<storage, read> k_cache: array<vec4<f32>>;    // [slots, CTX, HKV, D4]
@group(0) @binding(4) var<storage, read> v_cache: array<vec4<f32>>;    // [slots, CTX, HKV, D4]
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;  // [T, HQ * D4]
@group(0) @binding(6) var<storage, read> cols: array<Col>;             // [T] positions, slot
@group(0) @binding(7) var<uniform> dims: Dims;

const HALF: u32 = D / 2u;
const DS4: u32 = D4 / NS;
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;
const INV_TWO_PI: f32 = 0.15915494309189535;

var<workgroup> ks: array<vec4<f32>, BK * D4>;
var<workgroup> vs: array<vec4<f32>, BK * D4>;
// [R][BK][NS] partial dots (row stride RS floats: no bank conflicts between the rows of a warp);
// the q norm's [R][NS] partial sums first.
var<workgroup> part: array<f32, R * RS>;

fn cos_sin(a: f32) -> vec2<f32> {
    let k = round(a * INV_TWO_PI);
    let r = fma(-k, TWO_PI_LO, fma(-k, TWO_PI_HI, a));
    return vec2<f32>(cos(r), sin(r));
}

fn q_at(i: u32) -> f32 {
    return qkv[i / 4u][i % 4u];
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t0 = wid.x * BQ;
    let h = wid.y;
    // Uniform: the whole workgroup leaves or stays.
    if (t0 >= dims.m) {
        return;
    }
    let r = li / NS;
    let sl = li % NS;
    let tq = t0 + r / G;
    let live = tq < dims.m;
    let tc = min(tq, dims.m - 1u);
    let qpos = cols[tc].pos;
    // The tile's last position and its slot's first cache row (uniform).
    let pmax = cols[min(t0 + BQ, dims.m) - 1u].pos;
    let row0 = cols[t0].slot * CTX;
    let hq = h * G + r % G;
    let qb = tc * QKVW4 * 4u + hq * D;

    // q norm: the NS partial sums of squares of the row, summed in slot order.
    var ss = 0.0;
    for (var k4 = 0u; k4 < DS4; k4++) {
        let v = qkv[qb / 4u + k4 * NS + sl];
        ss += dot(v, v);
    }
    part[r * RS + sl] = ss;
    workgroupBarrier();
    var tot = 0.0;
    for (var s = 0u; s < NS; s++) {
        tot += part[r * RS + s];
    }
    let inv = inverseSqrt(tot / f32(D) + EPS);
    var qv: array<vec4<f32>, DS4>;
    var o: array<vec4<f32>, DS4>;
    let p = f32(qpos);
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
        qv[k4] = v * SCALE;
        o[k4] = vec4<f32>(0.0);
    }
    var m = -3.0e38;
    var l = 0.0;
    for (var kb = 0u; kb <= pmax; kb += BK) {
        // `part` (the norm's sums, or the last tile's dots) and the tiles are free again.
        workgroupBarrier();
        for (var i = li; i < BK * D4; i += 256u) {
            let j = i / D4;
            let kp = min(kb + j, pmax);
            let src = ((row0 + kp) * HKV + h) * D4 + i % D4;
            ks[i] = k_cache[src];
            vs[i] = v_cache[src];
        }
        workgroupBarrier();
        var dots: array<f32, BK>;
        for (var j = 0u; j < BK; j++) {
            var acc = 0.0;
            for (var k4 = 0u; k4 < DS4; k4++) {
                acc += dot(qv[k4], ks[j * D4 + k4 * NS + sl]);
            }
            dots[j] = acc;
        }
        for (var j = 0u; j < BK; j++) {
            part[r * RS + j * NS + sl] = dots[j];
        }
        workgroupBarrier();
        // Every thread of the row: the full scores, masked past the row's position.
        var mt = m;
        for (var j = 0u; j < BK; j++) {
            var sc = 0.0;
            for (var s = 0u; s < NS; s++) {
                sc += part[r * RS + j * NS + s];
            }
            if (kb + j > qpos) {
                sc = -3.0e38;
            }
            dots[j] = sc;
            mt = max(mt, sc);
        }
        let corr = exp(m - mt);
        l *= corr;
        for (var k4 = 0u; k4 < DS4; k4++) {
            o[k4] *= corr;
        }
        for (var j = 0u; j < BK; j++) {
            // Masked keys: exp(-3e38 - mt) is 0 (mt is finite from key 0 of the first tile on).
            let e = exp(dots[j] - mt);
            l += e;
            for (var k4 = 0u; k4 < DS4; k4++) {
                o[k4] = fma(vec4<f32>(e), vs[j * D4 + k4 * NS + sl], o[k4]);
            }
        }
        m = mt;
    }
    if (live) {
        let ob = tq * HQ * D4 + hq * D4;
        for (var k4 = 0u; k4 < DS4; k4++) {
            out[ob + k4 * NS + sl] = o[k4] / l;
        }
    }
}
