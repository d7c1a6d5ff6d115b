//! MoE kernels (formats-spec §1.7) and their scalar references.
//!
//! Per layer, after the router logits `[E]` (F32 matvec, not here):
//! - [`Routing::Fused`] (default, 2 dispatches): `gate_up_routed` recomputes softmax + top-k in
//!   every workgroup (one pass of rank counting over E logits, no reductions) and writes the
//!   route for `down`; `down` combines. Saves the router dispatch.
//! - [`Routing::Separate`] (3 dispatches): `router` (one workgroup) writes the route, `gate_up`
//!   reads the expert ids from it, `down` combines.
//!
//! The expert ids never leave the GPU. Top-k ties go to the lower index; the route is sorted by
//! descending weight; weights are renormalised over the K chosen iff `norm_topk_prob`.
//! `gate_up` computes `h_k = silu(Wg[e_k] x) * (Wu[e_k] x)` and writes `h` as f32 `[K, I]` and,
//! for the int8 numerics, quantised per block of 32; `down` computes `y = Σ_k w_k Wd[e_k] h_k`
//! and adds it into (or writes) `out [H]`. The activation form of `x` and `h` (f32, precise int8,
//! int8) is the kernel's [`Numerics`], fixed when it is compiled (numerics.rs).
//!
//! Weights are [`Q4Matrix`] with `rows = E * out`; a tensor split over several bindings must
//! split on whole experts (`row_multiple = out`): one dispatch per part, each part's workgroups
//! skip the experts it does not hold. The route buffer is `[2K]` u32: ids, then weight bits.
//!
//! Two kernel forms per stage:
//! - f32 activations (the default numerics), when the staged vector fits [`STAGE_BUDGET`]:
//!   `moe_gate_up_f32.wgsl` / `moe_down_f32.wgsl` copy the activations each workgroup reads (x
//!   `[H]`; the held slots of h `[K*I]`) into workgroup memory, swizzled so the lanes' block
//!   reads are free of bank conflicts, and dequantise with the mantissa trick; the work split is
//!   [`F32Tuning`] (the down kernel's per-item and per-row lines are written out here, one
//!   variable each, its weight loads issued before the staging).
//!   Reading the activations straight from global memory strides 128 bytes across the lanes
//!   (32 cache lines per load instruction) and held the f32 pair at ~0.4 TB/s on an H200.
//! - int8 / precise int8 activations (and f32 past the budget): `moe_gate_up.wgsl` /
//!   `moe_down.wgsl` reading the activation through the numerics snippet (numerics.rs).
//!
//! The folded router (router_fold.rs, [`MoeKernel::bind_folded`]): `gate_up_folded` stages
//! `rmsnorm(h + a)` itself (a: the o-proj output) and routes on `z / rms(h + a)` (z: the o-proj
//! dispatch's pre-norm logits; the ranks are counted on z, whose order the positive scale keeps,
//! alongside the norm's sum; the weights use the scaled logits); the first down part
//! (`main_add`) writes `h = (h + a) + y`. L2 warming (kernels/warm.rs, [`MoeFolded::warm`]):
//! `main_add_warm` appends workgroups that read the next layer's qkv into L2 (the default), and
//! `gate_up_folded_warm` has each gate/up workgroup read its share of its expert's down
//! weights (selectable, slower on the H200).
//!
//! Multi-column runs (up to 8 tokens per dispatch, [`crate::columns`]): the staged f32 kernels
//! have column entry points (`gate_up_union_cols`, reading each chosen expert's gate/up once
//! for all the columns that chose it, and `main_cols`; and `main_union` of
//! moe_down_union_f32.wgsl, the down reading each expert once), bound and recorded by
//! [`MoeKernel::bind_cols`] / [`MoeKernel::record_cols`] (moe_cols.rs).

use super::warm;
use crate::columns::COLUMNS_WGSL;
use crate::context::{Context, GpuError, Result};
use crate::numerics::{act_in_wgsl, act_out_wgsl, act_store8_wgsl, Act, Numerics, F32_DEQ};
use crate::state::STATE_WGSL;
use crate::tensor::{Q4Matrix, QForm, QuantActs, BLOCK};

/// WGSL: the swizzled staging helpers of the f32 kernels.
const STAGE: &str = include_str!("../shaders/moe_stage_f32.wgsl");
/// Workgroup size of every MoE kernel.
const WG: u32 = 256;
/// Lanes per output row in gate/up: 256 / 8 = 32 rows = one int8 output block per workgroup.
const GATE_UP_T: u32 = 8;
/// Lanes per output row in down (8 rows per workgroup).
const DOWN_T: u32 = 32;
/// Most workgroup memory (bytes) an f32 kernel may use for its staged activations plus the rest:
/// lavapipe allows 32 KiB, and less per workgroup keeps more workgroups resident on a big GPU.
/// Past it the f32 numerics fall back to the unstaged kernels.
pub const STAGE_BUDGET: u64 = 28 * 1024;
/// Bindings of the staged down's warm workgroups (`main_add_warm`, kernels/warm.rs).
const DOWN_WARM_BINDINGS: (u32, u32, u32) = (12, 13, 14);

/// Shapes of one model's MoE block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeParams {
    /// E: experts.
    pub experts: u32,
    /// K: experts per token (1..=E, at most 64).
    pub top_k: u32,
    /// H: hidden size (multiple of 32).
    pub hidden: u32,
    /// I: expert inner size (multiple of 32).
    pub inter: u32,
    pub norm_topk_prob: bool,
}

impl MoeParams {
    /// The MoE shapes of `cfg`.
    pub fn from_config(cfg: &nibble_model::config::Qwen3MoeConfig) -> Result<Self> {
        let u = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| GpuError::Shape(format!("{what} {v} does not fit u32")))
        };
        let p = MoeParams {
            experts: u(cfg.num_experts, "num_experts")?,
            top_k: u(cfg.num_experts_per_tok, "num_experts_per_tok")?,
            hidden: u(cfg.hidden_size, "hidden_size")?,
            inter: u(cfg.moe_intermediate_size, "moe_intermediate_size")?,
            norm_topk_prob: cfg.norm_topk_prob,
        };
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<()> {
        let ok = self.experts > 0
            && self.experts <= 4096
            && self.top_k > 0
            && self.top_k <= self.experts.min(64)
            && self.hidden > 0
            && self.hidden % BLOCK as u32 == 0
            && self.inter > 0
            && self.inter % BLOCK as u32 == 0
            && (self.experts as u64 * self.hidden.max(self.inter) as u64 * 4) < 1 << 31;
        if !ok {
            return Err(GpuError::Shape(format!(
                "MoE {self:?}: need 0 < K <= min(E, 64), E <= 4096, H and I positive multiples of 32"
            )));
        }
        Ok(())
    }
}

/// How the top-k routing is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// Inside the gate/up kernel (2 dispatches per layer).
    #[default]
    Fused,
    /// A separate one-workgroup router dispatch (3 dispatches per layer).
    Separate,
}

/// Compiled MoE pipelines.
#[derive(Debug)]
pub struct MoeKernel {
    /// The shapes and activation form the shaders were compiled for. Private: the binders'
    /// checks and the grids read them, and the unchecked modules rely on those matching the
    /// compiled constants (`unchecked_staged`).
    params: MoeParams,
    numerics: Numerics,
    /// The block forms of the expert matrices the kernels read: gate and up's, down's (a
    /// `Q4_K_M` file's down is Q6_K in some layers; [`super::MoeSet`] holds a kernel per pair).
    forms: (QForm, QForm),
    /// Lanes per row of the compiled gate/up and down, and down's rows per workgroup (the grids
    /// follow from them).
    gate_up_t: u32,
    /// Rows per team of the staged f32 gate/up ([`F32Tuning::gate_up_rows`]; 1 otherwise).
    gate_up_rows: u32,
    down_rows_per_wg: u32,
    /// Down slot groups (1 when down is not the staged kernel) and the staged kernel's scratch:
    /// `[8, DS, H]` f32 group sums and `[8, NRB]` u32 arrival counters (moe_down_f32.wgsl;
    /// a word each for one group), shared by every binding (dispatches run one after the
    /// other; counters end at 0).
    down_split: u32,
    down_scratch: Option<(wgpu::Buffer, wgpu::Buffer)>,
    /// Whether gate/up and down are the staged f32 forms.
    staged: (bool, bool),
    router: wgpu::ComputePipeline,
    gate_up: wgpu::ComputePipeline,
    gate_up_routed: wgpu::ComputePipeline,
    down: wgpu::ComputePipeline,
    /// The folded router's forms (router_fold.rs): `gate_up_folded`, down's `main_add` and
    /// `main_add_warm`; only when both stages are the staged f32 kernels.
    folded: Option<Folded>,
    /// Column forms (moe_cols.rs): only when both stages are the staged f32 kernels.
    cols: Option<cols::ColsPipelines>,
}

/// The buffers one layer's MoE block uses.
#[derive(Debug, Clone, Copy)]
pub struct MoeBuffers<'a> {
    /// Run state (`State` in shaders/state.wgsl).
    pub state: &'a wgpu::Buffer,
    /// `[E]` f32 router logits.
    pub logits: &'a wgpu::Buffer,
    /// `[2K]` u32 route (written here: ids, then f32 weight bits).
    pub route: &'a wgpu::Buffer,
    /// `[H]` input (post-attention RMSNorm output) in the kernel's numerics form.
    pub x: Act<'a>,
    /// `[E*I, H]` gate and up, `[E*H, I]` down.
    pub gate: &'a Q4Matrix,
    pub up: &'a Q4Matrix,
    pub down: &'a Q4Matrix,
    /// `[K, I]` f32 SiLU(gate) * up (scratch, also read by tests).
    pub h: &'a wgpu::Buffer,
    /// `[K*I]` the same, int8-quantised: the down kernel's input (`None` for f32 numerics,
    /// where down reads `h`).
    pub h_q: Option<&'a QuantActs>,
    /// `[H]` f32 output.
    pub out: &'a wgpu::Buffer,
    /// Add the MoE output into `out` (the residual stream) instead of overwriting it.
    pub residual: bool,
}

/// Bind groups of one layer, created once.
#[derive(Debug)]
pub struct MoeBinding {
    routing: Routing,
    /// Bound by [`MoeKernel::bind_folded`]: gate/up is `gate_up_folded` and the first down
    /// part `main_add` (`main_add_warm` with `warm` extra workgroups when `warm > 0`).
    folded: bool,
    warm: u32,
    /// The gate/up is `gate_up_folded_warm`.
    gate_up_warm: bool,
    router: Option<wgpu::BindGroup>,
    /// One per weight part.
    gate_up: Vec<wgpu::BindGroup>,
    down: Vec<wgpu::BindGroup>,
    /// Which of a [`super::MoeSet`]'s kernels records it (0 from a lone kernel's binders).
    pub(super) kernel: usize,
}

impl MoeBinding {
    /// Whether the gate/up reads its experts' down weights into L2 (`gate_up_folded_warm`).
    pub fn warms_down(&self) -> bool {
        self.gate_up_warm
    }
}

/// WGSL constants of one pipeline: `t` lanes per row, `cols` matvec inputs (NB = cols / 32).
fn consts(p: &MoeParams, t: u32, cols: u32) -> String {
    consts_rows(p, t, 1, cols)
}

/// [`consts`] with `rg` rows per team (`RG`; `R` = rows per workgroup), as the staged f32
/// gate/up takes them.
fn consts_rows(p: &MoeParams, t: u32, rg: u32, cols: u32) -> String {
    let c = |n: &str, v: u32| format!("const {n}: u32 = {v}u;\n");
    [
        STATE_WGSL.to_string(),
        c("E", p.experts),
        c("K", p.top_k),
        c("WG", WG),
        c("T", t),
        c("R", WG / t * rg),
        c("RG", rg),
        format!("const NORM_TOPK: bool = {};\n", p.norm_topk_prob),
        c("H", p.hidden),
        c("I", p.inter),
        c("NB", cols / BLOCK as u32),
        c("KNB", p.top_k * cols / BLOCK as u32),
    ]
    .concat()
}

/// Compile a staged f32 MoE source (moe_gate_up_f32.wgsl or moe_down_f32.wgsl with their
/// prepended constants) without naga's runtime bounds checks, for the single-token entry points
/// (`gate_up`, `gate_up_routed`, `gate_up_folded[_warm]`; `main`, `main_add[_warm]`; with the
/// checks the decode step ran 5.2% slower on the H200, docs/BENCHMARKS.md run 113) and the
/// per-column forms (`gate_up_routed_cols`, `main_cols`: multi-stream decode, run 115). The
/// union gate/up (`gate_up_union_cols`, not the default) takes its pipeline from the checked
/// module, and the union down is a module of its own, checked.
///
/// # Safety
/// `wgsl` must be the staged source this kernel built, and those pipelines bound only through
/// [`MoeKernel::bind`] / [`MoeKernel::bind_folded`] / [`MoeKernel::bind_cols_with`] (per-column
/// forms). Why every index then stays in bounds:
/// - weights: `check_weights` (`Q4Matrix::check_layout` + shapes) makes each part hold its
///   experts' `(e_hi - e_lo) * rows * NB` blocks and scales with whole experts (`expert_range`);
///   an expert id is always below E (the router's `top_e` starts at 0 and is set only to ids
///   below E; ids read from `route` are clamped with `min(.., E - 1)`), a part that does not
///   hold it computes on its first expert and discards the product, and a row is below I
///   (gate/up: grid x = I / R) or H (down: rows past H compute on row 0, are not stored);
/// - activations: x / fold_h / fold_a / fold_w / pub_x hold H floats, logits / fold_z / pub_lg
///   E, route 2K, h K I, out / add_a H (the binders' `need` checks), staged at i < NB * 8 =
///   H / 4 (gate/up) or KSNB * 8 (down: slot group g's slots g KS .. g KS + KS <= K);
/// - workgroup arrays: lg / rank_hi below E, top_e below K, the partials at rp(i) = i + i / T
///   (T >= 8) and the norm's li + li / NRED, (NRED + 1) li + j (li < 16, j < NRED = WG / 16)
///   all below RS = WG + WG / 8; down's red below ROWS TP, ids / wts below KS (item_k clamps);
///   the affine forms' block sums `xsum_s` written at b < NB (gate/up) or b < KSNB (down: its
///   block staging reads h at b * 8 + k < KSNB * 8, the vec4 staging's range) and read at a
///   lane's block below NB or at `min(it, KSNB - 1)`;
/// - the slot groups' dpart / darrive (DS > 1) are allocated for MAX_COLUMNS columns of
///   DS H / NRB (`down_scratch_bytes`), indexed at column 0 here; DS = 1 never touches them;
/// - the warm loads index below arrayLength (kernels/warm.rs, `down_warm`'s `min`);
/// - workgroups past the grid's own (2D grids, warm workgroups) are bounded by `g >= DS`,
///   `wg >= NRB * DS` before any other index;
/// - column forms: the column c = wid.z is below the grid's z, the bound `nb` (`record_cols`),
///   and they return at once when c >= 8; `bind_cols_with` makes logits, route, x, h and out
///   hold `nb` columns, and column c's reads and writes are the single-token ones offset by c
///   times the single-token length (logits c E, x / out c H, route c 2K, h c K I); `cols` is a
///   fixed `array<Col, 8>` (its binding size is validated); dpart / darrive hold 8 columns;
/// - loops run to constants, to `K` / `E` / `NB * 8`, or over `DW_LOADS`; the only run-time
///   divisor is `down_warm`'s `nx` (num_workgroups.x >= 1).
unsafe fn unchecked_staged(ctx: &Context, label: &str, wgsl: &str) -> Result<wgpu::ShaderModule> {
    // SAFETY: forwarded to the caller by this function's contract.
    unsafe { ctx.module_unchecked(label, wgsl) }
}

impl MoeKernel {
    /// The shapes this kernel was compiled for.
    pub fn params(&self) -> MoeParams {
        self.params
    }

    /// Whether gate/up and down were built as the staged f32 kernels (the work split of
    /// [`F32Tuning`] applies only to those; a split whose staging exceeds the workgroup
    /// memory falls back to the unstaged form).
    pub fn staged(&self) -> (bool, bool) {
        self.staged
    }

    /// Compile the router, gate/up (both routings) and down pipelines for `params` with plain
    /// int8 activations.
    pub fn new(ctx: &Context, params: MoeParams) -> Result<Self> {
        Self::with_numerics(ctx, params, Numerics::Int8)
    }

    /// As [`Self::new`] with activations in the form `numerics` (and the work split of
    /// [`F32Tuning::for_shapes`]).
    pub fn with_numerics(ctx: &Context, params: MoeParams, numerics: Numerics) -> Result<Self> {
        let tune = F32Tuning::for_shapes(ctx, &params);
        Self::with_f32_tuning(ctx, params, numerics, tune)
    }

    /// As [`Self::with_numerics`] with the work split of the staged f32 kernels chosen (for
    /// benchmarks; ignored by the other numerics).
    pub fn with_f32_tuning(
        ctx: &Context,
        params: MoeParams,
        numerics: Numerics,
        tune: F32Tuning,
    ) -> Result<Self> {
        Self::with_form(ctx, params, numerics, tune, QForm::Q4_0)
    }

    /// As [`Self::with_f32_tuning`] for expert matrices of the given block form (tensor.rs).
    /// Only the staged f32 kernels read a form other than Q4_0, e.g. the affine one (not the
    /// quantised numerics, not the unstaged f32 kernels, not the union forms over columns):
    /// anything else is an error here or at binding.
    pub fn with_form(
        ctx: &Context,
        params: MoeParams,
        numerics: Numerics,
        tune: F32Tuning,
        form: QForm,
    ) -> Result<Self> {
        Self::with_forms(ctx, params, numerics, tune, (form, form))
    }

    /// [`Self::with_form`] with gate and up of one block form and down of another
    /// (`(gate_up, down)`).
    pub fn with_forms(
        ctx: &Context,
        params: MoeParams,
        numerics: Numerics,
        tune: F32Tuning,
        forms: (QForm, QForm),
    ) -> Result<Self> {
        let (gu_form, down_form) = forms;
        params.validate()?;
        tune.validate()?;
        let p = &params;
        // lg, top_e, red_g, red_u, hv, act_sh (256 vec4).
        let shared = (p.experts + p.top_k + 2 * WG + 32 + 4 * 256) as u64 * 4;
        if shared > ctx.limits.max_compute_workgroup_storage_size as u64 {
            return Err(GpuError::Shape(format!(
                "MoE with {} experts needs {shared} bytes of workgroup memory",
                p.experts
            )));
        }
        let budget = STAGE_BUDGET.min(ctx.limits.max_compute_workgroup_storage_size as u64);
        let f32 = !numerics.quantized();
        // Down slot groups whose scratch would not fit one binding (tests' tiny limits) fall
        // back to one group, decided before the staging budget is checked with them.
        let want = tune.split_for(down_form, p.top_k);
        let nrb_staged = p.hidden.div_ceil(WG / tune.down_lanes * tune.down_rows);
        let want = if down_scratch_bytes(p, want, nrb_staged).0 > ctx.max_binding_bytes() {
            1
        } else {
            want
        };
        // Two gate/up rows per team only where the rows per workgroup divide I (and only in
        // the staged kernel, below).
        let gu_rows = if p.inter % (WG / tune.gate_up_lanes * tune.gate_up_rows) == 0 {
            tune.gate_up_rows
        } else {
            1
        };
        let staged = (
            f32 && gate_up_f32_shared(p, gu_rows) <= budget,
            f32 && down_f32_shared(p, tune.down_lanes, tune.down_rows, want) <= budget,
        );
        if let Some(f) = [gu_form, down_form]
            .into_iter()
            .find(|f| *f != QForm::Q4_0 && staged != (true, true))
        {
            return Err(GpuError::Shape(format!(
                "MoE at {params:?} with {numerics} activations: the {} form is read by the \
                 staged f32 kernels only (staged {staged:?})",
                f.name()
            )));
        }
        let route = include_str!("../shaders/moe_route.wgsl");
        let router_src = format!(
            "{}{route}{}",
            consts(p, 1, p.hidden),
            include_str!("../shaders/moe_router.wgsl")
        );
        let router = ctx.compute("moe.router", &router_src, "main")?;
        let gate_up_t = if staged.0 {
            tune.gate_up_lanes
        } else {
            GATE_UP_T
        };
        let gate_up_rows = if staged.0 { gu_rows } else { 1 };
        let gu_src = if staged.0 {
            format!(
                "{}const LATE_NORM: bool = {};\nconst DW_LOADS: u32 = {}u;\nconst DW_QB: u32 = {}u;\n\
                 const DW_SB: u32 = {}u;\n{route}{F32_DEQ}{STAGE}{COLUMNS_WGSL}{}{}",
                consts_rows(p, gate_up_t, gate_up_rows, p.hidden),
                tune.late_norm,
                down_warm_loads(p, p.inter / (WG / gate_up_t * gate_up_rows), down_form),
                down_form.block_bytes(),
                down_form.scale_word_bytes(),
                gu_form.wgsl(),
                gu_form.with_dot(include_str!("../shaders/moe_gate_up_f32.wgsl"))
            )
        } else {
            format!(
                "{}{route}{}{}{}{}",
                consts(p, gate_up_t, p.hidden),
                act_in_wgsl(numerics, 4, 5),
                act_out_wgsl(numerics, 11, 12),
                act_store8_wgsl(numerics),
                include_str!("../shaders/moe_gate_up.wgsl")
            )
        };
        let gu = ctx.module("moe.gate_up", &gu_src)?;
        // The staged kernels' single-token and per-column entry points come from a copy compiled
        // without naga's runtime bounds checks (`unchecked_staged`); the union gate/up keeps
        // them.
        let gu_fast = match staged.0 {
            // SAFETY: see `unchecked_staged` (the staged gate/up source).
            true => unsafe { unchecked_staged(ctx, "moe.gate_up.unchecked", &gu_src)? },
            false => gu.clone(),
        };
        let gate_up = ctx.pipeline("moe.gate_up", &gu_fast, "gate_up")?;
        let gate_up_routed = ctx.pipeline("moe.gate_up_routed", &gu_fast, "gate_up_routed")?;
        let (down_t, down_rows, ds) = if staged.1 {
            (tune.down_lanes, tune.down_rows, want)
        } else {
            (DOWN_T, 1, 1)
        };
        let down_rows_per_wg = WG / down_t * down_rows;
        let nrb = p.hidden.div_ceil(down_rows_per_wg);
        let down_src = if staged.1 {
            let c = |n: &str, v: u32| format!("const {n}: u32 = {v}u;\n");
            format!(
                "{}{}{}{}{}{}{F32_DEQ}{STAGE}{COLUMNS_WGSL}{}",
                consts(p, down_t, p.inter),
                c("RT", down_rows),
                c("DS", ds),
                c("KS", p.top_k / ds),
                c("KSNB", p.top_k / ds * p.inter / BLOCK as u32),
                c("NRB", nrb),
                down_f32_body(p, down_t, down_rows, ds, down_form)
            )
        } else {
            format!(
                "{}{}{}",
                consts(p, down_t, p.inter),
                act_in_wgsl(numerics, 3, 4),
                include_str!("../shaders/moe_down.wgsl")
            )
        };
        // Every entry point the staged down has is in the unchecked module's audit.
        let dm_fast = match staged.1 {
            // SAFETY: see `unchecked_staged` (the staged down source).
            true => unsafe { unchecked_staged(ctx, "moe.down.unchecked", &down_src)? },
            false => ctx.module("moe.down", &down_src)?,
        };
        let down = ctx.pipeline("moe.down", &dm_fast, "main")?;
        let (cols, folded) = if staged == (true, true) {
            (
                Some(cols::ColsPipelines::new(
                    ctx, &gu, &gu_fast, &dm_fast, p, down_t, ds,
                )?),
                Some(Folded {
                    gate_up: ctx.pipeline("moe.gate_up_folded", &gu_fast, "gate_up_folded")?,
                    gate_up_warm: ctx.pipeline(
                        "moe.gate_up_folded_warm",
                        &gu_fast,
                        "gate_up_folded_warm",
                    )?,
                    add: ctx.pipeline("moe.down_add", &dm_fast, "main_add")?,
                    add_warm: ctx.pipeline("moe.down_add_warm", &dm_fast, "main_add_warm")?,
                }),
            )
        } else {
            (None, None)
        };
        Ok(MoeKernel {
            params,
            numerics,
            forms,
            gate_up_t,
            gate_up_rows,
            down_rows_per_wg,
            down_split: ds,
            down_scratch: match staged.1 {
                true => {
                    let (part, arrive) = down_scratch_bytes(p, ds, nrb);
                    Some((
                        ctx.storage("moe.down.dpart", part)?,
                        ctx.storage("moe.down.darrive", arrive)?,
                    ))
                }
                false => None,
            },
            staged,
            router,
            gate_up,
            gate_up_routed,
            down,
            folded,
            cols,
        })
    }

    /// Check shapes and create the bind groups of one layer.
    pub fn bind(&self, ctx: &Context, b: &MoeBuffers<'_>, routing: Routing) -> Result<MoeBinding> {
        let p = &self.params;
        let (e, k, h, i) = (p.experts, p.top_k, p.hidden, p.inter);
        self.check_weights(b.gate, b.up, b.down)?;
        need(b.state, 16, "state")?;
        need(b.logits, e as u64 * 4, "logits")?;
        need(b.route, 2 * k as u64 * 4, "route")?;
        need(b.h, (k * i) as u64 * 4, "h")?;
        need(b.out, h as u64 * 4, "out")?;
        let hq_ok = match (self.numerics.form(), b.h_q) {
            (Numerics::F32, None) => true,
            (n, Some(q)) => {
                q.n == k * i && n.quantized() && q.precise == (n == Numerics::PreciseInt8)
            }
            _ => false,
        };
        if b.x.len() < h as u64 || b.x.numerics() != self.numerics.form() || !hq_ok {
            return Err(GpuError::Shape(format!(
                "MoE ({}) activations: x holds {} ({}), h_q {:?}; need {h} and {} ({})",
                self.numerics,
                b.x.len(),
                b.x.numerics(),
                b.h_q.map(|q| (q.n, q.precise)),
                k * i,
                self.numerics
            )));
        }
        let router = match routing {
            Routing::Separate => Some(ctx.bind_group(
                "moe.router",
                &self.router,
                &[whole(b.state), whole(b.logits), whole(b.route)],
            )?),
            Routing::Fused => None,
        };
        let mut gate_up = Vec::new();
        for (n, (g, u)) in b.gate.parts.iter().zip(&b.up.parts).enumerate() {
            let params = gate_up_params(ctx, g, u, i, n)?;
            let mut res = vec![(0, whole(b.state)), (1, whole(&params))];
            let pipe = match routing {
                Routing::Fused => {
                    res.push((2, whole(b.logits)));
                    &self.gate_up_routed
                }
                Routing::Separate => &self.gate_up,
            };
            res.extend([
                (3, whole(b.route)),
                (6, whole(&g.qs)),
                (7, whole(&g.scales)),
                (8, whole(&u.qs)),
                (9, whole(&u.scales)),
                (10, whole(b.h)),
            ]);
            res.extend(b.x.entries(4, 5));
            if let Some(q) = b.h_q {
                res.extend([(11, whole(&q.q)), (12, whole(&q.s))]);
            }
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            gate_up.push(ctx.bind_group_at("moe.gate_up", pipe, &ids, &res)?);
        }
        let mut down = Vec::new();
        for (n, part) in b.down.parts.iter().enumerate() {
            let params = down_params(ctx, part, h, b.residual || n > 0)?;
            let mut res = vec![
                (0, whole(b.state)),
                (1, whole(&params)),
                (2, whole(b.route)),
                (5, whole(&part.qs)),
                (6, whole(&part.scales)),
                (7, whole(b.out)),
            ];
            res.extend(
                match b.h_q {
                    Some(q) => Act::Int8(q),
                    None => Act::F32(b.h),
                }
                .entries(3, 4),
            );
            res.extend(self.down_split_entries());
            let (ids, res): (Vec<u32>, Vec<_>) = res.into_iter().unzip();
            down.push(ctx.bind_group_at("moe.down", &self.down, &ids, &res)?);
        }
        Ok(MoeBinding {
            routing,
            folded: false,
            warm: 0,
            gate_up_warm: false,
            router,
            gate_up,
            down,
            kernel: 0,
        })
    }

    /// The block forms it reads: `(gate and up, down)`.
    pub fn forms(&self) -> (QForm, QForm) {
        self.forms
    }

    /// Whether [`Self::bind_folded`] is available (both stages are the staged f32 kernels).
    pub fn can_fold(&self) -> bool {
        self.folded.is_some()
    }

    /// Record the MoE dispatches of one layer (no host sync).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, ctx: &Context, b: &MoeBinding) {
        self.record_marked(pass, ctx, b, &mut |_, _| {});
    }

    /// [`Self::record`] calling `mark(pass, op)` after each stage (the plan's profile).
    pub fn record_marked<F: FnMut(&mut wgpu::ComputePass<'_>, &'static str)>(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        ctx: &Context,
        b: &MoeBinding,
        mark: &mut F,
    ) {
        if let Some(router) = &b.router {
            pass.set_pipeline(&self.router);
            pass.set_bind_group(0, router, &[]);
            pass.dispatch_workgroups(1, 1, 1);
            mark(pass, "moe router");
        }
        let folded = self.folded.as_ref().filter(|_| b.folded);
        pass.set_pipeline(match (folded, b.routing) {
            (Some(f), _) if b.gate_up_warm => &f.gate_up_warm,
            (Some(f), _) => &f.gate_up,
            (None, Routing::Fused) => &self.gate_up_routed,
            (None, Routing::Separate) => &self.gate_up,
        });
        let ((ux, uy), (gx, gy)) = self.grids(ctx);
        for bg in &b.gate_up {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(ux, uy, 1);
        }
        mark(pass, "moe gate/up");
        for (n, bg) in b.down.iter().enumerate() {
            if n == 0 || (n == 1 && folded.is_some()) {
                pass.set_pipeline(match folded {
                    Some(f) if n == 0 && b.warm > 0 => &f.add_warm,
                    Some(f) if n == 0 => &f.add,
                    _ => &self.down,
                });
            }
            pass.set_bind_group(0, bg, &[]);
            let (x, y) = match folded {
                Some(_) if n == 0 && b.warm > 0 => ctx.grid(self.down_workgroups() + b.warm),
                _ => (gx, gy),
            };
            pass.dispatch_workgroups(x, y, 1);
        }
        mark(pass, "moe down");
    }

    /// The staged down kernel's slot-group scratch bindings (none for the unstaged kernel).
    fn down_split_entries(&self) -> Vec<(u32, wgpu::BindingResource<'_>)> {
        match &self.down_scratch {
            Some((part, arrive)) => vec![(10, whole(part)), (11, whole(arrive))],
            None => Vec::new(),
        }
    }

    /// Rows per team of the compiled gate/up (1 unless [`F32Tuning::gate_up_rows`] took).
    pub fn gate_up_rows(&self) -> u32 {
        self.gate_up_rows
    }

    /// Slot groups of the compiled down kernel (1: each workgroup sums all K slots of its rows).
    pub fn down_split(&self) -> u32 {
        self.down_split
    }

    /// Grids (x, y) of one column of gate/up and of down.
    fn grids(&self, ctx: &Context) -> ((u32, u32), (u32, u32)) {
        let p = &self.params;
        (
            (p.inter / (WG / self.gate_up_t * self.gate_up_rows), p.top_k),
            ctx.grid(self.down_workgroups()),
        )
    }

    /// Workgroups of one column of down: row blocks x slot groups.
    fn down_workgroups(&self) -> u32 {
        self.params.hidden.div_ceil(self.down_rows_per_wg) * self.down_split
    }

    /// Whether (gate/up, down) run the staged f32 kernels (false for the quantised numerics and
    /// for f32 past [`STAGE_BUDGET`]).
    pub fn f32_staged(&self) -> (bool, bool) {
        self.staged
    }

    /// Dispatches per layer when every weight fits one binding.
    pub fn dispatches(routing: Routing) -> u32 {
        match routing {
            Routing::Fused => 2,
            Routing::Separate => 3,
        }
    }
}

fn whole(buf: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    buf.as_entire_binding()
}

#[path = "moe_checks.rs"]
mod checks;
use checks::{down_params, expert_range, gate_up_params, gate_up_params_eps, need};

#[path = "moe_ref.rs"]
mod reference;
pub use reference::{down_ref, gate_up_ref, router_ref};

#[path = "moe_f32.rs"]
mod f32;
pub use f32::F32Tuning;
use f32::{down_f32_body, down_f32_shared, down_scratch_bytes, gate_up_f32_shared};

#[path = "moe_folded.rs"]
mod folded;
pub use folded::MoeFolded;
use folded::{down_warm_loads, Folded};

#[path = "moe_cols.rs"]
mod cols;
pub use cols::{ColsForm, ColsRead, MoeColsBinding, MoeColsBuffers};

#[path = "moe_set.rs"]
mod set;
pub use set::MoeSet;

#[cfg(test)]
#[path = "moe_f32_tests.rs"]
mod f32_tests;
#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
