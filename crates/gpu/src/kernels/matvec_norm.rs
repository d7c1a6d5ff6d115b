//! The norm-on-load binders of [`MatvecKernel`] (the decode's qkv: `y = m · rmsnorm(h)` with
//! the RMSNorm inside the dispatch): a dispatch per part of the matrix, each part at the rows
//! per team of its own rows, the first optionally warming another matrix into L2
//! (kernels/warm.rs); and a stack of two parts in two forms (a `Q4_K_M` qkv) as one dispatch
//! over a pipeline compiled for that pair at its first use (matvec_wgsl.rs `q4f_pair_body`).

use super::{
    check_norm_input, check_out, lanes_per_row, q4f, q4f_rows_per_wg, warm, Fused, MatvecBinding,
    MatvecKernel, NormInput, PairKey, Which, WARM_BINDINGS,
};
use crate::context::{Context, GpuError, Result};
use crate::kernels::matvec_wgsl::{q4f_input, q4f_pair_body, PAIR_BINDINGS};
use crate::state::with_state;
use crate::tensor::{Q4Matrix, Q4Part, BLOCK};
use std::sync::Arc;

impl MatvecKernel {
    /// `y[0..rows] = m · rmsnorm(h)`: the RMSNorm before the matvec fused into it. A matrix
    /// of several parts (a `Q4_K_M` qkv: v in Q6_K) takes one dispatch per part, each part's
    /// rows per team chosen for its own rows (the 512 rows of a Q6_K v over 64 workgroups
    /// rather than 16).
    pub fn bind_q4_norm(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: NormInput<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
    ) -> Result<MatvecBinding> {
        self.bind_norm_parts(ctx, m, x, y, state, None)
    }

    /// [`Self::bind_q4_norm`] whose first dispatch also reads `warm` (another matrix's part,
    /// read by a later dispatch of the step, and [`warm::sink`]) into L2 in extra workgroups
    /// (kernels/warm.rs): the same `y`.
    pub fn bind_q4_norm_warm(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: NormInput<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
        warm: (&Q4Part, &wgpu::Buffer),
    ) -> Result<MatvecBinding> {
        self.bind_norm_parts(ctx, m, x, y, state, Some(warm))
    }

    fn bind_norm_parts(
        &self,
        ctx: &Context,
        m: &Q4Matrix,
        x: NormInput<'_>,
        y: &wgpu::Buffer,
        state: &wgpu::Buffer,
        warm: Option<(&Q4Part, &wgpu::Buffer)>,
    ) -> Result<MatvecBinding> {
        m.check_layout("matvec_q4 (norm)")?;
        check_norm_input(&x, m.cols, "matvec_q4 (norm)")?;
        check_out(y, m.rows, "matvec_q4 (norm)")?;
        if let [a, b] = m.parts.as_slice() {
            if a.form != b.form && self.pair_forms {
                return self.bind_norm_pair(ctx, (a, b), m.cols, x, (y, state), warm);
            }
        }
        let bpr = m.cols / BLOCK as u32;
        let mut dispatches = Vec::with_capacity(m.parts.len());
        for (i, part) in m.parts.iter().enumerate() {
            // A whole matrix keeps the rows per team of its rows (and any override of them).
            let rpt = self.rows_per_team(if m.parts.len() == 1 {
                m.rows
            } else {
                part.rows
            });
            let warm = warm.filter(|_| i == 0);
            let fused = if warm.is_some() {
                Fused::NormWarm
            } else {
                Fused::Norm
            };
            let which = self.for_form(q4f(rpt, fused, m.cols)?, part.form, "matvec_q4 (norm)")?;
            let n_rows = part.rows.div_ceil(q4f_rows_per_wg(which, rpt));
            let grid = ctx.grid(n_rows + warm.map_or(0, |(w, _)| warm::workgroups(w)));
            let words = [
                part.rows,
                bpr,
                part.row_start,
                grid.0,
                x.eps.to_bits(),
                n_rows,
                0,
                0,
            ];
            let p = ctx.uniform("matvec.params", bytemuck::cast_slice(&words))?;
            let mut entries = norm_entries(part, &x, y, &p, state);
            if let Some((wp, sink)) = warm {
                entries.extend(warm::entries(wp, sink, WARM_BINDINGS));
            }
            let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
            let bg = ctx.bind_group_at("matvec_q4.norm", self.ready(ctx, which)?, &ids, &res)?;
            dispatches.push((which, bg, grid));
        }
        Ok(MatvecBinding {
            dispatches,
            pair: None,
        })
    }

    /// [`Self::bind_norm_parts`] for a stack of two parts in two forms: one dispatch
    /// (matvec_wgsl.rs `q4f_pair_body`), its first workgroups on the first part, the next on
    /// the second, then any warm ones.
    /// The parts are a checked matrix's two, of `cols` columns.
    fn bind_norm_pair(
        &self,
        ctx: &Context,
        (a, b): (&Q4Part, &Q4Part),
        cols: u32,
        x: NormInput<'_>,
        (y, state): (&wgpu::Buffer, &wgpu::Buffer),
        warm: Option<(&Q4Part, &wgpu::Buffer)>,
    ) -> Result<MatvecBinding> {
        // check_layout: the parts tile the rows in order, so b starts where a ends.
        let (ra, rb) = (self.rows_per_team(a.rows), self.rows_per_team(b.rows));
        // Both forms must be this kernel's, as for a dispatch per part.
        for (part, r) in [(a, ra), (b, rb)] {
            let which = q4f(r, Fused::Norm, cols)?;
            self.for_form(which, part.form, "matvec_q4 (norm, two forms)")?;
        }
        let lanes = lanes_per_row(cols / BLOCK as u32);
        let key = ((ra, rb), (a.form, b.form), warm.is_some(), lanes);
        let pipe = self.pair_pipeline(ctx, key)?;
        let teams = 256 / lanes;
        let (na, nb) = (a.rows.div_ceil(teams * ra), b.rows.div_ceil(teams * rb));
        let grid = ctx.grid(na + nb + warm.map_or(0, |(w, _)| warm::workgroups(w)));
        let words = [
            a.rows,
            cols / BLOCK as u32,
            a.row_start,
            grid.0,
            x.eps.to_bits(),
            na + nb,
            na,
            b.rows,
        ];
        let p = ctx.uniform("matvec.params", bytemuck::cast_slice(&words))?;
        let (qb, sb) = PAIR_BINDINGS;
        let mut entries = norm_entries(a, &x, y, &p, state);
        entries.extend([
            (qb, b.qs.as_entire_binding()),
            (sb, b.scales.as_entire_binding()),
        ]);
        if let Some((wp, sink)) = warm {
            entries.extend(warm::entries(wp, sink, WARM_BINDINGS));
        }
        let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
        let bg = ctx.bind_group_at("matvec_q4.norm_pair", &pipe, &ids, &res)?;
        Ok(MatvecBinding {
            dispatches: vec![(Which::Pair, bg, grid)],
            pair: Some(pipe),
        })
    }

    /// The two-form norm-on-load pipeline of `key`, compiled at its first use.
    fn pair_pipeline(&self, ctx: &Context, key: PairKey) -> Result<Arc<wgpu::ComputePipeline>> {
        let mut pairs = self
            .pairs
            .lock()
            .map_err(|_| GpuError::Shape("matvec: the pipeline cache was poisoned".into()))?;
        if let Some((_, p)) = pairs.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone());
        }
        let ((ra, rb), (fa, fb), warmed, lanes) = key;
        let f = if warmed { Fused::NormWarm } else { Fused::Norm };
        let wgsl = with_state(&format!(
            "{}const R: u32 = {ra}u;\n{}",
            q4f_input(f, false, self.late_norm),
            q4f_pair_body((ra, rb), lanes, (fa, fb))
        ));
        let label = format!(
            "matvec_q4f.pair.r{ra}.r{rb}.t{lanes}.{f:?}.{}.{}",
            fa.name(),
            fb.name()
        );
        // SAFETY: as for the one-form pipelines (`with_forms`): `bind_norm_pair` binds the
        // checked parts of one matrix (`check_layout`: each part's blocks and scale words
        // cover its rows x bpr, the parts tile the rows in order, so the second part's rows
        // are stored from row_start + rows of the first, below m.rows = y's checked size);
        // workgroup wg < p2 reads the first part's rows below p.rows (past it: row 0), the
        // others the second's below p3 (past it: row 0, and rows beyond either part are never
        // stored); the staged input and the warm workgroups are the one-form kernel's; `red`
        // holds the larger part's NT R TP partials.
        let pipe = Arc::new(unsafe { ctx.compute_unchecked(&label, &wgsl, "main")? });
        pairs.push((key, pipe.clone()));
        Ok(pipe)
    }
}

/// The bindings of a norm-on-load dispatch over `part` (matvec_q4f.wgsl 0-6).
fn norm_entries<'a>(
    part: &'a Q4Part,
    x: &NormInput<'a>,
    y: &'a wgpu::Buffer,
    params: &'a wgpu::Buffer,
    state: &'a wgpu::Buffer,
) -> Vec<(u32, wgpu::BindingResource<'a>)> {
    vec![
        (0, part.qs.as_entire_binding()),
        (1, part.scales.as_entire_binding()),
        (2, x.h.as_entire_binding()),
        (3, x.weight.as_entire_binding()),
        (4, y.as_entire_binding()),
        (5, params.as_entire_binding()),
        (6, state.as_entire_binding()),
    ]
}
