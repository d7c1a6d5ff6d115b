//! The GPU's `trace_step` against the oracle's (issue 6's localiser at the library level):
//! the names it emits are the oracle's, in the oracle's order, and match it within f32/int8
//! rounding on an unplanted model; with one weight corrupted in the GPU copy
//! ([`crate::plant`]), the first intermediate beyond tolerance is in the planted layer and op.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::model_with_vocab;
use crate::plant::PlantTarget;
use crate::testing::gpu;
use nibble_backend::divergence::{first_divergence, rel_l2, OpDivergence};
use nibble_backend::{Backend, RefBackend, StepTrace};

const VOCAB: usize = 512;
const TOL: f64 = 1e-3;

fn opts() -> GpuOptions {
    GpuOptions {
        context_len: 64,
        ..Default::default()
    }
}

/// Feed `prompt` to both, then trace one more token on each.
fn traces(
    gb: &mut GpuBackend,
    rb: &mut RefBackend,
    prompt: &[u32],
    t: u32,
) -> (StepTrace, StepTrace) {
    gb.prefill(prompt).unwrap();
    rb.prefill(prompt).unwrap();
    let g = gb.trace_step(t).unwrap().expect("the GPU traces");
    let r = rb.trace_step(t).unwrap().expect("the oracle traces");
    assert_eq!(gb.position(), prompt.len() + 1);
    (g, r)
}

fn random_prompt(seed: u32) -> Vec<u32> {
    (0..5u32)
        .map(|i| (i * 97 + seed * 31 + 11) % VOCAB as u32)
        .collect()
}

#[test]
fn gpu_trace_uses_the_oracle_names_and_agrees_without_a_plant() {
    let Some(ctx) = gpu("gpu_trace_uses_the_oracle_names_and_agrees_without_a_plant") else {
        return;
    };
    let m = model_with_vocab(31, false, VOCAB);
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), opts()).unwrap();
    let mut rb = RefBackend::new(m.clone(), 64).unwrap();
    let (g, r) = traces(&mut gb, &mut rb, &random_prompt(1), 42);
    // Every GPU name is an oracle name, in the oracle's relative order.
    let order: Vec<usize> = g
        .iter()
        .map(|(n, _)| {
            r.iter()
                .position(|(o, _)| o == n)
                .unwrap_or_else(|| panic!("{n}"))
        })
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
    let layers = gb.config().num_layers;
    for l in 0..layers {
        for op in [
            "attn_norm",
            "q",
            "v",
            "attn",
            "attn_out",
            "h_attn",
            "router_logits",
            "moe_experts",
            "moe_out",
            "h",
        ] {
            let name = format!("l{l}.{op}");
            assert!(g.iter().any(|(n, _)| *n == name), "GPU trace lacks {name}");
        }
    }
    let mut worst = (String::new(), 0f64);
    for (n, v) in &g {
        let want = &r.iter().find(|(o, _)| o == n).unwrap().1;
        let e = rel_l2(v, want);
        if e > worst.1 {
            worst = (n.clone(), e);
        }
    }
    eprintln!("unplanted: worst rel error {:.2e} at {}", worst.1, worst.0);
    assert!(worst.1 < TOL, "{worst:?}");
    assert_eq!(first_divergence(&r, &g, TOL), None);
    // The traced step appended like a step: the next logits agree with the oracle's.
    let (lg, lr) = (gb.step(7).unwrap(), rb.step(7).unwrap());
    assert!(rel_l2(&lg, &lr) < TOL);
}

fn planted(target: PlantTarget) -> OpDivergence {
    let Some(ctx) = gpu("planted") else {
        unreachable!("checked by the caller");
    };
    let m = model_with_vocab(32, false, VOCAB);
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), opts()).unwrap();
    gb.plant_error(2, target).unwrap();
    let mut rb = RefBackend::new(m.clone(), 64).unwrap();
    let (g, r) = traces(&mut gb, &mut rb, &random_prompt(2), 300);
    let d = first_divergence(&r, &g, TOL).expect("a planted error diverges");
    eprintln!("planted {target} in layer 2: first divergence {d:?}");
    d
}

#[test]
fn planted_errors_are_localised_to_their_layer_and_op() {
    if gpu("planted_errors_are_localised_to_their_layer_and_op").is_none() {
        return;
    }
    for (target, op) in [
        (PlantTarget::O, "l2.attn_out"),
        (PlantTarget::Down, "l2.moe_out"),
        (PlantTarget::Qkv, "l2.q"),
        (PlantTarget::Router, "l2.router_logits"),
    ] {
        let d = planted(target);
        assert_eq!(d.name, op, "{target}");
        assert!(d.rel_err > 10.0 * TOL, "{target}: {d:?}");
    }
}

#[test]
fn plant_errors_are_clear() {
    let Some(ctx) = gpu("plant_errors_are_clear") else {
        return;
    };
    let m = model_with_vocab(33, false, VOCAB);
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), opts()).unwrap();
    let e = gb.plant_error(4, PlantTarget::O).unwrap_err().to_string();
    assert!(e.contains("layer 4") && e.contains("has 4"), "{e}");
    assert!("bogus"
        .parse::<PlantTarget>()
        .unwrap_err()
        .contains("expected qkv"));
    assert_eq!("down".parse::<PlantTarget>(), Ok(PlantTarget::Down));
}
