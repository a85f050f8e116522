//! The server's whole life, as `kv-indexer-server` runs it and as the tests start it: listen at
//! once (NOT_SERVING and UNAVAILABLE while the state is recovered), recover the state and
//! install its writer, start its periodic jobs, serve until shutdown, drain, then stop the
//! writer (the final snapshot). A write or fdatasync of the state that fails for good ends it
//! at once instead, without a drain or a final snapshot, so that a restart recovers from the
//! log ([`ServeError::Unwritable`]).

use std::sync::Arc;

use kv_state::error::StateError;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::Config;
use crate::error::StartError;
use crate::service::Shared;
use crate::{boot, server};

/// Why the server stopped other than by a clean shutdown.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("starting the query threads or a listener")]
    Start(#[from] StartError),
    #[error("starting the apply listener's thread (KV_INDEXER_APPLY_LISTEN_ADDR)")]
    ApplyThread(#[source] std::io::Error),
    #[error("recovering the state (KV_INDEXER_STATE_DIR or KV_INDEXER_EVENT_LOG)")]
    Recover(#[source] StateError),
    #[error("the state cannot be written: stopping so that a restart recovers from the log")]
    Unwritable(#[source] Arc<StateError>),
    #[error("writing the final snapshot")]
    FinalSnapshot(#[source] StateError),
    #[error("the server task panicked")]
    Panicked,
}

/// A server started by [`start`]: its shared state at once, its life in a task.
pub struct Serving {
    pub shared: Arc<Shared>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Serving {
    /// Waits for the server's life to end: after `shutdown`, once drained and the final
    /// snapshot is written; at once when recovery fails or the state becomes unwritable.
    pub async fn wait(self) -> Result<(), ServeError> {
        self.task.await.map_err(|_| ServeError::Panicked)?
    }
}

/// Starts the server of `shared` (made with `Shared::new(config)`: the metrics recorder, if
/// any, is installed before, so that the first health and sizes are recorded) on `listener`
/// and on `apply_listener` (on a thread of its own) when given, until `shutdown`; recovery
/// runs in the background meanwhile.
pub fn start(
    shared: Arc<Shared>,
    listener: TcpListener,
    apply_listener: Option<std::net::TcpListener>,
    config: &Config,
    shutdown: CancellationToken,
) -> Result<Serving, ServeError> {
    let apply_thread = match apply_listener {
        None => None,
        Some(listener) => Some(
            server::serve_on_own_thread(listener, shared.clone(), shutdown.clone())
                .map_err(ServeError::ApplyThread)?,
        ),
    };
    let life = Life {
        shared: shared.clone(),
        config: config.clone(),
        shutdown,
        apply_thread,
    };
    let task = tokio::spawn(life.run(listener));
    Ok(Serving { shared, task })
}

/// [`start`] and [`Serving::wait`]: the server's life on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    config: &Config,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let shared = Arc::new(Shared::new(config)?);
    start(shared, listener, None, config, shutdown)?
        .wait()
        .await
}

/// What the server's task owns.
struct Life {
    shared: Arc<Shared>,
    config: Config,
    shutdown: CancellationToken,
    apply_thread: Option<std::thread::JoinHandle<Result<(), StartError>>>,
}

impl Life {
    async fn run(mut self, listener: TcpListener) -> Result<(), ServeError> {
        let stopped = self.shutdown.clone().cancelled_owned();
        let serving = tokio::spawn(server::run(listener, self.shared.clone(), stopped));
        if let Err(error) = boot::boot(&self.shared, &self.config).await {
            self.shutdown.cancel();
            let _ = serving.await;
            self.join_apply_thread().await;
            return Err(ServeError::Recover(error));
        }
        boot::spawn_maintenance(self.shared.clone(), &self.config, self.shutdown.clone());
        let writer = self.shared.writer().expect("installed by boot").clone();
        let served = tokio::select! {
            served = serving => served,
            error = writer.failed() => {
                self.shutdown.cancel();
                return Err(ServeError::Unwritable(error));
            }
        };
        self.shutdown.cancel();
        self.join_apply_thread().await;
        writer.stop().await.map_err(ServeError::FinalSnapshot)?;
        served.map_err(|_| ServeError::Panicked)??;
        Ok(())
    }

    /// Waits for the apply listener's thread (stopped by the shutdown), logging its failure.
    async fn join_apply_thread(&mut self) {
        let Some(thread) = self.apply_thread.take() else {
            return;
        };
        match tokio::task::spawn_blocking(move || thread.join()).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => {
                warn!(error = %kv_common::error_chain(&error), "the apply listener failed")
            }
            Ok(Err(_)) | Err(_) => warn!("the apply listener's thread panicked"),
        }
    }
}
