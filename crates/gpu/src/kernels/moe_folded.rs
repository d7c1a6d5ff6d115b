//! The MoE block's folded-router forms (router_fold.rs; moe.rs module docs): their pipelines,
//! their per-layer inputs and [`MoeKernel::bind_folded`], with the L2 warming the folded plan
//! adds to them (kernels/warm.rs): the down's `main_add_warm` workgroups and the gate/up's
//! `gate_up_folded_warm`.

use super::{
    down_params, gate_up_params_eps, need, warm, whole, MoeBinding, MoeBuffers, MoeKernel,
    MoeParams, Routing, BLOCK, DOWN_WARM_BINDINGS, WG,
};
use crate::context::{Context, GpuError, Result};
use crate::tensor::{Q4Part, QForm};

/// The folded router's pipelines.
#[derive(Debug)]
pub(super) struct Folded {
    pub(super) gate_up: wgpu::ComputePipeline,
    /// `gate_up_folded_warm`: also reads its expert's down weights into L2.
    pub(super) gate_up_warm: wgpu::ComputePipeline,
    pub(super) add: wgpu::ComputePipeline,
    pub(super) add_warm: wgpu::ComputePipeline,
}

/// The folded router's extra inputs of one layer (router_fold.rs).
#[derive(Debug, Clone, Copy)]
pub struct MoeFolded<'a> {
    /// `[H]` the o-proj output (not yet added into the residual stream).
    pub a: &'a wgpu::Buffer,
    /// `[H]` the post-attention RMSNorm weight, and its eps.
    pub norm_w: &'a wgpu::Buffer,
    pub eps: f32,
    /// `[E]` the router's pre-norm logits `fold · [att | h]`.
    pub z: &'a wgpu::Buffer,
    /// `[H]` receives `rmsnorm(h + a)` (diagnostics).
    pub xn_out: &'a wgpu::Buffer,
    /// A matrix part a later dispatch reads (the next layer's qkv) for the down dispatch to
    /// read into L2 in extra workgroups (kernels/warm.rs), and the warm sink; `None`: no warming.
    pub warm: Option<(&'a Q4Part, &'a wgpu::Buffer)>,
    /// The warm sink for the gate/up to read its experts' down weights into L2 for the down
    /// dispatch (`gate_up_folded_warm`; only where down is one binding); `None`: no warming.
    pub warm_down: Option<&'a wgpu::Buffer>,
}

/// Sector loads per thread of `gate_up_folded_warm` (`DW_LOADS`): one expert's down blocks
/// (`H x I/32` of `form`, `QForm::block_bytes` each, in 32-byte sectors) and scale
/// words (`QForm::scale_word_bytes` per pair of blocks) over the `nx` workgroups of a slot.
pub(super) fn down_warm_loads(p: &MoeParams, nx: u32, form: QForm) -> u32 {
    let blocks = p.hidden * (p.inter / BLOCK as u32);
    let q_bytes = blocks * form.block_bytes() as u32;
    let scale_bytes = blocks.div_ceil(2) * form.scale_word_bytes() as u32;
    let sectors = q_bytes.div_ceil(32) + scale_bytes.div_ceil(32);
    sectors.div_ceil(nx.max(1)).div_ceil(WG).max(1)
}

impl MoeKernel {
    /// Bind one layer for the folded router (router_fold.rs): gate/up stages
    /// `x = rmsnorm(h + a)` itself (`h` = `b.out`, the residual stream before the o-proj) and
    /// routes on `z / rms(h + a)`; the first down part writes `out = (h + a) + y`. `b.logits`
    /// and `f.xn_out` receive the logits and `x` (diagnostics); `b.x` is not read.
    pub fn bind_folded(
        &self,
        ctx: &Context,
        b: &MoeBuffers<'_>,
        f: &MoeFolded<'_>,
    ) -> Result<MoeBinding> {
        let Some(fp) = &self.folded else {
            return Err(GpuError::Shape(
                "MoE: the folded router needs the staged f32 kernels".into(),
            ));
        };
        let p = &self.params;
        let (e, k, h, i) = (p.experts, p.top_k, p.hidden, p.inter);
        self.check_weights(b.gate, b.up, b.down)?;
        need(b.state, 16, "state")?;
        need(b.logits, e as u64 * 4, "logits")?;
        need(f.z, e as u64 * 4, "z")?;
        need(b.route, 2 * k as u64 * 4, "route")?;
        need(b.h, (k * i) as u64 * 4, "h")?;
        for (buf, what) in [
            (b.out, "out"),
            (f.a, "a"),
            (f.norm_w, "norm weight"),
            (f.xn_out, "xn"),
        ] {
            need(buf, h as u64 * 4, what)?;
        }
        if !f.eps.is_finite() || f.eps < 0.0 {
            return Err(GpuError::Shape(format!(
                "MoE: eps {} is not a finite >= 0",
                f.eps
            )));
        }
        // The gate/up warms its experts' down weights where both are one binding (so the
        // expert id indexes the down part directly).
        let warm_down = match (f.warm_down, b.down.parts.as_slice()) {
            (Some(sink), [dpart]) if b.gate.parts.len() == 1 => Some((dpart, sink)),
            _ => None,
        };
        let mut gate_up = Vec::new();
        for (n, (g, u)) in b.gate.parts.iter().zip(&b.up.parts).enumerate() {
            let params = gate_up_params_eps(ctx, g, u, i, n, f.eps)?;
            let mut res = vec![
                (0, whole(b.state)),
                (1, whole(&params)),
                (3, whole(b.route)),
                (6, whole(&g.qs)),
                (7, whole(&g.scales)),
                (8, whole(&u.qs)),
                (9, whole(&u.scales)),
                (10, whole(b.h)),
                (14, whole(b.out)),
                (15, whole(f.a)),
                (16, whole(f.norm_w)),
                (17, whole(f.z)),
                (18, whole(f.xn_out)),
                (19, whole(b.logits)),
            ];
            let pipe = match warm_down {
                Some((dpart, sink)) => {
                    res.extend([
                        (20, whole(&dpart.qs)),
                        (21, whole(&dpart.scales)),
                        (22, whole(sink)),
                    ]);
                    &fp.gate_up_warm
                }
                None => &fp.gate_up,
            };
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            gate_up.push(ctx.bind_group_at("moe.gate_up_folded", pipe, &ids, &res)?);
        }
        let mut down = Vec::new();
        for (n, part) in b.down.parts.iter().enumerate() {
            let params = down_params(ctx, part, h, n > 0)?;
            let mut res = vec![
                (0, whole(b.state)),
                (1, whole(&params)),
                (2, whole(b.route)),
                (3, whole(b.h)),
                (5, whole(&part.qs)),
                (6, whole(&part.scales)),
                (7, whole(b.out)),
            ];
            let pipe = match (n, f.warm) {
                (0, Some((wpart, sink))) => {
                    res.push((9, whole(f.a)));
                    res.extend(warm::entries(wpart, sink, DOWN_WARM_BINDINGS));
                    &fp.add_warm
                }
                (0, None) => {
                    res.push((9, whole(f.a)));
                    &fp.add
                }
                _ => &self.down,
            };
            res.extend(self.down_split_entries());
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            down.push(ctx.bind_group_at("moe.down", pipe, &ids, &res)?);
        }
        Ok(MoeBinding {
            routing: Routing::Fused,
            folded: true,
            warm: f.warm.map_or(0, |(wpart, _)| warm::workgroups(wpart)),
            gate_up_warm: warm_down.is_some(),
            router: None,
            gate_up,
            down,
            kernel: 0,
        })
    }
}
