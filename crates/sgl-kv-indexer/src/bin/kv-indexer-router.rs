//! `kv-indexer-router`: parse settings, start logging and metrics, serve until SIGINT or
//! SIGTERM.

use std::process::ExitCode;

use anyhow::Context;
use kv_common::signal;
use kv_common::telemetry::{self, Exposition, Metrics};
use kv_indexer_router::config::{Args, RouterConfig};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

#[tokio::main]
async fn main() -> ExitCode {
    sgl_kv_indexer::exit_code(run().await)
}

async fn run() -> anyhow::Result<()> {
    let args: Args = sgl_kv_indexer::parse_args();
    telemetry::init_tracing();
    let config = RouterConfig::from_args(&args).context("bad setting")?;
    // The recorder's upkeep runs until the router stops, so that histogram samples are folded
    // into their buckets whether or not anything scrapes `/metrics`.
    let stop_metrics = CancellationToken::new();
    let metrics = Metrics::install(
        Exposition {
            buckets: kv_indexer_router::observe::BUCKETS,
            ..Exposition::default()
        },
        &stop_metrics,
    )?;
    sgl_kv_indexer::export_build_info();
    let state = kv_indexer_router::state(&config, Some(metrics))?;
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding KV_ROUTER_LISTEN_ADDR {}", args.listen_addr))?;
    info!(addr = %args.listen_addr, policy = ?config.policy, provider = ?config.provider, workers = ?config.worker_urls, "kv-indexer-router listening");
    let served = kv_indexer_router::run(listener, state, &config, signal::shutdown()).await;
    stop_metrics.cancel();
    Ok(served?)
}
