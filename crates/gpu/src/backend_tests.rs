//! The GPU backend against the oracle (`nibble_backend::RefBackend`) on tiny synthetic models
//! (tiny config, 512-token vocabulary, synth's Q4_0 matrices and F32 norms/router).

use crate::backend::{GpuBackend, GpuOptions};
use crate::kernels::attention::Combine;
use crate::numerics::Numerics;
use crate::testing::{cosine, gpu};
use crate::tune::Tune;
use nibble_backend::{Backend, RefBackend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::synth::{gguf_dtype, tensor_bytes, SynthParams};
use nibble_model::weights::{LayerTensor, TensorKey, Weight, WeightSource};
use std::collections::HashMap;
use std::sync::Arc;

/// An in-memory source holding synth's GGUF tensors (Q4_0 matrices, F32 norms and router).
pub(crate) struct Mem {
    cfg: Qwen3MoeConfig,
    t: HashMap<TensorKey, Vec<u8>>,
}

impl WeightSource for Mem {
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn weight(&self, key: TensorKey) -> anyhow::Result<Weight<'_>> {
        let b = self
            .t
            .get(&key)
            .ok_or_else(|| anyhow::anyhow!("no {key:?}"))?;
        Ok(Weight {
            dtype: gguf_dtype(key),
            shape: key.shape(&self.cfg),
            parts: vec![b.as_slice()],
        })
    }
}

fn model(seed: u64, tie: bool) -> Arc<Mem> {
    model_with_vocab(seed, tie, 512)
}

/// synth's tiny model (`Qwen3MoeConfig::tiny`) with `vocab` tokens, in memory.
pub(crate) fn model_with_vocab(seed: u64, tie: bool, vocab: usize) -> Arc<Mem> {
    let cfg = Qwen3MoeConfig {
        vocab_size: vocab,
        tie_word_embeddings: tie,
        ..Qwen3MoeConfig::tiny()
    };
    let p = SynthParams {
        seed,
        ..Default::default()
    };
    let t = TensorKey::all(&cfg)
        .into_iter()
        .map(|k| (k, tensor_bytes(&cfg, &p, k)))
        .collect();
    Arc::new(Mem { cfg, t })
}

/// [`model_with_vocab`] with every layer's two RMSNorm weights times `scale`: the GEMM inputs
/// (normalised rows) then reach `scale` times their usual magnitude.
pub(crate) fn model_with_norm_scale(seed: u64, vocab: usize, scale: f32) -> Arc<Mem> {
    let mut m = Arc::try_unwrap(model_with_vocab(seed, false, vocab))
        .unwrap_or_else(|_| unreachable!("a fresh Arc"));
    for (k, b) in m.t.iter_mut() {
        if let TensorKey::Layer(_, LayerTensor::AttnNorm | LayerTensor::FfnNorm) = k {
            let v: Vec<f32> = bytemuck::pod_collect_to_vec::<u8, f32>(b);
            *b = bytemuck::cast_slice(&v.iter().map(|x| x * scale).collect::<Vec<f32>>()).to_vec();
        }
    }
    Arc::new(m)
}

fn opts(per_token: bool, fold: u32) -> GpuOptions {
    GpuOptions {
        context_len: 256,
        fold,
        per_token,
        ..Default::default()
    }
}

/// `o` with the qkv matvec and the attention always in dispatches of their own.
fn no_qkv_attention(o: GpuOptions) -> GpuOptions {
    GpuOptions {
        tune: Tune {
            qkv_attn: Some(0),
            ..o.tune
        },
        ..o
    }
}

#[test]
fn logits_match_oracle_per_step() {
    let Some(ctx) = gpu("logits_match_oracle_per_step") else {
        return;
    };
    for (seed, tie) in [(1, false), (2, true)] {
        let m = model(seed, tie);
        // Every numerics (f32 with the router folded into the o-proj), f32 with the router in
        // its own dispatch, and the f32 forms `--tune` selects: the qkv's norm applied before
        // its dots, the folded gate/up's likewise (the defaults scale both late), the lm_head
        // as the one-column matmul (the default converts to bfp24 once) and the norm-on-load matvec
        // in f32 and in bfp24.
        let forms = Numerics::ALL.map(|n| (n, true, ""));
        let extra = [
            (Numerics::F32, false, ""),
            (Numerics::F32, true, "late_norm=0"),
            (Numerics::F32, true, "moe_late_norm=0"),
            (Numerics::F32, true, "head=1"),
            (Numerics::F32, true, "head=2"),
            (Numerics::F32, true, "head=0"),
            (Numerics::F32, true, "head=3"),
        ];
        for (numerics, fold_router, tune) in forms.into_iter().chain(extra) {
            let o = GpuOptions {
                numerics,
                fold_router,
                tune: tune.parse().unwrap(),
                ..opts(true, 4)
            };
            let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
            let mut rb = RefBackend::new(m.clone(), 256).unwrap();
            let prompt = [3u32, 77, 500, 12, 12, 401];
            let mut worst = 1.0f64;
            for (i, t) in prompt.iter().enumerate() {
                let g = gb.step(*t).unwrap();
                let r = rb.step(*t).unwrap();
                let c = cosine(&g, &r);
                worst = worst.min(c);
                assert_eq!(gb.position(), i + 1);
            }
            eprintln!(
                "seed {seed} tie {tie} {numerics} fold_router {fold_router} tune [{tune}]: \
                 worst per-step logits cosine {worst}"
            );
            // Plain int8 is allowed its quantisation noise here (parity_tests.rs holds the
            // exactness bar for the default); a wiring bug gives cosines far below this bound.
            let bar = if numerics == Numerics::Int8 {
                0.98
            } else {
                0.99999
            };
            assert!(worst >= bar, "seed {seed} {numerics}: worst cosine {worst}");
        }
    }
}

/// Greedy ids after prefilling `prompt` (all but its last token) on any backend.
fn greedy(b: &mut dyn Backend, prompt: &[u32], n: usize, eos: &[u32]) -> Vec<u32> {
    b.prefill(&prompt[..prompt.len() - 1]).unwrap();
    let ids = b.decode_greedy(*prompt.last().unwrap(), n, eos).unwrap();
    assert_eq!(b.position(), prompt.len() - 1 + ids.len());
    ids
}

#[test]
fn greedy_folded_equals_per_token_and_oracle() {
    let Some(ctx) = gpu("greedy_folded_equals_per_token_and_oracle") else {
        return;
    };
    let m = model(3, false);
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[400, 17], &[9, 9, 9, 9, 250]];
    for p in prompts {
        let mut folded = GpuBackend::with_context(&ctx, m.as_ref(), opts(false, 16)).unwrap();
        let mut odd = GpuBackend::with_context(&ctx, m.as_ref(), opts(false, 5)).unwrap();
        let mut per_tok = GpuBackend::with_context(&ctx, m.as_ref(), opts(true, 16)).unwrap();
        let mut oracle = RefBackend::new(m.clone(), 256).unwrap();
        let f = greedy(&mut folded, p, 128, &[]);
        assert_eq!(f.len(), 128);
        assert_eq!(
            f,
            greedy(&mut odd, p, 128, &[]),
            "fold 16 vs fold 5, prompt {p:?}"
        );
        assert_eq!(
            f,
            greedy(&mut per_tok, p, 128, &[]),
            "folded vs per-token, prompt {p:?}"
        );
        let r = greedy(&mut oracle, p, 128, &[]);
        assert_eq!(f, r, "default numerics vs the oracle, prompt {p:?}");
    }
}

#[test]
fn router_fold_saves_a_dispatch_per_layer_and_keeps_the_tokens() {
    let Some(ctx) = gpu("router_fold_saves_a_dispatch_per_layer_and_keeps_the_tokens") else {
        return;
    };
    let m = model(6, false);
    // The qkv and the attention in dispatches of their own throughout (the qkv dispatch's own
    // attention has its test below).
    let base = no_qkv_attention(opts(false, 8));
    let mut folded = GpuBackend::with_context(&ctx, m.as_ref(), base.clone()).unwrap();
    // The router in its own dispatch, and the attention's combine in its own too.
    let own = GpuOptions {
        fold_router: false,
        attention_combine: Some(Combine::Dispatch),
        ..base
    };
    let mut own = GpuBackend::with_context(&ctx, m.as_ref(), own).unwrap();
    let layers = m.config().num_layers;
    assert_eq!(
        folded.dispatches_per_step() + layers,
        own.dispatches_per_step()
    );
    // Past the first attention chunk (16 positions) each layer adds the combine dispatch,
    // unless the combine is fused into the chunks, which at 16 chunks per kv head (this
    // 256-position context) it always is on Vulkan.
    assert_eq!(
        own.dispatches_per_step_max(),
        own.dispatches_per_step() + layers
    );
    let fused = folded.plan().attention_combine() == Combine::Fused;
    assert_eq!(
        folded.dispatches_per_step_max(),
        folded.dispatches_per_step() + if fused { 0 } else { layers }
    );
    assert!(folded.describe().contains(if fused {
        "attention combine fused"
    } else {
        "attention combine in its own"
    }));
    assert!(folded.describe().contains("router folded into the o-proj"));
    assert!(own.describe().contains("router in its own dispatch"));
    assert!(
        folded.resident_bytes() > own.resident_bytes(),
        "the fold is resident"
    );
    let p = [7u32, 300, 41, 41];
    let f = greedy(&mut folded, &p, 64, &[]);
    assert_eq!(f, greedy(&mut own, &p, 64, &[]));
    let mut oracle = RefBackend::new(m.clone(), 256).unwrap();
    assert_eq!(f, greedy(&mut oracle, &p, 64, &[]));
}

#[test]
fn qkv_attention_saves_a_dispatch_per_layer_below_its_bound_and_keeps_the_tokens() {
    let Some(ctx) = gpu("qkv_attention_saves_a_dispatch_per_layer_below_its_bound") else {
        return;
    };
    if !ctx.publishes_across_workgroups() {
        eprintln!("skipped: the device cannot publish across workgroups (not Vulkan)");
        return;
    }
    let m = model(7, false);
    let layers = m.config().num_layers;
    let o = GpuOptions {
        context_len: 320,
        ..opts(false, 8)
    };
    let with_bound = |n: u32| GpuOptions {
        tune: Tune {
            qkv_attn: Some(n),
            ..o.tune
        },
        ..o.clone()
    };
    let mut fused = GpuBackend::with_context(&ctx, m.as_ref(), with_bound(256)).unwrap();
    let mut sep = GpuBackend::with_context(&ctx, m.as_ref(), no_qkv_attention(o.clone())).unwrap();
    // A bound of 20 positions: runs of 8 from a 5-token prompt cross it, so a request takes
    // both forms (a run past the bound records the two dispatches for all its steps).
    let mut low = GpuBackend::with_context(&ctx, m.as_ref(), with_bound(20)).unwrap();
    assert_eq!(fused.plan().qkv_attention_positions(), Some(256));
    assert_eq!(low.plan().qkv_attention_positions(), Some(20));
    assert_eq!(sep.plan().qkv_attention_positions(), None);
    // One dispatch fewer per layer below the bound, the same past it.
    assert_eq!(
        fused.dispatches_per_step() + layers,
        sep.dispatches_per_step()
    );
    assert_eq!(
        fused.plan().dispatches_per_step_at(255) + layers,
        sep.plan().dispatches_per_step_at(255)
    );
    assert_eq!(
        fused.plan().dispatches_per_step_at(256),
        sep.plan().dispatches_per_step_at(256)
    );
    assert!(fused
        .describe()
        .contains("in the qkv dispatch below position 256"));
    let mut oracle = RefBackend::new(m.clone(), 320).unwrap();
    for p in [&[7u32, 300, 41, 41, 9][..], &[500, 17]] {
        for b in [
            &mut fused as &mut dyn Backend,
            &mut low,
            &mut sep,
            &mut oracle,
        ] {
            b.truncate(0).unwrap();
        }
        let want = greedy(&mut oracle, p, 60, &[]);
        assert_eq!(greedy(&mut fused, p, 60, &[]), want, "fused, prompt {p:?}");
        assert_eq!(greedy(&mut low, p, 60, &[]), want, "bound 20, prompt {p:?}");
        assert_eq!(greedy(&mut sep, p, 60, &[]), want, "separate, prompt {p:?}");
    }
    // Per-step logits on both sides of the bound, against the oracle's.
    fused.truncate(0).unwrap();
    oracle.truncate(0).unwrap();
    let prompt: Vec<u32> = (0..250).map(|i| 11 + (i * 37) % 400).collect();
    fused.prefill(&prompt).unwrap();
    oracle.prefill(&prompt).unwrap();
    for (i, t) in [5u32, 99, 300, 4, 480, 12].into_iter().enumerate() {
        let (g, r) = (fused.step(t).unwrap(), oracle.step(t).unwrap());
        let c = cosine(&g, &r);
        assert!(c > 0.99999, "step {i} at position {}: cosine {c}", 250 + i);
    }
}

#[test]
fn tune_overrides_reach_the_kernels_and_keep_the_oracle_tokens() {
    let Some(ctx) = gpu("tune_overrides_reach_the_kernels_and_keep_the_oracle_tokens") else {
        return;
    };
    let m = model(8, false);
    let cfg = m.config().clone();
    let p = [5u32, 90, 333];
    let mut oracle = RefBackend::new(m.clone(), 256).unwrap();
    let want = greedy(&mut oracle, &p, 48, &[]);
    let sets = [
        "qkv_rows=1,o_rows=4,down_split=1,head=4,gate_up_rows=2",
        // From position 24 on, the deep attention kernel (the streamed body).
        "qkv_rows=2,o_rows=1,gate_up_lanes=32,down_lanes=8,down_rows=2,down_split=2,head=2,\
         moe_late_norm=0,attn_deep=24",
        // Chunks of 16 from the start, 8-row tiles, the fused combine only for one chunk.
        "qkv_rows=4,o_rows=2,down_split=4,attn_workgroups=4,attn_tile_loads=1,attn_fused_max=1,\
         head=3",
        // The streamed attention body over few long chunks.
        "qkv_rows=2,o_rows=2,down_split=2,attn_form=2,attn_tile_loads=4,attn_v_rows=3,\
         attn_workgroups=2",
    ];
    for s in sets {
        let tune: crate::tune::Tune = s.parse().unwrap();
        let o = GpuOptions {
            tune,
            ..opts(false, 8)
        };
        let mut g = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
        let mv = g.plan().matvec_for_tests();
        let qkv = (cfg.q_dim() + 2 * cfg.kv_dim()) as u32;
        assert_eq!(mv.rows_per_team(qkv), tune.qkv_rows.unwrap(), "{s}");
        assert_eq!(
            mv.rows_per_team(cfg.hidden_size as u32),
            tune.o_rows.unwrap(),
            "{s}"
        );
        assert_eq!(
            g.plan().moe_down_splits(),
            tune.down_split.unwrap().to_string(),
            "{s}"
        );
        let head = [
            "one-column matmul",
            "matvec",
            "matvec (bfp24)",
            "bfp24 conversion + matvec",
            "bfp24 conversion + matvec (2 rows per team)",
        ];
        assert_eq!(
            g.plan().head_form(),
            head[tune.head.unwrap_or(crate::tune::DEFAULT_HEAD) as usize],
            "{s}"
        );
        let sh = g.plan().attention_shape();
        let form = match tune.attn_form {
            Some(2) => crate::kernels::attention::AttnForm::Stream,
            _ => crate::kernels::attention::AttnForm::Tiles,
        };
        assert_eq!(sh.form, form, "{s}");
        assert_eq!(Some(sh.tile_loads), tune.attn_tile_loads.or(Some(2)), "{s}");
        assert!(g.describe().contains(match form {
            crate::kernels::attention::AttnForm::Stream => "streamed body",
            crate::kernels::attention::AttnForm::Tiles => "tiled body",
        }));
        let deep = g.plan().attention_deep().map(|(from, sh)| (from, sh.form));
        let streamed = crate::kernels::attention::AttnForm::Stream;
        assert_eq!(deep, tune.attn_deep.map(|from| (from, streamed)), "{s}");
        assert_eq!(
            g.describe().contains("; from position 24: streamed body"),
            deep.is_some(),
            "{s}"
        );
        assert_eq!(greedy(&mut g, &p, 48, &[]), want, "{s}");
    }
    // A split the kernels do not have is an error at start-up, not a silent default.
    let bad = GpuOptions {
        tune: "o_rows=3".parse().unwrap(),
        ..opts(false, 8)
    };
    let e = GpuBackend::with_context(&ctx, m.as_ref(), bad)
        .err()
        .expect("o_rows=3 accepted");
    assert!(e.to_string().contains("rows per team"), "{e}");
    for (s, want) in [
        ("head=5", "tune head"),
        ("moe_late_norm=2", "tune moe_late_norm"),
        ("attn_form=3", "attn_form=3"),
        ("attn_form=2,attn_v_rows=0", "V rows per batch"),
    ] {
        let bad = GpuOptions {
            tune: s.parse().unwrap(),
            ..opts(false, 8)
        };
        let e = GpuBackend::with_context(&ctx, m.as_ref(), bad)
            .err()
            .unwrap_or_else(|| panic!("{s} accepted"));
        assert!(e.to_string().contains(want), "{s}: {e}");
    }
}

#[test]
fn logits_steps_recorded_ahead_match_fresh_ones_after_a_rewind() {
    let Some(ctx) = gpu("logits_steps_recorded_ahead_match_fresh_ones_after_a_rewind") else {
        return;
    };
    let m = model(6, false);
    let o = GpuOptions {
        context_len: 320,
        ..opts(true, 8)
    };
    let mut b = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
    let mut oracle = RefBackend::new(m.clone(), 320).unwrap();
    b.prefill(&[5, 6, 7]).unwrap();
    oracle.prefill(&[5, 6, 7]).unwrap();
    // Steps at 3, 4, 5 (each records the next position's step ahead), then back to 4: the step
    // recorded for 6 must not be used there, and the rewound position is rewritten.
    let mut first = Vec::new();
    for t in [8u32, 9, 10] {
        let (g, o) = (b.step(t).unwrap(), oracle.step(t).unwrap());
        assert!(cosine(&g, &o) > 0.99999, "token {t}");
        first.push(g);
    }
    b.truncate(4).unwrap();
    let again = b.step(9).unwrap();
    assert_eq!(again, first[1], "step at 4 after the rewind");
    let other = b.step(200).unwrap();
    oracle.truncate(5).unwrap();
    assert!(cosine(&other, &oracle.step(200).unwrap()) > 0.99999);
    // A prompt moves the position past the fused attention combine's reach (16 chunks of 16):
    // the step recorded ahead for position 7 (one chunk, no combine) must not serve 290.
    let more: Vec<u32> = (0..284).map(|i| 30 + i % 400).collect();
    b.prefill(&more).unwrap();
    oracle.prefill(&more).unwrap();
    assert!(cosine(&b.step(77).unwrap(), &oracle.step(77).unwrap()) > 0.99999);
}

#[test]
fn greedy_stops_at_eos_and_keeps_position() {
    let Some(ctx) = gpu("greedy_stops_at_eos_and_keeps_position") else {
        return;
    };
    let m = model(4, false);
    let mut probe = GpuBackend::with_context(&ctx, m.as_ref(), opts(false, 16)).unwrap();
    let ids = greedy(&mut probe, &[5, 6, 7], 40, &[]);
    // Use the 11th id as EOS: both paths must stop right after its first occurrence.
    let eos = ids[10];
    let first = ids.iter().position(|t| *t == eos).unwrap();
    for per_token in [false, true] {
        let mut b = GpuBackend::with_context(&ctx, m.as_ref(), opts(per_token, 4)).unwrap();
        let got = greedy(&mut b, &[5, 6, 7], 40, &[999_999, eos]);
        assert_eq!(got, ids[..=first].to_vec(), "per_token {per_token}");
        // The run continues correctly from where it stopped.
        let more = b.decode_greedy(*got.last().unwrap(), 3, &[]).unwrap();
        assert_eq!(more.len(), 3);
        assert_eq!(b.position(), 2 + got.len() + 3);
    }
}

/// L2 warming (`--tune warm=1..7`, kernels/warm.rs) only adds reads: every step's logits keep
/// their bits and the folded greedy run its tokens; `-v` says where it warms.
#[test]
fn warming_changes_no_bits() {
    let Some(ctx) = gpu("warming_changes_no_bits") else {
        return;
    };
    let m = model(9, false);
    let layers = m.config().num_layers;
    let with_warm = |w: u32| GpuOptions {
        tune: Tune {
            warm: Some(w),
            ..Tune::default()
        },
        ..opts(false, 4)
    };
    let default = GpuBackend::with_context(&ctx, m.as_ref(), opts(false, 4)).unwrap();
    assert_eq!(
        default.plan().warmed_layers(),
        (layers, layers - 1, 0),
        "qkv -> o-proj and down -> next qkv by default"
    );
    drop(default);
    let mut base = GpuBackend::with_context(&ctx, m.as_ref(), with_warm(0)).unwrap();
    assert_eq!(base.plan().warmed_layers(), (0, 0, 0));
    assert!(base.describe().contains("L2 warming off"));
    let prompt = [5u32, 90, 301, 301, 7];
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let want: Vec<_> = prompt
        .iter()
        .map(|t| bits(base.step(*t).unwrap()))
        .collect();
    base.truncate(0).unwrap();
    let want_greedy = greedy(&mut base, &prompt, 24, &[]);
    for (w, warmed) in [
        (1, (layers, 0, 0)),
        (2, (0, layers - 1, 0)),
        (4, (0, 0, layers)),
        (7, (layers, layers - 1, layers)),
    ] {
        let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), with_warm(w)).unwrap();
        assert_eq!(gb.plan().warmed_layers(), warmed, "warm={w}");
        assert_eq!(gb.dispatches_per_step(), base.dispatches_per_step());
        for (t, want) in prompt.iter().zip(&want) {
            assert_eq!(&bits(gb.step(*t).unwrap()), want, "warm={w}");
        }
        gb.truncate(0).unwrap();
        assert_eq!(greedy(&mut gb, &prompt, 24, &[]), want_greedy, "warm={w}");
    }
    let gb = GpuBackend::with_context(&ctx, m.as_ref(), with_warm(7)).unwrap();
    assert!(gb.describe().contains(&format!(
        "qkv -> o-proj in {layers} layers, down -> next qkv in {}, gate/up -> down in {layers}",
        layers - 1
    )));
    let e = GpuBackend::with_context(&ctx, m.as_ref(), with_warm(8))
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("warm must be 0..=7"), "{e:#}");
}

#[test]
fn bad_input_is_an_error_and_keeps_position() {
    let Some(ctx) = gpu("bad_input_is_an_error_and_keeps_position") else {
        return;
    };
    let m = model(5, false);
    let mut b = GpuBackend::with_context(
        &ctx,
        m.as_ref(),
        GpuOptions {
            context_len: 8,
            ..opts(false, 4)
        },
    )
    .unwrap();
    b.prefill(&[1, 2]).unwrap();
    assert!(b.step(512).is_err(), "token id == V");
    assert!(b.prefill(&[]).is_err());
    assert!(b.prefill(&[1; 7]).is_err(), "overflows the context of 8");
    assert!(
        b.decode_greedy(1, 7, &[]).is_err(),
        "overflows the context of 8"
    );
    assert!(b.truncate(3).is_err());
    assert_eq!(b.position(), 2);
    assert_eq!(b.decode_greedy(1, 0, &[]).unwrap(), Vec::<u32>::new());
    b.truncate(0).unwrap();
    assert_eq!(b.decode_greedy(1, 8, &[]).unwrap().len(), 8);
    assert_eq!(b.position(), 8);
}

#[test]
fn profile_names_every_op_of_the_step_and_appends_nothing() {
    let Some(ctx) = gpu("profile_names_every_op_of_the_step_and_appends_nothing") else {
        return;
    };
    if !ctx
        .features
        .contains(wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES)
    {
        eprintln!("skipped: no timestamps inside passes on this adapter");
        return;
    }
    let m = model(4, false);
    let l = m.cfg.num_layers;
    // The qkv dispatch attending itself below its bound (`--tune qkv_attn=256`, where
    // workgroups publish) and the default, two dispatches.
    let qa = GpuOptions {
        tune: Tune {
            qkv_attn: Some(256),
            ..Tune::default()
        },
        ..opts(false, 4)
    };
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), qa).unwrap();
    assert_eq!(
        gb.plan().qkv_attention_positions().is_some(),
        ctx.publishes_across_workgroups()
    );
    let mut sep = GpuBackend::with_context(&ctx, m.as_ref(), opts(false, 4)).unwrap();
    assert_eq!(sep.plan().qkv_attention_positions(), None, "off by default");
    // Position 0 (one attention chunk), then past the first chunk (chunks + combine, in one
    // dispatch where the combine is fused); the fused form names one op at both.
    let several = match gb.plan().attention_combine() {
        Combine::Fused => &["qkv matvec", "attention chunks+combine"][..],
        Combine::Dispatch => &["qkv matvec", "attention chunks", "attention combine"][..],
    };
    let one = &["qkv matvec", "attention (one chunk)"][..];
    let fused = &["qkv matvec + attention"][..];
    let qa = gb.plan().qkv_attention_positions().is_some();
    let cases = [
        (false, 0usize, one),
        (false, 40, several),
        (true, 0, if qa { fused } else { one }),
        (true, 40, if qa { fused } else { several }),
    ];
    for (default, prefill, attention) in cases {
        let gb = if default { &mut gb } else { &mut sep };
        gb.truncate(0).unwrap();
        if prefill > 0 {
            gb.prefill(&(0..prefill as u32).collect::<Vec<_>>())
                .unwrap();
        }
        let ops = gb
            .profile_step(2)
            .unwrap()
            .expect("timestamps are supported");
        assert_eq!(gb.position(), prefill, "profiling appends nothing");
        let names: Vec<&str> = ops.iter().map(|o| o.op.as_str()).collect();
        let mut want = vec!["embed"];
        want.extend(attention);
        want.extend([
            "o-proj + folded router",
            "moe gate/up",
            "moe down",
            "lm_head",
            "argmax",
        ]);
        want.push(crate::profile::MARK_OP);
        assert_eq!(names, want, "at position {prefill}");
        for o in &ops {
            let once = ["embed", "lm_head", "argmax", crate::profile::MARK_OP];
            let per_layer = !once.contains(&o.op.as_str());
            assert_eq!(o.calls, if per_layer { l } else { 1 }, "{}", o.op);
            assert!(o.us.is_finite() && o.us >= 0.0, "{}: {} us", o.op, o.us);
        }
        assert!(ops.iter().map(|o| o.us).sum::<f64>() > 0.0);
    }
    // The other plan forms name their extra ops: the router in its own dispatch (f32 without
    // the fold), and the unfused int8 form with its norms and final norm.
    for (numerics, fold_router, extra) in [
        (Numerics::F32, false, &["o-proj", "router matvec"][..]),
        (
            Numerics::Int8,
            true,
            &[
                "rmsnorm (attention input)",
                "rmsnorm (MoE input)",
                "router matvec",
                "final rmsnorm",
            ][..],
        ),
    ] {
        let o = GpuOptions {
            numerics,
            fold_router,
            ..opts(false, 4)
        };
        let mut b = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
        let ops = b
            .profile_step(1)
            .unwrap()
            .expect("timestamps are supported");
        let names: Vec<&str> = ops.iter().map(|o| o.op.as_str()).collect();
        for want in extra {
            assert!(
                names.contains(want),
                "{numerics} fold {fold_router}: {names:?}"
            );
        }
        assert!(!names.contains(&"o-proj + folded router"), "{names:?}");
    }
    // A full context is an error, not a step past it.
    let mut small = GpuBackend::with_context(
        &ctx,
        m.as_ref(),
        GpuOptions {
            context_len: 4,
            ..opts(false, 4)
        },
    )
    .unwrap();
    small.prefill(&[1, 2, 3, 4]).unwrap();
    assert!(small.profile_step(1).is_err());
}
