//! Where a decode step's GPU time goes, op by op, in the real plan: one greedy step recorded
//! exactly as a folded run records it, with a timestamp query written after every op
//! (`DecodePlan::record_step_marked`), so the real weights stream from memory in the real order
//! (kernel_bench times each kernel alone, on stand-in weights). `nibble bench --profile`.
//!
//! A timestamp inside a pass is written once every earlier command has finished, so the gap
//! between two marks is that op's dispatches, barriers included, plus what the mark itself
//! costs: on the H200 (Vulkan) a profiled step took ~1.55x the GPU time of the same step in a
//! run (docs/BENCHMARKS.md run 23), so read the rows as relative weights, not as the kernels'
//! own times (kernel_bench has those). The last row times timestamps with nothing between.
//! Needs the device features `TIMESTAMP_QUERY` and `TIMESTAMP_QUERY_INSIDE_PASSES`; without
//! them there is no profile.

use crate::context::{GpuError, Result, Timestamps};
use crate::plan::{DecodePlan, Pick};
use nibble_backend::OpTime;

/// Most timestamps one profile may write (wgpu caps a query set at 4096).
const MAX_MARKS: u32 = 4096;
/// Unmeasured steps recorded first, so the clocks are up when the measured ones run.
const WARM: usize = 4;
/// Back-to-back timestamps written after the steps: their median gap is reported as the op
/// [`MARK_OP`], the cost of a mark itself (not part of the step's total).
const CALIB: u32 = 9;
/// The calibration row's name.
pub const MARK_OP: &str = "(timestamp pair, nothing between)";

impl DecodePlan {
    /// Per-op GPU time of one greedy step (the median of `reps` measured steps, fewer if their
    /// timestamps would not fit in one query set, at positions
    /// `pos + WARM ..`, after `WARM` unmeasured ones, all in one pass and one submit; fewer when
    /// the context ends first), summed over the layers per op kind, in first-run order.
    /// `Ok(None)` when the device cannot write timestamps inside passes. Writes the KV rows of
    /// those positions like the steps of a run would; the caller guarantees `token < V` and
    /// `pos < context_len`.
    pub fn profile_step(&self, token: u32, pos: usize, reps: usize) -> Result<Option<Vec<OpTime>>> {
        let need = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if !self.ctx.features.contains(need) {
            return Ok(None);
        }
        let ts = Timestamps::new(&self.ctx, "profile.ts", MAX_MARKS);
        // All steps in ONE pass and one submit, as a folded run records them (a submit per
        // step, tried first, gave the same totals: BENCHMARKS run 22). The first WARM steps
        // only warm up; each step after writes its timestamps. Positions advance like a run's
        // (within the context).
        // Marks per step, counted on a recording that is never submitted, so the measured
        // steps fit in one query set (fewer than `reps` when they would not).
        let mut per_step = 0u32;
        {
            let mut enc = self.ctx.device.create_command_encoder(&Default::default());
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            self.record_step_marked(&mut pass, pos as u32, Pick::Argmax, None, &mut |_, _| {
                per_step += 1
            });
        }
        let fit = ((MAX_MARKS - CALIB) / (per_step + 1)).max(1) as usize;
        let reps = reps.clamp(1, fit);
        let room = self.opts.context_len.saturating_sub(pos).max(1);
        let steps = (WARM + reps).min(room);
        let warm = steps.saturating_sub(reps).min(WARM);
        // The argmax's run length covers every step (no EOS), so none becomes a no-op.
        self.start_greedy(token, pos, steps as u32, &[])?;
        let mut labels: Vec<Vec<&'static str>> = Vec::new();
        // Timestamps written so far (indices past MAX_MARKS are counted, not written).
        let mut next = 0u32;
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            for s in 0..steps {
                let bound = (pos + s) as u32;
                if s < warm {
                    self.record_step_marked(&mut pass, bound, Pick::Argmax, None, &mut |_, _| {});
                    continue;
                }
                let mut ops = Vec::new();
                if next < MAX_MARKS {
                    pass.write_timestamp(&ts.set, next);
                }
                next += 1;
                self.record_step_marked(&mut pass, bound, Pick::Argmax, None, &mut |p, op| {
                    if next < MAX_MARKS {
                        p.write_timestamp(&ts.set, next);
                    }
                    ops.push(op);
                    next += 1;
                });
                labels.push(ops);
            }
            // Calibration: CALIB timestamps back to back with nothing between them.
            for _ in 0..CALIB {
                if next < MAX_MARKS {
                    pass.write_timestamp(&ts.set, next);
                }
                next += 1;
            }
        }
        if next > MAX_MARKS {
            return Err(GpuError::Shape(format!(
                "profile: {steps} steps need more than {MAX_MARKS} timestamps (fewer reps)"
            )));
        }
        let gaps = ts.finish(&self.ctx, enc, next)?;
        let mut per_rep: Vec<Vec<(&'static str, f64)>> = Vec::new();
        let mut at = 0usize;
        for ops in labels {
            // The step's gaps, then the one from its last mark to the next step's first.
            per_rep.push(
                ops.iter()
                    .copied()
                    .zip(gaps[at..].iter().copied())
                    .collect(),
            );
            at += ops.len() + 1;
        }
        let mut gaps = gaps[at..].to_vec();
        gaps.sort_by(f64::total_cmp);
        let mark_us = gaps.get(gaps.len() / 2).copied().unwrap_or(0.0);
        // The step with the median total.
        let mut reps = per_rep;
        reps.sort_by(|a, b| total(a).total_cmp(&total(b)));
        let median = &reps[reps.len() / 2];
        if median
            .iter()
            .any(|(_, us)| !us.is_finite() || *us < 0.0 || *us > 1e7)
        {
            return Err(GpuError::Poll("profile: timestamps out of order".into()));
        }
        let mut out = sum_by_op(median.iter().copied());
        out.push(OpTime {
            op: MARK_OP.to_string(),
            calls: 1,
            us: mark_us,
        });
        Ok(Some(out))
    }
}

fn total(ops: &[(&'static str, f64)]) -> f64 {
    ops.iter().map(|(_, us)| us).sum()
}

/// Per-op `(name, us)` pairs summed per name, in first-seen order, with the calls counted.
pub(crate) fn sum_by_op<'a>(ops: impl Iterator<Item = (&'a str, f64)>) -> Vec<OpTime> {
    let mut out: Vec<OpTime> = Vec::new();
    for (op, us) in ops {
        match out.iter_mut().find(|o| o.op == op) {
            Some(o) => {
                o.calls += 1;
                o.us += us;
            }
            None => out.push(OpTime {
                op: op.to_string(),
                calls: 1,
                us,
            }),
        }
    }
    out
}
