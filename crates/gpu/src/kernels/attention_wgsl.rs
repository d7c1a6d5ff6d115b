//! WGSL text of the attention kernels that the host writes out (attention.rs builds the
//! pipelines): WGSL constants, and the chunk module (attention.wgsl plus the form's body) with
//! its per-load lines written out (the tiled body's `stage` and first-tile prefetch, the
//! streamed body's key blocks, V batches and per-head accumulators), so a thread's loads and
//! sums live in separate variables.

use super::AttnForm;

/// The KV cache's element type and its conversions in WGSL, for every module that binds a
/// cache (`k_cache` / `v_cache` are `array<KV>`, one element per four values of a row):
/// `kv_in` reads an element as f32s, `kv_out` makes one from f32s, `kv_round(x)` is
/// `kv_in(kv_out(x))`, the value a cache row holds for x (a row written and substituted in the
/// same dispatch goes through it, so it reads as if loaded). f16 packs two halves per u32 with
/// `pack2x16float` after clamping to ±65504 (beyond it the pack is undefined). WGSL leaves the
/// rounding to the implementation; the kernel tests compare written v rows bit for bit with
/// `CacheType::round` (nearest even) on lavapipe, and the full-size model's greedy ids matched
/// the f16 oracle's on NVIDIA (BENCHMARKS run 171); Metal is unchecked.
pub(crate) fn kv_wgsl(t: nibble_model::kv_cache::CacheType) -> String {
    use nibble_model::kv_cache::{CacheType, F16_MAX};
    match t {
        CacheType::F32 => "alias KV = vec4<f32>;
fn kv_in(x: KV) -> vec4<f32> { return x; }
fn kv_out(x: vec4<f32>) -> KV { return x; }
fn kv_round(x: vec4<f32>) -> vec4<f32> { return x; }
"
        .to_string(),
        CacheType::F16 => format!(
            "alias KV = vec2<u32>;
fn kv_in(x: KV) -> vec4<f32> {{ return vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)); }}
fn kv_out(x: vec4<f32>) -> KV {{
    let c = clamp(x, vec4<f32>(-{F16_MAX:e}), vec4<f32>({F16_MAX:e}));
    return vec2<u32>(pack2x16float(c.xy), pack2x16float(c.zw));
}}
fn kv_round(x: vec4<f32>) -> vec4<f32> {{ return kv_in(kv_out(x)); }}
"
        ),
    }
}

pub(super) fn u32_const(name: &str, v: u32) -> String {
    format!("const {name}: u32 = {v}u;\n")
}

/// An f32 WGSL constant written so that it parses back to exactly `v` (shortest round-trip
/// decimal, always with an exponent so it is a float literal).
pub(super) fn f32_const(name: &str, v: f32) -> String {
    format!("const {name}: f32 = {v:e};\n")
}

/// The chunk module's body for `form`: attention.wgsl (bindings, entry points, fused combine)
/// followed by the form's `attend` with its per-load (and, streamed, per-head) lines written out,
/// and the form's own constants. `p` rows per tile / key block, `d4` = D/4, `wg` threads, `g`
/// query heads per kv head, `v_rows` V rows per thread per batch (streamed only).
pub(super) fn chunk_body(form: AttnForm, p: u32, d4: u32, wg: u32, g: u32, v_rows: u32) -> String {
    let common = include_str!("../shaders/attention.wgsl");
    match form {
        AttnForm::Tiles => format!("{common}{}", tiles_body((p * d4).div_ceil(wg))),
        AttnForm::Stream => format!("{common}{}", stream_body(p, d4, wg, g, v_rows)),
    }
}

/// Shared-memory vec4s of the streamed body's `tile`: a key block of `p` rows (stride D4 + 1) or
/// the V partials of one reduction round (at least one head's TS x D4).
pub(super) fn stream_tile_vec4s(p: u32, d4: u32, wg: u32) -> u32 {
    (p * (d4 + 1)).max((wg / d4).max(1) * d4)
}

/// attention_tiles.wgsl with `stage`'s per-load lines written out for `lpt` loads per thread: all
/// the loads (element e = li + j WG of the tile: row e / D4, vec4 e % D4), then all the stores;
/// and likewise the fields, loads and stores of the first tile's prefetch (`Pre`: K and V).
fn tiles_body(lpt: u32) -> String {
    let (mut loads, mut stores) = (String::new(), String::new());
    for j in 0..lpt {
        loads += &format!(
            "let e{j} = li + {j}u * WG;
    let r{j} = e{j} / D4;
    let s{j} = ((s.row0 + t0 + r{j}) * HKV + h) * D4 + e{j} % D4;
    var a{j} = vec4<f32>(0.0);
    if (e{j} < n) {{
        if (is_v) {{
            if (t0 + r{j} == own) {{ a{j} = kv_round(qkv[vb + e{j} % D4]); }} else {{ a{j} = kv_in(v_cache[s{j}]); }}
        }} else {{
            if (t0 + r{j} == own) {{ a{j} = kown[e{j} % D4]; }} else {{ a{j} = kv_in(k_cache[s{j}]); }}
        }}
    }}
    "
        );
        stores += &format!("if (e{j} < n) {{ tile[r{j} * DP + e{j} % D4] = a{j}; }}\n    ");
    }
    let (mut fields, mut pre_loads, mut pre_stores) = (String::new(), String::new(), String::new());
    for j in 0..lpt {
        fields += &format!("k{j}: vec4<f32>, v{j}: vec4<f32>,\n    ");
        pre_loads += &format!(
            "let e{j} = li + {j}u * WG;
    let r{j} = e{j} / D4;
    if (e{j} < n) {{
        if (t0 + r{j} == own) {{
            p.v{j} = kv_round(qkv[vb + e{j} % D4]);
        }} else {{
            let s{j} = ((s.row0 + t0 + r{j}) * HKV + h) * D4 + e{j} % D4;
            p.k{j} = kv_in(k_cache[s{j}]);
            p.v{j} = kv_in(v_cache[s{j}]);
        }}
    }}
    "
        );
        pre_stores += &format!(
            "let e{j} = li + {j}u * WG;
    let r{j} = e{j} / D4;
    if (e{j} < n) {{
        var a{j} = select(p.k{j}, p.v{j}, is_v);
        if (!is_v && t0 + r{j} == own) {{ a{j} = kown[e{j} % D4]; }}
        tile[r{j} * DP + e{j} % D4] = a{j};
    }}
    "
        );
    }
    include_str!("../shaders/attention_tiles.wgsl")
        .replace("//STAGE_LOADS", &loads)
        .replace("//STAGE_STORES", &stores)
        .replace("//PRE_FIELDS", &fields)
        .replace("//PRE_LOADS", &pre_loads)
        .replace("//PRE_STORES", &pre_stores)
}

/// attention_stream.wgsl with its constants and written-out lines for `p` key rows per block
/// (LK = ceil(p D4 / WG) loads per thread), TS = WG / D4 V lanes of `v_rows` rows per batch, and
/// `g` heads: the key block's fields, loads and stores, the V batch's fields, loads and
/// per-(row, head) fmas into `acc{g}`, the score row's GH heads and the reduction rounds.
fn stream_body(p: u32, d4: u32, wg: u32, g: u32, v_rows: u32) -> String {
    let lk = (p * d4).div_ceil(wg);
    let ts = (wg / d4).max(1);
    let sgn = (wg / p).max(1);
    let gh = g.div_ceil(sgn);
    let tile_n = stream_tile_vec4s(p, d4, wg);
    let gr = (tile_n / (ts * d4)).clamp(1, g);
    let consts = [
        u32_const("LK", lk),
        u32_const("TS", ts),
        u32_const("LV", v_rows),
        u32_const("SGN", sgn),
        u32_const("GH", gh),
        u32_const("GR", gr),
        u32_const("TILE_N", tile_n),
    ]
    .concat();
    let w = |f: &mut String, line: String| {
        f.push_str(&line);
        f.push_str("\n    ");
    };
    let (mut kf, mut kl, mut ks) = (String::new(), String::new(), String::new());
    for j in 0..lk {
        w(&mut kf, format!("k{j}: vec4<f32>,"));
        w(
            &mut kl,
            format!(
                "let e{j} = li + {j}u * WG;
    if (e{j} < n && t0 + e{j} / D4 != own) {{
        b.k{j} = kv_in(k_cache[((s.row0 + t0 + e{j} / D4) * HKV + h) * D4 + e{j} % D4]);
    }}"
            ),
        );
        w(
            &mut ks,
            format!(
                "let e{j} = li + {j}u * WG;
    if (e{j} < n) {{
        var a{j} = b.k{j};
        if (t0 + e{j} / D4 == own) {{ a{j} = kown[e{j} % D4]; }}
        tile[(e{j} / D4) * DP + e{j} % D4] = a{j};
    }}"
            ),
        );
    }
    let (mut vf, mut vl, mut va) = (String::new(), String::new(), String::new());
    for j in 0..v_rows {
        w(&mut vf, format!("v{j}: vec4<f32>,"));
        w(
            &mut vl,
            format!(
                "let r{j} = base + vt + {j}u * TS;
    if (r{j} < len) {{
        if (t0 + r{j} == own) {{
            b.v{j} = kv_round(qkv[vb + vd]);
        }} else {{
            b.v{j} = kv_in(v_cache[((s.row0 + t0 + r{j}) * HKV + h) * D4 + vd]);
        }}
    }}"
            ),
        );
        let fmas: String = (0..g)
            .map(|k| {
                format!(
                    "\n                    acc{k} = fma(vec4<f32>(sc[{k}u * CMAX + r]), cur.v{j}, acc{k});"
                )
            })
            .collect();
        va.push_str(&format!(
            "{{
                let r = base + vt + {j}u * TS;
                if (r < len) {{{fmas}
                }}
            }}
            "
        ));
    }
    let decl: String = (0..g)
        .map(|k| format!("var acc{k} = vec4<f32>(0.0);\n    "))
        .collect();
    let mut rounds = String::new();
    for g0 in (0..g).step_by(gr as usize) {
        let puts: String = (g0..(g0 + gr).min(g))
            .map(|k| {
                format!(
                    "\n        tile[(vt * GR + {j}u) * D4 + vd] = acc{k};",
                    j = k - g0
                )
            })
            .collect();
        rounds.push_str(&format!(
            "workgroupBarrier();
    if (vlive) {{{puts}
    }}
    workgroupBarrier();
    reduce_round({g0}u, s, h, c, li, single);
    "
        ));
    }
    let mut score = String::new();
    for j in 0..gh {
        w(
            &mut score,
            format!("var a{j} = vec4<f32>(0.0);\n    let q{j} = min(g0 + {j}u, G - 1u) * D4;"),
        );
    }
    let dots: String = (0..gh)
        .map(|j| format!("\n        a{j} = fma(qs[q{j} + d], k, a{j});"))
        .collect();
    score.push_str(&format!(
        "for (var d = 0u; d < D4; d++) {{
        let k = tile[t * DP + d];{dots}
    }}
    "
    ));
    for j in 0..gh {
        w(
            &mut score,
            format!(
                "if (g0 + {j}u < G) {{ sc[(g0 + {j}u) * CMAX + tt + t] = (a{j}.x + a{j}.y) + (a{j}.z + a{j}.w); }}"
            ),
        );
    }
    let body = include_str!("../shaders/attention_stream.wgsl")
        .replace("//KB_FIELDS", &kf)
        .replace("//KB_LOADS", &kl)
        .replace("//KB_STORES", &ks)
        .replace("//VB_FIELDS", &vf)
        .replace("//VB_LOADS", &vl)
        .replace("//VB_ACC", &va)
        .replace("//ACC_DECL", &decl)
        .replace("//ACC_ROUNDS", &rounds)
        .replace("//SCORE_ROW", &score);
    format!("{consts}{body}")
}
