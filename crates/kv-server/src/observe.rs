//! The server's Prometheus metrics (the state's own are `kv_state::observe`'s): names and labels. The recorder and its `/metrics`
//! endpoint are `kv_common::telemetry`'s; when no metrics address is set none is installed and
//! every call here is a no-op.

use std::time::Duration;

/// The histograms and their buckets, for `kv_common::telemetry::Metrics::install`.
pub const BUCKETS: &[(&str, &[f64])] = &[("kv_indexer_request_duration_seconds", LATENCY_BUCKETS)];

/// Latency buckets in seconds: 10 µs to 1 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0,
];

/// One answered call; `elapsed` runs from the arrival of its request head to its answer.
pub fn request(rpc: &'static str, code: tonic::Code, elapsed: Duration) {
    let code = code_label(code);
    metrics::counter!("kv_indexer_requests_total", "rpc" => rpc, "code" => code).increment(1);
    metrics::histogram!("kv_indexer_request_duration_seconds", "rpc" => rpc, "code" => code)
        .record(elapsed.as_secs_f64());
}

/// A prefix query turned away: `admission` (over the in-flight bound) or `deadline` (budget spent).
pub fn rejection(class: &'static str) {
    metrics::counter!("kv_indexer_rejections_total", "class" => class).increment(1);
}

/// A connection closed at once because the listener served its bound of connections.
pub fn connection_refused() {
    metrics::counter!("kv_indexer_connections_refused_total").increment(1);
}

/// A connection that did not complete its TLS handshake.
pub fn tls_handshake_failed() {
    metrics::counter!("kv_indexer_tls_handshake_failures_total").increment(1);
}

pub use kv_indexer_proto::code_label;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_labels_are_the_debug_names() {
        for value in 0..=16 {
            let code = tonic::Code::from_i32(value);
            assert_eq!(code_label(code), format!("{code:?}"));
        }
    }
}
