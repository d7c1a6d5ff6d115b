//! A request whose client left while it waited its turn costs no prefill: a scored prompt
//! emits no text, so only the worker's check before it starts can notice (a client that
//! dropped five admitted scoring requests held the next one for 25 s). Driven on the worker
//! directly, with a backend that gates and counts its prefills, so the order is fixed.

mod common;

use common::*;
use nibble_backend::{Backend, Qwen3MoeConfig, RowSink};
use nibble_engine::session::{GenParams, Session};
use nibble_server::metrics::Metrics;
use nibble_server::scheduler::{spawn, Event, Job};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The oracle, each prefill waiting for a permit and counted.
struct Gated {
    inner: nibble_backend::RefBackend,
    permits: Mutex<Receiver<()>>,
    prefills: Arc<AtomicUsize>,
}

impl Gated {
    fn gate(&self) {
        self.prefills.fetch_add(1, Ordering::SeqCst);
        let _ = self
            .permits
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(30));
    }
}

impl Backend for Gated {
    fn name(&self) -> String {
        "gated".into()
    }
    fn config(&self) -> &Qwen3MoeConfig {
        self.inner.config()
    }
    fn context_len(&self) -> usize {
        self.inner.context_len()
    }
    fn position(&self) -> usize {
        self.inner.position()
    }
    fn truncate(&mut self, pos: usize) -> anyhow::Result<()> {
        self.inner.truncate(pos)
    }
    fn prefill(&mut self, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.gate();
        self.inner.prefill(tokens)
    }
    fn prefill_rows(
        &mut self,
        tokens: &[u32],
        from: usize,
        row: &mut RowSink<'_>,
    ) -> anyhow::Result<()> {
        self.gate();
        self.inner.prefill_rows(tokens, from, row)
    }
}

#[test]
fn a_request_whose_client_left_while_waiting_is_not_prefilled() {
    let Some(_) = model_path() else { return };
    let (permit, permits) = sync_channel(8);
    let prefills = Arc::new(AtomicUsize::new(0));
    let backend = Gated {
        inner: backend(256),
        permits: Mutex::new(permits),
        prefills: prefills.clone(),
    };
    let (queue, worker) = spawn(
        Session::new(Box::new(backend)),
        tokenizer(),
        4,
        8,
        Metrics::new(),
    )
    .unwrap();
    let scoring = GenParams {
        max_tokens: 0,
        prompt_logprobs: Some(2),
        ..GenParams::default()
    };
    let submit = || {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        queue
            .submit(Job {
                prompt: vec![11, 22, 33, 44],
                gen: scoring.clone(),
                events: tx,
            })
            .unwrap();
        rx
    };
    let wait_for = |n: usize| {
        for _ in 0..3000 {
            if prefills.load(Ordering::SeqCst) >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("prefill {n} never started");
    };
    // A runs (held at its prefill); B and C arrive meanwhile and are admitted when A ends.
    let mut a = submit();
    wait_for(1);
    let mut b = submit();
    let c = submit();
    permit.send(()).unwrap();
    assert!(matches!(a.blocking_recv(), Some(Event::Done { .. })));
    // B runs (held); C's client leaves while C waits, admitted, for its turn.
    wait_for(2);
    drop(c);
    permit.send(()).unwrap();
    match b.blocking_recv() {
        Some(Event::Done {
            prompt_logprobs, ..
        }) => assert_eq!(prompt_logprobs.len(), 3),
        other => panic!("{other:?}"),
    }
    // D runs next: C was never prefilled.
    let mut d = submit();
    wait_for(3);
    permit.send(()).unwrap();
    assert!(matches!(d.blocking_recv(), Some(Event::Done { .. })));
    assert_eq!(prefills.load(Ordering::SeqCst), 3, "C was prefilled");
    drop(queue);
    worker.join().unwrap();
}
