//! Deadlines for grammar steps: one watchdog thread cancels, through llguidance's cancellation
//! handles, any step still running past its deadline.
//!
//! Why: some grammars send llguidance into a loop that neither ends nor fails (a lexer dead end
//! such as `start: A B` with `A: /a+/`, `B: /a/` forces `a` bytes forever while its memory
//! grows). Its loops poll the handle, so a cancelled step returns an error and the request ends
//! with it instead of holding the engine thread.

use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use llguidance::CancellationHandle;

/// The longest a grammar's first mask may take (at compile time, off the engine thread; it
/// builds the lexer's first states, tens of milliseconds for a large schema). Parser creation
/// itself cannot be cancelled; [`crate::grammar::MAX_GRAMMAR_BYTES`] bounds it.
pub const FIRST_STEP_LIMIT: Duration = Duration::from_secs(2);

/// The longest one mask during generation may take: it holds the engine thread, so every
/// other stream waits on it. Masks take well under a millisecond to a few milliseconds.
pub const STEP_LIMIT: Duration = Duration::from_millis(500);

struct Watch {
    /// (ticket, deadline, handle) of the steps running now.
    steps: Mutex<Vec<(u64, Instant, CancellationHandle)>>,
    wake: Condvar,
    next: Mutex<u64>,
}

fn watch() -> &'static Watch {
    static W: OnceLock<&'static Watch> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Watch = Box::leak(Box::new(Watch {
            steps: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            next: Mutex::new(0),
        }));
        // The thread lives as long as the process; it sleeps while no step runs.
        let spawned = std::thread::Builder::new()
            .name("grammar-watchdog".into())
            .spawn(move || run(w));
        if spawned.is_err() {
            // Without the thread steps run unguarded, as before deadlines existed.
            eprintln!("warning: no grammar watchdog thread; grammar steps have no time limit");
        }
        w
    })
}

fn run(w: &'static Watch) {
    let mut steps = w.steps.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let now = Instant::now();
        for (_, deadline, handle) in steps.iter() {
            if *deadline <= now {
                handle.cancel();
            }
        }
        let wait = (steps.iter())
            .map(|(_, d, _)| d.saturating_duration_since(now))
            .filter(|d| !d.is_zero())
            .min()
            .unwrap_or(Duration::from_secs(3600));
        steps = w
            .wake
            .wait_timeout(steps, wait)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
}

/// Runs `f` with `handle` cancelled if it is still running after `limit`.
pub fn guard<T>(handle: Option<CancellationHandle>, limit: Duration, f: impl FnOnce() -> T) -> T {
    let Some(handle) = handle else {
        return f();
    };
    let w = watch();
    let ticket = {
        let mut n = w.next.lock().unwrap_or_else(|e| e.into_inner());
        *n += 1;
        *n
    };
    w.steps.lock().unwrap_or_else(|e| e.into_inner()).push((
        ticket,
        Instant::now() + limit,
        handle,
    ));
    w.wake.notify_one();
    let out = f();
    w.steps
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(t, _, _)| *t != ticket);
    out
}
