//! Sampling the next token on the GPU (shaders/sample.wgsl), so a sampled request folds into
//! runs like a greedy one: the host sampler's top-k rule (penalties, top-k <= 256, softmax at
//! the temperature, top-p, min-p, one uniform draw per step walking the kept candidates in
//! value order) with the host's draws uploaded once per request. Four dispatches per step
//! (`hist`, `scan`, `collect`, `finish`), the last of which advances the run state exactly as
//! the argmax's `finish` does, sharing its run-length and EOS buffers.
//!
//! Buffers of a binding, one slice per column (B = 1 for the single token): `req [B, V + cap]`
//! u32 (per-id penalty counts, then the uniforms as f32 bits, one per step), `vals [B, V]` f32
//! (the penalised row), `work [B, 2048 + 8]` u32 (the first pass's histogram and the
//! selection's scalars), `list [B, V]` u32 (the candidate ids), `params [B]` (the settings).
//!
//! Column form ([`SampleKernel::bind_cols`], multi-stream runs): every live column of the
//! [`crate::columns`] buffer samples by its own settings (a greedy column as k = 1 with no
//! draw: the top-1 of the order, which is the argmax on finite rows), `finish_cols` advances
//! each column as the argmax's column form does, and a fifth dispatch sets the run's `done`.

use crate::columns::COLUMNS_WGSL;
use crate::context::{Context, GpuError, Result};
use crate::kernels::embed::check_cols;
use crate::state::with_state;
use nibble_backend::{DeviceSampling, DEVICE_TOP_K_MAX};

/// Logits one `hist` / `collect` workgroup covers (`CHUNK` in sample.wgsl).
const CHUNK: u32 = 256 * 4;
/// Words of `work`: the histogram (`HB`) and the `SEL_*` scalars.
const WORK_WORDS: u64 = 2048 + 8;

/// The four pipelines of one form (single token, or columns with `done` as a fifth).
struct Passes {
    hist: wgpu::ComputePipeline,
    scan: wgpu::ComputePipeline,
    collect: wgpu::ComputePipeline,
    finish: wgpu::ComputePipeline,
}

pub struct SampleKernel {
    single: Passes,
    cols: Passes,
    done: wgpu::ComputePipeline,
}

/// What one column sampling binding reads and writes.
pub struct SampleColsArgs<'a> {
    /// `[nb, n]` f32 logits, column `c` at `c * n`.
    pub logits: &'a wgpu::Buffer,
    pub n: u32,
    /// Columns, `1..=MAX_COLUMNS`.
    pub nb: u32,
    /// Steps one request of a column can take (uniforms held per column).
    pub cap: u32,
    /// The [`crate::columns`] buffer (read-write) and the run state (its `done`).
    pub cols: &'a wgpu::Buffer,
    pub state: &'a wgpu::Buffer,
    /// `[nb, out_cap]` u32, `out_cap` from the argmax's column params.
    pub out_tokens: &'a wgpu::Buffer,
    /// The column argmax binding's run parameters and EOS ids.
    pub run_params: &'a wgpu::Buffer,
    pub eos: &'a wgpu::Buffer,
}

/// What one sampling binding reads and writes.
pub struct SampleArgs<'a> {
    /// `[n]` f32 logits.
    pub logits: &'a wgpu::Buffer,
    /// The vocabulary.
    pub n: u32,
    /// Steps one request can take (uniforms held).
    pub cap: u32,
    /// The run state (read-write).
    pub state: &'a wgpu::Buffer,
    /// `[cap]` u32: the id of step `s` lands in `out_tokens[s]`.
    pub out_tokens: &'a wgpu::Buffer,
    /// The argmax binding's run parameters and EOS ids
    /// ([`crate::kernels::argmax::ArgmaxBinding::run_buffers`]).
    pub run_params: &'a wgpu::Buffer,
    pub eos: &'a wgpu::Buffer,
}

/// What both forms bind (`cols`: the column form's [`crate::columns`] buffer).
struct Common<'a> {
    logits: &'a wgpu::Buffer,
    n: u32,
    nb: u32,
    cap: u32,
    state: &'a wgpu::Buffer,
    out_tokens: &'a wgpu::Buffer,
    run_params: &'a wgpu::Buffer,
    eos: &'a wgpu::Buffer,
    cols: Option<&'a wgpu::Buffer>,
}

/// Mirror of `SParams` in sample.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SParams {
    n: u32,
    k: u32,
    greedy: u32,
    penalties: u32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    repetition: f32,
    presence: f32,
    frequency: f32,
    ucap: u32,
    p1: u32,
}

impl SParams {
    /// The settings of `s` for a row of `n` ids (`None`: greedy, k = 1, no penalties).
    fn of(s: Option<&DeviceSampling<'_>>, n: u32, ucap: u32) -> SParams {
        let greedy = s.is_none_or(|s| s.temperature <= 0.0);
        let d = DeviceSampling {
            temperature: 0.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: &[],
            history: &[],
            uniforms: &[],
        };
        let s = s.unwrap_or(&d);
        SParams {
            n,
            k: if greedy { 1 } else { s.top_k as u32 },
            greedy: greedy as u32,
            penalties: s.has_penalties() as u32,
            temperature: s.temperature,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition: s.repetition_penalty,
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            ucap,
            p1: 0,
        }
    }
}

pub struct SampleBinding {
    hist: wgpu::BindGroup,
    scan: wgpu::BindGroup,
    collect: wgpu::BindGroup,
    finish: wgpu::BindGroup,
    /// The column form's `done_cols` (None: the single-token form).
    done: Option<wgpu::BindGroup>,
    groups: u32,
    n: u32,
    /// Columns (1 for the single-token form).
    nb: u32,
    cap: u32,
    params: wgpu::Buffer,
    req: wgpu::Buffer,
}

impl SampleKernel {
    pub fn new(ctx: &Context) -> Result<SampleKernel> {
        let src = with_state(&format!(
            "{COLUMNS_WGSL}\n{}",
            include_str!("../shaders/sample.wgsl")
        ));
        let m = ctx.module("sample", &src)?;
        let passes = |sfx: &str| -> Result<Passes> {
            let p = |e: &str| ctx.pipeline(&format!("sample.{e}{sfx}"), &m, &format!("{e}{sfx}"));
            Ok(Passes {
                hist: p("hist")?,
                scan: p("scan")?,
                collect: p("collect")?,
                finish: p("finish")?,
            })
        };
        Ok(SampleKernel {
            single: passes("")?,
            cols: passes("_cols")?,
            done: ctx.pipeline("sample.done_cols", &m, "done_cols")?,
        })
    }

    /// The scratch buffers of `nb` columns of `n` ids with `cap` uniforms each.
    fn scratch(ctx: &Context, n: u32, nb: u32, cap: u32) -> Result<[wgpu::Buffer; 5]> {
        let (n, nb) = (n as u64, nb as u64);
        Ok([
            ctx.storage("sample.req", nb * (n + cap as u64) * 4)?,
            ctx.storage("sample.vals", nb * n * 4)?,
            ctx.storage("sample.work", nb * WORK_WORDS * 4)?,
            ctx.storage("sample.list", nb * n * 4)?,
            ctx.storage("sample.params", nb * std::mem::size_of::<SParams>() as u64)?,
        ])
    }

    fn check(ctx: &Context, n: u32, logits: &wgpu::Buffer, nb: u32) -> Result<u32> {
        if n == 0 || logits.size() < nb as u64 * n as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "sample: n = {n}, {nb} columns: logits too small"
            )));
        }
        let groups = n.div_ceil(CHUNK);
        if groups > ctx.limits.max_compute_workgroups_per_dimension {
            return Err(GpuError::Shape(format!("sample: {n} logits is too many")));
        }
        Ok(groups)
    }

    pub fn bind(&self, ctx: &Context, a: &SampleArgs<'_>) -> Result<SampleBinding> {
        if a.out_tokens.size() < a.cap as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "sample: out_tokens holds fewer than {} ids",
                a.cap
            )));
        }
        self.bind_common(
            ctx,
            &Common {
                logits: a.logits,
                n: a.n,
                nb: 1,
                cap: a.cap,
                state: a.state,
                out_tokens: a.out_tokens,
                run_params: a.run_params,
                eos: a.eos,
                cols: None,
            },
        )
    }

    /// Column form: see the module docs.
    pub fn bind_cols(&self, ctx: &Context, a: &SampleColsArgs<'_>) -> Result<SampleBinding> {
        check_cols(a.cols, a.nb, "sample")?;
        self.bind_common(
            ctx,
            &Common {
                logits: a.logits,
                n: a.n,
                nb: a.nb,
                cap: a.cap,
                state: a.state,
                out_tokens: a.out_tokens,
                run_params: a.run_params,
                eos: a.eos,
                cols: Some(a.cols),
            },
        )
    }

    fn bind_common(&self, ctx: &Context, a: &Common<'_>) -> Result<SampleBinding> {
        let groups = Self::check(ctx, a.n, a.logits, a.nb)?;
        let [req, vals, work, list, params] = Self::scratch(ctx, a.n, a.nb, a.cap)?;
        let mut all = vec![
            a.logits.as_entire_binding(),
            req.as_entire_binding(),
            vals.as_entire_binding(),
            work.as_entire_binding(),
            list.as_entire_binding(),
            a.state.as_entire_binding(),
            a.out_tokens.as_entire_binding(),
            a.eos.as_entire_binding(),
            params.as_entire_binding(),
            a.run_params.as_entire_binding(),
        ];
        if let Some(c) = a.cols {
            all.push(c.as_entire_binding());
        }
        // Derived layouts hold only the bindings an entry point uses.
        let group = |label: &str, p: &wgpu::ComputePipeline, ix: &[u32]| {
            let res: Vec<_> = ix.iter().map(|i| all[*i as usize].clone()).collect();
            ctx.bind_group_at(label, p, ix, &res)
        };
        let (hist, scan, collect, finish, done) = match a.cols {
            None => {
                let k = &self.single;
                (
                    group("sample.hist", &k.hist, &[0, 1, 2, 3, 5, 8])?,
                    group("sample.scan", &k.scan, &[3, 5, 8])?,
                    group("sample.collect", &k.collect, &[2, 3, 4, 5, 8])?,
                    group("sample.finish", &k.finish, &[1, 2, 3, 4, 5, 6, 7, 8, 9])?,
                    None,
                )
            }
            Some(_) => {
                let k = &self.cols;
                (
                    group("sample.hist_cols", &k.hist, &[0, 1, 2, 3, 8, 9, 10])?,
                    group("sample.scan_cols", &k.scan, &[3, 8, 9, 10])?,
                    group("sample.collect_cols", &k.collect, &[2, 3, 4, 8, 9, 10])?,
                    group(
                        "sample.finish_cols",
                        &k.finish,
                        &[1, 2, 3, 4, 6, 7, 8, 9, 10],
                    )?,
                    Some(group("sample.done_cols", &self.done, &[5, 9, 10])?),
                )
            }
        };
        Ok(SampleBinding {
            hist,
            scan,
            collect,
            finish,
            done,
            groups,
            n: a.n,
            nb: a.nb,
            cap: a.cap,
            params,
            req,
        })
    }

    /// Record one step's sampling (4 dispatches; 5 for columns).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &SampleBinding) {
        let k = if b.done.is_some() {
            &self.cols
        } else {
            &self.single
        };
        for (p, g, x, y) in [
            (&k.hist, &b.hist, b.groups, b.nb),
            (&k.scan, &b.scan, 1, b.nb),
            (&k.collect, &b.collect, b.groups, b.nb),
            (&k.finish, &b.finish, 1, b.nb),
        ] {
            pass.set_pipeline(p);
            pass.set_bind_group(0, g, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
        if let Some(d) = &b.done {
            pass.set_pipeline(&self.done);
            pass.set_bind_group(0, d, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
    }
}

impl SampleBinding {
    /// Dispatches [`SampleKernel::record`] issues per step.
    pub fn dispatch_count(&self) -> usize {
        4 + self.done.is_some() as usize
    }

    /// Write a request's settings, penalty counts and `steps` uniforms (the host's draws,
    /// rounded to f32). Errors when the settings are outside [`DeviceSampling::in_device_range`],
    /// `steps` exceeds the binding's capacity or too few draws are given.
    pub fn set_request(&self, ctx: &Context, s: &DeviceSampling<'_>, steps: usize) -> Result<()> {
        self.set_requests(ctx, &[Some((s, steps))])
    }

    /// [`SampleBinding::set_request`] per column: `specs[c]` (settings, steps) for column `c`
    /// (`None`, and columns past `specs`: greedy).
    pub fn set_requests(
        &self,
        ctx: &Context,
        specs: &[Option<(&DeviceSampling<'_>, usize)>],
    ) -> Result<()> {
        if specs.len() > self.nb as usize {
            return Err(GpuError::Shape(format!(
                "device sampling: {} columns of {}",
                specs.len(),
                self.nb
            )));
        }
        let stride = (self.n + self.cap) as u64 * 4;
        let mut params = Vec::with_capacity(self.nb as usize);
        for c in 0..self.nb as usize {
            let spec = specs.get(c).copied().flatten();
            if let Some((s, steps)) = spec {
                let greedy = s.temperature <= 0.0;
                if !s.in_device_range() {
                    return Err(GpuError::Shape(format!(
                        "device sampling: settings out of range (top_k {} must be 1..={DEVICE_TOP_K_MAX})",
                        s.top_k
                    )));
                }
                if steps > self.cap as usize || (!greedy && s.uniforms.len() < steps) {
                    return Err(GpuError::Shape(format!(
                        "device sampling: {steps} steps with {} draws (capacity {})",
                        s.uniforms.len(),
                        self.cap
                    )));
                }
                if s.has_penalties() {
                    let mut counts = vec![0u32; self.n as usize];
                    for &id in s.history {
                        if let Some(c) = counts.get_mut(id as usize) {
                            *c += 1;
                        }
                    }
                    ctx.write(&self.req, c as u64 * stride, bytemuck::cast_slice(&counts));
                }
                if !greedy && steps > 0 {
                    let u: Vec<f32> = s.uniforms[..steps].iter().map(|&u| u as f32).collect();
                    let at = c as u64 * stride + self.n as u64 * 4;
                    ctx.write(&self.req, at, bytemuck::cast_slice(&u));
                }
            }
            params.push(SParams::of(spec.map(|x| x.0), self.n, self.cap));
        }
        ctx.write(&self.params, 0, bytemuck::cast_slice(&params));
        Ok(())
    }
}
