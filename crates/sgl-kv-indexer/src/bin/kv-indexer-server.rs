//! `kv-indexer-server`: parse settings, start logging, bind, recover the state directory (if
//! any) while the listeners answer NOT_SERVING, serve until SIGINT or SIGTERM, drain, and
//! write the final snapshot.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use kv_common::signal;
use kv_common::telemetry::{self, Exposition, Page};
use kv_server::admin::StateReport;
use kv_server::service::Shared;
use kv_server::{Args, Config, boot, observe, server};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// `--help`'s first line.
const ABOUT: &str = "The KV-cache Indexer's gRPC server: which workers hold which KV-cache blocks, \
                     fed by the bridges, asked by the routers";

#[tokio::main]
async fn main() -> ExitCode {
    sgl_kv_indexer::exit_code(run().await)
}

async fn run() -> anyhow::Result<()> {
    let args: Args = sgl_kv_indexer::parse_args_about(ABOUT);
    telemetry::init_tracing();
    let config = Config::from_args(&args)?;
    for addr in std::iter::once(args.listen_addr).chain(args.apply_listen_addr) {
        for warning in config.access.warnings(addr) {
            warn!("{warning}");
        }
    }
    boot::preflight(&config)?;
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding KV_INDEXER_LISTEN_ADDR {}", args.listen_addr))?;

    let stop = CancellationToken::new();
    let shared = Arc::new(Shared::new(&config)?);
    if let Some(addr) = args.metrics_addr {
        let pages = vec![state_page(shared.clone())];
        telemetry::serve_on(
            "KV_INDEXER_METRICS_ADDR",
            addr,
            Exposition {
                buckets: observe::BUCKETS,
                ..Exposition::default()
            },
            pages,
            &stop,
        )
        .await?;
        sgl_kv_indexer::export_build_info();
        observe::register();
    }
    signal::cancel_on_shutdown(&stop);
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
    let serving = tokio::spawn(server::run(
        listener,
        shared.clone(),
        stop.clone().cancelled_owned(),
    ));
    let booted = boot::boot(&shared, &config).await;
    if let Err(error) = booted {
        stop.cancel();
        return Err(error).context("recovering KV_INDEXER_STATE_DIR");
    }
    boot::spawn_maintenance(shared.clone(), &config, stop.clone());
    exit_when_unwritable(&shared);

    let result = serving.await.context("the server task")?;
    stop.cancel();
    if let Some(thread) = apply_thread {
        match thread.join() {
            Ok(Err(error)) => {
                warn!(error = %kv_common::error_chain(&error), "the apply listener failed")
            }
            Err(_) => warn!("the apply listener's thread panicked"),
            Ok(Ok(())) => {}
        }
    }
    if let Ok(writer) = shared.writer() {
        writer.stop().await.context("writing the final snapshot")?;
    }
    Ok(result?)
}

/// A write or fdatasync of the state that failed for good: stops at once, non-zero and
/// without a final snapshot, so that the supervisor restarts the server and recovery runs
/// from the log (a full disk is not this: it is retried while queries are served).
fn exit_when_unwritable(shared: &Shared) {
    let Ok(writer) = shared.writer() else {
        return;
    };
    let writer = writer.clone();
    tokio::spawn(async move {
        let error = writer.failed().await;
        tracing::error!(
            error = %kv_common::error_chain(error.as_ref()),
            "the state cannot be written: exiting so that a restart recovers from the log"
        );
        std::process::exit(STATE_UNWRITABLE_EXIT);
    });
}

/// The exit status after a write or sync of the state failed for good.
const STATE_UNWRITABLE_EXIT: i32 = 75;

/// `GET /state` on the admin address: readiness, sizes and the index digest, as JSON; a
/// replica on a shared log adds its position, lag and whether it answers queries.
fn state_page(shared: Arc<Shared>) -> Page {
    Page {
        path: "/state",
        render: Arc::new(move || StateReport::of(&shared, true).to_json_line()),
    }
}
