//! Sampled requests folded on the GPU (`Backend::decode_sampled_stream`, kernels/sample.rs)
//! against the host sampler stepping the oracle (`RefBackend`) and the GPU backend's own logits
//! with the same seed: the same ids, for several settings (penalties included) and runs that
//! split the request unevenly; plus what the backend refuses.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::model_with_vocab;
use crate::testing::gpu;
use nibble_backend::{Backend, RefBackend};
use nibble_engine::sampler::{Sampler, SamplingParams};

/// The host way: prefill, then `n` steps with the host sampler on each row of logits.
fn host(b: &mut dyn Backend, prompt: &[u32], n: usize, p: &SamplingParams) -> Vec<u32> {
    b.truncate(0).unwrap();
    let mut s = Sampler::new(p.clone()).unwrap();
    let mut hist = prompt.to_vec();
    let mut tok = s.sample(&b.prefill(prompt).unwrap(), &hist).unwrap();
    let mut ids = vec![tok];
    for _ in 0..n {
        hist.push(tok);
        tok = s.sample(&b.step(tok).unwrap(), &hist).unwrap();
        ids.push(tok);
    }
    ids
}

/// The folded way: the first id from the prefill's logits on the host, then `n` ids sampled
/// on the GPU in runs of `run`, fed the host sampler's next draws.
fn folded(
    b: &mut GpuBackend,
    prompt: &[u32],
    n: usize,
    run: usize,
    p: &SamplingParams,
) -> Vec<u32> {
    b.truncate(0).unwrap();
    let mut s = Sampler::new(p.clone()).unwrap();
    let mut hist = prompt.to_vec();
    let tok = s.sample(&b.prefill(prompt).unwrap(), &hist).unwrap();
    hist.push(tok);
    let draws = s.draw_uniforms(n);
    let spec = s.device_sampling(&hist, &draws);
    assert!(b.samples_on_device(&spec));
    let mut ids = vec![tok];
    let got = b
        .decode_sampled_stream(tok, n, run, &[], &spec, &mut |r| {
            ids.extend_from_slice(r);
            true
        })
        .unwrap();
    assert_eq!(got, n);
    assert_eq!(b.position(), prompt.len() + n);
    ids
}

fn settings() -> Vec<SamplingParams> {
    vec![
        SamplingParams::llama_cpp_defaults(5),
        SamplingParams {
            seed: Some(9),
            ..SamplingParams::qwen3_thinking()
        },
        SamplingParams {
            temperature: 1.5,
            top_k: 64,
            repetition_penalty: 1.2,
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            seed: Some(3),
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.0,
            frequency_penalty: 1.5,
            ..Default::default()
        },
    ]
}

#[test]
fn sampled_folded_equals_host_sampling_and_oracle() {
    let Some(ctx) = gpu("sampled_folded_equals_host_sampling_and_oracle") else {
        return;
    };
    let m = model_with_vocab(4, false, 512);
    let opts = GpuOptions {
        context_len: 160,
        ..Default::default()
    };
    let mut g = GpuBackend::with_context(&ctx, m.as_ref(), opts).unwrap();
    let mut oracle = RefBackend::new(m.clone(), 160).unwrap();
    for (i, p) in settings().iter().enumerate() {
        let prompt: Vec<u32> = vec![3 + i as u32, 77, 140, 9];
        let want = host(&mut oracle, &prompt, 64, p);
        assert_eq!(
            want,
            host(&mut g, &prompt, 64, p),
            "settings {i}: GPU logits, host sampler"
        );
        assert_eq!(
            want,
            folded(&mut g, &prompt, 64, 7, p),
            "settings {i}: folded, runs of 7"
        );
        assert_eq!(
            want,
            folded(&mut g, &prompt, 64, 64, p),
            "settings {i}: folded, one run"
        );
    }
}

#[test]
fn sampled_stream_refuses_what_it_cannot_sample() {
    let Some(ctx) = gpu("sampled_stream_refuses_what_it_cannot_sample") else {
        return;
    };
    let m = model_with_vocab(4, false, 512);
    let opts = GpuOptions {
        context_len: 64,
        ..Default::default()
    };
    let mut g = GpuBackend::with_context(&ctx, m.as_ref(), opts).unwrap();
    g.prefill(&[1, 2, 3]).unwrap();
    let draws = vec![0.5; 8];
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_k: 0,
        ..Default::default()
    })
    .unwrap();
    // No top-k (the whole row) stays with the host sampler.
    let spec = s.device_sampling(&[], &draws);
    assert!(!g.samples_on_device(&spec));
    assert!(g
        .decode_sampled_stream(4, 8, 4, &[], &spec, &mut |_| true)
        .is_err());
    // Too few draws for the steps asked.
    s = Sampler::new(SamplingParams::llama_cpp_defaults(1)).unwrap();
    let spec = s.device_sampling(&[], &draws);
    assert!(g.samples_on_device(&spec));
    assert!(g
        .decode_sampled_stream(4, 9, 4, &[], &spec, &mut |_| true)
        .is_err());
    // Past the context.
    assert!(g
        .decode_sampled_stream(4, 70, 4, &[], &spec, &mut |_| true)
        .is_err());
    // None of these appended anything; a valid request still works from here.
    assert_eq!(g.position(), 3);
    let mut n = 0;
    g.decode_sampled_stream(4, 8, 3, &[], &spec, &mut |r| {
        n += r.len();
        true
    })
    .unwrap();
    assert_eq!((n, g.position()), (8, 11));
}

/// A lone multi-stream slot sampled on the GPU (`streams_queue_sampled`, the server's way for
/// one sampled request) against the same slot stepped with `streams_step` and the host
/// sampler: the same ids, the runs pipelined two deep; the reserved draws the device did not
/// use serve the host's next samples.
#[test]
fn lone_stream_sampled_on_the_gpu_equals_host_steps() {
    let Some(ctx) = gpu("lone_stream_sampled_on_the_gpu_equals_host_steps") else {
        return;
    };
    let m = model_with_vocab(6, false, 512);
    let opts = GpuOptions {
        context_len: 96,
        streams: 2,
        ..Default::default()
    };
    let mut g = GpuBackend::with_context(&ctx, m.as_ref(), opts).unwrap();
    let prompt = [5u32, 61, 300];
    for p in settings() {
        // Host: a step per token on slot 1.
        let mut s = Sampler::new(p.clone()).unwrap();
        let mut hist = prompt.to_vec();
        let mut tok = s
            .sample(&g.stream_prefill(1, 0, &prompt).unwrap(), &hist)
            .unwrap();
        let mut want = vec![tok];
        for _ in 0..44 {
            hist.push(tok);
            let mut l = g.streams_step(&[None, Some(tok)]).unwrap();
            tok = s.sample(l[1].as_ref().unwrap(), &hist).unwrap();
            l.clear();
            want.push(tok);
        }
        g.streams_end(1).unwrap();
        // Device: the same request restarted on the slot, runs of 4 with two queued.
        let mut s = Sampler::new(p.clone()).unwrap();
        let mut hist = prompt.to_vec();
        let tok = s
            .sample(&g.stream_prefill(1, 0, &prompt).unwrap(), &hist)
            .unwrap();
        hist.push(tok);
        let room = 96 - prompt.len();
        let draws = s.draw_uniforms(room);
        let spec = s.device_sampling(&hist, &draws);
        assert!(g.streams_sample_on_device(&spec));
        let inputs = [None, Some(tok)];
        let mut got = vec![tok];
        assert_eq!(g.streams_queue_sampled(&inputs, 4, &[], &spec).unwrap(), 4);
        assert_eq!(g.streams_queue(None, 4, &[]).unwrap(), 4);
        while got.len() < 25 {
            let ids = g.streams_collect().unwrap().unwrap();
            assert!(ids[0].is_empty());
            got.extend_from_slice(&ids[1]);
            g.streams_queue(None, 4, &[]).unwrap();
        }
        while let Some(ids) = g.streams_collect().unwrap() {
            got.extend_from_slice(&ids[1]);
        }
        assert!(got.len() > 26 && got.len() < want.len(), "{}", got.len());
        // The device took `got.len() - 1` steps with the first draws; the host goes on.
        s.consume_draws(got.len() - 1);
        let mut tok = *got.last().unwrap();
        hist.extend_from_slice(&got[1..got.len() - 1]);
        while got.len() < want.len() {
            hist.push(tok);
            let l = g.streams_step(&[None, Some(tok)]).unwrap();
            tok = s.sample(l[1].as_ref().unwrap(), &hist).unwrap();
            got.push(tok);
        }
        assert_eq!(got, want, "settings {:?}", p);
        g.streams_end(1).unwrap();
    }
}
