//! Per-kernel GPU microbenchmark of nibble's decode step.
//!
//! `cargo run --release -p nibble-gpu --example kernel_bench -- [--shapes full|tiny] [--reps N]
//! [--calls M] [--pos P] [--numerics f32|precise-int8|int8] [--adapter NAME] [--json]
//! [--matmul-tiles] [--moe-tunings] [--hot] [--only TEXT]`
//!
//! Every kernel the decode plan records is built with the real Qwen3-30B-A3B shapes (`full`) or
//! the tiny model's (`tiny`, for lavapipe) and random inputs, then one call of it is recorded M
//! times back to back in ONE compute pass (dependent: each call writes the buffer the next one
//! writes, so wgpu puts a barrier between them, as in the plan). Per-layer weights and KV caches
//! rotate over `layers` copies so calls stream from memory (see `fixtures.rs`). Reported per
//! call: GPU time (timestamps), wall time, host record time, bytes moved and GB/s; rows are
//! sorted by time per token = time per call x calls per token in the plan (48 layers), with the
//! sum compared against the whole step recorded in the plan's unfused form (the int8 numerics'
//! form; the default folded plan is profiled by `nibble bench --profile`), the empty-dispatch chain and
//! a plain 1 GiB read (reference lines). `--json` prints JSON on stdout, the table on stderr.
//! The multi-column matmul (not in the plan yet) has rows of its own at nb = 1, 2, 4, 8 columns
//! with the tile it picks, or every compiled tile of those columns with `--matmul-tiles`; so
//! has the MoE over columns (`moe cols`, multi-stream decode): nb = 1, 2, 4, 8 with random or
//! shared routes, per-column (the default), union gate/up and union gate/up + down forms.
//! `--hot` keeps ONE copy of every weight, KV cache and MoE route, so repeated calls read from L2
//! (what a kernel would cost were its weights prefetched). `--only TEXT` times only the rows
//! whose name contains TEXT or one of its `|`-separated parts (e.g. `@pos 1 |@pos 4096`: the
//! attention rows at those positions, a quick A/B of attention variants). Reference rows time the fixed costs
//! (empty dispatch, dependent-load chains through L2 and DRAM, 256-thread workgroups with
//! barrier rounds); attention also has rows for other sequence splits (one chunk per kv head,
//! 128 and 512 chunks per kv head) and wider tiles (4 and 8 loads per thread). Rows marked
//! "(as plan)" bind a kernel the way the default f32 plan does where that differs from the
//! plain row: the qkv matvec normalising its input on load, the MoE gate/up normalising h + a
//! and routing on the folded router's logits (the plain MoE rows are the routed, unfolded form).
//! Smallest run (lavapipe): `--shapes tiny --calls 2 --reps 1`.

#[path = "kernel_bench/args.rs"]
mod args;
#[path = "kernel_bench/cases.rs"]
mod cases;
#[path = "kernel_bench/fixtures.rs"]
mod fixtures;
#[path = "kernel_bench/moe_cols.rs"]
mod moe_cols;
#[path = "kernel_bench/timing.rs"]
mod timing;

use args::Args;
use cases::Bench;
use fixtures::RefKernel;
use nibble_gpu::context::{AdapterChoice, Context};
use nibble_gpu::kernels::matmul::{MatmulArgs, MatmulInput, MatmulKernel, Tile, B_MAX};
use nibble_gpu::kernels::moe::F32Tuning;
use nibble_gpu::tensor::Q4Matrix;
use nibble_gpu::Numerics;
use nibble_model::config::Qwen3MoeConfig;
use std::time::Instant;
use timing::{Row, Timer};

/// Bytes one Q4_0 `[rows, cols]` matrix holds (16 nibble bytes + an f16 scale per block).
fn q4(rows: usize, cols: usize) -> u64 {
    (rows * cols / 32 * 18) as u64
}

/// Bytes of `n` activations in the form `nm` (f32, or int8 parts + per-block scales).
fn act(n: usize, nm: Numerics) -> u64 {
    let n = n as u64;
    match nm {
        Numerics::F32 | Numerics::Bfp24 => 4 * n,
        Numerics::Int8 => n + n / 32 * 8,
        Numerics::PreciseInt8 => 2 * n + n / 32 * 16,
    }
}

/// What a case is, for the report.
struct Spec {
    name: String,
    disp: usize,
    per_token: usize,
    alt: bool,
    bytes: u64,
    /// The run-state position written before every rep.
    pos: u32,
}

struct Runner<'a> {
    timer: &'a Timer,
    only: Option<&'a str>,
    b: &'a Bench,
    rows: Vec<Row>,
}

impl Runner<'_> {
    /// Time `m` calls of `rec` and append the row (also printed at once, so a crash keeps them).
    fn case(
        &mut self,
        s: Spec,
        m: usize,
        rec: &dyn Fn(&mut wgpu::ComputePass<'_>, usize),
    ) -> anyhow::Result<()> {
        if self
            .only
            .is_some_and(|o| !o.split('|').any(|alt| s.name.contains(alt)))
        {
            return Ok(());
        }
        let meas = self.timer.time(m, &|| self.b.set_state(s.pos), rec)?;
        let row = Row {
            name: s.name,
            disp: s.disp,
            per_token: s.per_token,
            alt: s.alt,
            bytes: s.bytes,
            m: meas,
        };
        eprintln!(
            "  {:<48} {:>9.2} us/call {:>8.1} GB/s",
            row.name,
            row.m.us(),
            row.gbps()
        );
        self.rows.push(row);
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse()?;
    let choice = args
        .adapter
        .clone()
        .map_or(AdapterChoice::Auto, AdapterChoice::Named);
    let ctx = Context::new(&choice)?;
    // Working set per rotated dense matrix: 5x an H200's 50 MB L2, so calls stream from memory.
    let (cfg, mut positions, read_target, working_set) = if args.full {
        let full = Qwen3MoeConfig::qwen3_30b_a3b();
        (full, vec![1, 512, 4096], 1u64 << 30, 256u64 << 20)
    } else {
        // The tiny model with a 4k vocabulary: lavapipe needs ~0.5 s per 152k-row lm_head call.
        let tiny = Qwen3MoeConfig {
            vocab_size: 4096,
            ..Qwen3MoeConfig::tiny()
        };
        (tiny, vec![1, 64, 256], 16 << 20, 0)
    };
    if !positions.contains(&args.pos) {
        positions.push(args.pos);
    }
    let (nm, m, l) = (args.numerics, args.calls, cfg.num_layers);
    let m_step = (m / 20).max(2);
    let ctx_len = *positions.iter().max().unwrap_or(&1) as usize + m_step + 1;
    eprintln!(
        "adapter '{}' ({:?}, {:?}); timestamps {}; max binding {} MiB",
        ctx.info.name,
        ctx.info.backend,
        ctx.info.device_type,
        ctx.features.contains(wgpu::Features::TIMESTAMP_QUERY),
        ctx.max_binding_bytes() >> 20
    );
    let t0 = Instant::now();
    let mut rng = nibble_gpu::testing::rng(7);
    // `--moe-tunings`: gate/up lanes 8..64 (down default), then down lanes x rows (gate/up
    // default), the staged f32 kernels only.
    let d = F32Tuning::DEFAULT;
    let tunings: Vec<F32Tuning> = if args.moe_tunings {
        let gu = [8, 16, 32, 64].into_iter().flat_map(|gate_up_lanes| {
            [1, 2].map(|gate_up_rows| F32Tuning {
                gate_up_lanes,
                gate_up_rows,
                ..d
            })
        });
        let dn = [8, 16, 32, 64].into_iter().flat_map(|down_lanes| {
            [1, 2, 4].map(|down_rows| F32Tuning {
                down_lanes,
                down_rows,
                ..d
            })
        });
        gu.into_iter().chain(dn).collect()
    } else {
        // The down kernel's other slot-group counts (the default is 4 on Vulkan), and two
        // gate/up rows per team.
        let mut v = [1, 2, 8]
            .map(|down_split| F32Tuning { down_split, ..d })
            .to_vec();
        v.push(F32Tuning {
            gate_up_rows: 2,
            ..d
        });
        v
    };
    let b = Bench::new(
        &ctx,
        &cfg,
        nm,
        (
            ctx_len,
            m as u32,
            if args.hot { 0 } else { working_set },
            if args.hot { 1 } else { l },
        ),
        &tunings,
        &mut rng,
    )?;
    let read_bytes = read_target.min(ctx.max_binding_bytes() / (16 << 20) * (16 << 20));
    let (empty, read) = (
        RefKernel::empty(&ctx)?,
        RefKernel::read(&ctx, &mut rng, read_bytes)?,
    );
    let timer = Timer::new(&ctx, args.reps)?;
    eprintln!(
        "setup {:.1} s; {m} calls per pass, {} reps; empty submit+wait {:.1} us",
        t0.elapsed().as_secs_f64(),
        args.reps,
        timer.roundtrip_us()
    );
    let t1 = Instant::now();
    let mut r = Runner {
        timer: &timer,
        only: args.only.as_deref(),
        b: &b,
        rows: Vec::new(),
    };
    let (h, qd, kvd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
    let (e, k, i, v) = (
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.vocab_size,
    );
    let sp = |name: String, disp: usize, per_token: usize, alt: bool, bytes: u64| Spec {
        name,
        disp,
        per_token,
        alt,
        bytes,
        pos: args.pos,
    };

    // Reference lines.
    r.case(
        sp(
            "ref: empty dispatch (dependent chain)".into(),
            1,
            0,
            true,
            0,
        ),
        m,
        &|p, _| empty.record(p),
    )?;
    // A check that the chain really ran every call (unless `--only` skipped the row).
    let count = ctx.read_u32(&empty.buf, 1)?[0];
    let want = if r.rows.is_empty() {
        0
    } else {
        (m * (args.reps + 1)) as u32
    };
    anyhow::ensure!(count == want, "empty chain ran {count} times, want {want}");
    // Memory latency: a chain of dependent loads, 1 and 64 hops per call, through a cycle of
    // 512 KiB (L2) and of the read buffer's size (DRAM on a big GPU; 128-byte lines apart).
    for (what, bytes) in [("L2", 512u64 << 10), ("memory", read_bytes.min(256 << 20))] {
        let entries = (bytes / 128) as usize;
        for hops in [1u32, 64] {
            let chase = RefKernel::chase(&ctx, &mut rng, entries, 32, hops)?;
            let name = format!(
                "ref: chase {hops} dependent loads ({what}, {} KiB)",
                bytes >> 10
            );
            r.case(sp(name, 1, 0, true, 0), m, &|p, _| chase.record(p))?;
        }
    }
    // Fixed costs: 256-thread workgroups storing a word, with barrier rounds or a uniform load.
    for (groups, barriers, uniform) in [
        (1u32, 0u32, false),
        (1, 16, false),
        (1, 0, true),
        (132, 0, false),
        (1056, 0, false),
        (1056, 16, false),
    ] {
        let probe = RefKernel::probe(&ctx, groups, barriers, uniform)?;
        let u = if uniform { " + uniform load" } else { "" };
        let name = format!("ref: {groups} wg x 256, {barriers} barrier rounds{u}");
        r.case(sp(name, 1, 0, true, 0), m, &|p, _| probe.record(p))?;
    }
    let name = format!("ref: read {} MiB (sum)", read_bytes >> 20);
    r.case(sp(name, 1, 0, true, read_bytes), m.min(50), &|p, _| {
        read.record(p)
    })?;

    // Embedding, norms, quantisation.
    let bytes = q4(1, h) + 4 * h as u64;
    let name = format!("embed [{h}] from Q4 [{v}x{h}]");
    r.case(
        sp(name, b.embed_b.dispatch_count(), 1, false, bytes),
        m,
        &|p, _| b.embed.record(p, &b.embed_b),
    )?;
    let (qn, qb) = if nm.quantized() {
        (format!("+quant {nm}"), act(h, nm))
    } else {
        (String::new(), 0)
    };
    let h4 = 4 * h as u64;
    for (j, name, per, bytes) in [
        (0, format!("rmsnorm{qn} [{h}]"), l + 1, 3 * h4 + qb),
        (1, format!("add+rmsnorm{qn} [{h}]"), l, 5 * h4 + qb),
        (2, format!("rmsnorm (no quant) [{h}]"), l, 3 * h4),
    ] {
        let alt = j == 2;
        r.case(sp(name, 1, per, alt, bytes), m, &|p, _| {
            b.norm.record(p, &b.norm_b[j])
        })?;
    }
    for (n, x) in [(h, &b.xn), (k * i, &b.moe_h)] {
        let Some(qa) = x.quant(nm) else { continue };
        let qbind = b.quantize.bind(&ctx, &x.f, qa, &b.state)?;
        let name = format!("quantize {nm} [{n}] (not in plan)");
        r.case(
            sp(name, 1, 0, true, 4 * n as u64 + act(n, nm)),
            m,
            &|p, _| b.quantize.record(p, &qbind),
        )?;
    }

    // Dense matvecs: the plan's numerics, then the others as alternatives.
    for mv in std::iter::once(nm).chain(Numerics::ALL.into_iter().filter(|x| *x != nm)) {
        let alt = mv != nm;
        let bind = |w: &nibble_gpu::tensor::Q4Matrix, x: &cases::ActSet, y: &wgpu::Buffer| {
            b.matvec.bind_q4(&ctx, w, x.act(mv), y, &b.state)
        };
        let qkv: Vec<_> = b
            .qkv_w
            .iter()
            .map(|w| bind(w, &b.xn, &b.qkv_out))
            .collect::<Result<_, _>>()?;
        let o: Vec<_> = b
            .o_w
            .iter()
            .map(|w| bind(w, &b.att, &b.a))
            .collect::<Result<_, _>>()?;
        let head = bind(&b.head_w, &b.xn, &b.logits)?;
        let qr = qd + 2 * kvd;
        for (name, binds, per, bytes) in [
            (
                format!("matvec qkv [{qr}x{h}] {mv}"),
                &qkv[..],
                l,
                q4(qr, h) + act(h, mv) + 4 * qr as u64,
            ),
            (
                format!("matvec o_proj [{h}x{qd}] {mv}"),
                &o[..],
                l,
                q4(h, qd) + act(qd, mv) + h4,
            ),
            (
                format!("matvec lm_head [{v}x{h}] {mv}"),
                std::slice::from_ref(&head),
                1,
                q4(v, h) + act(h, mv) + 4 * v as u64,
            ),
        ] {
            r.case(
                sp(name, binds[0].dispatch_count(), per, alt, bytes),
                m,
                &|p, c| b.matvec.record(p, &binds[c % binds.len()]),
            )?;
        }
    }
    // The qkv matvec as the default plan records it: the RMSNorm recomputed on load by every
    // workgroup (the rows above read a normalised input).
    if let Some(first) = b.qkv_nol_b.first() {
        let qr = qd + 2 * kvd;
        let name = format!("matvec qkv [{qr}x{h}] f32 norm on load (as plan)");
        let bytes = q4(qr, h) + 2 * h4 + 4 * qr as u64;
        r.case(
            sp(name, first.dispatch_count(), l, true, bytes),
            m,
            &|p, c| b.matvec.record(p, &b.qkv_nol_b[c % b.qkv_nol_b.len()]),
        )?;
    }
    // The lm_head of `--tune head=3` and `head=4` (the default): the bfp24 conversion dispatch,
    // then the matvec reading its blocks from global memory, one or two rows per team (compare
    // with the matmul's lm_head row, `head=0`).
    if let Some((qk, qb, mb, mb2)) = &b.head_bfp {
        let bytes = q4(v, h) + 2 * h4 + 4 * v as u64;
        for (form, mb) in [("head=3", mb), ("head=4, 2 rows per team", mb2)] {
            let name = format!("bfp24 conversion + matvec lm_head [{v}x{h}] ({form})");
            r.case(
                sp(name, 1 + mb.dispatch_count(), 1, true, bytes),
                m,
                &|p, _| {
                    qk.record(p, qb);
                    b.matvec.record(p, mb);
                },
            )?;
        }
    }
    // The f32 form's rows per team, each shape at every choice (the plan picks by rows).
    for rpt in nibble_gpu::kernels::matvec::F32_ROWS_PER_TEAM {
        let qr = qd + 2 * kvd;
        let bind = |w: &nibble_gpu::tensor::Q4Matrix, x: &cases::ActSet, y: &wgpu::Buffer| {
            b.matvec
                .bind_q4_with(&ctx, w, x.act(Numerics::F32), y, &b.state, rpt)
        };
        // Every copy, so these rows read from memory as the plain rows above do.
        let qkv = (b.qkv_w.iter())
            .map(|w| bind(w, &b.xn, &b.qkv_out))
            .collect::<Result<Vec<_>, _>>()?;
        let o = (b.o_w.iter())
            .map(|w| bind(w, &b.att, &b.a))
            .collect::<Result<Vec<_>, _>>()?;
        let head = vec![bind(&b.head_w, &b.xn, &b.logits)?];
        for (name, binds, bytes) in [
            (format!("matvec qkv [{qr}x{h}] f32 r{rpt}"), &qkv, q4(qr, h)),
            (
                format!("matvec o_proj [{h}x{qd}] f32 r{rpt}"),
                &o,
                q4(h, qd),
            ),
            (
                format!("matvec lm_head [{v}x{h}] f32 r{rpt}"),
                &head,
                q4(v, h),
            ),
        ] {
            r.case(sp(name, 1, 0, true, bytes), m, &|p, c| {
                b.matvec.record(p, &binds[c % binds.len()])
            })?;
        }
    }
    // Multi-column int4 x f32 matmul (alternatives: not in the plan yet): X [nb, cols] random,
    // Y [nb, rows], the same rotated weight copies as the matvec rows above.
    let mm = MatmulKernel::new(&ctx)?;
    let qr = qd + 2 * kvd;
    let xm = nibble_gpu::testing::rand_f32(&mut rng, B_MAX as usize * h.max(qd), -1.0, 1.0);
    let xm = ctx.storage_init("matmul.x", bytemuck::cast_slice(&xm))?;
    let ym = ctx.storage("matmul.y", (B_MAX as usize * v.max(qr).max(h) * 4) as u64)?;
    let head = [&b.head_w];
    let mm_shapes: [(&str, Vec<&Q4Matrix>, usize, usize); 3] = [
        ("qkv", b.qkv_w.iter().collect(), qr, h),
        ("o_proj", b.o_w.iter().collect(), h, qd),
        ("lm_head", head.to_vec(), v, h),
    ];
    for (shape, ws, rows, cols) in &mm_shapes {
        for nb in [1u32, 2, 4, 8] {
            let chosen = Tile::for_shape(*rows as u32, *cols as u32, nb)?;
            let tiles: Vec<Tile> = if args.matmul_tiles {
                Tile::all().filter(|t| t.cols == chosen.cols).collect()
            } else {
                vec![chosen]
            };
            for t in tiles {
                let binds = ws
                    .iter()
                    .map(|w| {
                        let a = MatmulArgs {
                            m: w,
                            input: MatmulInput::Plain(&xm),
                            nb,
                            y: &ym,
                            y_stride: *rows as u32,
                            state: &b.state,
                        };
                        mm.bind_tiled(&ctx, &a, t)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let pick = if t == chosen { " *" } else { "" };
                let name = format!(
                    "matmul {shape} [{rows}x{cols}] f32 nb={nb} c{}r{}l{}{pick}",
                    t.cols, t.rows_per_team, t.lanes
                );
                let bytes = q4(*rows, *cols) + 4 * nb as u64 * (rows + cols) as u64;
                r.case(
                    sp(name, binds[0].dispatch_count(), 0, true, bytes),
                    m,
                    &|p, c| mm.record(p, &binds[c % binds.len()]),
                )?;
            }
        }
    }

    let name = format!("matvec router F32 [{e}x{h}]");
    let bytes = (e * h * 4 + h * 4 + e * 4) as u64;
    r.case(
        sp(name, b.router_b[0].dispatch_count(), l, false, bytes),
        m,
        &|p, c| b.matvec.record(p, &b.router_b[c % b.router_b.len()]),
    )?;

    // Attention at several positions (chunk kernel with the q/k norm + rope + KV write folded
    // in, then the combine unless one chunk covers the position: the kernel records both).
    let ap = b.attn.params();
    for &pos in &positions {
        let disp = b.attn.dispatches(&b.attn_b[0], pos);
        let nc = (pos / ap.chunk + 1) as u64;
        let parts = ap.heads as u64 * nc * (ap.head_dim as u64 + 2) * 4;
        // q read by every chunk, the new k/v row read and written, the older cache rows.
        let chunk = (nc * qd as u64 + 4 * kvd as u64 + 2 * pos as u64 * kvd as u64) * 4;
        let out = 4 * qd as u64 + if nm.quantized() { act(qd, nm) } else { 0 };
        let rest = if disp == 1 { out } else { 2 * parts + out };
        let s = Spec {
            name: format!("attention chunk(+rope)+combine @pos {pos}"),
            disp: disp as usize,
            per_token: l,
            alt: pos != args.pos,
            bytes: chunk + rest,
            pos,
        };
        r.case(s, m, &|p, c| b.attn.record(p, &b.attn_b[c % l], pos))?;
    }
    // The qkv + attention dispatch (kernels/qkv_attention.rs) and its ablations, at positions
    // up to its bound: compare with the qkv (as plan) row plus the attention rows.
    for (label, k, binds) in &b.qkv_attn {
        for pos in [1u32, 64, 128, 255] {
            if !k.serves(pos) {
                continue;
            }
            let qr = qd + 2 * kvd;
            let s = Spec {
                name: format!("qkv + attention{label} @pos {pos}"),
                disp: 1,
                per_token: l,
                alt: pos != args.pos,
                bytes: q4(qr, h) + 2 * h4 + 4 * qr as u64 + 2 * (pos as u64 + 1) * kvd as u64 * 4,
                pos,
            };
            r.case(s, m, &|p, c| k.record(p, &binds[c % binds.len()]))?;
        }
    }
    for (label, k, _, binds) in &b.attn_many {
        for &pos in &positions {
            let s = Spec {
                name: format!(
                    "attention {label} @pos {pos} ({} dispatches)",
                    k.dispatches(&binds[0], pos)
                ),
                disp: k.dispatches(&binds[0], pos) as usize,
                per_token: l,
                alt: true,
                bytes: (qd as u64 + 4 * kvd as u64 + 2 * pos as u64 * kvd as u64) * 4,
                pos,
            };
            r.case(s, m, &|p, c| k.record(p, &binds[c % l], pos))?;
        }
    }
    for pos in [1u32, 64, 128, 255] {
        let s = Spec {
            name: format!(
                "attention one chunk per kv head @pos {pos} ({} dispatch)",
                b.attn_one.dispatches(&b.attn_one_b[0], pos)
            ),
            disp: 1,
            per_token: l,
            alt: true,
            bytes: (qd as u64 + 4 * kvd as u64 + 2 * pos as u64 * kvd as u64) * 4,
            pos,
        };
        r.case(s, m, &|p, c| {
            b.attn_one.record(p, &b.attn_one_b[c % l], pos)
        })?;
    }

    // MoE: gate/up and down alone when the kernel allows it, else together.
    let moe_bytes = |mv: Numerics| {
        let gu = 2 * k as u64 * q4(i, h) + act(h, mv) + 4 * (e + k * i) as u64 + act(k * i, mv);
        (gu, k as u64 * q4(h, i) + act(k * i, mv) + 2 * h4)
    };
    for mv in std::iter::once(nm).chain(Numerics::ALL.into_iter().filter(|x| *x != nm)) {
        let set = b.moe_set(mv);
        let (gu, dn) = moe_bytes(mv);
        if let Some((g, d)) = &set.split {
            let name = format!("moe gate_up+silu K={k} [{i}x{h}] {mv}");
            r.case(sp(name, 1, l, mv != nm, gu), m, &|p, c| {
                set.kernel.record(p, &ctx, &g[c % g.len()])
            })?;
            let name = format!("moe down+combine K={k} [{h}x{i}] {mv}");
            r.case(sp(name, 1, l, mv != nm, dn), m, &|p, c| {
                set.kernel.record(p, &ctx, &d[c % d.len()])
            })?;
        }
        let name = format!("moe gate_up+down (routed, unfolded) {mv}");
        let alt = mv != nm || set.split.is_some();
        r.case(sp(name, 2, l, alt, gu + dn), m, &|p, c| {
            set.kernel.record(p, &ctx, &set.full[c % set.full.len()])
        })?;
    }
    // The MoE as the default single-token plan records it: gate/up normalising h + a on load
    // and routing on the folded router's logits (router_fold.rs), alone and with down.
    let (gu, dn) = moe_bytes(Numerics::F32);
    let set = b.moe_set(Numerics::F32);
    if let Some((both, gate_up)) = &set.folded {
        let name = format!("moe gate_up+silu folded (as plan) K={k} f32");
        r.case(sp(name, 1, l, true, gu + h4), m, &|p, c| {
            set.kernel.record(p, &ctx, &gate_up[c % gate_up.len()])
        })?;
        let name = "moe gate_up folded + down (as plan) f32".to_string();
        r.case(sp(name, 2, l, true, gu + h4 + dn), m, &|p, c| {
            set.kernel.record(p, &ctx, &both[c % both.len()])
        })?;
    }
    // The f32 work-split sweep (`--moe-tunings`): each stage alone where it can be split.
    // Without it: the down slot groups 1, 2, 8, alone and as the plan records the pair.
    for (t, set) in &b.moe_tuned {
        let Some((g, d)) = &set.split else { continue };
        let groups = set.kernel.down_split();
        if t.down_split != F32Tuning::DEFAULT.down_split {
            let name = format!("moe down f32 slot groups {groups}");
            r.case(sp(name, 1, l, true, dn), m, &|p, c| {
                set.kernel.record(p, &ctx, &d[c % d.len()])
            })?;
            if let Some((both, _)) = &set.folded {
                let name = format!("moe gate_up folded + down (as plan) slot groups {groups}");
                r.case(sp(name, 2, l, true, gu + h4 + dn), m, &|p, c| {
                    set.kernel.record(p, &ctx, &both[c % both.len()])
                })?;
            }
            continue;
        }
        if t.down_lanes == F32Tuning::DEFAULT.down_lanes
            && t.down_rows == F32Tuning::DEFAULT.down_rows
        {
            let un = if set.kernel.staged().0 {
                ""
            } else {
                " (unstaged)"
            };
            let name = format!(
                "moe gate_up f32 tuning lanes {} rows {}{un}",
                t.gate_up_lanes,
                set.kernel.gate_up_rows()
            );
            r.case(sp(name, 1, l, true, gu), m, &|p, c| {
                set.kernel.record(p, &ctx, &g[c % g.len()])
            })?;
            if t.gate_up_rows != F32Tuning::DEFAULT.gate_up_rows {
                if let Some((both, gate_up)) = &set.folded {
                    let rows = set.kernel.gate_up_rows();
                    let name = format!("moe gate_up+silu folded (as plan) rows {rows}");
                    r.case(sp(name, 1, l, true, gu + h4), m, &|p, c| {
                        set.kernel.record(p, &ctx, &gate_up[c % gate_up.len()])
                    })?;
                    let name = format!("moe gate_up folded + down (as plan) rows {rows}");
                    r.case(sp(name, 2, l, true, gu + h4 + dn), m, &|p, c| {
                        set.kernel.record(p, &ctx, &both[c % both.len()])
                    })?;
                }
            }
        }
        if t.gate_up_lanes == F32Tuning::DEFAULT.gate_up_lanes
            && t.gate_up_rows == F32Tuning::DEFAULT.gate_up_rows
        {
            let un = if set.kernel.staged().1 {
                ""
            } else {
                " (unstaged)"
            };
            let name = format!(
                "moe down f32 tuning lanes {} rows {} slot groups {}{un}",
                t.down_lanes,
                t.down_rows,
                set.kernel.down_split()
            );
            r.case(sp(name, 1, l, true, dn), m, &|p, c| {
                set.kernel.record(p, &ctx, &d[c % d.len()])
            })?;
        }
    }

    // The MoE over columns (multi-stream decode, not in the single-stream plan): nb = 1..8
    // columns whose routes are (a) independent random logits per column or (b) the same logits
    // in every column (one union of K experts), each form of the two stages. Bytes: the
    // weights of the union of the chosen experts (what the union forms read; the per-column
    // forms read K experts per column from the cache hierarchy) plus the activations.
    let cols_k = &b.moe_set(Numerics::F32).kernel;
    if cols_k.supports_cols() {
        moe_cols::bench_moe_cols(&ctx, &mut r, &sp, cols_k, m, &mut rng)?;
    }

    let bytes = 4 * v as u64 + 8 * (v as u64).div_ceil(2048);
    r.case(
        sp(format!("argmax [{v}] (partial+finish)"), 2, 1, false, bytes),
        m,
        &|p, _| b.argmax.record(p, &b.argmax_b),
    )?;

    // The whole step in the plan's unfused form (separate norms and router dispatch: the int8
    // numerics' form), which the rows above model; the default folded plan records fewer,
    // fused dispatches (its per-op weights: `nibble bench --profile`).
    let plan: Vec<&Row> = r.rows.iter().filter(|x| !x.alt).collect();
    let disp_token: usize = plan.iter().map(|x| x.disp * x.per_token).sum();
    let bytes_token: u64 = plan.iter().map(|x| x.bytes * x.per_token as u64).sum();
    let sum_us: f64 = plan.iter().map(|x| x.us_token()).sum();
    let s = Spec {
        name: format!(
            "whole step, unfused form @pos {}.. ({disp_token} dispatches)",
            args.pos
        ),
        disp: disp_token,
        per_token: 1,
        alt: true,
        bytes: bytes_token,
        pos: args.pos,
    };
    r.case(s, m_step, &|p, c| b.record_step(p, args.pos + c as u32))?;
    // Found by name: `--only` may have skipped any row (then its figure reads 0).
    let row = |prefix: &str| r.rows.iter().find(|x| x.name.starts_with(prefix));
    let (step, step_cpu) = row("whole step").map_or((0.0, 0.0), |x| (x.m.us(), x.m.cpu_us));
    let empty_us = row("ref: empty dispatch").map_or(0.0, |x| x.m.us());
    let read_gbps = row("ref: read").map_or(0.0, |x| x.gbps());

    let tok_s = |us: f64| if us > 0.0 { 1e6 / us } else { 0.0 };
    let header = format!(
        "nibble kernel_bench: '{}' {:?}, shapes {}, numerics {nm}, {} layers, plan pos {}, \
         {m} calls/pass, {} reps, time column = {}",
        ctx.info.name,
        ctx.info.backend,
        if args.full { "full" } else { "tiny" },
        l,
        args.pos,
        args.reps,
        if timer.has_timestamps() {
            "gpu us"
        } else {
            "wall us"
        }
    );
    let footer = format!(
        "unfused-form rows: {disp_token} dispatches/token, {:.1} MB/token, sum {sum_us:.1} us/token = {:.1} tok/s\n\
         whole step measured: {step:.1} us/token = {:.1} tok/s on the GPU, plus {:.1} us/token \
         of host recording (not overlapped with the GPU in a folded run)\n\
         floors: dispatch {empty_us:.2} us x {disp_token} = {:.1} us; bytes at {read_gbps:.1} GB/s = {:.1} us\n\
         bench time {:.1} s",
        bytes_token as f64 / 1e6,
        tok_s(sum_us),
        tok_s(step),
        step_cpu,
        empty_us * disp_token as f64,
        bytes_token as f64 / read_gbps.max(1e-9) / 1e3,
        t1.elapsed().as_secs_f64()
    );
    let text = format!("{}{footer}", timing::table(&r.rows, &header));
    if args.json {
        eprintln!("{text}");
        let meta = [
            ("adapter", ctx.info.name.clone()),
            (
                "shapes",
                if args.full { "full" } else { "tiny" }.to_string(),
            ),
            ("numerics", nm.to_string()),
            ("pos", args.pos.to_string()),
            ("timestamps", timer.has_timestamps().to_string()),
        ];
        println!("{}", timing::json(&r.rows, &meta));
    } else {
        println!("{text}");
    }
    Ok(())
}
