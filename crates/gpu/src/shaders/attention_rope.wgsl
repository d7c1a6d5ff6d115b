// Fused per-head q/k RMSNorm + NeoX (rotate-half) RoPE + KV-cache write (formats-spec §1.4-1.6).
// Prepended by the host: consts D, HQ, HKV, CTX, WG, EPS and the `State` struct.
// Grid: HQ + HKV workgroups; workgroup j < HQ handles query head j, the others kv head j - HQ.
//
// qkv      [HQ*D | HKV*D | HKV*D] f32: the fused q|k|v projection output. Query heads are roped
//          in place (the attention kernel reads them there); k and v are left as they are.
// inv_freq [D/2] f32: theta^(-2i/D), computed once on the host in f64 and rounded.
// k_cache, v_cache [CTX, HKV, D] f32: row `pos` receives the roped k and the raw v.

@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> q_norm: array<f32>;
@group(0) @binding(3) var<storage, read> k_norm: array<f32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;

const HALF: u32 = D / 2u;
// 2*pi split so that k * TWO_PI_HI is exact for k < 2^16 (Cody-Waite range reduction).
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;
const INV_TWO_PI: f32 = 0.15915494309189535;

var<workgroup> red: array<f32, WG>;

// cos/sin of a possibly large angle: GPU sin/cos are only accurate near [-pi, pi], and positions
// reach 1e5 radians, so reduce the angle first.
fn cos_sin(a: f32) -> vec2<f32> {
    let k = round(a * INV_TWO_PI);
    let r = fma(-k, TWO_PI_LO, fma(-k, TWO_PI_HI, a));
    return vec2<f32>(cos(r), sin(r));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (state.done != 0u) {
        return;
    }
    let pos = state.pos;
    let head = wid.x;
    let is_q = head < HQ;
    // Element offset of this head in qkv.
    let base = head * D;

    // Sum of squares of the head vector (each thread owns pairs (i, i + D/2)).
    var ss = 0.0;
    for (var i = li; i < HALF; i += WG) {
        let a = qkv[base + i];
        let b = qkv[base + i + HALF];
        ss += a * a + b * b;
    }
    red[li] = ss;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (li < st) {
            red[li] += red[li + st];
        }
        workgroupBarrier();
    }
    let rms = inverseSqrt(red[0] / f32(D) + EPS);
    let p = f32(pos);
    // Cache row of this kv head at `pos` (only used by kv workgroups; pos < CTX checked below).
    let kvh = head - HQ;
    let row = (pos * HKV + kvh) * D;
    let in_ctx = pos < CTX;
    for (var i = li; i < HALF; i += WG) {
        var w0: f32;
        var w1: f32;
        if (is_q) {
            w0 = q_norm[i];
            w1 = q_norm[i + HALF];
        } else {
            w0 = k_norm[i];
            w1 = k_norm[i + HALF];
        }
        let a = qkv[base + i] * rms * w0;
        let b = qkv[base + i + HALF] * rms * w1;
        let cs = cos_sin(p * inv_freq[i]);
        let ra = a * cs.x - b * cs.y;
        let rb = b * cs.x + a * cs.y;
        if (is_q) {
            qkv[base + i] = ra;
            qkv[base + i + HALF] = rb;
        } else if (in_ctx) {
            k_cache[row + i] = ra;
            k_cache[row + i + HALF] = rb;
        }
    }
    if (!is_q && in_ctx) {
        // v heads follow the k heads in qkv.
        let vbase = (HQ + HKV + kvh) * D;
        for (var i = li; i < D; i += WG) {
            v_cache[row + i] = qkv[vbase + i];
        }
    }
}
