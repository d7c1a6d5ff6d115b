//! Scalar references of the MoE kernels (moe.rs): router top-k, expert gate/up + SiLU, down +
//! weighted combine, in f64 over dequantised weights; the tests compare every kernel form with them.

/// Scalar reference of the router: (ids `[K]`, weights `[K]`) sorted by descending probability,
/// ties to the lower index; softmax in f64 over all E, renormalised over the K iff `norm`.
pub fn router_ref(logits: &[f32], k: usize, norm: bool) -> (Vec<u32>, Vec<f32>) {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let m = logits[idx[0]] as f64;
    let p: Vec<f64> = logits.iter().map(|v| (*v as f64 - m).exp()).collect();
    let all: f64 = p.iter().sum();
    let top: f64 = idx[..k].iter().map(|&e| p[e] / all).sum();
    let w = idx[..k]
        .iter()
        .map(|&e| (p[e] / all / if norm { top } else { 1.0 }) as f32)
        .collect();
    (idx[..k].iter().map(|&e| e as u32).collect(), w)
}

/// Scalar reference of gate/up for one expert: `h = silu(Wg x) * (Wu x)` with dense f32 weights
/// `wg`, `wu` `[I, H]` (dequantised) and input `x [H]`; f64 accumulation.
pub fn gate_up_ref(wg: &[f32], wu: &[f32], x: &[f32]) -> Vec<f32> {
    let hdim = x.len();
    wg.chunks(hdim)
        .zip(wu.chunks(hdim))
        .map(|(rg, ru)| {
            let dot = |r: &[f32]| {
                r.iter()
                    .zip(x)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            };
            let (g, u) = (dot(rg), dot(ru));
            (g / (1.0 + (-g).exp()) * u) as f32
        })
        .collect()
}

/// Scalar reference of down + combine: `y = Σ_k w_k Wd_k h_k` with dense `wd[k]` `[H, I]` and
/// `h[k]` `[I]`; f64 accumulation.
pub fn down_ref(wd: &[&[f32]], h: &[&[f32]], w: &[f32], hidden: usize) -> Vec<f32> {
    let mut y = vec![0f64; hidden];
    for ((wd, h), w) in wd.iter().zip(h).zip(w) {
        for (o, row) in y.iter_mut().zip(wd.chunks(h.len())) {
            *o += *w as f64
                * row
                    .iter()
                    .zip(*h)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>();
        }
    }
    y.into_iter().map(|v| v as f32).collect()
}
