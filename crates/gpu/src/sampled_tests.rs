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
        assert_eq!(
            g.streams_queue_sampled(&inputs, 4, &[], &[None, Some(&spec)])
                .unwrap(),
            4
        );
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

/// Three streams on the columns, two sampled by different settings and one greedy, sampled on
/// the GPU in pipelined runs (`streams_queue_sampled`, the server's way while every sampled
/// stream's settings are the device's) against the same streams stepped together with
/// `streams_step` (host sampler, argmax): the same ids per stream.
#[test]
fn column_streams_sampled_on_the_gpu_equal_host_steps() {
    let Some(ctx) = gpu("column_streams_sampled_on_the_gpu_equal_host_steps") else {
        return;
    };
    let m = model_with_vocab(8, false, 512);
    let ctxlen = 80;
    let opts = GpuOptions {
        context_len: ctxlen,
        streams: 3,
        ..Default::default()
    };
    let mut g = GpuBackend::with_context(&ctx, m.as_ref(), opts).unwrap();
    let prompts: [&[u32]; 3] = [&[5, 61, 300], &[9, 9], &[400, 17, 3, 88]];
    let sets = settings();
    let params = [Some(sets[0].clone()), None, Some(sets[2].clone())];
    let steps = 20;
    // Host: every stream stepped together, the sampled ones by their host samplers.
    let mut samplers: Vec<Option<Sampler>> = params
        .iter()
        .map(|p| p.clone().map(|p| Sampler::new(p).unwrap()))
        .collect();
    let mut hist: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut want: Vec<Vec<u32>> = vec![vec![]; 3];
    let mut toks = [0u32; 3];
    for s in 0..3 {
        let l = g.stream_prefill(s, 0, prompts[s]).unwrap();
        toks[s] = match &mut samplers[s] {
            Some(sm) => sm.sample(&l, &hist[s]).unwrap(),
            None => nibble_backend::argmax(&l),
        };
        want[s].push(toks[s]);
    }
    for _ in 0..steps {
        for s in 0..3 {
            hist[s].push(toks[s]);
        }
        let ls = g
            .streams_step(&toks.iter().map(|t| Some(*t)).collect::<Vec<_>>())
            .unwrap();
        for s in 0..3 {
            let l = ls[s].as_ref().unwrap();
            toks[s] = match &mut samplers[s] {
                Some(sm) => sm.sample(l, &hist[s]).unwrap(),
                None => nibble_backend::argmax(l),
            };
            want[s].push(toks[s]);
        }
    }
    for s in 0..3 {
        g.streams_end(s).unwrap();
    }
    // Device: the same requests restarted, runs of 4 with two queued.
    let mut samplers: Vec<Option<Sampler>> = params
        .iter()
        .map(|p| p.clone().map(|p| Sampler::new(p).unwrap()))
        .collect();
    let mut hist: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut got: Vec<Vec<u32>> = vec![vec![]; 3];
    let mut inputs = vec![None; 3];
    for s in 0..3 {
        let l = g.stream_prefill(s, 0, prompts[s]).unwrap();
        let t = match &mut samplers[s] {
            Some(sm) => sm.sample(&l, &hist[s]).unwrap(),
            None => nibble_backend::argmax(&l),
        };
        hist[s].push(t);
        got[s].push(t);
        inputs[s] = Some(t);
    }
    let draws: Vec<Vec<f64>> = (0..3)
        .map(|s| match &mut samplers[s] {
            Some(sm) => sm.draw_uniforms(ctxlen - prompts[s].len()),
            None => vec![],
        })
        .collect();
    let specs: Vec<_> = (0..3)
        .map(|s| {
            samplers[s]
                .as_ref()
                .map(|sm| sm.device_sampling(&hist[s], &draws[s]))
        })
        .collect();
    let refs: Vec<_> = specs.iter().map(Option::as_ref).collect();
    assert_eq!(g.streams_queue_sampled(&inputs, 4, &[], &refs).unwrap(), 4);
    assert_eq!(g.streams_queue(None, 4, &[]).unwrap(), 4);
    while got[0].len() <= steps {
        let ids = g.streams_collect().unwrap().unwrap();
        for s in 0..3 {
            got[s].extend_from_slice(&ids[s]);
        }
        g.streams_queue(None, 4, &[]).unwrap();
    }
    while let Some(ids) = g.streams_collect().unwrap() {
        for s in 0..3 {
            got[s].extend_from_slice(&ids[s]);
        }
    }
    for s in 0..3 {
        assert!(got[s].len() > steps, "{}", got[s].len());
        assert_eq!(got[s][..=steps], want[s][..], "stream {s}");
    }
}
