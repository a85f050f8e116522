//! `kv-indexer-sim`: a simulated SGLang worker (see the library's documentation).

use anyhow::Context;
use clap::Parser;
use kv_indexer_sim::{Args, Config, Listeners, Worker};
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::from_args(Args::parse())?;
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let listeners = Listeners::bind(&config).await?;
    let worker = Worker::start(&config, listeners)
        .await
        .context("starting the worker")?;
    let endpoints = worker.endpoints();
    let replay = endpoints.replay_url().unwrap_or_else(|| "off".into());
    info!(
        http = %endpoints.http_url(),
        kv_events = %endpoints.kv_events_url(),
        %replay,
        topic = %config.publisher.topic,
        page_size = config.cache.page_size,
        "kv-indexer-sim serving"
    );
    // One line on stdout for scripts: where to point a bridge and a router.
    println!(
        "kv-indexer-sim http={} kv_events={} replay={replay}",
        endpoints.http_url(),
        endpoints.kv_events_url()
    );
    worker.serve(shutdown()).await?;
    info!("stopped");
    Ok(())
}

/// Resolves on the first SIGINT or SIGTERM.
async fn shutdown() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            warn!(%error, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    info!("shutting down");
}
