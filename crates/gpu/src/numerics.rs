//! Activation numerics of the int4 matvecs: which form of the input vector every Q4 kernel
//! (dense matvec, MoE gate/up, MoE down) reads, the WGSL snippets that read and write each form,
//! and scalar simulations of the quantisation for the kernel tests.
//!
//! Variants ([`Numerics`]), from most to least exact:
//! - `F32`: the f32 activations themselves (`x: array<vec4<f32>>`); ~1.6 TB/s on an H200.
//! - `Bfp24`: f32 activations in memory, like `F32`; the dense int4 x f32 matvecs
//!   (matvec_q4f.wgsl) turn their staged copy into block floating point (per block of 32 a
//!   power-of-two scale and 24-bit integer mantissas, split into three int8 parts) and multiply
//!   with `dot4I8Packed` / `dot4U8Packed`: each block's Σ (nibble - 8) q is exact in integers and
//!   rounded once, where the f32 form rounds 32 FMAs. Quantisation error <= 2^-23 of the block's
//!   max |x| per element. The other kernels read it as `F32`. See [`BFP_DOT`]. Not the default:
//!   parity holds (lavapipe 3 x 128 tokens, H200 3 x 32) and the dot itself is ~2 us cheaper per
//!   matvec than the f32 one, but every workgroup quantises the whole staged vector, which costs
//!   more than that (H200: qkv 16.7 vs 12.0 us, tg128 272.8 vs 310.5 tok/s; docs/BENCHMARKS.md
//!   runs 56-60). Quantising once per vector (the producer) would remove that cost.
//! - `PreciseInt8`: two int8 parts per block of 32, `hi = round(x / d1)`, `lo = round((x -
//!   hi*d1) / d2)` with `d1 = amax / 127`, `d2 = amax(x - hi*d1) / 127`: two `dot4I8Packed` per
//!   4 weights, ~1e-5 relative error (the residual of plain int8 shrunk ~250x).
//! - `Int8`: one int8 part per block (`q = round(x / d)`), ~4e-3 relative error per matvec.
//!
//! GPU layouts ([`crate::tensor::QuantActs`], `n` elements, block `b` = elements `32b..32b+32`):
//! - Int8: `q` `[n/4]` u32 (byte k of word i = element 4i+k), `s` `[n/32]` vec2 `(d, d*Σq)`.
//! - PreciseInt8: `q` `[n/2]` u32, block b = words `16b..16b+8` (hi, as Int8) then
//!   `16b+8..16b+16` (lo); `s` `[n/32]` vec4 `(d1, Σhi, d2, Σlo)` with the sums as exact small
//!   integers in f32, so the Q4_0 offset of 8 is removed in integer arithmetic.
//!
//! Rounding is half away from zero then clamped to ±127 everywhere (GPU and simulations).

use crate::tensor::{QuantActs, BLOCK};
use std::fmt;
use std::str::FromStr;

/// Which activations the int4 matvecs read (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Numerics {
    F32,
    PreciseInt8,
    Int8,
    Bfp24,
}

impl Numerics {
    pub const ALL: [Numerics; 4] = [
        Numerics::F32,
        Numerics::PreciseInt8,
        Numerics::Int8,
        Numerics::Bfp24,
    ];

    /// The default: the fastest variant that keeps the oracle-parity bar on lavapipe
    /// (docs/BENCHMARKS.md, "GPU numerics variants"): only f32 does (precise int8 reaches
    /// cosine 0.99999996 but one prompt's greedy run parts from the oracle's at token 125).
    pub const DEFAULT: Numerics = Numerics::F32;

    pub fn name(self) -> &'static str {
        match self {
            Numerics::F32 => "f32",
            Numerics::PreciseInt8 => "precise-int8",
            Numerics::Int8 => "int8",
            Numerics::Bfp24 => "bfp24",
        }
    }

    /// The form the activations take in GPU memory: `Bfp24` keeps them f32 (each kernel
    /// converts its own staged copy).
    pub fn form(self) -> Numerics {
        match self {
            Numerics::Bfp24 => Numerics::F32,
            n => n,
        }
    }

    /// Whether the activations are quantised (the producers write a [`QuantActs`]).
    pub fn quantized(self) -> bool {
        self.form() != Numerics::F32
    }
}

impl Default for Numerics {
    fn default() -> Self {
        Numerics::DEFAULT
    }
}

impl fmt::Display for Numerics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Numerics {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Numerics::ALL
            .into_iter()
            .find(|n| n.name() == s)
            .ok_or_else(|| {
                format!("unknown numerics '{s}': expected f32, bfp24, precise-int8 or int8")
            })
    }
}

/// The activation a Q4 kernel reads.
#[derive(Clone, Copy, Debug)]
pub enum Act<'a> {
    /// f32 `[cols]` ([`Numerics::F32`]).
    F32(&'a wgpu::Buffer),
    /// Quantised ([`Numerics::Int8`] or [`Numerics::PreciseInt8`] per `QuantActs::precise`).
    Int8(&'a QuantActs),
    /// Block floating point in global memory ([`Numerics::Bfp24`] blocks converted once by a
    /// dispatch of their own, `kernels::matvec::BfpQuantKernel`); matvecs only.
    Bfp(&'a BfpActs),
}

/// A vector of `n` activations as [`Numerics::Bfp24`] blocks in global memory (the form
/// [`BFP_GLOBAL_IN`] reads): `parts [6, n/32]` `vec4<u32>`, part-major (part j of block b at
/// `j * n/32 + b`: the hi, mid and lo words of elements 0-15 and 16-31, as `BfpBlock::p`), so
/// the lanes of a matvec reading part j of consecutive blocks read consecutive 16 bytes; and
/// `recs [n/32]` `vec2<u32>` `(d bits, 8 Σ q)`.
#[derive(Debug)]
pub struct BfpActs {
    pub parts: wgpu::Buffer,
    pub recs: wgpu::Buffer,
    pub n: u32,
}

impl BfpActs {
    /// Buffers for `n` activations (a multiple of 32).
    pub fn new(ctx: &crate::context::Context, label: &str, n: u32) -> crate::context::Result<Self> {
        if n == 0 || n % BLOCK as u32 != 0 {
            return Err(crate::context::GpuError::Shape(format!(
                "{label}: bfp24 activations need a positive multiple of {BLOCK}, not {n}"
            )));
        }
        let nb = (n / BLOCK as u32) as u64;
        Ok(BfpActs {
            parts: ctx.storage(&format!("{label}.parts"), nb * 6 * 16)?,
            recs: ctx.storage(&format!("{label}.recs"), nb * 8)?,
            n,
        })
    }
}

/// WGSL input snippet of matvec_q4.wgsl for [`Act::Bfp`]: bindings 2 and 3 of [`BfpActs`] and
/// `act_dot`/`act_dot2` by [`BFP_DOT`]'s `dq_block` (the number of blocks is the matvec's
/// `p.bpr`). Each lane loads its block's 7 words from global memory (L1/L2): no staging, so
/// no per-workgroup conversion.
pub const BFP_GLOBAL_IN: &str = "
@group(0) @binding(2) var<storage, read> act_p: array<vec4<u32>>; // [6, n/32] parts, part-major
@group(0) @binding(3) var<storage, read> act_r: array<vec2<u32>>; // [n/32] (d bits, 8 sum q)
fn act_block(b: u32) -> BfpBlock {
    let nb = p.bpr;
    let r = act_r[b];
    return BfpBlock(array<vec4<u32>, 6>(act_p[b], act_p[nb + b], act_p[2u * nb + b],
        act_p[3u * nb + b], act_p[4u * nb + b], act_p[5u * nb + b]),
        bitcast<f32>(r.x), bitcast<i32>(r.y));
}
fn act_dot(w: vec4<u32>, b: u32) -> f32 {
    return dq_block(w, act_block(b));
}
fn act_dot2(w1: vec4<u32>, w2: vec4<u32>, b: u32) -> vec2<f32> {
    let x = act_block(b);
    return vec2<f32>(dq_block(w1, x), dq_block(w2, x));
}
";

impl<'a> Act<'a> {
    pub fn numerics(&self) -> Numerics {
        match self {
            Act::F32(_) => Numerics::F32,
            Act::Int8(q) if q.precise => Numerics::PreciseInt8,
            Act::Int8(_) => Numerics::Int8,
            Act::Bfp(_) => Numerics::Bfp24,
        }
    }

    /// `(binding, resource)` entries for the snippet of [`act_in_wgsl`] at bindings `bq`, `bs`.
    pub fn entries(&self, bq: u32, bs: u32) -> Vec<(u32, wgpu::BindingResource<'a>)> {
        match self {
            Act::F32(x) => vec![(bq, x.as_entire_binding())],
            Act::Int8(a) => vec![(bq, a.q.as_entire_binding()), (bs, a.s.as_entire_binding())],
            Act::Bfp(a) => vec![
                (bq, a.parts.as_entire_binding()),
                (bs, a.recs.as_entire_binding()),
            ],
        }
    }

    /// Elements the activation holds (f32: by buffer size).
    pub fn len(&self) -> u64 {
        match self {
            Act::F32(x) => x.size() / 4,
            Act::Int8(a) => a.n as u64,
            Act::Bfp(a) => a.n as u64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// WGSL: int4 -> f32 without integer-to-float conversions (a quarter-rate instruction on NVIDIA,
/// the bottleneck of the f32 matvec). OR-ing a nibble that sits at bit `s` (`s + 4 <= 23`) into the
/// mantissa of 2^23 gives exactly `2^23 + 2^s q`; subtracting `2^23 + 8 * 2^s` leaves `2^s (q - 8)`
/// exactly, and the `2^s` is undone once per block (a power of two: no rounding). Word `i` of a
/// Q4_0 block holds element `4i+k` at bit `8k` and `4i+16+k` at bit `8k+4`; the nibbles at bits
/// 20..31 are taken from `w >> 12`. `dq_block(w, x)` = Σ_j (q_j - 8) x_j over one block, `x` the
/// block's 32 activations as 8 vec4.
pub const F32_DEQ: &str = "
const DQ_MAG: u32 = 0x4B000000u;
// Lanes: elements (4i, 4i+16, 4i+1, 4i+17) of word i, times 2^(0, 4, 8, 12).
fn dq_lo(w: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>((vec4<u32>(w) & vec4<u32>(0xFu, 0xF0u, 0xF00u, 0xF000u)) | vec4<u32>(DQ_MAG))
        - vec4<f32>(8388616.0, 8388736.0, 8390656.0, 8421376.0);
}
// Lanes: elements (4i+2, 4i+18, 4i+3, 4i+19) of word i, times 2^(16, 8, 12, 16).
fn dq_hi(w: u32) -> vec4<f32> {
    let s = w >> 12u;
    return bitcast<vec4<f32>>((vec4<u32>(w, s, s, s) & vec4<u32>(0xF0000u, 0xF00u, 0xF000u, 0xF0000u)) | vec4<u32>(DQ_MAG))
        - vec4<f32>(8912896.0, 8390656.0, 8421376.0, 8912896.0);
}
const DQ_SLO = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
const DQ_SHI = vec4<f32>(0.0000152587890625, 0.00390625, 0.000244140625, 0.0000152587890625);
fn dq_block(w: vec4<u32>, x: array<vec4<f32>, 8>) -> f32 {
    var lo = dq_lo(w.x) * vec4<f32>(x[0].x, x[4].x, x[0].y, x[4].y);
    var hi = dq_hi(w.x) * vec4<f32>(x[0].z, x[4].z, x[0].w, x[4].w);
    lo = fma(dq_lo(w.y), vec4<f32>(x[1].x, x[5].x, x[1].y, x[5].y), lo);
    hi = fma(dq_hi(w.y), vec4<f32>(x[1].z, x[5].z, x[1].w, x[5].w), hi);
    lo = fma(dq_lo(w.z), vec4<f32>(x[2].x, x[6].x, x[2].y, x[6].y), lo);
    hi = fma(dq_hi(w.z), vec4<f32>(x[2].z, x[6].z, x[2].w, x[6].w), hi);
    lo = fma(dq_lo(w.w), vec4<f32>(x[3].x, x[7].x, x[3].y, x[7].y), lo);
    hi = fma(dq_hi(w.w), vec4<f32>(x[3].z, x[7].z, x[3].w, x[7].w), hi);
    return dot(lo, DQ_SLO) + dot(hi, DQ_SHI);
}
";

/// WGSL of [`Numerics::Bfp24`]: block floating point activations and their dot with a Q4_0 block.
/// A block of 32 activations with max |x| = m (biased exponent `ex` of m) gets the scale `d =
/// 2^(ex - 149)` = 2^(floor(log2 m) - 22), so the mantissas `q = x / d` (an exact power-of-two
/// scaling) are below 2^23 in magnitude; rounded half to even and clamped to ±(2^23 - 1), each is
/// split into bytes `hi = q >> 16` (signed), `mid = (q >> 8) & 255`, `lo = q & 255` (unsigned), four
/// elements per word (element k at byte k). Blocks with m < 2^-100 become zeros (d = 0): their
/// scale would not be a normal f32.
/// - `BfpBlock`: one staged block: `p[0..2]` hi words of elements 0-15 / 16-31, `p[2..4]` mid,
///   `p[4..6]` lo, `d`, and `q8 = 8 Σ q` (i32, wrapping).
/// - `dq_block(w, x)` = Σ_j (nibble_j - 8) x̂_j for the Q4_0 block `w` (word i: element 4i+k at bit
///   8k, 4i+16+k at bit 8k+4): low nibbles pair with elements 0-15, high with 16-31, three
///   `dot4*8Packed` per nibble word; `2^16 Σ n hi + 2^8 Σ n mid + Σ n lo - 8 Σ q` is exact in
///   wrapping i32 arithmetic because the true value is below 2^31 (|n - 8| <= 8, |q| < 2^23, 32
///   elements), then rounded to f32 once and scaled by d exactly.
/// - `bfp_scale(m)` -> (1 / d, d); `bfp_q(v, 1 / d)` -> mantissas; `bfp_pack(q)` -> (hi, mid, lo)
///   words of four mantissas.
pub const BFP_DOT: &str = "
struct BfpBlock { p: array<vec4<u32>, 6>, d: f32, q8: i32 };
const BFP_NIB: u32 = 0x0F0F0F0Fu;
// Σ over one block of nibble * part byte: low nibbles (l) with elements 0-15 (a), high (h) with
// 16-31 (b); the hi part is signed, mid and lo unsigned.
fn bfp_sdot(l: vec4<u32>, h: vec4<u32>, a: vec4<u32>, b: vec4<u32>) -> i32 {
    return ((dot4I8Packed(l.x, a.x) + dot4I8Packed(l.y, a.y)) + (dot4I8Packed(l.z, a.z) + dot4I8Packed(l.w, a.w)))
        + ((dot4I8Packed(h.x, b.x) + dot4I8Packed(h.y, b.y)) + (dot4I8Packed(h.z, b.z) + dot4I8Packed(h.w, b.w)));
}
fn bfp_udot(l: vec4<u32>, h: vec4<u32>, a: vec4<u32>, b: vec4<u32>) -> u32 {
    return ((dot4U8Packed(l.x, a.x) + dot4U8Packed(l.y, a.y)) + (dot4U8Packed(l.z, a.z) + dot4U8Packed(l.w, a.w)))
        + ((dot4U8Packed(h.x, b.x) + dot4U8Packed(h.y, b.y)) + (dot4U8Packed(h.z, b.z) + dot4U8Packed(h.w, b.w)));
}
fn dq_block(w: vec4<u32>, x: BfpBlock) -> f32 {
    let l = w & vec4<u32>(BFP_NIB);
    let h = (w >> vec4<u32>(4u)) & vec4<u32>(BFP_NIB);
    let shi = bfp_sdot(l, h, x.p[0], x.p[1]);
    let smid = bfp_udot(l, h, x.p[2], x.p[3]);
    let slo = bfp_udot(l, h, x.p[4], x.p[5]);
    // smid < 2^17 and slo < 2^17, so (smid << 8) + slo < 2^26 needs no wrap.
    let t = (shi << 16u) + bitcast<i32>((smid << 8u) + slo) - x.q8;
    return f32(t) * x.d;
}
fn bfp_scale(m: f32) -> vec2<f32> {
    let ex = bitcast<u32>(m) >> 23u;
    if (ex < 27u) {
        return vec2<f32>(0.0);
    }
    return vec2<f32>(bitcast<f32>((276u - ex) << 23u), bitcast<f32>((ex - 22u) << 23u));
}
fn bfp_q(v: vec4<f32>, s: f32) -> vec4<i32> {
    return vec4<i32>(clamp(round(v * s), vec4<f32>(-8388607.0), vec4<f32>(8388607.0)));
}
fn bfp_pack(q: vec4<i32>) -> vec3<u32> {
    return vec3<u32>(
        pack4xI8(q >> vec4<u32>(16u)),
        pack4xU8((vec4<u32>(q) >> vec4<u32>(8u)) & vec4<u32>(0xFFu)),
        pack4xU8(vec4<u32>(q) & vec4<u32>(0xFFu)));
}
";

/// Host copy of the [`Numerics::Bfp24`] quantisation ([`BFP_DOT`]): per block of 32, the
/// mantissas and the scale `d` (`x̂ = q d`).
pub fn bfp24_ref(x: &[f32]) -> Vec<(Vec<i32>, f32)> {
    x.chunks(BLOCK)
        .map(|blk| {
            let m = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let ex = m.to_bits() >> 23;
            if ex < 27 {
                return (vec![0; blk.len()], 0.0);
            }
            let s = f32::from_bits((276 - ex) << 23);
            let d = f32::from_bits((ex - 22) << 23);
            let q = blk
                .iter()
                .map(|v| (v * s).round_ties_even().clamp(-8388607.0, 8388607.0) as i32)
                .collect();
            (q, d)
        })
        .collect()
}

const NIB_DOT: &str = "
const ACT_LO: u32 = 0x0F0F0F0Fu;
// Σ over one block of nibble * int8: low nibbles pair with words q0, high nibbles with q1.
fn act_nib_dot(w: vec4<u32>, q0: vec4<u32>, q1: vec4<u32>) -> i32 {
    let l = w & vec4<u32>(ACT_LO);
    let h = (w >> vec4<u32>(4u)) & vec4<u32>(ACT_LO);
    return dot4I8Packed(l.x, q0.x) + dot4I8Packed(l.y, q0.y) + dot4I8Packed(l.z, q0.z)
        + dot4I8Packed(l.w, q0.w) + dot4I8Packed(h.x, q1.x) + dot4I8Packed(h.y, q1.y)
        + dot4I8Packed(h.z, q1.z) + dot4I8Packed(h.w, q1.w);
}
";

/// WGSL declaring the input activation at bindings `bq` (and `bs`) and
/// `fn act_dot(w: vec4<u32>, b: u32) -> f32` = Σ_j (nibble_j - 8) · x_j over block `b` of the
/// activation for one Q4_0 block `w` (the weight scale is applied by the caller), plus
/// `act_dot2(w1, w2, b) -> vec2<f32>` for two weight blocks sharing one activation load.
pub fn act_in_wgsl(n: Numerics, bq: u32, bs: u32) -> String {
    match n.form() {
        Numerics::F32 | Numerics::Bfp24 => format!(
            "@group(0) @binding({bq}) var<storage, read> act_x: array<vec4<f32>>; // [n/4]
{F32_DEQ}
fn act_xblock(b: u32) -> array<vec4<f32>, 8> {{
    let xb = b * 8u;
    return array<vec4<f32>, 8>(act_x[xb], act_x[xb + 1u], act_x[xb + 2u], act_x[xb + 3u],
                               act_x[xb + 4u], act_x[xb + 5u], act_x[xb + 6u], act_x[xb + 7u]);
}}
fn act_dot2(w1: vec4<u32>, w2: vec4<u32>, b: u32) -> vec2<f32> {{
    let x = act_xblock(b);
    return vec2<f32>(dq_block(w1, x), dq_block(w2, x));
}}
fn act_dot(w: vec4<u32>, b: u32) -> f32 {{
    return dq_block(w, act_xblock(b));
}}
"
        ),
        Numerics::Int8 => format!(
            "@group(0) @binding({bq}) var<storage, read> act_q: array<vec4<u32>>; // [n/16]
@group(0) @binding({bs}) var<storage, read> act_s: array<vec2<f32>>; // [n/32] (d, d*Σq)
{NIB_DOT}
fn act_dot(w: vec4<u32>, b: u32) -> f32 {{
    let s = act_s[b];
    return s.x * f32(act_nib_dot(w, act_q[2u * b], act_q[2u * b + 1u])) - 8.0 * s.y;
}}
fn act_dot2(w1: vec4<u32>, w2: vec4<u32>, b: u32) -> vec2<f32> {{
    let s = act_s[b];
    let q0 = act_q[2u * b];
    let q1 = act_q[2u * b + 1u];
    return vec2<f32>(s.x * f32(act_nib_dot(w1, q0, q1)) - 8.0 * s.y,
                     s.x * f32(act_nib_dot(w2, q0, q1)) - 8.0 * s.y);
}}
"
        ),
        Numerics::PreciseInt8 => format!(
            "@group(0) @binding({bq}) var<storage, read> act_q: array<vec4<u32>>; // [n/8]
@group(0) @binding({bs}) var<storage, read> act_s: array<vec4<f32>>; // [n/32] (d1, Σhi, d2, Σlo)
{NIB_DOT}
// Offsets removed in integers: Σ(nib-8)q = Σ nib*q - 8Σq, exact (|.| < 2^17).
fn act_dotq(w: vec4<u32>, s: vec4<f32>, h0: vec4<u32>, h1: vec4<u32>, l0: vec4<u32>, l1: vec4<u32>) -> f32 {{
    let hi = act_nib_dot(w, h0, h1) - 8 * i32(s.y);
    let lo = act_nib_dot(w, l0, l1) - 8 * i32(s.w);
    return s.x * f32(hi) + s.z * f32(lo);
}}
fn act_dot(w: vec4<u32>, b: u32) -> f32 {{
    return act_dotq(w, act_s[b], act_q[4u * b], act_q[4u * b + 1u], act_q[4u * b + 2u], act_q[4u * b + 3u]);
}}
fn act_dot2(w1: vec4<u32>, w2: vec4<u32>, b: u32) -> vec2<f32> {{
    let s = act_s[b];
    let h0 = act_q[4u * b]; let h1 = act_q[4u * b + 1u];
    let l0 = act_q[4u * b + 2u]; let l1 = act_q[4u * b + 3u];
    return vec2<f32>(act_dotq(w1, s, h0, h1, l0, l1), act_dotq(w2, s, h0, h1, l0, l1));
}}
"
        ),
    }
}

const Q8: &str = "
// Round half away from zero, clamp to ±127 (as numerics::q8 on the host).
fn act_q8(t: f32) -> i32 {
    return i32(clamp(sign(t) * floor(abs(t) + 0.5), -127.0, 127.0));
}
";

/// WGSL declaring the quantised output at bindings `bq`, `bs` and
/// `fn act_store(v: array<f32, 32>, blk: u32)` writing block `blk` of it from the 32 values `v`.
/// For [`Numerics::F32`] nothing is declared and `act_store` does nothing (producers always
/// write their f32 output themselves).
pub fn act_out_wgsl(n: Numerics, bq: u32, bs: u32) -> String {
    match n.form() {
        Numerics::F32 | Numerics::Bfp24 => {
            "fn act_store(v: array<f32, 32>, blk: u32) {}\n".to_string()
        }
        Numerics::Int8 => format!(
            "@group(0) @binding({bq}) var<storage, read_write> out_q: array<u32>; // [n/4]
@group(0) @binding({bs}) var<storage, read_write> out_s: array<vec2<f32>>; // [n/32]
{Q8}
fn act_store(v: array<f32, 32>, blk: u32) {{
    var a = v;
    var amax = 0.0;
    for (var j = 0u; j < 32u; j++) {{ amax = max(amax, abs(a[j])); }}
    let d = amax / 127.0;
    let id = select(0.0, 1.0 / d, d > 0.0);
    var sum = 0;
    for (var w = 0u; w < 8u; w++) {{
        var word = 0u;
        for (var k = 0u; k < 4u; k++) {{
            let q = act_q8(a[4u * w + k] * id);
            sum += q;
            word |= (u32(q) & 0xFFu) << (8u * k);
        }}
        out_q[blk * 8u + w] = word;
    }}
    out_s[blk] = vec2<f32>(d, d * f32(sum));
}}
"
        ),
        Numerics::PreciseInt8 => format!(
            "@group(0) @binding({bq}) var<storage, read_write> out_q: array<u32>; // [n/2]
@group(0) @binding({bs}) var<storage, read_write> out_s: array<vec4<f32>>; // [n/32]
{Q8}
fn act_store(v: array<f32, 32>, blk: u32) {{
    var a = v;
    var amax = 0.0;
    for (var j = 0u; j < 32u; j++) {{ amax = max(amax, abs(a[j])); }}
    let d1 = amax / 127.0;
    let id1 = select(0.0, 1.0 / d1, d1 > 0.0);
    var hi: array<i32, 32>;
    var amax2 = 0.0;
    var s1 = 0;
    for (var j = 0u; j < 32u; j++) {{
        hi[j] = act_q8(a[j] * id1);
        s1 += hi[j];
        a[j] = a[j] - f32(hi[j]) * d1;   // the residual, |.| <= d1 / 2
        amax2 = max(amax2, abs(a[j]));
    }}
    let d2 = amax2 / 127.0;
    let id2 = select(0.0, 1.0 / d2, d2 > 0.0);
    var s2 = 0;
    for (var w = 0u; w < 8u; w++) {{
        var wh = 0u;
        var wl = 0u;
        for (var k = 0u; k < 4u; k++) {{
            let ql = act_q8(a[4u * w + k] * id2);
            s2 += ql;
            wh |= (u32(hi[4u * w + k]) & 0xFFu) << (8u * k);
            wl |= (u32(ql) & 0xFFu) << (8u * k);
        }}
        out_q[blk * 16u + w] = wh;
        out_q[blk * 16u + 8u + w] = wl;
    }}
    out_s[blk] = vec4<f32>(d1, f32(s1), d2, f32(s2));
}}
"
        ),
    }
}

const Q8V: &str = "
// act_q8 on four values at once (the same rounding, componentwise).
fn act_q8v(t: vec4<f32>) -> vec4<i32> {
    return vec4<i32>(clamp(sign(t) * floor(abs(t) + 0.5), vec4<f32>(-127.0), vec4<f32>(127.0)));
}
fn act_pack(q: vec4<i32>) -> u32 {
    let b = vec4<u32>(q) & vec4<u32>(0xFFu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}
fn act_max8(v0: vec4<f32>, v1: vec4<f32>) -> f32 {
    let m = max(abs(v0), abs(v1));
    return max(max(m.x, m.y), max(m.z, m.w));
}
fn act_sum8(a: vec4<i32>, b: vec4<i32>) -> i32 {
    let s = a + b;
    return (s.x + s.y) + (s.z + s.w);
}
";

/// WGSL (appended after [`act_out_wgsl`] of the same `n`) declaring
/// `fn act_store8(v0: vec4<f32>, v1: vec4<f32>, c: u32, on: bool, li: u32)`: the workgroup-parallel
/// form of `act_store`. Thread `li` quantises chunk `c` (elements `8c..8c+8` = `v0`, `v1`) of the
/// output; the four threads `li = 4g..4g+3` must hold the four chunks of one block (`c % 4 ==
/// li % 4`), so a block's amax and sums are reduced through workgroup memory (`act_sh`, one slot
/// per thread: workgroups of at most 256 threads) and each thread writes its own words. `on` is
/// false for a whole group without a block. Contains barriers: call it from uniform control flow
/// with the whole workgroup. The results equal `act_store` exactly (max and the integer sums do
/// not depend on the order).
pub fn act_store8_wgsl(n: Numerics) -> String {
    let head = format!("{Q8V}var<workgroup> act_sh: array<vec4<f32>, 256>;\n");
    match n.form() {
        Numerics::F32 | Numerics::Bfp24 => {
            "fn act_store8(v0: vec4<f32>, v1: vec4<f32>, c: u32, on: bool, li: u32) {}\n".into()
        }
        Numerics::Int8 => format!(
            "{head}
fn act_store8(v0: vec4<f32>, v1: vec4<f32>, c: u32, on: bool, li: u32) {{
    let g = li & ~3u;
    act_sh[li].x = act_max8(v0, v1);
    workgroupBarrier();
    let amax = max(max(act_sh[g].x, act_sh[g + 1u].x), max(act_sh[g + 2u].x, act_sh[g + 3u].x));
    let d = amax / 127.0;
    let id = select(0.0, 1.0 / d, d > 0.0);
    let q0 = act_q8v(v0 * id);
    let q1 = act_q8v(v1 * id);
    act_sh[li].y = f32(act_sum8(q0, q1));
    if (on) {{
        out_q[2u * c] = act_pack(q0);
        out_q[2u * c + 1u] = act_pack(q1);
    }}
    workgroupBarrier();
    if (on && (li & 3u) == 0u) {{
        let sum = (act_sh[g].y + act_sh[g + 1u].y) + (act_sh[g + 2u].y + act_sh[g + 3u].y);
        out_s[c / 4u] = vec2<f32>(d, d * sum);
    }}
}}
"
        ),
        Numerics::PreciseInt8 => format!(
            "{head}
fn act_store8(v0: vec4<f32>, v1: vec4<f32>, c: u32, on: bool, li: u32) {{
    let g = li & ~3u;
    act_sh[li].x = act_max8(v0, v1);
    workgroupBarrier();
    let amax = max(max(act_sh[g].x, act_sh[g + 1u].x), max(act_sh[g + 2u].x, act_sh[g + 3u].x));
    let d1 = amax / 127.0;
    let id1 = select(0.0, 1.0 / d1, d1 > 0.0);
    let h0 = act_q8v(v0 * id1);
    let h1 = act_q8v(v1 * id1);
    let r0 = v0 - vec4<f32>(h0) * d1;   // the residual, |.| <= d1 / 2
    let r1 = v1 - vec4<f32>(h1) * d1;
    act_sh[li].y = act_max8(r0, r1);
    act_sh[li].z = f32(act_sum8(h0, h1));
    workgroupBarrier();
    let amax2 = max(max(act_sh[g].y, act_sh[g + 1u].y), max(act_sh[g + 2u].y, act_sh[g + 3u].y));
    let d2 = amax2 / 127.0;
    let id2 = select(0.0, 1.0 / d2, d2 > 0.0);
    let l0 = act_q8v(r0 * id2);
    let l1 = act_q8v(r1 * id2);
    act_sh[li].w = f32(act_sum8(l0, l1));
    let blk = c / 4u;
    let w = blk * 16u + 2u * (c & 3u);
    if (on) {{
        out_q[w] = act_pack(h0);
        out_q[w + 1u] = act_pack(h1);
        out_q[w + 8u] = act_pack(l0);
        out_q[w + 9u] = act_pack(l1);
    }}
    workgroupBarrier();
    if (on && (li & 3u) == 0u) {{
        let s1 = (act_sh[g].z + act_sh[g + 1u].z) + (act_sh[g + 2u].z + act_sh[g + 3u].z);
        let s2 = (act_sh[g].w + act_sh[g + 1u].w) + (act_sh[g + 2u].w + act_sh[g + 3u].w);
        out_s[blk] = vec4<f32>(d1, s1, d2, s2);
    }}
}}
"
        ),
    }
}

/// Host copy of the GPU rounding: half away from zero, clamped to ±127.
pub fn q8(t: f32) -> i8 {
    (t.abs() + 0.5).floor().copysign(t).clamp(-127.0, 127.0) as i8
}

/// Scalar simulation of the precise-int8 quantisation: per block `(hi[32], lo[32], d1, d2)`.
pub fn quantize_precise_ref(x: &[f32]) -> Vec<([i8; 32], [i8; 32], f32, f32)> {
    x.chunks(BLOCK)
        .map(|blk| {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d1 = amax / 127.0;
            let id1 = if d1 > 0.0 { 1.0 / d1 } else { 0.0 };
            let mut hi = [0i8; 32];
            let mut r = [0f32; 32];
            for (j, v) in blk.iter().enumerate() {
                hi[j] = q8(v * id1);
                r[j] = v - hi[j] as f32 * d1;
            }
            let amax2 = r.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d2 = amax2 / 127.0;
            let id2 = if d2 > 0.0 { 1.0 / d2 } else { 0.0 };
            let mut lo = [0i8; 32];
            for j in 0..blk.len() {
                lo[j] = q8(r[j] * id2);
            }
            (hi, lo, d1, d2)
        })
        .collect()
}

/// The activation values a kernel of variant `n` effectively multiplies with (x itself, or its
/// dequantised int8 form), in f64 so that a reference matvec over them matches the kernel to
/// f32 accumulation error.
pub fn effective_acts(n: Numerics, x: &[f32]) -> Vec<f64> {
    match n {
        Numerics::F32 => x.iter().map(|v| *v as f64).collect(),
        Numerics::Bfp24 => bfp24_ref(x)
            .into_iter()
            .flat_map(|(q, d)| q.into_iter().map(move |q| q as f64 * d as f64))
            .collect(),
        Numerics::Int8 => {
            let (q, s) = crate::tensor::quantize_acts_ref(x);
            q.iter()
                .enumerate()
                .map(|(j, q)| *q as f64 * s[j / BLOCK][0] as f64)
                .collect()
        }
        Numerics::PreciseInt8 => quantize_precise_ref(x)
            .into_iter()
            .flat_map(|(hi, lo, d1, d2)| {
                (0..32).map(move |j| hi[j] as f64 * d1 as f64 + lo[j] as f64 * d2 as f64)
            })
            .take(x.len())
            .collect(),
    }
}

/// Decode a [`QuantActs`] read back from the GPU (`q` words, `s` floats) to its effective
/// values (what a kernel multiplies with), so tests can compare producers with
/// [`effective_acts`] of their f32 output.
pub fn dequant_acts(precise: bool, q: &[u32], s: &[f32]) -> Vec<f64> {
    let byte = |w: u32, k: usize| (w >> (8 * k)) as u8 as i8 as f64;
    let blocks = if precise { s.len() / 4 } else { s.len() / 2 };
    let mut out = Vec::with_capacity(blocks * BLOCK);
    for b in 0..blocks {
        for j in 0..BLOCK {
            let v = if precise {
                let hi = byte(q[b * 16 + j / 4], j % 4);
                let lo = byte(q[b * 16 + 8 + j / 4], j % 4);
                hi * s[b * 4] as f64 + lo * s[b * 4 + 2] as f64
            } else {
                byte(q[b * 8 + j / 4], j % 4) * s[b * 2] as f64
            };
            out.push(v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{rand_f32, rng};

    #[test]
    fn precise_quantisation_error_is_tiny_and_int8_is_not() {
        let mut r = rng(7);
        let mut x = rand_f32(&mut r, 32 * 64, -3.0, 3.0);
        x[5] = 40.0; // an outlier block
        let err = |n: Numerics| {
            let e = effective_acts(n, &x);
            x.chunks(32)
                .zip(e.chunks(32))
                .map(|(a, b)| {
                    let amax = a.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    a.iter()
                        .zip(b)
                        .map(|(u, v)| (*u as f64 - v).abs() / amax)
                        .fold(0f64, f64::max)
                })
                .fold(0f64, f64::max)
        };
        let (e8, e16, ef) = (
            err(Numerics::Int8),
            err(Numerics::PreciseInt8),
            err(Numerics::F32),
        );
        eprintln!("max error / block amax: int8 {e8:e}, precise {e16:e}, f32 {ef:e}");
        assert!(e8 > 1e-3 && e8 <= 0.5 / 127.0 + 1e-6, "int8 {e8}");
        assert!(e16 < 0.5 / 127.0 / 127.0 * 1.01, "precise {e16}");
        assert_eq!(ef, 0.0);
        // bfp24: half a mantissa step, 2^-23 of the block max at most; not exact either.
        let eb = err(Numerics::Bfp24);
        eprintln!("bfp24 {eb:e}");
        assert!(eb > 0.0 && eb <= 2f64.powi(-23), "bfp24 {eb}");
    }

    #[test]
    fn names_round_trip() {
        for n in Numerics::ALL {
            assert_eq!(n.name().parse::<Numerics>().unwrap(), n);
        }
        assert!("int4".parse::<Numerics>().is_err());
    }
}
