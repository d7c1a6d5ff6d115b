//! The router folded through the o-proj, so the router needs no dispatch of its own.
//!
//! Per layer the fused plan used to run `h += Wo · att` and then `logits = Wr · rmsnorm(h)`: two
//! dispatches, the second waiting on the whole of the first (RMSNorm needs every element of h).
//! Since `rmsnorm(h)_r = s · w_r · h_r` with one scalar `s = 1 / rms(h)`,
//! `logits = s · Wr · diag(w) · (h + Wo · att) = s · fold · [att | h]` with
//! `fold = [Wr · diag(w) · Wo | Wr · diag(w)]` (`[E, Q + H]`, computed here once per layer when
//! the plan is built). The o-proj dispatch computes `z = fold · [att | h]` in extra workgroups
//! next to its own rows (matvec.rs `Fused::Router`; it reads h before anything adds to it), and
//! the MoE gate/up, which normalises `h + a` on load anyway, scales `z` by `s` before the top-k
//! (moe.rs, `gate_up_folded`). Exact algebra; only the f32 rounding order differs from the
//! oracle's `Wr · rmsnorm(h + Wo · att)`.

use crate::context::{Context, GpuError, Result};
use crate::tensor::{F32Matrix, Q4Matrix, QForm};

/// The fold pipelines, one per block form of the o-proj ([`QForm::ALL`] order; each runs
/// once per layer at plan creation).
pub struct RouterFoldKernel {
    pipes: Vec<wgpu::ComputePipeline>,
}

impl RouterFoldKernel {
    pub fn new(ctx: &Context) -> Result<Self> {
        let pipes = QForm::ALL
            .into_iter()
            .map(|f| {
                let src = f.wgsl() + include_str!("../shaders/router_fold.wgsl");
                ctx.compute(&format!("router_fold.{f:?}"), &src, "main")
            })
            .collect::<Result<_>>()?;
        Ok(RouterFoldKernel { pipes })
    }

    /// `[E, Q + H]` f32 `[Wr · diag(w) · Wo | Wr · diag(w)]` for the o-proj `o [H, Q]`, the
    /// router `router [E, H]` and the post-attention RMSNorm weight `w [H]` (one submit; the
    /// caller's next submit sees it).
    pub fn fold(
        &self,
        ctx: &Context,
        o: &Q4Matrix,
        router: &F32Matrix,
        w: &wgpu::Buffer,
    ) -> Result<wgpu::Buffer> {
        let bytes = router.rows as u64 * (o.cols + o.rows) as u64 * 4;
        let out = ctx.storage("router_fold", bytes)?;
        self.fold_into(ctx, o, router, w, &out)?;
        Ok(out)
    }

    /// [`Self::fold`] into an existing buffer (recomputing a layer's fold after its weights
    /// changed on the GPU: plant.rs).
    pub fn fold_into(
        &self,
        ctx: &Context,
        o: &Q4Matrix,
        router: &F32Matrix,
        w: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<()> {
        let (e, h, q) = (router.rows, o.rows, o.cols);
        if router.cols != h || o.parts.len() != 1 || router.parts.len() != 1 {
            return Err(GpuError::Shape(format!(
                "router fold: router [{e}, {}] and o-proj [{h}, {q}] in {} / {} parts (need one \
                 part each and router columns = o rows)",
                router.cols,
                o.parts.len(),
                router.parts.len()
            )));
        }
        if w.size() < h as u64 * 4 {
            return Err(GpuError::Shape(format!(
                "router fold: norm weight holds {} bytes for {h} rows",
                w.size()
            )));
        }
        let n = (q + h) as u64;
        if out.size() < e as u64 * n * 4 {
            return Err(GpuError::Shape(format!(
                "router fold: output holds {} bytes for [{e}, {n}]",
                out.size()
            )));
        }
        let p = ctx.uniform("router_fold.params", bytemuck::cast_slice(&[e, q, h, 0]))?;
        let pipe = &self.pipes[o.one_form("router fold")?.index()];
        let bg = ctx.bind_group(
            "router_fold",
            pipe,
            &[
                o.parts[0].qs.as_entire_binding(),
                o.parts[0].scales.as_entire_binding(),
                router.parts[0].w.as_entire_binding(),
                w.as_entire_binding(),
                out.as_entire_binding(),
                p.as_entire_binding(),
            ],
        )?;
        ctx.run_pass(|pass| {
            pass.set_pipeline(pipe);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups((n as u32).div_ceil(256), e, 1);
        })
    }
}

/// Scalar reference of the fold: `wo [H, Q]` dequantised, `wr [E, H]`, `w [H]`; f64
/// accumulation. Returns `[E, Q + H]`.
pub fn router_fold_ref(
    wo: &[f32],
    wr: &[f32],
    w: &[f32],
    e: usize,
    h: usize,
    q: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(e * (q + h));
    for ei in 0..e {
        let row: Vec<f64> = (0..h)
            .map(|r| wr[ei * h + r] as f64 * w[r] as f64)
            .collect();
        for j in 0..q {
            out.push((0..h).map(|r| row[r] * wo[r * q + j] as f64).sum::<f64>() as f32);
        }
        out.extend(row.iter().map(|v| *v as f32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dequant_q4_0, gpu, rand_f32, rand_q4_0, rng};

    #[test]
    fn fold_matches_reference() {
        let Some(ctx) = gpu("fold_matches_reference") else {
            return;
        };
        let k = RouterFoldKernel::new(&ctx).unwrap();
        let mut r = rng(41);
        // (E, H, Q): odd expert counts, Q != H, Q + H not a multiple of 256.
        for &(e, h, q) in &[(1, 32, 32), (5, 64, 96), (16, 96, 128), (7, 160, 320)] {
            let wo_b = rand_q4_0(&mut r, h, q);
            let wr = rand_f32(&mut r, e * h, -1.0, 1.0);
            let w = rand_f32(&mut r, h, 0.5, 1.5);
            let o = Q4Matrix::upload(&ctx, "o", h, q, 1, &[&wo_b]).unwrap();
            let router = F32Matrix::upload(&ctx, "router", e, h, &wr).unwrap();
            let wb = ctx.storage_init("w", bytemuck::cast_slice(&w)).unwrap();
            let got_b = k.fold(&ctx, &o, &router, &wb).unwrap();
            let got = ctx.read_f32(&got_b, e * (q + h)).unwrap();
            let want = router_fold_ref(&dequant_q4_0(&wo_b, h, q), &wr, &w, e, h, q);
            assert_close(&got, &want, 1e-4, 1e-5, &format!("fold E{e} H{h} Q{q}"));
        }
        // The affine (MLX) form of the o-proj.
        for &(e, h, q) in &[(3, 32, 64), (7, 160, 320)] {
            let wo_b = crate::testing::rand_mlx_a4(&mut r, h, q);
            let wr = rand_f32(&mut r, e * h, -1.0, 1.0);
            let w = rand_f32(&mut r, h, 0.5, 1.5);
            let o =
                Q4Matrix::upload_dtype(&ctx, "o", nibble_quant::DType::MLX_A4, h, q, 1, &[&wo_b])
                    .unwrap();
            let router = F32Matrix::upload(&ctx, "router", e, h, &wr).unwrap();
            let wb = ctx.storage_init("w", bytemuck::cast_slice(&w)).unwrap();
            let got_b = k.fold(&ctx, &o, &router, &wb).unwrap();
            let got = ctx.read_f32(&got_b, e * (q + h)).unwrap();
            let deq = crate::testing::dequant(nibble_quant::DType::MLX_A4, &wo_b, h, q);
            let want = router_fold_ref(&deq, &wr, &w, e, h, q);
            assert_close(
                &got,
                &want,
                1e-4,
                1e-5,
                &format!("affine fold E{e} H{h} Q{q}"),
            );
        }
        // The byte forms of the o-proj (Q8_0, MLX's 8-bit groups, Q6_K, Q5_K) and Q4_K.
        for &(e, h, q, form) in &[
            (3, 32, 64, QForm::Q8_0),
            (7, 160, 320, QForm::Q8_0),
            (5, 96, 192, QForm::Affine8),
            (5, 96, 512, QForm::Q6K),
            (3, 64, 512, QForm::Q4K),
            (3, 64, 768, QForm::Q5K),
        ] {
            let (wo_b, dt) = crate::testing::rand_form(&mut r, form, h, q);
            let wr = rand_f32(&mut r, e * h, -1.0, 1.0);
            let w = rand_f32(&mut r, h, 0.5, 1.5);
            let o = Q4Matrix::upload_dtype(&ctx, "o", dt, h, q, 1, &[&wo_b]).unwrap();
            let router = F32Matrix::upload(&ctx, "router", e, h, &wr).unwrap();
            let wb = ctx.storage_init("w", bytemuck::cast_slice(&w)).unwrap();
            let got_b = k.fold(&ctx, &o, &router, &wb).unwrap();
            let got = ctx.read_f32(&got_b, e * (q + h)).unwrap();
            let deq = crate::testing::dequant(dt, &wo_b, h, q);
            let want = router_fold_ref(&deq, &wr, &w, e, h, q);
            assert_close(
                &got,
                &want,
                1e-4,
                1e-5,
                &format!("{dt:?} fold E{e} H{h} Q{q}"),
            );
        }
    }

    #[test]
    fn fold_refuses_mismatched_shapes() {
        let Some(ctx) = gpu("fold_refuses_mismatched_shapes") else {
            return;
        };
        let k = RouterFoldKernel::new(&ctx).unwrap();
        let mut r = rng(42);
        let o = Q4Matrix::upload(&ctx, "o", 64, 32, 1, &[&rand_q4_0(&mut r, 64, 32)]).unwrap();
        let router =
            F32Matrix::upload(&ctx, "router", 4, 32, &rand_f32(&mut r, 128, -1.0, 1.0)).unwrap();
        let w = ctx.storage("w", 64 * 4).unwrap();
        let err = k
            .fold(&ctx, &o, &router, &w)
            .expect_err("router cols != o rows");
        assert!(err.to_string().contains("router fold"), "{err}");
    }
}
