//! SIGINT and SIGTERM, for the graceful shutdown of every binary (server, bridge, router,
//! simulated worker).

use tracing::warn;

/// Resolves on the first SIGINT or SIGTERM.
pub async fn shutdown() {
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
}

/// Cancels `stop` on the first SIGINT or SIGTERM (logging it), from a task of its own.
pub fn cancel_on_shutdown(stop: &tokio_util::sync::CancellationToken) {
    let stop = stop.clone();
    tokio::spawn(async move {
        shutdown().await;
        tracing::info!("shutting down");
        stop.cancel();
    });
}
