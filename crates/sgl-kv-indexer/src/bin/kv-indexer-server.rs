//! `kv-indexer-server`: parse settings, start logging, bind, serve until SIGINT or SIGTERM.

use anyhow::Context;
use clap::Parser;
use kv_indexer_client::signal;
use sgl_kv_indexer::access::Access;
use sgl_kv_indexer::{Args, Config, observe, server};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = Config::from(&args);
    let access = Access::from_args(&args)?;
    for warning in access.warnings(args.listen_addr) {
        warn!("{warning}");
    }
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding KV_INDEXER_LISTEN_ADDR {}", args.listen_addr))?;

    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(addr) = args.metrics_addr {
        let metrics_listener = observe::bind_metrics(addr).await?;
        let handle = observe::install_recorder()?;
        info!(%addr, "serving metrics on /metrics");
        let stopped = stop.clone().cancelled_owned();
        tasks.spawn(observe::serve_metrics(metrics_listener, handle, stopped));
    }
    {
        let stop = stop.clone();
        tasks.spawn(async move {
            signal::shutdown().await;
            info!("shutting down");
            stop.cancel();
            Ok(())
        });
    }

    let shared = server::shared(&config);
    let result = server::serve(listener, shared, access, stop.clone().cancelled_owned()).await;
    stop.cancel();
    while let Some(joined) = tasks.join_next().await {
        if let Ok(Err(error)) = joined {
            warn!(%error, "background task failed");
        }
    }
    result
}
