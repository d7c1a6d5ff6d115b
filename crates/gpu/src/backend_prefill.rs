//! Which path a prompt takes through [`GpuBackend`] (split from backend.rs): the GEMM prefill
//! (`prefill.rs`) for prompts of [`GpuOptions::prefill_gemm_min`] tokens or more, main sequence
//! and stream slots alike; the column prefill below that (8 tokens per dispatch: the main
//! sequence's [`ColumnPrefill`], a stream's own multi-stream plan) and for every prompt with
//! `--prefill-chunk 0`; token by token (`--per-token`, the int8 numerics); and a one-token
//! prompt as a decode step. `Backend::prefill_rows` (every row's logits, for scoring) takes the
//! GEMM prefill whatever the prompt's length (prefill/rows.rs), else steps token by token.
//! Both prefill plans are built at their first use, so backends that
//! never prefill (decode-only benchmarks, most tests on lavapipe, where compiling pipelines is
//! slow) pay for neither.

use super::{GpuBackend, GpuOptions};
use crate::batch::{BatchMode, BatchPlan};
use crate::kernels::attention::Combine;
use crate::kernels::gemm::{self, GemmKernel};
use crate::numerics::Numerics;
use crate::plan::PREFILL_CHUNK;
use crate::prefill::{PrefillPlan, PrefillShape, Target};
use crate::tensor::QForm;
use crate::tune::Tune;
use anyhow::{ensure, Result};
use nibble_backend::{Backend, OpTime, RowSink};
use std::io::Write as _;

/// The default [`GpuOptions::prefill_gemm_min`]: prompts shorter than this many tokens go
/// through the column prefill (8 tokens per dispatch), longer ones through the GEMM prefill.
/// The GEMM prefill costs about a chunk's weight traffic whatever the prompt's length, the
/// column prefill about one decode step per 8 tokens. Measured on the H200 (docs/BENCHMARKS.md
/// run 124, two rounds): GEMM against column pp8 203 / 198 against 616 / 632 tok/s, pp16 337 /
/// 343 against 683 / 684, pp32 592 / 603 against 704 / 549 (even), pp64 1053 / 1040 against
/// 743 / 738. A server's short chat turns pay it on every request: the load test (prompts of
/// ~12 tokens) ran at 673.0 / 683.2 tok/s (mixed / greedy) through the column prefill against
/// 462.4 / 513.8 through the GEMM prefill (run 123).
pub const GEMM_PREFILL_MIN_TOKENS: usize = 32;

/// The main sequence's column prefill: a [`BatchMode::Prefill`] plan over its KV cache, built
/// at the first prompt that takes it.
pub(super) enum ColumnPrefill {
    /// Token by token instead (`--per-token`, the int8 numerics: the column kernels take f32
    /// activations only).
    Off,
    Pending {
        numerics: Numerics,
        merge: Combine,
        tune: Tune,
    },
    Built(Box<BatchPlan>),
}

impl ColumnPrefill {
    /// The column prefill `opts` allow, not built yet.
    pub(super) fn new(opts: &GpuOptions, merge: Combine) -> ColumnPrefill {
        if opts.numerics.quantized() || opts.per_token {
            ColumnPrefill::Off
        } else {
            ColumnPrefill::Pending {
                numerics: opts.numerics,
                merge,
                tune: opts.tune,
            }
        }
    }
}

/// The GEMM prefill of a backend, built at the first prompt that takes it.
pub(super) enum GemmPrefill {
    Off,
    Pending {
        shape: PrefillShape,
        merge: Combine,
    },
    /// The plan and what it was built from (to rebuild it on f32 fmas, `run_gemm_prefill`).
    Built(Box<PrefillPlan>, PrefillShape, Combine),
}

impl GemmPrefill {
    /// The GEMM prefill `opts` allow, not built yet (off with the int8 numerics, `--per-token`
    /// and `--prefill-chunk 0`, and for weights of `forms` the GEMMs do not read); for an
    /// affine (MLX) model on f32 fmas unless `--tune prefill_coop_affine=1` (tune.rs says why),
    /// and on f32 fmas where no form of the model runs on matrix units.
    pub(super) fn new(opts: &GpuOptions, merge: Combine, forms: &[QForm]) -> GemmPrefill {
        let affine = forms.iter().any(|f| f.affine());
        if opts.numerics.quantized()
            || opts.per_token
            || opts.prefill_chunk == 0
            || !forms.iter().all(|f| GemmKernel::reads(*f))
        {
            GemmPrefill::Off
        } else {
            GemmPrefill::Pending {
                shape: PrefillShape {
                    chunk: opts.prefill_chunk,
                    query_tiles: opts.prefill_query_tiles,
                    matrix_units: opts.prefill_matrix_units
                        && forms.iter().any(|f| f.on_matrix_units())
                        && (!affine || opts.tune.prefill_coop_affine == Some(1)),
                    max_splits: opts.tune.prefill_splits,
                    k_splits: opts.tune.prefill_ksplits,
                    double_buffer: opts.tune.prefill_dbuf.map(|v| v != 0),
                },
                merge,
            }
        }
    }
}

impl GpuBackend {
    /// How prompts are prefilled, in words (for `describe`).
    pub fn prefill_summary(&self) -> String {
        let short = match self.gemm_min {
            0..=2 => String::new(),
            n => format!("; prompts under {n} tokens: the column prefill"),
        };
        match (&self.gemm_prefill, &self.prefill) {
            (GemmPrefill::Built(g, ..), _) => format!(
                "GEMM prefill ({}; {}), chunks of up to {} tokens per command buffer{short}",
                g.gemm_kind(),
                g.attention_kind(),
                g.chunk()
            ),
            (GemmPrefill::Pending { shape, .. }, _) => format!(
                "GEMM prefill ({}; {}), chunks of up to {} tokens per command buffer (built at \
                 the first prompt, shorter if its buffers would pass {} MiB){short}",
                gemm::describe(
                    gemm::on_matrix_units(&self.plan.ctx, shape.matrix_units),
                    shape
                        .double_buffer
                        .unwrap_or_else(|| gemm::double_buffer_fits(&self.plan.ctx))
                ),
                if shape.query_tiles {
                    "query-tile attention where the shapes allow"
                } else {
                    "column attention"
                },
                (shape.chunk as usize).min(self.context_len()),
                crate::prefill::CHUNK_BUDGET >> 20
            ),
            (GemmPrefill::Off, ColumnPrefill::Pending { .. } | ColumnPrefill::Built(_)) => {
                let forms = self.plan.weights.forms();
                format!(
                    "column prefill, {} tokens per dispatch{}",
                    crate::columns::MAX_COLUMNS,
                    match forms.iter().find(|f| !GemmKernel::reads(**f)) {
                        None => String::new(),
                        Some(f) => format!(" (the prefill GEMMs do not read {} weights)", f.name()),
                    }
                )
            }
            (GemmPrefill::Off, ColumnPrefill::Off) => {
                format!("token by token, {PREFILL_CHUNK} tokens per command buffer")
            }
        }
    }

    /// Which prefill plans exist yet: (column, GEMM). For tests of the path a prompt takes.
    #[cfg(test)]
    pub(crate) fn prefills_built(&self) -> (bool, bool) {
        (
            matches!(self.prefill, ColumnPrefill::Built(_)),
            matches!(self.gemm_prefill, GemmPrefill::Built(..)),
        )
    }

    /// Whether a prompt of `len` tokens takes the GEMM prefill (a short one too where there
    /// is no column prefill to take instead).
    fn takes_gemm(&self, len: usize) -> bool {
        !matches!(self.gemm_prefill, GemmPrefill::Off)
            && (len >= self.gemm_min || matches!(self.prefill, ColumnPrefill::Off))
    }

    /// The main sequence's column prefill, built now if this is its first use; `None` when it
    /// is off.
    fn column_prefill(&mut self) -> Result<Option<&mut BatchPlan>> {
        if let ColumnPrefill::Pending {
            numerics,
            merge,
            tune,
        } = self.prefill
        {
            let (k_cache, v_cache) = self.plan.kv_caches();
            let b = BatchPlan::new(
                &self.plan.ctx,
                &self.plan.weights,
                (
                    crate::columns::MAX_COLUMNS,
                    self.context_len(),
                    self.plan.cache_type(),
                ),
                numerics,
                merge,
                tune,
                BatchMode::Prefill { k_cache, v_cache },
            )?;
            self.prefill = ColumnPrefill::Built(Box::new(b));
        }
        Ok(match &mut self.prefill {
            ColumnPrefill::Built(b) => Some(b),
            _ => None,
        })
    }

    /// The GEMM prefill, built now if this is its first use; `None` when it is off.
    pub(super) fn gemm_prefill(&mut self) -> Result<Option<&PrefillPlan>> {
        if let GemmPrefill::Pending { shape, merge } = self.gemm_prefill {
            let mut p = PrefillPlan::new(
                &self.plan.ctx,
                &self.plan.weights,
                (self.context_len(), self.plan.cache_type()),
                shape,
                merge,
                self.plan.kv_caches(),
            )?;
            if let Some(b) = &self.batch {
                p.bind_streams(&self.plan.weights, b.kv_caches(), b.streams() as u32)?;
            }
            self.gemm_prefill = GemmPrefill::Built(Box::new(p), shape, merge);
        }
        Ok(match &self.gemm_prefill {
            GemmPrefill::Built(g, ..) => Some(g),
            _ => None,
        })
    }

    /// The GEMM prefill (not off) of `tokens` into `target` at positions `start..`; the logits
    /// after the last one. The matrix-unit GEMM takes its inputs through f16 (kernels/gemm_coop.rs:
    /// magnitudes below 2^11), and a value past that range turns into inf/NaN that reaches the
    /// logits. So where its logits are not all finite, the plan is rebuilt on f32 fmas (for the
    /// rest of this backend's life, with a warning) and the prompt run again: its KV rows are
    /// written afresh, and a model whose logits are non-finite on fmas too gets them as before.
    fn run_gemm_prefill(
        &mut self,
        target: Target,
        tokens: &[u32],
        start: usize,
    ) -> Result<Vec<f32>> {
        let g = self
            .gemm_prefill()?
            .expect("the caller checked it is not off");
        let logits = g.prefill(target, tokens, start)?;
        if !g.uses_matrix_units() || logits.iter().all(|v| v.is_finite()) {
            return Ok(logits);
        }
        self.prefill_on_fmas();
        let g = self.gemm_prefill()?.expect("rebuilt");
        g.prefill(target, tokens, start)
    }

    /// [`Backend::prefill`], or with `rows` [`Backend::prefill_rows`] (the result then empty).
    pub(super) fn prefill_with(
        &mut self,
        tokens: &[u32],
        rows: Option<(usize, &mut RowSink<'_>)>,
    ) -> Result<Vec<f32>> {
        let start = self.pos;
        let vocab = self.plan.weights.cfg.vocab_size;
        nibble_backend::check_prompt(vocab, tokens, start, self.context_len())?;
        self.lone_idle("prefill")?;
        // A failure leaves the position at `start` (the rows written are stale).
        let logits = match rows {
            None => self.prefill_main(tokens, start)?,
            Some((from, row)) => {
                self.rows_of(Target::Main, tokens, (start, from), row)?;
                Vec::new()
            }
        };
        self.pos = start + tokens.len();
        Ok(logits)
    }

    /// [`Backend::stream_prefill`], or with `rows` [`Backend::stream_prefill_rows`] (the
    /// result then empty).
    pub(super) fn stream_prefill_with(
        &mut self,
        slot: usize,
        start: usize,
        prompt: &[u32],
        rows: Option<(usize, &mut RowSink<'_>)>,
    ) -> Result<Vec<f32>> {
        let streams = self.max_streams();
        ensure!(
            streams > 0,
            "no multi-stream path: the GPU backend was built with 0 streams"
        );
        ensure!(slot < streams, "stream {slot} of {streams}");
        ensure!(
            start <= self.stream_pos[slot],
            "stream {slot} holds {} positions, cannot keep {start}",
            self.stream_pos[slot]
        );
        let vocab = self.plan.weights.cfg.vocab_size;
        nibble_backend::check_prompt(vocab, prompt, start, self.context_len())?;
        self.lone_idle("stream prefill")?;
        let b = self.batch.as_mut().expect("checked above");
        ensure!(
            b.queued_runs() == 0,
            "stream prefill with {} multi-stream runs queued: collect them first",
            b.queued_runs()
        );
        // A failure leaves the stream at `start` (rows past it are stale).
        self.stream_pos[slot] = start;
        let logits = match rows {
            None => self.prefill_stream(slot, prompt, start)?,
            Some((from, row)) => {
                self.rows_of(Target::Stream(slot as u32), prompt, (start, from), row)?;
                Vec::new()
            }
        };
        self.stream_pos[slot] = start + prompt.len();
        Ok(logits)
    }

    /// The rows from index `from` on of `tokens` (checked by the caller) at positions `start..`
    /// of `target`: the
    /// GEMM prefill's where it is on, whatever the prompt's length (the column prefill keeps
    /// only its last row), else token by token. Where the matrix-unit GEMMs gave a non-finite
    /// row, the plan is rebuilt on f32 fmas as in [`Self::run_gemm_prefill`] and the prompt
    /// redone, its rows handed again.
    fn rows_of(
        &mut self,
        target: Target,
        tokens: &[u32],
        (start, from): (usize, usize),
        row: &mut RowSink<'_>,
    ) -> Result<()> {
        if matches!(self.gemm_prefill, GemmPrefill::Off) {
            let mut pos = start;
            return nibble_backend::rows_by_steps(tokens, from, row, &mut |t| {
                let logits = match target {
                    Target::Main => self.prefill_main(&[t], pos),
                    Target::Stream(s) => self.prefill_stream(s as usize, &[t], pos),
                }?;
                pos += 1;
                Ok(logits)
            });
        }
        self.gemm_prefill()?;
        let GemmPrefill::Built(g, ..) = &self.gemm_prefill else {
            unreachable!("built above");
        };
        let finite = g.prefill_rows(&self.plan.weights, target, tokens, (start, from), row)?;
        if finite || !g.uses_matrix_units() {
            return Ok(());
        }
        self.prefill_on_fmas();
        self.gemm_prefill()?;
        let GemmPrefill::Built(g, ..) = &self.gemm_prefill else {
            unreachable!("built above");
        };
        g.prefill_rows(&self.plan.weights, target, tokens, (start, from), row)?;
        Ok(())
    }

    /// From now on the GEMM prefill runs on f32 fmas (rebuilt at its next use), with a warning:
    /// the matrix-unit GEMM gave non-finite values.
    fn prefill_on_fmas(&mut self) {
        let GemmPrefill::Built(_, shape, merge) = self.gemm_prefill else {
            return;
        };
        // Not `eprintln!`, which panics on a stderr that cannot be written.
        let _ = writeln!(
            std::io::stderr(),
            "warning: the matrix-unit prefill GEMM gave non-finite logits (GEMM inputs past \
             f16's range?); prefilling on f32 fmas from now on"
        );
        self.gemm_prefill = GemmPrefill::Pending {
            shape: PrefillShape {
                matrix_units: false,
                ..shape
            },
            merge,
        };
    }

    /// `tokens` (checked by the caller) at positions `start..` of the main sequence; the logits
    /// after the last one.
    pub(super) fn prefill_main(&mut self, tokens: &[u32], start: usize) -> Result<Vec<f32>> {
        Ok(if let [t] = tokens {
            // One token is a decode step (`Backend::step`: sampled generation): the
            // single-sequence step, its next one recorded while it runs (plan_logits.rs).
            self.plan.step_logits(*t, start)?
        } else if self.takes_gemm(tokens.len()) {
            self.run_gemm_prefill(Target::Main, tokens, start)?
        } else if let Some(b) = self.column_prefill()? {
            b.prefill_sequence(tokens, start)?
        } else {
            self.plan.prefill_logits(tokens, start)?
        })
    }

    /// `prompt` (checked by the caller, the multi-stream path built) into stream `slot` at
    /// positions `start..`; the logits after the last token.
    pub(super) fn prefill_stream(
        &mut self,
        slot: usize,
        prompt: &[u32],
        start: usize,
    ) -> Result<Vec<f32>> {
        if self.takes_gemm(prompt.len()) {
            return self.run_gemm_prefill(Target::Stream(slot as u32), prompt, start);
        }
        let b = self.batch.as_mut().expect("the caller checked the streams");
        b.prefill_slot(slot, prompt, start)
    }

    /// [`PrefillPlan::trace`] of `tokens` from position 0: the GEMM prefill's, where a prompt
    /// of that length takes it (`None` otherwise, or past one chunk).
    pub(super) fn trace_gemm_prefill(
        &mut self,
        tokens: &[u32],
    ) -> Result<Option<Vec<nibble_backend::PrefillLayerTrace>>> {
        self.lone_idle("a traced prefill")?;
        for t in tokens {
            self.check_token(*t)?;
        }
        ensure!(
            !tokens.is_empty() && tokens.len() <= self.context_len(),
            "a traced prefill of {} tokens (1..={})",
            tokens.len(),
            self.context_len()
        );
        if !self.takes_gemm(tokens.len()) {
            return Ok(None);
        }
        self.pos = 0;
        let g = self.gemm_prefill()?.expect("takes_gemm: not off");
        if tokens.len() > g.chunk() as usize {
            return Ok(None);
        }
        let layers = g.trace(tokens, 0)?;
        self.pos = tokens.len();
        Ok(Some(layers))
    }

    /// [`PrefillPlan::profile`] of `tokens` from position 0 (the GEMM prefill only; `None`
    /// without it).
    pub(super) fn profile_gemm_prefill(&mut self, tokens: &[u32]) -> Result<Option<Vec<OpTime>>> {
        self.lone_idle("a profiled prefill")?;
        for t in tokens {
            self.check_token(*t)?;
        }
        ensure!(
            tokens.len() <= self.context_len(),
            "prompt of {} tokens exceeds the context of {}",
            tokens.len(),
            self.context_len()
        );
        if matches!(self.gemm_prefill, GemmPrefill::Off) {
            return Ok(None);
        }
        // The profile writes rows from position 0 whatever the outcome.
        self.pos = 0;
        let g = self.gemm_prefill()?.expect("not off");
        let ops = g.profile(tokens, 0)?;
        self.pos = tokens.len();
        Ok(ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the GEMM prefill `new` would ask for matrix units.
    fn units_for(opts: &GpuOptions, form: QForm) -> bool {
        match GemmPrefill::new(opts, Combine::Fused, &[form]) {
            GemmPrefill::Pending { shape, .. } => shape.matrix_units,
            _ => panic!("the GEMM prefill is on by default"),
        }
    }

    fn units(opts: &GpuOptions, affine: bool) -> bool {
        units_for(opts, crate::testing::form(affine))
    }

    /// An affine (MLX) model's prefill asks for f32 fmas unless `prefill_coop_affine=1`; a
    /// Q4_0 model's asks for the matrix units unless `--prefill-f32-gemm`; a Q8_0 model's
    /// always for f32 fmas (the matrix units read nibbles only).
    #[test]
    fn affine_models_prefill_on_f32_fmas_by_default() {
        let mut opts = GpuOptions::default();
        assert!(!units_for(&opts, QForm::Q8_0));
        assert!(opts.prefill_matrix_units);
        assert!(units(&opts, false));
        assert!(!units(&opts, true));
        opts.tune.prefill_coop_affine = Some(1);
        assert!(units(&opts, true));
        opts.prefill_matrix_units = false;
        assert!(!units(&opts, true) && !units(&opts, false));
    }
}
