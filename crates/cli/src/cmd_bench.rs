//! `nibble bench`: prompt processing (pp) and generation (tg) speed, llama-bench style.
//!
//! Each measurement is repeated `--reps` times and reported as median and min-max. Warm-up is
//! reported apart: the first generation run after loading (pipeline compilation, page faults,
//! clocks ramping up) is timed and printed separately and never enters the statistics.

use crate::backends::{self, BackendArgs};
use anyhow::{Context, Result};
use clap::builder::RangedU64ValueParser;
use nibble_backend::{argmax, Backend};
use nibble_engine::sampler::{Sampler, SamplingParams};
use nibble_server::scheduler::{IN_FLIGHT, RUN};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Model: a .gguf file or a Hugging Face directory.
    #[arg(short, long)]
    model: PathBuf,
    /// Prompt tokens for the pp test (0 = skip).
    #[arg(short = 'p', long, default_value_t = 512)]
    prompt: usize,
    /// Generated tokens per tg repetition (at least 1: the warm-up and every tg test decode).
    #[arg(short = 'n', long, default_value_t = 128, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    gen: usize,
    /// Repetitions per test.
    #[arg(long, default_value_t = 5, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    reps: usize,
    /// Context depths (tokens already in the KV cache) at which to measure generation and
    /// prompt processing.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    depth: Vec<usize>,
    /// Batch sizes for generation: B independent sequences decoded together by the multi-stream
    /// path (aggregate and per-stream tok/s). 1 alone (the default) measures only the
    /// single-sequence path.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Also measure the per-token (unfolded) GPU path in the same run.
    #[arg(long)]
    compare_per_token: bool,
    /// Also measure sampled generation (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
    /// seeded) the way `nibble generate` samples (`tgN sampled`: folded runs sampled on the
    /// device where the backend can, else a step per token with the host's sampler), with the
    /// host's sampler per step for comparison (`tgN sampled, host sampler per step`), and the
    /// way the server decodes a lone sampled request in its stream slot (`tgN sampled, lone
    /// stream`); then with no top-k
    /// (temperature 1, top-p 0.95: the whole row is a candidate, as in an OpenAI request that
    /// sets only top_p; `tgN sampled, whole row`).
    #[arg(long)]
    sampled: bool,
    /// Also print where one decode step's GPU time goes, op by op, at these context positions
    /// (e.g. `--profile 64,4096`): the step recorded the fast path's way with a timestamp after
    /// every op (GPU backend only).
    #[arg(long, value_delimiter = ',')]
    profile: Vec<usize>,
    /// Also print where the GPU time of prefilling this many prompt tokens (one chunk, from
    /// position 0) goes, op by op over the layers (GPU backend, GEMM prefill only).
    #[arg(long)]
    profile_prefill: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Draw generation tok/s against context depth (median, min-max bars) into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Serialize, Debug)]
struct Stat {
    test: String,
    /// Context depth of a generation test.
    depth: Option<usize>,
    /// Sequences decoded together (multi-stream tests; tok/s are aggregate over them).
    batch: Option<usize>,
    /// Multi-stream tests: how many of the `batch` streams' greedy ids (first rep) equal
    /// single-stream decoding of the same prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    streams_equal_single: Option<usize>,
    median_tps: f64,
    min_tps: f64,
    max_tps: f64,
    reps: usize,
}

/// GPU time of one op kind over a decode step at `pos` (`--profile`).
#[derive(Serialize, Debug)]
struct OpRow {
    pos: usize,
    op: String,
    calls: usize,
    us: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    model: String,
    /// Weight bytes one decoded token reads (attention, router, K experts, lm_head, one embedding row).
    weight_bytes_per_token: u64,
    /// Plain read bandwidth of the device measured in this run (GB/s), when the backend has a probe.
    read_gbps: Option<f64>,
    backend: String,
    /// The KV cache's element type (`--cache-type`).
    kv_cache: String,
    warmup_tps: f64,
    warmup_tokens: usize,
    stats: Vec<Stat>,
    profile: Vec<OpRow>,
}

/// `--profile`: per-op GPU time of one step at each position (after a prefill to it).
fn profile(b: &mut dyn Backend, positions: &[usize], reps: usize) -> Result<Vec<OpRow>> {
    let mut rows = vec![];
    for &pos in positions {
        b.truncate(0)?;
        if pos > 0 {
            b.prefill(&prompt_ids(pos))?;
        }
        let Some(ops) = b.profile_step(reps)? else {
            anyhow::bail!(
                "--profile: backend {} cannot time ops on the device",
                b.name()
            );
        };
        rows.extend(ops.into_iter().map(|o| OpRow {
            pos,
            op: o.op,
            calls: o.calls,
            us: o.us,
        }));
    }
    Ok(rows)
}

fn stat(test: String, mut tps: Vec<f64>) -> Stat {
    tps.sort_by(f64::total_cmp);
    Stat {
        test,
        depth: None,
        batch: None,
        streams_equal_single: None,
        median_tps: tps[tps.len() / 2],
        min_tps: tps[0],
        max_tps: tps[tps.len() - 1],
        reps: tps.len(),
    }
}

/// Deterministic pseudo-prompt of ordinary token ids (no EOS, below the byte-level vocab).
fn prompt_ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + (i * 7919) % 100_000).collect()
}

/// Time `reps` greedy runs of `n` tokens after `depth` tokens of context; tokens/s of each.
/// The context is prefilled once; each repetition truncates back to it.
fn tg_at(b: &mut dyn Backend, depth: usize, n: usize, reps: usize) -> Result<Vec<f64>> {
    b.truncate(0)?;
    if depth > 0 {
        b.prefill(&prompt_ids(depth))?;
    }
    let mut out = vec![];
    for r in 0..reps {
        b.truncate(depth)?;
        let first = argmax(&b.prefill(&[1000 + r as u32])?);
        let t = Instant::now();
        // No EOS: every run decodes exactly n tokens.
        let ids = b.decode_greedy(first, n, &[])?;
        out.push(ids.len() as f64 / t.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// The prompt of stream `s` in rep `r` of [`tg_batch`].
fn batch_prompt(r: usize, s: usize) -> [u32; 2] {
    [1000 + (r * 8 + s) as u32, 2000 + s as u32]
}

/// Aggregate tokens/s of `reps` multi-stream runs: `bsz` streams, each prefilled with its own
/// short prompt, then `n` greedy tokens decoded together (no EOS) the way the server does:
/// runs of [`RUN`] steps, [`IN_FLIGHT`] of them queued on the device at once. Also returns
/// the ids each stream decoded in the first rep.
fn tg_batch(
    b: &mut dyn Backend,
    bsz: usize,
    n: usize,
    reps: usize,
) -> Result<(Vec<f64>, Vec<Vec<u32>>)> {
    let mut out = vec![];
    let mut first_ids = vec![vec![]; bsz];
    for r in 0..reps {
        let mut first = vec![];
        for s in 0..bsz {
            let logits = b.stream_prefill(s, 0, &batch_prompt(r, s))?;
            first.push(Some(argmax(&logits)));
        }
        let t = Instant::now();
        let queued = b.streams_queue(Some(&first), RUN.min(n), &[])?;
        let ids = drain_runs(b, n, queued)?;
        let total: usize = ids.iter().map(Vec::len).sum();
        if r == 0 {
            for (all, got) in first_ids.iter_mut().zip(ids) {
                *all = got;
            }
        }
        anyhow::ensure!(total == bsz * n, "{total} ids from {bsz} x {n} steps");
        out.push(total as f64 / t.elapsed().as_secs_f64());
    }
    for s in 0..bsz {
        b.streams_end(s)?;
    }
    Ok((out, first_ids))
}

/// After a restart that queued `queued` steps: keep [`IN_FLIGHT`] runs of [`RUN`] steps queued
/// until `n` steps are, collecting each run as the server does; the ids per stream.
fn drain_runs(b: &mut dyn Backend, n: usize, mut queued: usize) -> Result<Vec<Vec<u32>>> {
    let mut in_flight = 1;
    let mut all: Vec<Vec<u32>> = vec![];
    while in_flight > 0 {
        while in_flight < IN_FLIGHT && queued < n {
            let q = b.streams_queue(None, RUN.min(n - queued), &[])?;
            if q == 0 {
                break;
            }
            queued += q;
            in_flight += 1;
        }
        let ids = b.streams_collect()?.expect("a run is queued");
        in_flight -= 1;
        all.resize(all.len().max(ids.len()), Vec::new());
        for (a, got) in all.iter_mut().zip(&ids) {
            a.extend_from_slice(got);
        }
    }
    Ok(all)
}

/// How many of the streams' first-rep ids ([`tg_batch`]) equal single-stream greedy decoding of
/// the same prompt on the same backend (the multi-stream path's promise, checked where the
/// speed is measured).
fn streams_match_single(b: &mut dyn Backend, n: usize, ids: &[Vec<u32>]) -> Result<usize> {
    let mut same = 0;
    for (s, got) in ids.iter().enumerate() {
        b.truncate(0)?;
        let first = argmax(&b.prefill(&batch_prompt(0, s))?);
        same += (b.decode_greedy(first, n, &[])? == *got) as usize;
    }
    b.truncate(0)?;
    Ok(same)
}

/// How [`tg_sampled`] decodes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SampledWay {
    /// A device step per token, the host's sampler on its logits (`Backend::step`).
    Host,
    /// The same through `streams_step` on stream slot 0 alone (how the server decodes a lone
    /// sampled request the device cannot sample).
    Lone,
    /// Stream slot 0 alone sampled on the device (`Backend::streams_queue_sampled`: how the
    /// server decodes a lone sampled request now), runs of [`RUN`], [`IN_FLIGHT`] queued.
    LoneFolded,
    /// Folded runs sampled on the device (`Backend::decode_sampled_stream`, as `nibble
    /// generate` decodes where the backend samples the settings), runs of [`SAMPLED_RUN`].
    Folded,
}

/// Ids per folded sampled run in the benchmark: `nibble generate`'s default `--run`.
const SAMPLED_RUN: usize = 4;

/// `--sampled`: tokens/s of `reps` runs of `n` sampled tokens decoded `way`.
fn tg_sampled(
    b: &mut dyn Backend,
    n: usize,
    reps: usize,
    way: SampledWay,
    params: &SamplingParams,
) -> Result<Vec<f64>> {
    let lone = matches!(way, SampledWay::Lone | SampledWay::LoneFolded);
    let mut out = vec![];
    for r in 0..reps {
        let mut sampler = Sampler::new(params.clone())?;
        let mut hist = vec![1000 + r as u32];
        let logits = if lone {
            b.stream_prefill(0, 0, &hist)?
        } else {
            b.truncate(0)?;
            b.prefill(&hist)?
        };
        let mut tok = sampler.sample(&logits, &hist)?;
        let t = Instant::now();
        if way == SampledWay::Folded {
            hist.push(tok);
            let draws = sampler.draw_uniforms(n);
            let spec = sampler.device_sampling(&hist, &draws);
            let got = b.decode_sampled_stream(tok, n, SAMPLED_RUN, &[], &spec, &mut |_| true)?;
            anyhow::ensure!(got == n, "a folded sampled run gave {got} of {n} ids");
        } else if way == SampledWay::LoneFolded {
            hist.push(tok);
            let draws = sampler.draw_uniforms(b.context_len() - hist.len() + 1);
            let spec = sampler.device_sampling(&hist, &draws);
            let queued = b.streams_queue_sampled(&[Some(tok)], RUN.min(n), &[], &[Some(&spec)])?;
            let total = drain_runs(b, n, queued)?.first().map_or(0, Vec::len);
            anyhow::ensure!(total == n, "a lone sampled stream gave {total} of {n} ids");
        } else {
            for _ in 0..n {
                hist.push(tok);
                let logits = if lone {
                    let mut all = b.streams_step(&[Some(tok)])?;
                    all.first_mut()
                        .and_then(Option::take)
                        .context("a one-step run returned no logits for stream 0")?
                } else {
                    b.step(tok)?
                };
                tok = sampler.sample(&logits, &hist)?;
            }
        }
        out.push(n as f64 / t.elapsed().as_secs_f64());
        if lone {
            b.streams_end(0)?;
        }
    }
    b.truncate(0)?;
    Ok(out)
}

fn tg(b: &mut dyn Backend, n: usize, reps: usize) -> Result<Vec<f64>> {
    tg_at(b, 0, n, reps)
}

pub fn run(mut a: Args) -> Result<()> {
    a.backend.check_flags()?;
    if a.compare_per_token
        && matches!(
            a.backend.backend,
            backends::BackendKind::Cpu | backends::BackendKind::Ref
        )
    {
        anyhow::bail!("--compare-per-token compares the GPU's folded and per-token paths: it needs --backend gpu or auto");
    }
    // A depth given twice is measured once, in the order given.
    let mut seen = std::collections::HashSet::new();
    a.depth.retain(|d| seen.insert(*d));
    let model = crate::backends::open_model(&a.model, &a.backend)?;
    let reps = a.reps;
    let mut stats = vec![];
    anyhow::ensure!(
        a.batch.iter().all(|b| (1..=8).contains(b)),
        "--batch sizes must be between 1 and 8"
    );
    let multi = a.batch.iter().copied().filter(|b| *b > 1).max();
    let mut bargs = a.backend.clone();
    // Always say which kernels and which N run (the GPU backend prints it on stderr).
    bargs.verbose = true;
    if let Some(m) = multi {
        bargs.streams = bargs.streams.max(m);
    }
    if a.sampled {
        // The server's lone sampled request decodes in a stream slot.
        bargs.streams = bargs.streams.max(1);
    }
    let mut b = backends::make(&bargs, model.weights.clone())?;
    let name = b.name();
    // What a context error suggests: a larger --ctx, unless the context is the model's own.
    let hint = if b.context_len() < model.weights.config().max_context() {
        "raise --ctx"
    } else {
        "the model's own limit"
    };
    // Bad --profile positions fail before the timed tests, not after them.
    if let Some(p) = a.profile.iter().find(|p| **p >= b.context_len()) {
        anyhow::bail!(
            "--profile position {p} is outside the context of {} ({hint})",
            b.context_len()
        );
    }
    // Every depth's run must fit (the warm-up's too, at depth 0) before anything is timed.
    for &d in a.depth.iter().chain([&0]) {
        if d + a.gen + 1 > b.context_len() {
            anyhow::bail!(
                "depth {d} + {} generated tokens exceed the context of {} ({hint})",
                a.gen,
                b.context_len()
            );
        }
    }
    // Warm-up: one generation run, timed and reported apart.
    let t = Instant::now();
    b.truncate(0)?;
    let first = argmax(&b.prefill(&[1000])?);
    let w = b.decode_greedy(first, a.gen, &[])?;
    let warmup_tps = w.len() as f64 / t.elapsed().as_secs_f64();
    for &d in &a.depth {
        let name = if d == 0 {
            format!("tg{}", a.gen)
        } else {
            format!("tg{} @ d{d}", a.gen)
        };
        let mut s = stat(name, tg_at(b.as_mut(), d, a.gen, reps)?);
        s.depth = Some(d);
        stats.push(s);
    }
    if a.sampled {
        anyhow::ensure!(
            a.gen + 2 <= b.context_len(),
            "--sampled: {} generated tokens exceed the context of {} ({hint})",
            a.gen,
            b.context_len()
        );
        let top_k = SamplingParams::llama_cpp_defaults(0);
        let on_device =
            b.samples_on_device(&Sampler::new(top_k.clone())?.device_sampling(&[], &[]));
        let name = format!("tg{} sampled", a.gen);
        let way = if on_device {
            SampledWay::Folded
        } else {
            SampledWay::Host
        };
        stats.push(stat(
            name,
            tg_sampled(b.as_mut(), a.gen, reps, way, &top_k)?,
        ));
        if on_device {
            let name = format!("tg{} sampled, host sampler per step", a.gen);
            let host = tg_sampled(b.as_mut(), a.gen, reps, SampledWay::Host, &top_k)?;
            stats.push(stat(name, host));
        }
        if b.max_streams() > 0 {
            let spec_on =
                b.streams_sample_on_device(&Sampler::new(top_k.clone())?.device_sampling(&[], &[]));
            let name = format!("tg{} sampled, lone stream", a.gen);
            let way = if spec_on {
                SampledWay::LoneFolded
            } else {
                SampledWay::Lone
            };
            let lone = tg_sampled(b.as_mut(), a.gen, reps, way, &top_k)?;
            stats.push(stat(name, lone));
            if spec_on {
                let name = format!("tg{} sampled, lone stream, host sampler per step", a.gen);
                let lone = tg_sampled(b.as_mut(), a.gen, reps, SampledWay::Lone, &top_k)?;
                stats.push(stat(name, lone));
            }
        }
        let whole = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(0),
            ..SamplingParams::default()
        };
        let name = format!("tg{} sampled, whole row", a.gen);
        stats.push(stat(
            name,
            tg_sampled(b.as_mut(), a.gen, reps, SampledWay::Host, &whole)?,
        ));
    }
    if a.prompt > 0 {
        // Prompt processing after each depth's context, like llama-bench's -d.
        let ids = prompt_ids(a.prompt);
        for &d in &a.depth {
            anyhow::ensure!(
                d + a.prompt <= b.context_len(),
                "depth {d} + a {}-token prompt exceed the context of {} ({hint})",
                a.prompt,
                b.context_len()
            );
            b.truncate(0)?;
            if d > 0 {
                b.prefill(&prompt_ids(d))?;
            }
            let mut tps = vec![];
            for _ in 0..reps {
                b.truncate(d)?;
                let t = Instant::now();
                b.prefill(&ids)?;
                tps.push(ids.len() as f64 / t.elapsed().as_secs_f64());
            }
            let name = if d == 0 {
                format!("pp{}", a.prompt)
            } else {
                format!("pp{} @ d{d}", a.prompt)
            };
            stats.push(stat(name, tps));
        }
    }
    if multi.is_some() {
        anyhow::ensure!(
            b.max_streams() > 0,
            "--batch needs the multi-stream path, which {} does not have (the gpu and cpu backends do)",
            b.name()
        );
        anyhow::ensure!(
            b.max_streams() >= multi.unwrap_or(0),
            "--batch needs the multi-stream path: {} decodes at most {} streams together",
            b.name(),
            b.max_streams()
        );
        // B=1 through the multi-stream path too, so the ratios compare like with like.
        for &bsz in &a.batch {
            let (tps, ids) = tg_batch(b.as_mut(), bsz, a.gen, reps)?;
            let same = streams_match_single(b.as_mut(), a.gen, &ids)?;
            let mut s = stat(format!("tg{} batch {bsz}", a.gen), tps);
            s.streams_equal_single = Some(same);
            s.batch = Some(bsz);
            stats.push(s);
        }
    }
    let profile_rows = profile(b.as_mut(), &a.profile, reps)?;
    if let Some(n) = a.profile_prefill {
        b.truncate(0)?;
        let Some(ops) = b.profile_prefill(&prompt_ids(n))? else {
            anyhow::bail!(
                "--profile-prefill: backend {} cannot time its prefill",
                b.name()
            );
        };
        let total: f64 = ops.iter().map(|o| o.us).sum();
        note!(
            "prefill profile: {n} tokens from position 0, GPU {:.1} ms ({:.0} tok/s)",
            total / 1e3,
            n as f64 / total * 1e6
        );
        for o in &ops {
            note!(
                "  {:<32} {:>4} calls {:>10.1} us {:>5.1}%",
                o.op,
                o.calls,
                o.us,
                100.0 * o.us / total
            );
        }
    }
    // After the timed tests, so its 1 GiB scratch buffer is not resident during them.
    let read_gbps = b.read_bandwidth_gbps()?;
    // Only the GPU has a per-token path to compare (`--backend auto` may have chosen either).
    let on_gpu = b.name().starts_with("gpu");
    drop(b);
    if a.compare_per_token && on_gpu {
        let mut args = a.backend.clone();
        args.per_token = true;
        let mut b = backends::make(&args, model.weights.clone())?;
        tg(b.as_mut(), a.gen.min(32), 1)?; // warm-up, discarded
        stats.push(stat(
            format!("tg{} per-token", a.gen),
            tg(b.as_mut(), a.gen, reps)?,
        ));
    }
    let report = Report {
        weight_bytes_per_token: model.info()?.active_bytes_per_token,
        read_gbps,
        model: a.model.display().to_string(),
        backend: name,
        kv_cache: a.backend.cache_type.to_string(),
        warmup_tps,
        warmup_tokens: w.len(),
        stats,
        profile: profile_rows,
    };
    if let Some(path) = &a.plot {
        let points: Vec<crate::plot::Point> = report
            .stats
            .iter()
            .filter_map(|s| {
                s.depth.map(|d| crate::plot::Point {
                    x: d as f64,
                    median: s.median_tps,
                    min: s.min_tps,
                    max: s.max_tps,
                })
            })
            .collect();
        let batches: Vec<crate::plot::Point> = report
            .stats
            .iter()
            .filter_map(|s| {
                s.batch.map(|b| crate::plot::Point {
                    x: b as f64,
                    median: s.median_tps,
                    min: s.min_tps,
                    max: s.max_tps,
                })
            })
            .collect();
        let title = format!("nibble tg{} on {}", a.gen, report.backend);
        let mut panels = vec![("context depth (tokens)", points)];
        if !batches.is_empty() {
            panels.push(("sequences decoded together (aggregate tok/s)", batches));
        }
        crate::plot::draw(path, &title, &panels)?;
        note!("plot written to {}", path.display());
    }
    // A failed write (a full disk, a closed stdout) is an error, not a panic.
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(());
    }
    writeln!(out, "model   {}", report.model)?;
    writeln!(
        out,
        "backend {} ({} KV cache)",
        report.backend, report.kv_cache
    )?;
    writeln!(
        out,
        "warm-up {} tokens at {:.1} tok/s (first run after load; not in the statistics)",
        report.warmup_tokens, report.warmup_tps
    )?;
    writeln!(
        out,
        "weights read per token {:.3} GB",
        report.weight_bytes_per_token as f64 / 1e9
    )?;
    if let Some(g) = report.read_gbps {
        writeln!(out, "read bandwidth measured in this run: {g:.0} GB/s (sums of a buffer of up to 1 GiB, after the tests)")?;
    }
    writeln!(
        out,
        "{:<26} {:>12} {:>22} {:>5} {:>13} {:>9}",
        "test", "median tok/s", "min-max", "reps", "implied GB/s", "of read"
    )?;
    for s in &report.stats {
        // A single-stream generated token reads every active weight once. Batched prefill and
        // multi-stream runs share weight reads between tokens, so no per-token product holds.
        let single = s.batch.is_none() && s.test.starts_with("tg");
        let gbs = s.median_tps * report.weight_bytes_per_token as f64 / 1e9;
        let per = s.batch.map_or(String::new(), |b| {
            let same = s.streams_equal_single.map_or(String::new(), |n| {
                let flag = if n == b { "" } else { " MISMATCH" };
                format!("; ids of {n}/{b} streams equal single-stream{flag}")
            });
            format!("  ({:.1} tok/s per stream{same})", s.median_tps / b as f64)
        });
        let (gbs_col, share) = match (single, report.read_gbps) {
            (true, Some(r)) => (format!("{gbs:.0}"), format!("{:.0}%", 100.0 * gbs / r)),
            (true, None) => (format!("{gbs:.0}"), "-".to_string()),
            (false, _) => ("-".to_string(), "-".to_string()),
        };
        writeln!(
            out,
            "{:<26} {:>12.1} {:>10.1} - {:<10.1} {:>5} {:>13} {:>9}{per}",
            s.test, s.median_tps, s.min_tps, s.max_tps, s.reps, gbs_col, share
        )?;
    }
    for &pos in &a.profile {
        let ops: Vec<&OpRow> = report.profile.iter().filter(|o| o.pos == pos).collect();
        // The calibration row (timestamps with nothing between) is not part of the step.
        let total: f64 = ops
            .iter()
            .filter(|o| !o.op.starts_with('('))
            .map(|o| o.us)
            .sum();
        writeln!(
            out,
            "profile: one greedy step from position {pos} on, GPU {total:.1} us (the median of \
             up to {reps} steps after 4 warm-up steps, all in one pass)"
        )?;
        writeln!(
            out,
            "  {:<28} {:>6} {:>11} {:>9} {:>6}",
            "op", "calls", "us/step", "us/call", "share"
        )?;
        for o in ops {
            writeln!(
                out,
                "  {:<28} {:>6} {:>11.1} {:>9.2} {:>5.1}%",
                o.op,
                o.calls,
                o.us,
                o.us / o.calls as f64,
                100.0 * o.us / total
            )?;
        }
    }
    Ok(())
}
