//! RoPE scaling on the GPU against the oracle (lavapipe in CI): a tiny model run with YaRN (x4
//! over 1024 positions, the ramp inside the head's dimensions) through the column and GEMM
//! prefills, the folded decode, the multi-stream runs and the qkv + attention dispatch gives
//! the oracle's greedy ids and logits. The kernels fold YaRN's attention factor into the score
//! scale while the oracle scales the rotated `q` and `k` as transformers does, so agreement
//! checks that algebra too. A model whose outputs YaRN did not change would prove nothing:
//! the first test checks that it does.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::model_with_vocab;
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::rope::{yarn_default_attention_factor, RopeScaling};
use nibble_model::weights::{Reconfigured, WeightSource};
use std::sync::Arc;

const YARN: RopeScaling = RopeScaling::Yarn {
    factor: 4.0,
    original_context: 1024,
    beta_fast: 32.0,
    beta_slow: 1.0,
    // yarn_default_attention_factor(4.0), checked below.
    attention_factor: 1.138_629_4,
    truncate: true,
};
const CTX: usize = 256;
const STEPS: usize = 40;

/// The tiny model (512-token vocabulary) with `scaling`.
fn model(scaling: Option<RopeScaling>) -> Arc<dyn WeightSource> {
    let m: Arc<dyn WeightSource> = model_with_vocab(31, false, 512);
    let mut cfg = m.config().clone();
    cfg.rope_scaling = scaling;
    Arc::new(Reconfigured::new(m, cfg).unwrap())
}

/// The oracle's prompt logits, then its greedy ids and the logits each was chosen from.
fn oracle(m: &Arc<dyn WeightSource>, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut rb = RefBackend::new(m.clone(), CTX).unwrap();
    let mut logits = vec![rb.prefill(prompt).unwrap()];
    let mut ids = vec![argmax(&logits[0])];
    while ids.len() < STEPS {
        logits.push(rb.step(*ids.last().unwrap()).unwrap());
        ids.push(argmax(logits.last().unwrap()));
    }
    (ids, logits)
}

/// 40 tokens: the GEMM prefill (32 or more); 5: the column prefill.
fn prompts() -> [Vec<u32>; 2] {
    [
        (0..40u32).map(|i| (i * 53 + 11) % 512).collect(),
        vec![7, 300, 12, 499, 64],
    ]
}

#[test]
fn yarn_changes_the_oracle_and_the_gpu_follows_it() {
    assert_eq!(YARN.factor(), 4.0);
    let RopeScaling::Yarn {
        attention_factor, ..
    } = YARN
    else {
        unreachable!()
    };
    assert_eq!(attention_factor, yarn_default_attention_factor(4.0));
    let Some(ctx) = gpu("yarn_changes_the_oracle_and_the_gpu_follows_it") else {
        return;
    };
    let (plain, yarn) = (model(None), model(Some(YARN)));
    for prompt in prompts() {
        let (want, logits) = oracle(&yarn, &prompt);
        // YaRN moves the logits (and so the greedy path) of this model.
        let (plain_ids, plain_logits) = oracle(&plain, &prompt);
        let c = cosine(&plain_logits[0], &logits[0]);
        assert!(
            c < 0.999,
            "YaRN barely changes the prompt's logits: cosine {c}"
        );
        assert_ne!(plain_ids, want, "YaRN leaves the greedy path unchanged");

        let mut g = GpuBackend::with_context(
            &ctx,
            yarn.as_ref(),
            GpuOptions {
                context_len: CTX,
                ..Default::default()
            },
        )
        .unwrap();
        let first = g.prefill(&prompt).unwrap();
        let c = cosine(&first, &logits[0]);
        assert!(
            c >= 0.99999,
            "prefill of {} tokens: cosine {c}",
            prompt.len()
        );
        let mut ids = vec![argmax(&first)];
        ids.extend(g.decode_greedy(ids[0], STEPS - 1, &[]).unwrap());
        assert_eq!(ids, want, "folded decode, prompt of {}", prompt.len());
        // Teacher-forced steps along the oracle's path.
        g.truncate(0).unwrap();
        g.prefill(&prompt).unwrap();
        for s in 1..STEPS {
            let l = g.step(want[s - 1]).unwrap();
            let c = cosine(&l, &logits[s]);
            assert!(c >= 0.99999, "step {s}: cosine {c}");
        }
    }
}

#[test]
fn yarn_multi_stream_and_qkv_attention_follow_the_oracle() {
    let Some(ctx) = gpu("yarn_multi_stream_and_qkv_attention_follow_the_oracle") else {
        return;
    };
    let yarn = model(Some(YARN));
    let ps = prompts();
    let want: Vec<Vec<u32>> = ps.iter().map(|p| oracle(&yarn, p).0).collect();
    // Two streams decoded by the same runs (the column kernels).
    let mut g = GpuBackend::with_context(
        &ctx,
        yarn.as_ref(),
        GpuOptions {
            context_len: CTX,
            streams: 2,
            lone_stream: false,
            ..Default::default()
        },
    )
    .unwrap();
    let first: Vec<Option<u32>> = (ps.iter().enumerate())
        .map(|(slot, p)| Some(argmax(&g.stream_prefill(slot, 0, p).unwrap())))
        .collect();
    let ids = g.streams_decode_greedy(&first, STEPS - 1, &[]).unwrap();
    for (s, w) in want.iter().enumerate() {
        assert_eq!(Some(w[0]), first[s], "stream {s}'s prefill");
        assert_eq!(ids[s][..], w[1..], "stream {s}");
    }
    // The qkv dispatch attending below position 256 (`--tune qkv_attn=256`).
    let mut g = GpuBackend::with_context(
        &ctx,
        yarn.as_ref(),
        GpuOptions {
            context_len: CTX,
            tune: "qkv_attn=256".parse().unwrap(),
            ..Default::default()
        },
    )
    .unwrap();
    let p = &ps[1];
    let first = argmax(&g.prefill(p).unwrap());
    let mut got = vec![first];
    got.extend(g.decode_greedy(first, STEPS - 1, &[]).unwrap());
    assert_eq!(got, want[1], "qkv + attention in one dispatch");
}
