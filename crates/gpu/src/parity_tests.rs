//! Oracle parity of the GPU backend, issue 4's acceptance bar: on synth's tiny model with the
//! real 151936-token vocabulary, for several prompts, the GPU greedy sequence equals the
//! oracle's (`RefBackend`) for 128 tokens and every step's logits have cosine >= 0.99999 with
//! the oracle's, with the default options. The same runs measure every [`Numerics`] variant
//! (printed; docs/BENCHMARKS.md records them). Also: batched prefill == token-by-token, and the
//! per-layer diagnosis of where int8 activations diverge.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::model_with_vocab;
use crate::kernels::attention::Combine;
use crate::numerics::Numerics;
use crate::plan::PREFILL_CHUNK;
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::kv_cache::CacheType;
use std::sync::{Arc, Mutex};

const VOCAB: usize = 151_936;
const STEPS: usize = 128;
const PROMPTS: [&[u32]; 3] = [
    &[1, 2, 3],
    &[151_000, 17, 9000, 4],
    &[9, 9, 9, 9, 250, 77_777],
];

fn opts(numerics: Numerics) -> GpuOptions {
    GpuOptions {
        context_len: 256,
        numerics,
        ..Default::default()
    }
}

/// The attention merge under test: `None` is the backend's default (fused on lavapipe).
type Merge = Option<Combine>;

/// The oracle's greedy run: ids and the logits each id was chosen from.
struct OracleRun {
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn oracle(rb: &mut RefBackend, prompt: &[u32]) -> OracleRun {
    let mut logits = vec![rb.prefill(prompt).unwrap()];
    let mut ids = vec![argmax(&logits[0])];
    while ids.len() < STEPS {
        logits.push(rb.step(*ids.last().unwrap()).unwrap());
        ids.push(argmax(logits.last().unwrap()));
    }
    OracleRun { ids, logits }
}

/// (greedy ids agreeing with the oracle's, worst per-step logits cosine along the oracle path).
fn measure(gb: &mut GpuBackend, prompt: &[u32], want: &OracleRun) -> (usize, f64) {
    gb.truncate(0).unwrap();
    gb.prefill(&prompt[..prompt.len() - 1]).unwrap();
    let ids = gb
        .decode_greedy(*prompt.last().unwrap(), STEPS, &[])
        .unwrap();
    let agree = ids
        .iter()
        .zip(&want.ids)
        .take_while(|(a, b)| a == b)
        .count();
    // Teacher-forced along the oracle's path, so every step is compared on the same input.
    gb.truncate(0).unwrap();
    let mut worst = cosine(&gb.prefill(prompt).unwrap(), &want.logits[0]);
    for s in 1..STEPS {
        let l = gb.step(want.ids[s - 1]).unwrap();
        worst = worst.min(cosine(&l, &want.logits[s]));
    }
    (agree, worst)
}

/// Measure `variants` on the first `prompts` of the 3 prompts with the attention merged as
/// `merge`; assert the bar for the default numerics. Returns nothing: the per-variant summary
/// lines (`PARITY ...`) are printed for docs/BENCHMARKS.md.
fn parity(test: &str, variants: &[Numerics], merge: Merge, prompts: usize) {
    parity_with(test, variants, merge, prompts, (CacheType::default(), ""))
}

/// [`parity`] with KV caches of type `cache` on both sides and the GPU's work splits and kernel
/// forms overridden by `tune` (`--tune`'s text; empty: the defaults).
fn parity_with(
    test: &str,
    variants: &[Numerics],
    merge: Merge,
    prompts: usize,
    (cache, tune): (CacheType, &str),
) {
    let Some(ctx) = gpu(test) else {
        return;
    };
    // Seed 0: the synthetic model the product ships (`SynthParams::default()`, `synth --seed 0`).
    let m = model_with_vocab(0, false, VOCAB);
    let runs: Vec<OracleRun> = PROMPTS[..prompts]
        .iter()
        .map(|p| {
            oracle(
                &mut RefBackend::with_cache(m.clone(), 256, cache).unwrap(),
                p,
            )
        })
        .collect();
    for &n in variants {
        let o = GpuOptions {
            attention_combine: merge,
            cache,
            tune: tune.parse().unwrap(),
            ..opts(n)
        };
        let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
        let (mut min_agree, mut min_cos) = (STEPS, 1f64);
        for (p, want) in PROMPTS.iter().zip(&runs) {
            let (agree, worst) = measure(&mut gb, p, want);
            eprintln!("{n} ({cache} cache): prompt {p:?}: greedy agrees {agree}/{STEPS}, worst cosine {worst:.9}");
            min_agree = min_agree.min(agree);
            min_cos = min_cos.min(worst);
            if n == Numerics::DEFAULT {
                assert_eq!(agree, STEPS, "default {n}: greedy diverges, prompt {p:?}");
                assert!(
                    worst >= 0.99999,
                    "default {n}: cosine {worst}, prompt {p:?}"
                );
            }
        }
        let pass = min_agree == STEPS && min_cos >= 0.99999;
        eprintln!(
            "PARITY {n} ({cache} cache): min cosine {min_cos:.9}, min greedy agreement {min_agree}/{STEPS}: {}",
            if pass { "PASS" } else { "FAIL" }
        );
    }
}

#[test]
fn default_numerics_meets_the_oracle_parity_bar() {
    parity(
        "default_numerics_meets_the_oracle_parity_bar",
        &[Numerics::DEFAULT],
        None,
        PROMPTS.len(),
    );
}

/// An f16 KV cache (`--cache-type f16`) against the oracle holding the same cache keeps the bar
/// on this model (rounding to f16 magnifies the backends' tiny differences, so on other models
/// it may not: nibble_model::kv_cache).
#[test]
fn f16_cache_meets_the_oracle_parity_bar() {
    parity_with(
        "f16_cache_meets_the_oracle_parity_bar",
        &[Numerics::DEFAULT],
        None,
        PROMPTS.len(),
        (CacheType::F16, ""),
    );
}

/// The streamed attention body (`--tune attn_form=2`, with the 64-row key blocks it would run
/// at Qwen3's shapes where this model's workgroup allows) keeps the bar on every prompt.
#[test]
fn streamed_attention_meets_the_oracle_parity_bar() {
    parity_with(
        "streamed_attention_meets_the_oracle_parity_bar",
        &[Numerics::DEFAULT],
        None,
        PROMPTS.len(),
        (CacheType::F32, "attn_form=2,attn_tile_loads=8"),
    );
}

/// The attention's separate combine dispatch (the default off Vulkan) keeps the bar too (one
/// prompt: the default test above covers the rest of the plan).
#[test]
fn combine_dispatch_meets_the_oracle_parity_bar() {
    parity(
        "combine_dispatch_meets_the_oracle_parity_bar",
        &[Numerics::DEFAULT],
        Some(Combine::Dispatch),
        1,
    );
}

/// Every variant on the same runs (~15 min on lavapipe, hence ignored; run it with
/// `cargo test -p nibble-gpu numerics_variants_parity_report -- --ignored --nocapture`).
#[test]
#[ignore]
fn numerics_variants_parity_report() {
    parity(
        "numerics_variants_parity_report",
        &Numerics::ALL,
        None,
        PROMPTS.len(),
    );
}

#[test]
fn prefill_equals_token_by_token_and_continues_identically() {
    let Some(ctx) = gpu("prefill_equals_token_by_token_and_continues_identically") else {
        return;
    };
    let m = model_with_vocab(12, true, 512);
    // Longer than one prefill chunk, in two calls (the second at a non-zero position).
    let prompt: Vec<u32> = (0..PREFILL_CHUNK as u32 + 9)
        .map(|i| (i * 37 + 5) % 512)
        .collect();
    let (a, b) = prompt.split_at(30);
    let mut batched = GpuBackend::with_context(&ctx, m.as_ref(), opts(Numerics::DEFAULT)).unwrap();
    let mut single = GpuBackend::with_context(&ctx, m.as_ref(), opts(Numerics::DEFAULT)).unwrap();
    let mut oracle = RefBackend::new(m.clone(), 256).unwrap();
    let d = batched.describe();
    eprintln!("{d}");
    for part in [
        format!("numerics: {}", Numerics::DEFAULT),
        format!("{} dispatches per token", batched.dispatches_per_step()),
        format!("resident weights: {} bytes", batched.resident_bytes()),
        format!("gpu adapter: {}", ctx.info.name),
    ] {
        assert!(d.contains(&part), "describe() lacks '{part}':\n{d}");
    }
    batched.prefill(a).unwrap();
    let lb = batched.prefill(b).unwrap();
    assert_eq!(batched.position(), prompt.len());
    let mut ls = Vec::new();
    for t in &prompt {
        ls = single.step(*t).unwrap();
    }
    let lo = oracle.prefill(&prompt).unwrap();
    let (c, co) = (cosine(&lb, &ls), cosine(&lb, &lo));
    eprintln!("prefill vs token-by-token cosine {c}, vs oracle {co}");
    assert!(c >= 0.99999 && co >= 0.99999, "{c} {co}");
    // The KV cache the prefill left gives the same continuation.
    let next = argmax(&lb);
    let g1 = batched.decode_greedy(next, 24, &[]).unwrap();
    assert_eq!(g1, single.decode_greedy(next, 24, &[]).unwrap());
    assert_eq!(g1, oracle.decode_greedy(next, 24, &[]).unwrap());
}

type Trace = Arc<Mutex<Vec<(String, Vec<f32>)>>>;

/// Diagnosis of the int8 divergence: per layer, the residual stream's relative error and the
/// router's expert choice against the oracle, teacher-forced over a prompt. f32 activations
/// must track the oracle to f32 rounding in every layer (no wiring bug); the int8 error is
/// printed with the number of router top-k flips it causes.
#[test]
fn per_layer_trace_against_the_oracle() {
    let Some(ctx) = gpu("per_layer_trace_against_the_oracle") else {
        return;
    };
    let m = model_with_vocab(13, false, 512);
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 101 + 7) % 512).collect();
    for n in Numerics::ALL {
        let gb = GpuBackend::with_context(&ctx, m.as_ref(), opts(n)).unwrap();
        let mut rb = RefBackend::new(m.clone(), 256).unwrap();
        let trace: Trace = Arc::default();
        let sink = trace.clone();
        rb.set_trace(Some(Box::new(move |_, name, v| {
            if name.ends_with(".h") || name.ends_with(".moe_experts") {
                sink.lock().unwrap().push((name.to_string(), v.to_vec()));
            }
        })));
        let layers = gb.config().num_layers;
        let (mut worst, mut flips) = (vec![0f64; layers], vec![0usize; layers]);
        for (pos, t) in tokens.iter().enumerate() {
            trace.lock().unwrap().clear();
            rb.step(*t).unwrap();
            let (_, got) = gb.plan().trace_hidden(*t, pos).unwrap();
            let tr = trace.lock().unwrap();
            let find = |name: String| tr.iter().find(|(k, _)| *k == name).unwrap().1.clone();
            for (l, (h, ids)) in got.iter().enumerate() {
                let want = find(format!("l{l}.h"));
                let e: f64 = h
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
                    .sum();
                let nrm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
                worst[l] = worst[l].max((e / nrm).sqrt());
                let want_ids: Vec<u32> = find(format!("l{l}.moe_experts"))
                    .iter()
                    .map(|v| *v as u32)
                    .collect();
                flips[l] += (ids != &want_ids) as usize;
            }
        }
        eprintln!(
            "{n}: per-layer worst rel error of h [{}], router top-k flips {flips:?} over {} tokens",
            worst
                .iter()
                .map(|e| format!("{e:.1e}"))
                .collect::<Vec<_>>()
                .join(" "),
            tokens.len()
        );
        if n == Numerics::F32 {
            assert!(worst.iter().all(|e| *e < 1e-5), "{n}: {worst:?}");
            assert!(flips.iter().all(|f| *f == 0), "{n}: {flips:?}");
        }
    }
}
