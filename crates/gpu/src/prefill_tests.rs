//! The GEMM prefill (prefill.rs) end to end on lavapipe: its logits against the oracle's and the
//! column prefill's for prompts of odd lengths, in one chunk and in many (a 16-token chunk), in
//! one call and continued at a non-zero position; the greedy continuation from the KV rows it
//! wrote equal to the oracle's; and the same for a stream slot.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::{model_with_norm_scale, model_with_vocab};
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};
use nibble_model::weights::WeightSource;

/// The GEMM prefill for every prompt of 2 tokens or more (the default sends the short ones
/// through the column prefill: `default_prefill_takes_the_column_prefill_below_the_crossover`).
/// A short chunk's qkv and o-proj GEMMs run in the default K splits (as many of
/// `SHORT_K_SPLITS` as the tiny model's few blocks of K allow); [`unsplit`] turns them off.
fn opts(prefill_chunk: u32, streams: usize) -> GpuOptions {
    GpuOptions {
        context_len: 256,
        prefill_chunk,
        streams,
        prefill_gemm_min: 2,
        ..Default::default()
    }
}

/// `o` with a short chunk's qkv and o-proj GEMMs whole (`--tune prefill_ksplits=1`).
fn unsplit(o: GpuOptions) -> GpuOptions {
    GpuOptions {
        tune: crate::tune::Tune {
            prefill_ksplits: Some(1),
            ..o.tune
        },
        ..o
    }
}

/// `o` with the matrix-unit GEMM's 32-token tiles single-buffered (`--tune prefill_dbuf=0`,
/// the form before run 133; the same as `o` where the device has no matrix units, as lavapipe).
fn single_buffered(o: GpuOptions) -> GpuOptions {
    GpuOptions {
        tune: crate::tune::Tune {
            prefill_dbuf: Some(0),
            ..o.tune
        },
        ..o
    }
}

fn column_attention(o: GpuOptions) -> GpuOptions {
    GpuOptions {
        prefill_query_tiles: false,
        ..o
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 131 + seed * 17 + 3) % 512)
        .collect()
}

#[test]
fn gemm_prefill_matches_the_oracle_and_the_column_prefill() {
    let Some(ctx) = gpu("gemm_prefill_matches_the_oracle_and_the_column_prefill") else {
        return;
    };
    let m = model_with_vocab(14, false, 512);
    let mut columns = GpuBackend::with_context(&ctx, m.as_ref(), opts(0, 0)).unwrap();
    assert!(columns.prefill_summary().starts_with("column prefill"));
    // The query tiles (default) in many chunks (K-split and whole) and in one (512 asked for,
    // shortened to the 256-position context); the column attention in many and in one; where
    // the device has matrix units, also short chunks with two GEMM staging buffers (on 32-token
    // tiles: the experts' and the split dense GEMMs'), split and whole.
    let mut cases = vec![
        (16u32, opts(16, 0)),
        (16, unsplit(opts(16, 0))),
        (256, opts(512, 0)),
        (16, column_attention(opts(16, 0))),
        (256, column_attention(opts(512, 0))),
    ];
    if crate::kernels::gemm_coop::supported(&ctx) {
        cases.push((16, single_buffered(opts(16, 0))));
        cases.push((16, single_buffered(unsplit(opts(16, 0)))));
    }
    for (chunk, o) in cases {
        let tiles = o.prefill_query_tiles;
        let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
        let d = gb.describe();
        assert!(
            d.contains("GEMM prefill (") && d.contains(&format!("chunks of up to {chunk} tokens")),
            "{d}"
        );
        for (len, seed) in [(2usize, 1u32), (9, 2), (37, 3), (100, 4)] {
            let p = prompt(len, seed);
            let mut rb = RefBackend::new(m.clone(), 256).unwrap();
            let want = rb.prefill(&p).unwrap();
            gb.truncate(0).unwrap();
            let got = gb.prefill(&p).unwrap();
            assert_eq!(gb.position(), len);
            let d = gb.describe();
            let kind = if tiles {
                "; query-tile attention)"
            } else {
                "; column attention)"
            };
            assert!(d.contains(kind), "{d}");
            columns.truncate(0).unwrap();
            let col = columns.prefill(&p).unwrap();
            let (c, cc) = (cosine(&got, &want), cosine(&got, &col));
            eprintln!(
                "chunk {chunk} len {len}: cosine vs oracle {c:.9}, vs column prefill {cc:.9}"
            );
            assert!(
                c >= 0.99999,
                "chunk {chunk} len {len}: cosine {c} with the oracle"
            );
            assert!(
                cc >= 0.99999,
                "chunk {chunk} len {len}: cosine {cc} with the column prefill"
            );
            assert_eq!(
                argmax(&got),
                argmax(&want),
                "chunk {chunk} len {len}: next token"
            );
            // The rows it wrote carry the decode: the oracle's greedy continuation.
            let next = argmax(&want);
            let ids = gb.decode_greedy(next, 12, &[]).unwrap();
            assert_eq!(
                ids,
                rb.decode_greedy(next, 12, &[]).unwrap(),
                "chunk {chunk} len {len}"
            );
        }
        // Continued at a non-zero position: a second prefill reads the first one's rows.
        let p = prompt(53, 9);
        let mut rb = RefBackend::new(m.clone(), 256).unwrap();
        let want = rb.prefill(&p).unwrap();
        gb.truncate(0).unwrap();
        gb.prefill(&p[..20]).unwrap();
        let got = gb.prefill(&p[20..]).unwrap();
        let c = cosine(&got, &want);
        assert!(c >= 0.99999, "chunk {chunk}: continued prefill cosine {c}");
    }
}

#[test]
fn gemm_prefill_of_a_stream_slot_matches_the_main_sequence() {
    let Some(ctx) = gpu("gemm_prefill_of_a_stream_slot_matches_the_main_sequence") else {
        return;
    };
    let m = model_with_vocab(15, false, 512);
    for o in [opts(16, 2), column_attention(opts(16, 2))] {
        let o = GpuOptions {
            prefill_gemm_min: crate::backend::GEMM_PREFILL_MIN_TOKENS,
            ..o
        };
        stream_slot_case(&ctx, m.clone(), o);
    }
}

fn stream_slot_case(
    ctx: &crate::context::Context,
    m: std::sync::Arc<crate::backend_tests::Mem>,
    o: GpuOptions,
) {
    let mut gb = GpuBackend::with_context(ctx, m.as_ref(), o).unwrap();
    let mut rb = RefBackend::new(m.clone(), 256).unwrap();
    let p = prompt(41, 5);
    let want = rb.prefill(&p).unwrap();
    let next = argmax(&want);
    let want_ids = rb.decode_greedy(next, 10, &[]).unwrap();
    // Slot 1 (41 tokens: the GEMM prefill), with slot 0 holding another prompt (its rows must
    // not be touched; 30 tokens, below GEMM_PREFILL_MIN_TOKENS: the column prefill).
    assert!(p.len() >= crate::backend::GEMM_PREFILL_MIN_TOKENS);
    let other = prompt(30, 6);
    assert!(other.len() < crate::backend::GEMM_PREFILL_MIN_TOKENS);
    let lo = gb.stream_prefill(0, 0, &other).unwrap();
    let got = gb.stream_prefill(1, 0, &p).unwrap();
    let c = cosine(&got, &want);
    assert!(c >= 0.99999, "stream slot prefill cosine {c}");
    let ids = gb
        .streams_decode_greedy(&[Some(argmax(&lo)), Some(next)], 10, &[])
        .unwrap();
    assert_eq!(ids[1], want_ids, "slot 1's continuation");
    let mut ro = RefBackend::new(m.clone(), 256).unwrap();
    let lo_want = ro.prefill(&other).unwrap();
    assert_eq!(
        ids[0],
        ro.decode_greedy(argmax(&lo_want), 10, &[]).unwrap(),
        "slot 0's continuation"
    );
}

/// GEMM inputs far past f16's range (RMSNorm weights x 2048: normalised rows up to ~10^4): the
/// GEMM prefill still gives the oracle's logits and next token. On lavapipe this is the f32
/// kernel with large inputs; where the matrix-unit GEMM runs (the H200) its inputs overflow f16
/// and this checks the fallback to f32 fmas (backend_prefill.rs `run_gemm_prefill`).
#[test]
fn gemm_prefill_of_inputs_past_f16_range_matches_the_oracle() {
    let Some(ctx) = gpu("gemm_prefill_of_inputs_past_f16_range_matches_the_oracle") else {
        return;
    };
    let m = model_with_norm_scale(15, 512, 2048.0);
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), opts(64, 0)).unwrap();
    let p = prompt(23, 5);
    let mut rb = RefBackend::new(m.clone(), 256).unwrap();
    let want = rb.prefill(&p).unwrap();
    let got = gb.prefill(&p).unwrap();
    assert!(
        want.iter().all(|v| v.is_finite()),
        "the oracle's logits are finite"
    );
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{}",
        gb.prefill_summary()
    );
    let c = cosine(&got, &want);
    eprintln!(
        "inputs past f16 range: cosine vs oracle {c:.9}; {}",
        gb.prefill_summary()
    );
    assert!(c >= 0.99999, "cosine {c} with the oracle");
    assert_eq!(argmax(&got), argmax(&want), "next token");
    // The continuation decodes from the rows the (possibly repeated) prefill wrote.
    let (g1, w1) = (
        gb.step(argmax(&got) as u32).unwrap(),
        rb.step(argmax(&want) as u32).unwrap(),
    );
    assert_eq!(argmax(&g1), argmax(&w1), "the token after");
}

/// With the default options a prompt under `GEMM_PREFILL_MIN_TOKENS` takes the column prefill
/// and a longer one the GEMM prefill, each plan built at its first use; a prompt continued
/// across the two (column rows read by the GEMM prefill, and back) keeps the oracle's logits and
/// greedy continuation.
#[test]
fn default_prefill_takes_the_column_prefill_below_the_crossover() {
    let Some(ctx) = gpu("default_prefill_takes_the_column_prefill_below_the_crossover") else {
        return;
    };
    let min = crate::backend::GEMM_PREFILL_MIN_TOKENS;
    let m = model_with_vocab(16, false, 512);
    let o = GpuOptions {
        context_len: 256,
        ..Default::default()
    };
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
    assert!(
        gb.prefill_summary()
            .ends_with(&format!("prompts under {min} tokens: the column prefill")),
        "{}",
        gb.prefill_summary()
    );
    assert_eq!(
        gb.prefills_built(),
        (false, false),
        "nothing built before a prompt"
    );
    let p = prompt(min + 37, 7);
    let mut rb = RefBackend::new(m.clone(), 256).unwrap();
    let want = rb.prefill(&p).unwrap();
    // (tokens, column built, GEMM built) after each piece: 9 short, `min` long, 5 short, the
    // last 23 short again: the KV rows cross paths both ways.
    let cuts = [
        (9, (true, false)),
        (9 + min, (true, true)),
        (14 + min, (true, true)),
        (p.len(), (true, true)),
    ];
    let mut from = 0;
    let mut got = Vec::new();
    for (to, built) in cuts {
        got = gb.prefill(&p[from..to]).unwrap();
        assert_eq!(gb.position(), to);
        assert_eq!(gb.prefills_built(), built, "after {to} tokens");
        if to == 9 {
            let mut r9 = RefBackend::new(m.clone(), 256).unwrap();
            let c = cosine(&got, &r9.prefill(&p[..9]).unwrap());
            assert!(c >= 0.99999, "9-token column prefill: cosine {c}");
        }
        from = to;
    }
    let c = cosine(&got, &want);
    eprintln!("prefill in pieces across both paths: cosine vs oracle {c:.9}");
    assert!(c >= 0.99999, "cosine {c} with the oracle");
    let next = argmax(&want);
    assert_eq!(argmax(&got), next, "next token");
    assert_eq!(
        gb.decode_greedy(next, 12, &[]).unwrap(),
        rb.decode_greedy(next, 12, &[]).unwrap(),
        "greedy continuation"
    );
    // The threshold at 2: a short prompt takes the GEMM prefill; no column plan is built.
    let mut all_gemm = GpuBackend::with_context(
        &ctx,
        m.as_ref(),
        GpuOptions {
            context_len: 256,
            prefill_gemm_min: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let short = all_gemm.prefill(&p[..9]).unwrap();
    assert_eq!(all_gemm.prefills_built(), (false, true));
    let mut r9 = RefBackend::new(m.clone(), 256).unwrap();
    let c = cosine(&short, &r9.prefill(&p[..9]).unwrap());
    assert!(c >= 0.99999, "9-token GEMM prefill: cosine {c}");
}

/// `bench --profile-prefill`: one chunk's GPU time per op kind, the embedding once and every
/// layer op once per layer, in recording order, each time finite and not negative. The
/// profile prefills for real: the greedy decode from the rows it wrote equals the oracle's. A
/// prompt longer than a chunk is an error.
#[test]
fn prefill_profile_names_each_op_per_layer_and_prefills() {
    let Some(ctx) = gpu("prefill_profile_names_each_op_per_layer_and_prefills") else {
        return;
    };
    let need = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
    if !ctx.features.contains(need) {
        eprintln!("skipped: no timestamps inside passes on this adapter");
        return;
    }
    let m = model_with_vocab(21, false, 512);
    let layers = m.config().num_layers;
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), opts(16, 0)).unwrap();
    let p = prompt(11, 5);
    let ops = gb
        .profile_prefill(&p)
        .unwrap()
        .expect("timestamps and the GEMM prefill");
    let names: Vec<&str> = ops.iter().map(|o| o.op.as_str()).collect();
    let want = [
        "embed",
        "attn norm",
        "qkv gemm",
        "attention (kv write + attend)",
        "o gemm +=",
        "ffn norm",
        "router gemm",
        "moe route",
        "moe plan",
        "moe gate/up gemm",
        "moe down gemm",
        "moe combine",
    ];
    assert_eq!(names, want);
    for o in &ops {
        let calls = if o.op == "embed" { 1 } else { layers };
        assert_eq!(o.calls, calls, "{}", o.op);
        assert!(o.us.is_finite() && o.us >= 0.0, "{}: {} us", o.op, o.us);
    }
    assert!(ops.iter().map(|o| o.us).sum::<f64>() > 0.0);
    assert_eq!(gb.position(), p.len());
    let mut rb = RefBackend::new(m.clone(), 256).unwrap();
    let next = argmax(&rb.prefill(&p).unwrap());
    assert_eq!(
        gb.decode_greedy(next, 8, &[]).unwrap(),
        rb.decode_greedy(next, 8, &[]).unwrap(),
        "greedy decode from the profiled prefill's rows"
    );
    assert!(
        gb.profile_prefill(&prompt(17, 5)).is_err(),
        "17 tokens, chunk of 16"
    );
}
