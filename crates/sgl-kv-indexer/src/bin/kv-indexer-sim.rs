//! `kv-indexer-sim`: a simulated SGLang (or vLLM) worker, for the demo and the tests (see the
//! `kv-indexer-sim` library's documentation). In this package so that the wheel carries it.

use std::process::ExitCode;

use anyhow::Context;
use kv_common::signal;
use kv_indexer_sim::{Args, Config, Listeners, Worker};
use tracing::info;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    sgl_kv_indexer::exit_code(run().await)
}

async fn run() -> anyhow::Result<()> {
    let config = Config::from_args(sgl_kv_indexer::parse_args::<Args>())?;
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
    worker
        .serve(async {
            signal::shutdown().await;
            info!("shutting down");
        })
        .await?;
    info!("stopped");
    Ok(())
}
