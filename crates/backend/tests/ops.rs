//! Hand-checkable micro cases for each op of the reference forward pass, and `argmax`.

mod common;

use common::uniform;
use nibble_backend::argmax;
use nibble_backend::reference::attention::{attention, AttnDims};
use nibble_backend::reference::moe::{route, route_logits};
use nibble_backend::reference::ops::{
    dot_f64, matvec, rmsnorm, rmsnorm_heads, rope_head, silu, softmax,
};
use nibble_model::rope::{rope_table, RopeTable};
use nibble_model::weights::Weight;
use nibble_quant::DType;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The plain rotation (no scaling) for base `theta` and head size `d`.
fn rope_inv_freq(theta: f32, d: usize) -> RopeTable {
    rope_table(theta, None, d)
}

fn close(a: f32, b: f64, rel: f64) -> bool {
    (a as f64 - b).abs() <= rel * b.abs().max(1e-30)
}

#[test]
fn rmsnorm_of_a_known_vector() {
    // mean(x²) = 4, so x / sqrt(4 + 1e-6) ≈ x / 2, times w.
    let mut out = [0f32; 4];
    rmsnorm(
        &[2.0, -2.0, 2.0, -2.0],
        &[1.0, 2.0, 0.5, 1.0],
        1e-6,
        &mut out,
    );
    let inv = 1.0 / (4.0f64 + 1e-6).sqrt();
    for (o, e) in out.iter().zip([2.0 * inv, -4.0 * inv, inv, -2.0 * inv]) {
        assert!(close(*o, e, 1e-7), "{out:?}");
    }
    assert!((out[1] + 2.0).abs() < 1e-6);
    // Mean of squares 7.5 for [1, 2, 3, 4].
    rmsnorm(&[1.0, 2.0, 3.0, 4.0], &[1.0; 4], 0.5, &mut out);
    assert!(close(out[3], 4.0 / 8.0f64.sqrt(), 1e-7), "{out:?}");
    // All-zero input stays zero thanks to eps (no NaN).
    rmsnorm(&[0.0; 4], &[1.0; 4], 1e-6, &mut out);
    assert_eq!(out, [0.0; 4]);
}

#[test]
fn qk_norm_shares_one_weight_across_heads() {
    let mut x = vec![2.0, -2.0, 1.0, 1.0, 3.0, 4.0];
    rmsnorm_heads(&mut x, &[1.0, 2.0], 0.0);
    // head 0: rms 2 -> [1, -2]; head 1: rms 1 -> [1, 2]; head 2: rms sqrt(12.5).
    let r = 12.5f64.sqrt();
    let want = [1.0, -2.0, 1.0, 2.0, 3.0 / r, 8.0 / r];
    for (a, b) in x.iter().zip(want) {
        assert!(close(*a, b, 1e-7), "{x:?}");
    }
}

#[test]
fn rope_inverse_frequencies() {
    let f = rope_inv_freq(10_000.0, 8).inv_freq;
    assert_eq!(f.len(), 4);
    for (a, b) in f.iter().zip([1.0, 0.1, 0.01, 0.001]) {
        assert!(close(*a, b, 1e-7), "{f:?}");
    }
    let f = rope_inv_freq(1e6, 128).inv_freq;
    assert!(close(f[63], 1e6f64.powf(-126.0 / 128.0), 1e-7));
}

#[test]
fn rope_at_position_zero_is_identity() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let x = uniform(&mut rng, 16, 2.0);
    let mut y = x.clone();
    rope_head(&mut y, &rope_inv_freq(1e6, 16), 0);
    assert_eq!(x, y);
}

#[test]
fn rope_rotates_pair_i_with_i_plus_half() {
    let rope = rope_inv_freq(10_000.0, 8);
    let f = &rope.inv_freq; // [1, 0.1, 0.01, 0.001]
    let p = 3usize;
    // A unit vector in element 0 rotates into element 4 (not element 1).
    let mut x = vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    rope_head(&mut x, &rope, p);
    assert!(
        close(x[0], 3f64.cos(), 1e-7) && close(x[4], 3f64.sin(), 1e-7),
        "{x:?}"
    );
    assert_eq!([x[1], x[2], x[3], x[5], x[6], x[7]], [0.0; 6]);
    // A general vector: pair (i, i+4) rotated by p·f_i.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let x0 = uniform(&mut rng, 8, 1.0);
    let mut x = x0.clone();
    rope_head(&mut x, &rope, p);
    for i in 0..4 {
        let ang = p as f64 * f[i] as f64;
        let (a, b) = (x0[i] as f64, x0[i + 4] as f64);
        assert!(close(x[i], a * ang.cos() - b * ang.sin(), 1e-6), "i={i}");
        assert!(
            close(x[i + 4], b * ang.cos() + a * ang.sin(), 1e-6),
            "i={i}"
        );
    }
}

#[test]
fn softmax_topk_and_renormalise_on_a_known_row() {
    let logits = [1.0f32, 3.0, 2.0, 3.0, 0.0];
    let e = [1f64.exp(), 3f64.exp(), 2f64.exp(), 3f64.exp(), 1.0];
    let s: f64 = e.iter().sum();
    let p = softmax(&logits);
    for (a, b) in p.iter().zip(e.iter().map(|x| x / s)) {
        assert!(close(*a, b, 1e-7), "{p:?}");
    }
    // Equal probabilities: the lower index comes first.
    let (_, r) = route_logits(&logits, 2, true);
    assert_eq!(r.experts, vec![1, 3]);
    assert_eq!(r.weights, vec![0.5, 0.5]);
    let (_, r) = route_logits(&logits, 3, true);
    assert_eq!(r.experts, vec![1, 3, 2]);
    let z = 2.0 * e[1] + e[2];
    for (a, b) in r.weights.iter().zip([e[1] / z, e[1] / z, e[2] / z]) {
        assert!(close(*a, b, 1e-7), "{r:?}");
    }
    // norm_topk_prob = false: the raw softmax probabilities.
    let (_, r) = route_logits(&logits, 3, false);
    assert_eq!(r.experts, vec![1, 3, 2]);
    assert_eq!(r.weights, vec![p[1], p[3], p[2]]);
    assert!(close(r.weights[2], e[2] / s, 1e-7));
}

#[test]
fn route_picks_by_probability_not_position() {
    let probs = [0.05f32, 0.4, 0.1, 0.3, 0.15];
    let r = route(&probs, 3, false);
    assert_eq!(r.experts, vec![1, 3, 4]);
    assert_eq!(r.weights, vec![0.4, 0.3, 0.15]);
}

#[test]
fn silu_known_values() {
    assert_eq!(silu(0.0), 0.0);
    assert!(close(silu(1.0), 1.0 / (1.0 + (-1f64).exp()), 1e-7));
    assert!(close(silu(-1.0), -1.0 / (1.0 + 1f64.exp()), 1e-7));
    assert!(close(silu(2.5), 2.5 / (1.0 + (-2.5f64).exp()), 1e-7));
    assert_eq!(silu(40.0), 40.0);
}

#[test]
fn attention_with_one_position_returns_v_exactly() {
    let dims = AttnDims {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let q = uniform(&mut rng, 32, 3.0);
    let k = uniform(&mut rng, 16, 3.0);
    let v = uniform(&mut rng, 16, 3.0);
    let mut out = vec![0f32; 32];
    attention(&dims, &q, &k, &v, &mut out);
    for j in 0..4 {
        let g = j / 2;
        assert_eq!(&out[j * 8..(j + 1) * 8], &v[g * 8..(g + 1) * 8], "head {j}");
    }
}

#[test]
fn attention_two_positions_hand_computed() {
    let dims = AttnDims {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
    };
    // Scores 0 and ln 3 (after the 1/sqrt(2) scale): weights 1/4 and 3/4.
    let q = [1.0f32, 0.0];
    let k = [0.0f32, 0.0, (3f64.ln() * 2f64.sqrt()) as f32, 0.0];
    let v = [4.0f32, 0.0, 0.0, 8.0];
    let mut out = [0f32; 2];
    attention(&dims, &q, &k, &v, &mut out);
    assert!(
        close(out[0], 1.0, 1e-6) && close(out[1], 6.0, 1e-6),
        "{out:?}"
    );
}

/// Naive attention of query head `j` against kv head `g`, in f64.
fn naive_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    j: usize,
    g: usize,
    hkv: usize,
    d: usize,
) -> Vec<f64> {
    let n = k.len() / (hkv * d);
    let s: Vec<f64> = (0..n)
        .map(|m| {
            (0..d)
                .map(|i| q[j * d + i] as f64 * k[m * hkv * d + g * d + i] as f64)
                .sum::<f64>()
                / (d as f64).sqrt()
        })
        .collect();
    let mx = s.iter().cloned().fold(f64::MIN, f64::max);
    let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
    (0..d)
        .map(|i| {
            (0..n)
                .map(|m| (s[m] - mx).exp() / z * v[m * hkv * d + g * d + i] as f64)
                .sum()
        })
        .collect()
}

#[test]
fn gqa_query_head_j_reads_kv_head_j_over_group() {
    let (hq, hkv, d, n) = (8, 2, 16, 5);
    let dims = AttnDims {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let q = uniform(&mut rng, hq * d, 2.0);
    let k = uniform(&mut rng, n * hkv * d, 2.0);
    let v = uniform(&mut rng, n * hkv * d, 2.0);
    let mut out = vec![0f32; hq * d];
    attention(&dims, &q, &k, &v, &mut out);
    for j in 0..hq {
        assert_eq!(dims.kv_head_of(j), j / 4);
        let want = naive_head(&q, &k, &v, j, j / 4, hkv, d);
        for (a, b) in out[j * d..(j + 1) * d].iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5, "head {j}");
        }
        // The interleaved mapping (j % Hkv) would differ for heads 1..=6.
        if j % hkv != j / 4 {
            let wrong = naive_head(&q, &k, &v, j, j % hkv, hkv, d);
            let diff: f64 = out[j * d..(j + 1) * d]
                .iter()
                .zip(&wrong)
                .map(|(a, b)| (*a as f64 - b).abs())
                .sum();
            assert!(diff > 1e-2, "head {j} also matches kv head {}", j % hkv);
        }
    }
}

#[test]
fn matvec_decodes_rows_on_the_fly() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (rows, cols) = (6, 64);
    let vals = uniform(&mut rng, rows * cols, 1.0);
    let x = uniform(&mut rng, cols, 1.0);
    // Two parts of three rows each, like a per-expert checkpoint.
    let bytes: Vec<Vec<u8>> = vals
        .chunks(3 * cols)
        .map(|c| nibble_quant::encode_float(DType::Q4_0, c))
        .collect();
    let w = Weight {
        dtype: DType::Q4_0,
        shape: vec![2, 3, cols],
        parts: bytes.iter().map(|b| b.as_slice()).collect(),
    };
    let mut full = vec![0f32; rows];
    matvec(&w, 0, &x, &mut full).unwrap();
    for r in 0..rows {
        let mut row = vec![0f32; cols];
        nibble_quant::dequantize(DType::Q4_0, w.row(r), &mut row).unwrap();
        assert_eq!(full[r], dot_f64(&row, &x) as f32, "row {r}");
        // Q4_0 error is small relative to the f32 product.
        let exact = dot_f64(&vals[r * cols..(r + 1) * cols], &x);
        assert!(
            (full[r] as f64 - exact).abs() < 0.5,
            "row {r}: {} vs {exact}",
            full[r]
        );
    }
    let mut part = vec![0f32; 2];
    matvec(&w, 3, &x, &mut part).unwrap();
    assert_eq!(part, full[3..5]);
    let err = matvec(&w, 5, &x, &mut part).unwrap_err().to_string();
    assert!(err.contains("rows 5..7"), "{err}");
    let err = matvec(&w, 0, &x[..32], &mut part).unwrap_err().to_string();
    assert!(err.contains("64 elements"), "{err}");
}

#[test]
fn argmax_ties_and_nan() {
    assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, f32::NAN]), 2);
    assert_eq!(argmax(&[1.0, f32::NAN, 0.0]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax(&[-5.0, f32::INFINITY, f32::NAN]), 1);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[]), 0);
}
