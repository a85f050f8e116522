//! `kv-indexer-bridge`: parse settings, start logging, follow the worker's events until SIGINT
//! or SIGTERM; a permanent error from the Indexer exits non-zero.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kv_indexer_client::signal;
use sgl_kv_indexer::bridge::config::{Args, BridgeConfig};
use sgl_kv_indexer::bridge::stats::Stats;
use sgl_kv_indexer::{bridge, observe};
use tokio_util::sync::CancellationToken;
use tracing::info;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let metrics_addr = args.metrics_addr;
    let config = BridgeConfig::from_args(args)
        .map_err(anyhow::Error::msg)
        .context("bad setting")?;

    let stop = CancellationToken::new();
    if let Some(addr) = metrics_addr {
        let listener = observe::bind_metrics(addr).await?;
        let handle = observe::install_recorder()?;
        info!(%addr, "serving metrics on /metrics");
        tokio::spawn(observe::serve_metrics(
            listener,
            handle,
            stop.clone().cancelled_owned(),
        ));
    }
    tokio::spawn({
        let stop = stop.clone();
        async move {
            signal::shutdown().await;
            info!("shutting down");
            stop.cancel();
        }
    });
    info!(worker_id = %config.worker_id, endpoint = %config.endpoint, "kv-indexer-bridge starting");
    let result = bridge::run(config, Arc::new(Stats::default()), stop.clone()).await;
    stop.cancel();
    result.context("kv-indexer-bridge stopped")
}
