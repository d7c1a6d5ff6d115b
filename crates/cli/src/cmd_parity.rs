//! `nibble parity`: run the oracle and a fast backend side by side and report agreement.
//!
//! Per prompt: whether the fast backend's greedy sequence (its folded path) equals the oracle's,
//! the first divergence with the oracle's top-1/top-2 margin there, and the min/mean cosine and
//! max |delta| of per-step logits, the fast backend being teacher-forced along the oracle's
//! sequence so every step compares the same context. Exit status is non-zero on failure.
//!
//! Localisation: at the first step that fails (logits cosine below the bar, or where the greedy
//! sequences part), both backends re-run that step with [`Backend::trace_step`] and the report
//! names the first intermediate (oracle order, e.g. `l2.attn_out`) whose relative L2 error
//! exceeds `--trace-tol`. `--plant-error LAYER:TENSOR` (hidden) corrupts one GPU weight first,
//! to check that this localisation works.

use crate::backends::{self, BackendArgs, BackendKind};
use anyhow::{bail, Context, Result};
use nibble_backend::divergence::first_divergence;
use nibble_backend::reference::RefBackend;
use nibble_backend::{argmax, Backend};
use nibble_engine::sampler::{Sampler, SamplingParams};
use nibble_engine::tokenizer::Tokenizer;
use nibble_gpu::plant::PlantTarget;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model: a .gguf file or a Hugging Face directory.
    #[arg(short, long)]
    model: PathBuf,
    /// One prompt per line (default: built-in short and long prompts).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Greedy tokens per prompt.
    #[arg(short = 'n', long, default_value_t = 32)]
    tokens: usize,
    /// Minimum per-step cosine to pass.
    #[arg(long, default_value_t = 0.99999)]
    min_cosine: f64,
    /// Relative L2 error beyond which a traced intermediate counts as divergent.
    #[arg(long, default_value_t = 1e-3)]
    trace_tol: f64,
    #[arg(long)]
    json: bool,
    /// Also compare sampled decoding (llama.cpp's settings: temperature 0.8, top-k 40, top-p
    /// 0.95, min-p 0.05, seeded with this): the oracle with the host's sampler on each step
    /// against the fast backend's own way (folded runs sampled on the device where it can):
    /// the ids must be identical.
    #[arg(long)]
    sampled: Option<u64>,
    /// Testing the localiser: corrupt one tensor of the GPU copy first, `LAYER:TENSOR` with
    /// TENSOR one of qkv, o, router, gate, up, down (e.g. `2:o`).
    #[arg(long, hide = true)]
    plant_error: Option<String>,
    /// Diagnostics: also prefill each prompt on the fast backend's batched path one layer at a
    /// time and name the first layer and token where it departs from the oracle's
    /// token-by-token run, with the oracle's router gap there (on stderr).
    #[arg(long)]
    trace_prefill: bool,
    #[command(flatten)]
    backend: BackendArgs,
}

const BUILTIN: [&str; 3] = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint. Once upon a time, in a small town by the sea,",
    "<|im_start|>user\nExplain quicksort in one paragraph.<|im_end|>\n<|im_start|>assistant\n",
];

#[derive(Serialize, Debug)]
pub struct PromptReport {
    pub prompt: String,
    pub prompt_tokens: usize,
    pub identical: bool,
    pub first_divergence: Option<usize>,
    /// Oracle's top-1 minus top-2 logit at the divergence.
    pub oracle_margin_at_divergence: Option<f32>,
    pub min_cosine: f64,
    pub mean_cosine: f64,
    pub max_abs_delta: f32,
    /// The oracle's greedy ids and the fast backend's own (folded) greedy ids.
    pub oracle_tokens: Vec<u32>,
    pub fast_tokens: Vec<u32>,
    /// The generated-token index of the first failing step, re-run with tracing.
    pub traced_step: Option<usize>,
    /// The first traced intermediate beyond `--trace-tol` there (None: none was, or the fast
    /// backend cannot trace).
    pub first_divergence_op: Option<OpReport>,
}

/// One prompt of `--sampled`: the oracle's host-sampled ids against the fast backend's.
#[derive(Serialize, Debug)]
pub struct SampledReport {
    pub prompt: String,
    pub seed: u64,
    /// The fast backend sampled on the device (folded runs).
    pub on_device: bool,
    pub identical: bool,
    pub first_divergence: Option<usize>,
    pub oracle_tokens: Vec<u32>,
    pub fast_tokens: Vec<u32>,
}

#[derive(Serialize, Debug)]
pub struct OpReport {
    pub name: String,
    pub rel_err: f64,
}

/// Thresholds of a comparison.
#[derive(Debug, Clone, Copy)]
pub struct Bars {
    pub min_cosine: f64,
    pub trace_tol: f64,
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa.sqrt() * bb.sqrt()).max(1e-300)
}

fn margin(row: &[f32]) -> f32 {
    let top = argmax(row) as usize;
    let second = row
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != top)
        .map(|(_, v)| *v)
        .fold(f32::NEG_INFINITY, f32::max);
    row[top] - second
}

/// Compare `fast` with `oracle` on one prompt.
pub fn compare(
    oracle: &mut dyn Backend,
    fast: &mut dyn Backend,
    prompt: &[u32],
    n: usize,
    bars: Bars,
) -> Result<PromptReport> {
    oracle.truncate(0)?;
    fast.truncate(0)?;
    let mut o_rows = vec![oracle.prefill(prompt)?];
    let mut f_rows = vec![fast.prefill(prompt)?];
    let mut seq = vec![argmax(&o_rows[0])];
    while seq.len() < n {
        let t = *seq.last().expect("non-empty");
        o_rows.push(oracle.step(t)?);
        f_rows.push(fast.step(t)?);
        seq.push(argmax(o_rows.last().expect("non-empty")));
    }
    let cos: Vec<f64> = o_rows
        .iter()
        .zip(&f_rows)
        .map(|(a, b)| cosine(a, b))
        .collect();
    let max_abs_delta = o_rows
        .iter()
        .zip(&f_rows)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max);
    // The fast backend's own greedy path (folded on the GPU), not teacher-forced.
    fast.truncate(0)?;
    let first = argmax(&fast.prefill(prompt)?);
    let mut fast_seq = vec![first];
    fast_seq.extend(fast.decode_greedy(first, n - 1, &[])?);
    let div = seq.iter().zip(&fast_seq).position(|(a, b)| a != b);
    // The first failing step: low cosine (NaN counts) or the greedy parting.
    let low = cos.iter().position(|c| c.is_nan() || *c < bars.min_cosine);
    let traced_step = match (low, div) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let first_divergence_op = match traced_step {
        Some(s) => localise(oracle, fast, prompt, &seq, s, bars.trace_tol)?,
        None => None,
    };
    Ok(PromptReport {
        prompt: String::new(),
        prompt_tokens: prompt.len(),
        identical: div.is_none() && fast_seq.len() == seq.len(),
        first_divergence: div,
        oracle_margin_at_divergence: div.map(|i| margin(&o_rows[i])),
        min_cosine: min_cosine(&cos),
        mean_cosine: cos.iter().sum::<f64>() / cos.len() as f64,
        max_abs_delta,
        oracle_tokens: seq,
        fast_tokens: fast_seq,
        traced_step,
        first_divergence_op,
    })
}

/// Re-run generated step `s` (its input is the token at position `prompt.len() - 1 + s` of
/// prompt + `seq`) on both backends with tracing and name the first intermediate beyond `tol`.
/// Both are re-fed the teacher-forced context first (the fast one's cache may hold its own
/// greedy path).
fn localise(
    oracle: &mut dyn Backend,
    fast: &mut dyn Backend,
    prompt: &[u32],
    seq: &[u32],
    s: usize,
    tol: f64,
) -> Result<Option<OpReport>> {
    let full: Vec<u32> = prompt.iter().chain(seq).copied().collect();
    let p = prompt.len() - 1 + s;
    let mut traces = vec![];
    let backends: [&mut dyn Backend; 2] = [oracle, fast];
    for b in backends {
        b.truncate(0)?;
        if p > 0 {
            b.prefill(&full[..p])?;
        }
        match b.trace_step(full[p])? {
            Some(t) => traces.push(t),
            None => return Ok(None),
        }
    }
    Ok(
        first_divergence(&traces[0], &traces[1], tol).map(|d| OpReport {
            name: d.name,
            rel_err: d.rel_err,
        }),
    )
}

/// Parse `LAYER:TENSOR` of `--plant-error`.
fn parse_plant(spec: &str) -> Result<(usize, PlantTarget)> {
    let Some((l, t)) = spec.split_once(':') else {
        bail!("--plant-error wants LAYER:TENSOR (e.g. 2:o), got '{spec}'");
    };
    let layer = l
        .parse()
        .map_err(|_| anyhow::anyhow!("--plant-error: '{l}' is not a layer number"))?;
    let target = t
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--plant-error: {e}"))?;
    Ok((layer, target))
}

/// The ids of prompt `i` for a context of `ctx`: its tokens, or without a tokenizer a
/// deterministic id sequence.
fn prompt_ids(tok: Option<&Tokenizer>, text: &str, i: usize, ctx: usize) -> Result<Vec<u32>> {
    Ok(match tok {
        Some(t) => t.encode_within(text, ctx)?,
        None => (0..8 + 4 * i as u32)
            .map(|j| (j * 131 + i as u32 * 17) % 1000)
            .collect(),
    })
}

/// `n + 1` sampled ids after `prompt` (the first from the prompt's logits): folded runs
/// sampled on the device where `b` samples `params` there, else a step per token with the
/// host's sampler; both draw from the same seeded sampler in the same order.
fn sampled_ids(
    b: &mut dyn Backend,
    prompt: &[u32],
    n: usize,
    params: &SamplingParams,
) -> Result<Vec<u32>> {
    b.truncate(0)?;
    let mut s = Sampler::new(params.clone())?;
    let mut hist = prompt.to_vec();
    let mut tok = s.sample(&b.prefill(prompt)?, &hist)?;
    let mut ids = vec![tok];
    if b.samples_on_device(&s.device_sampling(&[], &[])) {
        hist.push(tok);
        let draws = s.draw_uniforms(n);
        let spec = s.device_sampling(&hist, &draws);
        b.decode_sampled_stream(tok, n, 16, &[], &spec, &mut |r| {
            ids.extend_from_slice(r);
            true
        })?;
    } else {
        for _ in 0..n {
            hist.push(tok);
            tok = s.sample(&b.step(tok)?, &hist)?;
            ids.push(tok);
        }
    }
    Ok(ids)
}

/// The lowest of the steps' cosines, NaN if any is (`f64::min` skips NaN, which would let a
/// step with NaN logits pass the bar); 1 for no steps.
fn min_cosine(cos: &[f64]) -> f64 {
    cos.iter().fold(1.0, |m: f64, &c| {
        if m.is_nan() || c.is_nan() {
            f64::NAN
        } else {
            m.min(c)
        }
    })
}

pub fn run(a: Args) -> Result<()> {
    a.backend.check_flags()?;
    if a.backend.backend == BackendKind::Ref {
        bail!("parity compares a fast backend with the oracle: choose --backend gpu, cpu or auto");
    }
    if a.tokens == 0 {
        bail!("-n must be at least 1");
    }
    if !(a.trace_tol.is_finite() && a.trace_tol >= 0.0) {
        bail!("--trace-tol must be a non-negative number");
    }
    if !(-1.0..=1.0).contains(&a.min_cosine) {
        bail!("--min-cosine must be a number from -1 to 1");
    }
    let model = crate::backends::open_model(&a.model, &a.backend)?;
    let tok = crate::tokenizer::from_model(&model)?;
    let texts: Vec<String> = match &a.prompts {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("--prompts {}: cannot read", p.display()))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.replace("\\n", "\n"))
            .collect(),
        None => BUILTIN.iter().map(|s| s.to_string()).collect(),
    };
    if texts.is_empty() {
        bail!("--prompts: the file has no prompt (every line is blank)");
    }
    let ctx = a
        .backend
        .ctx
        .unwrap_or(4096)
        .min(model.weights.config().max_context());
    let prompts = (texts.iter().enumerate())
        .map(|(i, text)| prompt_ids(tok.as_ref(), text, i, ctx))
        .collect::<Result<Vec<_>>>()?;
    // Each prompt and its -n tokens must fit before any decoding starts, not fail at the end.
    for (i, ids) in prompts.iter().enumerate() {
        let len = ids.len();
        if len + a.tokens - 1 > ctx {
            bail!(
                "prompt {} ({len} tokens) and -n {} need {} positions; the context is {ctx} ({})",
                i + 1,
                a.tokens,
                len + a.tokens - 1,
                if ctx < model.weights.config().max_context() {
                    "raise --ctx or lower -n"
                } else {
                    "the model's own limit: lower -n"
                }
            );
        }
    }
    // The oracle holds the same KV cache type as the fast backend (f16 rounds in both).
    let mut oracle = RefBackend::with_cache(model.weights.clone(), ctx, a.backend.cache_type)?;
    let mut fast = match &a.plant_error {
        None => backends::make(&a.backend, model.weights.clone())?,
        Some(spec) => {
            let (layer, target) = parse_plant(spec)?;
            if a.backend.backend != BackendKind::Gpu {
                bail!("--plant-error corrupts a GPU weight: use --backend gpu");
            }
            let mut g = backends::make_gpu(&a.backend, model.weights.as_ref(), ctx)?;
            g.plant_error(layer, target)?;
            note!("planted an error in {target} of layer {layer} (GPU copy only)");
            Box::new(g)
        }
    };
    let bars = Bars {
        min_cosine: a.min_cosine,
        trace_tol: a.trace_tol,
    };

    let mut reports = vec![];
    for (text, ids) in texts.iter().zip(&prompts) {
        let mut r = compare(&mut oracle, fast.as_mut(), ids, a.tokens, bars)?;
        r.prompt = text.chars().take(40).collect();
        reports.push(r);
    }
    if a.trace_prefill {
        let k = model.weights.config().num_experts_per_tok;
        for (text, ids) in texts.iter().zip(&prompts) {
            note!("{:?}:", text.chars().take(40).collect::<String>());
            for line in
                crate::prefill_trace::describe(&mut oracle, fast.as_mut(), ids, k, a.trace_tol)?
            {
                note!("  {line}");
            }
        }
    }
    let mut sampled = vec![];
    if let Some(seed) = a.sampled {
        let params = SamplingParams::llama_cpp_defaults(seed);
        let on_device =
            fast.samples_on_device(&Sampler::new(params.clone())?.device_sampling(&[], &[]));
        for (text, ids) in texts.iter().zip(&prompts) {
            let oracle_tokens = sampled_ids(&mut oracle, ids, a.tokens, &params)?;
            let fast_tokens = sampled_ids(fast.as_mut(), ids, a.tokens, &params)?;
            sampled.push(SampledReport {
                prompt: text.chars().take(40).collect(),
                seed,
                on_device,
                identical: oracle_tokens == fast_tokens,
                first_divergence: oracle_tokens
                    .iter()
                    .zip(&fast_tokens)
                    .position(|(x, y)| x != y),
                oracle_tokens,
                fast_tokens,
            });
        }
    }
    let sampled_pass = sampled.iter().all(|r| r.identical);
    let pass = sampled_pass
        && reports
            .iter()
            .all(|r| r.identical && r.min_cosine >= a.min_cosine);
    // A failed write (a full disk, a closed stdout) is an error, not a panic.
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"backend": fast.name(), "kv_cache": a.backend.cache_type.to_string(), "pass": pass, "prompts": reports, "sampled": sampled})
            )?
        )?;
    } else {
        writeln!(
            out,
            "backend {} vs oracle, {} tokens per prompt, {} KV caches",
            fast.name(),
            a.tokens,
            a.backend.cache_type
        )?;
        writeln!(
            out,
            "{:<42} {:>6} {:>9} {:>10} {:>12} {:>12} {:>10}  first op > {:.0e}",
            "prompt",
            "tokens",
            "identical",
            "diverge@",
            "min cos",
            "mean cos",
            "max|d|",
            a.trace_tol
        )?;
        for r in &reports {
            let div = match (r.first_divergence, r.oracle_margin_at_divergence) {
                (Some(i), Some(m)) => format!("{i} (m {m:.3})"),
                _ => "-".into(),
            };
            let op = match (&r.first_divergence_op, r.traced_step) {
                (Some(o), Some(s)) => format!("{} (rel {:.2e}, step {s})", o.name, o.rel_err),
                (None, Some(s)) => format!("none (step {s} traced)"),
                _ => "-".into(),
            };
            writeln!(
                out,
                "{:<42} {:>6} {:>9} {:>10} {:>12.7} {:>12.7} {:>10.2e}  {op}",
                format!("{:?}", r.prompt),
                r.prompt_tokens,
                r.identical,
                div,
                r.min_cosine,
                r.mean_cosine,
                r.max_abs_delta
            )?;
        }
        for r in &sampled {
            writeln!(
                out,
                "sampled (seed {}, {}) {:<42} identical {}{}",
                r.seed,
                if r.on_device {
                    "folded, sampled on the device"
                } else {
                    "host sampler per step"
                },
                format!("{:?}", r.prompt),
                r.identical,
                r.first_divergence
                    .map_or(String::new(), |p| format!(" (diverge@{p})"))
            )?;
        }
        // A cosine under the bar by less than the table's 7 decimals show: say by how much.
        // (A NaN cosine fails the bar too.)
        let missed = |r: &&PromptReport| r.min_cosine.is_nan() || r.min_cosine < a.min_cosine;
        for r in reports.iter().filter(missed) {
            writeln!(
                out,
                "{:?}: min cos {} (1 - {:.2e}) is below --min-cosine {}",
                r.prompt,
                r.min_cosine,
                1.0 - r.min_cosine,
                a.min_cosine
            )?;
        }
        writeln!(out, "parity {}", if pass { "PASS" } else { "FAIL" })?;
    }
    if !pass && !a.trace_prefill {
        // A departure already at the first traced step may have been written into the K/V
        // cache by the prefill, which that step only reads: the op it names is then a symptom
        // (run 161: a routing tie of 1.65e-5 inside the prefill showed as `l12.attn`).
        let departs =
            |r: &&PromptReport| r.traced_step == Some(0) && r.first_divergence_op.is_some();
        for r in reports.iter().filter(departs) {
            note!(
                "hint: {:?} departs at its first step, whose logits read the K/V rows its \
                 prefill wrote; --trace-prefill (--prefill-gemm-min 2 for a short prompt) names \
                 the prefill's first departing layer and token and the oracle's nearest routing tie",
                r.prompt
            );
        }
    }
    if !pass {
        bail!("parity failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_nan_step_makes_the_minimum_cosine_nan() {
        assert_eq!(super::min_cosine(&[0.5, 0.25, 0.75]), 0.25);
        assert!(super::min_cosine(&[0.9, f64::NAN, 0.8]).is_nan());
        assert!(super::min_cosine(&[f64::NAN, 0.8]).is_nan());
        assert_eq!(super::min_cosine(&[]), 1.0);
    }
}
