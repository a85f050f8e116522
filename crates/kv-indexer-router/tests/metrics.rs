//! The router's `/metrics` from start, before any request: every metric described, the series
//! whose labels are known at start exported at 0, and the histograms with buckets; and the
//! recorder's constant labels (the bridge's `worker`) on every series. A file of its own, as the
//! recorder is process-wide.

use clap::Parser;
use kv_common::telemetry::{Exposition, Metrics};
use kv_indexer_router::config::{Args, RouterConfig};
use kv_indexer_router::observe::BUCKETS;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn every_metric_is_described_and_exported_from_start() {
    let stop = CancellationToken::new();
    let exposition = Exposition {
        buckets: BUCKETS,
        labels: &[("fleet", "demo")],
    };
    let metrics = Metrics::install(exposition, &stop).unwrap();
    let argv = [
        "kv-indexer-router",
        "--worker-urls",
        "http://127.0.0.1:1,http://127.0.0.1:2",
        "--kv-indexer-endpoint",
        "http://127.0.0.1:3",
    ];
    let config = RouterConfig::from_args(&Args::try_parse_from(argv).unwrap()).unwrap();
    let _state = kv_indexer_router::state(&config, Some(metrics.clone())).unwrap();
    let text = metrics.render();
    // kv_router_requests_total has no series (nor help) before the first answer: its status
    // label is not known at start.
    for metric in [
        "kv_router_decisions_total",
        "kv_router_worker_response_start_seconds",
        "kv_router_indexer_queries_total",
        "kv_router_indexer_query_seconds",
        "kv_router_worker_healthy",
        "kv_router_worker_indexer_matches_total",
        "kv_router_indexer_unknown_addresses_total",
    ] {
        assert!(
            text.contains(&format!("# HELP {metric} ")),
            "no help for {metric}:\n{text}"
        );
    }
    for series in [
        r#"kv_router_decisions_total{fleet="demo",reason="cache_hit"} 0"#,
        r#"kv_router_decisions_total{fleet="demo",reason="no_usable_match"} 0"#,
        r#"kv_router_decisions_total{fleet="demo",reason="unreachable"} 0"#,
        r#"kv_router_indexer_queries_total{fleet="demo",outcome="matched"} 0"#,
        r#"kv_router_indexer_queries_total{fleet="demo",outcome="timeout"} 0"#,
        r#"kv_router_worker_healthy{fleet="demo",worker="http://127.0.0.1:2"} 1"#,
        r#"kv_router_worker_indexer_matches_total{fleet="demo",worker="http://127.0.0.1:1"} 0"#,
        r#"kv_router_indexer_unknown_addresses_total{fleet="demo"} 0"#,
        // Histograms with buckets (10 µs..1 s and 1 ms..60 s), not summaries.
        r#"kv_router_indexer_query_seconds_bucket{fleet="demo",outcome="matched",le="0.00001"} 0"#,
        r#"kv_router_indexer_query_seconds_bucket{fleet="demo",outcome="matched",le="1"} 0"#,
        r#"kv_router_worker_response_start_seconds_bucket{fleet="demo",route="/generate",le="0.001"} 0"#,
        r#"kv_router_worker_response_start_seconds_bucket{fleet="demo",route="/v1/chat/completions",le="60"} 0"#,
    ] {
        assert!(text.contains(series), "no {series}:\n{text}");
    }
    assert!(
        !text.contains("quantile="),
        "no histogram is a summary:\n{text}"
    );
    stop.cancel();
}
