//! The prefill GEMM on matrix units (tensor cores): the same forms, tiles, bindings and grid as
//! [`super::gemm`], with the multiply-adds done by 16x16x16 cooperative-matrix products
//! (wgpu's experimental `wgpu_cooperative_matrix`, Vulkan `VK_KHR_cooperative_matrix`) in place
//! of one f32 fma per thread and term. Used where the device offers f16 x f16 -> f32 products of
//! that size with 32-wide subgroups (NVIDIA); elsewhere (lavapipe, Metal) the f32 kernel runs.
//!
//! Numerics: f32-class, not f16-class. Each staged value is split into two f16s, `v = hi + lo`
//! (an activation: `hi` = `v` cut to 11 significant bits by masking, `lo = f16(v - hi)`; a
//! Q4_0 weight: `WSTORE_COOP`'s exact split of its scale; an affine (MLX) one: split as an
//! activation is, `WSTORE_COOP_AFFINE`), and a product is
//! `xh·wh + xl·wh + xh·wl`, accumulated in f32 by the matrix unit: what is dropped is `xl·wl`
//! (`xl` below 2^-10 of x, `wl` below 2^-7 of w: below 2^-17 of the term, always shrinking it)
//! and the rounding of `xl` (2^-21). A weight's split is exact whenever its parts are normal
//! f16s. X is scaled by 2^4 and W by 2^8 (exact; undone by 2^-12 in the epilogue) so that `xl`
//! is normal for |x| >= 2^-7, and a nonzero `wl` for block scales d >= 2^-12 (it is at least
//! one unit in the last place of `d · 2^8`, 2^-14 there); below that, if the matrix units or
//! the f16 multiplies flush subnormals (not measured), a term loses at most 2^-18 of x, or of w
//! a part below 2^-22 in absolute terms. Inputs must stay below 2^11 in magnitude and block
//! scales below 2^5 (f16's range after the scaling): the GEMMs' inputs are RMS-normalised rows,
//! attention outputs and `silu(gate) * up`. A value past it becomes inf/NaN that reaches the
//! logits; the backend then rebuilds the prefill on f32 fmas and runs the prompt again
//! (backend_prefill.rs `run_gemm_prefill`).
//! Tested against the same f64 reference and bound as the f32 kernel (gemm_tests.rs,
//! moe_prefill_tests.rs and prefill_tests.rs run it wherever the device has it).
//!
//! Tile work: 256 threads = 8 subgroups of 32. The tile's `BM` tokens are `MT = BM / 16` token
//! tiles and its 128 weight rows 8 column tiles of 16; subgroup `sg` owns token tile `sg % MT`
//! and `MT` column tiles chosen so that in `GateUp` each gate tile `c` (columns < 64) comes with
//! its up tile `c + 4`. Per block of 32 inputs the whole workgroup stages X^T `[32][BM]` and W^T
//! `[32][128]` as f16 pairs in shared memory (rows padded by 8 halves against bank conflicts;
//! each thread's stores are consecutive across the warp), then each subgroup runs its products.
//! The epilogue stores each accumulator pair through a per-subgroup 2 x 16 x 16 f32 scratch and
//! writes it out with the form's rule (`=`, `+=`, `silu(gate) * up`). With two staging buffers
//! (`LOOP_DOUBLE`, 32-token tiles, `--tune prefill_dbuf=1`) the scratch holds one pair, which
//! the subgroups fill in turn, and the whole workgroup writes each out.

use super::gemm::{prelude, GemmForm, PlanLayout};

/// The kernel in words (for `--verbose`).
pub const DESCRIPTION: &str = "int4 GEMM on matrix units, split-f16 products, f32 sums";

/// `gm_wstore` for int4 weights: thread (nn, h)'s 16 values of one block (elements 8h .. 8h + 8 and
/// 16 + 8h .. 16 + 8h + 8 of row nn, as in gemm.rs), scaled by `WS` and split into `wh`/`wl` at
/// `[k][nn]` from `wo` (the staging buffer's offset in halves), all in f16 arithmetic and two
/// values at a time. The scale `d · WS` (an f16 scale times 2^8: 11 significant bits) is cut into `dh`
/// (its top 8 bits) and `dl = d · WS - dh` (the other 3); with `|q - 8| <= 8` (at most 3
/// significant bits) `dh (q - 8)` has at most 11 significant bits and `dl (q - 8)` at most 6, so
/// both f16 products are exact and `wh + wl` is the weight exactly, with `wl` below 2^-7 of it (so
/// the dropped `xl·wl` stays below 2^-17 of a term; a 7-bit `dh` would allow 2^-16). The split of
/// the f32 weight, `hi` masked to 11 bits, needed an int-to-float and two float-to-half conversions
/// per weight: the staging's cost. `q - 8` comes exact from the f32 bits `0x4B000000 | q` (2^23 +
/// q), and each pair (the nibbles at bits 4t and 4t + 16 of a word) becomes f16 in one vector
/// conversion. (naga 30 cannot bitcast a u32 to `vec2<f16>`, which would skip the f32 step.)
const WSTORE_COOP: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32, wo: u32) {
    let d = r.d * WS;
    let dh = bitcast<f32>(bitcast<u32>(d) & 0xFFFF0000u);
    let dh16 = f16(dh);
    let dl16 = f16(d - dh);
    for (var j = 0u; j < 2u; j++) {
        let w = r.q[j];
        let k = 8u * h + 4u * j;
        for (var t = 0u; t < 4u; t++) {
            // Nibbles at bits 4t and 4t + 16: elements e and e + 2 of the block (byte t / 2 and
            // t / 2 + 2; a high nibble is element 16 further).
            let e = k + (t >> 1u) + 16u * (t & 1u);
            let s = 4u * t;
            let qe = bitcast<f32>(((w >> s) & 0xFu) | 0x4B000000u) - 8388616.0;
            let qf = bitcast<f32>(((w >> (s + 16u)) & 0xFu) | 0x4B000000u) - 8388616.0;
            let qv = vec2<f16>(vec2<f32>(qe, qf));
            let a = qv * dh16;
            let b = qv * dl16;
            wh[wo + e * SW + nn] = a.x;
            wh[wo + (e + 2u) * SW + nn] = a.y;
            wl[wo + e * SW + nn] = b.x;
            wl[wo + (e + 2u) * SW + nn] = b.y;
        }
    }
}
";

/// [`WSTORE_COOP`] for the affine form (tensor.rs): the weight `w = fma(s, q, b)` (the
/// oracle's weight exactly; times `WS`, exact) is split as an activation is, `hi` = `w` cut to
/// 11 significant bits by masking and `lo = f16(w - hi)`: `lo` is below 2^-10 of `w` and off by
/// at most 2^-11 of itself (2^-21 of `w`, as `xl` is of x), so the dropped `xl·wl` stays below
/// 2^-20 of a term. An MLX weight `s q + b` may need ~24 significant bits, so no split of
/// the scale alone is exact here. A weight below 2^-22 in magnitude (2^-14 after `WS`) gets an
/// f16 subnormal `hi`: at most 2^-32 off in absolute terms.
const WSTORE_COOP_AFFINE: &str = "fn gm_wstore(r: WReg, nn: u32, h: u32, wo: u32) {
    let s = r.d * WS;
    let o = r.b * WS;
    for (var j = 0u; j < 2u; j++) {
        let w = r.q[j];
        let k = 8u * h + 4u * j;
        for (var t = 0u; t < 4u; t++) {
            // As in WSTORE_COOP: nibbles at bits 4t and 4t + 16 are elements e and e + 2.
            let e = k + (t >> 1u) + 16u * (t & 1u);
            let sh = 4u * t;
            let v = vec2<f32>(
                fma(s, f32((w >> sh) & 0xFu), o),
                fma(s, f32((w >> (sh + 16u)) & 0xFu), o),
            );
            let hi = bitcast<vec2<f32>>(bitcast<vec2<u32>>(v) & vec2<u32>(0xFFFFE000u));
            let a = vec2<f16>(hi);
            let b = vec2<f16>(v - hi);
            wh[wo + e * SW + nn] = a.x;
            wh[wo + (e + 2u) * SW + nn] = a.y;
            wl[wo + e * SW + nn] = b.x;
            wl[wo + (e + 2u) * SW + nn] = b.y;
        }
    }
}
";

/// The body after the prelude; `NBUF` (staging buffers) and `CSW` (epilogue scratch words) are
/// set by [`shader`], and `//ZERO_CS`, `//COOP_DECL` (the accumulators, loaded from zeroed
/// scratch), `//LOOP` and `//COOP_STORE` are expanded there (the loop from [`STAGE`],
/// [`LOAD_NEXT`] and [`PRODUCTS`]).
const BODY: &str = "
const SX: u32 = BM + 8u;   // halves per staged X^T row (one input k, BM tokens + padding)
const SW: u32 = 136u;      // halves per staged W^T row (one input k, 128 weight rows + padding)
// X x 2^4 and W x 2^8 (exact) keep the low halves of the splits in f16's normal range for the
// usual magnitudes (whether the matrix units keep f16 subnormals was not measured); the sums
// are scaled back by 2^-12 (exact) in the epilogue.
const XS: f32 = 16.0;
const WS: f32 = 256.0;
const UNS: f32 = 0.000244140625;
var<workgroup> xh: array<f16, NBUF * 32u * SX>;
var<workgroup> xl: array<f16, NBUF * 32u * SX>;
var<workgroup> wh: array<f16, NBUF * 32u * SW>;
var<workgroup> wl: array<f16, NBUF * 32u * SW>;
var<workgroup> cs: array<f32, CSW>; // two 16 x 16 accumulators per subgroup (or one subgroup's)

// `hi` is `v` with its low 13 mantissa bits cleared (11 significant bits: exact in f16) and
// `lo = v - hi` (exact in f32). Integer masking, not `v - f32(f16(v))`: the H200's compiler
// folds that round trip to zero (the products were then exactly f16-rounded ones).
fn split_hi(v: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(v) & 0xFFFFE000u);
}
// Both halves converted as one vector (one packed conversion where the GPU has it).
fn xsplit(i: u32, v: f32) {
    let a = split_hi(v);
    let hl = vec2<f16>(vec2<f32>(a, v - a));
    xh[i] = hl.x;
    xl[i] = hl.y;
}
fn silu(g: f32) -> f32 {
    return g / (1.0 + exp(-g));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    // The tile flag, uniform per workgroup: passed through `workgroupUniformLoad` so the
    // validator sees it is (barriers and matrix operations need uniform control flow, and the
    // expert forms read `plan`, a storage buffer). It lives in a padding half of `wl` (row 31,
    // column 135: neither staged nor read by the products) rather than in a u32 workgroup
    // variable of its own: with one, every product read garbage on the H200 (presumably the
    // f16 arrays were placed off the alignment its matrix loads need; the probes in this file's
    // tests and docs/runs/2026-12-02-h200-run84-87* show the bisection). A workgroup without a
    // tile runs its block loop zero times and writes nothing: no early return ahead of the
    // products (the form that was tested).
    let t = gm_tile(wid);
    if (li == 0u) {
        wl[31u * SW + 135u] = select(f16(0.0), f16(1.0), t.ok);
    }
    // The blocks [kb, kb + nblocks) of this workgroup's K split (grid z; one split of bpr
    // blocks unless the binding splits K: gemm.rs `bind_split`).
    let kb = min(min(wid.z, p.splits - 1u) * p.ks, p.bpr - 1u);
    let kend = min(kb + p.ks, p.bpr);
    let nblocks = select(0u, kend - kb, workgroupUniformLoad(&wl[31u * SW + 135u]) != f16(0.0));
    // Staging roles as in gemm_q4.wgsl: X row sr of the tile, vec4s sv .. sv + XPT of the block;
    // W tile column nn, half h of the block.
    let sr = li % BM;
    let sv = (li / BM) * XPT;
    let xrow = gm_xrow(t, min(t.m0 + sr, t.mend - 1u));
    let nn = li % 128u;
    let h = li / 128u;
    var xr: array<vec4<f32>, XPT>;
    for (var i = 0u; i < XPT; i++) {
        xr[i] = x[xrow * p.xs4 + kb * 8u + sv + i];
    }
    var wr = gm_wfetch(wid, t, nn, h, kb);
    let ti = sg % MT;
    let g = sg / MT;
    // The accumulators start as loads of zeroed epilogue scratch (the form tested in the
    // kernel; `coop_mat16x16<f32, C>()` gives zeros too, coop_probe).
    //ZERO_CS
    workgroupBarrier();
    //COOP_DECL
    //LOOP
    //COOP_STORE
}
";

/// Stage the registers' block into buffer `$c` (X^T split, W^T dequantised and split).
const STAGE: &str = "
        for (var i = 0u; i < XPT; i++) {
            let k = 4u * (sv + i);
            let v = xr[i] * XS;
            let xo = ($c) * 32u * SX + sr;
            xsplit(xo + k * SX, v.x);
            xsplit(xo + (k + 1u) * SX, v.y);
            xsplit(xo + (k + 2u) * SX, v.z);
            xsplit(xo + (k + 3u) * SX, v.w);
        }
        gm_wstore(wr, nn, h, ($c) * 32u * SW);
";

/// Load block `$b` into the registers (its loads then overlap the products that follow).
const LOAD_NEXT: &str = "
        {
            let bn = $b;
            for (var i = 0u; i < XPT; i++) {
                xr[i] = x[xrow * p.xs4 + bn * 8u + sv + i];
            }
            wr = gm_wfetch(wid, t, nn, h, bn);
        }
";

/// This subgroup's products over the block in buffer `$c`; `//COOP_MMA` per accumulator.
const PRODUCTS: &str = "
        {
            let xo = ($c) * 32u * SX;
            let wo = ($c) * 32u * SW;
            for (var kk = 0u; kk < 32u; kk += 16u) {
                // A = X[16 tokens][16 k], stored k-major: column-major with stride SX.
                let ah = coopLoad<coop_mat16x16<f16, A>>(&xh[xo + kk * SX + 16u * ti], SX);
                let al = coopLoad<coop_mat16x16<f16, A>>(&xl[xo + kk * SX + 16u * ti], SX);
                //COOP_MMA
            }
        }
";

/// The block loop with one staging buffer: stage, products, two barriers per block.
const LOOP_SINGLE: &str = "
    for (var b = 0u; b < nblocks; b++) {
        // The previous block's products are done with the staging buffers.
        workgroupBarrier();
        //STAGE(0u)
        workgroupBarrier();
        // The next block's loads overlap this block's products (the last block loads itself
        // again rather than branch).
        //LOAD_NEXT(min(kb + b + 1u, p.bpr - 1u))
        //PRODUCTS(0u)
    }
";

/// The block loop with two staging buffers (`--tune prefill_dbuf=1`): block b + 1 is staged
/// into one buffer while the products read block b from the other, one barrier per block.
/// The barrier ending block b orders both that block's products before the next staging into
/// their buffer and that staging before its products. The staging is skipped where nothing
/// would read it (a workgroup without a tile, the split's last block): uniform branches with
/// no barrier or matrix operation inside.
const LOOP_DOUBLE: &str = "
    if (nblocks > 0u) {
        //STAGE(0u)
        //LOAD_NEXT(min(kb + 1u, kend - 1u))
    }
    workgroupBarrier();
    for (var b = 0u; b < nblocks; b++) {
        let cur = b & 1u;
        if (b + 1u < nblocks) {
            //STAGE(cur ^ 1u)
            //LOAD_NEXT(min(kb + b + 2u, kend - 1u))
        }
        //PRODUCTS(cur)
        workgroupBarrier();
    }
";

/// Expand the `//STAGE(c)`, `//LOAD_NEXT(b)` and `//PRODUCTS(c)` lines of `lp` (one of the
/// loops above), with `mma` (the products of every accumulator) in each `PRODUCTS`.
fn expand_loop(lp: &str, mma: &str) -> String {
    let mut out = String::new();
    for line in lp.lines() {
        let t = line.trim_start();
        let arg = |name: &str| t.strip_prefix(name).and_then(|r| r.strip_suffix(')'));
        if let Some(c) = arg("//STAGE(") {
            out += &STAGE.replace("$c", c);
        } else if let Some(b) = arg("//LOAD_NEXT(") {
            out += &LOAD_NEXT.replace("$b", b);
        } else if let Some(c) = arg("//PRODUCTS(") {
            out += &PRODUCTS
                .replace("$c", c)
                .replace("                //COOP_MMA\n", mma);
        } else {
            out += line;
            out += "\n";
        }
    }
    out
}

/// Workgroup memory of the kernel with `tm` tokens per thread, double-buffered or not: the X^T
/// and W^T staging (f16 pairs; SX = 16 tm + 8, SW = 136 halves per row of 32) and the epilogue
/// scratch (two 16 x 16 f32 tiles per subgroup, or one subgroup's at a time when double).
pub fn workgroup_bytes(tm: u32, double: bool) -> u64 {
    let nbuf = if double { 2 } else { 1 };
    let staging = nbuf * 2 * 32 * ((16 * tm + 8) + 136) * 2;
    let scratch = if double { 512 * 4 } else { 8 * 512 * 4 };
    (staging + scratch) as u64
}

/// Whether the `tm` form takes the double-buffered loop when `dbuf` asks for it: only the
/// 32-token tiles fit two buffers under the 48 KiB NVIDIA's Vulkan gives a workgroup (47104
/// bytes against 55296 at 64 tokens).
pub fn double_buffered(tm: u32, dbuf: bool) -> bool {
    dbuf && tm == 2
}

/// The WGSL of `form` (an int4 form: `DenseF32` stays on the f32 kernel) with `tm` tokens per
/// thread of the f32 kernel's tiling (tile height `16 tm`: 2 or 4 token tiles); `dbuf`: two
/// staging buffers where [`double_buffered`] allows (`--tune prefill_dbuf=1`); `affine`: int4
/// weights in the affine (MLX) form (`WSTORE_COOP_AFFINE`), else Q4_0.
pub fn shader(
    form: GemmForm,
    tm: u32,
    plan: Option<PlanLayout>,
    dbuf: bool,
    affine: bool,
) -> String {
    debug_assert!(form != GemmForm::DenseF32 && (tm == 2 || tm == 4));
    let mt = tm;
    let double = double_buffered(tm, dbuf);
    let mut s = String::from("enable f16;\nenable wgpu_cooperative_matrix;\n");
    s += &format!(
        "const MT: u32 = {mt}u;\nconst NBUF: u32 = {}u;\nconst CSW: u32 = {}u;\n",
        if double { 2 } else { 1 },
        if double { 512 } else { 8 * 512 }
    );
    let cs0 = if double { "0u" } else { "sg * 512u" };
    let wstore = if affine {
        WSTORE_COOP_AFFINE
    } else {
        WSTORE_COOP
    };
    let qform = match affine {
        true => crate::tensor::QForm::Affine4,
        false => crate::tensor::QForm::Q4_0,
    };
    s += &prelude(form, tm, plan, wstore, qform);
    // (gate-or-first, up-or-second) column tiles of each accumulator pair.
    let pairs: Vec<(&str, &str)> = if mt == 4 {
        vec![("2u * g", "2u * g + 4u"), ("2u * g + 1u", "2u * g + 5u")]
    } else {
        vec![("g", "g + 4u")]
    };
    let cols = form.cols_per_tile();
    let mut decl = String::new();
    let mut mma = String::new();
    let mut store = String::new();
    for (i, (na, nb)) in pairs.iter().enumerate() {
        for (acc, n) in [(format!("c{i}a"), na), (format!("c{i}b"), nb)] {
            decl += &format!("    var {acc} = coopLoad<coop_mat16x16<f32, C>>(&cs[{cs0}], 16u);\n");
            mma += &format!(
                "            {{
                let bh = coopLoadT<coop_mat16x16<f16, B>>(&wh[wo + kk * SW + 16u * ({n})], SW);
                let bl = coopLoadT<coop_mat16x16<f16, B>>(&wl[wo + kk * SW + 16u * ({n})], SW);
                {acc} = coopMultiplyAdd(ah, bh, {acc});
                {acc} = coopMultiplyAdd(al, bh, {acc});
                {acc} = coopMultiplyAdd(ah, bl, {acc});
            }}
"
            );
        }
        let write = match form {
            GemmForm::GateUp => {
                "            if (na < p.n) { y[yb + na] = silu(cs[o + e] * UNS) * (cs[o + 256u + e] * UNS); }\n"
            }
            GemmForm::DenseAcc => {
                "            if (na < p.n) { y[yb + na] += cs[o + e] * UNS; }
            if (nb < p.n) { y[yb + nb] += cs[o + 256u + e] * UNS; }\n"
            }
            _ => {
                "            if (na < p.n) { y[yb + na] = cs[o + e] * UNS; }
            if (nb < p.n) { y[yb + nb] = cs[o + 256u + e] * UNS; }\n"
            }
        };
        // Element e of the pair (token row e / 16, column e % 16 of this subgroup's tiles).
        let out = format!(
            "            let m = t.m0 + 16u * ti + e / 16u;
            if (m < t.mend) {{
                let yb = gm_yrow(t, m) * p.ys + p.ycol;
                let na = wid.x * {cols}u + 16u * ({na}) + e % 16u;
                let nb = wid.x * {cols}u + 16u * ({nb}) + e % 16u;
{write}            }}
"
        );
        store += &if double {
            // One subgroup at a time through the one scratch pair; every thread writes one
            // element of it (that subgroup's token and column tiles).
            format!(
                "    for (var s = 0u; s < 8u; s++) {{
        if (sg == s) {{
            coopStoreT(c{i}a, &cs[0], 16u);
            coopStoreT(c{i}b, &cs[256u], 16u);
        }}
        workgroupBarrier();
        {{
            let ti = s % MT;
            let g = s / MT;
            let o = 0u;
            let e = li;
{out}        }}
        workgroupBarrier();
    }}
"
            )
        } else {
            format!(
                "    {{
        let o = sg * 512u;
        coopStoreT(c{i}a, &cs[o], 16u);
        coopStoreT(c{i}b, &cs[o + 256u], 16u);
        workgroupBarrier();
        for (var j = 0u; j < 8u; j++) {{
            let e = lane + 32u * j;
{out}        }}
        workgroupBarrier();
    }}
"
            )
        };
    }
    let zero = if double {
        "    cs[li] = 0.0;\n    cs[li + 256u] = 0.0;\n"
    } else {
        "    for (var j = 0u; j < 16u; j++) {\n        cs[sg * 512u + lane + 32u * j] = 0.0;\n    }\n"
    };
    let lp = expand_loop(if double { LOOP_DOUBLE } else { LOOP_SINGLE }, &mma);
    s + &BODY
        .replace("    //ZERO_CS\n", zero)
        .replace("    //COOP_DECL\n", &decl)
        .replace("    //LOOP\n", &lp)
        .replace("    //COOP_STORE\n", &store)
}

/// Whether `ctx` can run this kernel: 16x16x16 f16 x f16 -> f32 cooperative products, f16 in
/// shaders, and subgroups of exactly 32 (the tile split above assumes 8 subgroups; the check is
/// made here, never assumed).
pub fn supported(ctx: &crate::context::Context) -> bool {
    ctx.coop_f16_16x16()
}

#[cfg(test)]
#[path = "gemm_coop_tests.rs"]
mod tests;
