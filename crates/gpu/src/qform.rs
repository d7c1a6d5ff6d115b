//! The block forms a GPU matrix may hold ([`QForm`]) and the WGSL each compiles into the
//! kernels that read it: the payload (`QB`, `qb_dot`, `qb_levels`: [`Q4_PAYLOAD`],
//! [`Q8_PAYLOAD`], [`Q6_PAYLOAD`], [`Q5_PAYLOAD`]), the scale word (`SW`, `q4_sb`: [`Q4_SB`], [`Q4_SB_K`]) and
//! the coefficients every dot shares ([`Q4_COEF`]). The layouts themselves are described in
//! `tensor.rs`'s module docs ("module docs" below).

/// WGSL payload of the nibble forms (Q4_0, affine): `QB` is one vec4 of nibble words, whose
/// block dot is numerics.rs's `dq_block` (Σ (q - 8) x; [`QForm::dot_fn`]);
/// `qb_levels(w, k)` = the unsigned levels of elements 4k .. 4k + 3 (k < 8).
pub const Q4_PAYLOAD: &str = "
alias QB = vec4<u32>;
fn qb_levels(w: QB, k: u32) -> vec4<f32> {
    let v = w[k & 3u] >> (4u * (k >> 2u));
    return vec4<f32>((vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
}
";

/// WGSL payload of the byte form (Q8_0): `QB` is two vec4s, byte `j` of the block = element
/// `j` stored as `q + 128` (module docs). `qb_dot(w, x)` = Σ q x: each word's bytes become
/// exact floats by the mantissa trick of numerics.rs `F32_DEQ` (`2^23 + u` from one OR; lanes
/// 1 and 3 carry `256 u`, scaled back by an exact 1/256 at the end), four products per word in
/// two chains. `qb_levels(w, k)` = the stored levels `u` of elements 4k .. 4k + 3.
pub const Q8_PAYLOAD: &str = "
struct QB { lo: vec4<u32>, hi: vec4<u32> };
fn dq8(w: u32) -> vec4<f32> {
    let s = w >> 16u;
    return bitcast<vec4<f32>>((vec4<u32>(w, w, s, s) & vec4<u32>(0xFFu, 0xFF00u, 0xFFu, 0xFF00u))
        | vec4<u32>(0x4B000000u)) - vec4<f32>(8388736.0, 8421376.0, 8388736.0, 8421376.0);
}
// Scales lanes (e, 256 e, e, 256 e) of dq8's products back to one.
const DQ8_S = vec4<f32>(1.0, 0.00390625, 1.0, 0.00390625);
fn qb_dot(w: QB, x: array<vec4<f32>, 8>) -> f32 {
    let h = qb_sums(w, x);
    return h.x + h.y;
}
fn qb_levels(w: QB, k: u32) -> vec4<f32> {
    let v = select(w.lo[k & 3u], w.hi[k & 3u], k >= 4u);
    return vec4<f32>((vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u));
}
alias QBY = QB;
fn qb_bytes(w: QB) -> QBY { return w; }
";

/// WGSL payload of the 6-bit form (Q6_K, module docs): `QB` is seven words, 28 bytes per
/// block: Q4_0's nibble words of the levels' low four bits, two words of their top two bits
/// (`h0` elements 0-15, `h1` 16-31, two bits each), and `s`, the two i8 sub-scales (elements
/// 0-15 in byte 0, 16-31 in byte 1). `qb_bytes(w)` = the block as the byte form's two vec4s
/// (byte `j` = element `j`'s level). The top bits are stored in the order that makes this
/// cheap: element `4k + t` of a half sits at bits `8t + 2k` of its word, so nibble word `k`'s
/// four top-bit pairs are byte-aligned already and one shift by `4 - 2k` and one mask put them
/// at bits 4-5 of their bytes (`q6_top`: 7 operations per half where moving fields stored in
/// element order took 36, for a form whose decode is bound by its unpacking: pure Q6_K tg128
/// 291.4 tok/s against 264.3 in element order, BENCHMARKS run 163). `dq8` masks each
/// byte to its 6-bit level (`q - 32` exactly, by the mantissa trick); `q6_sub(w, half)` = a
/// half's sub-scale. `qb_dot(w, x)` = Σ sc (q - 32) x (each half's sum times its sub-scale:
/// the integers `sc (q - 32)` are what the block's `d` multiplies); `qb_levels(w, k)` =
/// `sc (q - 32) + 32` for elements 4k .. 4k + 3, so that `(level - Q_OFF) d` is the weight,
/// exactly.
pub const Q6_PAYLOAD: &str = "
struct QB { w0: u32, w1: u32, w2: u32, w3: u32, h0: u32, h1: u32, s: u32 };
struct QBY { lo: vec4<u32>, hi: vec4<u32> };
fn q6_top(h: u32) -> vec4<u32> {
    return vec4<u32>(h << 4u, h << 2u, h, h >> 2u) & vec4<u32>(0x30303030u);
}
fn qb_bytes(w: QB) -> QBY {
    let q = vec4<u32>(w.w0, w.w1, w.w2, w.w3);
    let m = vec4<u32>(0x0F0F0F0Fu);
    return QBY((q & m) | q6_top(w.h0), ((q >> vec4<u32>(4u)) & m) | q6_top(w.h1));
}
fn dq8(w: u32) -> vec4<f32> {
    let s = w >> 16u;
    return bitcast<vec4<f32>>((vec4<u32>(w, w, s, s) & vec4<u32>(0x3Fu, 0x3F00u, 0x3Fu, 0x3F00u))
        | vec4<u32>(0x4B000000u)) - vec4<f32>(8388640.0, 8396800.0, 8388640.0, 8396800.0);
}
const DQ8_S = vec4<f32>(1.0, 0.00390625, 1.0, 0.00390625);
fn q6_sub(w: QB, half: u32) -> f32 {
    return f32(bitcast<i32>(w.s << (24u - 8u * half)) >> 24u);
}
fn qb_dot(v: QB, x: array<vec4<f32>, 8>) -> f32 {
    let h = qb_sums(qb_bytes(v), x);
    return fma(q6_sub(v, 0u), h.x, q6_sub(v, 1u) * h.y);
}
fn qb_levels(v: QB, k: u32) -> vec4<f32> {
    let w = qb_bytes(v);
    let u = select(w.lo[k & 3u], w.hi[k & 3u], k >= 4u);
    let sc = q6_sub(v, select(0u, 1u, k >= 4u));
    let q = vec4<f32>((vec4<u32>(u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(63u));
    return fma(vec4<f32>(sc), q - 32.0, vec4<f32>(32.0));
}
";

/// WGSL payload of the 5-bit K form (Q5_K, module docs): `QB` is five words, Q4_0's nibble
/// words and one word of fifth bits, 20 bytes per block. `qb_bytes(w)` = the block as the byte
/// form's two vec4s (byte `j` = element `j`'s level, 0..31): each nibble word's four nibbles
/// with their four fifth bits at bits 4, 12, 20 and 28. The fifth bits are stored in the order
/// that makes this one shift and one mask per word (`q5_top`): element `16 half + 4k + t` at
/// bit `8t + 4 half + k`, so nibble word `k`'s four sit a byte apart already. `dq8` is the byte
/// form's with the offset 16 (`Q_OFF`), the centre of the levels, so that `c1 = 16 c0 - dmin m`
/// stays as small as the weights; `qb_dot` and `qb_levels` as [`Q8_PAYLOAD`]'s over those
/// bytes.
pub const Q5_PAYLOAD: &str = "
struct QB { w0: u32, w1: u32, w2: u32, w3: u32, h: u32 };
struct QBY { lo: vec4<u32>, hi: vec4<u32> };
fn q5_top(h: u32) -> vec4<u32> {
    return vec4<u32>(h << 4u, h << 3u, h << 2u, h << 1u) & vec4<u32>(0x10101010u);
}
fn qb_bytes(w: QB) -> QBY {
    let q = vec4<u32>(w.w0, w.w1, w.w2, w.w3);
    let m = vec4<u32>(0x0F0F0F0Fu);
    return QBY((q & m) | q5_top(w.h), ((q >> vec4<u32>(4u)) & m) | q5_top(w.h >> 4u));
}
fn dq8(w: u32) -> vec4<f32> {
    let s = w >> 16u;
    return bitcast<vec4<f32>>((vec4<u32>(w, w, s, s) & vec4<u32>(0xFFu, 0xFF00u, 0xFFu, 0xFF00u))
        | vec4<u32>(0x4B000000u)) - vec4<f32>(8388624.0, 8392704.0, 8388624.0, 8392704.0);
}
const DQ8_S = vec4<f32>(1.0, 0.00390625, 1.0, 0.00390625);
fn qb_dot(v: QB, x: array<vec4<f32>, 8>) -> f32 {
    let h = qb_sums(qb_bytes(v), x);
    return h.x + h.y;
}
fn qb_levels(v: QB, k: u32) -> vec4<f32> {
    let w = qb_bytes(v);
    let u = select(w.lo[k & 3u], w.hi[k & 3u], k >= 4u);
    return vec4<f32>((vec4<u32>(u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u));
}
";

/// WGSL every wide payload's `qb_dot` shares, after the payload (`QBY`, `dq8`, `DQ8_S`):
/// `qb_sums(w, x)` = the sums over the block's two halves of `level - Q_OFF` times x, each half
/// one chain of four vec4 fmas over `dq8`'s words, the two chains interleaved.
pub const BYTE_SUMS: &str = "
fn qb_sums(w: QBY, x: array<vec4<f32>, 8>) -> vec2<f32> {
    var a = dq8(w.lo.x) * x[0];
    var b = dq8(w.hi.x) * x[4];
    a = fma(dq8(w.lo.y), x[1], a);
    b = fma(dq8(w.hi.y), x[5], b);
    a = fma(dq8(w.lo.z), x[2], a);
    b = fma(dq8(w.hi.z), x[6], b);
    a = fma(dq8(w.lo.w), x[3], a);
    b = fma(dq8(w.hi.w), x[7], b);
    return vec2<f32>(dot(a, DQ8_S), dot(b, DQ8_S));
}
";

/// The block form of a [`crate::tensor::Q4Matrix`]: what a block's payload words and its scale word hold.
/// Every kernel that reads block matrices is compiled for one form ([`QForm::wgsl`]) and
/// refuses a matrix of another by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QForm {
    /// ggml's Q4_0: 16 nibble bytes per block, f16 scale `d`, weight `(q - 8) d`.
    #[default]
    Q4_0,
    /// MLX's `MLX_A4` groups of 64 (module docs): nibbles as Q4_0's, one word per group with
    /// the bf16 scale and bias, weight `s q + b`.
    Affine4,
    /// ggml's Q8_0: 32 bytes per block (two vec4s, module docs), f16 scale `d` as Q4_0's,
    /// weight `q d` with `q` the signed byte.
    Q8_0,
    /// MLX's `MLX_A8` groups of 64: bytes as Q8_0's (each group two blocks; the unsigned level
    /// `q` stored as is, so `q - 128` is what the payload's dot sees), one word per group with
    /// the bf16 scale and bias as [`QForm::Affine4`]'s, weight `s q + b`.
    Affine8,
    /// ggml's Q6_K: nibbles, two top bits and each 16 weights' i8 sub-scale per block
    /// ([`Q6_PAYLOAD`]), the super-block's f16 `d` per block as Q4_0's scales, weight
    /// `d sc (q - 32)`.
    Q6K,
    /// ggml's Q4_K: nibbles as Q4_0's (each super-block of 256 its eight blocks of 32), scale
    /// words of two u32 per pair of blocks (module docs), weight `d sc q - dmin m`.
    Q4K,
    /// ggml's Q5_K: Q4_0's nibbles plus a word of fifth bits per block ([`Q5_PAYLOAD`], each
    /// super-block's eight blocks of 32) with [`QForm::Q4K`]'s scale words, weight `d sc q -
    /// dmin m`.
    Q5K,
}

impl QForm {
    /// Every form, in [`Self::index`] order.
    pub const ALL: [QForm; 7] = [
        QForm::Q4_0,
        QForm::Affine4,
        QForm::Q8_0,
        QForm::Affine8,
        QForm::Q6K,
        QForm::Q4K,
        QForm::Q5K,
    ];

    /// Position in [`Self::ALL`] (pipeline tables keyed by form).
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether a block's dot needs the `c1 · Σ x` term (a scale word with a bias).
    pub fn affine(self) -> bool {
        matches!(
            self,
            QForm::Affine4 | QForm::Affine8 | QForm::Q4K | QForm::Q5K
        )
    }

    /// Whether the scale words are the K-quants' (two u32 per pair of blocks: the super-block's
    /// `d` and `dmin`, the pair's 6-bit scales and mins; [`Q4_SB_K`]).
    pub fn k_words(self) -> bool {
        matches!(self, QForm::Q4K | QForm::Q5K)
    }

    /// Whether the prefill GEMM's matrix-unit kernel (gemm_coop.rs) reads this form: the nibble
    /// forms with 16-bit scale words (Q4_0, MLX's affine groups); the others take f32 fmas.
    pub fn on_matrix_units(self) -> bool {
        matches!(self, QForm::Q4_0 | QForm::Affine4)
    }

    /// Bytes of the scale word of one pair of blocks (`SW`): 8 for the K-quants' (their
    /// super-block's `d` and `dmin` beside the pair's 6-bit scales and mins), 4 for every
    /// other form.
    pub fn scale_word_bytes(self) -> u64 {
        if self.k_words() {
            8
        } else {
            4
        }
    }

    /// Whether a block's dot is the byte forms' (`qb_dot` over `qb_bytes`, levels past 4 bits)
    /// rather than the nibbles' (`dq_block`).
    pub fn wide(self) -> bool {
        matches!(self, QForm::Q8_0 | QForm::Affine8 | QForm::Q6K | QForm::Q5K)
    }

    /// The WGSL function of a block's dot with 32 staged activations, `(w: QB, x) -> f32` =
    /// Σ (level - offset) x: numerics.rs's `dq_block` for nibbles (whose bfp24 variant takes
    /// other activations), [`Q8_PAYLOAD`]'s `qb_dot` for bytes.
    pub fn dot_fn(self) -> &'static str {
        if self.wide() {
            "qb_dot"
        } else {
            "dq_block"
        }
    }

    /// A WGSL source written for the nibble forms (`dq_block` as each block's dot) made to read
    /// this form: for the byte form every `dq_block(` becomes `qb_dot(`.
    pub fn with_dot(self, wgsl: &str) -> String {
        if self.wide() {
            wgsl.replace("dq_block(", "qb_dot(")
        } else {
            wgsl.to_string()
        }
    }

    /// Bytes of one 32-weight block's payload in `qs`: 16 for nibbles, 32 for bytes, 20 for
    /// Q5_K's nibbles and fifth bits, 28 for Q6_K's nibbles, top bits and sub-scales.
    pub fn block_bytes(self) -> u64 {
        match self {
            QForm::Q5K => 20,
            QForm::Q6K => 28,
            f if f.wide() => 32,
            _ => 16,
        }
    }

    /// The form the kernels read a stored type in, or `None` for a type they do not read
    /// packed (F32/F16/BF16 and the other K-quants: decoded to f32 at upload where allowed).
    pub fn of(dtype: nibble_quant::DType) -> Option<QForm> {
        use nibble_quant::DType;
        Some(match dtype {
            DType::Q4_0 => QForm::Q4_0,
            DType::MLX_A4 => QForm::Affine4,
            DType::Q8_0 => QForm::Q8_0,
            DType::MLX_A8 => QForm::Affine8,
            DType::Q6_K => QForm::Q6K,
            DType::Q4_K => QForm::Q4K,
            DType::Q5_K => QForm::Q5K,
            _ => return None,
        })
    }

    /// The form's name in errors and labels.
    pub fn name(self) -> &'static str {
        match self {
            QForm::Q4_0 => "Q4_0",
            QForm::Affine4 => "affine (MLX_A4)",
            QForm::Q8_0 => "Q8_0",
            QForm::Affine8 => "affine 8-bit (MLX_A8)",
            QForm::Q6K => "Q6_K",
            QForm::Q4K => "Q4_K",
            QForm::Q5K => "Q5_K",
        }
    }

    /// WGSL prepended to a kernel reading matrices of this form: `const Q4_AFFINE`, `const
    /// Q_OFF` (the offset the stored levels carry: 8 for nibbles, 128 for bytes, 32 for Q6_K,
    /// 16 for Q5_K), [`Q4_COEF`] and the payload ([`Q4_PAYLOAD`], [`Q8_PAYLOAD`],
    /// [`Q6_PAYLOAD`] or [`Q5_PAYLOAD`]: the block type `QB`, `qb_dot`, `qb_levels`, and for
    /// the wide forms `qb_bytes`, the block as two vec4s of bytes, and [`BYTE_SUMS`]). Kernels
    /// declare their weight bindings `array<QB>`.
    pub fn wgsl(self) -> String {
        let (off, payload) = match self {
            QForm::Q6K => ("32.0", Q6_PAYLOAD),
            QForm::Q5K => ("16.0", Q5_PAYLOAD),
            f if f.wide() => ("128.0", Q8_PAYLOAD),
            _ => ("8.0", Q4_PAYLOAD),
        };
        let sb = match self.k_words() {
            true => Q4_SB_K,
            false => Q4_SB,
        };
        let sums = if self.wide() { BYTE_SUMS } else { "" };
        format!(
            "const Q4_AFFINE: bool = {};\nconst Q_OFF: f32 = {off};\n{sb}{Q4_COEF}{payload}{sums}",
            self.affine()
        )
    }
}

/// The scale word `SW` and `q4_sb` of every form but Q4_K: one u32 per pair of blocks, two f16
/// `d` (block `2k` low), or the affine group's bf16 scale (low) and bias (high).
pub const Q4_SB: &str = "
alias SW = u32;
fn q4_sb(v: SW, i: u32) -> vec2<f32> {
    if (Q4_AFFINE) {
        return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xFFFF0000u));
    }
    let d = unpack2x16float(v);
    return vec2<f32>(select(d.x, d.y, (i & 1u) == 1u), 0.0);
}
";

/// Q4_K's `SW` and `q4_sb` (module docs): `v.x` = the super-block's f16 `d` (low) and `dmin`,
/// `v.y` = the pair's 6-bit scale and min, 12 bits per block (block `2k` low). The weight is
/// `(d sc) q - dmin m`: both products exact in f32 (11 + 6 significant bits), so one rounding,
/// as the reference's.
pub const Q4_SB_K: &str = "
alias SW = vec2<u32>;
fn q4_sb(v: SW, i: u32) -> vec2<f32> {
    let dm = unpack2x16float(v.x);
    let sm = v.y >> (12u * (i & 1u));
    return vec2<f32>(dm.x * f32(sm & 63u), -(dm.y * f32((sm >> 6u) & 63u)));
}
";

/// WGSL, prepended by the host to every kernel that reads a [`crate::tensor::Q4Matrix`] (after [`QForm::wgsl`]'s
/// `const Q4_AFFINE: bool`, `const Q_OFF` and `alias SW`, the scale word of a pair of blocks):
/// `q4_sb(v, i)`, block `i`'s `(scale, bias)` from its scale word `v` (an affine weight is
/// `scale · q + bias` with `q` the stored level; a non-affine one `scale · (q - Q_OFF)`, bias
/// 0), `q4_coef(v, i)`, the two coefficients of its dot (module docs), and `q4_xsum(x)`, the sum
/// of one block's 32 activations. Kernels declare their scale bindings `array<SW>` and read
/// them only through these, so a form may widen its scale words.
pub const Q4_COEF: &str = "
fn q4_coef(v: SW, i: u32) -> vec2<f32> {
    let sb = q4_sb(v, i);
    if (Q4_AFFINE) {
        return vec2<f32>(sb.x, fma(Q_OFF, sb.x, sb.y));
    }
    return sb;
}
fn q4_xsum(x: array<vec4<f32>, 8>) -> f32 {
    let a = (x[0] + x[1]) + (x[2] + x[3]);
    let b = (x[4] + x[5]) + (x[6] + x[7]);
    return dot(a + b, vec4<f32>(1.0));
}
";
