//! `kv-indexer-bridge`: parse settings, start logging, follow the worker's events until SIGINT
//! or SIGTERM; a misconfiguration or a permanent error from the Indexer exits non-zero.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use kv_bridge::config::{Args, BridgeConfig};
use kv_bridge::stats::Stats;
use kv_common::signal;
use kv_common::telemetry::{self, Exposition};
use tokio_util::sync::CancellationToken;
use tracing::info;

/// `--help`'s first line.
const ABOUT: &str = "Follows one SGLang or vLLM worker's KV event stream and applies it to the \
                     KV-cache Indexer";

#[tokio::main]
async fn main() -> ExitCode {
    sgl_kv_indexer::exit_code(run().await)
}

async fn run() -> anyhow::Result<()> {
    let args: Args = sgl_kv_indexer::parse_args_about(ABOUT);
    telemetry::init_tracing();
    let metrics_addr = args.metrics_addr;
    let config = BridgeConfig::from_args(args).context("bad setting")?;

    let stop = CancellationToken::new();
    if let Some(addr) = metrics_addr {
        telemetry::serve_on(
            "KV_INDEXER_BRIDGE_METRICS_ADDR",
            addr,
            Exposition {
                labels: &[("worker", config.worker_address.as_str())],
                ..Exposition::default()
            },
            Vec::new(),
            &stop,
        )
        .await?;
        sgl_kv_indexer::export_build_info();
    }
    signal::cancel_on_shutdown(&stop);
    info!(worker_id = %config.worker_id, endpoints = ?config.endpoints, "kv-indexer-bridge starting");
    let result = kv_bridge::run(config, Arc::new(Stats::default()), stop.clone()).await;
    stop.cancel();
    result.context("kv-indexer-bridge stopped")
}
