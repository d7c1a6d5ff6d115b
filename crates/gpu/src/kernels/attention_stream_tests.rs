//! Lavapipe tests of the streamed chunk body (attention_stream.wgsl, `AttnForm::Stream`) against
//! the scalar references, through the single-token harness of attention_tests.rs.

use super::*;

/// The streamed chunk body (`AttnForm::Stream`) against the references over the shapes the
/// tiled body is checked at: odd group sizes and head dims (D/4 not dividing the workgroup, so
/// some V lanes idle), one kv head, G = 16 (all heads on one score thread, four reduction rounds
/// of up to five heads), the real head shape; key blocks of 1 to 64 rows with the owning row in the first,
/// a middle or the last block; V batches of 1 to 16 rows; the single, chunk + combine and fused
/// forms, tight and loose position bounds; f32 and f16 caches. One compile per shape.
/// Not checkable here: that row `pos`'s v comes from qkv rather than the cache. lavapipe's
/// compiler may move the V load after the owning workgroup's write of that row (a
/// workgroupBarrier orders workgroup memory only), so reading the cache there passes on lavapipe
/// (mutation-checked, 2026-12-07); on a GPU the load is issued first and would read the old row.
#[test]
fn attention_streamed_form_matches_reference() {
    let Some(ctx) = gpu("attention_streamed_form_matches_reference") else {
        return;
    };
    // (heads, kv_heads, head_dim, ctx, chunk, split override, tile loads, v rows, cache): six
    // kernels (lavapipe compiles each pipeline at its first dispatch, ~2 s; 20 s at G = 32).
    let shapes = [
        // 16-row blocks at G = 2: four head slices, two with no head to score.
        (4, 2, 32, 512, 16, None, TILE_LOADS, V_ROWS, CacheType::F32),
        (6, 2, 36, 100, 7, None, 8, 3, CacheType::F32),
        (5, 1, 20, 64, 5, None, 1, 1, CacheType::F16),
        (16, 1, 16, 80, 4, Some((4, 64)), 4, 2, CacheType::F32),
        (
            32,
            4,
            128,
            384,
            16,
            Some((4, 128)),
            4,
            V_ROWS,
            CacheType::F16,
        ),
        (8, 2, 32, 300, 16, Some((1, 256)), 8, 5, CacheType::F32),
    ];
    for (i, (hq, hkv, d, n, chunk, split, loads, v_rows, cache)) in shapes.into_iter().enumerate() {
        let p = AttentionParams {
            cache,
            ..params(hq, hkv, d, n, chunk)
        };
        let case = |seed: u64, merge: Combine| {
            let mut c = Case::new(p, seed);
            c.form = AttnForm::Stream;
            c.split = split;
            c.tile_loads = loads;
            c.v_rows = v_rows;
            c.merge = merge;
            c.fused_max = u32::MAX;
            c
        };
        let k = kernel(&ctx, &case(0, Combine::Dispatch));
        for (j, pos) in [0, 1, chunk - 1, chunk, 3 * chunk + 1, n / 2 + 3, n - 1]
            .into_iter()
            .enumerate()
        {
            let seed = 3000 + 100 * i as u64 + 4 * j as u64;
            // The fused form twice on one scratch: its arrival counters go back to zero.
            let mut c = case(seed, Combine::Fused);
            c.repeats = 2;
            check_case_with(&ctx, &k, c, (pos, pos));
            check_case_with(&ctx, &k, case(seed + 1, Combine::Dispatch), (pos, pos));
            // A loose bound: chunks past pos exit without touching anything.
            check_case_with(&ctx, &k, case(seed + 2, Combine::Dispatch), (pos, n - 1));
        }
    }
    let p = params(8, 2, 32, 300, 16);
    let bad = |tile_loads, v_rows| {
        let shape = ChunkShape {
            form: AttnForm::Stream,
            tile_loads,
            v_rows,
        };
        AttentionKernel::with_shape(&ctx, p, None, shape).is_err()
    };
    assert!(bad(0, 4) && bad(17, 4) && bad(8, 0) && bad(8, 17));
    // More than 32 heads per kv head would spill the streamed form's registers.
    let shape = ChunkShape {
        form: AttnForm::Stream,
        ..ChunkShape::default()
    };
    assert!(AttentionKernel::with_shape(&ctx, params(64, 1, 32, 64, 16), None, shape).is_err());
}

/// A kernel with a deep kernel (`--tune attn_deep`) records each step with the kernel its
/// position bound picks: bit for bit that kernel's output (the two bodies' bits differ), the
/// reference's values either way, the picked kernel's dispatch count. A deep kernel needing
/// more partial slots than the first, built for other params or holding a deep kernel itself is
/// refused.
#[test]
fn attention_deep_kernel_takes_the_steps_from_its_position() {
    let Some(ctx) = gpu("attention_deep_kernel_takes_the_steps_from_its_position") else {
        return;
    };
    let p = params(8, 2, 32, 300, 16);
    let case = |seed: u64, form: AttnForm| {
        let mut c = Case::new(p, seed);
        c.form = form;
        if form == AttnForm::Stream {
            c.split = Some((2, 256));
            c.tile_loads = 8;
        }
        c
    };
    let tiles = kernel(&ctx, &case(0, AttnForm::Tiles));
    let stream = kernel(&ctx, &case(0, AttnForm::Stream));
    let from = 100;
    let both = tiles.clone().with_deep(stream.clone(), from).unwrap();
    assert_eq!(both.deep_shape(), Some((from, stream.shape())));
    assert_eq!(tiles.deep_shape(), None);
    for (j, pos) in [5, 99, 100, 250].into_iter().enumerate() {
        let seed = 4000 + j as u64;
        check_case_with(&ctx, &both, case(seed, AttnForm::Tiles), (pos, pos));
        let out = |k: &AttentionKernel| {
            run_with(
                &ctx,
                k,
                &case(seed, AttnForm::Tiles),
                (pos, pos),
                false,
                false,
            )
        };
        let (want, other) = match pos >= from {
            true => (out(&stream), out(&tiles)),
            false => (out(&tiles), out(&stream)),
        };
        let got = out(&both);
        assert_ne!(want.out, other.out, "pos {pos}: the bodies' bits differ");
        assert_eq!(got.out, want.out, "pos {pos}");
        assert_eq!(got.dispatches, want.dispatches, "pos {pos}");
    }
    let few = kernel(&ctx, &case(0, AttnForm::Stream));
    assert!(few.with_deep(tiles.clone(), from).is_err());
    let other = kernel(&ctx, &Case::new(params(8, 2, 32, 200, 16), 0));
    assert!(tiles.clone().with_deep(other, from).is_err());
    assert!(tiles.clone().with_deep(both.clone(), from).is_err());
}
