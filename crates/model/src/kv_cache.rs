//! The element type of the KV cache, shared by every backend so that they round alike.
//!
//! The cache holds each position's roped key and raw value. At long contexts reading it is most
//! of a decode step's memory traffic (Qwen3-30B-A3B: 192 KiB per position in f32, against
//! ~1.75 GB of weights per token), so it may be kept in f16, as llama.cpp keeps it by default
//! (`--cache-type-k f16`) and vLLM keeps the model's 16-bit type. Every backend, the oracle
//! included, stores [`CacheType::round`]`(x)` for each element `x`: the nearest f16 (ties to
//! even) of `x` clamped to ±65504 (f16's largest finite value; the WGSL pack of a value beyond it
//! is undefined), so a fast path is compared with an oracle holding the same cache.
//!
//! The default is f32, because f16 does not keep the parity bar: rounding to f16 turns the
//! ~1e-7 relative differences between two backends' keys into whole f16 steps (~5e-4) wherever
//! a value sits near a rounding boundary, and those reach the MoE router. On the small
//! synthetic model in Q4_K_M, one of 32 greedy steps of the CPU backend against the oracle
//! (both with f16 caches) fell to logits cosine 0.99696, a router choice flipped (the f32
//! caches: >= 0.99999 everywhere). f16 is therefore a speed/memory option (`--cache-type f16`)
//! with its parity measured, not a default.

use std::fmt;
use std::str::FromStr;

/// The element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheType {
    /// IEEE half: 2 bytes per element, values clamped to ±65504 then rounded to nearest even.
    F16,
    /// IEEE single: 4 bytes per element, values exact (the default: see the module doc).
    #[default]
    F32,
}

/// f16's largest finite value.
pub const F16_MAX: f32 = 65504.0;

impl CacheType {
    /// Bytes per cached element.
    pub fn bytes(self) -> usize {
        match self {
            CacheType::F16 => 2,
            CacheType::F32 => 4,
        }
    }

    /// The value a cache of this type holds for `x` (NaN stays NaN).
    pub fn round(self, x: f32) -> f32 {
        match self {
            CacheType::F16 => to_f16(x).to_f32(),
            CacheType::F32 => x,
        }
    }

    /// [`CacheType::round`] of every element of `xs`, in place.
    pub fn round_all(self, xs: &mut [f32]) {
        if self != CacheType::F32 {
            for x in xs {
                *x = self.round(*x);
            }
        }
    }

    /// The name the command-line flag takes (`f16`, `f32`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F16 => "f16",
            CacheType::F32 => "f32",
        }
    }
}

/// The half an f16 cache holds for `x`: clamped to ±65504, then rounded to nearest even.
pub fn to_f16(x: f32) -> half::f16 {
    half::f16::from_f32(x.clamp(-F16_MAX, F16_MAX))
}

impl fmt::Display for CacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CacheType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(CacheType::F16),
            "f32" => Ok(CacheType::F32),
            other => Err(format!(
                "unknown KV cache type {other:?}: expected f16 or f32"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounds_to_nearest_even_and_clamps() {
        let t = CacheType::F16;
        // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1).
        assert_eq!(t.round(1.0 + 2f32.powi(-11)), 1.0);
        // 1 + 3 * 2^-11 lies halfway between 1 + 2^-10 and 1 + 2^-9: even is 1 + 2^-9.
        assert_eq!(t.round(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9));
        assert_eq!(t.round(0.1), 0.099975586);
        assert_eq!(t.round(1e9), F16_MAX);
        assert_eq!(t.round(-1e9), -F16_MAX);
        assert_eq!(t.round(f32::INFINITY), F16_MAX);
        assert!(t.round(f32::NAN).is_nan());
        // Subnormal halves survive.
        assert_eq!(t.round(2f32.powi(-24)), 2f32.powi(-24));
        assert_eq!(CacheType::F32.round(0.1), 0.1);
        let mut xs = [0.1f32, 3.0, -7e5];
        t.round_all(&mut xs);
        assert_eq!(xs, [0.099975586, 3.0, -F16_MAX]);
    }

    #[test]
    fn parses_and_prints() {
        assert_eq!("F16".parse::<CacheType>(), Ok(CacheType::F16));
        assert_eq!("f32".parse::<CacheType>(), Ok(CacheType::F32));
        assert!("q8_0"
            .parse::<CacheType>()
            .unwrap_err()
            .contains("f16 or f32"));
        assert_eq!(CacheType::F16.to_string(), "f16");
        assert_eq!(CacheType::default(), CacheType::F32);
        assert_eq!(CacheType::F16.bytes() * 2, CacheType::F32.bytes());
    }
}
