//! Prometheus metrics, kept in a `prometheus-client` registry and served at `/metrics` in the
//! OpenMetrics text format (which Prometheus scrapes natively).
//!
//! Names: `nibble_requests_total{status}` (every answered HTTP request, by status code),
//! `nibble_generated_tokens_total`, `nibble_prompt_tokens_total`, `nibble_cached_prompt_tokens_total`,
//! `nibble_queue_depth` (requests waiting for the engine), `nibble_active_streams` (requests the
//! engine has admitted and not finished), `nibble_decode_tokens_per_second` (decode speed of the
//! last finished request).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// `Content-Type` of the `/metrics` answer.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

/// The server's metrics; clones share the same values.
#[derive(Clone)]
pub struct Metrics {
    registry: std::sync::Arc<Registry>,
    requests: Family<Labels, Counter>,
    pub generated_tokens: Counter,
    pub prompt_tokens: Counter,
    pub cached_tokens: Counter,
    pub queue_depth: Gauge,
    pub active_streams: Gauge,
    pub decode_tps: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let requests = Family::<Labels, Counter>::default();
        let generated_tokens = Counter::default();
        let prompt_tokens = Counter::default();
        let cached_tokens = Counter::default();
        let queue_depth = Gauge::default();
        let active_streams = Gauge::default();
        let decode_tps = Gauge::<f64, AtomicU64>::default();
        // Counters get the `_total` suffix from the encoder.
        r.register(
            "nibble_requests",
            "HTTP requests answered, by status code",
            requests.clone(),
        );
        r.register(
            "nibble_generated_tokens",
            "Tokens generated",
            generated_tokens.clone(),
        );
        r.register(
            "nibble_prompt_tokens",
            "Prompt tokens received",
            prompt_tokens.clone(),
        );
        r.register(
            "nibble_cached_prompt_tokens",
            "Prompt tokens served from the KV cache (not recomputed)",
            cached_tokens.clone(),
        );
        r.register(
            "nibble_queue_depth",
            "Requests waiting for the engine",
            queue_depth.clone(),
        );
        r.register(
            "nibble_active_streams",
            "Requests admitted by the engine and not finished",
            active_streams.clone(),
        );
        r.register(
            "nibble_decode_tokens_per_second",
            "Decode speed of the last finished request",
            decode_tps.clone(),
        );
        Metrics {
            registry: std::sync::Arc::new(r),
            requests,
            generated_tokens,
            prompt_tokens,
            cached_tokens,
            queue_depth,
            active_streams,
            decode_tps,
        }
    }

    /// Counts one answered request.
    pub fn count_request(&self, status: u16) {
        self.requests
            .get_or_create(&vec![("status".to_owned(), status.to_string())])
            .inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_lists_every_metric_with_values() {
        let m = Metrics::new();
        m.count_request(200);
        m.count_request(200);
        m.count_request(429);
        m.generated_tokens.inc_by(17);
        m.queue_depth.set(3);
        m.decode_tps.set(41.5);
        let t = m.render();
        assert!(t.contains("nibble_requests_total{status=\"200\"} 2"), "{t}");
        assert!(t.contains("nibble_requests_total{status=\"429\"} 1"), "{t}");
        assert!(t.contains("nibble_generated_tokens_total 17"), "{t}");
        assert!(t.contains("nibble_queue_depth 3"), "{t}");
        assert!(t.contains("nibble_decode_tokens_per_second 41.5"), "{t}");
        assert!(t.contains("nibble_active_streams 0"), "{t}");
    }
}
