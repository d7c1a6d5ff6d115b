//! The device's plain read bandwidth, measured in the same process as a benchmark so the
//! benchmark's implied GB/s can be put against what this GPU, driver and clock state deliver
//! now (`nibble bench` prints both). A buffer of up to 1 GiB (capped by the binding limit) is
//! summed `reps` times back to back in one pass; wall-clock time from submit to completion.

use crate::context::{Context, Result};
use std::time::Instant;

/// Threads of the probe: enough to keep every memory channel busy on a big GPU, each reading
/// a strided run of the buffer.
const THREADS: u32 = 256 * 1024;

/// Bytes read per second (GB/s, 1e9) over `reps` sums of a buffer of `bytes` (rounded down to
/// whole 16-byte vectors, capped by the binding limit and 1 GiB). One warm-up pass first.
pub fn read_gbps(ctx: &Context, bytes: u64, reps: u32) -> Result<f64> {
    let bytes = bytes.min(1 << 30).min(ctx.max_binding_bytes()) / 16 * 16;
    let bytes = bytes.max(16);
    let src = ctx.storage("bandwidth.src", bytes)?;
    let n4 = (bytes / 16) as u32;
    let threads = THREADS.min(n4.div_ceil(256) * 256);
    let sums = ctx.storage("bandwidth.sums", threads as u64 * 4)?;
    let grid = ctx.grid(threads / 256);
    let p = ctx.uniform(
        "bandwidth.params",
        bytemuck::cast_slice(&[n4, grid.0, threads, 0]),
    )?;
    let pipe = ctx.compute(
        "read_bandwidth",
        include_str!("shaders/read_bandwidth.wgsl"),
        "main",
    )?;
    let bg = ctx.bind_group(
        "read_bandwidth",
        &pipe,
        &[
            src.as_entire_binding(),
            sums.as_entire_binding(),
            p.as_entire_binding(),
        ],
    )?;
    let run = |n: u32| {
        ctx.run_pass(|pass| {
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, &bg, &[]);
            for _ in 0..n {
                pass.dispatch_workgroups(grid.0, grid.1, 1);
            }
        })
    };
    run(1)?;
    let reps = reps.max(1);
    let t = Instant::now();
    run(reps)?;
    let secs = t.elapsed().as_secs_f64();
    Ok(bytes as f64 * reps as f64 / secs / 1e9)
}

#[cfg(test)]
mod tests {
    use crate::testing::gpu;

    #[test]
    fn read_bandwidth_is_positive_and_finite() {
        let Some(ctx) = gpu("read_bandwidth_is_positive_and_finite") else {
            return;
        };
        let g = super::read_gbps(&ctx, 8 << 20, 2).unwrap();
        // Any working device reads 8 MiB at more than 10 MB/s and less than 100 TB/s.
        assert!(g.is_finite() && g > 0.01 && g < 100_000.0, "{g} GB/s");
    }
}
