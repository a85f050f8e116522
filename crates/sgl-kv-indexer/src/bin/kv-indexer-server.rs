//! `kv-indexer-server`: parse settings, start logging, bind, serve until SIGINT or SIGTERM.

use anyhow::Context;
use clap::Parser;
use kv_common::{signal, telemetry};
use kv_server::{Args, Config, observe, server};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    telemetry::init_tracing();
    let config = Config::from_args(&args)?;
    for addr in std::iter::once(args.listen_addr).chain(args.apply_listen_addr) {
        for warning in config.access.warnings(addr) {
            warn!("{warning}");
        }
    }
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding KV_INDEXER_LISTEN_ADDR {}", args.listen_addr))?;

    let stop = CancellationToken::new();
    if let Some(addr) = args.metrics_addr {
        telemetry::serve_on("KV_INDEXER_METRICS_ADDR", addr, observe::BUCKETS, &stop).await?;
    }
    tokio::spawn({
        let stop = stop.clone();
        async move {
            signal::shutdown().await;
            info!("shutting down");
            stop.cancel();
        }
    });

    let shared = server::shared(&config);
    let apply_thread = match args.apply_listen_addr {
        None => None,
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr)
                .with_context(|| format!("binding KV_INDEXER_APPLY_LISTEN_ADDR {addr}"))?;
            let thread = server::serve_on_own_thread(listener, shared.clone(), stop.clone())
                .context("starting the apply listener's thread")?;
            Some(thread)
        }
    };
    let result = server::run(listener, shared, stop.clone().cancelled_owned()).await;
    stop.cancel();
    if let Some(thread) = apply_thread {
        match thread.join() {
            Ok(Err(error)) => {
                warn!(error = %anyhow::Error::from(error), "the apply listener failed")
            }
            Err(_) => warn!("the apply listener's thread panicked"),
            Ok(Ok(())) => {}
        }
    }
    Ok(result?)
}
