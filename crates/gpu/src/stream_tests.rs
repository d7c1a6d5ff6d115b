//! The overlapped greedy stream (`GpuBackend::decode_greedy_stream`, `plan::GreedyStream`) on
//! synth's tiny model (512-token vocabulary) against the per-token GPU path and the oracle
//! (`RefBackend`): identical ids for several run sizes, runs handed out at the requested size,
//! an EOS inside a run, and an early stop with the next run already queued on the GPU.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::{model_with_vocab, Mem};
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};
use std::sync::Arc;

const PROMPT: [u32; 4] = [11, 402, 7, 93];
/// Positions the prefill leaves cached: the prompt's last token is the stream's first input.
const START: usize = PROMPT.len() - 1;
const N: usize = 40;

fn opts(per_token: bool) -> GpuOptions {
    GpuOptions {
        context_len: 128,
        fold: 16,
        per_token,
        ..Default::default()
    }
}

fn model() -> Arc<Mem> {
    model_with_vocab(21, false, 512)
}

/// The oracle's `n` greedy ids after `PROMPT`, one step at a time.
fn oracle_ids(m: &Arc<Mem>, n: usize) -> Vec<u32> {
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    let mut ids = vec![argmax(&rb.prefill(&PROMPT).unwrap())];
    while ids.len() < n {
        ids.push(argmax(&rb.step(*ids.last().unwrap()).unwrap()));
    }
    ids
}

/// Prefill all but the prompt's last token, then stream; returns (runs handed out, returned count).
fn stream(
    b: &mut dyn Backend,
    n: usize,
    run: usize,
    eos: &[u32],
    keep: impl Fn(usize) -> bool,
) -> (Vec<Vec<u32>>, usize) {
    b.truncate(0).unwrap();
    b.prefill(&PROMPT[..START]).unwrap();
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let got = b
        .decode_greedy_stream(PROMPT[START], n, run, eos, &mut |ids| {
            runs.push(ids.to_vec());
            keep(runs.len())
        })
        .unwrap();
    (runs, got)
}

/// Expected run lengths when `n` ids come in runs of `run`.
fn run_lengths(n: usize, run: usize) -> Vec<usize> {
    (0..n.div_ceil(run)).map(|k| run.min(n - k * run)).collect()
}

#[test]
fn stream_matches_per_token_and_oracle_for_run_sizes() {
    let Some(ctx) = gpu("stream_matches_per_token_and_oracle_for_run_sizes") else {
        return;
    };
    let m = model();
    let want = oracle_ids(&m, N);
    // A constant sequence would not tell the runs apart.
    assert!(
        want.iter().any(|t| *t != want[0]),
        "degenerate ids {want:?}"
    );
    let mut folded = GpuBackend::with_context(&ctx, m.as_ref(), opts(false)).unwrap();
    let mut per_tok = GpuBackend::with_context(&ctx, m.as_ref(), opts(true)).unwrap();
    for run in [1, 3, 16] {
        for (name, b) in [("folded", &mut folded), ("per-token", &mut per_tok)] {
            let (runs, got) = stream(b, N, run, &[], |_| true);
            let lens: Vec<usize> = runs.iter().map(Vec::len).collect();
            assert_eq!(lens, run_lengths(N, run), "{name} run {run}: run sizes");
            assert_eq!(got, N, "{name} run {run}: returned count");
            assert_eq!(runs.concat(), want, "{name} run {run}: ids vs the oracle");
            assert_eq!(b.position(), START + N, "{name} run {run}: position");
        }
    }
    // decode_greedy goes through the same machinery in runs of `fold`.
    folded.truncate(0).unwrap();
    folded.prefill(&PROMPT[..START]).unwrap();
    assert_eq!(folded.decode_greedy(PROMPT[START], N, &[]).unwrap(), want);
    assert_eq!(folded.position(), START + N);
}

#[test]
fn plan_stream_keeps_the_next_run_queued() {
    let Some(ctx) = gpu("plan_stream_keeps_the_next_run_queued") else {
        return;
    };
    let m = model();
    let want = oracle_ids(&m, 10);
    let mut b = GpuBackend::with_context(&ctx, m.as_ref(), opts(false)).unwrap();
    b.prefill(&PROMPT[..START]).unwrap();
    let mut s = b
        .plan()
        .begin_greedy(PROMPT[START], START, 10, 4, &[])
        .unwrap();
    // While run k is read, run k+1 is already submitted; the last run has nothing behind it.
    let mut ids = Vec::new();
    for (len, queued_after) in [(4, 1), (4, 1), (2, 0)] {
        let out = s.next_run().unwrap().expect("a run is left");
        assert_eq!(out.ids.len(), len);
        assert_eq!(s.queued_runs(), queued_after);
        ids.extend_from_slice(&out.ids);
        assert_eq!(out.state.step as usize, ids.len());
        assert_eq!(out.state.pos as usize, START + ids.len());
        assert_eq!(out.state.token, *ids.last().unwrap());
    }
    assert_eq!(s.next_run().unwrap(), None);
    assert_eq!(ids, want);
}

#[test]
fn stream_stops_at_eos_inside_a_run() {
    let Some(ctx) = gpu("stream_stops_at_eos_inside_a_run") else {
        return;
    };
    let m = model();
    let want = oracle_ids(&m, N);
    // An id first produced at step i >= 5 that lands strictly inside a run of 4.
    let run = 4;
    let i = (5..N)
        .find(|&i| matches!(i % run, 1 | 2) && !want[..i].contains(&want[i]))
        .expect("the tiny model produces a fresh id mid-run");
    let eos = [999_999, want[i]];
    let mut b = GpuBackend::with_context(&ctx, m.as_ref(), opts(false)).unwrap();
    let (runs, got) = stream(&mut b, N, run, &eos, |_| true);
    assert_eq!(
        runs.concat(),
        want[..=i].to_vec(),
        "ids through the EOS at {i}"
    );
    assert_eq!(got, i + 1);
    let mut lens = vec![run; i / run];
    lens.push(i % run + 1);
    assert_eq!(runs.iter().map(Vec::len).collect::<Vec<_>>(), lens);
    // The EOS step is appended, the EOS id itself is not.
    assert_eq!(b.position(), START + i + 1);

    // The cache holds exactly the oracle's rows: feeding the EOS id and then a short prompt
    // gives the oracle's logits.
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    rb.prefill(&PROMPT[..START]).unwrap();
    assert_eq!(
        rb.decode_greedy(PROMPT[START], N, &eos).unwrap(),
        want[..=i]
    );
    assert_eq!(rb.position(), b.position());
    let (g, r) = (b.step(want[i]).unwrap(), rb.step(want[i]).unwrap());
    assert_eq!(argmax(&g), argmax(&r));
    assert!(cosine(&g, &r) >= 0.99999, "step cosine {}", cosine(&g, &r));
    let (g, r) = (
        b.prefill(&[300, 5]).unwrap(),
        rb.prefill(&[300, 5]).unwrap(),
    );
    assert_eq!(argmax(&g), argmax(&r));
    assert!(
        cosine(&g, &r) >= 0.99999,
        "prefill cosine {}",
        cosine(&g, &r)
    );
    assert_eq!(b.position(), START + i + 4);
}

#[test]
fn early_stop_reports_the_queued_run_and_truncate_continues() {
    let Some(ctx) = gpu("early_stop_reports_the_queued_run_and_truncate_continues") else {
        return;
    };
    let m = model();
    let want = oracle_ids(&m, N);
    let run = 5;
    let mut b = GpuBackend::with_context(&ctx, m.as_ref(), opts(false)).unwrap();
    let (runs, got) = stream(&mut b, N, run, &[], |_| false);
    assert_eq!(runs, vec![want[..run].to_vec()], "one run handed out");
    assert_eq!(got, run);
    // Run 1 was queued before the host read run 0, so the GPU took its steps too.
    assert_eq!(b.position(), START + 2 * run);

    // Those rows are real: the next step agrees with the oracle after the same 10 ids.
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    rb.prefill(&PROMPT[..START]).unwrap();
    assert_eq!(
        rb.decode_greedy(PROMPT[START], 2 * run, &[]).unwrap(),
        want[..2 * run]
    );
    let (g, r) = (
        b.step(want[2 * run - 1]).unwrap(),
        rb.step(want[2 * run - 1]).unwrap(),
    );
    assert_eq!(argmax(&g), want[2 * run]);
    assert!(cosine(&g, &r) >= 0.99999, "step cosine {}", cosine(&g, &r));

    // Keep only 2 ids, as a caller stopping mid-run would, and continue from there.
    let kept = 2;
    b.truncate(START + kept).unwrap();
    let mut rest: Vec<Vec<u32>> = Vec::new();
    let more = b
        .decode_greedy_stream(want[kept - 1], N - kept, run, &[], &mut |ids| {
            rest.push(ids.to_vec());
            true
        })
        .unwrap();
    assert_eq!(more, N - kept);
    assert_eq!(rest.concat(), want[kept..].to_vec());
    assert_eq!(b.position(), START + N);
}

#[test]
fn stream_bad_input_is_an_error_and_keeps_position() {
    let Some(ctx) = gpu("stream_bad_input_is_an_error_and_keeps_position") else {
        return;
    };
    let m = model();
    let mut b = GpuBackend::with_context(&ctx, m.as_ref(), opts(false)).unwrap();
    b.prefill(&PROMPT).unwrap();
    let calls = std::cell::Cell::new(0);
    let mut count = |_: &[u32]| {
        calls.set(calls.get() + 1);
        true
    };
    assert!(b.decode_greedy_stream(512, 4, 2, &[], &mut count).is_err());
    let too_many = 128 - PROMPT.len() + 1;
    assert!(b
        .decode_greedy_stream(1, too_many, 2, &[], &mut count)
        .is_err());
    assert!(b
        .decode_greedy_stream(1, 4, 2, &[7; 17], &mut count)
        .is_err());
    assert_eq!(b.decode_greedy_stream(1, 0, 2, &[], &mut count).unwrap(), 0);
    assert_eq!(calls.get(), 0);
    assert_eq!(b.position(), PROMPT.len());
    // Exactly the context that is left, in one run larger than the request.
    let left = 128 - PROMPT.len();
    assert_eq!(
        b.decode_greedy_stream(1, left, 1000, &[], &mut count)
            .unwrap(),
        left
    );
    assert_eq!(calls.get(), 1);
    assert_eq!(b.position(), 128);
}
