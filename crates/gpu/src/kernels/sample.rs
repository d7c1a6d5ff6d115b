//! Sampling the next token on the GPU (shaders/sample.wgsl), so a sampled request folds into
//! runs like a greedy one: the host sampler's top-k rule (penalties, top-k <= 256, softmax at
//! the temperature, top-p, min-p, one uniform draw per step walking the kept candidates in
//! value order) with the host's draws uploaded once per request. Four dispatches per step
//! (`hist`, `scan`, `collect`, `finish`), the last of which advances the run state exactly as
//! the argmax's `finish` does, sharing its run-length and EOS buffers.
//!
//! Buffers of a binding: `req [V + cap]` u32 (per-id penalty counts, then the uniforms as f32
//! bits, one per step), `vals [V]` f32 (the penalised row), `work [2048 + 8]` u32 (the first
//! pass's histogram and the selection's scalars), `list [V]` u32 (the candidate ids).

use crate::context::{Context, GpuError, Result};
use crate::state::with_state;
use nibble_backend::{DeviceSampling, DEVICE_TOP_K_MAX};

/// Logits one `hist` / `collect` workgroup covers (`CHUNK` in sample.wgsl).
const CHUNK: u32 = 256 * 4;
/// Words of `work`: the histogram (`HB`) and the `SEL_*` scalars.
const WORK_WORDS: u64 = 2048 + 8;

pub struct SampleKernel {
    hist: wgpu::ComputePipeline,
    scan: wgpu::ComputePipeline,
    collect: wgpu::ComputePipeline,
    finish: wgpu::ComputePipeline,
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
    p0: u32,
    p1: u32,
}

pub struct SampleBinding {
    hist: wgpu::BindGroup,
    scan: wgpu::BindGroup,
    collect: wgpu::BindGroup,
    finish: wgpu::BindGroup,
    groups: u32,
    n: u32,
    cap: u32,
    params: wgpu::Buffer,
    req: wgpu::Buffer,
}

impl SampleKernel {
    pub fn new(ctx: &Context) -> Result<SampleKernel> {
        let m = ctx.module(
            "sample",
            &with_state(include_str!("../shaders/sample.wgsl")),
        )?;
        Ok(SampleKernel {
            hist: ctx.pipeline("sample.hist", &m, "hist")?,
            scan: ctx.pipeline("sample.scan", &m, "scan")?,
            collect: ctx.pipeline("sample.collect", &m, "collect")?,
            finish: ctx.pipeline("sample.finish", &m, "finish")?,
        })
    }

    pub fn bind(&self, ctx: &Context, a: &SampleArgs<'_>) -> Result<SampleBinding> {
        let n = a.n as u64;
        if a.n == 0 || a.logits.size() < n * 4 || a.out_tokens.size() < a.cap as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "sample: n = {}, cap = {}: logits or out_tokens too small",
                a.n, a.cap
            )));
        }
        let groups = a.n.div_ceil(CHUNK);
        if groups > ctx.limits.max_compute_workgroups_per_dimension {
            return Err(GpuError::Shape(format!(
                "sample: {} logits is too many",
                a.n
            )));
        }
        let req = ctx.storage("sample.req", (n + a.cap as u64) * 4)?;
        let vals = ctx.storage("sample.vals", n * 4)?;
        let work = ctx.storage("sample.work", WORK_WORDS * 4)?;
        let list = ctx.storage("sample.list", n * 4)?;
        let params = ctx.uniform("sample.params", &[0u8; std::mem::size_of::<SParams>()])?;
        let all = [
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
        // Derived layouts hold only the bindings an entry point uses.
        let group = |label: &str, p: &wgpu::ComputePipeline, ix: &[u32]| {
            let res: Vec<_> = ix.iter().map(|i| all[*i as usize].clone()).collect();
            ctx.bind_group_at(label, p, ix, &res)
        };
        Ok(SampleBinding {
            hist: group("sample.hist", &self.hist, &[0, 1, 2, 3, 5, 8])?,
            scan: group("sample.scan", &self.scan, &[3, 5, 8])?,
            collect: group("sample.collect", &self.collect, &[2, 3, 4, 5, 8])?,
            finish: group("sample.finish", &self.finish, &[1, 2, 3, 4, 5, 6, 7, 8, 9])?,
            groups,
            n: a.n,
            cap: a.cap,
            params,
            req,
        })
    }

    /// Record one step's sampling (4 dispatches).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &SampleBinding) {
        for (p, g, x) in [
            (&self.hist, &b.hist, b.groups),
            (&self.scan, &b.scan, 1),
            (&self.collect, &b.collect, b.groups),
            (&self.finish, &b.finish, 1),
        ] {
            pass.set_pipeline(p);
            pass.set_bind_group(0, g, &[]);
            pass.dispatch_workgroups(x, 1, 1);
        }
    }
}

impl SampleBinding {
    /// Dispatches [`SampleKernel::record`] issues per step.
    pub fn dispatch_count(&self) -> usize {
        4
    }

    /// Write a request's settings, penalty counts and `steps` uniforms (the host's draws,
    /// rounded to f32). Errors when the settings are outside [`DeviceSampling::in_device_range`],
    /// `steps` exceeds the binding's capacity or too few draws are given.
    pub fn set_request(&self, ctx: &Context, s: &DeviceSampling<'_>, steps: usize) -> Result<()> {
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
        let penalties = s.has_penalties();
        let p = SParams {
            n: self.n,
            k: if greedy { 1 } else { s.top_k as u32 },
            greedy: greedy as u32,
            penalties: penalties as u32,
            temperature: s.temperature,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition: s.repetition_penalty,
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            p0: 0,
            p1: 0,
        };
        ctx.write(&self.params, 0, bytemuck::bytes_of(&p));
        if penalties {
            let mut counts = vec![0u32; self.n as usize];
            for &id in s.history {
                if let Some(c) = counts.get_mut(id as usize) {
                    *c += 1;
                }
            }
            ctx.write(&self.req, 0, bytemuck::cast_slice(&counts));
        }
        if !greedy && steps > 0 {
            let u: Vec<f32> = s.uniforms[..steps].iter().map(|&u| u as f32).collect();
            ctx.write(&self.req, self.n as u64 * 4, bytemuck::cast_slice(&u));
        }
        Ok(())
    }
}
