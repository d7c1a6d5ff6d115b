//! Tests of the matrix-unit GEMM's WGSL and numerics (gemm_coop.rs): the weight splits replayed
//! on the CPU, every form's shader through naga's validator and SPIR-V writer, and the ignored
//! probes of the cooperative-matrix operations on a device that has them.

use super::*;

/// Run `pipe` as one workgroup writing `n` f32s to binding 0; returns them.
fn run_one_workgroup(
    ctx: &crate::context::Context,
    pipe: &wgpu::ComputePipeline,
    n: usize,
) -> Vec<f32> {
    let out = ctx.storage("out", 4 * n as u64).unwrap();
    let bg = ctx
        .bind_group("coop probe", pipe, &[out.as_entire_binding()])
        .unwrap();
    ctx.run_pass(|p| {
        p.set_pipeline(pipe);
        p.set_bind_group(0, &bg, &[]);
        p.dispatch_workgroups(1, 1, 1);
    })
    .unwrap();
    ctx.read_f32(&out, n).unwrap()
}

/// [`WSTORE_COOP`]'s split, replayed on the CPU for every f16 scale `d` in the range the
/// module doc names (2^-12 <= |d| < 32, and 0) and every nibble: `dh` and `dl` convert to
/// f16 exactly, both f16 products `dh (q - 8)` and `dl (q - 8)` are exact (an f16 multiply
/// rounds the exact product once, as `f16::from_f32` of the f32 product of two f16s does),
/// they sum to `d 2^8 (q - 8)`, and the low part is below 2^-7 of the weight (the bound on
/// the dropped `xl·wl`). The nibble-to-element mapping is not replayed here: the shader
/// itself runs against the f64 reference wherever the device has matrix units (gemm_tests.rs
/// on the H200).
#[test]
fn weight_split_is_exact_for_every_f16_scale() {
    use half::f16;
    // The shader's mask, so that this replay follows it.
    assert!(WSTORE_COOP.contains("bitcast<u32>(d) & 0xFFFF0000u"));
    let mut checked = 0;
    for bits in 0..=u16::MAX {
        let d = f16::from_bits(bits).to_f32();
        if !d.is_finite() || (d != 0.0 && !(2f32.powi(-12)..32.0).contains(&d.abs())) {
            continue;
        }
        let ds = d * 256.0;
        let dh = f32::from_bits(ds.to_bits() & 0xFFFF_0000);
        let dl = ds - dh;
        let (h16, l16) = (f16::from_f32(dh), f16::from_f32(dl));
        assert_eq!((h16.to_f32(), l16.to_f32()), (dh, dl), "d = {d}");
        for q in 0..16u32 {
            // The shader's nibble: the f32 bits 2^23 + q, less 2^23 + 8.
            let qv = f32::from_bits(0x4B00_0000 | q) - 8_388_616.0;
            assert_eq!(qv, q as f32 - 8.0);
            let a = f16::from_f32(h16.to_f32() * qv).to_f32();
            let b = f16::from_f32(l16.to_f32() * qv).to_f32();
            assert_eq!(a, dh * qv, "d = {d}, q = {q}: dh (q - 8) not exact in f16");
            assert_eq!(b, dl * qv, "d = {d}, q = {q}: dl (q - 8) not exact in f16");
            assert_eq!(
                a as f64 + b as f64,
                ds as f64 * qv as f64,
                "d = {d}, q = {q}"
            );
            assert!(
                b == 0.0 || b.abs() < a.abs() / 128.0,
                "d = {d}, q = {q}: wl too large"
            );
        }
        checked += 1;
    }
    // 17 binades of 1024 scales each (2^-12 .. 2^5), both signs, and the two zeros.
    assert_eq!(checked, 2 * 17 * 1024 + 2);
}

/// [`WSTORE_COOP_AFFINE`]'s split, replayed on the CPU over MLX-like groups (bf16 scales
/// 2^-12 .. 2^-1 and biases 2^-10 .. 2^1 of either sign, every level): the high part is an
/// exact f16, the two parts give the scaled weight to 2^-21 of it (2^-32 absolute below
/// f16's normal range), and the low part is below 2^-10 of the weight.
#[test]
fn affine_weight_split_keeps_f32_class() {
    use half::{bf16, f16};
    use rand::Rng;
    assert!(WSTORE_COOP_AFFINE.contains("& vec2<u32>(0xFFFFE000u)"));
    let mut r = crate::testing::rng(41);
    let mut draw = |lo: i32, hi: i32| {
        let v = 2f32.powf(r.random_range(lo as f32..hi as f32));
        let sign = if r.random_bool(0.5) { -1.0 } else { 1.0 };
        bf16::from_f32(sign * v).to_f32()
    };
    for _ in 0..20_000 {
        let (s, b) = (draw(-12, -1), draw(-10, 1));
        for q in 0..16u32 {
            // The oracle's weight (one rounding of an exact product), then the shader's.
            let w = q as f32 * s + b;
            let v = (s * 256.0).mul_add(q as f32, b * 256.0);
            assert_eq!(v, w * 256.0, "s {s} b {b} q {q}");
            let hi = f32::from_bits(v.to_bits() & 0xFFFF_E000);
            let (h16, l16) = (f16::from_f32(hi), f16::from_f32(v - hi));
            let err = (h16.to_f32() as f64 + l16.to_f32() as f64 - v as f64).abs();
            let normal = v.abs() >= 2f32.powi(-14);
            if normal {
                assert_eq!(h16.to_f32(), hi, "s {s} b {b} q {q}: hi not exact");
            }
            let bound = if normal {
                v.abs() as f64 * 2f64.powi(-21)
            } else {
                2f64.powi(-24)
            };
            assert!(err <= bound, "s {s} b {b} q {q}: off by {err}");
            assert!(l16.to_f32().abs() <= v.abs() / 1024.0, "s {s} b {b} q {q}");
        }
    }
}

/// Diagnostic (ignored: needs a device with cooperative matrices, e.g. the H200 through
/// `NIBBLE_TEST_ADAPTER=nvidia`): one subgroup checks the matrix operations this kernel uses
/// one by one against what they must give: a zero-constructed accumulator stored, one loaded
/// from zeroed shared memory, and A x I + 0 with A column-major and I row-major in shared
/// memory (f16), each accumulator started both ways. Prints the first mismatches.
#[test]
#[ignore]
fn coop_probe() {
    let Some(ctx) = crate::testing::gpu("coop_probe") else {
        return;
    };
    if !supported(&ctx) {
        eprintln!("coop_probe: no 16x16x16 f16 cooperative matrices on this device");
        return;
    }
    let src = "enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> out: array<f32>; // [4 * 256]
var<workgroup> a: array<f16, 16u * 24u>;
var<workgroup> b: array<f16, 16u * 24u>;
var<workgroup> z: array<f32, 256u>;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) li: u32) {
for (var j = 0u; j < 8u; j++) {
    let e = li + 32u * j;
    z[e] = 0.0;
    let r = e / 16u;
    let c = e % 16u;
    // A(m = c, k = r) stored column-major (column k contiguous over m), stride 24.
    a[r * 24u + c] = f16(f32(r * 16u + c) * 0.25 - 20.0);
    // I(k = r, n = c) row-major, stride 24.
    b[r * 24u + c] = select(f16(0.0), f16(1.0), r == c);
}
workgroupBarrier();
let c0 = coop_mat16x16<f32, C>();
let cz = coopLoad<coop_mat16x16<f32, C>>(&z[0], 16u);
let am = coopLoad<coop_mat16x16<f16, A>>(&a[0], 24u);
let bm = coopLoadT<coop_mat16x16<f16, B>>(&b[0], 24u);
let p0 = coopMultiplyAdd(am, bm, c0);
let pz = coopMultiplyAdd(am, bm, cz);
coopStoreT(c0, &out[0], 16u);
coopStoreT(cz, &out[256], 16u);
coopStoreT(p0, &out[512], 16u);
coopStoreT(pz, &out[768], 16u);
}
";
    let pipe = ctx.compute("coop_probe", src, "main").unwrap();
    let got = run_one_workgroup(&ctx, &pipe, 1024);
    let mut bad = 0;
    for (part, name) in ["zero ctor", "zero load", "A x I + ctor", "A x I + load"]
        .iter()
        .enumerate()
    {
        let mut first = Vec::new();
        for e in 0..256 {
            // Row-major store: element (m, n) at m * 16 + n; A(m, k) = (k * 16 + m) / 4 - 20.
            let (m, n) = (e / 16, e % 16);
            let want = if part < 2 {
                0.0
            } else {
                (n * 16 + m) as f32 * 0.25 - 20.0
            };
            let g = got[part * 256 + e];
            if g != want && first.len() < 4 {
                first.push(format!("({m},{n}) got {g} want {want}"));
            }
        }
        eprintln!(
            "coop_probe {name}: {}",
            if first.is_empty() {
                "ok".into()
            } else {
                first.join("; ")
            }
        );
        bad += first.len();
    }
    assert_eq!(
        bad, 0,
        "cooperative-matrix operations disagree with their definitions"
    );
}

/// Diagnostic (ignored; a device with cooperative matrices): the kernel's own tile split
/// with known small integers: 8 subgroups of a 256-wide workgroup, each two 16 x 16 output
/// tiles from X^T and W^T staged at the kernel's strides and offsets, accumulated over two
/// k steps in loop-carried variables, in four variants (subgroup ids from the builtin or
/// from `li / 32`; two staging arrays, or the kernel's four with its 3 products each).
#[test]
#[ignore]
fn coop_probe_tiles() {
    let Some(ctx) = crate::testing::gpu("coop_probe_tiles") else {
        return;
    };
    let tmpl = "enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> out: array<f32>; // [4096 + 256]
const SX: u32 = 40u;
const SW: u32 = 136u;
var<workgroup> xh: array<f16, 32u * SX>;
var<workgroup> wh: array<f16, 32u * SW>;
//LO_DECL
var<workgroup> cs: array<f32, 4096u>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sgb: u32,
    @builtin(subgroup_invocation_id) laneb: u32) {
let sg = SG_EXPR;
let lane = LANE_EXPR;
for (var i = li; i < 32u * SX; i += 256u) {
    xh[i] = f16(f32(((i / SX) * 7u + (i % SX) * 3u) % 17u) - 8.0);
    //LO_X
}
for (var i = li; i < 32u * SW; i += 256u) {
    wh[i] = f16(f32(((i / SW) * 5u + (i % SW) * 11u) % 13u) - 6.0);
    //LO_W
}
for (var j = 0u; j < 16u; j++) {
    cs[sg * 512u + lane + 32u * j] = 0.0;
}
workgroupBarrier();
let ti = sg % 2u;
let g = sg / 2u;
var ca = coopLoad<coop_mat16x16<f32, C>>(&cs[sg * 512u], 16u);
var cb = coopLoad<coop_mat16x16<f32, C>>(&cs[sg * 512u], 16u);
for (var kk = 0u; kk < 32u; kk += 16u) {
    let ah = coopLoad<coop_mat16x16<f16, A>>(&xh[kk * SX + 16u * ti], SX);
    let ba = coopLoadT<coop_mat16x16<f16, B>>(&wh[kk * SW + 16u * g], SW);
    ca = coopMultiplyAdd(ah, ba, ca);
    let bb = coopLoadT<coop_mat16x16<f16, B>>(&wh[kk * SW + 16u * (g + 4u)], SW);
    cb = coopMultiplyAdd(ah, bb, cb);
    //LO_MMA
}
workgroupBarrier();
coopStoreT(ca, &cs[sg * 512u], 16u);
coopStoreT(cb, &cs[sg * 512u + 256u], 16u);
workgroupBarrier();
for (var j = 0u; j < 16u; j++) {
    out[sg * 512u + lane + 32u * j] = cs[sg * 512u + lane + 32u * j];
}
out[4096u + li] = f32(sgb * 32u + laneb);
}
";
    let lo_decl =
        "var<workgroup> xl: array<f16, 32u * SX>;\nvar<workgroup> wl: array<f16, 32u * SW>;";
    let lo_mma = "let al = coopLoad<coop_mat16x16<f16, A>>(&xl[kk * SX + 16u * ti], SX);
    let bla = coopLoadT<coop_mat16x16<f16, B>>(&wl[kk * SW + 16u * g], SW);
    ca = coopMultiplyAdd(al, ba, ca);
    ca = coopMultiplyAdd(ah, bla, ca);
    let blb = coopLoadT<coop_mat16x16<f16, B>>(&wl[kk * SW + 16u * (g + 4u)], SW);
    cb = coopMultiplyAdd(al, bb, cb);
    cb = coopMultiplyAdd(ah, blb, cb);";
    // CPU: X^T(k, m), W^T(k, n) as the shader fills them.
    let xt = |k: usize, m: usize| ((k * 7 + m * 3) % 17) as f32 - 8.0;
    let wt = |k: usize, n: usize| ((k * 5 + n * 11) % 13) as f32 - 6.0;
    let mut failed = 0;
    for (name, sg, lane, lo) in [
        ("builtin ids, 2 arrays", "sgb", "laneb", false),
        ("li / 32, 2 arrays", "li / 32u", "li % 32u", false),
        ("builtin ids, 4 arrays", "sgb", "laneb", true),
        ("li / 32, 4 arrays", "li / 32u", "li % 32u", true),
    ] {
        let mut src = tmpl.replace("SG_EXPR", sg).replace("LANE_EXPR", lane);
        if lo {
            src = src
                .replace("//LO_DECL", lo_decl)
                .replace("//LO_X", "xl[i] = f16(0.0);")
                .replace("//LO_W", "wl[i] = f16(0.0);")
                .replace("//LO_MMA", lo_mma);
        }
        let module = wgpu::naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
        wgpu::naga::valid::Validator::new(
            wgpu::naga::valid::ValidationFlags::all(),
            wgpu::naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
        if !supported(&ctx) {
            continue;
        }
        let pipe = match ctx.compute("coop_probe_tiles", &src, "main") {
            Ok(p) => p,
            Err(e) => {
                eprintln!("coop_probe_tiles {name}: pipeline error {e}");
                failed += 1;
                continue;
            }
        };
        let got = run_one_workgroup(&ctx, &pipe, 4096 + 256);
        let mut first = Vec::new();
        let mut bad = 0;
        for sgi in 0..8 {
            let (ti, g) = (sgi % 2, sgi / 2);
            for (half, nt) in [(0, g), (1, g + 4)] {
                for e in 0..256 {
                    let (m, n) = (16 * ti + e / 16, 16 * nt + e % 16);
                    let want: f32 = (0..32).map(|k| xt(k, m) * wt(k, n)).sum();
                    let v = got[sgi * 512 + half * 256 + e];
                    if v != want {
                        bad += 1;
                        if first.len() < 3 {
                            first.push(format!("sg {sgi} tile {nt} ({m},{n}): {v} vs {want}"));
                        }
                    }
                }
            }
        }
        let ids: Vec<u32> = got[4096..4096 + 40].iter().map(|v| *v as u32).collect();
        eprintln!(
            "coop_probe_tiles {name}: {bad} of 4096 wrong {}; sg*32+lane of li 0..40: {ids:?}",
            first.join("; ")
        );
        failed += (bad > 0) as usize;
    }
    assert_eq!(failed, 0);
}

/// Every form and tile height parses and validates with naga (the device-free half of the
/// check: lavapipe has no cooperative matrices, so the numbers are tested on devices that
/// do, by the same tests as the f32 kernel).
#[test]
fn coop_shaders_validate() {
    use wgpu::naga;
    let pl = PlanLayout {
        k: 8,
        off: 1,
        tiles: 130,
        list: 400,
    };
    for form in [
        GemmForm::Dense,
        GemmForm::DenseAcc,
        GemmForm::GateUp,
        GemmForm::Down,
    ] {
        for (tm, dbuf, affine) in [(2, false), (4, false), (2, true)]
            .into_iter()
            .flat_map(|(tm, d)| [(tm, d, false), (tm, d, true)])
        {
            let plan = matches!(form, GemmForm::GateUp | GemmForm::Down).then_some(pl);
            let src = shader(form, tm, plan, dbuf, affine);
            let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
                panic!(
                    "{form:?} tm{tm} dbuf {dbuf} affine {affine}: {}",
                    e.emit_to_string(&src)
                )
            });
            let info = naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            .unwrap_or_else(|e| {
                panic!(
                    "{form:?} tm{tm} dbuf {dbuf} affine {affine}: {}",
                    e.emit_to_string(&src)
                )
            });
            // The Vulkan backend's translation (what the device's compiler will see).
            let opts = naga::back::spv::Options {
                lang_version: (1, 3),
                ..Default::default()
            };
            let words = naga::back::spv::write_vec(&module, &info, &opts, None)
                .unwrap_or_else(|e| panic!("{form:?} tm{tm} dbuf {dbuf}: SPIR-V: {e}"));
            assert!(
                words.len() > 100,
                "{form:?} tm{tm} dbuf {dbuf}: {} words",
                words.len()
            );
            if let Ok(dir) = std::env::var("NIBBLE_DUMP_SPV") {
                std::fs::write(
                    format!("{dir}/gemm_coop_{form:?}_tm{tm}_db{dbuf}_a{affine}.wgsl"),
                    &src,
                )
                .expect("write WGSL dump");
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                let path = format!("{dir}/gemm_coop_{form:?}_tm{tm}_db{dbuf}_a{affine}.spv");
                std::fs::write(&path, bytes).expect("write SPIR-V dump");
            }
        }
    }
}
