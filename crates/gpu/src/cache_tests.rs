//! The f16 KV cache (`GpuOptions::cache`) on every path that writes or reads the cache, against
//! the oracle holding an f16 cache too: the GEMM prefill (a prompt of 40 tokens) and the column
//! prefill (5 tokens) of the main sequence, the folded decode after each, multi-stream decode of
//! two slots together, and a lone stream on the single-sequence plan in its slot. The buffers
//! are half the f32 ones'.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::{model_with_vocab, Mem};
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::kv_cache::CacheType;
use std::sync::Arc;

const N: usize = 24;

fn long_prompt() -> Vec<u32> {
    (0..40).map(|i| (i * 37 + 11) % 500).collect()
}

/// The f16 oracle's logits after `prompt` and its first `n` greedy ids.
fn oracle(m: &Arc<Mem>, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut rb = RefBackend::with_cache(m.clone(), 128, CacheType::F16).unwrap();
    let first = rb.prefill(prompt).unwrap();
    let mut ids = vec![argmax(&first)];
    while ids.len() < n {
        ids.push(argmax(&rb.step(*ids.last().unwrap()).unwrap()));
    }
    (first, ids)
}

#[test]
fn f16_cache_on_every_path_matches_the_f16_oracle() {
    let Some(ctx) = gpu("f16_cache_on_every_path_matches_the_f16_oracle") else {
        return;
    };
    let m = model_with_vocab(21, false, 512);
    let backend = |cache| {
        let opts = GpuOptions {
            context_len: 128,
            streams: 2,
            cache,
            ..Default::default()
        };
        GpuBackend::with_context(&ctx, m.as_ref(), opts).unwrap()
    };
    let mut g = backend(CacheType::F16);
    let f32_bytes = backend(CacheType::F32).kv_cache_bytes();
    assert_eq!(g.kv_cache_bytes() * 2, f32_bytes, "f16 halves the caches");
    let prompts = [long_prompt(), vec![7, 300, 12, 9, 44]];
    let want: Vec<_> = prompts.iter().map(|p| oracle(&m, p, N + 8)).collect();
    for (p, (logits, ids)) in prompts.iter().zip(&want) {
        g.truncate(0).unwrap();
        let got = g.prefill(p).unwrap();
        let cos = cosine(&got, logits);
        assert!(
            cos >= 0.99999,
            "prefill of {} tokens: cosine {cos}",
            p.len()
        );
        let first = argmax(&got);
        assert_eq!(first, ids[0], "prefill of {} tokens", p.len());
        let rest = g.decode_greedy(first, N - 1, &[]).unwrap();
        assert_eq!(rest[..], ids[1..N], "decode after {} tokens", p.len());
    }
    // Both prompts in stream slots, decoded together, then the second alone (the lone-stream
    // path: the single-sequence plan bound to its slot).
    let mut first = vec![];
    for (slot, p) in prompts.iter().enumerate() {
        let l = g.stream_prefill(slot, 0, p).unwrap();
        assert!(
            cosine(&l, &want[slot].0) >= 0.99999,
            "stream {slot} prefill"
        );
        first.push(Some(argmax(&l)));
    }
    let ids = g.streams_decode_greedy(&first, N - 1, &[]).unwrap();
    for (s, got) in ids.iter().enumerate() {
        assert_eq!(got[..], want[s].1[1..N], "stream {s}");
    }
    let alone = g
        .streams_decode_greedy(&[None, ids[1].last().copied()], 8, &[])
        .unwrap();
    assert_eq!(alone[1][..], want[1].1[N..N + 8], "stream 1 alone");
}
