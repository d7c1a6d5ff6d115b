//! kernel_bench's rows of the MoE over columns (multi-stream decode): every [`ColsForm`] at
//! nb = 1, 2, 4, 8 with random and shared routes.

use super::{fixtures, q4, Runner, Spec};
use nibble_gpu::columns::{self, Col, MAX_COLUMNS};
use nibble_gpu::context::Context;
use nibble_gpu::kernels::moe::{router_ref, ColsForm, ColsRead, MoeColsBuffers, MoeKernel};
use rand::{Rng, RngCore};

/// Routing slots the column MoE rows rotate over, so consecutive calls read different experts
/// (one slot's union at nb = 1 would stay in an H200's L2).
const COL_SLOTS: usize = 16;

/// Rows of the MoE over columns: every form of [`ColsForm`] at nb = 1, 2, 4, 8, with random
/// and shared routes (see the call site).
pub(super) fn bench_moe_cols(
    ctx: &Context,
    r: &mut Runner<'_>,
    sp: &dyn Fn(String, usize, usize, bool, u64) -> Spec,
    kern: &MoeKernel,
    m: usize,
    rng: &mut impl Rng,
) -> anyhow::Result<()> {
    let p = kern.params();
    let (e, k, h, i) = (
        p.experts as usize,
        p.top_k as usize,
        p.hidden as usize,
        p.inter as usize,
    );
    let nmax = MAX_COLUMNS;
    let gate = fixtures::q4_copies(ctx, rng, (e * i, h, i), 1)?.remove(0);
    let up = fixtures::q4_copies(ctx, rng, (e * i, h, i), 1)?.remove(0);
    let down = fixtures::q4_copies(ctx, rng, (e * h, i, h), 1)?.remove(0);
    let f32s = |label: &str, n: usize, rng: &mut dyn RngCore| {
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        ctx.storage_init(label, bytemuck::cast_slice(&v))
    };
    let x = f32s("cols.x", nmax * h, rng)?;
    let out = f32s("cols.out", nmax * h, rng)?;
    let route = ctx.storage("cols.route", (nmax * 2 * k * 4) as u64)?;
    let hbuf = ctx.storage("cols.h", (nmax * k * i * 4) as u64)?;
    // Per slot: logits [8, E] for both route patterns.
    let mut slots: Vec<[Vec<f32>; 2]> = Vec::new();
    for _ in 0..COL_SLOTS {
        let random: Vec<f32> = (0..nmax * e).map(|_| rng.random_range(-2.0..2.0)).collect();
        let shared = random[..e].repeat(nmax);
        slots.push([random, shared]);
    }
    let mut forms = vec![
        ("per-column (default)", ColsForm::PER_COLUMN),
        (
            "union gate_up",
            ColsForm {
                gate_up: ColsRead::Union,
                down: ColsRead::PerColumn,
            },
        ),
    ];
    if kern.cols_union_down() {
        forms.push(("union both", ColsForm::UNION));
    }
    for nb in [1usize, 2, 4, 8] {
        let cols = columns::buffer(ctx, &vec![Col::active(1, 1, 0); nb])?;
        for (pat, pname) in ["random", "shared"].into_iter().enumerate() {
            // The mean union size over the slots, from the reference router.
            let mut union = 0usize;
            let mut logits = Vec::new();
            for sl in &slots {
                let lg = &sl[pat][..nb * e];
                let mut ids: Vec<u32> = lg
                    .chunks(e)
                    .flat_map(|c| router_ref(c, k, p.norm_topk_prob).0)
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                union += ids.len();
                logits.push(ctx.storage_init("cols.logits", bytemuck::cast_slice(lg))?);
            }
            let union = union as f64 / COL_SLOTS as f64;
            let weights = (union * 3.0 * q4(i, h) as f64) as u64;
            let acts = 4 * nb as u64 * (e + 2 * h + 2 * k * i + 2 * h) as u64;
            for (fname, form) in &forms {
                let binds = logits
                    .iter()
                    .map(|lg| {
                        let bufs = MoeColsBuffers {
                            state: &r.b.state,
                            cols: &cols,
                            nb: nb as u32,
                            logits: lg,
                            route: &route,
                            x: &x,
                            gate: &gate,
                            up: &up,
                            down: &down,
                            h: &hbuf,
                            out: &out,
                            residual: true,
                        };
                        kern.bind_cols_with(ctx, &bufs, *form)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let name = format!("moe cols nb={nb} {pname} (union {union:.1} experts) {fname}");
                let disp = binds[0].dispatch_count();
                r.case(sp(name, disp, 0, true, weights + acts), m, &|pass, c| {
                    kern.record_cols(pass, ctx, &binds[c % binds.len()])
                })?;
            }
        }
    }
    Ok(())
}
