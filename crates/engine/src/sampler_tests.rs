//! Unit tests for the sampler: hand-computed distributions, penalties, determinism.

use super::*;

/// Random logits in roughly [-4, 4), from a fixed seed.
fn random_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random::<f32>() * 8.0 - 4.0).collect()
}

fn seeded(params: SamplingParams) -> Sampler {
    Sampler::new(SamplingParams {
        seed: Some(1234),
        ..params
    })
    .unwrap()
}

/// Draws `n` samples and returns the frequency of each id.
fn frequencies(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<f64> {
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..n {
        counts[s.sample(logits, &[]).unwrap() as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / n as f64).collect()
}

fn ln(ps: &[f64]) -> Vec<f32> {
    ps.iter().map(|p| p.ln() as f32).collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "id {i}: got {g}, want {w} (all: {got:?})"
        );
    }
}

#[test]
fn greedy_is_argmax_with_lowest_index_on_ties() {
    let mut s = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &[]).unwrap(), 1);
    assert_eq!(s.sample(&[-5.0, -7.0, -5.0], &[]).unwrap(), 0);
    let logits = random_logits(1000, 7);
    let want = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0;
    assert_eq!(s.sample(&logits, &[]).unwrap() as usize, want);
}

#[test]
fn nan_logits_never_win_and_never_panic() {
    let logits = [f32::NAN, 1.0, f32::NAN, 0.5, f32::INFINITY * 0.0];
    let mut greedy = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(greedy.sample(&logits, &[]).unwrap(), 1);
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        ..Default::default()
    });
    for _ in 0..200 {
        let id = s.sample(&logits, &[0, 2]).unwrap();
        assert!(id == 1 || id == 3, "picked {id}");
    }
    assert!(greedy.sample(&[f32::NAN, f32::NAN], &[]).is_err());
    assert!(s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]).is_err());
    assert!(s.sample(&[], &[]).is_err());
}

#[test]
fn top_k_one_equals_greedy() {
    let mut topk = seeded(SamplingParams {
        temperature: 1.3,
        top_k: 1,
        ..Default::default()
    });
    let mut greedy = Sampler::new(SamplingParams::default()).unwrap();
    for seed in 0..50 {
        let logits = random_logits(300, seed);
        assert_eq!(
            topk.sample(&logits, &[]).unwrap(),
            greedy.sample(&logits, &[]).unwrap()
        );
    }
}

#[test]
fn temperature_one_reproduces_softmax() {
    let p = [0.1, 0.2, 0.3, 0.4];
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        ..Default::default()
    });
    assert_close(&frequencies(&mut s, &ln(&p), 40_000), &p, 0.01);
}

#[test]
fn temperature_half_squares_probabilities() {
    // softmax(ln p / 0.5) = p^2 / sum p^2 = [1, 4, 9, 16] / 30.
    let p = [0.1, 0.2, 0.3, 0.4];
    let mut s = seeded(SamplingParams {
        temperature: 0.5,
        ..Default::default()
    });
    let want = [1.0 / 30.0, 4.0 / 30.0, 9.0 / 30.0, 16.0 / 30.0];
    assert_close(&frequencies(&mut s, &ln(&p), 40_000), &want, 0.01);
}

#[test]
fn top_k_renormalises_over_the_k_largest() {
    // k = 2 keeps ids 3 (0.4) and 2 (0.3): 4/7 and 3/7.
    let p = [0.1, 0.2, 0.3, 0.4];
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        top_k: 2,
        ..Default::default()
    });
    let f = frequencies(&mut s, &ln(&p), 40_000);
    assert_close(&f, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0], 0.01);
    assert_eq!(f[0] + f[1], 0.0);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    // Sorted: 0.5, 0.3, 0.15, 0.05. p = 0.75 needs {0.5, 0.3}; p = 0.85 needs the first three.
    let p = [0.05, 0.5, 0.15, 0.3];
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        top_p: 0.75,
        ..Default::default()
    });
    let f = frequencies(&mut s, &ln(&p), 40_000);
    assert_close(&f, &[0.0, 0.625, 0.0, 0.375], 0.01);
    assert_eq!(f[0] + f[2], 0.0);

    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        top_p: 0.85,
        ..Default::default()
    });
    let f = frequencies(&mut s, &ln(&p), 40_000);
    assert_close(&f, &[0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], 0.01);
    assert_eq!(f[0], 0.0);

    // A tiny p still keeps the most likely token.
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        top_p: 0.01,
        ..Default::default()
    });
    assert_eq!(frequencies(&mut s, &ln(&p), 500)[1], 1.0);
}

#[test]
fn min_p_uses_a_threshold_relative_to_the_max() {
    // max = 0.5. min_p 0.35 -> floor 0.175 keeps {0.5, 0.3}; min_p 0.25 -> floor 0.125 adds 0.15.
    let p = [0.05, 0.5, 0.15, 0.3];
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        min_p: 0.35,
        ..Default::default()
    });
    assert_close(
        &frequencies(&mut s, &ln(&p), 40_000),
        &[0.0, 0.625, 0.0, 0.375],
        0.01,
    );
    let mut s = seeded(SamplingParams {
        temperature: 1.0,
        min_p: 0.25,
        ..Default::default()
    });
    let f = frequencies(&mut s, &ln(&p), 40_000);
    assert_close(&f, &[0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], 0.01);
    assert_eq!(f[0], 0.0);
}

/// Runs only the penalty stage and returns the adjusted logits.
fn penalised(params: SamplingParams, logits: &[f32], history: &[u32]) -> Vec<f32> {
    let mut s = Sampler::new(params).unwrap();
    let mut row = logits.to_vec();
    s.apply_penalties(&mut row, history);
    row
}

#[test]
fn top_k_keeps_the_k_largest_finite_logits_lower_ids_first_on_ties() {
    // Rows with many ties, NaN and infinities; k on both sides of the streamed limit.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for trial in 0..40 {
        let n = 50 + (next() % 3000) as usize;
        let row: Vec<f32> = (0..n)
            .map(|_| match next() % 50 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                v => {
                    (v % 17) as f32 * 0.5 - 3.0
                        + if trial % 2 == 0 {
                            0.0
                        } else {
                            0.001 * (next() % 7) as f32
                        }
                }
            })
            .collect();
        for k in [1, 7, 40, TOP_K_STREAMED, TOP_K_STREAMED + 1, n + 5] {
            let mut want: Vec<(u32, f64)> = row
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (i as u32, f64::from(v)))
                .collect();
            want.sort_unstable_by(by_value_desc);
            want.truncate(k);
            let mut want: Vec<u32> = want.into_iter().map(|c| c.0).collect();
            want.sort_unstable();
            let mut s = seeded(SamplingParams {
                temperature: 0.7,
                top_k: k,
                ..Default::default()
            });
            let id = s.sample(&row, &[]).unwrap();
            let mut got: Vec<u32> = s.candidates.iter().map(|c| c.0).collect();
            got.sort_unstable();
            assert_eq!(got, want, "trial {trial} n {n} k {k}");
            assert!(want.contains(&id), "trial {trial} k {k}: drew {id}");
        }
    }
}

/// The whole-row nucleus (binned, only the boundary bin sorted) keeps exactly the sorted
/// prefix that reaches top-p, on rows of several sizes (the largest over the parallel softmax's
/// chunks) and spreads, with and without top-k past the streamed limit and with min-p after.
#[test]
fn whole_row_nucleus_keeps_the_sorted_prefix_reaching_top_p() {
    for (trial, &(n, spread, temperature)) in [
        (300usize, 8.0f32, 1.0f32),
        (5000, 2.0, 0.7),
        (5000, 30.0, 1.0),
        (20_000, 12.0, 1.3),
        (40_000, 1.0, 1.0),
    ]
    .iter()
    .enumerate()
    {
        let row: Vec<f32> = random_logits(n, 77 + trial as u64)
            .iter()
            .map(|x| x * spread / 8.0)
            .collect();
        for top_p in [0.05f32, 0.5, 0.9, 0.95, 0.999] {
            for (top_k, min_p) in [(0usize, 0.0f32), (TOP_K_STREAMED + 44, 0.0), (0, 0.01)] {
                // Reference: the old way, a full sort then the prefix.
                let t = f64::from(temperature);
                let mut c: Vec<(u32, f64)> = row
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| (i as u32, f64::from(x) / t))
                    .collect();
                c.sort_unstable_by(by_value_desc);
                if top_k > 0 {
                    c.truncate(top_k);
                }
                let max = c[0].1;
                let total: f64 = c.iter().map(|v| (v.1 - max).exp()).sum();
                let mut mass = 0.0;
                let mut want = Vec::new();
                for v in &c {
                    let p = (v.1 - max).exp() / total;
                    if p >= f64::from(min_p) / total {
                        want.push(v.0);
                    }
                    mass += p;
                    if mass >= f64::from(top_p) {
                        break;
                    }
                }
                want.sort_unstable();
                let mut s = seeded(SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    ..Default::default()
                });
                let id = s.sample(&row, &[]).unwrap();
                let mut got: Vec<u32> = s.candidates.iter().map(|v| v.0).collect();
                got.sort_unstable();
                let what =
                    format!("n {n} T {temperature} top-p {top_p} top-k {top_k} min-p {min_p}");
                assert_eq!(got.len(), want.len(), "{what}: kept");
                assert_eq!(got, want, "{what}");
                assert!(want.binary_search(&id).is_ok(), "{what}: drew {id}");
            }
        }
    }
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let params = SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    };
    // Seen ids 0 and 2, id 0 twice: the HF penalty applies once per distinct id.
    let out = penalised(params.clone(), &[2.0, 1.5, -1.0, 0.7], &[0, 2, 0]);
    assert_eq!(out, vec![1.0, 1.5, -2.0, 0.7]);
    let mut s = Sampler::new(params).unwrap();
    assert_eq!(s.sample(&[2.0, 1.5, -1.0], &[]).unwrap(), 0);
    assert_eq!(s.sample(&[2.0, 1.5, -1.0], &[0]).unwrap(), 1);
    assert_eq!(s.sample(&[-1.0, -1.5], &[0]).unwrap(), 1);
}

#[test]
fn presence_and_frequency_penalties_subtract() {
    let presence = SamplingParams {
        presence_penalty: 0.6,
        ..Default::default()
    };
    let out = penalised(presence.clone(), &[2.0, 1.5, 0.25], &[0, 0, 0, 2]);
    assert_eq!(out, vec![1.4, 1.5, 0.25 - 0.6]);
    let mut s = Sampler::new(presence).unwrap();
    assert_eq!(s.sample(&[2.0, 1.5], &[0, 0, 0]).unwrap(), 1);

    let frequency = SamplingParams {
        frequency_penalty: 0.2,
        ..Default::default()
    };
    let out = penalised(frequency.clone(), &[2.0, 1.5, 1.0], &[0, 0, 0, 2]);
    assert_close(
        &out.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        &[1.4, 1.5, 0.8],
        1e-6,
    );
    let mut s = Sampler::new(frequency).unwrap();
    assert_eq!(s.sample(&[2.0, 1.5], &[0, 0]).unwrap(), 0); // 2.0 - 0.4 = 1.6 > 1.5
    assert_eq!(s.sample(&[2.0, 1.5], &[0, 0, 0]).unwrap(), 1); // 1.4 < 1.5
}

#[test]
fn history_ids_outside_the_row_are_ignored() {
    let params = SamplingParams {
        repetition_penalty: 1.5,
        presence_penalty: 1.0,
        ..Default::default()
    };
    let out = penalised(params, &[1.0, 2.0], &[5, u32::MAX, 1]);
    assert_eq!(out, vec![1.0, 2.0 / 1.5 - 1.0]);
}

#[test]
fn same_seed_same_ids_different_seed_different_ids() {
    let params = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.9,
        seed: Some(seed),
        ..Default::default()
    };
    let run = |seed| {
        let mut s = Sampler::new(params(seed)).unwrap();
        (0..100)
            .map(|i| s.sample(&random_logits(500, i), &[]).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn invalid_params_are_rejected() {
    let bad = [
        SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 1.5,
            ..Default::default()
        },
        SamplingParams {
            min_p: -0.1,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        },
        SamplingParams {
            presence_penalty: f32::INFINITY,
            ..Default::default()
        },
    ];
    for p in bad {
        assert!(Sampler::new(p.clone()).is_err(), "{p:?} accepted");
    }
    assert!(Sampler::new(SamplingParams::qwen3_thinking()).is_ok());
    assert!(Sampler::new(SamplingParams::qwen3_non_thinking()).is_ok());
}

#[test]
fn reserved_draws_keep_the_host_sequence_whatever_the_device_used() {
    let logits = random_logits(3000, 4);
    let p = SamplingParams::llama_cpp_defaults(21);
    // The host alone: 12 samples.
    let mut plain = Sampler::new(p.clone()).unwrap();
    let want: Vec<u32> = (0..12)
        .map(|_| plain.sample(&logits, &[]).unwrap())
        .collect();
    // A device reserves 8 draws and uses 5 of them (ids 2..7 of the sequence, fed the same
    // draws); the host then samples the rest from the unused draws and the RNG after them.
    let mut s = Sampler::new(p.clone()).unwrap();
    let mut got: Vec<u32> = (0..2).map(|_| s.sample(&logits, &[]).unwrap()).collect();
    let draws = s.draw_uniforms(8);
    assert_eq!(draws.len(), 8);
    for &u in &draws[..5] {
        got.push(s.sample_with_uniform(&logits, &[], u).unwrap());
    }
    s.consume_draws(5);
    // Reserving again returns the unused draws first.
    assert_eq!(s.draw_uniforms(2), draws[5..7].to_vec());
    while got.len() < 12 {
        got.push(s.sample(&logits, &[]).unwrap());
    }
    assert_eq!(got, want);
    // Greedy reserves nothing.
    let mut g = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(g.draw_uniforms(3), vec![0.0; 3]);
}

fn biased(bias: &[(u32, f32)], temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        logit_bias: bias.to_vec(),
        ..Default::default()
    }
}

#[test]
fn logit_bias_moves_the_greedy_choice_and_is_not_greedy_for_backends() {
    let logits = [1.0, 3.0, 2.0, 2.9];
    let mut s = Sampler::new(biased(&[(1, f32::NEG_INFINITY)], 0.0)).unwrap();
    assert!(
        !s.is_greedy(),
        "a biased row must not take the folded argmax"
    );
    assert_eq!(s.sample(&logits, &[]).unwrap(), 3);
    let mut s = Sampler::new(biased(&[(0, 2.5), (3, -1.0)], 0.0)).unwrap();
    assert_eq!(s.sample(&logits, &[]).unwrap(), 0);
    // The bias comes before the penalties, as in llama.cpp's chain and vLLM: -1.0 doubled by
    // the repetition penalty is -2 < -1.7 (penalty first would give 0.5 - 2 = -1.5 > -1.7).
    let mut s = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        ..biased(&[(1, -2.0)], 0.0)
    })
    .unwrap();
    assert_eq!(s.sample(&[-1.7, 1.0], &[1]).unwrap(), 0);
    // No device sampler adds a bias, so the device declines it.
    let spec = s.device_sampling(&[], &[]);
    assert!(!spec.in_device_range());
    let plain = Sampler::new(SamplingParams::llama_cpp_defaults(0)).unwrap();
    assert!(plain.device_sampling(&[], &[]).in_device_range());
}

#[test]
fn logit_bias_scales_sampled_probabilities_by_exp_bias() {
    // p = [0.1, 0.2, 0.3, 0.4]; bias ln 3 on id 0 and a ban on id 3: [0.3, 0.2, 0.3, 0] / 0.8.
    let p = [0.1, 0.2, 0.3, 0.4];
    let mut s = seeded(biased(&[(0, 3f32.ln()), (3, f32::NEG_INFINITY)], 1.0));
    let want = [0.375, 0.25, 0.375, 0.0];
    assert_close(&frequencies(&mut s, &ln(&p), 40_000), &want, 0.01);
}

#[test]
fn bad_logit_biases_are_refused() {
    for bias in [
        vec![(2, f32::NAN)],
        vec![(2, f32::INFINITY)],
        vec![(2, 2e6)],
        vec![(2, -1e38)],
        vec![(2, 1.0), (5, 0.0), (2, -1.0)],
    ] {
        assert!(
            Sampler::new(biased(&bias, 0.0)).is_err(),
            "{bias:?} accepted"
        );
    }
    // An id past the row is an error, not an out-of-bounds write.
    let mut s = Sampler::new(biased(&[(4, 1.0)], 0.0)).unwrap();
    let err = s.sample(&[0.0; 4], &[]).unwrap_err().to_string();
    assert!(err.contains("token 4"), "{err}");
    assert_eq!(biased(&[(4, 1.0)], 0.0).bias_outside(4), Some(4));
    assert_eq!(biased(&[(3, 1.0)], 0.0).bias_outside(4), None);
}
