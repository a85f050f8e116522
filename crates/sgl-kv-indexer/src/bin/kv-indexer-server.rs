//! `kv-indexer-server`: parse settings, start logging, bind, then the server's life as
//! `kv_server::serve` runs it (recover the state while the listeners answer NOT_SERVING,
//! serve until SIGINT or SIGTERM, drain, write the final snapshot), with its admin address.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use kv_common::signal;
use kv_common::telemetry::{self, Exposition, Page};
use kv_server::admin::StateReport;
use kv_server::serve::{self, ServeError};
use kv_server::service::Shared;
use kv_server::{Args, Config, boot, observe};
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
    let apply_listener = match args.apply_listen_addr {
        None => None,
        Some(addr) => Some(
            std::net::TcpListener::bind(addr)
                .with_context(|| format!("binding KV_INDEXER_APPLY_LISTEN_ADDR {addr}"))?,
        ),
    };

    let stop = CancellationToken::new();
    let shared = Arc::new(Shared::new(&config)?);
    if let Some(addr) = args.metrics_addr {
        let pages = vec![state_page(shared.clone())];
        let exposition = Exposition {
            buckets: observe::BUCKETS,
            ..Exposition::default()
        };
        telemetry::serve_on("KV_INDEXER_METRICS_ADDR", addr, exposition, pages, &stop).await?;
        sgl_kv_indexer::export_build_info();
        observe::register();
    }
    signal::cancel_on_shutdown(&stop);
    let serving = serve::start(shared, listener, apply_listener, &config, stop.clone())?;
    match serving.wait().await {
        Err(ServeError::Unwritable(error)) => {
            tracing::error!(
                error = %kv_common::error_chain(error.as_ref()),
                "the state cannot be written: exiting so that a restart recovers from the log"
            );
            // At once, before the runtime winds down (which would let the writer thread write
            // a final snapshot): no drain and no final snapshot, on purpose.
            #[allow(clippy::disallowed_methods)]
            std::process::exit(STATE_UNWRITABLE_EXIT);
        }
        served => Ok(served?),
    }
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
