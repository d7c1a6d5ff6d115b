//! Deliberate weight corruption, to test the parity localiser: `nibble parity` must notice a
//! wrong weight in the GPU copy and name the layer and op where the outputs first diverge.
//!
//! [`plant_error`] overwrites the f16 block scales of one row (per expert, for the expert
//! tensors) of one layer's Q4_0 matrix on the GPU with a large value, after upload (for a
//! matrix widened to f32, such as the router, row 0's weights themselves). The host
//! copy (and so the oracle) is untouched. Which op it shows up in first:
//! `qkv` -> `l{n}.q`, `o` -> `l{n}.attn_out`, `router` -> `l{n}.router_logits`,
//! `gate` / `up` / `down` -> `l{n}.moe_out`.

use crate::plan::DecodePlan;
use crate::tensor::{Q4Matrix, BLOCK};
use crate::weights::Matrix;
use anyhow::{bail, Context as _, Result};
use std::fmt;
use std::str::FromStr;

/// The tensor of a layer to corrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantTarget {
    /// The fused q/k/v projection (its first row is a q row).
    Qkv,
    /// The attention output projection.
    O,
    Router,
    /// Expert gate/up/down: one row of every expert, so whichever are routed see it.
    Gate,
    Up,
    Down,
}

impl PlantTarget {
    pub const ALL: [PlantTarget; 6] = [
        PlantTarget::Qkv,
        PlantTarget::O,
        PlantTarget::Router,
        PlantTarget::Gate,
        PlantTarget::Up,
        PlantTarget::Down,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PlantTarget::Qkv => "qkv",
            PlantTarget::O => "o",
            PlantTarget::Router => "router",
            PlantTarget::Gate => "gate",
            PlantTarget::Up => "up",
            PlantTarget::Down => "down",
        }
    }
}

impl fmt::Display for PlantTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PlantTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PlantTarget::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                format!("unknown tensor '{s}': expected qkv, o, router, gate, up or down")
            })
    }
}

/// The value written: Q4_0 scales and f32 weights of real models are ~0.001-0.1, so this is
/// 100-10000x.
const PLANTED_SCALE: f32 = 8.0;

/// Overwrite the block scales of row 0 of every `group` rows of `m` (row 0 of each expert).
fn corrupt(plan: &DecodePlan, m: &Q4Matrix, group: u32) -> Result<()> {
    let bpr = m.cols as usize / BLOCK; // blocks per row
    let half = half::f16::from_f32(PLANTED_SCALE).to_bits() as u32;
    let word = half | (half << 16); // two f16 scales per u32
    for row in (0..m.rows).step_by(group.max(1) as usize) {
        let part = m
            .parts
            .iter()
            .find(|p| (p.row_start..p.row_start + p.rows).contains(&row))
            .context("a row outside every part of the matrix")?;
        // The row's blocks are b0..b0+bpr of the part; their scale words (one per pair of
        // blocks, `wpp` u32 each: two for the K-quants' forms) are overwritten whole (queue
        // writes are 4-byte aligned), which may also hit a neighbouring row's.
        let b0 = (row - part.row_start) as usize * bpr;
        let wpp = (part.form.scale_word_bytes() / 4) as usize;
        let (w0, w1) = (b0 / 2 * wpp, (b0 + bpr).div_ceil(2) * wpp);
        let words = vec![word; w1 - w0];
        plan.ctx
            .write(&part.scales, w0 as u64 * 4, bytemuck::cast_slice(&words));
    }
    Ok(())
}

/// Corrupt `target` of `layer` in `plan`'s GPU weights (see the module docs).
pub fn plant_error(plan: &DecodePlan, layer: usize, target: PlantTarget) -> Result<()> {
    let cfg = &plan.weights.cfg;
    let Some(lw) = plan.weights.layers.get(layer) else {
        bail!(
            "layer {layer} does not exist (the model has {})",
            cfg.num_layers
        );
    };
    let dense = |m: &Matrix| -> Result<()> {
        match m {
            Matrix::Q4(q) => corrupt(plan, q, q.rows),
            Matrix::F32(f) => {
                // Widened (non-Q4_0) weights: row 0 becomes all PLANTED_SCALE.
                let part = f.parts.first().context("an f32 matrix without parts")?;
                let row = vec![PLANTED_SCALE; f.cols as usize];
                plan.ctx.write(&part.w, 0, bytemuck::cast_slice(&row));
                Ok(())
            }
        }
    };
    match target {
        PlantTarget::Qkv => dense(&lw.qkv),
        // The folded router (router_fold.rs) is computed from both: recompute it.
        PlantTarget::O => dense(&lw.o).and_then(|_| plan.refold(layer)),
        PlantTarget::Router => dense(&lw.router).and_then(|_| plan.refold(layer)),
        PlantTarget::Gate => corrupt(plan, &lw.gate, cfg.moe_intermediate_size as u32),
        PlantTarget::Up => corrupt(plan, &lw.up, cfg.moe_intermediate_size as u32),
        PlantTarget::Down => corrupt(plan, &lw.down, cfg.hidden_size as u32),
    }
}
