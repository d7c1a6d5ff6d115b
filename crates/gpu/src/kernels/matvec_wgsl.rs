//! WGSL sources of the matvec family (matvec.rs builds its pipelines from them): the input
//! snippets of matvec_q4f.wgsl (norm on load, its late-scaled form, plain copy, and the bfp24
//! staging), the per-row expansion of its body, the folded router's extra workgroups, and the
//! input snippets of matvec_f32.wgsl.

use super::matvec::Fused;
use crate::numerics::{BFP_DOT, F32_DEQ};
use crate::tensor::QForm;

/// WGSL (a macro, so that [`NORM_ON_LOAD`] and the bfp24 norm can both be built from it with
/// `concat!`): `nol_inv(li, n4, eps)` = `1 / sqrt(mean(h^2) + eps)` of `nol_h` (`[n4]` vec4s;
/// 256 threads, every thread calls it). Two-level sum (two barriers), every thread adding the
/// 16 partials in the same order; every workgroup of a dispatch computes the same value.
macro_rules! nol_inv_wgsl {
    () => {
        "
// Thread i's partial at i + i / 16: the 16 threads of the second level read 16 banks, not 2.
var<workgroup> nol_red: array<f32, 272>;
var<workgroup> nol_red16: array<f32, 16>;
// Threads 0-15: the second level of the sum (after the barrier that publishes nol_red).
fn nol_sum16(li: u32) {
    if (li < 16u) {
        var s = 0.0;
        for (var j = 0u; j < 16u; j++) { s += nol_red[17u * li + j]; }
        nol_red16[li] = s;
    }
}
// 1 / rms from the second level (after the barrier that publishes nol_red16).
fn nol_rms_inv(n4: u32, eps: f32) -> f32 {
    var tot = 0.0;
    for (var j = 0u; j < 16u; j++) { tot += nol_red16[j]; }
    return inverseSqrt(tot / f32(4u * n4) + eps);
}
fn nol_inv(li: u32, n4: u32, eps: f32) -> f32 {
    var ss = 0.0;
    for (var i = li; i < n4; i += 256u) {
        let v = nol_h[i];
        ss += dot(v, v);
    }
    nol_red[li + li / 16u] = ss;
    workgroupBarrier();
    nol_sum16(li);
    workgroupBarrier();
    return nol_rms_inv(n4, eps);
}
"
    };
}

/// WGSL of the norm-on-load input (`nol_h` = residual stream, `nol_w` = RMSNorm weight, both
/// `array<vec4<f32>>`, and `nol_slot(i)` declared by the includer): `nol_stage(li, n4, eps)` (256
/// threads, every thread calls it) leaves `h / sqrt(mean(h^2) + eps) * w` in `nol_xs` (vec4 `i`
/// at `nol_slot(i)`), the scale from `nol_inv`.
pub(crate) const NORM_ON_LOAD: &str = concat!(
    nol_inv_wgsl!(),
    "
var<workgroup> nol_xs: array<vec4<f32>, 1024>; // [n/4], n <= 4096
fn nol_stage(li: u32, n4: u32, eps: f32) {
    let inv = nol_inv(li, n4, eps);
    for (var i = li; i < n4; i += 256u) {
        nol_xs[nol_slot(i)] = nol_h[i] * inv * nol_w[i];
    }
    workgroupBarrier();
}
"
);

/// WGSL: the late-norm form of [`NORM_ON_LOAD`] (`--tune late_norm=1`): `nol_stage` stages
/// `h ⊙ w` with the first level of the sum of squares and leaves the second level to threads
/// 0-15 without waiting for it; `nol_scale` (called after the kernel's reduction barrier, which
/// publishes that level too) is `1 / sqrt(mean(h^2) + eps)` from the same partials in the same
/// order, and multiplies each row's sum. `rmsnorm(h) = inv (h ⊙ w)` with one scalar inv, so
/// `W rmsnorm(h) = inv (W (h ⊙ w))`: the dots start one barrier after the loads instead of three.
const LATE_NORM_ON_LOAD: &str = concat!(
    nol_inv_wgsl!(),
    "
var<workgroup> nol_xs: array<vec4<f32>, 1024>; // [n/4] h * w, n <= 4096
fn nol_stage(li: u32, n4: u32, eps: f32) {
    var ss = 0.0;
    for (var i = li; i < n4; i += 256u) {
        let v = nol_h[i];
        ss += dot(v, v);
        nol_xs[nol_slot(i)] = v * nol_w[i];
    }
    nol_red[li + li / 16u] = ss;
    workgroupBarrier();
    nol_sum16(li);
}
fn nol_scale(eps: f32, n4: u32) -> f32 {
    return nol_rms_inv(n4, eps);
}
"
);

/// WGSL: `nol_scale` of every input form that scales nothing after the product.
const UNIT_SCALE: &str = "fn nol_scale(eps: f32, n4: u32) -> f32 { return 1.0; }\n";

/// WGSL: `nol_stage` that only copies the plain input `act_x` into `nol_xs` (same slots as
/// [`NORM_ON_LOAD`]).
const COPY_ON_LOAD: &str = "
var<workgroup> nol_xs: array<vec4<f32>, 1024>; // [n/4], n <= 4096
fn nol_stage(li: u32, n4: u32, eps: f32) {
    for (var i = li; i < n4; i += 256u) {
        nol_xs[nol_slot(i)] = act_x[i];
    }
    workgroupBarrier();
}
";

/// WGSL: the swizzled slot of vec4 `i` (block `i / 8`, vec4 `i % 8`) in matvec_q4f's staging.
const SWIZZLE: &str =
    "fn nol_slot(i: u32) -> u32 { return (i & ~7u) | (((i & 7u) + (i >> 3u)) & 7u); }\n";

/// WGSL: `xblock(b)`, the 32 staged f32 activations of block b in element order (the f32
/// staging of [`NORM_ON_LOAD`] / [`COPY_ON_LOAD`] through [`SWIZZLE`]).
const F32_XBLOCK: &str = "
fn xblock(b: u32) -> array<vec4<f32>, 8> {
    let s = b & 7u;
    return array<vec4<f32>, 8>(
        nol_xs[b * 8u + (s & 7u)], nol_xs[b * 8u + ((s + 1u) & 7u)],
        nol_xs[b * 8u + ((s + 2u) & 7u)], nol_xs[b * 8u + ((s + 3u) & 7u)],
        nol_xs[b * 8u + ((s + 4u) & 7u)], nol_xs[b * 8u + ((s + 5u) & 7u)],
        nol_xs[b * 8u + ((s + 6u) & 7u)], nol_xs[b * 8u + ((s + 7u) & 7u)]);
}
";

/// WGSL of the bfp24 staging (numerics.rs `BFP_DOT`, which the includer also prepends): the
/// arrays, `bfp_put`, `bfp_rec` and `xblock`; `nol_stage` itself is [`bfp_nol_stage`]. Block b's
/// parts lie at `nol_slot(8b + k)` (k = 0, 1 hi; 2, 3 mid; 4, 5 lo: the f32 staging's swizzle,
/// so 8 lanes reading vec4 k of 8 consecutive blocks hit 8 different bank groups) and its record
/// `(d, 8 Σ q)` at `nol_slot(8b + 6)`. The thread of input vec4 i (elements 4j..4j+3 of block
/// i / 8, j = i % 8) publishes the vec4's max |x|; after a barrier it reads the block's 8 maxima
/// and writes word j % 4 of the part vec4s j / 4 and its 8 Σ q (`bfp_put`); after another, the
/// block's first thread writes the record (`bfp_rec`). Each block's words come from its own 8
/// threads and nothing reads the staging before the closing barrier, so the f32 values never
/// need to be staged.
const BFP_STAGE: &str = "
var<workgroup> nol_xs: array<vec4<u32>, 1024>;   // [n/4] bfp parts, 8 slots per block of 32
var<workgroup> bfp_amax: array<f32, 1024>;       // [n/4] max |x| of each input vec4
var<workgroup> bfp_ps: array<i32, 1024>;         // [n/4] 8 Σ q of each input vec4 (wrapping)
var<workgroup> bfp_d: array<f32, 128>;           // [n/32] block scales
fn bfp_put(i: u32, v: vec4<f32>) {
    let o = i & ~7u;
    let m = max(
        max(max(bfp_amax[o], bfp_amax[o + 1u]), max(bfp_amax[o + 2u], bfp_amax[o + 3u])),
        max(max(bfp_amax[o + 4u], bfp_amax[o + 5u]), max(bfp_amax[o + 6u], bfp_amax[o + 7u])));
    let sd = bfp_scale(m);
    let q = bfp_q(v, sd.x);
    let pk = bfp_pack(q);
    let j = i & 7u;
    let c = j & 3u;
    let k = j >> 2u;
    nol_xs[nol_slot(o + k)][c] = pk.x;
    nol_xs[nol_slot(o + 2u + k)][c] = pk.y;
    nol_xs[nol_slot(o + 4u + k)][c] = pk.z;
    bfp_ps[i] = 8 * ((q.x + q.y) + (q.z + q.w));
    if (j == 0u) {
        bfp_d[i >> 3u] = sd.y;
    }
}
// The record of block i / 8 (i = its first vec4): (d, 8 Σ q) at its slot 6.
fn bfp_rec(i: u32) {
    let q8 = ((bfp_ps[i] + bfp_ps[i + 1u]) + (bfp_ps[i + 2u] + bfp_ps[i + 3u]))
        + ((bfp_ps[i + 4u] + bfp_ps[i + 5u]) + (bfp_ps[i + 6u] + bfp_ps[i + 7u]));
    nol_xs[nol_slot(i + 6u)] = vec4<u32>(bitcast<u32>(bfp_d[i >> 3u]), bitcast<u32>(q8), 0u, 0u);
}
fn xblock(b: u32) -> BfpBlock {
    let o = b * 8u;
    let s = b & 7u;
    let r = nol_xs[o + ((s + 6u) & 7u)];
    return BfpBlock(
        array<vec4<u32>, 6>(nol_xs[o + s], nol_xs[o + ((s + 1u) & 7u)], nol_xs[o + ((s + 2u) & 7u)],
            nol_xs[o + ((s + 3u) & 7u)], nol_xs[o + ((s + 4u) & 7u)], nol_xs[o + ((s + 5u) & 7u)]),
        bitcast<f32>(r.x), bitcast<i32>(r.y));
}
";

/// The input vec4s a thread of the bfp24 staging holds (n <= 4096 in 256 threads).
const BFP_IT: u32 = 4;

/// WGSL: the bfp24 `nol_stage(li, n4, eps)` with `pre` run first (the norm's reduction, or
/// nothing) and input vec4 `i` given by the expression `value` (of `i`). Written out per held
/// vec4 (v0, v1, ..): separate variables, since a per-thread array indexed in a loop may be
/// placed in slow local memory by the driver's compiler.
fn bfp_nol_stage(pre: &str, value: &str) -> String {
    let (mut load, mut put, mut rec) = (String::new(), String::new(), String::new());
    for t in 0..BFP_IT {
        load += &format!(
            "    let i{t} = li + {}u;
    var v{t} = vec4<f32>(0.0);
    if (i{t} < n4) {{
        let i = i{t};
        v{t} = {value};
        let a = abs(v{t});
        bfp_amax[i] = max(max(a.x, a.y), max(a.z, a.w));
    }}
",
            256 * t
        );
        put += &format!("    if (i{t} < n4) {{ bfp_put(i{t}, v{t}); }}\n");
        rec += &format!("    if (i{t} < n4 && (i{t} & 7u) == 0u) {{ bfp_rec(i{t}); }}\n");
    }
    format!(
        "fn nol_stage(li: u32, n4: u32, eps: f32) {{
{pre}{load}    workgroupBarrier();
{put}    workgroupBarrier();
{rec}    workgroupBarrier();
}}
"
    )
}

/// The bfp24 norm-on-load input's scale (`nol_h`, `nol_w` as in [`NORM_ON_LOAD`]): the same
/// `nol_inv`, so the same `h * inv * w` values.
const BFP_NORM_PRE: &str = "    let inv = nol_inv(li, n4, eps);\n";

/// matvec_q4f.wgsl with `lanes` lanes per row (matvec.rs `lanes_per_row`).
fn q4f_shader(lanes: u32) -> String {
    include_str!("../shaders/matvec_q4f.wgsl").replace("LANES_PER_ROW", &lanes.to_string())
}

/// matvec_q4f.wgsl over one form: [`q4f_rows`] for `r` rows per team of `lanes` lanes each,
/// called for the part the dispatch binds (the host prepends `const R: u32 = r`).
pub(super) fn q4f_body(r: u32, lanes: u32, form: QForm) -> String {
    form.wgsl()
        + &q4f_shader(lanes)
            .replace(
                "//ROWS_FNS",
                &format!("const RED_R: u32 = R;\n{}", q4f_rows(r, form, (0, 1))),
            )
            .replace(
                "//ROWS_CALL",
                "mv_rows(wid.x + wid.y * p.gx, li, p.rows, p.row_start);",
            )
}

/// Bindings of the second part's blocks and scale words in [`q4f_pair_body`].
pub(super) const PAIR_BINDINGS: (u32, u32) = (10, 11);

/// matvec_q4f.wgsl over a stack of two parts in two forms (a `Q4_K_M` qkv: q and k in Q4_K,
/// v in Q6_K) in one dispatch instead of one per part: `(r, form)` of each part. The first
/// `p.p2` workgroups take the first part (`p.rows` rows from `p.row_start`, bindings 0 and 1,
/// `r.0` rows per team, the host's `const R`), the next ones the second (`p.p3` rows right
/// after it, bindings [`PAIR_BINDINGS`], `r.1` rows per team): a copy of the second form's
/// WGSL and of [`q4f_rows`] with every name they define suffixed `_b` ([`suffixed`]), so the
/// two forms' `QB`, `SW`, `q4_coef`, .. live side by side. The staged input, the partials'
/// `red` (sized for the larger `R`), the `lanes` per row (the parts' columns are the same) and
/// everything after the rows are shared.
pub(super) fn q4f_pair_body(r: (u32, u32), lanes: u32, forms: (QForm, QForm)) -> String {
    let second = format!(
        "const R: u32 = {}u;\n{}{}",
        r.1,
        forms.1.wgsl(),
        q4f_rows(r.1, forms.1, PAIR_BINDINGS)
    );
    let mut names = defined_names(&second);
    names.extend(["qs", "sc", "scale", "mv_rows"].map(String::from));
    let fns = format!(
        "const RED_R: u32 = {}u;\n{}\n{}",
        r.0.max(r.1),
        q4f_rows(r.0, forms.0, (0, 1)),
        suffixed(&second, &names, "_b")
    );
    let call = "let wg = wid.x + wid.y * p.gx;
    if (wg < p.p2) {
        mv_rows(wg, li, p.rows, p.row_start);
    } else {
        mv_rows_b(wg - p.p2, li, p.p3, p.row_start + p.rows);
    }";
    forms.0.wgsl()
        + &q4f_shader(lanes)
            .replace("//ROWS_FNS", &fns)
            .replace("//ROWS_CALL", call)
}

/// The names a WGSL source declares at module scope (`fn`, `alias`, `struct`, `const`,
/// `var<..>`), which [`suffixed`] renames.
fn defined_names(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in src.lines() {
        let t = line.trim_start();
        // Only module-scope declarations start a line unindented.
        if t.len() != line.len() {
            continue;
        }
        let rest = ["fn ", "alias ", "struct ", "const "]
            .iter()
            .find_map(|k| t.strip_prefix(k))
            .or_else(|| {
                t.strip_prefix("var<")
                    .and_then(|v| v.split_once('>'))
                    .map(|v| v.1)
            });
        if let Some(rest) = rest {
            let name: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

/// `src` with every identifier in `names` (whole words; not inside numbers such as
/// `0x0F0Fu`, not after a `.`, which would be a member) followed by `suffix`.
fn suffixed(src: &str, names: &[String], suffix: &str) -> String {
    let mut out = String::with_capacity(src.len() + 256);
    let b = src.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i] as char;
        if c.is_ascii_alphanumeric() || c == '_' {
            let start = i;
            while i < b.len() && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            let word = &src[start..i];
            out.push_str(word);
            let member = start > 0 && b[start - 1] == b'.';
            if !c.is_ascii_digit() && !member && names.iter().any(|n| n == word) {
                out.push_str(suffix);
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// matvec_q4f_rows.wgsl (`mv_rows`, reading its blocks and scale words at bindings `at`) with
/// its per-row lines written out for `r` rows per team, for a nibble or a byte form and, where
/// `form` is affine, each block adding `c1 · Σ x` (tensor.rs `Q4_COEF`), the block's sum
/// computed once per lane and block for all the team's rows.
fn q4f_rows(r: u32, form: QForm, at: (u32, u32)) -> String {
    let affine = form.affine();
    let dot = form.dot_fn();
    let (mut pre, mut decl, mut first) = (String::new(), String::new(), String::new());
    let (mut body, mut store) = (String::new(), String::new());
    if affine {
        first += "let xs = q4_xsum(x);\n        ";
        body += "let xs = q4_xsum(x);\n        ";
    }
    for i in 0..r {
        decl += &format!("var acc{i} = 0.0;\n    ");
        store += &format!("red[(team * R + {i}u) * TP + lane] = acc{i};\n    ");
        if affine {
            pre += &format!(
                "let r{i} = select(0u, row0 + {i}u, row0 + {i}u < rows); \
                 let pq{i} = qs[r{i} * p.bpr + b0]; \
                 let ps{i} = q4_coef(sc[(r{i} * p.bpr + b0) >> 1u], r{i} * p.bpr + b0);\n    "
            );
            first += &format!("acc{i} = fma(ps{i}.x, {dot}(pq{i}, x), ps{i}.y * xs);\n        ");
            body += &format!(
                "{{ let blk = r{i} * p.bpr + b; let cf = q4_coef(sc[blk >> 1u], blk); \
                 acc{i} = fma(cf.x, {dot}(qs[blk], x), fma(cf.y, xs, acc{i})); }}\n        "
            );
            continue;
        }
        pre += &format!(
            "let r{i} = select(0u, row0 + {i}u, row0 + {i}u < rows); \
             let pq{i} = qs[r{i} * p.bpr + b0]; let ps{i} = scale(r{i} * p.bpr + b0);\n    "
        );
        first += &format!("acc{i} = ps{i} * {dot}(pq{i}, x);\n        ");
        body += &format!(
            "{{ let blk = r{i} * p.bpr + b; \
             acc{i} = fma(scale(blk), {dot}(qs[blk], x), acc{i}); }}\n        "
        );
    }
    include_str!("../shaders/matvec_q4f_rows.wgsl")
        .replace("QS_BINDING", &at.0.to_string())
        .replace("SC_BINDING", &at.1.to_string())
        .replace("//ROWS_PREFETCH", &pre)
        .replace("//ROWS_DECL", &decl)
        .replace("//ROWS_FIRST", &first)
        .replace("//ROWS_BODY", &body)
        .replace("//ROWS_STORE", &store)
}

/// WGSL: `extra_rows` of every matvec_q4f form but the folded router's.
const NO_EXTRA_ROWS: &str = "fn extra_rows(wg: u32, li: u32) -> bool { return false; }\n";

/// WGSL: the folded router's workgroups of the o-proj dispatch ([`Fused::Router`]). Params: p1 =
/// workgroups of the matrix rows (those come first), p2 = E, p3 = Q/4 (the matrix's columns);
/// the fold rows are `[Q + H]` with H = p.rows. One row per workgroup, 256 lanes striding it by
/// vec4, then a tree reduction in `red`.
const ROUTER_ROWS: &str = "
@group(0) @binding(7) var<storage, read> fold_h: array<vec4<f32>>; // [H/4] residual stream
@group(0) @binding(8) var<storage, read> fold_w: array<vec4<f32>>; // [E, (Q + H)/4] router fold
@group(0) @binding(9) var<storage, read_write> fold_z: array<f32>; // [E] pre-norm logits
fn extra_rows(wg: u32, li: u32) -> bool {
    if (wg < p.p1) { return false; }
    let e = wg - p.p1;
    let q4 = p.p3;
    let c4 = q4 + p.rows / 4u;
    var acc = 0.0;
    if (e < p.p2) {
        for (var c = li; c < c4; c += 256u) {
            var x: vec4<f32>;
            if (c < q4) { x = act_x[c]; } else { x = fold_h[c - q4]; }
            acc += dot(fold_w[e * c4 + c], x);
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var st = 128u; st > 0u; st >>= 1u) {
        if (li < st) { red[li] += red[li + st]; }
        workgroupBarrier();
    }
    if (li == 0u && e < p.p2) { fold_z[e] = red[0]; }
    return true;
}
";

/// WGSL: `extra_rows` of [`Fused::NormWarm`]: workgroups from p1 = the matrix rows'
/// workgroups on warm another matrix into L2 (kernels/warm.rs) and write nothing else.
fn warm_rows() -> String {
    let (q, s, sink) = super::matvec::WARM_BINDINGS;
    format!(
        "{}
fn extra_rows(wg: u32, li: u32) -> bool {{
    if (wg < p.p1) {{ return false; }}
    warm(wg - p.p1, li);
    return true;
}}
",
        super::warm::wgsl(q, s, sink)
    )
}

/// Input snippet of matvec_q4f.wgsl for `f`, with the staging and product of `bfp` (bfp24) or
/// f32, and for [`Fused::Norm`] in f32 the late-norm form when `late`.
pub(super) fn q4f_input(f: Fused, bfp: bool, late: bool) -> String {
    let (norm, copy, dot) = if bfp {
        (
            format!(
                "{BFP_DOT}{BFP_STAGE}{UNIT_SCALE}{}{}",
                nol_inv_wgsl!(),
                bfp_nol_stage(BFP_NORM_PRE, "nol_h[i] * inv * nol_w[i]")
            ),
            format!(
                "{BFP_DOT}{BFP_STAGE}{UNIT_SCALE}{}",
                bfp_nol_stage("", "act_x[i]")
            ),
            "",
        )
    } else {
        let norm = if late {
            LATE_NORM_ON_LOAD.to_string()
        } else {
            format!("{NORM_ON_LOAD}{UNIT_SCALE}")
        };
        (norm, format!("{COPY_ON_LOAD}{UNIT_SCALE}"), F32_DEQ)
    };
    let stage = |s: &str| format!("{s}{SWIZZLE}{dot}{}", if bfp { "" } else { F32_XBLOCK });
    match f {
        Fused::Norm | Fused::NormWarm => format!(
            "@group(0) @binding(2) var<storage, read> nol_h: array<vec4<f32>>; // [n/4] residual stream
@group(0) @binding(3) var<storage, read> nol_w: array<vec4<f32>>; // [n/4] RMSNorm weight
{}{}
const ACC: bool = false;
",
            stage(&norm),
            if f == Fused::NormWarm {
                warm_rows()
            } else {
                NO_EXTRA_ROWS.to_string()
            }
        ),
        Fused::Router => format!(
            "@group(0) @binding(2) var<storage, read> act_x: array<vec4<f32>>; // [n/4]
{}{ROUTER_ROWS}
const ACC: bool = false;
",
            stage(&copy)
        ),
        _ => format!(
            "@group(0) @binding(2) var<storage, read> act_x: array<vec4<f32>>; // [n/4]
{}{NO_EXTRA_ROWS}
const ACC: bool = {};
",
            stage(&copy),
            f == Fused::Acc
        ),
    }
}

/// Input snippet of matvec_f32.wgsl, norm-on-load or not.
pub(super) fn f32_input(norm: bool) -> String {
    if norm {
        format!(
            "@group(0) @binding(1) var<storage, read> nol_h: array<vec4<f32>>; // [c4] residual stream
@group(0) @binding(5) var<storage, read> nol_w: array<vec4<f32>>; // [c4] RMSNorm weight
@group(0) @binding(6) var<storage, read_write> nol_out: array<vec4<f32>>; // [c4] normalised
{NORM_ON_LOAD}
fn nol_slot(i: u32) -> u32 {{ return i; }}
fn xv(c: u32) -> vec4<f32> {{ return nol_xs[c]; }}
fn nol_publish(wg: u32, li: u32, n4: u32) {{
    if (wg == 0u) {{
        for (var i = li; i < n4; i += 256u) {{ nol_out[i] = nol_xs[i]; }}
    }}
}}
"
        )
    } else {
        "@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>; // [c4]
fn xv(c: u32) -> vec4<f32> { return x[c]; }
fn nol_stage(li: u32, n4: u32, eps: f32) {}
fn nol_publish(wg: u32, li: u32, n4: u32) {}
"
        .to_string()
    }
}

/// WGSL of the bfp24 conversion dispatch ([`super::matvec::BfpQuantKernel`]): one workgroup
/// stages `rmsnorm(h) = h * inv * w` in bfp24 exactly as the norm-on-load bfp24 matvec does
/// (so the same blocks), then writes each block to [`crate::numerics::BfpActs`]' part-major
/// layout. `n <= 4096` (the staging's capacity).
pub(super) fn bfp_quant_wgsl() -> String {
    format!(
        "struct QParams {{ n4: u32, eps: f32, p0: u32, p1: u32 }};
@group(0) @binding(0) var<storage, read> state: State;
@group(0) @binding(1) var<uniform> qp: QParams;
@group(0) @binding(2) var<storage, read> nol_h: array<vec4<f32>>;  // [n/4] residual stream
@group(0) @binding(3) var<storage, read> nol_w: array<vec4<f32>>;  // [n/4] RMSNorm weight
@group(0) @binding(4) var<storage, read_write> act_p: array<vec4<u32>>; // [6, n/32] parts
@group(0) @binding(5) var<storage, read_write> act_r: array<vec2<u32>>; // [n/32] records
{BFP_DOT}{BFP_STAGE}{}{SWIZZLE}{}
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {{
    if (state.done != 0u) {{ return; }}
    nol_stage(li, qp.n4, qp.eps);
    let nb = qp.n4 / 8u;
    for (var b = li; b < nb; b += 256u) {{
        let x = xblock(b);
        act_p[b] = x.p[0];
        act_p[nb + b] = x.p[1];
        act_p[2u * nb + b] = x.p[2];
        act_p[3u * nb + b] = x.p[3];
        act_p[4u * nb + b] = x.p[4];
        act_p[5u * nb + b] = x.p[5];
        act_r[b] = vec2<u32>(bitcast<u32>(x.d), bitcast<u32>(x.q8));
    }}
}}
",
        nol_inv_wgsl!(),
        bfp_nol_stage(BFP_NORM_PRE, "nol_h[i] * inv * nol_w[i]")
    )
}
