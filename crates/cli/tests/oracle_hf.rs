//! The oracle against Hugging Face transformers.
//!
//! `scripts/oracle_fixture.py` ran `Qwen3MoeForCausalLM` (float32) on the tiny synthetic model
//! (`nibble synth --preset tiny --format safetensors --seed 0`) and recorded logit summaries and
//! greedy continuations in `tests/fixtures/oracle_hf.json`. Here the same model is regenerated
//! (synth is deterministic) in both file formats and the oracle must reproduce the fixture:
//! max |delta logit| <= 1e-4 x the logit scale, identical greedy continuations, and identical
//! logits from the GGUF (Q4_0) and safetensors (BF16) copies, which hold the same weights.

use nibble_backend::reference::RefBackend;
use nibble_backend::{argmax, Backend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::kv_cache::CacheType;
use nibble_model::loader;
use nibble_model::rope::{yarn_default_attention_factor, RopeScaling};
use nibble_model::synth::{self, SynthParams};
use serde::Deserialize;

#[derive(Deserialize)]
struct Summary {
    top_ids: Vec<u32>,
    top_logits: Vec<f64>,
    probe_logits: Vec<f64>,
    sum: f64,
    sum_sq: f64,
    max_abs: f64,
}

#[derive(Deserialize)]
struct Case {
    prompt: Vec<u32>,
    prompt_logits: Vec<Summary>,
    greedy: Vec<u32>,
    step_logits: Vec<Summary>,
}

#[derive(Deserialize)]
struct Fixture {
    transformers: String,
    probe_ids: Vec<u32>,
    cases: Vec<Case>,
    /// The rotary embedding transformers built (fixtures written since RoPE scaling).
    #[serde(default)]
    inv_freq: Vec<f64>,
    #[serde(default)]
    attention_scaling: Option<f64>,
}

/// Compare one row of oracle logits with HF's summary; returns max |delta| / scale.
fn compare(ours: &[f32], hf: &Summary, probes: &[u32], what: &str) -> f64 {
    let scale = hf.max_abs.max(1e-6);
    let mut worst = 0f64;
    for (id, want) in hf
        .top_ids
        .iter()
        .zip(&hf.top_logits)
        .chain(probes.iter().zip(&hf.probe_logits))
    {
        let d = (ours[*id as usize] as f64 - want).abs() / scale;
        worst = worst.max(d);
        assert!(
            d <= 1e-4,
            "{what}: logit of id {id}: oracle {} vs HF {want} (|d|/scale {d:.2e})",
            ours[*id as usize]
        );
    }
    // The row's top-1 must agree; lower ranks may swap only between near-equal logits.
    assert_eq!(argmax(ours), hf.top_ids[0], "{what}: top-1 differs");
    let n = ours.len() as f64;
    let sum: f64 = ours.iter().map(|&x| x as f64).sum();
    let sum_sq: f64 = ours.iter().map(|&x| (x as f64) * (x as f64)).sum();
    assert!(
        (sum - hf.sum).abs() <= 1e-4 * scale * n.sqrt(),
        "{what}: sum {sum} vs HF {}",
        hf.sum
    );
    assert!(
        (sum_sq - hf.sum_sq).abs() <= 1e-4 * hf.sum_sq,
        "{what}: sum_sq {sum_sq} vs HF {}",
        hf.sum_sq
    );
    worst
}

#[test]
fn oracle_matches_transformers_in_both_formats() {
    check_fixture("oracle_hf.json", Qwen3MoeConfig::tiny());
}

/// The same with YaRN (x4 over 1024 positions; the fixture's model was written by `synth
/// --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 1024`): the rotation table and attention
/// factor are transformers' own, and so are the logits and greedy continuations.
#[test]
fn oracle_matches_transformers_with_yarn() {
    let cfg = Qwen3MoeConfig {
        rope_scaling: Some(RopeScaling::Yarn {
            factor: 4.0,
            original_context: 1024,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: yarn_default_attention_factor(4.0),
            truncate: true,
        }),
        ..Qwen3MoeConfig::tiny()
    };
    let fx = check_fixture("oracle_hf_yarn.json", cfg.clone());
    let rope = cfg.rope();
    assert_eq!(fx.inv_freq.len(), rope.inv_freq.len());
    for (i, (want, got)) in fx.inv_freq.iter().zip(&rope.inv_freq).enumerate() {
        // transformers computes in f32, nibble in f64 rounded once.
        assert!(
            (*got as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
            "inv_freq[{i}]: {got} vs transformers {want}"
        );
    }
    let af = fx.attention_scaling.expect("the fixture records it");
    assert!((rope.attention_factor as f64 - af).abs() < 1e-6, "{af}");
    // The scaling moves this model: the plain fixture's greedy runs differ.
    let plain = fixture("oracle_hf.json");
    assert!(plain
        .cases
        .iter()
        .zip(&fx.cases)
        .any(|(a, b)| a.greedy != b.greedy));
}

/// An f16 KV cache (`--cache-type f16`) moves the oracle off transformers' f32 numerics by its rounding
/// alone: each row of the prompt stays within 2e-3 of the logit scale of the fixture's, with the
/// same top-1, and the rounding is visible (the rows differ from the f32 cache's).
#[test]
fn f16_cache_stays_close_to_transformers() {
    let fx = fixture("oracle_hf.json");
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let p = SynthParams {
        seed: 0,
        ..Default::default()
    };
    synth::write_gguf(&Qwen3MoeConfig::tiny(), &p, None, &gguf, true).unwrap();
    let m = loader::open(&gguf).unwrap();
    let (mut worst, mut moved) = (0f64, 0f64);
    for case in &fx.cases {
        let mut half = RefBackend::with_cache(m.weights.clone(), 256, CacheType::F16).unwrap();
        let mut full = RefBackend::with_cache(m.weights.clone(), 256, CacheType::F32).unwrap();
        for (t, &id) in case.prompt.iter().enumerate() {
            let (a, b) = (half.step(id).unwrap(), full.step(id).unwrap());
            let hf = &case.prompt_logits[t];
            let scale = hf.max_abs.max(1e-6);
            for (id, want) in hf.top_ids.iter().zip(&hf.top_logits) {
                worst = worst.max((a[*id as usize] as f64 - want).abs() / scale);
            }
            moved = a
                .iter()
                .zip(&b)
                .fold(moved, |m, (x, y)| m.max((x - y).abs() as f64 / scale));
            assert_eq!(
                argmax(&a),
                hf.top_ids[0],
                "prompt position {t}: top-1 differs"
            );
        }
    }
    eprintln!("f16 cache vs transformers: max |delta logit| / scale = {worst:.2e}, vs f32 cache {moved:.2e}");
    assert!(worst <= 2e-3, "{worst:.2e}");
    assert!(moved > 0.0, "the f16 cache changed nothing");
}

fn fixture(name: &str) -> Fixture {
    let path = format!("{}/../../tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture present")).unwrap()
}

/// The oracle on `cfg`'s synthetic model (seed 0), as GGUF and as safetensors, against the
/// fixture `name`; returns the fixture.
fn check_fixture(name: &str, cfg: Qwen3MoeConfig) -> Fixture {
    let fx = fixture(name);
    let p = SynthParams {
        seed: 0,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let hf_dir = dir.path().join("hf");
    synth::write_gguf(&cfg, &p, None, &gguf, true).unwrap();
    synth::write_safetensors(&cfg, &p, &hf_dir, true).unwrap();
    let models = [loader::open(&gguf).unwrap(), loader::open(&hf_dir).unwrap()];
    let mut worst = 0f64;
    for case in &fx.cases {
        let mut backends: Vec<RefBackend> = models
            .iter()
            .map(|m| RefBackend::with_cache(m.weights.clone(), 256, CacheType::F32).unwrap())
            .collect();
        let mut rows = vec![];
        for (t, &id) in case.prompt.iter().enumerate() {
            let a = backends[0].step(id).unwrap();
            let b = backends[1].step(id).unwrap();
            assert_eq!(
                a, b,
                "GGUF and safetensors logits differ at prompt position {t}"
            );
            worst = worst.max(compare(
                &a,
                &case.prompt_logits[t],
                &fx.probe_ids,
                &format!(
                    "prompt {:?} pos {t}",
                    &case.prompt[..3.min(case.prompt.len())]
                ),
            ));
            rows.push(a);
        }
        let mut next = argmax(rows.last().unwrap());
        for (i, want) in case.greedy.iter().enumerate() {
            assert_eq!(
                next, *want,
                "greedy token {i} differs from transformers ({})",
                fx.transformers
            );
            let a = backends[0].step(next).unwrap();
            worst = worst.max(compare(
                &a,
                &case.step_logits[i],
                &fx.probe_ids,
                &format!("greedy step {i}"),
            ));
            next = argmax(&a);
        }
        // The folded greedy path of the oracle gives the same continuation.
        let mut b = RefBackend::with_cache(models[0].weights.clone(), 256, CacheType::F32).unwrap();
        let last = b.prefill(&case.prompt).unwrap();
        let first = argmax(&last);
        let ids = b.decode_greedy(first, case.greedy.len() - 1, &[]).unwrap();
        assert_eq!(&ids[..], &case.greedy[1..]);
    }
    eprintln!(
        "oracle vs transformers {} ({name}): max |delta logit| / scale = {worst:.2e}",
        fx.transformers
    );
    fx
}
