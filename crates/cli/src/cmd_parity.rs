//! `nibble parity`: run the oracle and a fast backend side by side and report agreement.
//!
//! Per prompt: whether the fast backend's greedy sequence (its folded path) equals the oracle's,
//! the first divergence with the oracle's top-1/top-2 margin there, and the min/mean cosine and
//! max |delta| of per-step logits, the fast backend being teacher-forced along the oracle's
//! sequence so every step compares the same context. Exit status is non-zero on failure.

use crate::backends::{self, BackendArgs, BackendKind};
use anyhow::{bail, Result};
use nibble_backend::reference::RefBackend;
use nibble_backend::{argmax, Backend};
use serde::Serialize;
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
    #[arg(long)]
    json: bool,
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
    Ok(PromptReport {
        prompt: String::new(),
        prompt_tokens: prompt.len(),
        identical: div.is_none() && fast_seq.len() == seq.len(),
        first_divergence: div,
        oracle_margin_at_divergence: div.map(|i| margin(&o_rows[i])),
        min_cosine: cos.iter().copied().fold(1.0, f64::min),
        mean_cosine: cos.iter().sum::<f64>() / cos.len() as f64,
        max_abs_delta,
    })
}

pub fn run(a: Args) -> Result<()> {
    if a.backend.backend == BackendKind::Ref {
        bail!("parity compares a fast backend with the oracle: choose --backend gpu or auto");
    }
    if a.tokens == 0 {
        bail!("-n must be at least 1");
    }
    let model = nibble_model::loader::open(&a.model)?;
    let tok = crate::tokenizer::from_model(&model)?;
    let texts: Vec<String> = match &a.prompts {
        Some(p) => std::fs::read_to_string(p)?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.replace("\\n", "\n"))
            .collect(),
        None => BUILTIN.iter().map(|s| s.to_string()).collect(),
    };
    let ctx = a
        .backend
        .ctx
        .unwrap_or(4096)
        .min(model.weights.config().max_position_embeddings);
    let mut oracle = RefBackend::new(model.weights.clone(), ctx)?;
    let mut fast = backends::make(&a.backend, model.weights.clone())?;
    let mut reports = vec![];
    for (i, text) in texts.iter().enumerate() {
        let ids = match &tok {
            Some(t) => t.encode(text)?,
            // Without a tokenizer, a deterministic id sequence per prompt.
            None => (0..8 + 4 * i as u32)
                .map(|j| (j * 131 + i as u32 * 17) % 1000)
                .collect(),
        };
        let mut r = compare(&mut oracle, fast.as_mut(), &ids, a.tokens)?;
        r.prompt = text.chars().take(40).collect();
        reports.push(r);
    }
    let pass = reports
        .iter()
        .all(|r| r.identical && r.min_cosine >= a.min_cosine);
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"backend": fast.name(), "pass": pass, "prompts": reports})
            )?
        );
    } else {
        println!(
            "backend {} vs oracle, {} tokens per prompt",
            fast.name(),
            a.tokens
        );
        println!(
            "{:<42} {:>6} {:>9} {:>10} {:>12} {:>12} {:>10}",
            "prompt", "tokens", "identical", "diverge@", "min cos", "mean cos", "max|d|"
        );
        for r in &reports {
            let div = match (r.first_divergence, r.oracle_margin_at_divergence) {
                (Some(i), Some(m)) => format!("{i} (m {m:.3})"),
                _ => "-".into(),
            };
            println!(
                "{:<42} {:>6} {:>9} {:>10} {:>12.7} {:>12.7} {:>10.2e}",
                format!("{:?}", r.prompt),
                r.prompt_tokens,
                r.identical,
                div,
                r.min_cosine,
                r.mean_cosine,
                r.max_abs_delta
            );
        }
        println!("parity {}", if pass { "PASS" } else { "FAIL" });
    }
    if !pass {
        bail!("parity failed");
    }
    Ok(())
}
