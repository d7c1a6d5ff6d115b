// The router folded through the o-proj (router_fold.rs), computed once per layer at plan
// creation: row e of `fold` [E, Q + H] is
//   fold[e, j]     = Σ_r Wr[e, r] · w[r] · Wo[r, j]   (j < Q: M = Wr · diag(w) · dequant(Wo))
//   fold[e, Q + r] = Wr[e, r] · w[r]                   (r < H: Wr' = Wr · diag(w))
// so that Wr · diag(w) · (h + Wo · att) = fold[e] · [att | h]: the router's pre-norm logits
// from the attention output and the residual stream before the o-proj, which the o-proj dispatch
// computes alongside its own rows (matvec.rs `Fused::Router`).
// Grid: (ceil((Q + H) / 256), E); thread j of workgroup (_, e) computes fold[e, j], an f32
// accumulation over r in order.
//
// qs, sc   Wo [H, Q] blocks of the form prepended (tensor.rs QForm::wgsl), one part
// wr       [E, H] f32 router
// wn       [H] f32 post-attention RMSNorm weight
// fold     [E, Q + H] f32 (written)

struct Params { e: u32, q: u32, hdim: u32, pad: u32 };

@group(0) @binding(0) var<storage, read> qs: array<QB>;
@group(0) @binding(1) var<storage, read> sc: array<SW>; // [rows * bpr / 2] scale words (tensor.rs QForm)
@group(0) @binding(2) var<storage, read> wr: array<f32>;
@group(0) @binding(3) var<storage, read> wn: array<f32>;
@group(0) @binding(4) var<storage, read_write> fold: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

fn scale(i: u32) -> f32 {
    return q4_coef(sc[i >> 1u], i).x;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n = p.q + p.hdim;
    let j = wid.x * 256u + li;
    let e = wid.y;
    if (j >= n || e >= p.e) {
        return;
    }
    if (j >= p.q) {
        let r = j - p.q;
        fold[e * n + j] = wr[e * p.hdim + r] * wn[r];
        return;
    }
    // Element t of a block: lane t % 4 of the form's levels of elements 4 (t / 4) .. (tensor.rs).
    let bpr = p.q / 32u;
    let b = j / 32u;
    let t = j % 32u;
    var acc = 0.0;
    for (var r = 0u; r < p.hdim; r++) {
        let blk = r * bpr + b;
        let nib = qb_levels(qs[blk], t / 4u)[t % 4u];
        var wv: f32;
        if (Q4_AFFINE) {
            // s q + b, as the reference decodes it (s q is exact: 8 + 4 significant bits).
            let sb = q4_sb(sc[blk >> 1u], blk);
            wv = sb.x * nib + sb.y;
        } else {
            wv = scale(blk) * (nib - Q_OFF);
        }
        acc = fma(wr[e * p.hdim + r] * wn[r], wv, acc);
    }
    fold[e * n + j] = acc;
}
