//! Timing of one recorded call repeated `m` times back to back in ONE compute pass, and the
//! report (table sorted by time per token, or JSON).
//!
//! Every rep: `reset` (queued buffer writes, e.g. the run state), record `m` calls, submit, wait.
//! GPU time comes from timestamps written at the pass boundaries (TIMESTAMP_QUERY); wall time is
//! submit-to-idle minus the median round trip of an empty pass, so the ~45 us submit+wait cost
//! is not spread over the calls. The first rep is a warm-up; the median of the rest is reported.

use nibble_gpu::context::{Context, GpuError, Result};
use std::time::Instant;

/// Per-call times in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// From pass-boundary timestamps (`None` without TIMESTAMP_QUERY).
    pub gpu_us: Option<f64>,
    /// Submit-to-idle wall time minus the empty-pass round trip.
    pub wall_us: f64,
    /// Host time to record (and finish) the command buffer.
    pub cpu_us: f64,
}

impl Measured {
    /// The best estimate of device time: timestamps when available.
    pub fn us(&self) -> f64 {
        self.gpu_us.unwrap_or(self.wall_us)
    }
}

/// Times recorded closures; see the module docs.
pub struct Timer {
    ctx: Context,
    pub reps: usize,
    /// `(query set of 2, resolve buffer [2] u64, ns per tick)`.
    query: Option<(wgpu::QuerySet, wgpu::Buffer, f64)>,
    roundtrip_us: f64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Timer {
    pub fn new(ctx: &Context, reps: usize) -> Result<Timer> {
        let query = ctx
            .features
            .contains(wgpu::Features::TIMESTAMP_QUERY)
            .then(|| {
                let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("bench.ts"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                });
                let buf = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("bench.ts.resolve"),
                    size: 16,
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                });
                (set, buf, ctx.queue.get_timestamp_period() as f64)
            });
        let mut t = Timer {
            ctx: ctx.clone(),
            reps: reps.max(1),
            query,
            roundtrip_us: 0.0,
        };
        t.roundtrip_us = t.time(1, &|| {}, &|_, _| {})?.wall_us;
        Ok(t)
    }

    pub fn has_timestamps(&self) -> bool {
        self.query.is_some()
    }

    pub fn roundtrip_us(&self) -> f64 {
        self.roundtrip_us
    }

    /// Median per-call times of `record(pass, i)` for `i in 0..m`, all in one pass.
    pub fn time(
        &self,
        m: usize,
        reset: &dyn Fn(),
        record: &dyn Fn(&mut wgpu::ComputePass<'_>, usize),
    ) -> Result<Measured> {
        let (mut gpu, mut wall, mut cpu) = (vec![], vec![], vec![]);
        for rep in 0..=self.reps {
            reset();
            let tc = Instant::now();
            let mut enc = self.ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("bench"),
                    timestamp_writes: self.query.as_ref().map(|(set, _, _)| {
                        wgpu::ComputePassTimestampWrites {
                            query_set: set,
                            beginning_of_pass_write_index: Some(0),
                            end_of_pass_write_index: Some(1),
                        }
                    }),
                });
                for i in 0..m {
                    record(&mut pass, i);
                }
            }
            if let Some((set, buf, _)) = &self.query {
                enc.resolve_query_set(set, 0..2, buf, 0);
            }
            let cb = enc.finish();
            let t0 = Instant::now();
            let rec = t0.duration_since(tc).as_secs_f64() * 1e6;
            self.ctx.queue.submit([cb]);
            self.ctx.wait()?;
            let w = t0.elapsed().as_secs_f64() * 1e6;
            let g = match &self.query {
                Some((_, buf, period)) => {
                    let t: Vec<u64> = bytemuck::pod_collect_to_vec(&self.ctx.read(buf, 0, 16)?);
                    Some(t[1].wrapping_sub(t[0]) as f64 * period / 1e3)
                }
                None => None,
            };
            if rep > 0 {
                gpu.extend(g);
                wall.push(w);
                cpu.push(rec);
            }
        }
        let n = m.max(1) as f64;
        let gpu_us = (!gpu.is_empty()).then(|| median(&mut gpu) / n);
        if gpu_us.is_some_and(|g| !g.is_finite() || g < 0.0) {
            return Err(GpuError::Poll("timestamps went backwards".into()));
        }
        Ok(Measured {
            gpu_us,
            wall_us: ((median(&mut wall) - self.roundtrip_us) / n).max(0.0),
            cpu_us: median(&mut cpu) / n,
        })
    }
}

/// One measured line of the report.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    /// Dispatches one call records.
    pub disp: usize,
    /// Calls per decoded token in the plan's role (0: reference line, not in the plan).
    pub per_token: usize,
    /// Excluded from the per-token total (another position / numerics / a cross-check).
    pub alt: bool,
    /// Bytes read + written by one call (weights, activations, caches).
    pub bytes: u64,
    pub m: Measured,
}

impl Row {
    pub fn us_token(&self) -> f64 {
        self.m.us() * self.per_token as f64
    }
    pub fn gbps(&self) -> f64 {
        if self.m.us() > 0.0 {
            self.bytes as f64 / self.m.us() / 1e3
        } else {
            0.0
        }
    }
}

/// The table, sorted by time per token (largest first), then a total over the plan rows.
pub fn table(rows: &[Row], header: &str) -> String {
    let mut sorted: Vec<&Row> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        b.us_token()
            .total_cmp(&a.us_token())
            .then(b.m.us().total_cmp(&a.m.us()))
    });
    let total: f64 = rows.iter().filter(|r| !r.alt).map(Row::us_token).sum();
    let mut s = format!("{header}\n");
    s += &format!(
        "{:<48} {:>4} {:>5} {:>10} {:>10} {:>8} {:>10} {:>8} {:>10} {:>6}\n",
        "kernel (* = not in total)",
        "disp",
        "/tok",
        "gpu us",
        "wall us",
        "cpu us",
        "MB",
        "GB/s",
        "us/token",
        "%tok"
    );
    for r in sorted {
        let gpu = r.m.gpu_us.map_or("-".into(), |g| format!("{g:.2}"));
        let pct = if r.alt || total == 0.0 {
            String::new()
        } else {
            format!("{:.1}", 100.0 * r.us_token() / total)
        };
        s += &format!(
            "{:<48} {:>4} {:>5} {:>10} {:>10.2} {:>8.2} {:>10.3} {:>8.1} {:>10.1} {:>6}\n",
            format!("{}{}", if r.alt { "* " } else { "" }, r.name),
            r.disp,
            r.per_token,
            gpu,
            r.m.wall_us,
            r.m.cpu_us,
            r.bytes as f64 / 1e6,
            r.gbps(),
            r.us_token(),
            pct
        );
    }
    s
}

/// The rows as one JSON object (row names are plain ASCII; meta values lose quotes/backslashes).
pub fn json(rows: &[Row], meta: &[(&str, String)]) -> String {
    let clean = |v: &str| v.replace(['"', '\\'], "'");
    let meta: Vec<String> = meta
        .iter()
        .map(|(k, v)| format!("\"{k}\":\"{}\"", clean(v)))
        .collect();
    let num = |v: Option<f64>| v.map_or("null".into(), |v| format!("{v:.4}"));
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"name\":\"{}\",\"dispatches\":{},\"per_token\":{},\"alt\":{},\"bytes\":{},\
                 \"gpu_us\":{},\"wall_us\":{:.4},\"cpu_us\":{:.4},\"gbps\":{:.2},\"us_token\":{:.3}}}",
                r.name,
                r.disp,
                r.per_token,
                r.alt,
                r.bytes,
                num(r.m.gpu_us),
                r.m.wall_us,
                r.m.cpu_us,
                r.gbps(),
                r.us_token()
            )
        })
        .collect();
    format!("{{{},\"rows\":[{}]}}", meta.join(","), rows.join(","))
}
