//! Host cost of choosing one token from a Qwen3-sized logits row (151936 ids), the work a
//! sampled decode step adds on top of the device step (`cargo bench -p nibble-engine --bench
//! sampler`; docs/BENCHMARKS.md, runs 49-50).

use nibble_engine::sampler::{Sampler, SamplingParams};

const VOCAB: usize = 151_936;

fn main() {
    divan::main();
}

/// A fixed pseudo-random row in [-10, 10) (xorshift, so every run reads the same logits).
fn row() -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..VOCAB)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
        })
        .collect()
}

fn bench_params(b: divan::Bencher, params: SamplingParams) {
    let logits = row();
    let history: Vec<u32> = (0..256).map(|i| i * 577 % VOCAB as u32).collect();
    let mut s = Sampler::new(params).unwrap();
    b.bench_local(|| s.sample(divan::black_box(&logits), &history).unwrap());
}

/// `nibble bench --sampled`'s parameters: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05.
fn sampled() -> SamplingParams {
    SamplingParams::llama_cpp_defaults(0)
}

#[divan::bench]
fn top_k_40(b: divan::Bencher) {
    bench_params(b, sampled());
}

/// The same with presence and frequency penalties over a 256-id history (a copy of the row).
#[divan::bench]
fn top_k_40_penalties(b: divan::Bencher) {
    bench_params(
        b,
        SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.5,
            ..sampled()
        },
    );
}

/// OpenAI's defaults: temperature 1, no top-k, top-p 1 (the whole row is a candidate).
#[divan::bench]
fn whole_row(b: divan::Bencher) {
    bench_params(
        b,
        SamplingParams {
            temperature: 1.0,
            seed: Some(0),
            ..SamplingParams::default()
        },
    );
}

/// A nucleus over the whole row: temperature 1, top-p 0.95, no top-k.
#[divan::bench]
fn whole_row_top_p(b: divan::Bencher) {
    bench_params(
        b,
        SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(0),
            ..SamplingParams::default()
        },
    );
}

/// Greedy (temperature 0): the argmax.
#[divan::bench]
fn greedy(b: divan::Bencher) {
    bench_params(b, SamplingParams::default());
}
