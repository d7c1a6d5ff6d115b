//! [`GpuBackend`]: `nibble_backend::Backend` on the GPU decode plan.
//!
//! - `decode_greedy` is folded: runs of up to `fold` steps (default 16) are each recorded into
//!   one command buffer, the argmax stays on the GPU and the host waits once per run. With
//!   `per_token` set it instead submits and waits per token and takes the argmax on the host
//!   (the comparison path; same kernels otherwise).
//! - `step` / `prefill` return logits. `prefill` is, for now, a loop of single-token steps (one
//!   submit + logits readback each); batching prompt tokens is future work.
//! - Position bookkeeping follows the trait: a failing call leaves `position()` unchanged.

use crate::context::{AdapterChoice, Context};
use crate::kernels::moe::Routing;
use crate::plan::{DecodePlan, PlanOptions};
use crate::weights::GpuWeights;
use anyhow::{bail, ensure, Result};
use nibble_backend::{argmax, Backend};
use nibble_model::config::Qwen3MoeConfig;
use nibble_model::weights::WeightSource;

/// Options of the GPU backend.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// KV-cache positions.
    pub context_len: usize,
    /// Greedy steps per submission in `decode_greedy`.
    pub fold: u32,
    /// Submit per token and take the argmax on the host.
    pub per_token: bool,
    pub routing: Routing,
    pub adapter: AdapterChoice,
    /// Dense matvecs on f32 activations (parity mode, see `PlanOptions::f32_acts`).
    pub f32_acts: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            context_len: 4096,
            fold: 16,
            per_token: false,
            routing: Routing::default(),
            adapter: AdapterChoice::Auto,
            f32_acts: false,
        }
    }
}

/// Most EOS ids a folded run can stop on.
const MAX_EOS: usize = 16;

/// The GPU backend: weights resident on the device, one sequence's KV cache.
pub struct GpuBackend {
    plan: DecodePlan,
    per_token: bool,
    pos: usize,
}

impl GpuBackend {
    /// Open a device per `opts.adapter` and upload `source`.
    pub fn new(source: &dyn WeightSource, opts: GpuOptions) -> Result<GpuBackend> {
        let ctx = Context::new(&opts.adapter)?;
        Self::with_context(&ctx, source, opts)
    }

    /// Upload `source` to an existing context.
    pub fn with_context(
        ctx: &Context,
        source: &dyn WeightSource,
        opts: GpuOptions,
    ) -> Result<GpuBackend> {
        let cfg = source.config();
        ensure!(
            opts.context_len > 0,
            "the context length must be at least 1"
        );
        ensure!(
            opts.context_len <= cfg.max_position_embeddings,
            "a context of {} positions exceeds max_position_embeddings ({})",
            opts.context_len,
            cfg.max_position_embeddings
        );
        ensure!(opts.fold > 0, "fold must be at least 1");
        let weights = GpuWeights::upload(ctx, source)?;
        let plan = DecodePlan::new(
            ctx,
            weights,
            PlanOptions {
                context_len: opts.context_len,
                max_run: opts.fold,
                routing: opts.routing,
                max_eos: MAX_EOS,
                f32_acts: opts.f32_acts,
            },
        )?;
        Ok(GpuBackend {
            plan,
            per_token: opts.per_token,
            pos: 0,
        })
    }

    /// Bytes of weights resident on the GPU.
    pub fn resident_bytes(&self) -> u64 {
        self.plan.weights.resident_bytes
    }

    /// Dispatches recorded per greedy step.
    pub fn dispatches_per_step(&self) -> usize {
        self.plan.dispatches_per_step()
    }

    fn check_token(&self, t: u32) -> Result<()> {
        let v = self.plan.weights.cfg.vocab_size;
        if t as usize >= v {
            bail!("token id {t} is outside the vocabulary of {v} tokens");
        }
        Ok(())
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> String {
        format!("gpu ({})", self.plan.ctx.info.name)
    }

    fn config(&self) -> &Qwen3MoeConfig {
        &self.plan.weights.cfg
    }

    fn context_len(&self) -> usize {
        self.plan.opts.context_len
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn truncate(&mut self, pos: usize) -> Result<()> {
        ensure!(
            pos <= self.pos,
            "cannot truncate to {pos}: only {} positions are cached",
            self.pos
        );
        // Rows >= pos are stale and get overwritten before attention reads them again.
        self.pos = pos;
        Ok(())
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "prefill of an empty token list");
        for t in tokens {
            self.check_token(*t)?;
        }
        let start = self.pos;
        if tokens.len() > self.context_len() - start {
            bail!(
                "prompt of {} tokens at position {start} exceeds the context of {}",
                tokens.len(),
                self.context_len()
            );
        }
        let mut logits = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            match self.plan.step_logits(*t, start + i) {
                Ok(l) => logits = l,
                Err(e) => {
                    self.pos = start;
                    return Err(e.into());
                }
            }
        }
        self.pos = start + tokens.len();
        Ok(logits)
    }

    fn decode_greedy(&mut self, token: u32, n: usize, eos: &[u32]) -> Result<Vec<u32>> {
        self.check_token(token)?;
        ensure!(
            eos.len() <= MAX_EOS,
            "at most {MAX_EOS} EOS ids are supported, got {}",
            eos.len()
        );
        if n == 0 {
            return Ok(Vec::new());
        }
        let start = self.pos;
        if n > self.context_len() - start {
            bail!(
                "{n} greedy steps at position {start} exceed the context of {}",
                self.context_len()
            );
        }
        let mut out = Vec::with_capacity(n);
        let mut cur = token;
        let result = (|| -> Result<()> {
            while out.len() < n {
                if self.per_token {
                    let next = argmax(&self.plan.step_logits(cur, start + out.len())?);
                    out.push(next);
                    if eos.contains(&next) {
                        break;
                    }
                    cur = next;
                    continue;
                }
                let run = (n - out.len()).min(self.plan.opts.max_run as usize) as u32;
                let ids = self.plan.run_greedy(cur, start + out.len(), run, eos)?;
                let stopped = ids.last().is_some_and(|t| eos.contains(t));
                let Some(&last) = ids.last() else {
                    bail!("the GPU run produced no token");
                };
                out.extend_from_slice(&ids);
                if stopped {
                    break;
                }
                cur = last;
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                self.pos = start + out.len();
                Ok(out)
            }
            Err(e) => {
                self.pos = start;
                Err(e)
            }
        }
    }
}
