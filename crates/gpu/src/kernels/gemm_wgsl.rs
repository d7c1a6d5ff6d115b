//! The WGSL of the int4 GEMMs (gemm.rs): the prelude both kernels share (tile functions, weight
//! bindings and fetch) and the f32 kernel's staging, accumulators and epilogue around
//! shaders/gemm_q4.wgsl.
//!
//! Weight forms (`affine`, tensor.rs): Q4_0 blocks dequantise as `d · (q - 8)`, the affine (MLX)
//! form's as `fma(s, q, b)` with the group's bf16 scale and bias. Both are the oracle's weights
//! exactly (`d (q - 8)` has at most 15 significant bits, `s q` at most 12, so one rounding of
//! `s q + b` is the oracle's own), so the f32 kernel's sums stay the oracle's dot up to f32
//! rounding in either form. The matrix-unit kernel (gemm_coop.rs) has its own staging.

use super::gemm::{GemmForm, PlanLayout, WG};
use crate::tensor::QForm;
/// WGSL of the f32 kernel's `gm_wstore` for int4 weights: thread (nn, h)'s share of one block
/// (`WReg`: words 2h, 2h + 1 of row nn's block and its scale), dequantised into `ws`: elements
/// 8h .. 8h + 8 (low nibbles) and 16 + 8h .. 16 + 8h + 8 (high nibbles).
const WSTORE_F32: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32) {
    for (var j = 0u; j < 2u; j++) {
        let w = r.q[j];
        let k = 8u * h + 4u * j;
        for (var c = 0u; c < 4u; c++) {
            let lo = f32((w >> (8u * c)) & 0xFu) - 8.0;
            let hi = f32((w >> (8u * c + 4u)) & 0xFu) - 8.0;
            ws[(k + c) * 32u + nn / 4u][nn % 4u] = r.d * lo;
            ws[(k + c + 16u) * 32u + nn / 4u][nn % 4u] = r.d * hi;
        }
    }
}
";

/// [`WSTORE_F32`] for the affine form: `fma(s, q, b)` (`WReg.d` = s, `WReg.b` = b).
const WSTORE_F32_AFFINE: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32) {
    for (var j = 0u; j < 2u; j++) {
        let w = r.q[j];
        let k = 8u * h + 4u * j;
        for (var c = 0u; c < 4u; c++) {
            let lo = f32((w >> (8u * c)) & 0xFu);
            let hi = f32((w >> (8u * c + 4u)) & 0xFu);
            ws[(k + c) * 32u + nn / 4u][nn % 4u] = fma(r.d, lo, r.b);
            ws[(k + c + 16u) * 32u + nn / 4u][nn % 4u] = fma(r.d, hi, r.b);
        }
    }
}
";

/// [`WSTORE_F32`] for the byte form (Q8_0): `WReg.q` holds words 4h .. 4h + 4 of the block,
/// elements 16h .. 16h + 16 as `q + 128`; each weight is `d q`, one rounding, the oracle's.
const WSTORE_F32_Q8: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32) {
    for (var j = 0u; j < 4u; j++) {
        let w = r.q[j];
        let k = 16u * h + 4u * j;
        for (var c = 0u; c < 4u; c++) {
            let q = f32((w >> (8u * c)) & 0xFFu) - 128.0;
            ws[(k + c) * 32u + nn / 4u][nn % 4u] = r.d * q;
        }
    }
}
";

/// [`WSTORE_F32_Q8`] for MLX's 8-bit affine groups: `fma(s, q, b)` with `q` the stored level
/// (`WReg.d` = s, `WReg.b` = b; `s q` is exact, 8 + 8 significant bits, so this is the
/// oracle's `s q + b`).
const WSTORE_F32_A8: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32) {
    for (var j = 0u; j < 4u; j++) {
        let w = r.q[j];
        let k = 16u * h + 4u * j;
        for (var c = 0u; c < 4u; c++) {
            let q = f32((w >> (8u * c)) & 0xFFu);
            ws[(k + c) * 32u + nn / 4u][nn % 4u] = fma(r.d, q, r.b);
        }
    }
}
";

/// [`WSTORE_F32_Q8`] for Q6_K's 6-bit form: `WReg.q` is half `h` of the block (one 16-weight
/// sub-block), its i8 sub-scale `sc` in the top bits of word 0's bytes (`q8_half` puts it there); each
/// weight is `d (sc (q - 32))`, the integer exact and the product exact (11 + 7 + 5 significant
/// bits), as the oracle's.
const WSTORE_F32_Q6: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32) {
    let t = (r.q.x >> 6u) & 0x03030303u;
    let u = (t & 3u) | ((t >> 6u) & 0xCu) | ((t >> 12u) & 0x30u) | ((t >> 18u) & 0xC0u);
    let sc = f32(bitcast<i32>(u << 24u) >> 24u);
    for (var j = 0u; j < 4u; j++) {
        let w = r.q[j];
        let k = 16u * h + 4u * j;
        for (var c = 0u; c < 4u; c++) {
            let q = f32((w >> (8u * c)) & 0x3Fu) - 32.0;
            ws[(k + c) * 32u + nn / 4u][nn % 4u] = r.d * (sc * q);
        }
    }
}
";

/// The WGSL of `form` with `tm` tokens per thread (2 or 4), for weights of the block form
/// `qform` (tensor.rs): Q4_0, the affine one or Q8_0.
pub fn shader(form: GemmForm, tm: u32, plan: Option<PlanLayout>, qform: QForm) -> String {
    let wstore = match qform {
        QForm::Q4_0 => WSTORE_F32,
        QForm::Affine4 | QForm::Q4K => WSTORE_F32_AFFINE,
        QForm::Q8_0 => WSTORE_F32_Q8,
        // Q5_K's 5-bit levels are stored as MLX_A8's bytes are: `s q + b` alike.
        QForm::Affine8 | QForm::Q5K => WSTORE_F32_A8,
        QForm::Q6K => WSTORE_F32_Q6,
    };
    let s = prelude(form, tm, plan, wstore, qform);
    shader_body(form, tm, s)
}

/// The WGSL both kernels share (this file's and gemm_coop.rs's): the tile constants (`TM`, `BM`,
/// `XPT`, `XV`), the form's tile functions (`gm_tile`, `gm_xrow`, `gm_yrow`) and its weight
/// bindings and fetch (`WReg`, `gm_wfetch`), with `wstore` (the kernel's `gm_wstore` for int4
/// weights) in between; `qform`: the block form of the weights (tensor.rs).
pub(crate) fn prelude(
    form: GemmForm,
    tm: u32,
    plan: Option<PlanLayout>,
    wstore: &str,
    qform: QForm,
) -> String {
    let affine = qform.affine();
    let bm = 16 * tm;
    let xv = if tm == 4 { "vec4<f32>" } else { "vec2<f32>" };
    // vec4s of X each thread stages per block: 8 per row, BM rows, 256 threads.
    let xpt = 8 * bm / WG;
    let mut s = String::from(include_str!("../shaders/gemm_common.wgsl"));
    s += &format!(
        "const TM: u32 = {tm}u;\nconst BM: u32 = {bm}u;\nconst XPT: u32 = {xpt}u;\nalias XV = {xv};\n"
    );
    let cols = form.cols_per_tile();
    // The weight row of tile column nn at block b (clamped into the matrix part).
    let row_of = format!(
        "    let n = min(wid.x * {cols}u + (nn % {cols}u), p.n - 1u);
    let blk = (t.wrow + n) * p.bpr + b;
"
    );
    match (form, plan) {
        (GemmForm::Dense | GemmForm::DenseAcc | GemmForm::DenseF32, _) => {
            s += "fn gm_tile(wid: vec3<u32>) -> Tile {
    let m0 = wid.y * BM;
    // Tokens past the rows X or Y hold are not computed (the host keeps dims.m below both).
    let mm = min(dims.m, min(p.xrows, p.yrows));
    // list0: the first Y row of this K split's partial sums (0 without a split).
    return Tile(m0 < mm, m0, min(m0 + BM, mm), 0u, min(wid.z, p.splits - 1u) * p.yrows);
}
fn gm_xrow(t: Tile, m: u32) -> u32 { return min(m, p.xrows - 1u); }
fn gm_yrow(t: Tile, m: u32) -> u32 { return t.list0 + m; }
";
        }
        (GemmForm::GateUp | GemmForm::Down, Some(pl)) => {
            s += &format!(
                "const P_OFF: u32 = {}u;\nconst P_TILES: u32 = {}u;\nconst P_LIST: u32 = {}u;\nconst K: u32 = {}u;
@group(0) @binding(8) var<storage, read> plan: array<u32>; // moe_prefill.rs layout
fn gm_tile(wid: vec3<u32>) -> Tile {{
    var t = Tile(false, 0u, 0u, 0u, 0u);
    if (wid.y >= plan[0]) {{ return t; }}
    let packed = plan[P_TILES + wid.y];
    let e = packed >> 16u;
    if (e < p.e_lo || e >= p.e_hi) {{ return t; }}
    t.m0 = packed & 0xFFFFu;
    // The expert's list [list0, hi), clamped into Y's rows (the plan's own offsets are).
    t.list0 = min(plan[P_OFF + e], p.yrows);
    let hi = clamp(plan[P_OFF + e + 1u], t.list0, p.yrows);
    t.mend = hi - t.list0;
    t.wrow = (e - p.e_lo) * p.n;
    t.ok = t.m0 < t.mend;
    return t;
}}
fn gm_yrow(t: Tile, m: u32) -> u32 {{ return t.list0 + m; }}
// The list position of tile row m, below Y's rows even for a tile without rows (whose staging
// still loads, and discards, one X row per thread).
fn gm_lrow(t: Tile, m: u32) -> u32 {{ return min(t.list0 + m, p.yrows - 1u); }}
",
                pl.off, pl.tiles, pl.list, pl.k
            );
            s += if form == GemmForm::GateUp {
                "fn gm_xrow(t: Tile, m: u32) -> u32 { return min(plan[P_LIST + gm_lrow(t, m)] / K, p.xrows - 1u); }\n"
            } else {
                "fn gm_xrow(t: Tile, m: u32) -> u32 { return min(gm_lrow(t, m), p.xrows - 1u); }\n"
            };
        }
        _ => unreachable!("expert forms are built with a plan layout"),
    }
    if form == GemmForm::DenseF32 {
        // Thread (nn, h) stages inputs 16 h .. 16 h + 16 of row nn: four vec4s.
        s += "@group(0) @binding(0) var<storage, read> wf: array<vec4<f32>>; // [rows, bpr * 8]
struct WReg { a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32> };
fn gm_wfetch(wid: vec3<u32>, t: Tile, nn: u32, h: u32, b: u32) -> WReg {
";
        s += &row_of;
        s += "    let i = blk * 8u + 4u * h;
    return WReg(wf[i], wf[i + 1u], wf[i + 2u], wf[i + 3u]);
}
fn gm_wstore(r: WReg, nn: u32, h: u32) {
    let k = 16u * h;
    let c = nn / 4u;
    let j = nn % 4u;
    for (var i = 0u; i < 4u; i++) {
        ws[(k + i) * 32u + c][j] = r.a[i];
        ws[(k + 4u + i) * 32u + c][j] = r.b[i];
        ws[(k + 8u + i) * 32u + c][j] = r.c[i];
        ws[(k + 12u + i) * 32u + c][j] = r.d[i];
    }
}
";
    } else if qform.wide() {
        // Thread (nn, h) stages half h of the byte block of row nn: its vec4 h, elements
        // 16h .. 16h + 16, dequantised on the store (tensor.rs byte form).
        // The scale of block i: Q8_0's f16 (two per word), the MLX group's bf16 scale and
        // bias (one word per group of two blocks, tensor.rs) as (d, b), or Q5_K's (d sc,
        // -dmin m) from its pair's two words (`GSW`, as Q4_K's).
        s += if qform.k_words() {
            "alias GSW = vec2<u32>;
fn coef_of(v: GSW, i: u32) -> vec2<f32> {
    let dm = unpack2x16float(v.x);
    let sm = v.y >> (12u * (i & 1u));
    return vec2<f32>(dm.x * f32(sm & 63u), -(dm.y * f32((sm >> 6u) & 63u)));
}
"
        } else {
            "alias GSW = u32;
fn coef_of(v: GSW, i: u32) -> vec2<f32> {
    if (Q8_AFFINE) {
        return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xFFFF0000u));
    }
    let d = unpack2x16float(v);
    return vec2<f32>(select(d.x, d.y, (i & 1u) == 1u), 0.0);
}
"
        };
        // `q8_half(q, h)`: half h of the block as 4 words of bytes (byte j = element 16 h + j's
        // level); Q5_K's blocks are nibbles and a word of fifth bits (qform.rs `Q5_PAYLOAD`).
        s += if qform == QForm::Q6K {
            // Q6_K's blocks are nibbles, two words of top bits and a word of two sub-scales
            // (qform.rs `Q6_PAYLOAD`); the half's sub-scale goes back into the top bits of its
            // first four bytes, where `WSTORE_F32_Q6` reads it.
            "struct QB8 { w0: u32, w1: u32, w2: u32, w3: u32, h0: u32, h1: u32, s: u32 };
fn q8_half(q: QB8, h: u32) -> vec4<u32> {
    let n = (vec4<u32>(q.w0, q.w1, q.w2, q.w3) >> vec4<u32>(4u * h)) & vec4<u32>(0x0F0F0F0Fu);
    let t = select(q.h0, q.h1, h == 1u);
    // The top bits as qform.rs `q6_top` places them; the sub-scale's eight bits two per byte.
    let b = n | (vec4<u32>(t << 4u, t << 2u, t, t >> 2u) & vec4<u32>(0x30303030u));
    let v = (q.s >> (8u * h)) & 0xFFu;
    let x = v | ((v & 0xF0u) << 12u);
    let sc = ((x | (x << 6u)) & 0x03030303u) << 6u;
    return vec4<u32>(b.x | sc, b.yzw);
}
"
        } else if qform == QForm::Q5K {
            "struct QB8 { w0: u32, w1: u32, w2: u32, w3: u32, h: u32 };
fn q8_half(q: QB8, h: u32) -> vec4<u32> {
    let n = (vec4<u32>(q.w0, q.w1, q.w2, q.w3) >> vec4<u32>(4u * h)) & vec4<u32>(0x0F0F0F0Fu);
    // The fifth bits as qform.rs `q5_top` places them.
    let t = q.h >> (4u * h);
    return n | (vec4<u32>(t << 4u, t << 3u, t << 2u, t << 1u) & vec4<u32>(0x10101010u));
}
"
        } else {
            "struct QB8 { lo: vec4<u32>, hi: vec4<u32> };
fn q8_half(q: QB8, h: u32) -> vec4<u32> { return select(q.lo, q.hi, h == 1u); }
"
        };
        s += "@group(0) @binding(0) var<storage, read> qs: array<QB8>; // [rows * bpr] byte blocks
@group(0) @binding(1) var<storage, read> sc: array<GSW>; // [rows * bpr / 2] scale words
struct WReg { q: vec4<u32>, d: f32, b: f32 };
";
        s += &format!("const Q8_AFFINE: bool = {affine};\n");
        s += wstore;
        s += "fn gm_wfetch(wid: vec3<u32>, t: Tile, nn: u32, h: u32, b: u32) -> WReg {
";
        s += &row_of;
        if form == GemmForm::GateUp {
            s += "    var q: QB8;
    var v: GSW;
    if (nn < 64u) {
        q = qs[blk];
        v = sc[blk >> 1u];
    } else {
        q = qs2[blk];
        v = sc2[blk >> 1u];
    }
    let c = coef_of(v, blk);
    return WReg(q8_half(q, h), c.x, c.y);
}
@group(0) @binding(6) var<storage, read> qs2: array<QB8>; // up bytes
@group(0) @binding(7) var<storage, read> sc2: array<GSW>; // up scale words
";
        } else {
            s += "    let q = qs[blk];
    let c = coef_of(sc[blk >> 1u], blk);
    return WReg(q8_half(q, h), c.x, c.y);
}
";
        }
    } else {
        // Thread (nn, h) stages words 2h, 2h + 1 of the Q4 block of row nn: elements 8h .. 8h+8
        // (low nibbles) and 16 + 8h .. 16 + 8h + 8 (high nibbles), dequantised on the store.
        // The scale words (`GSW`): a u32 per pair of blocks, or Q4_K's two (tensor.rs).
        s += if qform == QForm::Q4K {
            "alias GSW = vec2<u32>;\n"
        } else {
            "alias GSW = u32;\n"
        };
        s += "@group(0) @binding(0) var<storage, read> qs: array<vec4<u32>>; // [rows * bpr] nibble blocks
@group(0) @binding(1) var<storage, read> sc: array<GSW>;       // [rows * bpr / 2] scale words
";
        if qform == QForm::Q4K {
            // Q4_K's (d sc, -dmin m) of block i (tensor.rs `Q4_SB_K`).
            s += "struct WReg { q: vec2<u32>, d: f32, b: f32 };
fn sb_of(v: GSW, i: u32) -> vec2<f32> {
    let dm = unpack2x16float(v.x);
    let sm = v.y >> (12u * (i & 1u));
    return vec2<f32>(dm.x * f32(sm & 63u), -(dm.y * f32((sm >> 6u) & 63u)));
}
";
        } else if affine {
            // A group's word: bf16 scale low, bf16 bias high (tensor.rs), the same for its two
            // blocks 2g and 2g + 1.
            s += "struct WReg { q: vec2<u32>, d: f32, b: f32 };
fn sb_of(v: GSW, i: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xFFFF0000u));
}
";
        } else {
            s += "fn f16_at(i: u32) -> f32 {
    let v = unpack2x16float(sc[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
struct WReg { q: vec2<u32>, d: f32 };
";
        }
        s += wstore;
        s += "fn gm_wfetch(wid: vec3<u32>, t: Tile, nn: u32, h: u32, b: u32) -> WReg {
";
        s += &row_of;
        s += match (form == GemmForm::GateUp, affine) {
            (true, false) => {
                "    var q: vec4<u32>;
    var d: f32;
    if (nn < 64u) {
        q = qs[blk];
        d = f16_at(blk);
    } else {
        q = qs2[blk];
        let v = unpack2x16float(sc2[blk >> 1u]);
        d = select(v.x, v.y, (blk & 1u) == 1u);
    }
    return WReg(select(q.xy, q.zw, h == 1u), d);
}
"
            }
            (true, true) => {
                "    var q: vec4<u32>;
    var v: GSW;
    if (nn < 64u) {
        q = qs[blk];
        v = sc[blk >> 1u];
    } else {
        q = qs2[blk];
        v = sc2[blk >> 1u];
    }
    let sb = sb_of(v, blk);
    return WReg(select(q.xy, q.zw, h == 1u), sb.x, sb.y);
}
"
            }
            (false, false) => {
                "    let q = qs[blk];
    return WReg(select(q.xy, q.zw, h == 1u), f16_at(blk));
}
"
            }
            (false, true) => {
                "    let q = qs[blk];
    let sb = sb_of(sc[blk >> 1u], blk);
    return WReg(select(q.xy, q.zw, h == 1u), sb.x, sb.y);
}
"
            }
        };
        if form == GemmForm::GateUp {
            s += "@group(0) @binding(6) var<storage, read> qs2: array<vec4<u32>>; // up nibbles
@group(0) @binding(7) var<storage, read> sc2: array<GSW>;       // up scale words
";
        }
    }
    s
}

/// The f32 kernel: per-token accumulator lines, epilogue and body after `s` (the prelude).
fn shader_body(form: GemmForm, tm: u32, s: String) -> String {
    let cols = form.cols_per_tile();
    let comp = ["x", "y", "z", "w"];
    let mut decl = String::new();
    let mut fma = String::new();
    let mut store = String::new();
    for i in 0..tm as usize {
        decl += &format!("    var a{i}l = vec4<f32>(0.0);\n    var a{i}h = vec4<f32>(0.0);\n");
        let c = comp[i];
        fma += &format!(
            "            a{i}l = fma(vec4<f32>(xv.{c}), w0, a{i}l);\n            a{i}h = fma(vec4<f32>(xv.{c}), w1, a{i}h);\n"
        );
        store += &format!(
            "    {{
        let m = t.m0 + ty * TM + {i}u;
        if (m < t.mend) {{
            let yb = gm_yrow(t, m) * p.ys + p.ycol;
            let n0 = wid.x * {cols}u + tx * 4u;
"
        );
        for (j, cj) in comp.iter().enumerate() {
            store += &match form {
                GemmForm::GateUp => format!(
                    "            if (n0 + {j}u < p.n) {{ y[yb + n0 + {j}u] = silu(a{i}l.{cj}) * a{i}h.{cj}; }}\n"
                ),
                GemmForm::DenseAcc => format!(
                    "            if (n0 + {j}u < p.n) {{ y[yb + n0 + {j}u] += a{i}l.{cj}; }}
            if (n0 + {}u < p.n) {{ y[yb + n0 + {}u] += a{i}h.{cj}; }}\n",
                    64 + j,
                    64 + j
                ),
                _ => format!(
                    "            if (n0 + {j}u < p.n) {{ y[yb + n0 + {j}u] = a{i}l.{cj}; }}
            if (n0 + {}u < p.n) {{ y[yb + n0 + {}u] = a{i}h.{cj}; }}\n",
                    64 + j,
                    64 + j
                ),
            };
        }
        store += "        }\n    }\n";
    }
    let body = include_str!("../shaders/gemm_q4.wgsl")
        .replace("    //GEMM_DECL\n", &decl)
        .replace("            //GEMM_FMA\n", &fma)
        .replace("    //GEMM_STORE\n", &store);
    s + &body
}
