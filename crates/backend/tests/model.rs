//! Whole-model behaviour of the reference backend on a tiny random Qwen3-MoE.

mod common;

use common::{random_model, random_tokens, tiny_cfg, MemSource};
use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::weights::{LayerTensor, TensorKey};
use std::sync::Arc;

fn backend(src: MemSource, ctx: usize) -> RefBackend {
    RefBackend::new(Arc::new(src), ctx).unwrap()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn logits_are_finite_and_spread() {
    let cfg = tiny_cfg();
    let mut b = backend(random_model(&cfg, 1), 64);
    let l = b.prefill(&random_tokens(7, 5, cfg.vocab_size)).unwrap();
    assert_eq!(l.len(), 512);
    assert!(l.iter().all(|x| x.is_finite()));
    let mean = l.iter().sum::<f32>() / l.len() as f32;
    let var = l.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / l.len() as f32;
    assert!(var > 0.1 && var < 1e4, "logit variance {var}");
    assert_eq!(b.name(), "ref");
    assert_eq!(b.position(), 5);
    assert_eq!(b.context_len(), 64);
    assert_eq!(b.config(), &cfg);
}

#[test]
fn prefill_matches_step_by_step() {
    let cfg = tiny_cfg();
    let toks = random_tokens(11, 12, cfg.vocab_size);
    let mut a = backend(random_model(&cfg, 2), 32);
    let mut b = backend(random_model(&cfg, 2), 32);
    let batched = a.prefill(&toks).unwrap();
    let mut stepped = Vec::new();
    for t in &toks {
        stepped = b.step(*t).unwrap();
    }
    assert_eq!(a.position(), 12);
    assert_eq!(b.position(), 12);
    let d = max_rel_diff(&batched, &stepped);
    assert!(d <= 1e-5, "prefill vs step differ by {d}");
    // Mixed: a prefill split in two also agrees.
    let mut c = backend(random_model(&cfg, 2), 32);
    c.prefill(&toks[..5]).unwrap();
    let split = c.prefill(&toks[5..]).unwrap();
    assert!(max_rel_diff(&batched, &split) <= 1e-5);
}

/// The trait's default `prefill_rows` (the oracle's): each row is that step's logits, bit for
/// bit; a sink's error appends nothing; bad ids are refused before any row.
#[test]
fn prompt_rows_are_the_steps_logits() {
    let cfg = tiny_cfg();
    let toks = random_tokens(12, 9, cfg.vocab_size);
    let mut a = backend(random_model(&cfg, 3), 32);
    let mut b = backend(random_model(&cfg, 3), 32);
    a.prefill(&toks[..2]).unwrap();
    b.prefill(&toks[..2]).unwrap();
    let mut rows = Vec::new();
    a.prefill_rows(&toks[2..], 0, &mut |i, l| {
        assert_eq!(i, rows.len());
        rows.push(bits(l));
        Ok(())
    })
    .unwrap();
    let stepped: Vec<Vec<u32>> = toks[2..]
        .iter()
        .map(|t| bits(&b.step(*t).unwrap()))
        .collect();
    assert_eq!(rows, stepped);
    assert_eq!(a.position(), 9);
    // From index 4 on: the later rows alone, the same logits.
    a.truncate(2).unwrap();
    let mut later = Vec::new();
    a.prefill_rows(&toks[2..], 4, &mut |i, l| {
        later.push((i, bits(l)));
        Ok(())
    })
    .unwrap();
    let want: Vec<(usize, Vec<u32>)> = stepped.iter().cloned().enumerate().skip(4).collect();
    assert_eq!(later, want);
    let e = a
        .prefill_rows(&toks, 0, &mut |i, _| {
            anyhow::ensure!(i < 2, "sink says stop");
            Ok(())
        })
        .unwrap_err();
    assert!(e.to_string().contains("sink says stop"), "{e}");
    assert_eq!(a.position(), 9, "a failed call appends nothing");
    let bad = [1, cfg.vocab_size as u32];
    let e = a
        .prefill_rows(&bad, 0, &mut |_, _| panic!("no row"))
        .unwrap_err();
    assert!(e.to_string().contains("vocabulary"), "{e}");
    assert_eq!(a.position(), 9);
}

#[test]
fn thread_count_does_not_change_a_bit() {
    let cfg = tiny_cfg();
    let toks = random_tokens(12, 6, cfg.vocab_size);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut b = backend(random_model(&cfg, 3), 32);
            let mut out = bits(&b.prefill(&toks).unwrap());
            out.extend(bits(&b.step(17).unwrap()));
            out.extend(bits(&b.step(400).unwrap()));
            out
        })
    };
    let one = run(1);
    assert_eq!(one, run(4));
    assert_eq!(one, run(3));
}

#[test]
fn truncate_then_refeed_is_identical() {
    let cfg = tiny_cfg();
    let toks = random_tokens(13, 10, cfg.vocab_size);
    let mut b = backend(random_model(&cfg, 4), 16);
    let full = b.prefill(&toks).unwrap();
    b.truncate(6).unwrap();
    assert_eq!(b.position(), 6);
    assert_eq!(bits(&b.prefill(&toks[6..]).unwrap()), bits(&full));
    // Overwrite slots 6.. with other tokens, then go back: the stale slots must not leak.
    b.truncate(6).unwrap();
    let other = b.prefill(&[1, 2, 3, 4, 5]).unwrap();
    assert_ne!(bits(&other), bits(&full));
    b.truncate(6).unwrap();
    assert_eq!(bits(&b.prefill(&toks[6..]).unwrap()), bits(&full));
    b.truncate(0).unwrap();
    assert_eq!(bits(&b.prefill(&toks).unwrap()), bits(&full));
    let e = b.truncate(11).unwrap_err().to_string();
    assert!(e.contains("only 10 positions"), "{e}");
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let cfg = tiny_cfg();
    let mut b = backend(random_model(&cfg, 5), 10);
    b.prefill(&[1, 2, 3]).unwrap();
    let e = b.prefill(&[4, 512]).unwrap_err().to_string();
    assert!(
        e.contains("token id 512") && e.contains("512 tokens"),
        "{e}"
    );
    let e = b.step(u32::MAX).unwrap_err().to_string();
    assert!(e.contains("token id 4294967295"), "{e}");
    let e = b.prefill(&[]).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    b.prefill(&[4, 5, 6, 7, 8]).unwrap();
    let e = b.prefill(&[1, 2, 3]).unwrap_err().to_string();
    assert_eq!(
        e,
        "prompt of 3 tokens at position 8 exceeds the context of 10"
    );
    assert_eq!(b.position(), 8);
    b.prefill(&[1, 2]).unwrap();
    assert!(b.step(1).is_err(), "the context is full");
    assert_eq!(b.position(), 10);
}

#[test]
fn construction_checks_context_and_every_tensor() {
    let cfg = tiny_cfg();
    let err = |src: MemSource, ctx: usize| match RefBackend::new(Arc::new(src), ctx) {
        Ok(_) => panic!("constructed a backend from bad input"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err(random_model(&cfg, 6), 0).contains("at least 1"));
    assert!(err(random_model(&cfg, 6), 4097).contains("exceeds the model's context (4096)"));

    let mut src = random_model(&cfg, 6);
    let key = TensorKey::Layer(2, LayerTensor::AttnK);
    src.tensors.get_mut(&key).unwrap().shape = vec![64, 32];
    let e = err(src, 8);
    assert!(
        e.contains("Layer(2, AttnK)") && e.contains("[64, 32]"),
        "{e}"
    );

    let mut src = random_model(&cfg, 6);
    src.tensors.get_mut(&TensorKey::OutputNorm).unwrap().parts[0].pop();
    let e = err(src, 8);
    assert!(e.contains("OutputNorm") && e.contains("255 bytes"), "{e}");

    let mut src = random_model(&cfg, 6);
    src.tensors.remove(&TensorKey::Output);
    assert!(err(src, 8).contains("no tensor Output"));

    // Parts that split a row would make Weight::row straddle parts.
    let mut src = random_model(&cfg, 6);
    let key = TensorKey::Layer(0, LayerTensor::ExpUp);
    let t = src.tensors.get_mut(&key).unwrap();
    let first = t.parts.remove(0);
    let (a, b) = first.split_at(first.len() / 2 + 18);
    t.parts.insert(0, b.to_vec());
    t.parts.insert(0, a.to_vec());
    let e = err(src, 8);
    assert!(e.contains("ExpUp") && e.contains("whole number"), "{e}");

    // A NaN block scale surfaces as an error from the forward pass, not NaN logits.
    let mut src = random_model(&cfg, 6);
    let key = TensorKey::Layer(1, LayerTensor::AttnQ);
    src.tensors.get_mut(&key).unwrap().parts[0][0..2].copy_from_slice(&[0x00, 0x7e]);
    let mut b = backend(src, 8);
    let e = format!("{:#}", b.prefill(&[3, 4]).unwrap_err());
    assert!(e.contains("attn q") && e.contains("non-finite"), "{e}");
    assert_eq!(b.position(), 0);
}

#[test]
fn decode_greedy_equals_step_and_argmax() {
    let cfg = tiny_cfg();
    let mut a = backend(random_model(&cfg, 7), 64);
    let mut b = backend(random_model(&cfg, 7), 64);
    let prompt = random_tokens(14, 4, cfg.vocab_size);
    let la = a.prefill(&prompt[..3]).unwrap();
    b.prefill(&prompt[..3]).unwrap();
    assert_eq!(argmax(&la), {
        let mut c = backend(random_model(&cfg, 7), 64);
        argmax(&c.prefill(&prompt[..3]).unwrap())
    });
    let got = a.decode_greedy(prompt[3], 8, &[]).unwrap();
    let mut want = Vec::new();
    let mut cur = prompt[3];
    for _ in 0..8 {
        cur = argmax(&b.step(cur).unwrap());
        want.push(cur);
    }
    assert_eq!(got, want);
    assert_eq!(a.position(), 3 + 8);

    // Stop on eos: the first occurrence of the chosen id ends the run, and is included.
    let eos = want[4];
    let stop = want.iter().position(|t| *t == eos).unwrap();
    let mut c = backend(random_model(&cfg, 7), 64);
    c.prefill(&prompt[..3]).unwrap();
    let got = c.decode_greedy(prompt[3], 8, &[999, eos]).unwrap();
    assert_eq!(got, want[..=stop]);
    assert_eq!(c.position(), 3 + stop + 1);
    assert!(c.decode_greedy(5, 0, &[]).unwrap().is_empty());
    assert_eq!(c.position(), 3 + stop + 1);
}

#[test]
fn tied_embeddings_use_the_embedding_as_lm_head() {
    let mut cfg = tiny_cfg();
    cfg.tie_word_embeddings = true;
    let tied = random_model(&cfg, 8);
    // The same weights, untied, with lm_head = a copy of the embedding.
    let mut untied = random_model(&cfg, 8);
    untied.cfg.tie_word_embeddings = false;
    let embd = untied.values(TensorKey::TokenEmbd);
    untied.set(TensorKey::Output, nibble_quant::DType::F32, &embd, 1);
    let toks = [5, 77, 300];
    let a = backend(tied, 8).prefill(&toks).unwrap();
    let b = backend(untied, 8).prefill(&toks).unwrap();
    assert_eq!(bits(&a), bits(&b));
    // And the untied model with a different lm_head gives different logits.
    let mut other = random_model(&cfg, 8);
    other.cfg.tie_word_embeddings = false;
    let out = random_model(&tiny_cfg(), 9).values(TensorKey::Output);
    other.set(TensorKey::Output, nibble_quant::DType::F32, &out, 1);
    assert!(max_rel_diff(&a, &backend(other, 8).prefill(&toks).unwrap()) > 0.1);
}
