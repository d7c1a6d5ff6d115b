//! WGSL text of the attention kernels that the host writes out (attention.rs builds the
//! pipelines): WGSL constants, and attention.wgsl with `stage`'s and the first tile's prefetch
//! lines expanded per load, so a thread's loads live in separate variables.

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
            if (t0 + r{j} == own) {{ a{j} = qkv[vb + e{j} % D4]; }} else {{ a{j} = v_cache[s{j}]; }}
        }} else {{
            if (t0 + r{j} == own) {{ a{j} = kown[e{j} % D4]; }} else {{ a{j} = k_cache[s{j}]; }}
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
            p.v{j} = qkv[vb + e{j} % D4];
        }} else {{
            let s{j} = ((s.row0 + t0 + r{j}) * HKV + h) * D4 + e{j} % D4;
            p.k{j} = k_cache[s{j}];
            p.v{j} = v_cache[s{j}];
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
