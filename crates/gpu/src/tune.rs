//! Work-split overrides for side-by-side comparisons (`nibble ... --tune key=value,..`).
//!
//! The defaults are the splits measured fastest in the whole decode step on the H200
//! (docs/BENCHMARKS.md runs 41-44); the step and the kernel measured alone have disagreed, so a
//! new split is judged by running the step both ways in one process (`scripts/gpu-bench.sh`
//! step `flagsets`). Every field left `None` keeps its default; values are checked where the
//! kernels are built (one the kernels cannot take is a clear error). The one adjustment:
//! `down_split` (`down_split_wide` for a down of a byte form) becomes the largest power of two
//! up to it that divides K, and 1 where its scratch would pass the binding limit
//! (`F32Tuning`); `-v` prints the slot groups in use.

use crate::context::{Context, GpuError, Result};
use crate::kernels::attention::{AttentionKernel, AttentionParams, AttnForm, ChunkShape, Combine};
use crate::kernels::moe::{F32Tuning, MoeParams};
use std::str::FromStr;

/// Overrides of the kernels' work splits; `Tune::default()` changes nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tune {
    /// Rows per team of the qkv matvec (1, 2 or 4; default 4).
    pub qkv_rows: Option<u32>,
    /// Rows per team of the o-proj matvec (1, 2 or 4; default 2).
    pub o_rows: Option<u32>,
    /// [`F32Tuning`] fields of the staged f32 MoE kernels.
    pub gate_up_lanes: Option<u32>,
    pub gate_up_rows: Option<u32>,
    pub down_lanes: Option<u32>,
    pub down_rows: Option<u32>,
    pub down_split: Option<u32>,
    pub down_split_wide: Option<u32>,
    /// The attention's split: target workgroups over all kv heads (default 1024), cache loads
    /// per thread per tile (1..=16, default 2), and the most chunks per kv head the fused
    /// combine serves (default 16; Vulkan).
    pub attn_workgroups: Option<u32>,
    pub attn_tile_loads: Option<u32>,
    pub attn_fused_max: Option<u32>,
    /// The chunk body: 1 (the default) the tiled form, 2 the streamed form
    /// ([`crate::kernels::attention::AttnForm`]); and the streamed form's V rows per thread
    /// per batch (1..=16, default 4).
    pub attn_form: Option<u32>,
    pub attn_v_rows: Option<u32>,
    /// From this position on, the single-sequence steps take a second attention kernel: the
    /// streamed body with 64-row key blocks (8 loads), `attn_v_rows` V rows and a split over
    /// 256 workgroups, run 175's fastest at depth (unset: one kernel at every position;
    /// [`AttentionKernel::with_deep`]).
    pub attn_deep: Option<u32>,
    /// 1 or unset (the default since run 63: tg128 318.2 against 315.2): the norm-on-load
    /// matvec (qkv) stages `h ⊙ w` and scales each row's sum by `1 / rms(h)` at the end, so
    /// its dot products need not wait for the norm's reduction (matvec_wgsl.rs
    /// `LATE_NORM_ON_LOAD`); 0: the norm first.
    pub late_norm: Option<u32>,
    /// 1 or unset (the default): the folded MoE gate/up scales late likewise
    /// ([`F32Tuning::late_norm`]); 0: the norm first.
    pub moe_late_norm: Option<u32>,
    /// The fused plan's int4 lm_head: 3 (the default from run 67 to run 104: tg128 323.5
    /// against 322.4) a one-workgroup dispatch converting `rmsnorm(h)` to bfp24 once, then the
    /// matvec reading those blocks from global memory (no per-workgroup conversion); 0 the
    /// one-column matmul normalising on load, 1 the norm-on-load matvec in the plan's f32 form,
    /// 2 that matvec with bfp24 activations staged by every workgroup (integer dots;
    /// [`crate::numerics::Numerics::Bfp24`]); 4 or unset (the default since run 104) form 3 with
    /// two rows per team, each activation block a lane loads serving both (the same bits).
    pub head: Option<u32>,
    /// Most key splits of the GEMM prefill's query-tile attention (1..=16, default 16; 1: the
    /// keys unsplit; kernels/attention_prefill.rs).
    pub prefill_splits: Option<u32>,
    /// K splits of a short chunk's qkv and o-proj GEMMs (under 256 tokens: few tiles of 128
    /// rows; gemm.rs `bind_split`, the partials summed by gemm_reduce.rs); 1: unsplit. Unset:
    /// [`crate::prefill::SHORT_K_SPLITS`] (8).
    pub prefill_ksplits: Option<u32>,
    /// The matrix-unit prefill GEMM's 32-token tiles with two staging buffers (one barrier
    /// per block of K instead of two; kernels/gemm_coop.rs `LOOP_DOUBLE`). Unset: two where
    /// the workgroup memory holds them (run 133: pp128 +6-10%, pp512 +11%); 0: one buffer;
    /// 1: two, an error where they do not fit.
    pub prefill_dbuf: Option<u32>,
    /// An affine (MLX) model's prefill GEMMs on the matrix units (kernels/gemm_coop.rs
    /// `WSTORE_COOP_AFFINE`): 1 on. Unset or 0 (the default): f32 fmas, because on the
    /// full-size MLX model the matrix units' f32-class sums flipped a near-tied route and so
    /// one greedy token of three prompts' 32 (BENCHMARKS run 135, pp512 4112 tok/s on the
    /// H200), where f32 fmas pass (run 136).
    pub prefill_coop_affine: Option<u32>,
    /// Positions below which the qkv dispatch also attends (kernels/qkv_attention.rs: 4
    /// dispatches per layer instead of 5; 256 is the bound measured). Unset or 0 (the
    /// default): the qkv matvec and the attention in dispatches of their own, faster on the
    /// H200 (tg128 324.6 against 269.6 tok/s, BENCHMARKS run 101).
    pub qkv_attn: Option<u32>,
    /// L2 warming (kernels/warm.rs), a bit mask: 1 the qkv dispatch reads the o-proj's
    /// weights into L2 in extra workgroups, 2 the MoE down dispatch the next layer's qkv, 4 each
    /// MoE gate/up workgroup its share of its expert's down weights; 0 none. Unset:
    /// [`DEFAULT_WARM`].
    pub warm: Option<u32>,
    /// 1 or unset (the default since run 147: Q4_K_M tg128 289.4 against 276.7): the
    /// norm-on-load qkv over a stack of two forms (a `Q4_K_M` file's: q and k Q4_K, v Q6_K)
    /// in one dispatch, each part's workgroups in its form (matvec_wgsl.rs `q4f_pair_body`);
    /// 0: a dispatch per part.
    pub qkv_pair: Option<u32>,
}

/// The lm_head form when `head` is unset ([`Tune::head`]; run 67 chose 3, run 104 its
/// two-rows-per-team form 4: 70.4 against 79.0 us in kernel_bench, tg128 +0.3% side by side).
pub const DEFAULT_HEAD: u32 = 4;

/// The L2 warming when `warm` is unset ([`Tune::warm`]): the qkv warms the o-proj and the MoE
/// down the next layer's qkv (run 106: tg128 343.3 / 343.7 against 338.5 / 337.9 with none,
/// +1.6%; run 105: each half alone +0.9% / +0.8%). Bit 4 (the gate/up warming the down) is
/// slower: 340.9 / 341.1 with all three.
pub const DEFAULT_WARM: u32 = 3;

/// The keys `--tune` accepts, in the order [`Tune`]'s `Display` writes them.
pub const KEYS: [&str; 24] = [
    "qkv_rows",
    "o_rows",
    "gate_up_lanes",
    "gate_up_rows",
    "down_lanes",
    "down_rows",
    "down_split",
    "down_split_wide",
    "attn_workgroups",
    "attn_tile_loads",
    "attn_fused_max",
    "attn_form",
    "attn_v_rows",
    "attn_deep",
    "late_norm",
    "moe_late_norm",
    "head",
    "prefill_splits",
    "prefill_ksplits",
    "prefill_dbuf",
    "prefill_coop_affine",
    "qkv_attn",
    "warm",
    "qkv_pair",
];

impl Tune {
    fn slot(&mut self, key: &str) -> Option<&mut Option<u32>> {
        Some(match key {
            "qkv_rows" => &mut self.qkv_rows,
            "o_rows" => &mut self.o_rows,
            "gate_up_lanes" => &mut self.gate_up_lanes,
            "gate_up_rows" => &mut self.gate_up_rows,
            "down_lanes" => &mut self.down_lanes,
            "down_rows" => &mut self.down_rows,
            "down_split" => &mut self.down_split,
            "down_split_wide" => &mut self.down_split_wide,
            "attn_workgroups" => &mut self.attn_workgroups,
            "attn_tile_loads" => &mut self.attn_tile_loads,
            "attn_fused_max" => &mut self.attn_fused_max,
            "attn_form" => &mut self.attn_form,
            "attn_v_rows" => &mut self.attn_v_rows,
            "attn_deep" => &mut self.attn_deep,
            "late_norm" => &mut self.late_norm,
            "moe_late_norm" => &mut self.moe_late_norm,
            "head" => &mut self.head,
            "prefill_splits" => &mut self.prefill_splits,
            "prefill_ksplits" => &mut self.prefill_ksplits,
            "prefill_dbuf" => &mut self.prefill_dbuf,
            "prefill_coop_affine" => &mut self.prefill_coop_affine,
            "qkv_attn" => &mut self.qkv_attn,
            "warm" => &mut self.warm,
            "qkv_pair" => &mut self.qkv_pair,
            _ => return None,
        })
    }

    /// The MoE work split on `ctx` for the shapes `p`: [`F32Tuning::for_shapes`] with these
    /// overrides.
    pub fn moe(&self, ctx: &Context, p: &MoeParams) -> F32Tuning {
        let t = F32Tuning::for_shapes(ctx, p);
        F32Tuning {
            gate_up_lanes: self.gate_up_lanes.unwrap_or(t.gate_up_lanes),
            gate_up_rows: self.gate_up_rows.unwrap_or(t.gate_up_rows),
            down_lanes: self.down_lanes.unwrap_or(t.down_lanes),
            down_rows: self.down_rows.unwrap_or(t.down_rows),
            down_split: self.down_split.unwrap_or(t.down_split),
            down_split_wide: self.down_split_wide.unwrap_or(t.down_split_wide),
            late_norm: self.moe_late_norm.map_or(t.late_norm, |v| v != 0),
        }
    }

    /// The attention kernel for `params` with these overrides, merging as `merge` (the
    /// single-sequence plan and the multi-stream path build theirs alike, so the streams'
    /// bits match the single-stream ones).
    pub fn attention(
        &self,
        ctx: &Context,
        params: AttentionParams,
        merge: Combine,
    ) -> Result<AttentionKernel> {
        let d = ChunkShape::default();
        let form = match self.attn_form {
            None | Some(1) => AttnForm::Tiles,
            Some(2) => AttnForm::Stream,
            Some(n) => {
                return Err(GpuError::Shape(format!(
                    "attn_form={n}: expected 1 (tiles) or 2 (streamed)"
                )))
            }
        };
        let shape = ChunkShape {
            form,
            tile_loads: self.attn_tile_loads.unwrap_or(d.tile_loads),
            v_rows: self.attn_v_rows.unwrap_or(d.v_rows),
        };
        let mut k = AttentionKernel::with_overrides(ctx, params, self.attn_workgroups, shape)?
            .with_combine(merge);
        if let Some(from) = self.attn_deep {
            let deep = ChunkShape {
                form: AttnForm::Stream,
                tile_loads: 8,
                v_rows: shape.v_rows,
            };
            let deep = AttentionKernel::with_overrides(ctx, params, Some(256), deep)?;
            k = k.with_deep(deep, from)?;
        }
        Ok(match self.attn_fused_max {
            Some(n) => k.with_fused_max_chunks(n),
            None => k,
        })
    }

    /// Whether anything is overridden.
    pub fn is_default(&self) -> bool {
        *self == Tune::default()
    }
}

impl FromStr for Tune {
    type Err = String;

    /// `key=value` pairs separated by commas, e.g. `o_rows=1,down_split=2` (empty: no change).
    fn from_str(s: &str) -> std::result::Result<Tune, String> {
        let mut t = Tune::default();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| format!("'{pair}' is not key=value"))?;
            let (k, v) = (k.trim(), v.trim());
            let slot = t
                .slot(k)
                .ok_or_else(|| format!("unknown key '{k}' (known: {})", KEYS.join(", ")))?;
            if slot.is_some() {
                return Err(format!("'{k}' given twice"));
            }
            let n: u32 = v
                .parse()
                .map_err(|_| format!("'{k}={v}': the value is not a non-negative integer"))?;
            *slot = Some(n);
        }
        Ok(t)
    }
}

impl std::fmt::Display for Tune {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vals = [
            self.qkv_rows,
            self.o_rows,
            self.gate_up_lanes,
            self.gate_up_rows,
            self.down_lanes,
            self.down_rows,
            self.down_split,
            self.down_split_wide,
            self.attn_workgroups,
            self.attn_tile_loads,
            self.attn_fused_max,
            self.attn_form,
            self.attn_v_rows,
            self.attn_deep,
            self.late_norm,
            self.moe_late_norm,
            self.head,
            self.prefill_splits,
            self.prefill_ksplits,
            self.prefill_dbuf,
            self.prefill_coop_affine,
            self.qkv_attn,
            self.warm,
            self.qkv_pair,
        ];
        let set: Vec<String> = KEYS
            .iter()
            .zip(vals)
            .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
            .collect();
        if set.is_empty() {
            write!(f, "defaults")
        } else {
            write!(f, "{}", set.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_round_trips_and_rejects_bad_input() {
        let t: Tune = "o_rows=1, down_split=8,qkv_rows=2,attn_fused_max=4,late_norm=1,\
                       moe_late_norm=0,down_split_wide=2"
            .parse()
            .unwrap();
        assert_eq!(
            t,
            Tune {
                qkv_rows: Some(2),
                o_rows: Some(1),
                down_split: Some(8),
                down_split_wide: Some(2),
                attn_fused_max: Some(4),
                late_norm: Some(1),
                moe_late_norm: Some(0),
                ..Tune::default()
            }
        );
        assert_eq!(
            t.to_string(),
            "qkv_rows=2,o_rows=1,down_split=8,down_split_wide=2,attn_fused_max=4,late_norm=1,\
             moe_late_norm=0"
        );
        assert_eq!(t.to_string().parse::<Tune>().unwrap(), t);
        assert!("".parse::<Tune>().unwrap().is_default());
        assert_eq!(Tune::default().to_string(), "defaults");
        for (bad, want) in [
            ("o_rows", "not key=value"),
            ("rows=2", "unknown key 'rows'"),
            ("o_rows=2,o_rows=1", "given twice"),
            ("down_split=-1", "not a non-negative integer"),
            ("down_split=x", "not a non-negative integer"),
        ] {
            let e = bad.parse::<Tune>().expect_err(bad);
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
