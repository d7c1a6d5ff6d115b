// Per-head q/k RMSNorm + NeoX (rotate-half) RoPE (formats-spec §1.4-1.6), computed inside each
// attention chunk workgroup (attention.wgsl) instead of in a dispatch of its own.
// Appended by the host to attention.wgsl, whose bindings it uses: qkv, q_norm, k_norm, inv_freq.
// Needs consts D, D4, HQ, G, WG, LR (lanes per head in the norm reduction: the largest power of
// two <= max(WG / (G + 1), 1)), EPS and the workgroup array `red` (WG f32).
//
// A workgroup of kv head h handles NH = G + 1 head vectors: e < G is query head h*G + e, e = G
// is kv head h's k. The math matches the former stand-alone rope kernel and `rope_ref`:
// rms = inverseSqrt(Σx²/D + EPS), a = x_i * rms * w_i, b = x_{i+D/2} * rms * w_{i+D/2},
// (a, b) -> (a cos - b sin, b cos + a sin) with the angle f32(pos) * inv_freq[i].

const HALF: u32 = D / 2u;
const NH: u32 = G + 1u;
// 2*pi split so that k * TWO_PI_HI is exact for k < 2^16 (Cody-Waite range reduction).
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;
const INV_TWO_PI: f32 = 0.15915494309189535;

// (cos, sin) of the angle of frequency i at this step's position: [D/2].
var<workgroup> cst: array<vec2<f32>, HALF>;
// 1/rms of the NH head vectors.
var<workgroup> rms: array<f32, NH>;

// cos/sin of a possibly large angle: GPU sin/cos are only accurate near [-pi, pi], and positions
// reach 1e5 radians, so reduce the angle first.
fn cos_sin(a: f32) -> vec2<f32> {
    let k = round(a * INV_TWO_PI);
    let r = fma(-k, TWO_PI_LO, fma(-k, TWO_PI_HI, a));
    return vec2<f32>(cos(r), sin(r));
}

fn qkv_at(i: u32) -> f32 {
    return qkv[i / 4u][i % 4u];
}

// Element offset in qkv of head vector e of kv head h, for the token whose q|k|v starts at
// element qb.
fn head_base(qb: u32, h: u32, e: u32) -> u32 {
    if (e < G) {
        return qb + (h * G + e) * D;
    }
    return qb + (HQ + h) * D;
}

fn norm_w(e: u32, i: u32) -> f32 {
    if (e < G) {
        return q_norm[i];
    }
    return k_norm[i];
}

// Fill `cst` and `rms` (head vectors e0..NH: 0 for all, G for k alone) for kv head h of the token
// whose q|k|v starts at element qb, at position pos. Called in uniform control flow; ends with a
// barrier so both arrays are visible to the whole workgroup. LR lanes per head, WG / LR heads per
// pass of tree reductions over `red`.
fn rope_prepare(qb: u32, h: u32, pos: u32, li: u32, first: u32) {
    let p = f32(pos);
    for (var i = li; i < HALF; i += WG) {
        cst[i] = cos_sin(p * inv_freq[i]);
    }
    let lane = li % LR;
    for (var e0 = first; e0 < NH; e0 += WG / LR) {
        let e = e0 + li / LR;
        var ss = 0.0;
        if (e < NH) {
            let base = head_base(qb, h, e);
            for (var i = lane; i < HALF; i += LR) {
                let a = qkv_at(base + i);
                let b = qkv_at(base + i + HALF);
                ss += a * a + b * b;
            }
        }
        // The previous pass (or the caller) may still read `red`.
        workgroupBarrier();
        red[li] = ss;
        workgroupBarrier();
        for (var st = LR / 2u; st > 0u; st >>= 1u) {
            if (lane < st) {
                red[li] += red[li + st];
            }
            workgroupBarrier();
        }
        if (e < NH && lane == 0u) {
            rms[e] = inverseSqrt(red[li] / f32(D) + EPS);
        }
    }
    workgroupBarrier();
}

// Element k of head vector e (base: head_base) normed and roped, its pair partner recomputed.
fn roped1(base: u32, r: f32, e: u32, k: u32) -> f32 {
    let i = k % HALF;
    let a = qkv_at(base + i) * r * norm_w(e, i);
    let b = qkv_at(base + i + HALF) * r * norm_w(e, i + HALF);
    let cs = cst[i];
    if (k < HALF) {
        return a * cs.x - b * cs.y;
    }
    return b * cs.x + a * cs.y;
}

// Elements 4*d4 .. 4*d4+3 of head vector e (kv head h) normed and roped. Each element recomputes
// its pair partner, so one thread owns a whole vec4 (no two threads write parts of one vector).
// The four elements are written out rather than stored through `v[j]` in a loop: a vector
// indexed by a loop counter may be placed in local memory by NVIDIA's compiler (session 17's
// per-thread arrays), and the values are the same.
fn roped4(qb: u32, h: u32, e: u32, d4: u32) -> vec4<f32> {
    let base = head_base(qb, h, e);
    let r = rms[e];
    let k = 4u * d4;
    return vec4<f32>(roped1(base, r, e, k), roped1(base, r, e, k + 1u),
                     roped1(base, r, e, k + 2u), roped1(base, r, e, k + 3u));
}
