//! The cross-workgroup publication that the fused kernels rely on (attention.wgsl's fused
//! combine, moe_down_f32.wgsl's slot groups): every workgroup writes its part, `storageBarrier`,
//! counts itself in an atomic; the one that counts last reads every part. Checked here alone,
//! over many dispatches, on the test adapter (lavapipe in CI, any GPU with NIBBLE_TEST_ADAPTER).
//!
//! A spin-wait variant of the same publication (consumer workgroups that wait on the count
//! instead of being the last to arrive) failed this kind of check on lavapipe (2026-11-30, the
//! chained MoE experiment, docs/BENCHMARKS.md run 47): the kernels use only the last-arriver form.

use crate::testing::gpu;

/// Producers' values: a chain of 200 LCG steps from `(round + t + li)`, so each part takes a
/// while and workgroups overlap.
fn value(round: u32, t: u32, li: u32) -> u32 {
    let mut x = round.wrapping_add(t).wrapping_add(li);
    for _ in 0..200 {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
    }
    x
}

#[test]
fn last_arriver_sees_every_workgroups_part() {
    let Some(ctx) = gpu("last_arriver_sees_every_workgroups_part") else {
        return;
    };
    let p = 64u32;
    let src = format!(
        r#"
const P: u32 = {p}u;
@group(0) @binding(0) var<storage, read_write> arrive: array<atomic<u32>, 1>;
@group(0) @binding(1) var<storage, read_write> data: array<u32>; // [P, 256]
@group(0) @binding(2) var<storage, read_write> out: array<u32>;  // [1]
@group(0) @binding(3) var<storage, read> round: array<u32>;      // [1]
var<workgroup> last: u32;
var<workgroup> red: array<u32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    var x = round[0] + wid.x + li;
    for (var i = 0u; i < 200u; i++) {{
        x = x * 1664525u + 1013904223u;
    }}
    data[wid.x * 256u + li] = x;
    storageBarrier();
    if (li == 0u) {{
        last = u32(atomicAdd(&arrive[0], 1u) + 1u == P);
    }}
    if (workgroupUniformLoad(&last) == 0u) {{
        return;
    }}
    storageBarrier();
    var s = 0u;
    for (var i = li; i < P * 256u; i += 256u) {{
        s += data[i];
    }}
    red[li] = s;
    workgroupBarrier();
    if (li == 0u) {{
        var tot = 0u;
        for (var i = 0u; i < 256u; i++) {{
            tot += red[i];
        }}
        out[0] = tot;
        atomicStore(&arrive[0], 0u);
    }}
}}
"#
    );
    let pipe = ctx.compute("ordering", &src, "main").unwrap();
    let arrive = ctx.storage("arrive", 4).unwrap();
    let data = ctx.storage("data", p as u64 * 256 * 4).unwrap();
    let out = ctx.storage("out", 4).unwrap();
    let mut wrong = Vec::new();
    for r in 0..100u32 {
        let round = ctx.storage_init("round", bytemuck::bytes_of(&r)).unwrap();
        let bg = ctx
            .bind_group(
                "ordering",
                &pipe,
                &[
                    arrive.as_entire_binding(),
                    data.as_entire_binding(),
                    out.as_entire_binding(),
                    round.as_entire_binding(),
                ],
            )
            .unwrap();
        ctx.run_pass(|pass| {
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(p, 1, 1);
        })
        .unwrap();
        let want = (0..p)
            .flat_map(|t| (0..256).map(move |li| value(r, t, li)))
            .fold(0u32, u32::wrapping_add);
        if ctx.read_u32(&out, 1).unwrap()[0] != want {
            wrong.push(r);
        }
    }
    assert!(wrong.is_empty(), "rounds with a stale part: {wrong:?}");
    assert_eq!(ctx.read_u32(&arrive, 1).unwrap(), [0], "counter not reset");
}
