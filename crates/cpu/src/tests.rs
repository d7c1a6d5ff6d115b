//! The CPU backend against references: its products against f64 sums on random weights of every
//! dtype, and the whole backend against the oracle (greedy ids and logits cosine, the GPU's bar),
//! plus what it must refuse.

use crate::matmul::{self, Job};
use crate::{CpuBackend, PREFILL_CHUNK};
use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::kv_cache::CacheType;
use nibble_model::synth::{MemModel, QuantMix, SynthParams};
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use nibble_quant::DType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `[rows, cols]` random weights stored as `dtype` (two parts, as a split checkpoint holds
/// them), and their exact f32 values.
fn weights(
    rng: &mut ChaCha8Rng,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> (Vec<Vec<u8>>, Vec<f32>) {
    let vals = random(rng, rows * cols);
    let half = rows / 2 * cols;
    let parts: Vec<Vec<u8>> = [&vals[..half], &vals[half..]]
        .iter()
        .map(|v| nibble_quant::encode_float(dtype, v))
        .collect();
    let mut exact = vec![0f32; rows * cols];
    let bytes: Vec<u8> = parts.concat();
    nibble_quant::dequantize(dtype, &bytes, &mut exact).unwrap();
    (parts, exact)
}

#[test]
fn products_match_f64_sums_for_every_dtype_and_token_count() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for dtype in DType::ALL {
        // K-quant rows are whole 256-weight super-blocks, MLX rows whole groups of 64.
        let shapes: &[(usize, usize)] = if dtype.layout().block_elems == 256 {
            &[(2, 256), (13, 512), (6, 2048)]
        } else if dtype.layout().block_elems == 64 {
            &[(2, 64), (13, 128), (40, 192), (6, 2048)]
        } else {
            &[(2, 32), (13, 64), (40, 96), (6, 2048)]
        };
        for &(rows, cols) in shapes {
            let (parts, exact) = weights(&mut rng, dtype, rows, cols);
            let w = Weight {
                dtype,
                shape: vec![rows, cols],
                parts: parts.iter().map(|p| p.as_slice()).collect(),
            };
            for n in [1, 3, 4, 5, 9] {
                let x = random(&mut rng, n * cols);
                // Two jobs over the same tensor: all rows, and rows 1..rows-1.
                let jobs = [
                    Job {
                        w: &w,
                        row0: 0,
                        rows,
                        x: &x,
                        n,
                    },
                    Job {
                        w: &w,
                        row0: 1,
                        rows: rows - 2,
                        x: &x,
                        n,
                    },
                ];
                let outs = matmul::run(&jobs).unwrap();
                for (job, out) in jobs.iter().zip(&outs) {
                    assert_eq!(out.len(), job.rows * n);
                    for r in 0..job.rows {
                        for t in 0..n {
                            let row = &exact[(job.row0 + r) * cols..][..cols];
                            let want: f64 = row
                                .iter()
                                .zip(&x[t * cols..][..cols])
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum();
                            let got = out[r * n + t] as f64;
                            let bound = 1e-5 * (cols as f64).sqrt() + 1e-6 * want.abs();
                            assert!(
                                (got - want).abs() <= bound,
                                "{dtype:?} {rows}x{cols} n={n} row {r} token {t}: {got} vs {want}"
                            );
                        }
                    }
                }
                // A token's sums do not depend on the other tokens of the call.
                let alone = matmul::run(&[Job {
                    w: &w,
                    row0: 0,
                    rows,
                    x: &x[..cols],
                    n: 1,
                }])
                .unwrap();
                for r in 0..rows {
                    assert_eq!(alone[0][r].to_bits(), outs[0][r * n].to_bits());
                }
            }
        }
    }
}

#[test]
fn products_refuse_bad_shapes_and_non_finite_scales() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (parts, _) = weights(&mut rng, DType::Q4_0, 4, 64);
    let mut bytes = parts.concat();
    let x = random(&mut rng, 64);
    let w = |b: &[u8]| Weight {
        dtype: DType::Q4_0,
        shape: vec![4, 64],
        parts: vec![b.to_vec().leak()],
    };
    let ok = w(&bytes);
    let err = |jobs: &[Job]| matmul::run(jobs).unwrap_err().to_string();
    assert!(err(&[Job {
        w: &ok,
        row0: 3,
        rows: 2,
        x: &x,
        n: 1
    }])
    .contains("rows 3..5"));
    assert!(err(&[Job {
        w: &ok,
        row0: 0,
        rows: 4,
        x: &x[..32],
        n: 1
    }])
    .contains("input values"));
    let odd = Weight {
        dtype: DType::F32,
        shape: vec![1, 40],
        parts: vec![vec![0u8; 160].leak()],
    };
    let x40 = vec![1f32; 40];
    assert!(err(&[Job {
        w: &odd,
        row0: 0,
        rows: 1,
        x: &x40,
        n: 1
    }])
    .contains("whole blocks"));
    // Block 1 of row 2 gets an f16 NaN scale (0x7e00), then an infinite one (0x7c00).
    for bits in [0x7e00u16, 0x7c00] {
        let at = (2 * 2 + 1) * 18;
        bytes[at..at + 2].copy_from_slice(&bits.to_le_bytes());
        let bad = w(&bytes);
        let e = err(&[Job {
            w: &bad,
            row0: 0,
            rows: 4,
            x: &x,
            n: 1,
        }]);
        assert!(e.contains("non-finite scale"), "{e}");
    }
}

/// The K-quant and MLX decoders are implementations of their own: on random bytes (every bit
/// pattern of the packed scales, mins and quants; finite f16 or bf16 scales) they give the
/// oracle's dequantized values bit for bit, and a non-finite `d`, `dmin`, scale or bias is an
/// error.
#[test]
fn k_quant_and_mlx_rows_decode_to_the_oracles_bits_and_refuse_bad_scales() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dtype in [
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::MLX_A4,
        DType::MLX_A8,
    ] {
        let mlx = matches!(dtype, DType::MLX_A4 | DType::MLX_A8);
        let be = dtype.layout().block_elems as usize;
        let bb = dtype.layout().block_bytes as usize;
        let cols = 1024;
        let mut bytes: Vec<u8> = (0..2 * cols / be * bb).map(|_| rng.random()).collect();
        // Scale offsets within a block: d (and dmin, or MLX's scale and bias) first, Q6_K's d
        // last.
        let scales: &[usize] = if dtype == DType::Q6_K {
            &[208]
        } else {
            &[0, 2]
        };
        for blk in bytes.chunks_exact_mut(bb) {
            for &at in scales {
                let v = rng.random_range(-2.0f32..2.0);
                blk[at..at + 2].copy_from_slice(&if mlx {
                    half::bf16::from_f32(v).to_le_bytes()
                } else {
                    half::f16::from_f32(v).to_le_bytes()
                });
            }
        }
        let w = Weight {
            dtype,
            shape: vec![2, cols],
            parts: vec![bytes.as_slice()],
        };
        let mut want = vec![0f32; 2 * cols];
        nibble_quant::dequantize(dtype, &bytes, &mut want).unwrap();
        for r in 0..2 {
            let mut got = vec![0f32; cols];
            matmul::decode_row(&w, r, &mut got).unwrap();
            for (i, (g, e)) in got.iter().zip(&want[r * cols..]).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{dtype:?} row {r} weight {i}: {g} vs {e}"
                );
            }
        }
        let x = random(&mut rng, cols);
        let jobs = [Job {
            w: &w,
            row0: 0,
            rows: 2,
            x: &x,
            n: 1,
        }];
        assert!(matmul::run(&jobs).is_ok());
        for &at in scales {
            let mut bad = bytes.clone();
            let nan: u16 = if mlx { 0x7fc0 } else { 0x7e00 };
            bad[bb + at..bb + at + 2].copy_from_slice(&nan.to_le_bytes());
            let w = Weight {
                dtype,
                shape: vec![2, cols],
                parts: vec![bad.as_slice()],
            };
            let jobs = [Job {
                w: &w,
                row0: 0,
                rows: 2,
                x: &x,
                n: 1,
            }];
            let e = matmul::run(&jobs).unwrap_err().to_string();
            assert!(
                e.contains("block 1 of a") && e.contains("non-finite"),
                "{dtype:?}: {e}"
            );
            let mut row = vec![0f32; cols];
            assert!(matmul::decode_row(&w, 0, &mut row).is_err());
        }
    }
}

const VOCAB: usize = 151_936;
const STEPS: usize = 128;
const PROMPTS: [&[u32]; 3] = [
    &[1, 2, 3],
    &[151_000, 17, 9000, 4],
    &[9, 9, 9, 9, 250, 77_777],
];

fn model(vocab: usize, tie: bool) -> Arc<MemModel> {
    let cfg = Qwen3MoeConfig {
        vocab_size: vocab,
        tie_word_embeddings: tie,
        ..Qwen3MoeConfig::tiny()
    };
    Arc::new(MemModel::new(&cfg, &SynthParams::default()))
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += *x as f64 * *y as f64;
        aa += *x as f64 * *x as f64;
        bb += *y as f64 * *y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// Issue 4's bar, on the CPU backend: for 3 prompts on the tiny model with the real vocabulary,
/// 128 greedy ids equal the oracle's, and every step's logits (teacher-forced along the
/// oracle's path) have cosine >= 0.99999 with the oracle's.
#[test]
fn greedy_ids_and_logits_match_the_oracle() {
    let worst = greedy_parity(CacheType::F32);
    assert!(worst >= 0.99999, "min cosine {worst}");
}

/// The same with f16 KV caches on both sides (`--cache-type f16`): the greedy ids still equal
/// the oracle's and the logits keep the bar on this model (rounding to f16 magnifies the
/// backends' tiny differences, so other models can miss it: kv_cache.rs), and the f16 oracle
/// differs from the f32 one.
#[test]
fn f16_cache_matches_the_f16_oracle() {
    let worst = greedy_parity(CacheType::F16);
    assert!(worst >= 0.99999, "min cosine {worst}");
    // The CPU's rounding is the oracle's: its f16 logits lie far closer to the f16 oracle's
    // than the f16 oracle's lie to the f32 oracle's (a cache that skipped rounding the keys or
    // the values would sit in between).
    let m = model(VOCAB, false);
    let run = |ct: CacheType, cpu: bool| {
        let mut b: Box<dyn Backend> = if cpu {
            Box::new(CpuBackend::with_cache(m.clone(), 64, 0, ct).unwrap())
        } else {
            Box::new(RefBackend::with_cache(m.clone(), 64, ct).unwrap())
        };
        b.prefill(PROMPTS[2]).unwrap();
        b.step(5).unwrap()
    };
    let far = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let (ours, want) = (run(CacheType::F16, true), run(CacheType::F16, false));
    let gap = far(&want, &run(CacheType::F32, false));
    println!(
        "f16 cache: |cpu - oracle| {:.3e}, |oracle f16 - f32| {gap:.3e}",
        far(&ours, &want)
    );
    assert!(gap > 0.0, "the oracle's f16 cache rounds nothing");
    let bytes = |ct| {
        CpuBackend::with_cache(m.clone(), 64, 0, ct)
            .unwrap()
            .kv_cache_bytes()
    };
    assert_eq!(
        bytes(CacheType::F16) * 2,
        bytes(CacheType::F32),
        "halves take half"
    );
    assert!(
        far(&ours, &want) * 10.0 < gap,
        "{} vs {gap}",
        far(&ours, &want)
    );
}

/// Greedy ids of the CPU backend and the oracle, both with `cache` KV caches, for [`STEPS`]
/// tokens of each prompt (asserted equal); returns the lowest logits cosine over every step.
fn greedy_parity(cache: CacheType) -> f64 {
    let m = model(VOCAB, false);
    let mut oracle = RefBackend::with_cache(m.clone(), 256, cache).unwrap();
    let mut cpu = CpuBackend::with_cache(m, 256, 0, cache).unwrap();
    let mut all = 1f64;
    for prompt in PROMPTS {
        oracle.truncate(0).unwrap();
        let mut want_logits = vec![oracle.prefill(prompt).unwrap()];
        let mut want = vec![argmax(&want_logits[0])];
        while want.len() < STEPS {
            want_logits.push(oracle.step(*want.last().unwrap()).unwrap());
            want.push(argmax(want_logits.last().unwrap()));
        }
        cpu.truncate(0).unwrap();
        cpu.prefill(&prompt[..prompt.len() - 1]).unwrap();
        let got = cpu
            .decode_greedy(*prompt.last().unwrap(), STEPS, &[])
            .unwrap();
        assert_eq!(got, want, "{cache} cache: greedy ids of prompt {prompt:?}");
        assert_eq!(cpu.position(), prompt.len() + STEPS - 1);

        cpu.truncate(0).unwrap();
        let mut worst = cosine(&cpu.prefill(prompt).unwrap(), &want_logits[0]);
        for s in 1..STEPS {
            worst = worst.min(cosine(&cpu.step(want[s - 1]).unwrap(), &want_logits[s]));
        }
        println!("CPU PARITY ({cache} cache) prompt {prompt:?}: min cos {worst:.9}");
        all = all.min(worst);
    }
    all
}

/// A `Q4_K_M`-style model (Q4_K matrices, Q6_K lm_head and some attn_v / ffn_down_exps; the
/// small config, whose every row is whole super-blocks): greedy ids and logits as the oracle's.
#[test]
fn k_quant_mix_matches_the_oracle() {
    let cfg = Qwen3MoeConfig::small();
    let p = SynthParams {
        mix: QuantMix::Q4KM,
        ..SynthParams::default()
    };
    let m = Arc::new(MemModel::new(&cfg, &p));
    let kinds: std::collections::HashSet<DType> = TensorKey::all(&cfg)
        .into_iter()
        .map(|k| m.weight(k).unwrap().dtype)
        .collect();
    for d in [DType::Q4_K, DType::Q6_K, DType::F32] {
        assert!(kinds.contains(&d), "the mix has no {d:?}");
    }
    assert!(
        !kinds.contains(&DType::Q4_0),
        "every row is whole super-blocks"
    );
    let mut oracle = RefBackend::new(m.clone(), 128).unwrap();
    let mut cpu = CpuBackend::new(m, 128).unwrap();
    for prompt in PROMPTS {
        oracle.truncate(0).unwrap();
        let mut want_logits = vec![oracle.prefill(prompt).unwrap()];
        let mut want = vec![argmax(&want_logits[0])];
        while want.len() < 32 {
            want_logits.push(oracle.step(*want.last().unwrap()).unwrap());
            want.push(argmax(want_logits.last().unwrap()));
        }
        cpu.truncate(0).unwrap();
        let mut worst = cosine(&cpu.prefill(prompt).unwrap(), &want_logits[0]);
        let mut got = vec![argmax(&want_logits[0])];
        for s in 1..32 {
            let l = cpu.step(got[s - 1]).unwrap();
            worst = worst.min(cosine(&l, &want_logits[s]));
            got.push(argmax(&l));
        }
        assert_eq!(got, want, "greedy ids of prompt {prompt:?}");
        println!("CPU K-QUANT PARITY prompt {prompt:?}: min cos {worst:.9}");
        assert!(worst >= 0.99999, "prompt {prompt:?}: min cosine {worst}");
    }
}

/// A prompt longer than a prefill chunk (tied embeddings, the other lm_head) gives the oracle's
/// last logits, and the same bits as feeding it token by token.
/// YaRN (x4 over 1024 positions): the chunked prefill and the decode follow the oracle, which
/// scales the rotated q and k as transformers does (the CPU scales cos and sin the same way),
/// and the scaling moves this model's logits (a backend ignoring it would fail here).
#[test]
fn yarn_matches_the_oracle() {
    let yarn = nibble_model::rope::RopeScaling::Yarn {
        factor: 4.0,
        original_context: 1024,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: nibble_model::rope::yarn_default_attention_factor(4.0),
        truncate: true,
    };
    let cfg = Qwen3MoeConfig {
        vocab_size: 512,
        rope_scaling: Some(yarn),
        ..Qwen3MoeConfig::tiny()
    };
    let m = Arc::new(MemModel::new(&cfg, &SynthParams::default()));
    let prompt: Vec<u32> = (0..PREFILL_CHUNK as u32 + 37)
        .map(|i| (i * 89 + 3) % 512)
        .collect();
    let mut oracle = RefBackend::new(m.clone(), 512).unwrap();
    let mut want_logits = vec![oracle.prefill(&prompt).unwrap()];
    let mut want = vec![argmax(&want_logits[0])];
    while want.len() < 24 {
        want_logits.push(oracle.step(*want.last().unwrap()).unwrap());
        want.push(argmax(want_logits.last().unwrap()));
    }
    let plain = Qwen3MoeConfig {
        rope_scaling: None,
        ..cfg
    };
    let mut p = RefBackend::new(
        Arc::new(MemModel::new(&plain, &SynthParams::default())),
        512,
    )
    .unwrap();
    let c = cosine(&p.prefill(&prompt).unwrap(), &want_logits[0]);
    assert!(c < 0.999, "YaRN barely moves the logits: cosine {c}");

    let mut cpu = CpuBackend::new(m, 512).unwrap();
    let got = cpu.prefill(&prompt).unwrap();
    assert!(cosine(&got, &want_logits[0]) >= 0.99999);
    let mut ids = vec![argmax(&got)];
    ids.extend(cpu.decode_greedy(ids[0], 23, &[]).unwrap());
    assert_eq!(ids, want);
    cpu.truncate(prompt.len()).unwrap();
    for s in 1..want.len() {
        let c = cosine(&cpu.step(want[s - 1]).unwrap(), &want_logits[s]);
        assert!(c >= 0.99999, "step {s}: cosine {c}");
    }
}

#[test]
fn chunked_prefill_matches_the_oracle_and_single_steps() {
    let m = model(512, true);
    let prompt: Vec<u32> = (0..PREFILL_CHUNK as u32 + 37)
        .map(|i| (i * 97 + 5) % 512)
        .collect();
    let mut oracle = RefBackend::new(m.clone(), 512).unwrap();
    let want = oracle.prefill(&prompt).unwrap();
    let mut cpu = CpuBackend::new(m.clone(), 512).unwrap();
    // In two calls, the second starting mid-context and crossing a chunk boundary.
    cpu.prefill(&prompt[..10]).unwrap();
    let got = cpu.prefill(&prompt[10..]).unwrap();
    assert_eq!(cpu.position(), prompt.len());
    let c = cosine(&got, &want);
    assert!(c >= 0.99999, "cosine {c}");
    assert_eq!(argmax(&got), argmax(&want));

    let mut single = CpuBackend::new(m, 512).unwrap();
    let mut last = Vec::new();
    for t in &prompt {
        last = single.step(*t).unwrap();
    }
    let same = last
        .iter()
        .zip(&got)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "chunked prefill and single steps differ");

    // The thread count changes nothing either.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let one = pool.install(|| {
        let mut b = CpuBackend::new(model(512, true), 512).unwrap();
        b.prefill(&prompt).unwrap()
    });
    assert!(one
        .iter()
        .zip(&got)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn bad_input_is_an_error_that_appends_nothing() {
    let m = model(512, false);
    let mut cpu = CpuBackend::new(m.clone(), 16).unwrap();
    cpu.prefill(&[1, 2, 3]).unwrap();
    let msg = |r: anyhow::Result<Vec<f32>>| format!("{:#}", r.unwrap_err());
    assert!(msg(cpu.prefill(&[])).contains("empty"));
    assert!(msg(cpu.prefill(&[4, 512])).contains("outside the vocabulary"));
    assert!(msg(cpu.prefill(&[7; 14])).contains("exceeds the context"));
    assert_eq!(cpu.position(), 3);
    assert!(cpu.truncate(4).is_err());
    cpu.truncate(1).unwrap();
    assert_eq!(cpu.position(), 1);
    assert!(CpuBackend::new(m.clone(), 0).is_err());
    assert!(CpuBackend::new(m, 1 << 30).is_err());

    // A NaN block scale in layer 2's up-projection of every expert: the call fails, naming it.
    let mut broken = Arc::try_unwrap(model(512, false)).unwrap_or_else(|_| unreachable!());
    let up = broken
        .tensors
        .get_mut(&TensorKey::Layer(2, LayerTensor::ExpUp))
        .unwrap();
    for block in up.chunks_exact_mut(18) {
        block[..2].copy_from_slice(&0x7e00u16.to_le_bytes());
    }
    let mut cpu = CpuBackend::new(Arc::new(broken), 16).unwrap();
    let e = msg(cpu.prefill(&[1, 2]));
    assert!(
        e.contains("layer 2 experts") && e.contains("non-finite scale"),
        "{e}"
    );
    assert_eq!(cpu.position(), 0);
}

/// Three streams prefilled with their own prompts and decoded together, in queued runs, give
/// each prompt's single-stream greedy ids; a stream that meets an EOS id stops there, one ended
/// by the host sits out the later runs, and host-fed steps return the single-stream logits'
/// bits.
#[test]
fn streams_equal_single_stream_decoding() {
    let m = model(512, false);
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[400, 17, 90, 4, 5], &[9, 9]];
    let mut single = CpuBackend::new(m.clone(), 64).unwrap();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            single.truncate(0).unwrap();
            single.prefill(&p[..p.len() - 1]).unwrap();
            single.decode_greedy(*p.last().unwrap(), 12, &[]).unwrap()
        })
        .collect();
    // Stream 1's 6th id as an EOS (its first occurrence ends it).
    let eos = want[1][5];
    let stop = want[1].iter().position(|t| *t == eos).unwrap();

    let mut b = CpuBackend::with_streams(m.clone(), 64, 3).unwrap();
    assert_eq!(b.max_streams(), 3);
    for (s, p) in prompts.iter().enumerate() {
        b.stream_prefill(s, 0, &p[..p.len() - 1]).unwrap();
    }
    let first: Vec<Option<u32>> = prompts.iter().map(|p| p.last().copied()).collect();
    assert_eq!(b.streams_queue(Some(&first), 4, &[eos]).unwrap(), 4);
    assert_eq!(b.streams_queue(None, 4, &[eos]).unwrap(), 4);
    let msg = b
        .streams_queue(Some(&first), 4, &[])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("collect"), "{msg}");
    let mut got = vec![Vec::new(); 3];
    for _ in 0..2 {
        for (g, ids) in got.iter_mut().zip(b.streams_collect().unwrap().unwrap()) {
            g.extend(ids);
        }
    }
    assert!(b.streams_collect().unwrap().is_none());
    b.streams_end(2).unwrap();
    assert_eq!(b.streams_queue(None, 4, &[eos]).unwrap(), 4);
    for (g, ids) in got.iter_mut().zip(b.streams_collect().unwrap().unwrap()) {
        g.extend(ids);
    }
    assert_eq!(got[0], want[0]);
    assert_eq!(got[1], want[1][..=stop]);
    assert_eq!(got[2], want[2][..8]);

    // Host-fed steps: stream 0 continues, stream 2 restarts from its prompt.
    let mut s0 = CpuBackend::new(m, 64).unwrap();
    let p0 = prompts[0];
    s0.prefill(p0).unwrap();
    for id in &want[0][..11] {
        s0.step(*id).unwrap();
    }
    let single_logits = s0.step(want[0][11]).unwrap();
    b.stream_prefill(2, 0, &[9]).unwrap();
    let out = b.streams_step(&[Some(want[0][11]), None, Some(9)]).unwrap();
    assert!(out[1].is_none());
    let l0 = out[0].as_ref().unwrap();
    assert!(l0
        .iter()
        .zip(&single_logits)
        .all(|(a, c)| a.to_bits() == c.to_bits()));
    assert!(out[2].is_some());
}

#[test]
fn streams_refuse_bad_requests() {
    let m = model(512, false);
    assert!(CpuBackend::with_streams(m.clone(), 16, 9).is_err());
    let mut b = CpuBackend::with_streams(m, 16, 2).unwrap();
    let msg = |e: anyhow::Error| format!("{e:#}");
    assert!(msg(b.stream_prefill(2, 0, &[1]).unwrap_err()).contains("slot 2"));
    assert!(msg(b.stream_prefill(0, 1, &[1]).unwrap_err()).contains("holds 0"));
    assert!(msg(b.stream_prefill(0, 0, &[512]).unwrap_err()).contains("vocabulary"));
    assert!(msg(b.stream_prefill(0, 0, &[1; 17]).unwrap_err()).contains("context"));
    assert!(msg(b.streams_step(&[Some(600)]).unwrap_err()).contains("vocabulary"));
    assert!(msg(b.streams_step(&[None, None, Some(1)]).unwrap_err()).contains("3 streams fed"));
    assert!(b.streams_end(5).is_err());
    // 14 positions held: a run of 8 is cut to the 2 left, then nothing is live.
    b.stream_prefill(0, 0, &[1; 14]).unwrap();
    assert_eq!(b.streams_queue(Some(&[Some(3)]), 8, &[]).unwrap(), 2);
    assert_eq!(b.streams_collect().unwrap().unwrap()[0].len(), 2);
    assert_eq!(b.streams_queue(None, 8, &[]).unwrap(), 0);
    assert!(msg(b.streams_step(&[Some(1)]).unwrap_err()).contains("filled its context"));
    // No stream live: nothing is queued.
    assert_eq!(b.streams_queue(Some(&[None, None]), 4, &[]).unwrap(), 0);
}

/// With a non-finite scale in the embedding row of one token (`BAD`), a stream prefill whose
/// first chunk succeeds (writing 256 rows) and whose second fails leaves the stream truncated
/// to its start, and a failing step or run appends nothing.
#[test]
fn failed_stream_calls_leave_consistent_positions() {
    const BAD: u32 = 77;
    let mut broken = Arc::try_unwrap(model(512, false)).unwrap_or_else(|_| unreachable!());
    let row_bytes = broken.cfg.hidden_size / 32 * 18;
    let embd = broken.tensors.get_mut(&TensorKey::TokenEmbd).unwrap();
    let at = BAD as usize * row_bytes + 18; // the row's second block
    embd[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let mut b = CpuBackend::with_streams(Arc::new(broken), 300, 2).unwrap();
    let ok = 5u32;
    b.stream_prefill(0, 0, &[ok, ok, ok]).unwrap();
    let mut long = vec![ok; PREFILL_CHUNK];
    long.push(BAD);
    let e = format!("{:#}", b.stream_prefill(0, 1, &long).unwrap_err());
    assert!(e.contains("non-finite scale"), "{e}");
    // Truncated to 1 by the failed call: 2 positions are no longer held.
    let e = format!("{:#}", b.stream_prefill(0, 2, &[ok]).unwrap_err());
    assert!(e.contains("holds 1"), "{e}");
    b.stream_prefill(0, 1, &[ok, ok]).unwrap();
    // A failed step or run leaves every stream where it was (3 positions).
    assert!(b.streams_step(&[Some(BAD)]).is_err());
    assert!(b
        .streams_queue(Some(&[Some(ok), Some(BAD)]), 4, &[])
        .is_err());
    assert!(b.streams_collect().unwrap().is_none());
    assert!(b.stream_prefill(0, 4, &[ok]).is_err());
    b.stream_prefill(0, 3, &[ok]).unwrap();
}

/// `trace_step` gives the oracle's intermediates (every name but `router_probs`, in the
/// oracle's order) with values within 1e-4 relative L2 of the oracle's, so `parity` can name
/// the first diverging op on the CPU backend; a bad token is refused and appends nothing.
#[test]
fn trace_step_matches_the_oracles_trace() {
    let m = model(512, false);
    let mut oracle = RefBackend::new(m.clone(), 64).unwrap();
    let mut cpu = CpuBackend::new(m, 64).unwrap();
    let prompt = [5u32, 77, 300, 12];
    oracle.prefill(&prompt).unwrap();
    cpu.prefill(&prompt).unwrap();
    let want = oracle.trace_step(9).unwrap().unwrap();
    let got = cpu.trace_step(9).unwrap().expect("the CPU backend traces");
    assert_eq!(cpu.position(), prompt.len() + 1);
    let expected: Vec<&str> = want
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !n.ends_with("router_probs"))
        .collect();
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, expected);
    for (name, v) in &got {
        let (_, w) = want.iter().find(|(n, _)| n == name).unwrap();
        let e = nibble_backend::divergence::rel_l2(v, w);
        assert!(e <= 1e-4, "{name}: relative L2 error {e}");
    }
    assert!(nibble_backend::divergence::first_divergence(&want, &got, 1e-4).is_none());
    // The traced step is a step: the next logits equal the oracle's next ones.
    let (a, b) = (oracle.step(3).unwrap(), cpu.step(3).unwrap());
    assert!(cosine(&a, &b) >= 0.99999);
    assert!(cpu.trace_step(512).is_err());
    assert_eq!(cpu.position(), prompt.len() + 2);
}

/// With one weight byte of layer 2's o-proj changed in the CPU backend's copy, the traces part
/// first at `l2.attn_out`: what `nibble parity` reports as the first diverging op.
#[test]
fn trace_names_the_first_op_a_changed_weight_touches() {
    let good = model(512, false);
    let cfg = good.cfg.clone();
    let mut bad = MemModel::new(&cfg, &SynthParams::default());
    let key = TensorKey::Layer(2, LayerTensor::AttnOut);
    let bytes = bad.tensors.get_mut(&key).unwrap();
    bytes[5] ^= 0x77; // block 0's nibbles (bytes 2..18), not its scale
    let mut oracle = RefBackend::new(good, 16).unwrap();
    let mut cpu = CpuBackend::new(Arc::new(bad), 16).unwrap();
    oracle.prefill(&[1, 2]).unwrap();
    cpu.prefill(&[1, 2]).unwrap();
    let (want, got) = (
        oracle.trace_step(3).unwrap().unwrap(),
        cpu.trace_step(3).unwrap().unwrap(),
    );
    let d = nibble_backend::divergence::first_divergence(&want, &got, 1e-4).expect("a divergence");
    assert_eq!(d.name, "l2.attn_out", "{d:?}");
}

/// Every prompt token's logits (`prefill_rows`, in `ROWS_CHUNK` chunks) against the oracle
/// stepped token by token, for the main sequence and a stream slot; the cache they leave
/// continues as the oracle's.
#[test]
fn prompt_rows_match_the_oracle_stepped() {
    let m = model(512, false);
    let p: Vec<u32> = (0..crate::ROWS_CHUNK as u32 + 9)
        .map(|i| (i * 37 + 11) % 512)
        .collect();
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    let want: Vec<Vec<f32>> = p.iter().map(|&t| rb.step(t).unwrap()).collect();
    let next = rb
        .decode_greedy(argmax(want.last().unwrap()), 5, &[])
        .unwrap();
    let mut b = CpuBackend::with_streams(m, 128, 2).unwrap();
    let check = |got: &[Vec<f32>], want: &[Vec<f32>]| {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let c = cosine(g, w);
            assert!(c >= 0.99999, "row {i} cosine {c}");
            assert_eq!(argmax(g), argmax(w), "row {i}");
        }
    };
    let mut got = Vec::new();
    b.prefill_rows(&p, 0, &mut |i, l| {
        assert_eq!(i, got.len());
        got.push(l.to_vec());
        Ok(())
    })
    .unwrap();
    check(&got, &want);
    assert_eq!(b.position(), p.len());
    assert_eq!(
        b.decode_greedy(argmax(&got[p.len() - 1]), 5, &[]).unwrap(),
        next
    );
    // Stream 1 keeps 5 positions and scores the rest.
    b.stream_prefill(1, 0, &p[..5]).unwrap();
    let mut got = Vec::new();
    b.stream_prefill_rows(1, 5, &p[5..], &mut |_, l| {
        got.push(l.to_vec());
        Ok(())
    })
    .unwrap();
    check(&got, &want[5..]);
    let ids = b
        .streams_decode_greedy(&[None, Some(argmax(got.last().unwrap()))], 5, &[])
        .unwrap();
    assert_eq!(ids[1], next);
}
