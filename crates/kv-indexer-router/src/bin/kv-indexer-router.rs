//! `kv-indexer-router`: parse settings, start logging, serve until SIGINT or SIGTERM.

use anyhow::Context;
use clap::Parser;
use kv_common::signal;
use kv_indexer_router::config::{Args, RouterConfig};
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::net::TcpListener;
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
    let config = RouterConfig::from_args(&args)
        .map_err(anyhow::Error::msg)
        .context("bad setting")?;
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let state = kv_indexer_router::state(&config, Some(metrics))?;
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding KV_ROUTER_LISTEN_ADDR {}", args.listen_addr))?;
    info!(addr = %args.listen_addr, policy = ?config.policy, provider = ?config.provider, workers = ?config.worker_urls, "kv-indexer-router listening");
    kv_indexer_router::run(listener, state, &config, signal::shutdown()).await
}
