//! Tensor element types and quantised block layouts.
//!
//! Every storage type nibble understands is declared here once: its GGUF type id, how many
//! elements one block holds, how many bytes one block takes, and a scalar reference
//! dequantize. Everything else (file readers, the oracle, GPU upload) asks this module and
//! never hard-codes a block size.
//!
//! Invariants (these match ggml, so a GGUF written by nibble loads in llama.cpp):
//! - `Q4_0`: blocks of 32 weights, 18 bytes: an f16 scale `d` then 16 bytes of nibbles.
//!   Byte `j` holds weight `j` in its low nibble and weight `j + 16` in its high nibble;
//!   weight = `(nibble - 8) * d`.
//! - `Q8_0`: blocks of 32 weights, 34 bytes: an f16 scale `d` then 32 signed bytes;
//!   weight = `q * d`.
//! - `Q4_K`, `Q5_K`, `Q6_K`: llama.cpp's 256-weight super-blocks ([`kquants`] documents them).
//! - `MLX_A4`, `MLX_A8`: MLX's affine groups of 64 (scale and bias per group), interleaved
//!   into blocks by the loader ([`mlx`] documents them); not GGUF types.
//! - Rows never share a block: a row's element count must be a multiple of the block size.
//!
//! Adding a type means one new enum variant, its row in [`DType::layout`] and its reference
//! dequantize in [`dequantize`].

pub mod kquants;
pub mod mlx;

use half::{bf16, f16};

/// Errors raised when bytes do not match the layout they claim.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error("{dtype:?}: {elements} elements is not a whole number of {block}-element blocks")]
    NotWholeBlocks {
        dtype: DType,
        elements: u64,
        block: u64,
    },
    #[error("{dtype:?}: expected {expected} bytes for {elements} elements, got {got}")]
    WrongByteCount {
        dtype: DType,
        elements: u64,
        expected: u64,
        got: u64,
    },
    #[error("{dtype:?}: byte size of {elements} elements overflows")]
    Overflow { dtype: DType, elements: u64 },
    #[error("{dtype:?}: block {block} has a non-finite scale ({scale})")]
    NonFiniteScale {
        dtype: DType,
        block: u64,
        scale: f32,
    },
    #[error("{dtype:?}: element {index} is not finite ({value})")]
    NonFiniteValue {
        dtype: DType,
        index: u64,
        value: f32,
    },
    #[error("unknown GGML tensor type id {0}")]
    UnknownTypeId(u32),
}

/// Storage type of a tensor's elements (named as ggml names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    MLX_A4,
    MLX_A8,
}

/// Size facts of one storage type: `block_elems` elements occupy `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub block_elems: u64,
    pub block_bytes: u64,
}

/// ggml's `block_q4_0`: f16 scale then 16 bytes of packed nibbles (see module docs for order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_0 {
    pub d: u16,
    pub qs: [u8; 16],
}

/// ggml's `block_q8_0`: f16 scale then 32 signed bytes.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; 32],
}

// The on-disk sizes are part of the GGUF format: a silent change would corrupt every file.
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// Elements per block of the quantised types (ggml's QK4_0 and QK8_0).
pub const QK: usize = 32;

impl DType {
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::MLX_A4,
        DType::MLX_A8,
    ];

    /// Block geometry of this type.
    pub const fn layout(self) -> Layout {
        match self {
            DType::F32 => Layout {
                block_elems: 1,
                block_bytes: 4,
            },
            DType::F16 => Layout {
                block_elems: 1,
                block_bytes: 2,
            },
            DType::BF16 => Layout {
                block_elems: 1,
                block_bytes: 2,
            },
            DType::Q8_0 => Layout {
                block_elems: 32,
                block_bytes: 34,
            },
            DType::Q4_0 => Layout {
                block_elems: 32,
                block_bytes: 18,
            },
            DType::Q4_K => Layout {
                block_elems: 256,
                block_bytes: 144,
            },
            DType::Q5_K => Layout {
                block_elems: 256,
                block_bytes: 176,
            },
            DType::Q6_K => Layout {
                block_elems: 256,
                block_bytes: 210,
            },
            DType::MLX_A4 => Layout {
                block_elems: 64,
                block_bytes: 36,
            },
            DType::MLX_A8 => Layout {
                block_elems: 64,
                block_bytes: 68,
            },
        }
    }

    /// The `ggml_type` id used in GGUF tensor infos; `None` for the MLX types, which GGUF
    /// cannot hold.
    pub const fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q8_0 => 8,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::BF16 => 30,
            DType::MLX_A4 | DType::MLX_A8 => return None,
        })
    }

    /// Inverse of [`DType::ggml_id`].
    pub fn from_ggml_id(id: u32) -> Result<DType, QuantError> {
        DType::ALL
            .into_iter()
            .find(|t| t.ggml_id() == Some(id))
            .ok_or(QuantError::UnknownTypeId(id))
    }

    /// Short upper-case name as llama.cpp prints it (`Q4_0`, `F32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::MLX_A4 => "MLX_A4",
            DType::MLX_A8 => "MLX_A8",
        }
    }

    /// Whether this type packs several elements into a block with a shared scale.
    pub const fn is_quantized(self) -> bool {
        self.layout().block_elems > 1
    }

    /// Bytes taken by `elements` elements, checking block alignment and overflow.
    pub fn byte_size(self, elements: u64) -> Result<u64, QuantError> {
        let l = self.layout();
        if !elements.is_multiple_of(l.block_elems) {
            return Err(QuantError::NotWholeBlocks {
                dtype: self,
                elements,
                block: l.block_elems,
            });
        }
        (elements / l.block_elems)
            .checked_mul(l.block_bytes)
            .ok_or(QuantError::Overflow {
                dtype: self,
                elements,
            })
    }
}

/// Reference dequantize: decode `bytes` (which must hold exactly `out.len()` elements of
/// `dtype`) into `out`. Scalar and plain on purpose: this is what every kernel is judged by.
/// A non-finite block scale, or a non-finite element of a float type, is an error, never
/// silently propagated as NaN weights.
pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let n = out.len() as u64;
    let expected = dtype.byte_size(n)?;
    if bytes.len() as u64 != expected {
        return Err(QuantError::WrongByteCount {
            dtype,
            elements: n,
            expected,
            got: bytes.len() as u64,
        });
    }
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q4_0 => {
            for (b, (o, c)) in out
                .chunks_exact_mut(QK)
                .zip(bytes.chunks_exact(18))
                .enumerate()
            {
                let d = checked_scale(dtype, b, [c[0], c[1]])?;
                for j in 0..16 {
                    let byte = c[2 + j];
                    o[j] = ((byte & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((byte >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q8_0 => {
            for (b, (o, c)) in out
                .chunks_exact_mut(QK)
                .zip(bytes.chunks_exact(34))
                .enumerate()
            {
                let d = checked_scale(dtype, b, [c[0], c[1]])?;
                for j in 0..QK {
                    o[j] = (c[2 + j] as i8) as f32 * d;
                }
            }
        }
        DType::Q4_K | DType::Q5_K => kquants::dequantize_q45_k(dtype, bytes, out)?,
        DType::Q6_K => kquants::dequantize_q6_k(bytes, out)?,
        DType::MLX_A4 | DType::MLX_A8 => mlx::dequantize(dtype, bytes, out)?,
    }
    // A float tensor's NaN or infinity (a norm weight, a router) would reach the logits as
    // silent garbage; the quantised types' scales are checked per block above.
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        if let Some(index) = out.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFiniteValue {
                dtype,
                index: index as u64,
                value: out[index],
            });
        }
    }
    Ok(())
}

pub(crate) fn checked_scale(dtype: DType, block: usize, le: [u8; 2]) -> Result<f32, QuantError> {
    let d = f16::from_le_bytes(le).to_f32();
    if !d.is_finite() {
        return Err(QuantError::NonFiniteScale {
            dtype,
            block: block as u64,
            scale: d,
        });
    }
    Ok(d)
}

/// Quantise `src` (a multiple of 32 long) to Q4_0 the way ggml's reference does: the scale is
/// the signed value of largest magnitude divided by -8, so that value maps to nibble 0.
pub fn quantize_q4_0(src: &[f32]) -> Vec<u8> {
    assert!(src.len().is_multiple_of(QK), "Q4_0 needs whole blocks");
    let mut out = Vec::with_capacity(src.len() / QK * 18);
    for blk in src.chunks_exact(QK) {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in blk {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..16 {
            let q0 = ((blk[j] * id + 8.5) as i32).clamp(0, 15) as u8;
            let q1 = ((blk[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
    out
}

/// Quantise `src` (a multiple of 32 long) to Q8_0 as ggml's reference does (`d = amax / 127`).
pub fn quantize_q8_0(src: &[f32]) -> Vec<u8> {
    assert!(src.len().is_multiple_of(QK), "Q8_0 needs whole blocks");
    let mut out = Vec::with_capacity(src.len() / QK * 34);
    for blk in src.chunks_exact(QK) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for &v in blk {
            out.push(((v * id).round() as i32).clamp(-128, 127) as i8 as u8);
        }
    }
    out
}

/// Encode f32 values in `dtype`: the float types exactly (to nearest), the quantised ones
/// through this module's quantizers.
pub fn encode_float(dtype: DType, src: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => src.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => src
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => src
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::Q4_0 => quantize_q4_0(src),
        DType::Q8_0 => quantize_q8_0(src),
        DType::Q4_K | DType::Q5_K => kquants::quantize_q45_k(dtype, src),
        DType::Q6_K => kquants::quantize_q6_k(src),
        DType::MLX_A4 | DType::MLX_A8 => mlx::quantize(dtype, src),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_hand_computed_block() {
        // d = 0.5 (f16 0x3800); byte j = low nibble j, high nibble 15 - j.
        let mut bytes = vec![0x00, 0x38];
        for j in 0..16u8 {
            bytes.push(j | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        dequantize(DType::Q4_0, &bytes, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5, "low nibble {j}");
            assert_eq!(
                out[j + 16],
                ((15 - j) as f32 - 8.0) * 0.5,
                "high nibble {j}"
            );
        }
        assert_eq!(out[0], -4.0);
        assert_eq!(out[16], 3.5);
    }

    #[test]
    fn q8_0_hand_computed_block() {
        // d = 2.0 (f16 0x4000); q = j - 16.
        let mut bytes = vec![0x00, 0x40];
        for j in 0..32i32 {
            bytes.push((j - 16) as i8 as u8);
        }
        let mut out = [0f32; 32];
        dequantize(DType::Q8_0, &bytes, &mut out).unwrap();
        for (j, v) in out.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 2.0);
        }
    }

    #[test]
    fn float_types_hand_computed() {
        let mut out = [0f32; 2];
        dequantize(DType::F16, &[0x00, 0x3c, 0x00, 0xc0], &mut out).unwrap();
        assert_eq!(out, [1.0, -2.0]);
        dequantize(DType::BF16, &[0x80, 0x3f, 0x40, 0x40], &mut out).unwrap();
        assert_eq!(out, [1.0, 3.0]);
        dequantize(DType::F32, &[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0][..], &mut out).unwrap();
        assert_eq!(out, [1.0, -2.0]);
    }

    #[test]
    fn float_types_refuse_non_finite_elements() {
        let mut out = [0f32; 3];
        // F16 NaN at element 1, BF16 +inf at element 2, F32 -inf at element 0.
        let cases: [(DType, &[u8], u64); 3] = [
            (DType::F16, &[0x00, 0x3c, 0x00, 0x7e, 0x00, 0x3c], 1),
            (DType::BF16, &[0x80, 0x3f, 0x80, 0x3f, 0x80, 0x7f], 2),
            (
                DType::F32,
                &[0, 0, 0x80, 0xff, 0, 0, 0x80, 0x3f, 0, 0, 0x80, 0x3f],
                0,
            ),
        ];
        for (dtype, bytes, at) in cases {
            let e = dequantize(dtype, bytes, &mut out).unwrap_err();
            assert!(
                matches!(e, QuantError::NonFiniteValue { index, value, .. } if index == at && !value.is_finite()),
                "{dtype:?}: {e}"
            );
            assert!(
                e.to_string()
                    .contains(&format!("element {at} is not finite")),
                "{e}"
            );
        }
    }

    #[test]
    fn nan_scale_is_an_error() {
        let mut bytes = vec![0x00, 0x7e]; // f16 NaN
        bytes.extend([0u8; 16]);
        let mut out = [0f32; 32];
        let e = dequantize(DType::Q4_0, &bytes, &mut out).unwrap_err();
        assert!(
            matches!(e, QuantError::NonFiniteScale { block: 0, .. }),
            "{e}"
        );
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize(DType::Q4_0, &[0u8; 18], &mut out),
            Err(QuantError::NotWholeBlocks { .. })
        ));
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(DType::Q4_0, &[0u8; 17], &mut out),
            Err(QuantError::WrongByteCount { .. })
        ));
        assert!(matches!(
            DType::F32.byte_size(u64::MAX / 2),
            Err(QuantError::Overflow { .. })
        ));
        assert!(DType::from_ggml_id(12345).is_err());
    }

    #[test]
    fn quantize_round_trips_within_half_a_step() {
        let src: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 17) as f32 - 8.3) * 0.11)
            .collect();
        for dtype in [DType::Q4_0, DType::Q8_0] {
            let bytes = encode_float(dtype, &src);
            let mut out = vec![0f32; 64];
            dequantize(dtype, &bytes, &mut out).unwrap();
            for (blk_s, blk_o) in src.chunks(32).zip(out.chunks(32)) {
                let amax = blk_s.iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = if dtype == DType::Q4_0 {
                    amax / 8.0
                } else {
                    amax / 127.0
                };
                for (a, b) in blk_s.iter().zip(blk_o) {
                    assert!((a - b).abs() <= step * 0.5 + 1e-3, "{dtype:?} {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn ggml_ids_round_trip() {
        for t in DType::ALL {
            match t.ggml_id() {
                Some(id) => assert_eq!(DType::from_ggml_id(id).unwrap(), t),
                None => assert!(matches!(t, DType::MLX_A4 | DType::MLX_A8)),
            }
        }
    }
}
