//! The trace hook names every intermediate, and each one is what an independent, naive
//! recomputation from the previous ones and the weights gives: this checks the wiring of the
//! forward pass (QK-norm before RoPE, raw v, GQA mapping, residuals, routing, final norm).

mod common;

use common::{random_model, tiny_cfg, MemSource};
use nibble_backend::reference::TRACE_NAMES;
use nibble_backend::{Backend, RefBackend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::{LayerTensor, TensorKey};
use std::sync::{Arc, Mutex};

type Log = Arc<Mutex<Vec<(usize, String, Vec<f32>)>>>;

struct Traced {
    log: Log,
}

impl Traced {
    fn get(&self, pos: usize, name: &str) -> Vec<f32> {
        let log = self.log.lock().unwrap();
        let hits: Vec<_> = log
            .iter()
            .filter(|(p, n, _)| *p == pos && n == name)
            .collect();
        assert_eq!(hits.len(), 1, "{name} at {pos}");
        hits[0].2.clone()
    }
}

/// Run `tokens` through a traced backend; return the final logits and the trace.
fn run(src: MemSource, tokens: &[u32]) -> (Vec<f32>, Traced) {
    let log: Log = Arc::default();
    let mut b = RefBackend::new(Arc::new(src), 16).unwrap();
    let sink = Arc::clone(&log);
    b.set_trace(Some(Box::new(move |p, n, v| {
        sink.lock().unwrap().push((p, n.to_string(), v.to_vec()))
    })));
    let logits = b.prefill(tokens).unwrap();
    (logits, Traced { log })
}

fn mv(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks(x.len())
        .map(|r| {
            r.iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

fn rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let r = (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(a, b)| (*a as f64 / r * *b as f64) as f32)
        .collect()
}

fn rope(x: &[f32], d: usize, theta: f32, pos: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    for (h, o) in x.chunks(d).zip(out.chunks_mut(d)) {
        for i in 0..d / 2 {
            let f = (theta as f64).powf(-2.0 * i as f64 / d as f64);
            let (s, c) = (pos as f64 * f).sin_cos();
            o[i] = (h[i] as f64 * c - h[i + d / 2] as f64 * s) as f32;
            o[i + d / 2] = (h[i + d / 2] as f64 * c + h[i] as f64 * s) as f32;
        }
    }
    out
}

/// Attention of query head j over positions 0..n with kv head `g`.
fn attend(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], j: usize, g: usize, d: usize) -> Vec<f32> {
    let qj = &q[j * d..(j + 1) * d];
    let s: Vec<f64> = ks
        .iter()
        .map(|k| {
            let kg = &k[g * d..(g + 1) * d];
            qj.iter()
                .zip(kg)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                / (d as f64).sqrt()
        })
        .collect();
    let z: f64 = s.iter().map(|x| x.exp()).sum();
    (0..d)
        .map(|i| {
            s.iter()
                .zip(vs)
                .map(|(x, v)| x.exp() / z * v[g * d + i] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

fn silu(z: f32) -> f64 {
    z as f64 / (1.0 + (-z as f64).exp())
}

/// Check layer `l` at position `pos` (1) from the trace and the weights.
fn check_layer(src: &MemSource, t: &Traced, cfg: &Qwen3MoeConfig, l: usize, input: &[f32]) {
    let w = |x: LayerTensor| src.values(TensorKey::Layer(l, x));
    let (d, eps, pos) = (cfg.head_dim, cfg.rms_norm_eps, 1);
    let name = |n: &str| format!("l{l}.{n}");
    let get = |n: &str| t.get(pos, &name(n));

    assert_close(
        &get("attn_norm"),
        &rms(input, &w(LayerTensor::AttnNorm), eps),
        "attn_norm",
    );
    let a = get("attn_norm");
    assert_close(&get("q"), &mv(&w(LayerTensor::AttnQ), &a), "q");
    assert_close(&get("k"), &mv(&w(LayerTensor::AttnK), &a), "k");
    assert_close(&get("v"), &mv(&w(LayerTensor::AttnV), &a), "v");
    for (raw, normed, key) in [
        ("q", "q_normed", LayerTensor::QNorm),
        ("k", "k_normed", LayerTensor::KNorm),
    ] {
        let nw = w(key);
        let want: Vec<f32> = get(raw).chunks(d).flat_map(|h| rms(h, &nw, eps)).collect();
        assert_close(&get(normed), &want, normed);
    }
    assert_close(
        &get("q_rope"),
        &rope(&get("q_normed"), d, cfg.rope_theta, pos),
        "q_rope",
    );
    assert_close(
        &get("k_rope"),
        &rope(&get("k_normed"), d, cfg.rope_theta, pos),
        "k_rope",
    );

    // GQA: query head j reads kv head j / (Hq/Hkv), over positions 0 and 1.
    let ks = [t.get(0, &name("k_rope")), get("k_rope")];
    let vs = [t.get(0, &name("v")), get("v")];
    let (q, attn) = (get("q_rope"), get("attn"));
    let group = cfg.num_heads / cfg.num_kv_heads;
    for j in 0..cfg.num_heads {
        let want = attend(&q, &ks, &vs, j, j / group, d);
        assert_close(&attn[j * d..(j + 1) * d], &want, &format!("attn head {j}"));
        if j % cfg.num_kv_heads != j / group {
            let wrong = attend(&q, &ks, &vs, j, j % cfg.num_kv_heads, d);
            let diff: f32 = attn[j * d..]
                .iter()
                .zip(&wrong)
                .map(|(a, b)| (a - b).abs())
                .sum();
            assert!(diff > 1e-2, "head {j} cannot tell the kv heads apart");
        }
    }
    assert_close(
        &get("attn_out"),
        &mv(&w(LayerTensor::AttnOut), &attn),
        "attn_out",
    );
    let h_attn: Vec<f32> = input
        .iter()
        .zip(get("attn_out"))
        .map(|(a, b)| a + b)
        .collect();
    assert_close(&get("h_attn"), &h_attn, "h_attn");

    let b = rms(&h_attn, &w(LayerTensor::FfnNorm), eps);
    assert_close(&get("ffn_norm"), &b, "ffn_norm");
    let logits = mv(&w(LayerTensor::Router), &b);
    assert_close(&get("router_logits"), &logits, "router_logits");
    let z: f64 = logits.iter().map(|x| (*x as f64).exp()).sum();
    let probs: Vec<f32> = logits
        .iter()
        .map(|x| ((*x as f64).exp() / z) as f32)
        .collect();
    assert_close(&get("router_probs"), &probs, "router_probs");
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|x, y| probs[*y].partial_cmp(&probs[*x]).unwrap());
    order.truncate(cfg.num_experts_per_tok);
    let ids: Vec<f32> = order.iter().map(|e| *e as f32).collect();
    assert_eq!(get("moe_experts"), ids);
    let sel: f64 = order.iter().map(|e| probs[*e] as f64).sum();
    let weights: Vec<f32> = order
        .iter()
        .map(|e| {
            if cfg.norm_topk_prob {
                (probs[*e] as f64 / sel) as f32
            } else {
                probs[*e]
            }
        })
        .collect();
    assert_close(&get("moe_weights"), &weights, "moe_weights");

    let (hd, inner) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let (gate, up, down) = (
        w(LayerTensor::ExpGate),
        w(LayerTensor::ExpUp),
        w(LayerTensor::ExpDown),
    );
    let mut moe = vec![0f64; hd];
    for (e, wk) in order.iter().zip(&weights) {
        let g = mv(&gate[e * inner * hd..(e + 1) * inner * hd], &b);
        let u = mv(&up[e * inner * hd..(e + 1) * inner * hd], &b);
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| (silu(*g) * *u as f64) as f32)
            .collect();
        let y = mv(&down[e * hd * inner..(e + 1) * hd * inner], &act);
        for (m, yi) in moe.iter_mut().zip(&y) {
            *m += *wk as f64 * *yi as f64;
        }
    }
    let moe: Vec<f32> = moe.iter().map(|x| *x as f32).collect();
    assert_close(&get("moe_out"), &moe, "moe_out");
    let h: Vec<f32> = h_attn.iter().zip(&moe).map(|(a, b)| a + b).collect();
    assert_close(&get("h"), &h, "h");
}

fn check_model(cfg: &Qwen3MoeConfig, seed: u64) {
    let tokens = [17u32, 301];
    let (logits, t) = run(random_model(cfg, seed), &tokens);
    let src = random_model(cfg, seed);
    let embd = src.values(TensorKey::TokenEmbd);
    let h = cfg.hidden_size;
    let row = &embd[301 * h..302 * h];
    assert_eq!(t.get(1, "embd"), row);
    check_layer(&src, &t, cfg, 0, row);
    for l in 1..cfg.num_layers {
        check_layer(&src, &t, cfg, l, &t.get(1, &format!("l{}.h", l - 1)));
    }
    let last = t.get(1, &format!("l{}.h", cfg.num_layers - 1));
    let fin = rms(&last, &src.values(TensorKey::OutputNorm), cfg.rms_norm_eps);
    assert_close(&t.get(1, "final_norm"), &fin, "final_norm");
    assert_close(&logits, &mv(&src.values(TensorKey::Output), &fin), "logits");
    assert_eq!(t.get(1, "logits"), logits);

    // Names arrive in TRACE_NAMES order; the lm_head runs only for the last prompt token.
    let log = t.log.lock().unwrap();
    let at1: Vec<&str> = log
        .iter()
        .filter(|e| e.0 == 1)
        .map(|e| e.1.as_str())
        .collect();
    let mut want = vec!["embd".to_string()];
    for l in 0..cfg.num_layers {
        want.extend(
            TRACE_NAMES[1..TRACE_NAMES.len() - 2]
                .iter()
                .map(|n| format!("l{l}.{n}")),
        );
    }
    want.extend(["final_norm".to_string(), "logits".to_string()]);
    assert_eq!(at1, want);
    assert!(!log.iter().any(|e| e.0 == 0 && e.1 == "logits"));
}

#[test]
fn every_intermediate_matches_a_naive_recomputation() {
    check_model(&tiny_cfg(), 21);
}

#[test]
fn without_norm_topk_prob_the_raw_probabilities_mix_the_experts() {
    let cfg = Qwen3MoeConfig {
        norm_topk_prob: false,
        ..tiny_cfg()
    };
    check_model(&cfg, 22);
    let (_, t) = run(random_model(&cfg, 22), &[3, 4]);
    let sum: f32 = t.get(1, "l0.moe_weights").iter().sum();
    assert!(sum < 0.999, "raw top-k probabilities sum to {sum}");
}

#[test]
fn gqa_with_more_kv_heads() {
    // Hq = 8, Hkv = 4: G = 2, so query heads 2,3 read kv head 1 (not 2,3 as j % Hkv would).
    let cfg = Qwen3MoeConfig {
        num_heads: 8,
        num_kv_heads: 4,
        num_layers: 2,
        ..tiny_cfg()
    };
    check_model(&cfg, 23);
}

/// `trace_step` appends like `step` (same logits, same continuation), returns every name of
/// [`TRACE_NAMES`] once per layer in the hook's order with the hook's values, and leaves an
/// installed hook in place (suspended for the call).
#[test]
fn trace_step_returns_the_hooks_intermediates_and_appends_like_step() {
    let cfg = tiny_cfg();
    let tokens = [5u32, 9, 2];
    let mut plain = RefBackend::new(Arc::new(random_model(&cfg, 23)), 16).unwrap();
    let mut traced = RefBackend::new(Arc::new(random_model(&cfg, 23)), 16).unwrap();
    let log: Log = Arc::default();
    let sink = Arc::clone(&log);
    traced.set_trace(Some(Box::new(move |p, n, v| {
        sink.lock().unwrap().push((p, n.to_string(), v.to_vec()))
    })));
    plain.prefill(&tokens[..2]).unwrap();
    traced.prefill(&tokens[..2]).unwrap();
    let hook_len = log.lock().unwrap().len();
    assert!(hook_len > 0);
    let want = plain.step(tokens[2]).unwrap();
    let got = traced
        .trace_step(tokens[2])
        .unwrap()
        .expect("the oracle traces");
    assert_eq!(traced.position(), 3);
    assert_eq!(log.lock().unwrap().len(), hook_len, "the hook is suspended");
    // Names: embd, then TRACE_NAMES' per-layer ones per layer, then final_norm and logits.
    let per_layer = &TRACE_NAMES[1..TRACE_NAMES.len() - 2];
    let mut names = vec!["embd".to_string()];
    for l in 0..cfg.num_layers {
        names.extend(per_layer.iter().map(|n| format!("l{l}.{n}")));
    }
    names.extend(["final_norm".to_string(), "logits".to_string()]);
    let got_names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(got_names, names);
    assert_eq!(got.last().unwrap().1, want, "traced logits == step logits");
    // The hook is back: the next step is seen, and both backends continue identically.
    let next = plain.step(7).unwrap();
    assert_eq!(traced.step(7).unwrap(), next);
    let log = log.lock().unwrap();
    assert!(log.len() > hook_len);
    assert!(log[hook_len..].iter().all(|(p, _, _)| *p == 3));
}
