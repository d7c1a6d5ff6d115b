//! The sparse MoE block of one token (formats-spec §1.7): router softmax over all experts, top-k,
//! optional renormalisation, SwiGLU experts, weighted sum.
//!
//! Only the rows of the chosen experts are decoded. The combine accumulates in f64 in routing
//! order (descending probability, ties to the lower expert index), so it is deterministic.

use super::ops::{matvec, silu_f64, softmax};
use nibble_model::weights::Weight;

/// The experts chosen for one token and their mixing weights, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Expert indices, by descending probability; equal probabilities go to the lower index.
    pub experts: Vec<usize>,
    /// Mixing weight of each chosen expert (renormalised to sum 1 iff `norm_topk_prob`).
    pub weights: Vec<f32>,
}

/// Top-`k` of the router probabilities `probs` `[E]`; with `renormalise` the chosen
/// probabilities are divided by their sum (in f64), otherwise used as they are.
pub fn route(probs: &[f32], k: usize, renormalise: bool) -> Routing {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Stable sort on descending probability keeps ties in index order.
    order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
    order.truncate(k);
    let sum: f64 = order.iter().map(|e| probs[*e] as f64).sum();
    let weights = order
        .iter()
        .map(|e| {
            if renormalise {
                (probs[*e] as f64 / sum) as f32
            } else {
                probs[*e]
            }
        })
        .collect();
    Routing {
        experts: order,
        weights,
    }
}

/// Router logits `[E]` -> probabilities `[E]` -> [`Routing`].
pub fn route_logits(logits: &[f32], k: usize, renormalise: bool) -> (Vec<f32>, Routing) {
    let probs = softmax(logits);
    let routing = route(&probs, k, renormalise);
    (probs, routing)
}

/// The stacked expert tensors of one layer: gate/up `[E, I, H]`, down `[E, H, I]`.
pub struct ExpertWeights<'a> {
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
}

/// Expert `e` on `x` `[H]`: `out = down_e · (silu(gate_e · x) ⊙ (up_e · x))`, `out` `[H]`.
pub fn expert_ffn(
    w: &ExpertWeights<'_>,
    e: usize,
    x: &[f32],
    out: &mut [f32],
) -> anyhow::Result<()> {
    let inner = w.gate.shape.get(1).copied().unwrap_or(0);
    let mut g = vec![0f32; inner]; // [I]
    let mut u = vec![0f32; inner]; // [I]
    matvec(&w.gate, e * inner, x, &mut g)?;
    matvec(&w.up, e * inner, x, &mut u)?;
    let act: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| (silu_f64(*g as f64) * *u as f64) as f32)
        .collect(); // [I]
    matvec(&w.down, e * out.len(), &act, out)
}

/// `out = Σ_k weights[k] · expert_{experts[k]}(x)`, `x` and `out` `[H]`.
pub fn moe_combine(
    w: &ExpertWeights<'_>,
    routing: &Routing,
    x: &[f32],
    out: &mut [f32],
) -> anyhow::Result<()> {
    let mut acc = vec![0f64; out.len()]; // [H]
    let mut y = vec![0f32; out.len()]; // [H] one expert's output
    for (e, wk) in routing.experts.iter().zip(&routing.weights) {
        expert_ffn(w, *e, x, &mut y)?;
        for (a, yi) in acc.iter_mut().zip(&y) {
            *a += *wk as f64 * *yi as f64;
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = *a as f32;
    }
    Ok(())
}
