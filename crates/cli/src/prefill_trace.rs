//! `nibble parity --trace-prefill`: each prompt prefilled by the fast backend's batched path
//! one layer per submit ([`Backend::trace_prefill`]) against the oracle's token-by-token run,
//! with the first layer and token where the batch departs and how near a tie the oracle's
//! routing was there (`nibble_backend::divergence::prefill_departure`). A diagnostic for a
//! parity failure inside the prefill: an expert flip at a gap of ~1e-6 is rounding, a large
//! residual error with the same experts is a kernel to look at.

use anyhow::Result;
use nibble_backend::divergence::prefill_departure;
use nibble_backend::Backend;

/// Trace `prompt` on both backends and describe the comparison in lines of text (both are
/// left at position `prompt.len()`).
pub fn describe(
    oracle: &mut dyn Backend,
    fast: &mut dyn Backend,
    prompt: &[u32],
    k: usize,
    tol: f64,
) -> Result<Vec<String>> {
    fast.truncate(0)?;
    let Some(layers) = fast.trace_prefill(prompt)? else {
        return Ok(vec![format!(
            "prefill trace: a prompt of {} tokens does not take a traceable batched prefill \
             on {} (the GEMM prefill's; try --prefill-gemm-min 2)",
            prompt.len(),
            fast.name()
        )]);
    };
    oracle.truncate(0)?;
    let mut steps = Vec::with_capacity(prompt.len());
    for &t in prompt {
        match oracle.trace_step(t)? {
            Some(s) => steps.push(s),
            None => anyhow::bail!("the oracle does not trace"),
        }
    }
    let d = prefill_departure(&steps, &layers, k, tol)?;
    let per_layer: Vec<String> = d
        .layer_max_rel
        .iter()
        .enumerate()
        .map(|(l, e)| format!("l{l} {e:.1e}"))
        .collect();
    let mut out = vec![format!(
        "prefill trace ({} tokens): worst residual rel err per layer: {}",
        prompt.len(),
        per_layer.join(", ")
    )];
    out.push(match &d.first {
        None => format!("first departure: none beyond {tol:.0e}, every expert the oracle's"),
        Some(p) => format!(
            "first departure: layer {} token {}: residual rel err {:.2e}, experts {:?} vs the \
             oracle's {:?}{} (oracle's router gap there {})",
            p.layer,
            p.token,
            p.rel_err,
            p.fast_experts,
            p.oracle_experts,
            if same_set(&p.fast_experts, &p.oracle_experts) {
                " (the same set)"
            } else {
                " (a flip)"
            },
            p.oracle_gap.map_or("-".into(), |g| format!("{g:.2e}"))
        ),
    });
    if let Some((g, l, j)) = d.min_gap {
        out.push(format!(
            "the oracle's nearest routing tie: gap {g:.2e} at layer {l} token {j}"
        ));
    }
    Ok(out)
}

fn same_set(a: &[u32], b: &[u32]) -> bool {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_unstable();
    b.sort_unstable();
    a == b
}
