//! Shared harness for GPU tests: one adapter for the whole test binary, serialised by a global
//! mutex (lavapipe is slow and wgpu devices are not meant to be hammered from many test
//! threads), plus random-input generators and comparison helpers.
//!
//! No adapter: the test fails when env `CI` is set, otherwise it prints a loud SKIP and returns.
//! Tests use the CPU adapter (lavapipe) when there is one, so results do not depend on which GPU
//! the machine has; `NIBBLE_TEST_ADAPTER=<name part>` overrides that (e.g. to test on the H200).

use crate::context::{AdapterChoice, Context};
use nibble_model::kv_cache::CacheType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, MutexGuard};

/// `None` until first use; `Some(None)` when no adapter exists.
static GPU: Mutex<Option<Option<Context>>> = Mutex::new(None);

/// Exclusive access to the shared test [`Context`] for the lifetime of the guard.
pub struct GpuGuard {
    guard: MutexGuard<'static, Option<Option<Context>>>,
}

impl std::ops::Deref for GpuGuard {
    type Target = Context;
    fn deref(&self) -> &Context {
        match &*self.guard {
            Some(Some(ctx)) => ctx,
            _ => unreachable!("GpuGuard is only built around an initialised context"),
        }
    }
}

/// The shared test context, or `None` (after printing SKIP) when this machine has no adapter.
/// Panics when there is no adapter and env `CI` is set: CI must run the GPU tests.
pub fn gpu(test: &str) -> Option<GpuGuard> {
    // A panicking test poisons the mutex; the context itself is still fine for the others.
    let mut guard = GPU.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        let choice = match std::env::var("NIBBLE_TEST_ADAPTER") {
            Ok(n) => AdapterChoice::Named(n),
            Err(_) => AdapterChoice::PreferCpu,
        };
        let ctx = match Context::new(&choice) {
            Ok(c) => {
                eprintln!("GPU tests on '{}' ({:?})", c.info.name, c.info.backend);
                Some(c)
            }
            Err(e) => {
                eprintln!("no GPU context: {e}");
                None
            }
        };
        *guard = Some(ctx);
    }
    if matches!(*guard, Some(None)) {
        if std::env::var_os("CI").is_some() {
            panic!("{test}: no wgpu adapter and CI is set: GPU tests must run in CI");
        }
        eprintln!("!!!!!!!! SKIP {test}: no wgpu adapter (install mesa-vulkan-drivers) !!!!!!!!");
        return None;
    }
    Some(GpuGuard { guard })
}

/// A seeded, portable random generator.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` uniform values in `[lo, hi)`.
pub fn rand_f32(rng: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Random ggml Q4_0 bytes for `[rows, cols]`: random nibbles, scales in `[0.002, 0.02)` with
/// random sign (like real weights of magnitude ~0.01-0.1).
pub fn rand_q4_0(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / 32;
    let mut out = Vec::with_capacity(blocks * 18);
    for _ in 0..blocks {
        let mut d: f32 = rng.random_range(0.002..0.02);
        if rng.random::<bool>() {
            d = -d;
        }
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for _ in 0..16 {
            out.push(rng.random::<u8>());
        }
    }
    out
}

/// Dequantize Q4_0 `[rows, cols]` with the reference decoder of `nibble_quant`.
pub fn dequant_q4_0(bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    nibble_quant::dequantize(nibble_quant::DType::Q4_0, bytes, &mut out)
        .expect("test Q4_0 bytes are well formed");
    out
}

/// Random MLX `MLX_A4` bytes for `[rows, cols]` (`nibble_quant::mlx`'s interleaved groups of
/// 64): random nibbles, bf16 scales in `[0.002, 0.02)` of either sign (MLX anchors a group on
/// its larger end, so both occur) and biases of either sign up to `16 |scale|`.
pub fn rand_mlx_a4(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    let groups = rows * cols / 64;
    let mut out = Vec::with_capacity(groups * 36);
    for _ in 0..groups {
        let mut s: f32 = rng.random_range(0.002..0.02);
        if rng.random::<bool>() {
            s = -s;
        }
        let b: f32 = rng.random_range(-16.0..16.0) * s.abs();
        out.extend_from_slice(&half::bf16::from_f32(s).to_le_bytes());
        out.extend_from_slice(&half::bf16::from_f32(b).to_le_bytes());
        for _ in 0..32 {
            out.push(rng.random::<u8>());
        }
    }
    out
}

/// Dequantize `[rows, cols]` of `dtype` with the reference decoder of `nibble_quant`.
pub fn dequant(dtype: nibble_quant::DType, bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    nibble_quant::dequantize(dtype, bytes, &mut out).expect("test bytes are well formed");
    out
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "cosine of different lengths");
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += *x as f64 * *y as f64;
        aa += *x as f64 * *x as f64;
        bb += *y as f64 * *y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// Assert `|got - want| <= abs + rel * |want|` elementwise (NaN fails), naming the first bad index.
pub fn assert_close(got: &[f32], want: &[f32], abs: f32, rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= abs + rel * w.abs();
        assert!(
            ok,
            "{what}: index {i}: got {g}, want {w} (abs {abs}, rel {rel})"
        );
    }
}

/// The block form tests name by a flag: the affine (MLX) one, else Q4_0.
pub fn form(affine: bool) -> crate::tensor::QForm {
    if affine {
        crate::tensor::QForm::Affine4
    } else {
        crate::tensor::QForm::Q4_0
    }
}

/// Random Q8_0 bytes for `[rows, cols]` (ggml blocks of 34 bytes): f16 scales in `[0.0002,
/// 0.002)` of either sign and random bytes, so levels -128 and 127 both occur.
pub fn rand_q8_0(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / 32;
    let mut out = Vec::with_capacity(blocks * 34);
    for _ in 0..blocks {
        let mut d: f32 = rng.random_range(0.0002..0.002);
        if rng.random::<bool>() {
            d = -d;
        }
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for _ in 0..32 {
            out.push(rng.random::<u8>());
        }
    }
    out
}

/// The file block type each [`QForm`] is uploaded from.
///
/// [`QForm`]: crate::tensor::QForm
pub fn dtype_of(form: crate::tensor::QForm) -> nibble_quant::DType {
    use crate::tensor::QForm;
    use nibble_quant::DType;
    match form {
        QForm::Q4_0 => DType::Q4_0,
        QForm::Affine4 => DType::MLX_A4,
        QForm::Q8_0 => DType::Q8_0,
        QForm::Affine8 => DType::MLX_A8,
        QForm::Q6K => DType::Q6_K,
        QForm::Q4K => DType::Q4_K,
        QForm::Q5K => DType::Q5_K,
    }
}

/// Random file bytes for a `[rows, cols]` matrix of `form`, with their block type.
pub fn rand_form(
    rng: &mut impl Rng,
    form: crate::tensor::QForm,
    rows: usize,
    cols: usize,
) -> (Vec<u8>, nibble_quant::DType) {
    use nibble_quant::DType;
    let dt = dtype_of(form);
    let b = match dt {
        DType::MLX_A4 => rand_mlx_a4(rng, rows, cols),
        DType::Q8_0 => rand_q8_0(rng, rows, cols),
        DType::MLX_A8 => rand_mlx_a8(rng, rows, cols),
        DType::Q6_K => rand_q6_k(rng, rows, cols),
        DType::Q4_K => rand_q4_k(rng, rows, cols),
        DType::Q5_K => rand_q5_k(rng, rows, cols),
        _ => rand_q4_0(rng, rows, cols),
    };
    (b, dt)
}

/// A random matrix stacked from `pieces` (`(form, rows)` each, in row order; each piece
/// uploaded on its own, so its parts keep its form, then [`crate::tensor::Q4Matrix::stack`]ed
/// as a `Q4_K_M` qkv is), with its reference values `[rows, cols]`.
pub fn rand_stack(
    ctx: &crate::context::Context,
    rng: &mut impl Rng,
    pieces: &[(crate::tensor::QForm, usize)],
    cols: usize,
) -> (crate::tensor::Q4Matrix, Vec<f32>) {
    use crate::tensor::Q4Matrix;
    let mut mats = Vec::new();
    let mut deq = Vec::new();
    for &(form, rows) in pieces {
        let (b, dt) = rand_form(rng, form, rows, cols);
        mats.push(Q4Matrix::upload_dtype(ctx, "piece", dt, rows, cols, 1, &[&b]).unwrap());
        deq.extend(dequant(dt, &b, rows, cols));
    }
    (Q4Matrix::stack("stack", mats).unwrap(), deq)
}

/// Random Q4_K bytes for `[rows, cols]` (`cols % 256 == 0`; ggml super-blocks of 144 bytes):
/// random nibbles and packed 6-bit scales and mins (every bit pattern), f16 `d` and `dmin` in
/// `[0.00002, 0.0002)`, `dmin` of either sign.
pub fn rand_q4_k(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    rand_q45_k(rng, rows, cols, 144)
}

/// Random Q5_K bytes for `[rows, cols]` (`cols % 256 == 0`; super-blocks of 176 bytes): as
/// [`rand_q4_k`] with random fifth bits (`qh`).
pub fn rand_q5_k(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    rand_q45_k(rng, rows, cols, 176)
}

/// [`rand_q4_k`] or [`rand_q5_k`] by the super-block's bytes (`bb`: 144 or 176).
fn rand_q45_k(rng: &mut impl Rng, rows: usize, cols: usize, bb: usize) -> Vec<u8> {
    let supers = rows * cols / 256;
    let mut out = Vec::with_capacity(supers * bb);
    for _ in 0..supers {
        let d: f32 = rng.random_range(0.00002..0.0002);
        let mut dmin: f32 = rng.random_range(0.00002..0.0002);
        if rng.random::<bool>() {
            dmin = -dmin;
        }
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&half::f16::from_f32(dmin).to_le_bytes());
        for _ in 0..bb - 4 {
            out.push(rng.random::<u8>());
        }
    }
    out
}

/// Random Q6_K bytes for `[rows, cols]` (`cols % 256 == 0`; ggml super-blocks of 210 bytes):
/// random 6-bit levels, i8 sub-scales over their whole range (-128 and 127 included) and an
/// f16 `d` in `[0.00001, 0.0001)` of either sign.
pub fn rand_q6_k(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    let supers = rows * cols / 256;
    let mut out = Vec::with_capacity(supers * 210);
    for i in 0..supers {
        for _ in 0..192 {
            out.push(rng.random::<u8>());
        }
        for s in 0..16 {
            out.push(match (i + s) % 7 {
                0 => 0x80,
                1 => 0x7F,
                _ => rng.random::<u8>(),
            });
        }
        let mut d: f32 = rng.random_range(0.00001..0.0001);
        if rng.random::<bool>() {
            d = -d;
        }
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
    }
    out
}

/// Random MLX `MLX_A8` bytes for `[rows, cols]` (interleaved groups of 64: bf16 scale and
/// bias, 64 level bytes): random levels, scales in `[0.0002, 0.002)` of either sign and biases
/// of either sign up to `256 |scale|`.
pub fn rand_mlx_a8(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<u8> {
    let groups = rows * cols / 64;
    let mut out = Vec::with_capacity(groups * 68);
    for _ in 0..groups {
        let mut s: f32 = rng.random_range(0.0002..0.002);
        if rng.random::<bool>() {
            s = -s;
        }
        let b: f32 = rng.random_range(-256.0..256.0) * s.abs();
        out.extend_from_slice(&half::bf16::from_f32(s).to_le_bytes());
        out.extend_from_slice(&half::bf16::from_f32(b).to_le_bytes());
        for _ in 0..64 {
            out.push(rng.random::<u8>());
        }
    }
    out
}

/// A cache's bytes on the GPU for host values `v` (already rounded to the type).
pub fn cache_bytes(t: CacheType, v: &[f32]) -> Vec<u8> {
    match t {
        CacheType::F32 => bytemuck::cast_slice(v).to_vec(),
        CacheType::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
    }
}

/// Read `n` cached values back from a cache buffer of type `t`.
pub fn read_cache(ctx: &Context, t: CacheType, buf: &wgpu::Buffer, n: usize) -> Vec<f32> {
    match t {
        CacheType::F32 => ctx.read_f32(buf, n).unwrap(),
        CacheType::F16 => ctx
            .read_u32(buf, n / 2)
            .unwrap()
            .iter()
            .flat_map(|w| [*w as u16, (*w >> 16) as u16])
            .map(|h| half::f16::from_bits(h).to_f32())
            .collect(),
    }
}
