//! The staged f32 MoE kernels' work split ([`F32Tuning`]) and the host side of their sources:
//! workgroup-memory sizes, the down kernel's slot-group scratch, and moe_down_f32.wgsl with its
//! per-item lines written out.

use super::{MoeParams, WG};
use crate::context::{Context, GpuError, Result};
use crate::tensor::{QForm, BLOCK};

/// Work split of the staged f32 kernels: tuning knobs for a GPU (the tests cover every value).
/// Fewer lanes per row, or more rows per team, means fewer, longer-running workgroups with more
/// weight loads in flight per lane and less staging repeated across workgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct F32Tuning {
    /// Lanes per gate/up row (power of two, 8..=256): grid `(I / (256 / lanes), K)`; 16 = 384
    /// workgroups at the real shape, ~3 per H200 SM, 8 weight loads in flight per lane.
    pub gate_up_lanes: u32,
    /// Gate/up rows per team of lanes (1 or 2): each staged activation block a lane reads
    /// serves this many rows' gate and up blocks (less shared-memory traffic per weight byte,
    /// half the workgroups at 2). Falls back to 1 where I is not a multiple of the rows per
    /// workgroup.
    pub gate_up_rows: u32,
    /// Lanes per down row (power of two, 8..=256).
    pub down_lanes: u32,
    /// Down rows per team of lanes (1, 2 or 4; per-row lines written out as separate
    /// variables): grid `ceil(H / (256 / lanes * rows))`. Each workgroup stages all of h
    /// (24 KiB at the real shape, 6 MB of L2 reads per call at 32 lanes x 1 row), which more
    /// rows per team divide.
    pub down_rows: u32,
    /// Down slot groups (1, 2, 4 or 8; the kernel uses the largest power of two up to it that
    /// divides K): each row block's K slots are split over this many workgroups, the last of
    /// which adds their sums (moe_down_f32.wgsl). More than 1 needs cross-workgroup memory
    /// ordering: Vulkan only ([`F32Tuning::for_context`]).
    pub down_split: u32,
    /// [`F32Tuning::down_split`] for a down matrix of a byte form ([`QForm::wide`]: Q5_K, Q6_K,
    /// Q8_0, MLX 8-bit), whose dot costs more ALU per weight byte, so that more and shorter
    /// workgroups pay: 8. Runs 155-156 (H100, tg128 against 4 for every form): `Q5_K_M` (Q5_K
    /// downs, Q6_K in half the layers) +4.3%, `Q4_K_M` +0.4%; 8 for the nibble forms too lost
    /// 0.5% on pure Q4_K (and 2.1% on Q4_0 in run 42), so those keep 4. Pure Q6_K and Q8_0
    /// files at 8 are not measured.
    pub down_split_wide: u32,
    /// The folded gate/up (`gate_up_folded`) stages `(h + a) ⊙ w` and multiplies each row's
    /// gate and up sums by `1 / rms(h + a)` instead of normalising the staged input before its
    /// weight loads (`LATE_NORM` in moe_gate_up_f32.wgsl). A form, not a split; the default
    /// since runs 64-65 (tg128 +0.1-0.9% side by side on the H200, parity PASS).
    pub late_norm: bool,
}

impl F32Tuning {
    /// Measured on the H200 (`kernel_bench --moe-tunings`, docs/runs/2026-11-29-h200-run9.txt,
    /// real shapes, us per call): gate/up lanes 8/16/32/64 -> 22.3/**20.3**/31.8/50.2; down
    /// lanes x rows 8x1 12.1, 8x2 33.9, **16x1 9.8**, 16x2 11.8, 32x1 13.3, 32x2 10.3, 64x1 23.3,
    /// 64x2 15.6 (x4 does not fit the staging budget: unstaged, 18.7).
    pub const DEFAULT: F32Tuning = F32Tuning {
        gate_up_lanes: 16,
        gate_up_rows: 1,
        down_lanes: 16,
        down_rows: 1,
        down_split: 4,
        down_split_wide: 8,
        late_norm: true,
    };

    /// [`F32Tuning::DEFAULT`] for `ctx`'s backend: the down slot groups only where workgroups
    /// can publish to each other ([`Context::publishes_across_workgroups`]: Vulkan; Metal's and
    /// D3D's barrier translations promise no memory ordering across workgroups).
    pub fn for_context(ctx: &Context) -> F32Tuning {
        let groups = |d: u32| {
            if ctx.publishes_across_workgroups() {
                d
            } else {
                1
            }
        };
        F32Tuning {
            down_split: groups(F32Tuning::DEFAULT.down_split),
            down_split_wide: groups(F32Tuning::DEFAULT.down_split_wide),
            ..F32Tuning::DEFAULT
        }
    }

    /// [`F32Tuning::for_context`] for the MoE shapes `p`: 8 lanes per gate/up row where its H
    /// / 32 blocks are fewer than 16, and per down row where a slot's I / 32 are (the small
    /// synthetic models; the real ones have 64 and 24). A lane strides a row's blocks, so
    /// past the blocks lanes idle, and lavapipe, a CPU, pays for idle lanes: the small
    /// `Q4_K_M` model decoded about a third faster there at 8 lanes for both.
    pub fn for_shapes(ctx: &Context, p: &MoeParams) -> F32Tuning {
        let t = F32Tuning::for_context(ctx);
        let lanes = |blocks: u32, d: u32| if blocks < 16 { 8 } else { d };
        F32Tuning {
            gate_up_lanes: lanes(p.hidden / BLOCK as u32, t.gate_up_lanes),
            down_lanes: lanes(p.inter / BLOCK as u32, t.down_lanes),
            ..t
        }
    }

    pub(super) fn validate(&self) -> Result<()> {
        let ok = |t: u32| t.is_power_of_two() && (8..=WG).contains(&t);
        if !ok(self.gate_up_lanes)
            || !ok(self.down_lanes)
            || ![1, 2].contains(&self.gate_up_rows)
            || ![1, 2, 4].contains(&self.down_rows)
            || ![1, 2, 4, 8].contains(&self.down_split)
            || ![1, 2, 4, 8].contains(&self.down_split_wide)
        {
            return Err(GpuError::Shape(format!(
                "MoE {self:?}: lanes per row must be powers of two in 8..={WG}, gate/up rows per \
                 team 1 or 2, down rows per team 1, 2 or 4, down slot groups 1, 2, 4 or 8"
            )));
        }
        Ok(())
    }

    /// The slot groups the down kernel uses for `k` slots of a down matrix in `form`: the
    /// largest power of two up to `down_split` (`down_split_wide` for a byte form) that
    /// divides `k`.
    pub(super) fn split_for(&self, form: QForm, k: u32) -> u32 {
        let mut d = if form.wide() {
            self.down_split_wide
        } else {
            self.down_split
        };
        while k % d != 0 {
            d /= 2;
        }
        d
    }
}

impl Default for F32Tuning {
    fn default() -> Self {
        F32Tuning::DEFAULT
    }
}

/// Workgroup bytes of moe_gate_up_f32.wgsl at `rg` rows per team: xs `[H]`, xsum_s `[H/32]`,
/// lg `[E]`, top_e `[K]`, red_g and red_u `[rg, WG + WG / 8]` (bank-spread partials), slot_e;
/// the column union form's col_rank and users `[8]`, n_users.
pub(super) fn gate_up_f32_shared(p: &MoeParams, rg: u32) -> u64 {
    let red = 2 * (rg * (WG + WG / 8)) as u64;
    let xsum = p.hidden as u64 / BLOCK as u64;
    (p.hidden as u64 + xsum + p.experts as u64 + p.top_k as u64 + red + 1 + 17) * 4
}

/// Workgroup bytes of moe_down_f32.wgsl at `t` lanes per row, `rt` rows per team and `ds` slot
/// groups: xs `[K/ds*I]`, the affine forms' block sums `[K/ds*I/32]`, red `[WG/t*rt, t+1]`
/// (bank-spread partials), ids and wts `[K/ds]`, dlast.
pub(super) fn down_f32_shared(p: &MoeParams, t: u32, rt: u32, ds: u32) -> u64 {
    let ks = (p.top_k / ds) as u64;
    // xs, then the affine forms' block sums (counted for every form: a bound, not exact).
    let xsum = ks * p.inter as u64 / BLOCK as u64;
    (ks * p.inter as u64 + xsum + (WG / t * rt * (t + 1)) as u64 + 2 * ks + 1) * 4
}

/// Bytes of the down slot groups' scratch for `ds` groups of `nrb` row blocks over up to 8
/// columns: (group sums, arrival counters); one word each for `ds = 1`, where the kernel's
/// constant branch never touches them.
pub(super) fn down_scratch_bytes(p: &MoeParams, ds: u32, nrb: u32) -> (u64, u64) {
    if ds == 1 {
        return (4, 4);
    }
    let cols = crate::columns::MAX_COLUMNS as u64;
    (cols * (ds * p.hidden) as u64 * 4, cols * nrb as u64 * 4)
}

/// moe_down_f32.wgsl's staging of the group's h slots for the non-affine forms: one vec4 per
/// thread and pass, consecutive threads on consecutive vec4s; slots the part does not hold
/// are zeros.
const STAGE_VEC4S: &str = "for (var i = li; i < KSNB * 8u; i += WG) {
        var v = vec4<f32>(0.0);
        if (held(ids[i / (NB * 8u)])) {
            v = h[hb + i];
        }
        xs[xs_slot(i)] = v;
    }";

/// The affine forms' staging: one block of 32 per thread and pass, whose sum `q4_xsum` (the
/// `c1 Σ x` term of every row's dot with that block) goes to `xsum_s` once for the
/// workgroup, where computing it per item cost each team the same sums again (the dots read
/// the same bits either way: the same function of the same values).
const STAGE_BLOCKS: &str = "for (var b = li; b < KSNB; b += WG) {
        var x = array<vec4<f32>, 8>();
        if (held(ids[b / NB])) {
            let o = hb + b * 8u;
            x = array<vec4<f32>, 8>(h[o], h[o + 1u], h[o + 2u], h[o + 3u], h[o + 4u], h[o + 5u],
                                    h[o + 6u], h[o + 7u]);
        }
        let s = b * 8u;
        xs[xs_slot(s)] = x[0];
        xs[xs_slot(s + 1u)] = x[1];
        xs[xs_slot(s + 2u)] = x[2];
        xs[xs_slot(s + 3u)] = x[3];
        xs[xs_slot(s + 4u)] = x[4];
        xs[xs_slot(s + 5u)] = x[5];
        xs[xs_slot(s + 6u)] = x[6];
        xs[xs_slot(s + 7u)] = x[7];
        xsum_s[b] = q4_xsum(x);
    }";

/// The affine forms' block sums of the staged h: `[KSNB]` f32.
const XSUM_DECL: &str = "var<workgroup> xsum_s: array<f32, KSNB>;";

/// moe_down_f32.wgsl with its per-item and per-row lines written out for `t` lanes per row and
/// `rt` rows per team and `ds` slot groups, one variable each (a per-thread array indexed in a
/// loop may be placed in slow local memory): item j of a lane is `it = lane + j * t`,
/// ceil(K / ds * NB / t) of them (3 at the real shape with 16 lanes and 4 groups). The weight and scale loads come first (in flight
/// during the staging), the dots after; each staged block is read once for the team's rows.
/// `form`: the blocks' form; the affine one's (tensor.rs): each item adds `w c1 Σ x` with the staged
/// block's sum computed once for the workgroup while staging ([`STAGE_BLOCKS`]: Q4_K tg128
/// 336.5 against 320.0 tok/s on the H100, BENCHMARKS run 151; the non-affine forms keep the
/// vec4 staging, faster for them: run 152).
pub(super) fn down_f32_body(p: &MoeParams, t: u32, rt: u32, ds: u32, form: QForm) -> String {
    let affine = form.affine();
    let dotf = form.dot_fn();
    let items = (p.top_k / ds * p.inter / BLOCK as u32).div_ceil(t);
    let (mut load, mut dot, mut store) = (String::new(), String::new(), String::new());
    for r in 0..rt {
        load += &format!(
            "let crow{r} = select(0u, row0 + {r}u, row0 + {r}u < H);\n    var acc{r} = 0.0;\n    "
        );
        store += &format!("red[(team * RT + {r}u) * TP + lane] = acc{r};\n    ");
    }
    for j in 0..items {
        load += &format!("let it{j} = lane + {j}u * T;\n    ");
        dot += &format!(
            "{{ let x = xs_block(min(it{j}, KSNB - 1u)); let w = wts[item_k(it{j})]; \
             let on = item_on(it{j});\n        "
        );
        if affine {
            dot += &format!("let xsum = xsum_s[min(it{j}, KSNB - 1u)];\n        ");
        }
        for r in 0..rt {
            if affine {
                load += &format!(
                    "let b{j}_{r} = item_blk(it{j}, crow{r}); let q{j}_{r} = qs[b{j}_{r}]; \
                     let s{j}_{r} = q4_coef(sc[b{j}_{r} >> 1u], b{j}_{r});\n    "
                );
                dot += &format!(
                    "acc{r} = select(acc{r}, fma(w * s{j}_{r}.x, {dotf}(q{j}_{r}, x), \
                     fma(w * s{j}_{r}.y, xsum, acc{r})), on);\n        "
                );
                continue;
            }
            load += &format!(
                "let b{j}_{r} = item_blk(it{j}, crow{r}); let q{j}_{r} = qs[b{j}_{r}]; \
                 let s{j}_{r} = scale(b{j}_{r});\n    "
            );
            dot += &format!(
                "acc{r} = select(acc{r}, fma(w * s{j}_{r}, {dotf}(q{j}_{r}, x), acc{r}), on);\n        "
            );
        }
        dot += "}\n    ";
    }
    let (stage, decl) = if affine {
        (STAGE_BLOCKS, XSUM_DECL)
    } else {
        (STAGE_VEC4S, "")
    };
    let (wq, ws, wsink) = super::DOWN_WARM_BINDINGS;
    form.wgsl()
        + &super::super::warm::wgsl(wq, ws, wsink)
        + &include_str!("../shaders/moe_down_f32.wgsl")
            .replace("//XSUM_DECL", decl)
            .replace("//STAGE", stage)
            .replace("//ITEMS_LOAD", &load)
            .replace("//ITEMS_DOT", &dot)
            .replace("//ROWS_STORE", &store)
}
