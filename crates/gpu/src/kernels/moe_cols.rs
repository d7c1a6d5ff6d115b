//! The MoE block over columns (multi-stream decode, batched prefill; [`crate::columns`]): for
//! each column `c < nb` that is not done, the fused routing + gate/up and the down + combine of
//! moe.rs on that column's token, in the same two dispatches per weight part for all columns.
//!
//! Buffers (column `c` at `c * n`, `n` the single-token length): router logits `[nb, E]`, x (the
//! post-attention RMSNorm output) `[nb, H]` f32, route `[nb, 2K]` u32 (per column: ids, then f32
//! weight bits), h `[nb, K*I]` f32, out (the residual stream) `[nb, H]` f32. Grids: gate/up
//! `(I / R, K, nb)`, down `(gx, gy, nb)` (z = the column; the union down `(gx, gy, 1)`, rows
//! for every column). A done column's route, h and out are left untouched.
//!
//! Only the staged f32 kernels have column forms (the real model's shapes are staged); the int8
//! numerics and f32 past [`super::STAGE_BUDGET`] return an error here.
//!
//! Each stage has two exact forms ([`ColsForm`]); the default reads per column (z = the column,
//! each column its own experts, shared only through the cache), the fastest on the H200 (run 6
//! of docs/BENCHMARKS.md). The union forms read each chosen expert once per step:
//!
//! Union gate/up (`gate_up_union_cols` in moe_gate_up_f32.wgsl): workgroup (b, k, c) routes
//! column c, and the first (column, rank) that chose an expert owns it; the owner keeps its
//! lanes' weight blocks of that expert in registers and applies them to every column that chose
//! it, one staged x after the other (all 8 columns' x at once would be 64 KiB at the real
//! shape), with the single-token dots and sums in the same order, so every h value is
//! bit-identical to the single-token kernel's. The other workgroups exit after routing.
//!
//! Union down (moe_down_union_f32.wgsl): a column's output row sums its K experts' blocks in
//! one per-lane fma chain that interleaves the experts, so the row cannot be split across
//! workgroups by expert in one dispatch; instead each workgroup owns rows for all columns and
//! walks the union experts in batches (3 experts and 4 h slots at the real shape, the next batch's rows loaded
//! during the current one), reading each expert's rows once, keeping every (column, item) block
//! dot in registers and running the chains at the end (two barriers per batch).
//! [`MoeKernel::bind_cols_with`] picks any combination (kernel_bench compares them).

use super::{
    consts, down_params, expert_range, gate_up_params, need, whole, MoeKernel, MoeParams, STAGE,
    STAGE_BUDGET, WG,
};
use crate::columns::{COLUMNS_WGSL, MAX_COLUMNS};
use crate::context::{Context, GpuError, Result};
use crate::kernels::embed::check_cols;
use crate::numerics::F32_DEQ;
use crate::tensor::{Q4Matrix, QForm, BLOCK};

/// The buffers of one layer's MoE block over `nb` columns.
#[derive(Debug, Clone, Copy)]
pub struct MoeColsBuffers<'a> {
    /// Run state (`State` in shaders/state.wgsl): `done` once every column is done.
    pub state: &'a wgpu::Buffer,
    /// The [`crate::columns`] buffer (read only).
    pub cols: &'a wgpu::Buffer,
    /// Columns, `1..=MAX_COLUMNS` (the grids' z).
    pub nb: u32,
    /// `[nb, E]` f32 router logits.
    pub logits: &'a wgpu::Buffer,
    /// `[nb, 2K]` u32 route (written here: per column ids, then f32 weight bits).
    pub route: &'a wgpu::Buffer,
    /// `[nb, H]` f32 input (post-attention RMSNorm output).
    pub x: &'a wgpu::Buffer,
    /// `[E*I, H]` gate and up, `[E*H, I]` down.
    pub gate: &'a Q4Matrix,
    pub up: &'a Q4Matrix,
    pub down: &'a Q4Matrix,
    /// `[nb, K, I]` f32 SiLU(gate) * up (scratch, also read by tests).
    pub h: &'a wgpu::Buffer,
    /// `[nb, H]` f32 output.
    pub out: &'a wgpu::Buffer,
    /// Add the MoE output into `out` (the residual stream) instead of overwriting it.
    pub residual: bool,
}

/// How one stage of the column MoE reads the expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColsRead {
    /// Each chosen expert's weights read once for all the columns that chose it.
    Union,
    /// Every column reads its own K experts (the earlier form, for side-by-side benchmarks).
    PerColumn,
}

/// The kernel each stage of a column binding records (every form writes the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColsForm {
    pub gate_up: ColsRead,
    pub down: ColsRead,
}

impl ColsForm {
    /// What [`MoeKernel::bind_cols`] records: both stages per column, the fastest form on the
    /// H200 at nb = 1..8 with random or shared routes (docs/BENCHMARKS.md run 6: the cache
    /// already serves repeated expert reads, and the union forms serialise an expert's columns
    /// inside one workgroup).
    pub const DEFAULT: ColsForm = ColsForm::PER_COLUMN;
    /// Both stages read the union of the chosen experts.
    pub const UNION: ColsForm = ColsForm {
        gate_up: ColsRead::Union,
        down: ColsRead::Union,
    };
    /// Both stages per column.
    pub const PER_COLUMN: ColsForm = ColsForm {
        gate_up: ColsRead::PerColumn,
        down: ColsRead::PerColumn,
    };
}

/// The compiled column pipelines of a [`MoeKernel`].
#[derive(Debug)]
pub(super) struct ColsPipelines {
    /// `gate_up_union_cols`.
    union: wgpu::ComputePipeline,
    /// `gate_up_routed_cols`.
    per_column: wgpu::ComputePipeline,
    /// `main_cols`.
    down: wgpu::ComputePipeline,
    /// moe_down_union_f32.wgsl `main_union` and its rows per workgroup; `None` when its
    /// workgroup memory does not fit the staging budget with one h slot.
    down_union: Option<(wgpu::ComputePipeline, u32)>,
}

impl ColsPipelines {
    /// The column entry points of the compiled gate/up and down modules (the union gate/up
    /// from `gate_up_checked`, the per-column forms from `gate_up` / `down`, compiled without
    /// runtime checks: moe.rs `unchecked_staged`), and the union down kernel for `down_t` lanes
    /// per row (the single-token down kernel's, which fixes the order of each row's sums).
    pub(super) fn new(
        ctx: &Context,
        gate_up_checked: &wgpu::ShaderModule,
        gate_up: &wgpu::ShaderModule,
        down: &wgpu::ShaderModule,
        p: &MoeParams,
        down_t: u32,
        down_split: u32,
    ) -> Result<Self> {
        let budget = STAGE_BUDGET.min(ctx.limits.max_compute_workgroup_storage_size as u64);
        // The union down reproduces the per-column kernel's bits only without slot groups.
        let src = (down_split == 1)
            .then(|| down_union_src(p, down_t, budget))
            .flatten();
        let down_union = match src {
            Some(src) => {
                let m = ctx.module("moe.down_union", &src)?;
                Some((
                    ctx.pipeline("moe.down_union", &m, "main_union")?,
                    WG / down_t,
                ))
            }
            None => None,
        };
        Ok(ColsPipelines {
            union: ctx.pipeline(
                "moe.gate_up_union_cols",
                gate_up_checked,
                "gate_up_union_cols",
            )?,
            per_column: ctx.pipeline("moe.gate_up_routed_cols", gate_up, "gate_up_routed_cols")?,
            down: ctx.pipeline("moe.down_cols", down, "main_cols")?,
            down_union,
        })
    }

    fn gate_up(&self, form: ColsRead) -> &wgpu::ComputePipeline {
        match form {
            ColsRead::Union => &self.union,
            ColsRead::PerColumn => &self.per_column,
        }
    }
}

/// Workgroup memory of moe_down_union_f32.wgsl besides its staged experts and h slots: red
/// `[WG]`, the pair tables `5 x [8K]`, the union tables `4 x [min(E, 8K)]`, n_union, n_batch.
fn down_union_fixed(p: &MoeParams) -> u64 {
    let pairs = 8 * p.top_k as u64;
    let umax = (p.experts as u64).min(pairs);
    WG as u64 * 4 + pairs * 20 + umax * 16 + 8
}

/// The union experts (EB) and h slots (G) moe_down_union_f32.wgsl stages at once for `t` lanes
/// per row: the most experts (up to 4) that leave room for at least as many slots (up to 8)
/// within `budget` bytes; `None` when not even one expert and one slot fit. At the real shape
/// (32 lanes): 3 experts and 4 slots, 27 KB.
fn down_union_staging(p: &MoeParams, t: u32, budget: u64) -> Option<(u32, u32)> {
    let nb = (p.inter / BLOCK as u32) as u64;
    // Per expert: [WG / t, NB] blocks (16 bytes) and scales (4); per slot: [I] f32.
    let (expert, slot) = ((WG / t) as u64 * nb * 20, nb * 32 * 4);
    let room = budget.checked_sub(down_union_fixed(p))?;
    let slots = |eb: u64| (room.saturating_sub(eb * expert) / slot).min(8);
    (1..=4u64)
        .rev()
        .find(|&eb| slots(eb) >= eb)
        .map(|eb| (eb as u32, slots(eb) as u32))
}

/// moe_down_union_f32.wgsl for `t` lanes per row (staging from [`down_union_staging`]), its
/// per-column, per-item lines written out (one variable each: registers, see `down_f32_body`);
/// `None` when its workgroup memory does not fit `budget`.
fn down_union_src(p: &MoeParams, t: u32, budget: u64) -> Option<String> {
    let (eb, g) = down_union_staging(p, t, budget)?;
    let nb = p.inter / BLOCK as u32;
    let pairs = 8 * p.top_k;
    let j_items = (p.top_k * nb).div_ceil(t);
    let (mut decl, mut dot, mut chain) = (String::new(), String::new(), String::new());
    // An item's dot is computed once and selected into its pair's column's registers (a
    // dynamic index into a per-thread array could land in slow local memory).
    for j in 0..j_items {
        dot += &format!(
            "{{ let it = lane + {j}u * T;\nif (it < KNB && it / NB == k) {{\nlet b = it % NB;\n\
             let dv = dq_block(wq[wb + b], xs_block(s * NB + b));\nlet sv = wsc[wb + b];\n"
        );
        for c in 0..8 {
            dot += &format!(
                "d{c}_{j} = select(d{c}_{j}, dv, c == {c}u);\n\
                 s{c}_{j} = select(s{c}_{j}, sv, c == {c}u);\n"
            );
        }
        dot += "} }\n";
    }
    for c in 0..8 {
        chain += &format!("if ({c}u < params.nb && cols[{c}u].done == 0u) {{\nvar acc = 0.0;\n");
        for j in 0..j_items {
            decl += &format!("var d{c}_{j} = 0.0;\nvar s{c}_{j} = 0.0;\n");
            chain += &format!(
                "{{ let it = lane + {j}u * T; let p = {c}u * K + item_k(it);\n\
                 let on = it < KNB && cid[p] != NONE;\n\
                 acc = select(acc, fma(cwt[p] * s{c}_{j}, d{c}_{j}, acc), on); }}\n"
            );
        }
        chain += &format!(
            "red[li] = acc;\nworkgroupBarrier();\nif (lane == 0u && row < H) {{\nvar tot = 0.0;\n\
             for (var j = 0u; j < T; j++) {{ tot += red[li + j]; }}\n\
             if (params.accumulate != 0u) {{ out[{c}u * H + row] += tot; }} \
             else {{ out[{c}u * H + row] = tot; }}\n}}\nworkgroupBarrier();\n}}\n"
        );
    }
    let c = |n: &str, v: u32| format!("const {n}: u32 = {v}u;\n");
    Some(format!(
        "{}{}{}{}{}{}{F32_DEQ}{STAGE}{COLUMNS_WGSL}{}",
        consts(p, t, p.inter),
        c("P", pairs),
        c("UMAX", p.experts.min(pairs)),
        c("EB", eb),
        c("G", g),
        c("J", j_items),
        include_str!("../shaders/moe_down_union_f32.wgsl")
            .replace("//UNION_DECL", &decl)
            .replace("//UNION_DOT", &dot)
            .replace("//UNION_CHAIN", &chain)
    ))
}

/// Bind groups of one layer's MoE block over columns, created once.
#[derive(Debug)]
pub struct MoeColsBinding {
    form: ColsForm,
    /// One per weight part.
    gate_up: Vec<wgpu::BindGroup>,
    down: Vec<wgpu::BindGroup>,
    nb: u32,
    /// Which of a [`super::MoeSet`]'s kernels records it (0 from a lone kernel's binders).
    pub(super) kernel: usize,
}

impl MoeColsBinding {
    /// Dispatches [`MoeKernel::record_cols`] issues (one per weight part and stage: 2 when every
    /// weight fits one binding).
    pub fn dispatch_count(&self) -> usize {
        self.gate_up.len() + self.down.len()
    }
}

impl MoeKernel {
    /// Whether this kernel has the column forms (f32 numerics, both stages staged).
    pub fn supports_cols(&self) -> bool {
        self.cols.is_some()
    }

    /// Check shapes and create the bind groups of one layer's MoE block over `b.nb` columns
    /// (the form [`ColsForm::DEFAULT`]: per column).
    pub fn bind_cols(&self, ctx: &Context, b: &MoeColsBuffers<'_>) -> Result<MoeColsBinding> {
        self.bind_cols_with(ctx, b, ColsForm::DEFAULT)
    }

    /// Whether the union down kernel is compiled: the kernel has one down slot group (the
    /// union reproduces that kernel's bits) and its workgroup memory fits
    /// [`super::STAGE_BUDGET`] (it does at the real model's shapes).
    pub fn cols_union_down(&self) -> bool {
        self.cols.as_ref().is_some_and(|c| c.down_union.is_some())
    }

    /// As [`Self::bind_cols`] with each stage's form chosen (benchmarks compare them; every
    /// form writes the same route, h and out bits).
    pub fn bind_cols_with(
        &self,
        ctx: &Context,
        b: &MoeColsBuffers<'_>,
        form: ColsForm,
    ) -> Result<MoeColsBinding> {
        let Some(pipes) = &self.cols else {
            return Err(GpuError::Shape(format!(
                "MoE over columns needs f32 activations and both stages staged (numerics {}, \
                 staged {:?}); one column at a time uses bind",
                self.numerics, self.staged
            )));
        };
        let union = form.down == ColsRead::Union || form.gate_up == ColsRead::Union;
        let other = [self.forms.0, self.forms.1]
            .into_iter()
            .find(|f| *f != QForm::Q4_0);
        if let (Some(other), true) = (other, union) {
            return Err(GpuError::Shape(format!(
                "MoE over columns: the union forms read Q4_0 experts only, not {}; use the \
                 per-column forms",
                other.name()
            )));
        }
        let down_union = match (form.down, &pipes.down_union) {
            (ColsRead::PerColumn, _) => None,
            (ColsRead::Union, Some((pipe, _))) => Some(pipe),
            (ColsRead::Union, None) => {
                return Err(GpuError::Shape(format!(
                    "MoE over columns: no union down kernel at {:?} (it needs one down slot \
                     group, and its workgroup memory to fit {STAGE_BUDGET} bytes); use the \
                     per-column down",
                    self.params
                )))
            }
        };
        check_cols(b.cols, b.nb, "MoE columns")?;
        // The kernels serve columns below MAX_COLUMNS (their dpart / darrive scratch and the
        // `c >= 8` exits): more would be skipped in silence.
        if b.nb as usize > MAX_COLUMNS {
            return Err(GpuError::Shape(format!(
                "MoE columns: {} columns (at most {MAX_COLUMNS})",
                b.nb
            )));
        }
        self.check_weights(b.gate, b.up, b.down)?;
        let p = &self.params;
        let (nb, e, k, h, i) = (
            b.nb as u64,
            p.experts as u64,
            p.top_k as u64,
            p.hidden as u64,
            p.inter as u64,
        );
        need(b.state, 16, "state")?;
        need(b.logits, nb * e * 4, "column logits [nb, E]")?;
        need(b.route, nb * 2 * k * 4, "column route [nb, 2K]")?;
        need(b.x, nb * h * 4, "column x [nb, H]")?;
        need(b.h, nb * k * i * 4, "column h [nb, K*I]")?;
        need(b.out, nb * h * 4, "column out [nb, H]")?;
        let mut gate_up = Vec::with_capacity(b.gate.parts.len());
        for (n, (g, u)) in b.gate.parts.iter().zip(&b.up.parts).enumerate() {
            let params = gate_up_params(ctx, g, u, p.inter, n)?;
            let res = [
                (0, whole(b.state)),
                (1, whole(&params)),
                (2, whole(b.logits)),
                (3, whole(b.route)),
                (4, whole(b.x)),
                (6, whole(&g.qs)),
                (7, whole(&g.scales)),
                (8, whole(&u.qs)),
                (9, whole(&u.scales)),
                (10, whole(b.h)),
                (13, whole(b.cols)),
            ];
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            let pipe = pipes.gate_up(form.gate_up);
            gate_up.push(ctx.bind_group_at("moe.gate_up_cols", pipe, &ids, &res)?);
        }
        let mut down = Vec::with_capacity(b.down.parts.len());
        for (n, part) in b.down.parts.iter().enumerate() {
            let accumulate = b.residual || n > 0;
            let params = match down_union {
                // The union kernel takes the column count from its params (grid z = 1).
                Some(_) => {
                    let (lo, hi) = expert_range(part, p.hidden, "down")?;
                    let words = [lo, hi, accumulate as u32, b.nb];
                    ctx.uniform("moe.down_union.params", bytemuck::cast_slice(&words))?
                }
                None => down_params(ctx, part, p.hidden, accumulate)?,
            };
            let mut res = vec![
                (0, whole(b.state)),
                (1, whole(&params)),
                (2, whole(b.route)),
                (3, whole(b.h)),
                (5, whole(&part.qs)),
                (6, whole(&part.scales)),
                (7, whole(b.out)),
                (8, whole(b.cols)),
            ];
            if down_union.is_none() {
                res.extend(self.down_split_entries());
            }
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            let pipe = down_union.unwrap_or(&pipes.down);
            down.push(ctx.bind_group_at("moe.down_cols", pipe, &ids, &res)?);
        }
        Ok(MoeColsBinding {
            form,
            gate_up,
            down,
            nb: b.nb,
            kernel: 0,
        })
    }

    /// Record one layer's MoE dispatches over the binding's columns (no host sync): gate/up per
    /// weight part (the column as the grid's z), then down per part (per column: z = the
    /// column; union: one workgroup per row block for all columns).
    pub fn record_cols(&self, pass: &mut wgpu::ComputePass<'_>, ctx: &Context, b: &MoeColsBinding) {
        // bind_cols only succeeds with the column pipelines, so a binding implies them.
        let Some(pipes) = &self.cols else {
            return;
        };
        let ((ux, uy), (gx, gy)) = self.grids(ctx);
        pass.set_pipeline(pipes.gate_up(b.form.gate_up));
        for bg in &b.gate_up {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(ux, uy, b.nb);
        }
        let ((dx, dy, dz), pipe) = match (b.form.down, &pipes.down_union) {
            (ColsRead::Union, Some((pipe, rows))) => {
                let (x, y) = ctx.grid(self.params.hidden.div_ceil(*rows));
                ((x, y, 1), pipe)
            }
            _ => ((gx, gy, b.nb), &pipes.down),
        };
        pass.set_pipeline(pipe);
        for bg in &b.down {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(dx, dy, dz);
        }
    }
}

#[cfg(test)]
#[path = "moe_cols_tests.rs"]
mod tests;
