//! The MoE layer of a prefill chunk as expert-grouped GEMMs: each expert's weights are
//! dequantised once per tile of up to `BM` of the tokens that chose it, instead of once per
//! token as in decode (`moe.rs`, `moe_cols.rs`). A 512-token chunk gives each of Qwen3's 128
//! experts ~32 tokens.
//!
//! Five dispatches per layer (shaders/moe_prefill.wgsl, gemm_q4.wgsl, moe_combine.wgsl):
//! 1. `route` (grid T): every token's top-K from the router logits `[T, E]` (summed over the
//!    router GEMM's K splits; the decode rule),
//!    its mixing weights, and a place in each chosen expert's list (an atomic count per expert);
//! 2. `build` (one workgroup): list offsets, tiles, the list and its inverse (the plan);
//! 3. the `GateUp` GEMM: `act[j] = silu(gate_e · xn[t]) * (up_e · xn[t])` for list row `j` =
//!    assignment `(t, r)` of expert `e`;
//! 4. the `Down` GEMM: `dn[j] = down_e · act[j]`;
//! 5. `combine` (grid T x H/1024): `h[t] += Σ_r w[t, r] dn[j(t, r)]` in rank order.
//!
//! Buffers (sized for `tokens_max` tokens, `TK = tokens_max * K` assignments): `logits [T, E]`,
//! `xn [T, H]` (the normalised input the router published) and `h [T, H]` belong to the caller;
//! the plan (layout in moe_prefill.wgsl), `rid`/`rw [TK]`, `cnt [E]` (atomic, zero between
//! layers: `build` clears it), `act [TK, I]`, `dn [TK, H]` belong to this struct.

use crate::context::{Context, GpuError, Result};
use crate::kernels::gemm::{GemmArgs, GemmBinding, GemmForm, GemmKernel, GemmWeights, PlanLayout};
use crate::tensor::Q4Matrix;

/// Threads per workgroup of the route/build kernels (moe_route.wgsl needs `WG >= K`).
const WG: u32 = 256;

/// Shapes of one MoE layer.
#[derive(Debug, Clone, Copy)]
pub struct MoeDims {
    pub hidden: u32,
    pub inter: u32,
    pub experts: u32,
    pub top_k: u32,
    pub norm_topk: bool,
}

/// The shared buffers, pipelines and bind groups of a chunk's MoE (every layer uses them).
pub struct MoePrefill {
    dims: MoeDims,
    tokens_max: u32,
    /// Tokens per thread of the expert GEMMs (tile of `16 * tm` list rows).
    tm: u32,
    layout: PlanLayout,
    max_tiles: u32,
    route: (wgpu::ComputePipeline, wgpu::BindGroup),
    build: (wgpu::ComputePipeline, wgpu::BindGroup),
    combine: (wgpu::ComputePipeline, wgpu::BindGroup),
    /// `[1 + E + 1 + max_tiles + 2 TK]` u32, see moe_prefill.wgsl.
    plan: wgpu::Buffer,
    /// `[TK, I]` f32.
    act: wgpu::Buffer,
    /// `[TK, H]` f32.
    dn: wgpu::Buffer,
    /// `[TK]` u32: each token's K expert ids in rank order (the route's; read by the
    /// diagnostics, prefill_diag.rs).
    rid: wgpu::Buffer,
    _keep: Vec<wgpu::Buffer>,
}

/// One layer's expert GEMMs.
pub struct MoePrefillLayer {
    gate_up: GemmBinding,
    down: GemmBinding,
}

/// The caller's buffers the MoE reads and writes.
pub struct MoePrefillBuffers<'a> {
    /// `[S, T, E]` router logits: `S = logit_splits` partial sums per logit (the router GEMM's
    /// K splits, gemm.rs `bind_split`), token rows `T = tokens_max` apart; `route` adds them.
    pub logits: &'a wgpu::Buffer,
    pub logit_splits: u32,
    /// `[T, H]` the residual stream, `+=` the MoE output.
    pub h: &'a wgpu::Buffer,
    /// The `[m, 0, 0, 0]` uniform: tokens in the chunk.
    pub dims: &'a wgpu::Buffer,
}

impl MoePrefill {
    /// Buffers and pipelines for chunks of up to `tokens_max` tokens.
    pub fn new(
        ctx: &Context,
        d: MoeDims,
        tokens_max: u32,
        b: &MoePrefillBuffers<'_>,
    ) -> Result<MoePrefill> {
        if d.top_k == 0 || d.top_k > d.experts || d.top_k > WG || d.experts > 65536 {
            return Err(GpuError::Shape(format!(
                "moe prefill: top-{} of {} experts",
                d.top_k, d.experts
            )));
        }
        if d.hidden % 4 != 0 || d.hidden == 0 || d.inter == 0 {
            return Err(GpuError::Shape(format!(
                "moe prefill: hidden {} (a multiple of 4) and inter {}",
                d.hidden, d.inter
            )));
        }
        if tokens_max == 0 || tokens_max > 65535 {
            return Err(GpuError::Shape(format!(
                "moe prefill: {tokens_max} tokens per chunk (1..=65535)"
            )));
        }
        // Expert lists of up to 128 rows fill a 32-row tile 4 times; longer chunks take 64.
        let tm = if tokens_max * d.top_k / d.experts >= 64 {
            4
        } else {
            2
        };
        let tk = tokens_max * d.top_k;
        let max_tiles = tk.div_ceil(16 * tm) + d.experts.min(tk);
        let off = 1;
        let tiles = off + d.experts + 1;
        let list = tiles + max_tiles;
        let inv = list + tk;
        let layout = PlanLayout {
            k: d.top_k,
            off,
            tiles,
            list,
        };
        let (e, h, i) = (d.experts as u64, d.hidden as u64, d.inter as u64);
        let t = tokens_max as u64;
        if b.logit_splits == 0 {
            return Err(GpuError::Shape("moe prefill: 0 router logit splits".into()));
        }
        need(b.logits, b.logit_splits as u64 * t * e, "router logits")?;
        need(b.h, t * h, "h")?;
        let plan = ctx.storage("moe_prefill.plan", (inv + tk) as u64 * 4)?;
        let rid = ctx.storage("moe_prefill.rid", tk as u64 * 4)?;
        let rw = ctx.storage("moe_prefill.rw", tk as u64 * 4)?;
        let cnt = ctx.storage("moe_prefill.cnt", e * 4)?;
        let act = ctx.storage("moe_prefill.act", tk as u64 * i * 4)?;
        let dn = ctx.storage("moe_prefill.dn", tk as u64 * h * 4)?;
        let consts = format!(
            "const E: u32 = {}u;\nconst K: u32 = {}u;\nconst WG: u32 = {WG}u;\nconst NORM_TOPK: bool = {};\n\
             const H4: u32 = {}u;\nconst MBM: u32 = {}u;\nconst P_OFF: u32 = {off}u;\nconst P_TILES: u32 = {tiles}u;\n\
             const P_LIST: u32 = {list}u;\nconst P_INV: u32 = {inv}u;\n",
            d.experts,
            d.top_k,
            d.norm_topk,
            d.hidden / 4,
            16 * tm
        );
        let src = [
            consts.as_str(),
            &format!(
                "const RS: u32 = {}u;\nconst TMAX: u32 = {tokens_max}u;\n",
                b.logit_splits
            ),
            include_str!("../shaders/moe_route.wgsl"),
            include_str!("../shaders/moe_prefill.wgsl"),
        ]
        .concat();
        let module = ctx.module("moe_prefill", &src)?;
        let route_p = ctx.pipeline("moe_prefill.route", &module, "route")?;
        let build_p = ctx.pipeline("moe_prefill.build", &module, "build")?;
        let route_bg = ctx.bind_group(
            "moe_prefill.route",
            &route_p,
            &[
                b.logits.as_entire_binding(),
                rid.as_entire_binding(),
                rw.as_entire_binding(),
                cnt.as_entire_binding(),
                plan.as_entire_binding(),
                b.dims.as_entire_binding(),
            ],
        )?;
        let build_bg = ctx.bind_group_at(
            "moe_prefill.build",
            &build_p,
            &[1, 3, 4, 5],
            &[
                rid.as_entire_binding(),
                cnt.as_entire_binding(),
                plan.as_entire_binding(),
                b.dims.as_entire_binding(),
            ],
        )?;
        let csrc = [
            consts.as_str(),
            &format!("const TMAX: u32 = {tokens_max}u;\n"),
            include_str!("../shaders/moe_combine.wgsl"),
        ]
        .concat();
        // Compiled without naga's runtime bounds checks (it streams the chunk's [T K, H] down
        // products once per layer).
        // SAFETY: every index of moe_combine.wgsl stays in bounds whatever `dims` and the plan
        // hold: the token t < min(dims.m, TMAX) (TMAX = tokens_max), so i = t K + r < TK =
        // tokens_max K indexes rw (TK words) and plan at P_INV + i (the plan holds P_INV + TK);
        // the list row j is clamped below TK (dn holds TK rows of H4 vec4s) and c < H4; h holds
        // tokens_max rows of H (`need` above). The loop runs to K; no run-time divisor.
        let combine_p = unsafe { ctx.compute_unchecked("moe_prefill.combine", &csrc, "combine")? };
        let combine_bg = ctx.bind_group(
            "moe_prefill.combine",
            &combine_p,
            &[
                dn.as_entire_binding(),
                rw.as_entire_binding(),
                plan.as_entire_binding(),
                b.h.as_entire_binding(),
                b.dims.as_entire_binding(),
            ],
        )?;
        Ok(MoePrefill {
            dims: d,
            tokens_max,
            tm,
            layout,
            max_tiles,
            route: (route_p, route_bg),
            build: (build_p, build_bg),
            combine: (combine_p, combine_bg),
            plan,
            act,
            dn,
            rid,
            _keep: vec![rw, cnt],
        })
    }

    /// `[tokens_max, K]` u32: the last recorded layer's expert ids per token, rank order
    /// (diagnostics).
    pub fn route_ids(&self) -> &wgpu::Buffer {
        &self.rid
    }

    /// Experts per token.
    pub fn top_k(&self) -> u32 {
        self.dims.top_k
    }

    /// Bind one layer's expert GEMMs: `xn [T, H]` is the normalised input (the router's), the
    /// expert tensors `gate`/`up [E*I, H]` and `down [E*H, I]`.
    pub fn bind_layer(
        &self,
        ctx: &Context,
        gemm: &GemmKernel,
        xn: &wgpu::Buffer,
        gate: &Q4Matrix,
        up: &Q4Matrix,
        down: &Q4Matrix,
    ) -> Result<MoePrefillLayer> {
        let d = &self.dims;
        let tk = self.tokens_max * d.top_k;
        if gate.cols != d.hidden || down.cols != d.inter || down.rows != d.experts * d.hidden {
            return Err(GpuError::Shape(format!(
                "moe prefill: experts [{}, {}] / down [{}, {}] for E {} H {} I {}",
                gate.rows, gate.cols, down.rows, down.cols, d.experts, d.hidden, d.inter
            )));
        }
        if gate.rows != d.experts * d.inter {
            return Err(GpuError::Shape(format!(
                "moe prefill: gate has {} rows, need E x I = {}",
                gate.rows,
                d.experts * d.inter
            )));
        }
        need(xn, self.tokens_max as u64 * d.hidden as u64, "xn")?;
        let gate_up = gemm.bind(
            ctx,
            &GemmArgs {
                form: GemmForm::GateUp,
                w: GemmWeights::GateUp { gate, up },
                x: xn,
                y: &self.act,
                y_stride: d.inter,
                x_rows: self.tokens_max,
                y_rows: tk,
                dims: None,
                plan: Some((&self.plan, self.layout)),
                rows_per_expert: d.inter,
                max_tiles: self.max_tiles,
            },
            self.tm,
        )?;
        let down = gemm.bind(
            ctx,
            &GemmArgs {
                form: GemmForm::Down,
                w: GemmWeights::Q4(down),
                x: &self.act,
                y: &self.dn,
                y_stride: d.hidden,
                x_rows: tk,
                y_rows: tk,
                dims: None,
                plan: Some((&self.plan, self.layout)),
                rows_per_expert: d.hidden,
                max_tiles: self.max_tiles,
            },
            self.tm,
        )?;
        Ok(MoePrefillLayer { gate_up, down })
    }

    /// Record one layer's MoE over `tokens` tokens (`<= tokens_max`; the `dims` uniform must
    /// hold the same count).
    pub fn record(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        gemm: &GemmKernel,
        l: &MoePrefillLayer,
        tokens: u32,
    ) {
        self.record_marked(pass, gemm, l, tokens, &mut |_, _| {});
    }

    /// [`Self::record`] with `mark` called after each op (the prefill profile's timestamps).
    pub fn record_marked(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        gemm: &GemmKernel,
        l: &MoePrefillLayer,
        tokens: u32,
        mark: &mut dyn FnMut(&mut wgpu::ComputePass<'_>, &'static str),
    ) {
        pass.set_pipeline(&self.route.0);
        pass.set_bind_group(0, &self.route.1, &[]);
        pass.dispatch_workgroups(tokens, 1, 1);
        mark(pass, "moe route");
        pass.set_pipeline(&self.build.0);
        pass.set_bind_group(0, &self.build.1, &[]);
        pass.dispatch_workgroups(1, 1, 1);
        mark(pass, "moe plan");
        gemm.record(pass, &l.gate_up, tokens);
        mark(pass, "moe gate/up gemm");
        gemm.record(pass, &l.down, tokens);
        mark(pass, "moe down gemm");
        pass.set_pipeline(&self.combine.0);
        pass.set_bind_group(0, &self.combine.1, &[]);
        pass.dispatch_workgroups(tokens, (self.dims.hidden / 4).div_ceil(256), 1);
        mark(pass, "moe combine");
    }

    /// Most tokens one chunk may hold.
    pub fn tokens_max(&self) -> u32 {
        self.tokens_max
    }

    /// The plan buffer (tests read it).
    #[cfg(test)]
    pub(crate) fn plan_buffer(&self) -> &wgpu::Buffer {
        &self.plan
    }
}

fn need(buf: &wgpu::Buffer, elems: u64, what: &str) -> Result<()> {
    if buf.size() < elems * 4 {
        return Err(GpuError::Shape(format!(
            "moe prefill: {what} holds {} bytes, need {elems} words",
            buf.size()
        )));
    }
    Ok(())
}

#[cfg(test)]
#[path = "moe_prefill_tests.rs"]
mod tests;
