//! WGSL text of the attention kernels that the host writes out (attention.rs builds the
//! pipelines): WGSL constants, and attention.wgsl with `stage`'s and the first tile's prefetch
//! lines expanded per load, so a thread's loads live in separate variables.

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

/// attention.wgsl with `stage`'s per-load lines written out for `lpt` loads per thread: all the
/// loads (element e = li + j WG of the tile: row e / D4, vec4 e % D4), then all the stores; and
/// likewise the fields, loads and stores of the first tile's prefetch (`Pre`: K and V).
pub(super) fn stage_body(lpt: u32) -> String {
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
    include_str!("../shaders/attention.wgsl")
        .replace("//STAGE_LOADS", &loads)
        .replace("//STAGE_STORES", &stores)
        .replace("//PRE_FIELDS", &fields)
        .replace("//PRE_LOADS", &pre_loads)
        .replace("//PRE_STORES", &pre_stores)
}
