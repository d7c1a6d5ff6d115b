//! The qkv projection and the step's attention in ONE dispatch, for the positions of a short
//! context (formats-spec §1.4 steps 2-6).
//!
//! The dispatch is the qkv matvec of the fused plan (matvec_q4f.wgsl, RMSNorm on load, the
//! rows per team of the plan's qkv) with a tail (shaders/qkv_attention.wgsl): each workgroup,
//! once its rows are stored, counts itself in its kv head's arrival counter, and the last of that
//! head's workgroups to arrive (the last-arriver pattern of the fused attention combine) attends
//! alone over every position: q/k RMSNorm + RoPE (attention_rope.wgsl, the chunk kernel's own
//! code), the KV-cache write of row `pos`, scores, softmax and the weighted sum of V, written to
//! `att` for the o-proj. So a layer needs no attention dispatch: 4 dispatches per layer instead
//! of 5 while `pos < max_positions`; past that the plan records the matvec and the chunked
//! attention as before, which spreads long contexts over many workgroups.
//!
//! **Off by default** (`--tune qkv_attn=N` turns it on below position N): on the H200 it is
//! slower than the two dispatches it replaces (tg128 269.6 against 324.6 tok/s, BENCHMARKS run
//! 101). kernel_bench's ablation rows say where: the matvec with its arrival count is 12.3 us
//! (11.2 alone), the k norm + RoPE + KV write adds 3.9 us, the queries' norm + RoPE with the
//! scores 9.6 us even at position 1 (two rows!), the softmax 2.8, the weighted sum of V
//! 1.9-5.7: ~19 us of tail on one workgroup against 7.8-11.2 us for the whole chunk attention
//! dispatch. Kept, tested, for the next attempt (that 9.6 us is not understood; BENCHMARKS
//! runs 98-102).
//!
//! Requirements, checked when the kernel is built ([`QkvAttentionKernel::new`] returns `None`
//! where they fail and the plan keeps the two dispatches): workgroups can publish to each other
//! ([`Context::publishes_across_workgroups`], Vulkan), the matvec's rows per workgroup divide
//! `D` (every workgroup's rows belong to one kv head), the qkv matrix is one binding, and the
//! workgroup memory fits the device.
//!
//! Invariants: the arrival counters (`[Hkv]` u32, one buffer for every layer) are zero between
//! dispatches; `qkv` keeps the raw projection (tracing reads it); KV row `pos` is written only
//! by the step at `pos`, as in attention.rs.

use super::attention::{rope, AttentionParams};
use super::matvec::{check_norm_input, check_out, params, rows_index, NormInput};
use super::matvec_wgsl::{q4f_body, q4f_input};
use crate::context::{Context, GpuError, Result};
use crate::state::with_state;
use crate::tensor::{Q4Matrix, BLOCK};

/// Threads per workgroup of the matvec (and so of the tail).
const WG: u32 = 256;

/// The position bound measured on the H200 (`--tune qkv_attn=256`: a step at `pos < 256`
/// records 4 dispatches per layer). Not the default: there the form is slower (module docs).
pub const MEASURED_MAX_POSITIONS: u32 = 256;

/// The compiled qkv + attention pipeline of one model shape.
#[derive(Debug)]
pub struct QkvAttentionKernel {
    pub params: AttentionParams,
    pipeline: wgpu::ComputePipeline,
    /// Rows per team of the matvec part (one of `F32_ROWS_PER_TEAM`).
    rows_per_team: u32,
    /// A step attends over at most this many positions (`pos < max_positions`).
    max_positions: u32,
    /// `[D/2]` f32 RoPE inverse frequencies.
    inv_freq: wgpu::Buffer,
}

/// What one layer's qkv + attention dispatch reads and writes.
#[derive(Clone, Copy)]
pub struct QkvAttentionBuffers<'a> {
    /// `[Hq*D + 2 Hkv*D, H]` the fused q|k|v projection (one part).
    pub m: &'a Q4Matrix,
    /// The residual stream `h [H]` and the attention RMSNorm weight.
    pub x: NormInput<'a>,
    /// `[Hq*D + 2 Hkv*D]` f32: the raw projection (written).
    pub qkv: &'a wgpu::Buffer,
    /// `[D]` f32 q_norm / k_norm weights.
    pub q_norm: &'a wgpu::Buffer,
    pub k_norm: &'a wgpu::Buffer,
    /// `[ctx, Hkv, D]` f32 this layer's cache.
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    /// `[Hq*D]` f32 attention output.
    pub out: &'a wgpu::Buffer,
    /// `[Hkv]` u32 arrival counters ([`QkvAttentionKernel::arrivals`]), zero between dispatches.
    pub arrive: &'a wgpu::Buffer,
    pub state: &'a wgpu::Buffer,
}

/// One layer's bind group, created once.
#[derive(Debug)]
pub struct QkvAttentionBinding {
    bind_group: wgpu::BindGroup,
    grid: (u32, u32),
}

impl QkvAttentionKernel {
    /// The kernel for attention `params` whose qkv matvec takes `rows_per_team` rows per team
    /// (the plan's), scaling its norm late when `late_norm` (matvec_wgsl.rs), serving steps at
    /// positions below `max_positions` (at least 1). `Ok(None)` where the device or the shape
    /// cannot take the fused form (module docs); an error for a bad argument.
    pub fn new(
        ctx: &Context,
        params: AttentionParams,
        rows_per_team: u32,
        late_norm: bool,
        max_positions: u32,
    ) -> Result<Option<Self>> {
        Self::with_source_edit(ctx, params, rows_per_team, late_norm, max_positions, &|s| s)
    }

    /// [`Self::new`] with the WGSL passed through `edit` before compiling: kernel_bench's
    /// ablation rows cut the tail at its `//@STOP_*` marks with it. Not for decoding.
    pub fn with_source_edit(
        ctx: &Context,
        params: AttentionParams,
        rows_per_team: u32,
        late_norm: bool,
        max_positions: u32,
        edit: &dyn Fn(String) -> String,
    ) -> Result<Option<Self>> {
        params.validate()?;
        rows_index(rows_per_team)?;
        if max_positions == 0 {
            return Err(GpuError::Shape(
                "qkv attention: a bound of 0 positions".into(),
            ));
        }
        let p = &params;
        let (d, g) = (p.head_dim, p.group());
        let d4 = d / 4;
        let rpw = 8 * rows_per_team;
        // Workgroup memory: the matvec's staging (16 KiB, which also holds the queries), norm
        // sums (272 + 16 floats) and reduction (8 rows x 33 floats per row per team), the
        // tail's stats and flag, the rope's (cos, sin) table and rms; then 4 G bytes per
        // position of the scores, which bound the positions where the device has less room
        // (lavapipe and Metal: 32 KiB).
        let fixed =
            16384 + 4 * 272 + 64 + 4 * 8 * 33 * rows_per_team + 4 * g + 4 + 4 * d + 4 * (g + 1);
        let limit = ctx.limits.max_compute_workgroup_storage_size;
        let fit = limit.saturating_sub(fixed) / (4 * g);
        let maxp = max_positions.min(p.ctx).min(fit);
        // Position groups of the weighted sum of V (a power of two; see the shader).
        let pg = 1u32 << (WG / d4).ilog2();
        let staged = (2 * g + 2) * d4 <= 1024 && pg / 2 * g * d4 <= 1024;
        if !ctx.publishes_across_workgroups() || d % rpw != 0 || !staged || maxp == 0 {
            return Ok(None);
        }
        let lg = 1u32 << (WG / g).ilog2();
        let lr = 1u32 << (WG / (g + 1)).max(1).ilog2();
        let consts = [
            ("D", d),
            ("D4", d4),
            ("HQ", p.heads),
            ("HKV", p.kv_heads),
            ("G", g),
            ("CTX", p.ctx),
            ("WG", WG),
            ("LR", lr),
            ("LG", lg),
            ("MAXP", maxp),
            ("PG", pg),
            ("PVU", PV_UNROLL),
            ("QKV_RPW", rpw),
            ("ARRIVALS", (g + 2) * d / rpw),
        ]
        .iter()
        .map(|(n, v)| format!("const {n}: u32 = {v}u;\n"))
        .collect::<String>()
            + &format!(
                "const EPS: f32 = {:e};\nconst SCALE: f32 = {:e};\n",
                p.eps,
                rope(p).score_scale()
            );
        let src = with_state(&format!(
            "{consts}{}{}const R: u32 = {rows_per_team}u;\n{}{}{}",
            super::attention::kv_wgsl(p.cache),
            q4f_input(super::matvec::Fused::Norm, false, late_norm),
            matvec_part(rows_per_team),
            rope_part(),
            tail_part(g, d4),
        ));
        let pipeline = ctx.compute("qkv_attention", &edit(src), "main")?;
        let table = rope(p).inv_freq;
        let inv_freq = ctx.storage_init("qkv_attention.inv_freq", bytemuck::cast_slice(&table))?;
        Ok(Some(QkvAttentionKernel {
            params,
            pipeline,
            rows_per_team,
            max_positions: maxp,
            inv_freq,
        }))
    }

    /// Whether a step at a position up to `pos_bound` can take this form.
    pub fn serves(&self, pos_bound: u32) -> bool {
        pos_bound < self.max_positions
    }

    /// Most positions a step of this form attends over.
    pub fn max_positions(&self) -> u32 {
        self.max_positions
    }

    /// The `[Hkv]` arrival counters one plan shares between its layers (zeroed).
    pub fn arrivals(&self, ctx: &Context) -> Result<wgpu::Buffer> {
        ctx.storage("qkv_attention.arrive", self.params.kv_heads as u64 * 4)
    }

    pub fn bind(&self, ctx: &Context, b: &QkvAttentionBuffers<'_>) -> Result<QkvAttentionBinding> {
        self.bind_at(ctx, b, 0)
    }

    /// [`Self::bind`] with the caches read and written from byte `kv_offset` on (a KV slot of
    /// the multi-stream caches, plan_slots.rs; a multiple of the device's storage offset
    /// alignment).
    pub fn bind_at(
        &self,
        ctx: &Context,
        b: &QkvAttentionBuffers<'_>,
        kv_offset: u64,
    ) -> Result<QkvAttentionBinding> {
        let p = &self.params;
        let (d, g) = (p.head_dim as u64, p.group() as u64);
        let rows = (p.heads + 2 * p.kv_heads) * p.head_dim;
        let bad = |m: String| Err(GpuError::Shape(format!("qkv attention: {m}")));
        if b.m.form() != Some(crate::tensor::QForm::Q4_0) {
            return bad(format!(
                "reads Q4_0 matrices only, not {}",
                b.m.form_names()
            ));
        }
        if b.m.rows != rows || b.m.parts.len() != 1 {
            return bad(format!(
                "the qkv matrix has {} rows in {} parts (need {rows} in one)",
                b.m.rows,
                b.m.parts.len()
            ));
        }
        check_norm_input(&b.x, b.m.cols, "qkv attention")?;
        check_out(b.qkv, rows, "qkv attention")?;
        let cache = p.cache_bytes();
        let align = ctx.limits.min_storage_buffer_offset_alignment as u64;
        if kv_offset % align != 0 {
            return bad(format!(
                "cache offset {kv_offset} is not a multiple of {align}"
            ));
        }
        let small = [
            (b.q_norm, d * 4, "q_norm"),
            (b.k_norm, d * 4, "k_norm"),
            (b.k_cache, kv_offset + cache, "k_cache"),
            (b.v_cache, kv_offset + cache, "v_cache"),
            (b.out, p.heads as u64 * d * 4, "output"),
            (b.arrive, p.kv_heads as u64 * 4, "arrival counters"),
        ];
        for (buf, need, what) in small {
            if buf.size() < need {
                return bad(format!("{what} holds {} bytes, need {need}", buf.size()));
            }
        }
        debug_assert!(g >= 1);
        let part = &b.m.parts[0];
        let bpr = b.m.cols / BLOCK as u32;
        let (prm, grid) = params(ctx, rows, bpr, 0, 8 * self.rows_per_team, b.x.eps)?;
        fn slot(buf: &wgpu::Buffer, offset: u64, size: u64) -> wgpu::BindingResource<'_> {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: buf,
                offset,
                size: std::num::NonZeroU64::new(size),
            })
        }
        let entries = [
            (0, part.qs.as_entire_binding()),
            (1, part.scales.as_entire_binding()),
            (2, b.x.h.as_entire_binding()),
            (3, b.x.weight.as_entire_binding()),
            (4, b.qkv.as_entire_binding()),
            (5, prm.as_entire_binding()),
            (6, b.state.as_entire_binding()),
            (7, b.q_norm.as_entire_binding()),
            (8, b.k_norm.as_entire_binding()),
            (9, self.inv_freq.as_entire_binding()),
            (10, slot(b.k_cache, kv_offset, cache)),
            (11, slot(b.v_cache, kv_offset, cache)),
            (12, b.out.as_entire_binding()),
            (13, b.arrive.as_entire_binding()),
        ];
        let (ids, res): (Vec<u32>, Vec<_>) = entries.into_iter().unzip();
        let bind_group = ctx.bind_group_at("qkv_attention", &self.pipeline, &ids, &res)?;
        Ok(QkvAttentionBinding { bind_group, grid })
    }

    /// Record the one dispatch.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, b: &QkvAttentionBinding) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &b.bind_group, &[]);
        pass.dispatch_workgroups(b.grid.0, b.grid.1, 1);
    }
}

/// matvec_q4f.wgsl for `r` rows per team with `y` coherent (the last arriver reads the rows of
/// other workgroups) and the tail called after the row stores.
fn matvec_part(r: u32) -> String {
    // 32 lanes per row (8 teams), which `rpw` and the workgroup memory above count: this form
    // is off by default and measured at the real shape only.
    let body = q4f_body(r, 32, crate::tensor::QForm::Q4_0);
    let decl = "@group(0) @binding(4) var<storage, read_write> y";
    let tail = "    // TAIL:";
    debug_assert!(body.contains(decl) && body.contains(tail));
    body.replacen(decl, &format!("/*COHERENT*/{decl}"), 1)
        .replacen(
            tail,
            "    attn_tail(wid.x + wid.y * p.gx, li);\n    // TAIL:",
            1,
        )
}

/// attention_rope.wgsl reading the raw projection from the tail's copy of it (`fa_x`).
fn rope_part() -> String {
    let rope = include_str!("../shaders/attention_rope.wgsl");
    let from = "return qkv[i / 4u][i % 4u];";
    debug_assert!(rope.contains(from));
    rope.replacen(from, "return fa_x(i);", 1)
}

/// Rows of V each thread loads per round of the weighted sum (`PVU` in the shader).
const PV_UNROLL: u32 = 8;
/// K vec4s of a score row loaded per group before their dots.
const SCORE_LOADS: u32 = 8;

/// qkv_attention.wgsl with the per-head lines of the score loop and of the weighted sum of V
/// written out for G heads and D4 vec4s per row: separate variables and straight-line loads,
/// since a per-thread array indexed in a loop may be placed in slow local memory by the
/// driver's compiler (BENCHMARKS runs 93-95) and a loop's loads may stay in a dependent chain
/// (run 100).
fn tail_part(g: u32, d4: u32) -> String {
    let heads = |f: &dyn Fn(u32) -> String| (0..g).map(f).collect::<Vec<_>>().join("\n");
    let mut score = String::new();
    for d0 in (0..d4).step_by(SCORE_LOADS as usize) {
        let block = d0..(d0 + SCORE_LOADS).min(d4);
        for d in block.clone() {
            score += &format!("let k{d} = kv_in(k_cache[row + {d}u]);\n");
        }
        for d in block {
            score += &heads(&|j| format!("s{j} += dot(nol_xs[{}u], k{d});", j * d4 + d));
            score += "\n";
        }
    }
    let mut loads = String::from("let v0 = kv_in(v_cache[(t0 * HKV + h) * D4 + c]);\n");
    let mut body = heads(&|j| format!("o{j} = fma(vec4<f32>(fa_p[t0 * G + {j}u]), v0, o{j});"));
    for u in 1..PV_UNROLL {
        loads += &format!(
            "let t{u} = min(t0 + {u}u * PG, n - 1u);
let m{u} = select(0.0, 1.0, t0 + {u}u * PG < n);
let v{u} = kv_in(v_cache[(t{u} * HKV + h) * D4 + c]);\n"
        );
        body += "\n";
        body += &heads(&|j| {
            format!("o{j} = fma(vec4<f32>(fa_p[t{u} * G + {j}u] * m{u}), v{u}, o{j});")
        });
    }
    include_str!("../shaders/qkv_attention.wgsl")
        .replace("//SCORE_DECL", &heads(&|j| format!("var s{j} = 0.0;")))
        .replace(
            "//SCORE_BODY",
            &format!("//@SCORE_BEGIN\n{score}//@SCORE_END\n"),
        )
        .replace(
            "//SCORE_STORE",
            &heads(&|j| format!("fa_p[t * G + {j}u] = s{j};")),
        )
        .replace(
            "//PV_DECL",
            &heads(&|j| format!("var o{j} = vec4<f32>(0.0);")),
        )
        .replace("//PV_LOADS", &loads)
        .replace("//PV_BODY", &body)
        .replace(
            "//PV_PUT",
            &heads(&|j| format!("nol_xs[((pg - half) * G + {j}u) * D4 + c] = o{j};")),
        )
        .replace(
            "//PV_ADD",
            &heads(&|j| format!("o{j} += nol_xs[(pg * G + {j}u) * D4 + c];")),
        )
        .replace(
            "//PV_STORE",
            &heads(&|j| format!("att[(h * G + {j}u) * D4 + c] = o{j} * fa_ml[{j}u];")),
        )
}

#[cfg(test)]
#[path = "qkv_attention_tests.rs"]
mod tests;
