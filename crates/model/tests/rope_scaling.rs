//! RoPE scaling in the config: YaRN and linear read from a Hugging Face `config.json` (both
//! transformers spellings) and from GGUF `rope.scaling.*` metadata, written back by synth, the
//! rotation table they give, and what is refused by name.

use nibble_formats::gguf::{GgufWriter, MetaValue};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::loader;
use nibble_model::qwen3_moe::gguf_metadata;
use nibble_model::rope::{rope_table, yarn_default_attention_factor, RopeScaling};
use nibble_model::synth::{self, SynthParams};
use nibble_model::weights::Reconfigured;
use serde_json::json;
use std::sync::Arc;

/// Qwen's model card: YaRN x4 over the trained 32768 positions.
fn qwen_yarn() -> RopeScaling {
    RopeScaling::Yarn {
        factor: 4.0,
        original_context: 32768,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: yarn_default_attention_factor(4.0),
        truncate: true,
    }
}

fn small_cfg(scaling: Option<RopeScaling>) -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: 256,
        num_layers: 2,
        rope_scaling: scaling,
        ..Qwen3MoeConfig::tiny()
    }
}

#[test]
fn yarn_table_at_qwen3s_shape() {
    let t = rope_table(1e6, Some(qwen_yarn()), 128);
    let plain = |i: usize| 1e6f64.powf(-2.0 * i as f64 / 128.0);
    assert_eq!(t.inv_freq.len(), 64);
    // The ramp's ends: dimensions turning more than 32 times over 32768 positions keep their
    // frequency (i <= floor(23.6) = 23), fewer than once are interpolated (i >= ceil(39.6) = 40).
    for i in 0..64 {
        let (f, got) = (plain(i), t.inv_freq[i] as f64);
        let ramp = ((i as f64 - 23.0) / 17.0).clamp(0.0, 1.0);
        let want = f * (1.0 - ramp) + f / 4.0 * ramp;
        assert!((got - want).abs() <= 1e-7 * want, "i {i}: {got} vs {want}");
        if i <= 23 {
            assert_eq!(t.inv_freq[i], f as f32, "i {i} keeps its frequency");
        }
        if i >= 40 {
            assert_eq!(t.inv_freq[i], (f / 4.0) as f32, "i {i} is interpolated");
        }
    }
    // 0.1 ln 4 + 1, and the scores carry its square.
    assert!((t.attention_factor as f64 - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-7);
    let af = t.attention_factor;
    assert!((t.score_scale() - af * af / 128f32.sqrt()).abs() < 1e-7);
    // Without truncation the ends stay fractional (23.6, 39.6): dimension 24 is mixed less,
    // 39 more.
    let loose = match qwen_yarn() {
        RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        } => RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate: false,
        },
        s => s,
    };
    let u = rope_table(1e6, Some(loose), 128);
    assert!(u.inv_freq[24] > t.inv_freq[24] && u.inv_freq[39] < t.inv_freq[39]);

    // Linear divides every frequency; none is the plain rotation with 1 / sqrt(D) exactly.
    let l = rope_table(1e6, Some(RopeScaling::Linear { factor: 2.0 }), 128);
    let p = rope_table(1e6, None, 128);
    for i in 0..64 {
        assert_eq!(l.inv_freq[i], (plain(i) / 2.0) as f32);
        assert_eq!(p.inv_freq[i], plain(i) as f32);
    }
    assert_eq!((l.attention_factor, p.attention_factor), (1.0, 1.0));
    assert_eq!(p.score_scale(), 1.0 / 128f32.sqrt());

    // The context it reaches; never below the config's own.
    assert_eq!(qwen_yarn().context_limit(40960), 131072);
    assert_eq!(
        RopeScaling::Linear { factor: 2.0 }.context_limit(4096),
        8192
    );
    let mut c = Qwen3MoeConfig::qwen3_30b_a3b();
    assert_eq!(c.max_context(), 40960);
    c.rope_scaling = Some(qwen_yarn());
    assert_eq!(c.max_context(), 131072);
}

/// `config.json`'s `rope_scaling` with `scaling` (tiny config otherwise).
fn hf(scaling: serde_json::Value) -> Result<Qwen3MoeConfig, String> {
    let mut j = Qwen3MoeConfig::tiny().to_hf_json();
    j["rope_scaling"] = scaling;
    Qwen3MoeConfig::from_hf_json(&j.to_string()).map_err(|e| e.to_string())
}

#[test]
fn hf_configs_in_every_spelling() {
    let card =
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    assert_eq!(hf(card.clone()).unwrap().rope_scaling, Some(qwen_yarn()));
    // Older configs say "type"; a 0 or null beta is the default (transformers' `or 32`).
    let old = json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                     "beta_fast": 0, "beta_slow": null});
    assert_eq!(hf(old).unwrap().rope_scaling, Some(qwen_yarn()));
    // transformers 5 folds it into rope_parameters beside rope_theta.
    let mut j = Qwen3MoeConfig::qwen3_30b_a3b().to_hf_json();
    let o = j.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    let mut params = card.clone();
    params["rope_theta"] = json!(1e6);
    o.insert("rope_parameters".into(), params);
    let c = Qwen3MoeConfig::from_hf_json(&j.to_string()).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (1e6, Some(qwen_yarn())));
    // An integral float is an integer, as transformers reads it.
    let c = hf(
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768.0}),
    )
    .unwrap();
    assert_eq!(c.rope_scaling, Some(qwen_yarn()));
    // Without original_max_position_embeddings: max_position_embeddings (4096 here).
    let c = hf(json!({"rope_type": "yarn", "factor": 2.0})).unwrap();
    assert!(matches!(
        c.rope_scaling,
        Some(RopeScaling::Yarn {
            original_context: 4096,
            factor: 2.0,
            ..
        })
    ));
    // mscale / mscale_all_dim (DeepSeek's form) and an explicit attention_factor.
    let c = hf(json!({"rope_type": "yarn", "factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0}))
        .unwrap();
    let want = ((0.2 * 4f64.ln() + 1.0) / (0.1 * 4f64.ln() + 1.0)) as f32;
    assert!(
        matches!(c.rope_scaling, Some(RopeScaling::Yarn { attention_factor, .. })
        if (attention_factor - want).abs() < 1e-6)
    );
    let c = hf(json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5})).unwrap();
    assert!(matches!(
        c.rope_scaling,
        Some(RopeScaling::Yarn {
            attention_factor: 1.5,
            ..
        })
    ));
    // Linear; "default" and null are the plain rotation.
    assert_eq!(
        hf(json!({"rope_type": "linear", "factor": 2.0}))
            .unwrap()
            .rope_scaling,
        Some(RopeScaling::Linear { factor: 2.0 })
    );
    assert_eq!(
        hf(json!({"rope_type": "default"})).unwrap().rope_scaling,
        None
    );
    assert_eq!(hf(json!(null)).unwrap().rope_scaling, None);
    // What synth writes reads back the same, non-default fields included.
    for s in [
        qwen_yarn(),
        RopeScaling::Linear { factor: 8.0 },
        RopeScaling::Yarn {
            factor: 2.0,
            original_context: 1024,
            beta_fast: 16.0,
            beta_slow: 2.0,
            attention_factor: 1.25,
            truncate: false,
        },
    ] {
        let c = Qwen3MoeConfig {
            rope_scaling: Some(s),
            ..Qwen3MoeConfig::tiny()
        };
        let back = Qwen3MoeConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }
}

#[test]
fn unsupported_or_bad_scalings_are_named() {
    for (v, says) in [
        (
            json!({"rope_type": "dynamic", "factor": 2.0}),
            "`dynamic` is not supported",
        ),
        (
            json!({"rope_type": "longrope", "short_factor": [1.0]}),
            "`longrope` is not supported",
        ),
        (
            json!({"rope_type": "llama3", "factor": 8.0}),
            "`llama3` is not supported",
        ),
        (json!({"rope_type": "yarn"}), "needs a factor"),
        (json!({"rope_type": "yarn", "factor": 0.5}), "factor 0.5"),
        (
            json!({"rope_type": "linear", "factor": "4"}),
            "factor: expected a number",
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}),
            "original context 0",
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1.5}),
            "expected an integer",
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1.0}),
            "beta_fast",
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}),
            "attention factor",
        ),
        // Its square scales the scores: 1e20 overflowed f32 into NaN logits on the CPU.
        (
            json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e20}),
            "attention factor",
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "mscale": 1e30, "mscale_all_dim": 1.0}),
            "attention factor",
        ),
        (json!({"factor": 4.0}), "no rope_type"),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "truncate": 1}),
            "truncate",
        ),
        (json!({"rope_type": 3}), "expected a string"),
        (json!([4.0]), "expected an object"),
    ] {
        let e = hf(v.clone()).unwrap_err();
        assert!(e.contains("rope_scaling") && e.contains(says), "{v}: {e}");
    }
}

/// A config with both spellings: they must agree (a transformers 5 config whose
/// `rope_parameters` says "default" and Qwen's card's `rope_scaling` added beside it is refused,
/// not read one way or the other).
#[test]
fn rope_scaling_beside_rope_parameters_must_agree() {
    let card =
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    let both = |params: serde_json::Value| {
        let mut j = Qwen3MoeConfig::qwen3_30b_a3b().to_hf_json();
        j["rope_scaling"] = card.clone();
        j["rope_parameters"] = params;
        Qwen3MoeConfig::from_hf_json(&j.to_string()).map_err(|e| e.to_string())
    };
    let mut same = card.clone();
    same["rope_theta"] = json!(1e6);
    assert_eq!(both(same).unwrap().rope_scaling, Some(qwen_yarn()));
    for other in [
        json!({"rope_type": "default", "rope_theta": 1e6}),
        json!({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}),
    ] {
        let e = both(other.clone()).unwrap_err();
        assert!(
            e.contains("rope_scaling") && e.contains("disagrees with rope_parameters"),
            "{other}: {e}"
        );
    }
    // A null rope_scaling beside rope_parameters: the latter holds.
    let mut j = Qwen3MoeConfig::qwen3_30b_a3b().to_hf_json();
    j["rope_scaling"] = serde_json::Value::Null;
    j["rope_parameters"] = card.clone();
    let c = Qwen3MoeConfig::from_hf_json(&j.to_string()).unwrap();
    assert_eq!(c.rope_scaling, Some(qwen_yarn()));
}

#[test]
fn rope_parameters_theta_of_the_wrong_type_is_named() {
    let mut j = Qwen3MoeConfig::tiny().to_hf_json();
    let o = j.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": "abc"}),
    );
    let e = Qwen3MoeConfig::from_hf_json(&j.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rope_parameters") && e.contains("rope_theta"),
        "{e}"
    );
}

#[test]
fn gguf_and_safetensors_files_carry_the_scaling() {
    let dir = tempfile::tempdir().unwrap();
    let p = SynthParams::default();
    for s in [qwen_yarn(), RopeScaling::Linear { factor: 2.0 }] {
        let cfg = small_cfg(Some(s));
        let g = dir.path().join("m.gguf");
        synth::write_gguf(&cfg, &p, None, &g, true).unwrap();
        let m = loader::open(&g).unwrap();
        assert_eq!(m.weights.config().rope_scaling, Some(s));
        let h = dir.path().join(format!("hf-{}", s.factor()));
        synth::write_safetensors(&cfg, &p, &h, true).unwrap();
        assert_eq!(
            loader::open(&h).unwrap().weights.config().rope_scaling,
            Some(s)
        );
        // An override replaces it for every reader of the weights; shapes may not change.
        let m = m.with_rope_scaling(None).unwrap();
        assert_eq!(m.weights.config().rope_scaling, None);
        let wider = Qwen3MoeConfig {
            num_layers: 3,
            ..cfg.clone()
        };
        assert!(Reconfigured::new(m.weights.clone(), wider).is_err());
        let bad = Qwen3MoeConfig {
            rope_scaling: Some(RopeScaling::Linear { factor: 0.0 }),
            ..cfg
        };
        assert!(Reconfigured::new(Arc::clone(&m.weights), bad).is_err());
    }
}

/// The config read from a tensorless GGUF of [`small_cfg`]'s metadata plus `extra`.
fn gguf_config(extra: &[(&str, MetaValue)]) -> Result<Qwen3MoeConfig, String> {
    let mut meta = gguf_metadata(&small_cfg(None), "t");
    for (k, v) in extra {
        meta.push((k.to_string(), v.clone()));
    }
    meta.push(("qwen3moe.vocab_size".into(), MetaValue::U32(256)));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let w = GgufWriter::new(std::fs::File::create(&path).unwrap(), meta, vec![]).unwrap();
    w.finish().unwrap();
    let f = nibble_formats::gguf::GgufFile::open(&path).unwrap();
    nibble_model::qwen3_moe::config_from_gguf(&f).map_err(|e| e.to_string())
}

fn gguf_scaling(extra: &[(&str, MetaValue)]) -> Option<RopeScaling> {
    gguf_config(extra).unwrap().rope_scaling
}

fn gguf_err(extra: &[(&str, MetaValue)]) -> String {
    gguf_config(extra).expect_err("accepted")
}

#[test]
fn gguf_factor_without_a_type_is_linear_as_llama_cpp_reads_it() {
    let f = |x: f32| ("qwen3moe.rope.scaling.factor", MetaValue::F32(x));
    assert_eq!(
        gguf_scaling(&[f(4.0)]),
        Some(RopeScaling::Linear { factor: 4.0 })
    );
    assert_eq!(gguf_scaling(&[f(1.0)]), None);
    assert_eq!(gguf_scaling(&[f(0.0)]), None);
    assert_eq!(
        gguf_scaling(&[("qwen3moe.rope.scale_linear", MetaValue::F32(2.0))]),
        Some(RopeScaling::Linear { factor: 2.0 })
    );
}

#[test]
fn bad_gguf_scaling_keys_are_named() {
    let s = |v: &str| MetaValue::String(v.into());
    for (extra, says) in [
        (
            vec![("qwen3moe.rope.scaling.type", s("longrope"))],
            "`longrope` is not supported",
        ),
        (
            vec![("qwen3moe.rope.scaling.type", s("yarn"))],
            "missing for a scaled rope",
        ),
        (
            vec![
                ("qwen3moe.rope.scaling.type", s("yarn")),
                ("qwen3moe.rope.scaling.factor", MetaValue::F32(0.25)),
            ],
            "factor 0.25",
        ),
        (
            vec![(
                "qwen3moe.rope.scaling.yarn_log_multiplier",
                MetaValue::F32(0.1),
            )],
            "yarn_log_multiplier",
        ),
        (
            vec![("qwen3moe.rope.scaling.type", MetaValue::U32(2))],
            "expected a string",
        ),
    ] {
        let e = gguf_err(&extra);
        assert!(
            e.contains("rope.scaling") && e.contains(says),
            "{extra:?}: {e}"
        );
    }
}
