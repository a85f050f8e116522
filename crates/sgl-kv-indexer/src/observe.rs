//! Prometheus metrics: names, labels and the admin HTTP endpoint that serves them.
//!
//! The recorder is process-global (the `metrics` facade); when no metrics address is set none
//! is installed and every call here is a no-op.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context;
use kv_index::IndexStats;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

/// Latency buckets in seconds: 10 µs to 1 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0,
];

/// One answered call; `elapsed` runs from the arrival of its request head to its answer.
pub fn request(rpc: &'static str, code: tonic::Code, elapsed: Duration) {
    let code = format!("{code:?}");
    metrics::counter!("kv_indexer_requests_total", "rpc" => rpc, "code" => code.clone())
        .increment(1);
    metrics::histogram!("kv_indexer_request_duration_seconds", "rpc" => rpc, "code" => code)
        .record(elapsed.as_secs_f64());
}

/// A prefix query turned away: `admission` (over the in-flight bound) or `deadline` (budget spent).
pub fn rejection(class: &'static str) {
    metrics::counter!("kv_indexer_rejections_total", "class" => class).increment(1);
}

/// A connection that did not complete its TLS handshake.
pub fn tls_handshake_failed() {
    metrics::counter!("kv_indexer_tls_handshake_failures_total").increment(1);
}

pub fn index_size(stats: IndexStats) {
    metrics::gauge!("kv_indexer_blocks").set(stats.blocks as f64);
    metrics::gauge!("kv_indexer_placements").set(stats.placements as f64);
    metrics::gauge!("kv_indexer_workers").set(stats.workers as f64);
}

/// Installs the global Prometheus recorder once per process and returns its handle.
pub fn install_recorder() -> anyhow::Result<PrometheusHandle> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("kv_indexer_request_duration_seconds".into()),
            LATENCY_BUCKETS,
        )
        .context("setting latency buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves.
pub async fn serve_metrics(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving metrics")
}

/// Binds the admin address, naming it on failure.
pub async fn bind_metrics(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding KV_INDEXER_METRICS_ADDR {addr}"))
}
