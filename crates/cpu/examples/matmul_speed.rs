//! Times the CPU backend's Q4_0 products on one Qwen3-30B-A3B-sized matrix (`[4096, 2048]`, the
//! q projection) for 1 and 8 token vectors: `cargo run --release -p nibble-cpu --example matmul_speed`.

use nibble_cpu::matmul::{run, Job};
use nibble_model::weights::Weight;
use nibble_quant::DType;
use std::time::Instant;

fn main() {
    let (rows, cols) = (4096usize, 2048usize);
    let vals: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 15) as f32 - 7.0)
        .collect();
    let bytes = nibble_quant::encode_float(DType::Q4_0, &vals);
    let w = Weight {
        dtype: DType::Q4_0,
        shape: vec![rows, cols],
        parts: vec![&bytes],
    };
    for n in [1usize, 8] {
        let x: Vec<f32> = (0..n * cols).map(|i| (i % 13) as f32 * 0.1).collect();
        let job = [Job {
            w: &w,
            row0: 0,
            rows,
            x: &x,
            n,
        }];
        run(&job).unwrap();
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(run(&job).unwrap());
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        let macs = (rows * cols * n) as f64;
        println!(
            "n={n}: {:.2} ms, {:.2} G MAC/s, {:.1} GB/s of weights",
            s * 1e3,
            macs / s / 1e9,
            bytes.len() as f64 / s / 1e9
        );
    }
}
