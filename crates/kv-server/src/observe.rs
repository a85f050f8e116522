//! The server's Prometheus metrics (the state's own are `kv_state::observe`'s): names and labels. The recorder and its `/metrics`
//! endpoint are `kv_common::telemetry`'s; when no metrics address is set none is installed and
//! every call here is a no-op.

use std::time::Duration;

/// The histograms and their buckets, for `kv_common::telemetry::Metrics::install`.
pub const BUCKETS: &[(&str, &[f64])] = &[(
    "kv_indexer_request_duration_seconds",
    kv_common::buckets::SECONDS_10US_TO_1S,
)];

/// Describes every metric of the server and of its state and exports each at 0 (the answers
/// per method with code `Ok`), so that dashboards and alerts see the series from start.
pub fn register() {
    kv_state::observe::register();
    metrics::describe_counter!(
        "kv_indexer_requests_total",
        "gRPC calls answered, by method and status code"
    );
    metrics::describe_histogram!(
        "kv_indexer_request_duration_seconds",
        metrics::Unit::Seconds,
        "Time from a call's request head to its answer, by method and status code"
    );
    for rpc in crate::access::METHODS {
        metrics::counter!("kv_indexer_requests_total", "rpc" => rpc, "code" => "Ok").absolute(0);
    }
    metrics::describe_counter!(
        "kv_indexer_rejections_total",
        "Prefix queries turned away: admission (over the in-flight bound) or deadline (budget already spent)"
    );
    for class in ["admission", "deadline"] {
        metrics::counter!("kv_indexer_rejections_total", "class" => class).absolute(0);
    }
    kv_common::series::counters_from_zero(&[
        (
            "kv_indexer_connections_refused_total",
            "Connections closed at once because the listener served its bound of connections",
        ),
        (
            "kv_indexer_tls_handshake_failures_total",
            "Connections that did not complete their TLS handshake",
        ),
    ]);
    kv_common::series::counters_from_zero(&[(
        "kv_indexer_predicted_blocks_total",
        "Block predictions recorded from routers (PredictExternalKv); memory only, never placements",
    )]);
    kv_common::series::gauges_from_zero(&[
        (
            "kv_indexer_predictions",
            "Block-worker predictions held (expired ones until the next sweep, at most a second later)",
        ),
        (
            "kv_indexer_prefix_queries_inflight",
            "Prefix queries admitted and not yet answered",
        ),
        (
            "kv_indexer_serving",
            "1 while the server answers SERVING to health checks; 0 while it recovers its state or, as a replica, lags its shared log",
        ),
    ]);
}

/// A prefix query admitted (`1`) or answered (`-1`).
pub fn prefix_queries_inflight(change: f64) {
    metrics::gauge!("kv_indexer_prefix_queries_inflight").increment(change);
}

/// A prediction recorded `recorded` blocks; `held` pairs are in the table now.
pub fn predictions(recorded: usize, held: usize) {
    metrics::counter!("kv_indexer_predicted_blocks_total").increment(recorded as u64);
    metrics::gauge!("kv_indexer_predictions").set(held as f64);
}

/// The health the server publishes.
pub fn serving(serving: bool) {
    metrics::gauge!("kv_indexer_serving").set(if serving { 1.0 } else { 0.0 });
}

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
