//! Inputs of the benchmark: random buffers and Q4_0 / f32 weights, per-layer copies made on the
//! GPU, and the two reference kernels (empty dispatch, plain read).
//!
//! Why copies: the real step reads 48 different matrices per role, so a call of one kernel finds
//! nothing of its weights in L2 (50 MB on an H200). Repeating one matrix M times would measure
//! L2 instead; rotating over `layers` copies at distinct addresses does not. Copies hold the
//! same random values (made once on the host, duplicated with GPU copies: fast setup).

use nibble_gpu::context::{Context, Result};
use nibble_gpu::tensor::{F32Matrix, F32Part, Q4Matrix, Q4Part};
use nibble_gpu::testing::{rand_f32, rand_q4_0};
use rand::Rng;

/// A storage buffer of `n` uniform f32 in `[lo, hi)`.
pub fn rand_buf(
    ctx: &Context,
    label: &str,
    rng: &mut impl Rng,
    n: usize,
    lo: f32,
    hi: f32,
) -> Result<wgpu::Buffer> {
    ctx.storage_init(label, bytemuck::cast_slice(&rand_f32(rng, n, lo, hi)))
}

/// `n - 1` GPU copies of `src`, after `src` itself (so `n` buffers in all).
pub fn copies(ctx: &Context, src: wgpu::Buffer, n: usize) -> Result<Vec<wgpu::Buffer>> {
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    let mut out = Vec::with_capacity(n);
    for _ in 1..n {
        let b = ctx.storage("bench.copy", src.size())?;
        enc.copy_buffer_to_buffer(&src, 0, &b, 0, src.size());
        out.push(b);
    }
    ctx.queue.submit([enc.finish()]);
    ctx.wait()?;
    out.insert(0, src);
    Ok(out)
}

/// `n` copies of one random Q4_0 matrix `[rows, cols]`, parts holding whole `row_multiple` groups.
pub fn q4_copies(
    ctx: &Context,
    rng: &mut impl Rng,
    (rows, cols, row_multiple): (usize, usize, usize),
    n: usize,
) -> Result<Vec<Q4Matrix>> {
    let bytes = rand_q4_0(rng, rows, cols);
    let m = Q4Matrix::upload(ctx, "bench.q4", rows, cols, row_multiple, &[&bytes])?;
    let mut per_part = Vec::new();
    for p in m.parts {
        let qs = copies(ctx, p.qs, n)?;
        let sc = copies(ctx, p.scales, n)?;
        per_part.push((
            p.row_start,
            p.rows,
            qs.into_iter().zip(sc).collect::<Vec<_>>(),
        ));
    }
    Ok((0..n)
        .map(|_| Q4Matrix {
            rows: m.rows,
            cols: m.cols,
            parts: per_part
                .iter_mut()
                .map(|(row_start, rows, bufs)| {
                    let (qs, scales) = bufs.remove(0);
                    Q4Part {
                        row_start: *row_start,
                        rows: *rows,
                        qs,
                        scales,
                        form: nibble_gpu::tensor::QForm::Q4_0,
                    }
                })
                .collect(),
        })
        .collect())
}

/// `n` copies of one random f32 matrix `[rows, cols]` with values in ±`amp`.
pub fn f32_copies(
    ctx: &Context,
    rng: &mut impl Rng,
    rows: usize,
    cols: usize,
    amp: f32,
    n: usize,
) -> Result<Vec<F32Matrix>> {
    let m = F32Matrix::upload(
        ctx,
        "bench.f32",
        rows,
        cols,
        &rand_f32(rng, rows * cols, -amp, amp),
    )?;
    let mut per_part = Vec::new();
    for p in m.parts {
        per_part.push((p.row_start, p.rows, copies(ctx, p.w, n)?));
    }
    Ok((0..n)
        .map(|_| F32Matrix {
            rows: m.rows,
            cols: m.cols,
            parts: per_part
                .iter_mut()
                .map(|(row_start, rows, ws)| F32Part {
                    row_start: *row_start,
                    rows: *rows,
                    w: ws.remove(0),
                })
                .collect(),
        })
        .collect())
}

/// A Q4 matrix shape with no parts: binding it records no dispatch. The MoE kernel records
/// gate/up and down together; binding one side with this isolates the other (see `cases.rs`).
pub fn no_parts(rows: u32, cols: u32) -> Q4Matrix {
    Q4Matrix {
        rows,
        cols,
        parts: Vec::new(),
    }
}

const EMPTY_WGSL: &str = "
@group(0) @binding(0) var<storage, read_write> c: array<u32>;
@compute @workgroup_size(1)
fn main() { c[0] = c[0] + 1u; }
";

const PROBE_WGSL: &str = "
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<uniform> u: vec4<u32>;
var<workgroup> sh: array<u32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    var v = li;
    for (var k = 0u; k < NBAR; k++) {
        sh[li] = v;
        workgroupBarrier();
        v = sh[(li + 1u) & 255u] + 1u;
        workgroupBarrier();
    }
    if (UNI) { v += u.x; }
    out[wid.x * 256u + li] = v;
}
";

const CHASE_WGSL: &str = "
@group(0) @binding(0) var<storage, read> next: array<u32>;
@group(0) @binding(1) var<storage, read_write> cur: array<u32>;
@compute @workgroup_size(1)
fn main() {
    var i = cur[0];
    for (var k = 0u; k < HOPS; k++) { i = next[i]; }
    cur[0] = i;
}
";

const READ_WGSL: &str = "
@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n = arrayLength(&src);
    let stride = nw.x * 256u;
    var acc = vec4<u32>(0u);
    var i = gid.x;
    // Four independent loads in flight per thread.
    for (; i + 3u * stride < n; i += 4u * stride) {
        acc += (src[i] + src[i + stride]) + (src[i + 2u * stride] + src[i + 3u * stride]);
    }
    for (; i < n; i += stride) { acc += src[i]; }
    dst[gid.x] = acc.x + acc.y + acc.z + acc.w;
}
";

/// A compiled reference kernel with its bind group and grid.
pub struct RefKernel {
    pipeline: wgpu::ComputePipeline,
    bg: wgpu::BindGroup,
    groups: u32,
    /// The empty kernel's counter / the read, chase kernels' source / the probe's output.
    pub buf: wgpu::Buffer,
}

impl RefKernel {
    /// Pipeline `main` of `wgsl`, its bind group over `bufs` (bindings 0, 1, ..) and the grid.
    fn build(
        ctx: &Context,
        label: &str,
        wgsl: &str,
        bufs: &[&wgpu::Buffer],
        groups: u32,
        buf: wgpu::Buffer,
    ) -> Result<RefKernel> {
        let pipeline = ctx.compute(label, wgsl, "main")?;
        let entries: Vec<_> = bufs.iter().map(|b| b.as_entire_binding()).collect();
        let bg = ctx.bind_group(label, &pipeline, &entries)?;
        Ok(RefKernel {
            pipeline,
            bg,
            groups,
            buf,
        })
    }

    /// A dependent chain of one-thread dispatches, each incrementing `buf[0]`.
    pub fn empty(ctx: &Context) -> Result<RefKernel> {
        let buf = ctx.storage("bench.counter", 4)?;
        Self::build(ctx, "bench.empty", EMPTY_WGSL, &[&buf], 1, buf.clone())
    }

    /// Sum of a random buffer of `bytes` (a multiple of 16 MiB): the achievable read bandwidth.
    pub fn read(ctx: &Context, rng: &mut impl Rng, bytes: u64) -> Result<RefKernel> {
        const CHUNK: u64 = 16 << 20;
        let chunk: Vec<u32> = (0..CHUNK / 4).map(|_| rng.random()).collect();
        let chunk = ctx.storage_init("bench.read.chunk", bytemuck::cast_slice(&chunk))?;
        let buf = ctx.storage("bench.read", bytes)?;
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        for k in 0..bytes / CHUNK {
            enc.copy_buffer_to_buffer(&chunk, 0, &buf, k * CHUNK, CHUNK);
        }
        ctx.queue.submit([enc.finish()]);
        ctx.wait()?;
        // ~64 vec4 loads per thread, 256 threads per workgroup.
        let groups = (bytes / 16 / (256 * 64))
            .clamp(1, ctx.limits.max_compute_workgroups_per_dimension as u64)
            as u32;
        let dst = ctx.storage("bench.read.dst", groups as u64 * 256 * 4)?;
        Self::build(
            ctx,
            "bench.read",
            READ_WGSL,
            &[&buf, &dst],
            groups,
            buf.clone(),
        )
    }

    /// One thread following `hops` dependent loads through a random cycle over `entries` slots
    /// `stride` u32 apart (Sattolo's shuffle: one cycle through every slot), continuing where
    /// the previous call stopped: each hop costs one memory latency, from L2 for a cycle that
    /// fits in it, from DRAM for one far larger than it.
    pub fn chase(
        ctx: &Context,
        rng: &mut impl Rng,
        entries: usize,
        stride: usize,
        hops: u32,
    ) -> Result<RefKernel> {
        let mut order: Vec<u32> = (0..entries as u32).collect();
        for i in (1..entries).rev() {
            order.swap(i, rng.random_range(0..i));
        }
        let mut next = vec![0u32; entries * stride];
        for (i, &slot) in order.iter().enumerate() {
            let to = order[(i + 1) % entries];
            next[slot as usize * stride] = to * stride as u32;
        }
        let src = ctx.storage_init("bench.chase", bytemuck::cast_slice(&next))?;
        let cur = ctx.storage("bench.chase.cur", 4)?;
        let wgsl = CHASE_WGSL.replace("HOPS", &format!("{hops}u"));
        Self::build(ctx, "bench.chase", &wgsl, &[&src, &cur], 1, src.clone())
    }

    /// `groups` workgroups of 256 threads that each store one word, after `barriers` rounds of
    /// (shared store, barrier, neighbour's shared load, barrier) and, with `uniform`, adding a
    /// uniform-buffer word: the fixed costs every kernel's chain is made of.
    pub fn probe(ctx: &Context, groups: u32, barriers: u32, uniform: bool) -> Result<RefKernel> {
        let wgsl = PROBE_WGSL
            .replace("NBAR", &format!("{barriers}u"))
            .replace("UNI", if uniform { "true" } else { "false" });
        let buf = ctx.storage("bench.probe.out", groups as u64 * 256 * 4)?;
        let u = ctx.uniform("bench.probe.u", bytemuck::bytes_of(&[1u32, 0, 0, 0]))?;
        Self::build(ctx, "bench.probe", &wgsl, &[&buf, &u], groups, buf.clone())
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bg, &[]);
        pass.dispatch_workgroups(self.groups, 1, 1);
    }
}
