//! The int4 matvec pipelines compiled at their first binding ([`MatvecKernel`]'s tables hold
//! `OnceLock`s: a model uses a few of each form's variants), with the bounds proof of the
//! unchecked int4 x f32 ones.

use super::{q4_table_index, q4f_index, Fused, MatvecKernel, Which, F32_ROWS_PER_TEAM};
use crate::context::{Context, Result};
use crate::kernels::matvec_wgsl::{q4f_body, q4f_input};
use crate::numerics::{act_in_wgsl, Numerics, BFP_DOT, BFP_GLOBAL_IN};
use crate::state::with_state;

impl MatvecKernel {
    /// [`Self::pipeline`], compiling an int4 one at its first binding.
    pub(super) fn ready(&self, ctx: &Context, w: Which) -> Result<&wgpu::ComputePipeline> {
        if let Which::Q4(n, two, t) = w {
            let cell = &self.q4[q4_table_index(n, two, t)];
            if cell.get().is_none() {
                let r = if two { 2 } else { 1 };
                // bfp24 here reads blocks converted in global memory ([`Act::Bfp`]); f32
                // inputs never take this pipeline under bfp24 (they take `q4f`'s).
                let input = match n {
                    Numerics::Bfp24 => format!("{BFP_DOT}{BFP_GLOBAL_IN}"),
                    n => act_in_wgsl(n, 2, 3),
                };
                let body = include_str!("../shaders/matvec_q4.wgsl")
                    .replace("LANES_PER_ROW", &t.to_string());
                let wgsl = with_state(&format!("const R2: u32 = {r}u;\n{input}{body}"));
                let pipe = ctx.compute(&format!("matvec_q4.{n}.r{r}.t{t}"), &wgsl, "main")?;
                // Another thread may have compiled the same source meanwhile: either serves.
                let _ = cell.set(pipe);
            }
            return self.pipeline(w);
        }
        let Which::Q4F(ri, f, slot, t) = w else {
            return self.pipeline(w);
        };
        let cell = &self.q4f[slot][q4f_index(ri, f, t)];
        if cell.get().is_none() {
            let (r, form) = (F32_ROWS_PER_TEAM[ri], self.forms[slot]);
            let label = format!(
                "matvec_q4f.r{r}.t{t}.{f:?}.{}{}",
                form.name(),
                if self.bfp { ".bfp" } else { "" }
            );
            let late = self.late_norm && matches!(f, Fused::Norm | Fused::NormWarm);
            let wgsl = with_state(&format!(
                "{}const R: u32 = {r}u;\n{}",
                q4f_input(f, self.bfp, late),
                q4f_body(r, t, form)
            ));
            // Compiled without naga's runtime bounds checks: with them the whole decode
            // step (qkv, o-proj + folded router, lm_head) ran 6.8% slower on the H200
            // (docs/BENCHMARKS.md run 113).
            // SAFETY: every index of matvec_q4f.wgsl and its snippets (matvec_wgsl.rs) stays
            // in bounds for every binding this kernel makes, because its only binders
            // (`bind_q4_parts`, `bind_q4_router`, `bind_norm_parts`) check on the host:
            // - `Q4Matrix::check_layout`: cols % 32 == 0, rows >= 1, parts tiling the rows,
            //   each part's qs >= part rows * bpr blocks of the form (`QB`s) and scales >= ceil(that / 2) words,
            //   so a block r * bpr + b with r < part rows (rows past the end read row 0) and
            //   b < bpr, b0 = min(lane, bpr - 1) with bpr >= 1, is in both (the affine
            //   form reads the same scale word, blk >> 1, as Q4_0's `scale(blk)`);
            // - `y` holds m.rows floats (`check_out`) and stores go to row_start + row with
            //   row < part rows, row_start + part rows <= m.rows;
            // - the staged input has bpr * 8 = cols / 4 vec4s, cols <= NORM_ON_LOAD_MAX (so
            //   below nol_xs' 1024 slots; the swizzle permutes within a group of 8, and
            //   n4 is a multiple of 8), read from act_x / nol_h / nol_w which hold cols
            //   floats (`check_x`, `check_norm_input`); bfp24's bfp_amax / bfp_ps /
            //   bfp_d are indexed below n4 / n4 / n4 / 8, each thread's i = li + 256 t < n4;
            // - red (NT R TP floats, NT = 256 / T teams: 264, 272, 288, 320 and 384 at
            //   T = 32, 16, 8, 4 and 2 for R = 1): row partials at (team R + i) TP + lane with team < NT, i < R,
            //   lane < T, sums of rows k < NT R (k = li + 256 i) over j < T; nol_red's
            //   li + li / 16 <= 270 < 272, 17 li + j <= 270 for li, j < 16;
            // - the folded router's workgroups (wg >= p1): e = wg - p1 is used only when
            //   e < p2 = E; fold_w holds E (cols + rows) floats, c < c4 = cols/4 + rows/4,
            //   act_x read below cols / 4, fold_h (rows floats) below rows / 4; its tree
            //   reads red[li + st] < 256 <= red's size;
            // - the warm workgroups index their bindings below arrayLength (warm.rs);
            // - loops run to bpr, n4, T or constants, and every divisor is a constant.
            let pipe = unsafe { ctx.compute_unchecked(&label, &wgsl, "main")? };
            // Another thread may have compiled the same source meanwhile: either copy serves.
            let _ = cell.set(pipe);
        }
        self.pipeline(w)
    }
}
