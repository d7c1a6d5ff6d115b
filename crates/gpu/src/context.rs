//! The wgpu device and the small helpers every kernel uses: buffers, upload, readback, shader
//! modules, pipelines, bind groups and "record, submit, wait".
//!
//! Invariants:
//! - One [`Context`] per device. It is cheap to clone (wgpu handles are reference counted); a
//!   clone shares the device, queue and error log.
//! - The device is requested with the adapter's own limits and with SUBGROUP / TIMESTAMP_QUERY /
//!   SHADER_F16 when present. No kernel may assume a subgroup size (8 on lavapipe, 32 on NVIDIA).
//! - [`Context::max_binding_bytes`] is the size every storage binding must fit in; tensors larger
//!   than it are split by rows by their owners. Tests lower it with
//!   [`Context::with_max_binding_bytes`] to exercise the split path on small tensors.
//! - wgpu reports validation errors asynchronously. Creation helpers capture them with error
//!   scopes; anything else lands in the shared error log, which [`Context::wait`] turns into an
//!   `Err`, so a bad dispatch is an error, never a silent wrong answer or a panic.

use std::sync::{Arc, Mutex};

/// Errors of the GPU tier.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no wgpu adapter found{0}")]
    NoAdapter(String),
    #[error("request_device failed: {0}")]
    RequestDevice(String),
    #[error("wgpu validation error in {what}: {msg}")]
    Validation { what: String, msg: String },
    #[error("buffer `{label}`: {bytes} bytes exceeds the device limit of {limit} bytes")]
    TooLarge {
        label: String,
        bytes: u64,
        limit: u64,
    },
    #[error("GPU wait failed: {0}")]
    Poll(String),
    #[error("buffer map failed: {0}")]
    Map(String),
    #[error("bad shape: {0}")]
    Shape(String),
    /// Weights whose values the kernels cannot take (a non-finite scale): the file's data is
    /// wrong, not its shapes.
    #[error("bad model data: {0}")]
    Data(String),
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// Which adapter to use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AdapterChoice {
    /// `NIBBLE_ADAPTER` (substring of the adapter name) if set, else a discrete GPU, else any.
    #[default]
    Auto,
    /// Prefer a CPU adapter (lavapipe): deterministic and available on every CI machine.
    PreferCpu,
    /// The first adapter whose name contains this (case-insensitive).
    Named(String),
}

/// The device, its queue and what it can do. See the module docs for the invariants.
#[derive(Clone)]
pub struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    max_binding: u64,
    /// Whether 16x16x16 f16 x f16 -> f32 cooperative-matrix products run here, with f16 shaders
    /// and subgroups of exactly 32 (kernels/gemm_coop.rs).
    coop16: bool,
    errors: Arc<Mutex<Vec<String>>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .field("max_binding", &self.max_binding)
            .finish()
    }
}

/// A bind group entry: a whole buffer or a byte range of one.
pub type Binding<'a> = wgpu::BindingResource<'a>;

impl Context {
    /// Pick an adapter and open a device on it.
    pub fn new(choice: &AdapterChoice) -> Result<Context> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        let by_name = |want: &str| {
            let want = want.to_lowercase();
            adapters
                .iter()
                .find(|a| a.get_info().name.to_lowercase().contains(&want))
        };
        let by_type = |t: wgpu::DeviceType| adapters.iter().find(|a| a.get_info().device_type == t);
        let adapter = match choice {
            AdapterChoice::Named(n) => by_name(n),
            AdapterChoice::PreferCpu => by_type(wgpu::DeviceType::Cpu).or(adapters.first()),
            AdapterChoice::Auto => match std::env::var("NIBBLE_ADAPTER") {
                Ok(n) => by_name(&n),
                Err(_) => by_type(wgpu::DeviceType::DiscreteGpu)
                    .or_else(|| by_type(wgpu::DeviceType::IntegratedGpu))
                    .or(adapters.first()),
            },
        }
        .ok_or_else(|| GpuError::NoAdapter(format!(" for {choice:?} among {names:?}")))?;
        Self::from_adapter(adapter)
    }

    /// Open a device on `adapter` with its full limits and the optional features we use.
    pub fn from_adapter(adapter: &wgpu::Adapter) -> Result<Context> {
        let info = adapter.get_info();
        let wanted = wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_F16
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
            | wgpu::Features::MEMORY_DECORATION_COHERENT;
        let coop16 = Self::offers_coop16(adapter, &info);
        let coop = if coop16 {
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        } else {
            wgpu::Features::empty()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("nibble"),
            required_features: adapter.features() & (wanted | coop),
            required_limits: adapter.limits(),
            memory_hints: wgpu::MemoryHints::Performance,
            experimental_features: if coop16 {
                // SAFETY: wgpu marks cooperative matrices experimental (its bugs may be UB). We
                // request them only where the adapter lists the exact product the one kernel
                // that uses them needs (gemm_coop.rs), which is tested against an f64 reference
                // on such devices; NIBBLE_NO_COOP=1 turns them off.
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            ..Default::default()
        }))
        .map_err(|e| GpuError::RequestDevice(e.to_string()))?;
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = errors.clone();
        // Without a handler wgpu panics on an uncaptured error; we log it and fail the next wait.
        device.on_uncaptured_error(Arc::new(move |e| {
            log.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(e.to_string());
        }));
        let limits = device.limits();
        let features = device.features();
        let max_binding = limits.max_storage_buffer_binding_size;
        Ok(Context {
            device,
            queue,
            info,
            limits,
            features,
            max_binding,
            coop16: coop16 && features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX),
            errors,
        })
    }

    /// Whether `adapter` offers what kernels/gemm_coop.rs needs: f16 shaders, subgroups of
    /// exactly 32, and subgroup-scope 16x16x16 products of f16 into f32. Off with
    /// `NIBBLE_NO_COOP=1`.
    fn offers_coop16(adapter: &wgpu::Adapter, info: &wgpu::AdapterInfo) -> bool {
        if std::env::var_os("NIBBLE_NO_COOP").is_some_and(|v| v == "1") {
            return false;
        }
        let f = adapter.features();
        let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
            | wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP;
        f.contains(need)
            && info.subgroup_min_size == 32
            && info.subgroup_max_size == 32
            && adapter.cooperative_matrix_properties().iter().any(|p| {
                p.m_size == 16
                    && p.n_size == 16
                    && p.k_size == 16
                    && p.ab_type == wgpu::CooperativeScalarType::F16
                    && p.cr_type == wgpu::CooperativeScalarType::F32
            })
    }

    /// Whether kernels/gemm_coop.rs can run on this device (see `offers_coop16`).
    pub fn coop_f16_16x16(&self) -> bool {
        self.coop16
    }

    /// Largest storage binding, in bytes (possibly lowered for tests).
    pub fn max_binding_bytes(&self) -> u64 {
        self.max_binding
    }

    /// A clone that splits tensors as if storage bindings were at most `bytes` (never raises it).
    pub fn with_max_binding_bytes(&self, bytes: u64) -> Context {
        let mut c = self.clone();
        c.max_binding = bytes.min(self.max_binding).max(4);
        c
    }

    /// Whether subgroup operations are available (their size is still unknown: use the builtin).
    pub fn has_subgroups(&self) -> bool {
        self.features.contains(wgpu::Features::SUBGROUP)
    }

    /// Whether one dispatch's workgroups may hand results to each other through memory (the
    /// last-arriver pattern of attention.wgsl's fused combine and moe_down_f32.wgsl's slot
    /// groups): Vulkan, whose device-scope barriers order memory across workgroups, with the
    /// `@coherent` decoration, without which the NVIDIA driver let a last arriver read a part
    /// that another workgroup had already written and published (H200, 2026-11-30).
    pub fn publishes_across_workgroups(&self) -> bool {
        self.info.backend == wgpu::Backend::Vulkan
            && self
                .features
                .contains(wgpu::Features::MEMORY_DECORATION_COHERENT)
    }

    /// `wgsl` with each `/*COHERENT*/` marker made the `@coherent` attribute where the device has
    /// it, and nothing elsewhere (kernels only read such buffers across workgroups where
    /// `publishes_across_workgroups` holds).
    fn expand(&self, wgsl: &str) -> String {
        let attr = if self
            .features
            .contains(wgpu::Features::MEMORY_DECORATION_COHERENT)
        {
            "@coherent "
        } else {
            ""
        };
        wgsl.replace("/*COHERENT*/", attr)
    }

    /// Whether this is a software (CPU) adapter such as lavapipe.
    pub fn is_cpu(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    fn check_size(&self, label: &str, bytes: u64, limit: u64) -> Result<()> {
        if bytes > limit {
            return Err(GpuError::TooLarge {
                label: label.to_string(),
                bytes,
                limit,
            });
        }
        Ok(())
    }

    /// A zero-filled storage buffer of at least `bytes` bytes (rounded up to 4, at least 4),
    /// also usable as a copy source/destination. Must fit one binding.
    pub fn storage(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).div_ceil(4) * 4;
        self.check_size(label, size, self.max_binding)?;
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer holding `data` (zero-padded to a multiple of 4 bytes).
    pub fn storage_init(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let buf = self.storage(label, data.len() as u64)?;
        self.write(&buf, 0, data);
        Ok(buf)
    }

    /// A uniform buffer holding `data` (a `#[repr(C)]` params struct, 16-byte multiple).
    pub fn uniform(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let size = (data.len() as u64).max(16).div_ceil(16) * 16;
        self.check_size(label, size, self.limits.max_uniform_buffer_binding_size)?;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.write(&buf, 0, data);
        Ok(buf)
    }

    /// Queue a write of `data` at `offset` (visible to every later submission). Unaligned tails
    /// are zero-padded to 4 bytes as wgpu requires.
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if data.len() % 4 == 0 {
            self.queue.write_buffer(buf, offset, data);
        } else {
            let mut padded = data.to_vec();
            padded.resize(data.len().div_ceil(4) * 4, 0);
            self.queue.write_buffer(buf, offset, &padded);
        }
    }

    /// Copy `bytes` bytes at `offset` of `buf` back to the host (waits for the GPU).
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        let size = bytes.div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: size.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, offset, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|e| GpuError::Map(e.to_string()))?
            .map_err(|e| GpuError::Map(e.to_string()))?;
        let mut out = staging
            .get_mapped_range(..)
            .map_err(|e| GpuError::Map(format!("{e:?}")))?
            .to_vec();
        staging.unmap();
        out.truncate(bytes as usize);
        Ok(out)
    }

    /// Read `n` f32 values from the start of `buf`.
    pub fn read_f32(&self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<f32>> {
        let b = self.read(buf, 0, n as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }

    /// Read `n` u32 values from the start of `buf`.
    pub fn read_u32(&self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<u32>> {
        let b = self.read(buf, 0, n as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }

    /// Block until all submitted work is done; fail if wgpu logged an error meanwhile.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Poll(e.to_string()))?;
        self.take_errors("submitted work")
    }

    /// Turn logged uncaptured errors into an `Err` (and clear the log).
    pub fn take_errors(&self, what: &str) -> Result<()> {
        let mut log = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if log.is_empty() {
            return Ok(());
        }
        let msg = log.join("; ");
        log.clear();
        Err(GpuError::Validation {
            what: what.to_string(),
            msg,
        })
    }

    /// Run `f` inside a validation error scope and return its error, if any, as `Err`.
    fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        match pollster::block_on(scope.pop()) {
            None => Ok(out),
            Some(e) => Err(GpuError::Validation {
                what: what.to_string(),
                msg: e.to_string(),
            }),
        }
    }

    /// Compile WGSL with runtime bounds checks (the default for every kernel).
    pub fn module(&self, label: &str, wgsl: &str) -> Result<wgpu::ShaderModule> {
        self.scoped(label, || {
            self.device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(label),
                    source: wgpu::ShaderSource::Wgsl(self.expand(wgsl).into()),
                })
        })
    }

    /// Compile WGSL WITHOUT naga's runtime checks (`ShaderRuntimeChecks::unchecked()`): no
    /// bounds checks (docs/BENCHMARKS.md runs 113-117: +11% decode, +62% prefill), and also no
    /// loop bounding and no integer-division checks.
    ///
    /// # Safety
    /// For every dispatch the caller records, by construction (shapes checked on the host when
    /// binding, values read from buffers clamped in the shader): every array index in `wgsl`
    /// must be in bounds, every integer divisor computed at run time non-zero (and no
    /// `i32::MIN / -1`), and every loop must terminate. Otherwise the behaviour on the device is
    /// undefined.
    pub unsafe fn module_unchecked(&self, label: &str, wgsl: &str) -> Result<wgpu::ShaderModule> {
        self.scoped(label, || {
            // SAFETY: forwarded to the caller by this function's contract.
            unsafe {
                self.device.create_shader_module_trusted(
                    wgpu::ShaderModuleDescriptor {
                        label: Some(label),
                        source: wgpu::ShaderSource::Wgsl(self.expand(wgsl).into()),
                    },
                    wgpu::ShaderRuntimeChecks::unchecked(),
                )
            }
        })
    }

    /// A compute pipeline for `entry` of `module`, with the layout derived from the shader.
    /// Workgroup memory is not zero-initialised: our kernels write before they read it.
    pub fn pipeline(
        &self,
        label: &str,
        module: &wgpu::ShaderModule,
        entry: &str,
    ) -> Result<wgpu::ComputePipeline> {
        self.scoped(label, || {
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(label),
                    layout: None,
                    module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &[],
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                })
        })
    }

    /// Compile `wgsl` and build the pipeline for `entry` in one go (checked module).
    pub fn compute(&self, label: &str, wgsl: &str, entry: &str) -> Result<wgpu::ComputePipeline> {
        let m = self.module(label, wgsl)?;
        self.pipeline(label, &m, entry)
    }

    /// [`Self::compute`] with the module compiled by [`Self::module_unchecked`].
    ///
    /// # Safety
    /// That of [`Self::module_unchecked`], for every dispatch of the returned pipeline.
    pub unsafe fn compute_unchecked(
        &self,
        label: &str,
        wgsl: &str,
        entry: &str,
    ) -> Result<wgpu::ComputePipeline> {
        // SAFETY: forwarded to the caller by this function's contract.
        let m = unsafe { self.module_unchecked(label, wgsl)? };
        self.pipeline(label, &m, entry)
    }

    /// A bind group for group 0 of `pipeline` with `resources[i]` at binding `i`.
    pub fn bind_group(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        resources: &[Binding<'_>],
    ) -> Result<wgpu::BindGroup> {
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry<'_>> = resources
            .iter()
            .enumerate()
            .map(|(i, r)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: r.clone(),
            })
            .collect();
        self.scoped(label, || {
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(label),
                layout: &layout,
                entries: &entries,
            })
        })
    }

    /// A bind group for group 0 of `pipeline` with `resources[k]` at binding `bindings[k]` (for
    /// entry points that use only some of a shader's bindings: derived layouts omit the rest).
    pub fn bind_group_at(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        bindings: &[u32],
        resources: &[Binding<'_>],
    ) -> Result<wgpu::BindGroup> {
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bindings
            .iter()
            .zip(resources)
            .map(|(i, r)| wgpu::BindGroupEntry {
                binding: *i,
                resource: r.clone(),
            })
            .collect();
        self.scoped(label, || {
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(label),
                layout: &layout,
                entries: &entries,
            })
        })
    }

    /// Record `f` into one compute pass, submit it and wait for the GPU.
    pub fn run_pass(&self, f: impl FnOnce(&mut wgpu::ComputePass<'_>)) -> Result<()> {
        let mut enc = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            f(&mut pass);
        }
        self.queue.submit([enc.finish()]);
        self.wait()
    }

    /// Submit one finished command buffer without waiting; the index lets the caller wait for
    /// exactly this submission later ([`Context::wait_for`]) while later ones keep running.
    pub fn submit(&self, enc: wgpu::CommandEncoder) -> wgpu::SubmissionIndex {
        self.queue.submit([enc.finish()])
    }

    /// A host-mappable buffer of `bytes` bytes (rounded up to 4) that copies land in for a
    /// later [`Context::map_read`].
    pub fn readback_buffer(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(4).div_ceil(4) * 4,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Block until submission `index` (and everything submitted before it) is done, but not
    /// for later submissions; fail if wgpu logged an error meanwhile.
    pub fn wait_for(&self, index: wgpu::SubmissionIndex) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| GpuError::Poll(e.to_string()))?;
        self.take_errors("submitted work")
    }

    /// Read the whole of `buf` (a [`Context::readback_buffer`] whose last writer is submission
    /// `index`): waits for that submission only, then maps and copies the bytes out.
    pub fn map_read(&self, buf: &wgpu::Buffer, index: wgpu::SubmissionIndex) -> Result<Vec<u8>> {
        self.map_read_with(buf, index, <[u8]>::to_vec)
    }

    /// [`Context::map_read`] that hands the mapped bytes to `f` instead of copying them out
    /// first: a per-token read of the logits (608 KB) then costs one copy, not two.
    pub fn map_read_with<T>(
        &self,
        buf: &wgpu::Buffer,
        index: wgpu::SubmissionIndex,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        buf.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        // The map callback runs inside this poll once `index` has completed.
        self.wait_for(index)?;
        rx.recv()
            .map_err(|e| GpuError::Map(e.to_string()))?
            .map_err(|e| GpuError::Map(e.to_string()))?;
        let out = f(&buf
            .get_mapped_range(..)
            .map_err(|e| GpuError::Map(format!("{e:?}")))?);
        buf.unmap();
        Ok(out)
    }

    /// Spread `groups` workgroups over x and y so that no dimension exceeds the device limit;
    /// kernels recover the linear id as `wid.x + wid.y * num_workgroups.x` and skip ids >= groups.
    pub fn grid(&self, groups: u32) -> (u32, u32) {
        let max = self.limits.max_compute_workgroups_per_dimension.max(1);
        let gy = groups.max(1).div_ceil(max);
        (groups.max(1).div_ceil(gy), gy)
    }
}

/// A timestamp query set of `count` marks and the buffer its marks resolve into: a pass writes
/// marks with `pass.write_timestamp(&t.set, i)`, [`Timestamps::finish`] submits and reads the
/// gaps back. Shared by the decode profile, the prefill profile and the timing diagnostics;
/// the caller checks the device's timestamp features first.
pub struct Timestamps {
    pub set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
}

impl Timestamps {
    pub fn new(ctx: &Context, label: &str, count: u32) -> Timestamps {
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some(label),
            ty: wgpu::QueryType::Timestamp,
            count,
        });
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: count as u64 * 8,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Timestamps { set, resolve }
    }

    /// Resolves marks `0..used` at the end of `enc`, submits it, waits, and returns the
    /// microseconds from each mark to the next (`used - 1` gaps; a clock that ran backwards
    /// gives a huge gap, which the callers check).
    pub fn finish(
        &self,
        ctx: &Context,
        mut enc: wgpu::CommandEncoder,
        used: u32,
    ) -> Result<Vec<f64>> {
        enc.resolve_query_set(&self.set, 0..used, &self.resolve, 0);
        ctx.queue.submit([enc.finish()]);
        ctx.wait()?;
        let ticks: Vec<u64> =
            bytemuck::pod_collect_to_vec(&ctx.read(&self.resolve, 0, used as u64 * 8)?);
        let period_ns = ctx.queue.get_timestamp_period() as f64;
        Ok(ticks
            .windows(2)
            .map(|w| w[1].wrapping_sub(w[0]) as f64 * period_ns / 1e3)
            .collect())
    }
}
