//! Multi-stream decode (`BatchPlan` through `GpuBackend::streams_decode_greedy`) on synth's tiny
//! model: every stream's greedy ids equal its single-stream GPU ids and the oracle's, with
//! streams of different prompt lengths (so different positions) sharing each run, an idle
//! column, a second run that continues some streams while another sits out, and bad input;
//! one-step runs returning each stream's logits (sampled requests) against the oracle; and the
//! batched prefill against token-by-token prefill and the oracle.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::{model_with_vocab, Mem};
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};
use std::sync::Arc;

const PROMPTS: [&[u32]; 3] = [&[11, 402, 7, 93], &[5], &[300, 301, 302, 17, 250, 4, 9]];
const N: usize = 24;

fn model() -> Arc<Mem> {
    model_with_vocab(21, false, 512)
}

/// A GPU backend over `m` with `streams` stream slots of `context_len` positions.
fn streams_backend(
    ctx: &crate::context::Context,
    m: &Arc<Mem>,
    context_len: usize,
    streams: usize,
) -> GpuBackend {
    let opts = GpuOptions {
        context_len,
        streams,
        ..Default::default()
    };
    GpuBackend::with_context(ctx, m.as_ref(), opts).unwrap()
}

/// The oracle's first `n` greedy ids after `prompt`.
fn oracle(m: &Arc<Mem>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    let mut ids = vec![argmax(&rb.prefill(prompt).unwrap())];
    while ids.len() < n {
        ids.push(argmax(&rb.step(*ids.last().unwrap()).unwrap()));
    }
    ids
}

#[test]
fn streams_equal_single_stream_and_oracle() {
    let Some(ctx) = gpu("streams_equal_single_stream_and_oracle") else {
        return;
    };
    let m = model();
    let mut g = streams_backend(&ctx, &m, 128, 4);
    assert_eq!(g.max_streams(), 4);
    // Single-stream GPU ids for each prompt (the main sequence of the same backend).
    let single: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| {
            g.truncate(0).unwrap();
            let first = argmax(&g.prefill(p).unwrap());
            let mut ids = vec![first];
            ids.extend(g.decode_greedy(first, N + 7, &[]).unwrap());
            ids
        })
        .collect();
    for (p, s) in PROMPTS.iter().zip(&single) {
        assert_eq!(
            s[..N],
            oracle(&m, p, N)[..],
            "single-stream vs oracle for {p:?}"
        );
    }
    // Prefill each stream; its logits match the single-stream prefill's.
    let mut first = vec![];
    for (slot, p) in PROMPTS.iter().enumerate() {
        let l = g.stream_prefill(slot, 0, p).unwrap();
        g.truncate(0).unwrap();
        let want = g.prefill(p).unwrap();
        let cos = cosine(&l, &want);
        assert!(cos >= 0.99999, "stream {slot} prefill logits cosine {cos}");
        first.push(Some(argmax(&l)));
    }
    // Column 3 idle: streams 0..3 decode N - 1 tokens together.
    let ids = g.streams_decode_greedy(&first, N - 1, &[]).unwrap();
    assert_eq!(ids.len(), 3);
    for (s, got) in ids.iter().enumerate() {
        assert_eq!(
            got[..],
            single[s][1..N],
            "stream {s} vs its single-stream ids"
        );
    }
    // Continue streams 0 and 2 for 8 more tokens while stream 1 sits out.
    let next: Vec<Option<u32>> = vec![ids[0].last().copied(), None, ids[2].last().copied()];
    let more = g.streams_decode_greedy(&next, 8, &[]).unwrap();
    assert!(more[1].is_empty());
    assert_eq!(more[0][..], single[0][N..N + 8], "stream 0 continued");
    assert_eq!(more[2][..], single[2][N..N + 8], "stream 2 continued");
    // Stream 1 resumes where it stopped.
    let again = g
        .streams_decode_greedy(&[None, ids[1].last().copied()], 8, &[])
        .unwrap();
    assert_eq!(again[1][..], single[1][N..N + 8], "stream 1 resumed");
}

#[test]
fn streams_stop_at_eos_and_refuse_bad_input() {
    let Some(ctx) = gpu("streams_stop_at_eos_and_refuse_bad_input") else {
        return;
    };
    let m = model();
    let mut g = streams_backend(&ctx, &m, 32, 2);
    let want = oracle(&m, PROMPTS[0], 12);
    let f0 = argmax(&g.stream_prefill(0, 0, PROMPTS[0]).unwrap());
    let f1 = argmax(&g.stream_prefill(1, 0, PROMPTS[1]).unwrap());
    // Stream 0 stops at the EOS id it produces at step 5; stream 1 runs on.
    let eos = want[5];
    let ids = g
        .streams_decode_greedy(&[Some(f0), Some(f1)], 10, &[eos])
        .unwrap();
    let stop = want[1..].iter().position(|t| *t == eos).unwrap() + 1;
    assert_eq!(ids[0][..], want[1..=stop], "stream 0 ends with its EOS");
    assert!(!ids[1].is_empty());
    // Bad input: a clear error, never a panic.
    assert!(
        g.stream_prefill(2, 0, &[1]).is_err(),
        "slot past the streams"
    );
    assert!(
        g.stream_prefill(1, 30, &[1]).is_err(),
        "keeping more than the stream holds"
    );
    assert!(g.stream_prefill(0, 0, &[]).is_err(), "empty prompt");
    assert!(
        g.stream_prefill(0, 0, &[100_000]).is_err(),
        "id past the vocabulary"
    );
    assert!(
        g.stream_prefill(0, 0, &[1; 33]).is_err(),
        "prompt past the context"
    );
    assert!(
        g.streams_decode_greedy(&[Some(1), Some(1), Some(1)], 2, &[])
            .is_err(),
        "three streams on a two-stream path"
    );
    assert!(
        g.streams_decode_greedy(&[Some(1)], 40, &[]).is_err(),
        "past the context"
    );
    // A backend built without streams says so.
    let mut one = GpuBackend::with_context(&ctx, m.as_ref(), GpuOptions::default()).unwrap();
    assert_eq!(one.max_streams(), 0);
    assert!(one.stream_prefill(0, 0, &[1]).is_err());
}

/// Pipelined runs (`streams_queue` / `streams_collect` / `streams_end`): run k+1 is queued
/// before run k is collected and continues every stream on the device; the ids joined up equal
/// each stream's single-stream ids; a stream ended mid-pipeline keeps its ids of the runs
/// already queued and none after; a restart from the host-known ids continues it exactly; the
/// columns cannot be touched while runs are queued.
#[test]
fn pipelined_runs_continue_on_the_device() {
    let Some(ctx) = gpu("pipelined_runs_continue_on_the_device") else {
        return;
    };
    let m = model();
    let mut g = streams_backend(&ctx, &m, 64, 3);
    let single: Vec<Vec<u32>> = PROMPTS.iter().map(|p| oracle(&m, p, 20)).collect();
    let first: Vec<Option<u32>> = PROMPTS
        .iter()
        .enumerate()
        .map(|(s, p)| Some(argmax(&g.stream_prefill(s, 0, p).unwrap())))
        .collect();
    let mut got: Vec<Vec<u32>> = vec![vec![]; 3];
    let take = |g: &mut GpuBackend, got: &mut Vec<Vec<u32>>| {
        let ids = g.streams_collect().unwrap().expect("a queued run");
        for (s, v) in ids.iter().enumerate() {
            got[s].extend_from_slice(v);
        }
        ids
    };
    assert_eq!(g.streams_queue(Some(&first), 3, &[]).unwrap(), 3);
    assert_eq!(g.streams_queue(None, 3, &[]).unwrap(), 3);
    assert!(
        g.stream_prefill(0, 0, &[1]).is_err(),
        "prefill while runs are queued"
    );
    take(&mut g, &mut got);
    g.streams_queue(None, 3, &[]).unwrap();
    take(&mut g, &mut got);
    // Stream 1 ends: the run already queued still advances it, the next one does not.
    g.streams_end(1).unwrap();
    g.streams_queue(None, 3, &[]).unwrap();
    let third = take(&mut g, &mut got);
    assert_eq!(third[1].len(), 3, "the run queued before the end");
    let fourth = take(&mut g, &mut got);
    assert!(fourth[1].is_empty(), "stream 1 ran after its end");
    assert!(g.streams_collect().unwrap().is_none());
    for s in 0..3 {
        let n = got[s].len();
        assert_eq!(n, if s == 1 { 9 } else { 12 }, "stream {s}");
        assert_eq!(got[s][..], single[s][1..=n], "stream {s} vs the oracle");
    }
    // Restart stream 1 alone from its last id: it continues exactly.
    let last = *got[1].last().unwrap();
    assert_eq!(
        g.streams_queue(Some(&[None, Some(last)]), 4, &[]).unwrap(),
        4
    );
    let ids = g.streams_collect().unwrap().unwrap();
    assert!(ids[0].is_empty() && ids[2].is_empty());
    assert_eq!(ids[1][..], single[1][10..14], "stream 1 restarted");
    // Near the end of the context a run is cut to what fits.
    let pos0 = PROMPTS[0].len() + 12;
    let room = 64 - pos0;
    let l0 = *got[0].last().unwrap();
    assert_eq!(
        g.streams_queue(Some(&[Some(l0)]), room + 5, &[]).unwrap(),
        room
    );
    assert_eq!(g.streams_collect().unwrap().unwrap()[0].len(), room);
    assert_eq!(g.streams_queue(None, 1, &[]).unwrap(), 0, "context full");
}

/// One-step runs returning logits (`streams_step`, the path of sampled requests): each stream's
/// logits follow the oracle's along its own greedy path (cosine), so argmax chains equal the
/// oracle's ids; a stream sitting out a step keeps its position; a stream prefilled with a
/// kept prefix (`start > 0`) continues from it; bad input is refused.
#[test]
fn streams_step_logits_follow_the_oracle() {
    let Some(ctx) = gpu("streams_step_logits_follow_the_oracle") else {
        return;
    };
    let m = model();
    let mut g = streams_backend(&ctx, &m, 64, 3);
    // Slot 2 first holds PROMPTS[2] minus its tail, then keeps 5 positions and is fed the rest.
    g.stream_prefill(2, 0, &[300, 301, 302, 17, 250, 1, 1, 1])
        .unwrap();
    let mut refs: Vec<RefBackend> = Vec::new();
    let mut next = Vec::new();
    for (slot, p) in PROMPTS.iter().enumerate() {
        let (start, feed) = if slot == 2 { (5, &p[5..]) } else { (0, *p) };
        let l = g.stream_prefill(slot, start, feed).unwrap();
        let mut rb = RefBackend::new(m.clone(), 64).unwrap();
        let want = rb.prefill(p).unwrap();
        assert!(cosine(&l, &want) >= 0.99999, "stream {slot} prefill");
        next.push(argmax(&l));
        refs.push(rb);
    }
    for step in 0..8 {
        // Stream 1 sits out every third step.
        let sit = step % 3 == 2;
        let inputs: Vec<Option<u32>> = (0..3)
            .map(|s| (!(sit && s == 1)).then_some(next[s]))
            .collect();
        let out = g.streams_step(&inputs).unwrap();
        assert_eq!(out.len(), 3);
        for s in 0..3 {
            match (&out[s], inputs[s]) {
                (Some(l), Some(t)) => {
                    let want = refs[s].step(t).unwrap();
                    let cos = cosine(l, &want);
                    assert!(cos >= 0.99999, "stream {s} step {step}: cosine {cos}");
                    assert_eq!(argmax(l), argmax(&want), "stream {s} step {step}");
                    next[s] = argmax(l);
                }
                (None, None) => {}
                (got, fed) => panic!(
                    "stream {s} step {step}: logits {} for input {fed:?}",
                    got.is_some()
                ),
            }
        }
    }
    // Past the vocabulary, more streams than slots: clear errors.
    assert!(g.streams_step(&[Some(100_000)]).is_err());
    assert!(g.streams_step(&[None, None, None, Some(1)]).is_err());
}

/// The batched prefill (8 prompt tokens per dispatch, the default for f32 numerics) against the
/// unbatched backend (`per_token`: token by token) and the oracle: a 19-token prompt (groups of
/// 8, 8, 3), then 5 more tokens appended at position 19 (a group starting mid-sequence), then
/// greedy decoding from the batched cache.
#[test]
fn batched_prefill_equals_token_by_token_and_oracle() {
    let Some(ctx) = gpu("batched_prefill_equals_token_by_token_and_oracle") else {
        return;
    };
    let m = model();
    let prompt: Vec<u32> = (0..19).map(|i| (i * 37 + 11) % 500).collect();
    let more = [7u32, 93, 402, 11, 250];
    let opts = |per_token| GpuOptions {
        context_len: 64,
        per_token,
        ..Default::default()
    };
    let mut batched = GpuBackend::with_context(&ctx, m.as_ref(), opts(false)).unwrap();
    let mut plain = GpuBackend::with_context(&ctx, m.as_ref(), opts(true)).unwrap();
    let mut rb = RefBackend::new(m.clone(), 64).unwrap();
    for chunk in [&prompt[..], &more[..]] {
        let (b, p, r) = (
            batched.prefill(chunk).unwrap(),
            plain.prefill(chunk).unwrap(),
            rb.prefill(chunk).unwrap(),
        );
        for (what, x) in [("token by token", &p), ("oracle", &r)] {
            let cos = cosine(&b, x);
            assert!(cos >= 0.99999, "batched prefill vs {what}: cosine {cos}");
            assert_eq!(argmax(&b), argmax(x), "batched prefill vs {what}: argmax");
        }
    }
    assert_eq!(batched.position(), 24);
    // Greedy from the batched cache (re-feeding the last prompt token at 23) equals greedy from
    // the token-by-token cache and the oracle's.
    let t = more[4];
    batched.truncate(23).unwrap();
    plain.truncate(23).unwrap();
    let a = batched.decode_greedy(t, 12, &[]).unwrap();
    let b = plain.decode_greedy(t, 12, &[]).unwrap();
    assert_eq!(a, b, "greedy after batched vs token-by-token prefill");
    let mut rb = RefBackend::new(m.clone(), 64).unwrap();
    rb.prefill(&prompt).unwrap();
    let mut want = vec![argmax(&rb.prefill(&more).unwrap())];
    while want.len() < 12 {
        want.push(argmax(&rb.step(*want.last().unwrap()).unwrap()));
    }
    assert_eq!(a, want, "greedy after batched prefill vs the oracle");
}

/// A lone greedy stream runs on the single-sequence plan in its KV slot (plan_slots.rs), slot 1
/// so the cache offset is not 0: its ids equal the oracle's with the lone path on and off
/// (`lone_stream: false` keeps it on the columns); a second stream joining continues both on
/// the columns from the rows the plan wrote, and once it is gone the first goes back to the
/// plan, still exact; a stream ended mid-pipeline keeps the ids of the run already queued; the
/// plan's own sequence is refused while a lone run is queued; one-step runs of the lone stream
/// (sampled requests) follow the oracle and hand over to greedy runs.
#[test]
fn lone_stream_runs_on_the_plan_in_its_slot() {
    let Some(ctx) = gpu("lone_stream_runs_on_the_plan_in_its_slot") else {
        return;
    };
    let m = model();
    let want: Vec<Vec<u32>> = PROMPTS[..2].iter().map(|p| oracle(&m, p, 30)).collect();
    // The third pass: the lone stream's plan steps with the qkv dispatch attending itself
    // (`--tune qkv_attn`, kernels/qkv_attention.rs) on its slot's cache.
    for (lone, qkv_attn) in [(true, None), (false, None), (true, Some(64))] {
        let opts = GpuOptions {
            context_len: 64,
            streams: 2,
            lone_stream: lone,
            tune: crate::tune::Tune {
                qkv_attn,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut g = GpuBackend::with_context(&ctx, m.as_ref(), opts).unwrap();
        if qkv_attn.is_some() && ctx.publishes_across_workgroups() {
            assert_eq!(g.plan().qkv_attention_positions(), Some(64));
            assert_eq!(
                g.plan().slot_qkv_attention_layers(),
                vec![g.plan().weights.cfg.num_layers; 2]
            );
        }
        let place = if lone {
            "single-sequence plan"
        } else {
            "multi-stream kernels"
        };
        assert!(g.describe().contains(place), "{}", g.describe());
        let mut got0 = vec![argmax(&g.stream_prefill(1, 0, PROMPTS[0]).unwrap())];
        let last = |v: &Vec<u32>| Some(*v.last().unwrap());
        assert_eq!(
            g.streams_queue(Some(&[None, last(&got0)]), 4, &[]).unwrap(),
            4
        );
        assert_eq!(g.streams_queue(None, 4, &[]).unwrap(), 4);
        if lone {
            assert!(
                g.prefill(&[1]).is_err(),
                "main prefill while lone runs queue"
            );
            assert!(
                g.decode_greedy(1, 2, &[]).is_err(),
                "main decode while queued"
            );
        }
        for _ in 0..2 {
            let ids = g.streams_collect().unwrap().expect("a queued run");
            assert!(ids[0].is_empty(), "slot 0 is not live");
            got0.extend_from_slice(&ids[1]);
        }
        assert_eq!(got0[..], want[0][..9], "lone {lone}: alone");
        // A second stream joins in slot 0: both decode on the columns.
        let mut got1 = vec![argmax(&g.stream_prefill(0, 0, PROMPTS[1]).unwrap())];
        let both = [last(&got1), last(&got0)];
        assert_eq!(g.streams_queue(Some(&both), 5, &[]).unwrap(), 5);
        let ids = g.streams_collect().unwrap().unwrap();
        got1.extend_from_slice(&ids[0]);
        got0.extend_from_slice(&ids[1]);
        // Slot 0 left: slot 1 alone again, ended while its second run is queued.
        assert_eq!(
            g.streams_queue(Some(&[None, last(&got0)]), 3, &[]).unwrap(),
            3
        );
        assert_eq!(g.streams_queue(None, 3, &[]).unwrap(), 3);
        g.streams_end(1).unwrap();
        assert_eq!(g.streams_queue(None, 3, &[]).unwrap(), 0, "nothing live");
        for _ in 0..2 {
            got0.extend_from_slice(&g.streams_collect().unwrap().unwrap()[1]);
        }
        assert!(g.streams_collect().unwrap().is_none());
        assert_eq!(got0[..], want[0][..20], "lone {lone}: stream 0");
        assert_eq!(got1[..], want[1][..6], "lone {lone}: stream 1");
        // One-step runs of slot 1 alone (a sampled request's path) continue it: logits against
        // the oracle's along the same ids, then a greedy run picks up after them.
        let mut rb = RefBackend::new(m.clone(), 64).unwrap();
        rb.prefill(PROMPTS[0]).unwrap();
        for &t in &want[0][..19] {
            rb.step(t).unwrap();
        }
        for j in 19..22 {
            let out = g.streams_step(&[None, Some(want[0][j])]).unwrap();
            assert!(out[0].is_none(), "slot 0 was not fed");
            let l = out[1].as_ref().expect("slot 1's logits");
            let oracle = rb.step(want[0][j]).unwrap();
            let cos = cosine(l, &oracle);
            assert!(cos >= 0.99999, "lone {lone}: one-step {j}: cosine {cos}");
            assert_eq!(argmax(l), want[0][j + 1], "lone {lone}: one-step {j}");
        }
        assert_eq!(
            g.streams_queue(Some(&[None, Some(want[0][22])]), 4, &[])
                .unwrap(),
            4
        );
        let ids = g.streams_collect().unwrap().unwrap();
        assert_eq!(
            ids[1][..],
            want[0][23..27],
            "lone {lone}: greedy after one-steps"
        );
        // The main sequence works again once the runs are collected.
        assert_eq!(argmax(&g.prefill(PROMPTS[0]).unwrap()), want[0][0]);
    }
}

#[test]
fn lone_stream_and_main_sequence_steps_keep_their_own_caches() {
    let Some(ctx) = gpu("lone_stream_and_main_sequence_steps_keep_their_own_caches") else {
        return;
    };
    let m = model();
    let mut g = streams_backend(&ctx, &m, 64, 3);
    let (mut main, mut lone) = (
        RefBackend::new(m.clone(), 64).unwrap(),
        RefBackend::new(m.clone(), 64).unwrap(),
    );
    g.prefill(&[5, 6, 7]).unwrap();
    main.prefill(&[5, 6, 7]).unwrap();
    g.stream_prefill(1, 0, &[40, 41, 42, 43]).unwrap();
    lone.prefill(&[40, 41, 42, 43]).unwrap();
    // Alternating one-step runs whose next positions coincide: the main sequence at 3 (its
    // step for 4 is recorded ahead), slot 1 at 4 (it must not take that one), and so on.
    for (i, t) in [9u32, 10, 11, 12, 13, 14].into_iter().enumerate() {
        let (got, want) = if i % 2 == 0 {
            (g.step(t).unwrap(), main.step(t).unwrap())
        } else {
            let mut out = g.streams_step(&[None, Some(t), None]).unwrap();
            (out[1].take().unwrap(), lone.step(t).unwrap())
        };
        let cos = cosine(&got, &want);
        assert!(cos >= 0.99999, "step {i}: cosine {cos}");
    }
}
