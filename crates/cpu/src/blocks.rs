//! The storage types as the CPU kernels walk them: one [`Block`] per dtype, decoding runs of 32
//! weights to the exact f32 values the oracle computes (`nibble_quant::dequantize`; this is an
//! independent implementation of the same formulas, so the parity tests check both).

use crate::matmul::BLOCK;
use half::{bf16, f16};

/// One block of a dtype (32 elements, or a K-quant super-block of 256 walked as eight runs of
/// 32): its size and its exact decoding to f32.
pub(crate) trait Block {
    const BYTES: usize;
    /// Elements per block: [`BLOCK`] or a multiple of it.
    const ELEMS: usize = BLOCK;
    const NAME: &'static str;
    /// Whether the block's scales (if it has any) are finite.
    fn finite(bytes: &[u8]) -> bool {
        let _ = bytes;
        true
    }
    /// Decode elements `32·sub..32·sub + 32` of one block (its scales checked by
    /// [`Block::finite`]; a non-finite one gives NaN weights).
    fn decode(bytes: &[u8], sub: usize) -> [f32; BLOCK];
}

/// An f16 block scale: finite unless its exponent bits are all set.
#[inline(always)]
pub(crate) fn scale_finite(bytes: &[u8]) -> bool {
    u16::from_le_bytes([bytes[0], bytes[1]]) & 0x7c00 != 0x7c00
}

/// The f16 scale as f32 without a branch (the library conversion's special cases cost 13-25%
/// of the products): the exponent and mantissa bits moved to their f32 places read as an f32
/// 2^-112 times too small (a subnormal f16 lands on an f32 subnormal, exactly), so one multiply
/// by 2^112 gives the value for every finite f16. An infinite or NaN scale becomes NaN (a
/// select, not a branch), which the products carry to their results (see [`scales_finite`]).
#[inline(always)]
pub(crate) fn scale(bytes: &[u8]) -> f32 {
    let h = u16::from_le_bytes([bytes[0], bytes[1]]) as u32;
    let magnitude = f32::from_bits((h & 0x7fff) << 13) * f32::from_bits((127 + 112) << 23);
    let v = f32::from_bits(magnitude.to_bits() | ((h & 0x8000) << 16));
    if h & 0x7c00 == 0x7c00 {
        f32::NAN
    } else {
        v
    }
}

pub(crate) struct Q4;
impl Block for Q4 {
    const BYTES: usize = 18;
    const NAME: &'static str = "Q4_0";
    fn finite(bytes: &[u8]) -> bool {
        scale_finite(bytes)
    }
    #[inline(always)]
    fn decode(bytes: &[u8], _sub: usize) -> [f32; BLOCK] {
        let d = scale(bytes);
        let q: &[u8; 16] = bytes[2..18].try_into().expect("an 18-byte block");
        let mut w = [0f32; BLOCK];
        // Low nibbles are elements 0..16, high nibbles 16..32 (formats-spec §2, ggml's order).
        for j in 0..16 {
            w[j] = ((q[j] & 15) as i32 - 8) as f32 * d;
            w[16 + j] = ((q[j] >> 4) as i32 - 8) as f32 * d;
        }
        w
    }
}

pub(crate) struct Q8;
impl Block for Q8 {
    const BYTES: usize = 34;
    const NAME: &'static str = "Q8_0";
    fn finite(bytes: &[u8]) -> bool {
        scale_finite(bytes)
    }
    #[inline(always)]
    fn decode(bytes: &[u8], _sub: usize) -> [f32; BLOCK] {
        let d = scale(bytes);
        let q: &[u8; 32] = bytes[2..34].try_into().expect("a 34-byte block");
        q.map(|v| (v as i8) as f32 * d)
    }
}

pub(crate) struct F32;
impl Block for F32 {
    const BYTES: usize = 128;
    const NAME: &'static str = "F32";
    #[inline(always)]
    fn decode(bytes: &[u8], _sub: usize) -> [f32; BLOCK] {
        std::array::from_fn(|j| {
            let c = &bytes[4 * j..4 * j + 4];
            f32::from_le_bytes([c[0], c[1], c[2], c[3]])
        })
    }
}

pub(crate) struct F16;
impl Block for F16 {
    const BYTES: usize = 64;
    const NAME: &'static str = "F16";
    #[inline(always)]
    fn decode(bytes: &[u8], _sub: usize) -> [f32; BLOCK] {
        std::array::from_fn(|j| f16::from_le_bytes([bytes[2 * j], bytes[2 * j + 1]]).to_f32_const())
    }
}

pub(crate) struct Bf16;
impl Block for Bf16 {
    const BYTES: usize = 64;
    const NAME: &'static str = "BF16";
    #[inline(always)]
    fn decode(bytes: &[u8], _sub: usize) -> [f32; BLOCK] {
        std::array::from_fn(|j| {
            bf16::from_le_bytes([bytes[2 * j], bytes[2 * j + 1]]).to_f32_const()
        })
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K / Q5_K super-block from its 12 packed
/// bytes: bytes 0-3 and 4-7 hold scales and mins 0-3 in their low six bits; sub-blocks 4-7
/// take their low four bits from the nibbles of bytes 8-11 and their top two from the top bits
/// of bytes 0-3 (scales) and 4-7 (mins).
#[inline(always)]
pub(crate) fn k4_scale_min(packed: &[u8], j: usize) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (packed[j] & 63, packed[4 + j] & 63)
    } else {
        let low = packed[4 + j];
        (
            (low & 15) | ((packed[j - 4] >> 6) << 4),
            (low >> 4) | ((packed[j] >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

/// Run `sub` of a Q4_K (`FIVE` false) or Q5_K super-block: `d·sc·q − dmin·m`, where `d·sc·q`
/// and `dmin·m` are exact, so the subtraction is the only rounding, as in the oracle.
#[inline(always)]
fn k45_decode<const FIVE: bool>(bytes: &[u8], sub: usize) -> [f32; BLOCK] {
    let (sc, m) = k4_scale_min(&bytes[4..16], sub);
    let step = scale(bytes) * sc;
    let offset = scale(&bytes[2..]) * m;
    let qs_at = if FIVE { 48 } else { 16 };
    // Sub-blocks 2c and 2c + 1 share the 32 bytes of chunk c: low and high nibbles.
    let qs = &bytes[qs_at + 32 * (sub / 2)..qs_at + 32 * (sub / 2) + 32];
    let shift = 4 * (sub % 2);
    std::array::from_fn(|l| {
        let mut q = (qs[l] >> shift) & 15;
        if FIVE {
            q |= ((bytes[16 + l] >> sub) & 1) << 4;
        }
        step * q as f32 - offset
    })
}

pub(crate) struct Q4K;
impl Block for Q4K {
    const BYTES: usize = 144;
    const ELEMS: usize = 256;
    const NAME: &'static str = "Q4_K";
    fn finite(bytes: &[u8]) -> bool {
        scale_finite(bytes) && scale_finite(&bytes[2..])
    }
    #[inline(always)]
    fn decode(bytes: &[u8], sub: usize) -> [f32; BLOCK] {
        k45_decode::<false>(bytes, sub)
    }
}

pub(crate) struct Q5K;
impl Block for Q5K {
    const BYTES: usize = 176;
    const ELEMS: usize = 256;
    const NAME: &'static str = "Q5_K";
    fn finite(bytes: &[u8]) -> bool {
        scale_finite(bytes) && scale_finite(&bytes[2..])
    }
    #[inline(always)]
    fn decode(bytes: &[u8], sub: usize) -> [f32; BLOCK] {
        k45_decode::<true>(bytes, sub)
    }
}

/// Q6_K: `ql[128]`, `qh[64]`, sixteen i8 scales, then the f16 `d`. Run `sub` is quarter
/// `k = sub mod 4` of half `h = sub / 4`: its low four bits are the low (k < 2) or high nibbles
/// of `ql[64h + 32(k mod 2) + l]`, its top two bits bits `2k..2k + 2` of `qh[32h + l]`.
pub(crate) struct Q6K;
impl Block for Q6K {
    const BYTES: usize = 210;
    const ELEMS: usize = 256;
    const NAME: &'static str = "Q6_K";
    fn finite(bytes: &[u8]) -> bool {
        scale_finite(&bytes[208..])
    }
    #[inline(always)]
    fn decode(bytes: &[u8], sub: usize) -> [f32; BLOCK] {
        let d = scale(&bytes[208..]);
        let (h, k) = (sub / 4, sub % 4);
        let ql = &bytes[64 * h + 32 * (k % 2)..64 * h + 32 * (k % 2) + 32];
        let qh = &bytes[128 + 32 * h..128 + 32 * h + 32];
        let scales = &bytes[192 + 8 * h + 2 * k..192 + 8 * h + 2 * k + 2];
        let shift = 4 * (k / 2);
        std::array::from_fn(|l| {
            let q = ((ql[l] >> shift) & 15) | (((qh[l] >> (2 * k)) & 3) << 4);
            // d·scale·(q − 32): exact at every step (11 + 7 + 5 significant bits: |scale| <= 128,
            // |q − 32| <= 32).
            d * (scales[l / 16] as i8) as f32 * (q as i32 - 32) as f32
        })
    }
}

/// A bf16 as f32: its bits moved up (exact for every value; a non-finite one stays
/// non-finite and so carries to the products' results, see [`Block::finite`]).
#[inline(always)]
pub(crate) fn bf16_bits(bytes: &[u8], at: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([bytes[at], bytes[at + 1]]) as u32) << 16)
}

/// Whether the bf16 at `at` is finite (exponent bits not all set).
#[inline(always)]
fn bf16_finite(bytes: &[u8], at: usize) -> bool {
    u16::from_le_bytes([bytes[at], bytes[at + 1]]) & 0x7f80 != 0x7f80
}

/// MLX's affine 4-bit groups of 64 as nibble keeps them (`nibble_quant::mlx`): bf16 scale,
/// bf16 bias, 32 bytes with weight `2b` in the low nibble of byte `b`; weight = `scale·q + bias`
/// (a product then a sum, as the oracle rounds them).
pub(crate) struct MlxA4;
impl Block for MlxA4 {
    const BYTES: usize = 36;
    const ELEMS: usize = 64;
    const NAME: &'static str = "MLX_A4";
    fn finite(bytes: &[u8]) -> bool {
        bf16_finite(bytes, 0) && bf16_finite(bytes, 2)
    }
    #[inline(always)]
    fn decode(bytes: &[u8], sub: usize) -> [f32; BLOCK] {
        let (s, b) = (bf16_bits(bytes, 0), bf16_bits(bytes, 2));
        let q: &[u8; 16] = bytes[4 + 16 * sub..20 + 16 * sub]
            .try_into()
            .expect("a 36-byte block");
        let mut w = [0f32; BLOCK];
        for j in 0..16 {
            w[2 * j] = (q[j] & 15) as f32 * s + b;
            w[2 * j + 1] = (q[j] >> 4) as f32 * s + b;
        }
        w
    }
}

/// MLX's affine 8-bit groups of 64 (the router of newer conversions): bf16 scale, bf16 bias,
/// 64 unsigned bytes.
pub(crate) struct MlxA8;
impl Block for MlxA8 {
    const BYTES: usize = 68;
    const ELEMS: usize = 64;
    const NAME: &'static str = "MLX_A8";
    fn finite(bytes: &[u8]) -> bool {
        MlxA4::finite(bytes)
    }
    #[inline(always)]
    fn decode(bytes: &[u8], sub: usize) -> [f32; BLOCK] {
        let (s, b) = (bf16_bits(bytes, 0), bf16_bits(bytes, 2));
        std::array::from_fn(|j| bytes[4 + 32 * sub + j] as f32 * s + b)
    }
}
