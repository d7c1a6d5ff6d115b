//! Every prompt token's logits ([`Backend::prefill_rows`], prefill/rows.rs) on lavapipe against
//! the oracle stepped token by token: through the GEMM prefill in many chunks and in one, for
//! the main sequence (from position 0 and continued) and for a stream slot, and token by token
//! where the GEMM prefill is off; the cache the rows leave continues as the oracle's.

use crate::backend::{GpuBackend, GpuOptions};
use crate::backend_tests::model_with_vocab;
use crate::testing::{cosine, gpu};
use nibble_backend::{argmax, Backend, RefBackend};

fn opts(prefill_chunk: u32, streams: usize) -> GpuOptions {
    GpuOptions {
        context_len: 128,
        prefill_chunk,
        streams,
        ..Default::default()
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 197 + seed * 31 + 5) % 512)
        .collect()
}

/// The oracle's logits after each of `tokens`, appended to `rb`'s sequence.
fn oracle_rows(rb: &mut RefBackend, tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens.iter().map(|&t| rb.step(t).unwrap()).collect()
}

/// Rows as handed, checked to come in order, each once.
fn collect(
    run: impl FnOnce(&mut nibble_backend::RowSink<'_>) -> anyhow::Result<()>,
) -> Vec<Vec<f32>> {
    let mut rows: Vec<Vec<f32>> = Vec::new();
    run(&mut |i, l| {
        assert_eq!(i, rows.len(), "rows in order");
        rows.push(l.to_vec());
        Ok(())
    })
    .unwrap();
    rows
}

fn assert_rows_match(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let c = cosine(g, w);
        assert!(c >= 0.99999, "{what}: row {i} cosine {c}");
        assert_eq!(argmax(g), argmax(w), "{what}: row {i} argmax");
    }
}

#[test]
fn prompt_rows_match_the_oracle_stepped() {
    let Some(ctx) = gpu("prompt_rows_match_the_oracle_stepped") else {
        return;
    };
    let m = model_with_vocab(21, false, 512);
    let p = prompt(100, 1);
    let tail = prompt(9, 2);
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    let want = oracle_rows(&mut rb, &p);
    let want_tail = oracle_rows(&mut rb, &tail);
    let want_next = rb
        .decode_greedy(argmax(want_tail.last().unwrap()), 6, &[])
        .unwrap();
    // 16-token chunks (100 = 6 x 16 + 4: a batch of rows each), one chunk (four batches of
    // up to 32 rows, the two readback buffers each used twice), and the GEMM prefill off
    // (token by token).
    for (name, o) in [
        ("chunks of 16", opts(16, 0)),
        ("one chunk", opts(512, 0)),
        ("token by token", opts(0, 0)),
    ] {
        let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
        let got = collect(|row| gb.prefill_rows(&p, 0, row));
        assert_rows_match(&got, &want, name);
        assert_eq!(gb.position(), p.len(), "{name}: position");
        // Continued at a non-zero position (a 9-token tail: under the GEMM crossover, which
        // rows take anyway), then greedy decode from the cache the rows wrote.
        let got_tail = collect(|row| gb.prefill_rows(&tail, 0, row));
        assert_rows_match(&got_tail, &want_tail, name);
        let next = gb
            .decode_greedy(argmax(got_tail.last().unwrap()), 6, &[])
            .unwrap();
        assert_eq!(next, want_next, "{name}: continuation");
        // From index 35 on (inside the third 16-token chunk; inside the second batch of one chunk):
        // those rows alone, the same logits.
        gb.truncate(0).unwrap();
        let mut later = Vec::new();
        gb.prefill_rows(&p, 35, &mut |i, l| {
            assert_eq!(i, 35 + later.len(), "{name}");
            later.push(l.to_vec());
            Ok(())
        })
        .unwrap();
        assert_rows_match(&later, &want[35..], name);
    }
}

#[test]
fn stream_rows_match_the_oracle_stepped() {
    let Some(ctx) = gpu("stream_rows_match_the_oracle_stepped") else {
        return;
    };
    let m = model_with_vocab(22, false, 512);
    let p = prompt(37, 3);
    let mut rb = RefBackend::new(m.clone(), 128).unwrap();
    let want = oracle_rows(&mut rb, &p);
    for (name, o) in [("GEMM", opts(16, 2)), ("token by token", opts(0, 2))] {
        let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), o).unwrap();
        // Slot 1 keeps its first 7 positions from an earlier prefill of the same tokens.
        gb.stream_prefill(1, 0, &p[..7]).unwrap();
        let got = collect(|row| gb.stream_prefill_rows(1, 7, &p[7..], row));
        assert_rows_match(&got, &want[7..], name);
        let ids = gb
            .streams_decode_greedy(&[None, Some(argmax(got.last().unwrap()))], 5, &[])
            .unwrap();
        let mut ro = RefBackend::new(m.clone(), 128).unwrap();
        ro.prefill(&p).unwrap();
        let want_ids = ro
            .decode_greedy(argmax(want.last().unwrap()), 5, &[])
            .unwrap();
        assert_eq!(ids[1], want_ids, "{name}: slot 1's continuation");
    }
}

/// A sink's error ends the call and the position stays where it was; bad ids are refused
/// before any row.
#[test]
fn prompt_rows_refuse_bad_input_and_stop_on_a_sink_error() {
    let Some(ctx) = gpu("prompt_rows_refuse_bad_input_and_stop_on_a_sink_error") else {
        return;
    };
    let m = model_with_vocab(23, false, 512);
    let mut gb = GpuBackend::with_context(&ctx, m.as_ref(), opts(16, 0)).unwrap();
    let mut seen = 0;
    let e = gb
        .prefill_rows(&prompt(20, 4), 0, &mut |i, _| {
            seen += 1;
            anyhow::ensure!(i < 3, "enough");
            Ok(())
        })
        .unwrap_err();
    assert!(e.to_string().contains("enough"), "{e}");
    assert_eq!(seen, 4);
    assert_eq!(gb.position(), 0);
    let e = gb
        .prefill_rows(&[1, 512], 0, &mut |_, _| panic!("no row"))
        .unwrap_err();
    assert!(e.to_string().contains("vocabulary"), "{e}");
    let e = gb
        .prefill_rows(&prompt(129, 4), 0, &mut |_, _| panic!("no row"))
        .unwrap_err();
    assert!(e.to_string().contains("exceeds the context"), "{e}");
    let e = gb
        .prefill_rows(&[], 0, &mut |_, _| panic!("no row"))
        .unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
}
