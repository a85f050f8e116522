//! Bringing the server to ready: the state beneath is opened off the async worker threads
//! (recovery may take a while; the listeners answer NOT_SERVING and UNAVAILABLE meanwhile), its
//! writer installed, and health kept in step with a replica's freshness.

use std::sync::Arc;
use std::time::Duration;

use kv_state::error::StateError;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::service::Shared;

/// Before the server listens: a state directory that cannot be created or locked (a
/// permission, another live server on it) fails start-up here, before anything says it listens.
/// The lock is taken again by [`boot`]; what only recovery can find (a corrupt log) still
/// shows while the listeners answer NOT_SERVING.
pub fn preflight(config: &Config) -> Result<(), kv_state::dir::DirError> {
    match &config.state.dir {
        Some(dir) => kv_state::dir::StateDir::lock(dir).map(drop),
        None => Ok(()),
    }
}

/// Opens the state `config` names over the shared index and installs its writer; publishes
/// SERVING when done (a replica: NOT_SERVING until it has caught up, see [`spawn_maintenance`]).
pub async fn boot(shared: &Arc<Shared>, config: &Config) -> Result<(), StateError> {
    let cell = shared.index_cell();
    let settings = config.state.clone();
    let opened = tokio::task::spawn_blocking(move || kv_state::open::open(&cell, &settings))
        .await
        .map_err(|error| StateError::Thread(std::io::Error::other(error)))??;
    if let Some(freshness) = opened.freshness {
        shared.install_fleet(freshness);
    }
    shared.install(opened.writer);
    shared.publish_health().await;
    Ok(())
}

/// Starts the state's periodic jobs and, for a replica or a server with a state directory,
/// the health watch, until `stop`.
pub fn spawn_maintenance(shared: Arc<Shared>, config: &Config, stop: CancellationToken) {
    if let Ok(writer) = shared.writer() {
        kv_state::open::spawn_ticks(writer.clone(), &config.state, stop.clone());
    }
    if config.state.fleet.is_some() || config.state.dir.is_some() {
        tokio::spawn(watch_health(shared, stop));
    }
}

/// A replica's readiness and freshness change on its applier's thread, a state directory's
/// writability on the writer's: publishes health when they do (checked every 100 ms).
async fn watch_health(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut serving = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some(freshness) = shared.freshness() {
            // Set here, not by the applier's reads: it must rise while the engine is down.
            kv_state::observe::fleet_lag(freshness.lag_ms());
        }
        let now = shared.is_serving();
        if serving != Some(now) {
            serving = Some(now);
            shared.publish_health().await;
        }
    }
}
