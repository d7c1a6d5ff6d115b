//! Diagnostics of the single-sequence plan: one step processed one layer (or one op) per
//! submit, with the intermediates read back under the oracle's trace names (the parity
//! reports' `first op > 1e-3` column and the per-layer trace tests). The fast path's
//! recording is the same; only the submits differ.

use super::{DecodePlan, LayerTrace};
use crate::context::Result;

impl DecodePlan {
    /// Diagnostics: process `token` at `pos` one layer per submit and return the residual
    /// stream `h [H]` after the embedding and, per layer, `(h after the layer, the layer's
    /// expert ids best first)` (compare with the oracle's `embd`, `l{n}.h`, `l{n}.moe_experts`
    /// trace). Writes the KV rows like a step; no logits.
    pub fn trace_hidden(&self, token: u32, pos: usize) -> Result<(Vec<f32>, Vec<LayerTrace>)> {
        let (h, k) = (
            self.weights.cfg.hidden_size,
            self.weights.cfg.num_experts_per_tok,
        );
        self.set_state(token, pos);
        self.ctx.run_pass(|p| self.k.embed.record(p, &self.embed))?;
        let embd = self.ctx.read_f32(&self.acts.h, h)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for lb in &self.layers {
            self.ctx
                .run_pass(|p| self.record_layer(p, lb, pos as u32))?;
            layers.push((
                self.ctx.read_f32(&self.acts.h, h)?,
                self.ctx.read_u32(&self.acts.route, k)?,
            ));
        }
        Ok((embd, layers))
    }

    /// Diagnostics: process `token` at `pos` one op per submit and return the step's
    /// intermediates under the oracle's trace names: `embd`; per layer `l{n}.` + `attn_norm`,
    /// `q`, `k`, `v` (before QK-norm, from `qkv`), `attn`, `attn_out`, `h_attn`, `ffn_norm`,
    /// `router_logits`, `moe_experts` (ids as f32, best first), `moe_weights`, `moe_out` (the
    /// MoE's residual update, computed on the host as h after minus h before) and `h`; then
    /// `final_norm` and `logits`. Writes the KV row like a step. The slow path (a submit and a
    /// readback per op); the fast path's recording is unchanged.
    pub fn trace_step(&self, token: u32, pos: usize) -> Result<Vec<(String, Vec<f32>)>> {
        let cfg = &self.weights.cfg;
        let (h, q, kv) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let (e, k) = (cfg.num_experts, cfg.num_experts_per_tok);
        let (a, ctx, pb) = (&self.acts, &self.ctx, pos as u32);
        let mut out = Vec::with_capacity(2 + 13 * self.layers.len() + 2);
        self.set_state(token, pos);
        ctx.run_pass(|p| self.k.embed.record(p, &self.embed))?;
        out.push(("embd".to_string(), ctx.read_f32(&a.h, h)?));
        for (l, lb) in self.layers.iter().enumerate() {
            let name = |s: &str| format!("l{l}.{s}");
            // The fused qkv normalises on load; the standalone norm shows what it computes.
            let norm1 = lb.norm1.as_ref().unwrap_or(&lb.trace_norm1);
            ctx.run_pass(|p| self.k.norm.record(p, norm1))?;
            out.push((name("attn_norm"), ctx.read_f32(&a.xn, h)?));
            ctx.run_pass(|p| self.k.matvec.record(p, &lb.qkv))?;
            let qkv = ctx.read_f32(&a.qkv, q + 2 * kv)?; // [Q + 2 KV]
            out.push((name("q"), qkv[..q].to_vec()));
            out.push((name("k"), qkv[q..q + kv].to_vec()));
            out.push((name("v"), qkv[q + kv..].to_vec()));
            ctx.run_pass(|p| self.k.attn.record(p, &lb.attn, pb))?;
            out.push((name("attn"), ctx.read_f32(&a.att, q)?));
            let h_before = ctx.read_f32(&a.h, h)?;
            ctx.run_pass(|p| self.k.matvec.record(p, &lb.o))?;
            let h_attn = match (&lb.norm2, &lb.router) {
                (Some(norm2), _) => {
                    out.push((name("attn_out"), ctx.read_f32(&a.a, h)?));
                    ctx.run_pass(|p| self.k.norm.record(p, norm2))?;
                    ctx.read_f32(&a.h, h)?
                }
                (None, Some(_)) => {
                    // The fused o-proj added into h: its output is the difference.
                    let h_attn = ctx.read_f32(&a.h, h)?;
                    let o = h_attn.iter().zip(&h_before).map(|(x, y)| x - y).collect();
                    out.push((name("attn_out"), o));
                    h_attn
                }
                (None, None) => {
                    // Folded: the MoE's down adds a into h; h + a here is what it computes.
                    let o = ctx.read_f32(&a.a, h)?;
                    let h_attn = h_before.iter().zip(&o).map(|(x, y)| x + y).collect();
                    out.push((name("attn_out"), o));
                    h_attn
                }
            };
            out.push((name("h_attn"), h_attn.clone()));
            if let Some(router) = &lb.router {
                ctx.run_pass(|p| self.k.matvec.record(p, router))?;
            }
            // The folded gate/up publishes both; else norm2 or the fused router wrote them.
            let moe_run = || ctx.run_pass(|p| self.k.moe.record(p, ctx, &lb.moe));
            if lb.router.is_none() {
                moe_run()?;
            }
            out.push((name("ffn_norm"), ctx.read_f32(&a.xn, h)?));
            out.push((name("router_logits"), ctx.read_f32(&a.router, e)?));
            if lb.router.is_some() {
                moe_run()?;
            }
            let route = ctx.read_u32(&a.route, 2 * k)?; // [2K]: ids, then f32 weight bits
            out.push((
                name("moe_experts"),
                route[..k].iter().map(|i| *i as f32).collect(),
            ));
            out.push((
                name("moe_weights"),
                route[k..].iter().map(|b| f32::from_bits(*b)).collect(),
            ));
            let h_out = ctx.read_f32(&a.h, h)?;
            let moe: Vec<f32> = h_out.iter().zip(&h_attn).map(|(x, y)| x - y).collect();
            out.push((name("moe_out"), moe));
            out.push((name("h"), h_out));
        }
        ctx.run_pass(|p| self.k.norm.record(p, &self.final_norm))?;
        out.push(("final_norm".to_string(), ctx.read_f32(&a.xn, h)?));
        ctx.run_pass(|p| self.record_head(p))?;
        out.push((
            "logits".to_string(),
            ctx.read_f32(&a.logits, cfg.vocab_size)?,
        ));
        Ok(out)
    }
}
