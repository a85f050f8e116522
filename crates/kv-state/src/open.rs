//! Opening the state: in memory, from a state directory (recovered), or as a replica of a
//! shared log; and the periodic jobs a single server's writer runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::cell::{IndexCell, IndexWriter};
use crate::config::{StateConfig, sweep_interval};
use crate::dir::StateDir;
use crate::durable::Durable;
use crate::error::StateError;
use crate::fleet::{self, Freshness};
use crate::meta::{Meta, fresh_ttl};
use crate::recover::{Recovered, recover_dir};
use crate::writer::Writer;

/// The opened state: the writer every change goes through and, for a replica, its freshness.
pub struct Opened {
    pub writer: Writer,
    /// A replica's freshness (none: a single server, always fresh once open).
    pub freshness: Option<Arc<Freshness>>,
}

/// Opens the state of `settings` over `cell`: at once in memory; with a state directory by
/// recovering it into the cell first (blocking: call it off async worker threads); as a
/// replica by starting its appender and applier (it catches up in the background, see
/// [`Freshness`]).
pub fn open(cell: &IndexCell, settings: &StateConfig) -> Result<Opened, StateError> {
    if let Some(fleet) = &settings.fleet {
        let dir = settings.dir.as_deref().map(StateDir::lock).transpose()?;
        let started = fleet::start(cell.clone(), fleet, dir, settings)?;
        return Ok(Opened {
            writer: started.writer,
            freshness: Some(started.freshness),
        });
    }
    let Some(path) = &settings.dir else {
        let index = IndexWriter::new(cell.clone());
        let writer = Writer::start(
            index,
            None,
            Meta::new(),
            settings.worker_ttl,
            settings.clock.clone(),
        )
        .map_err(StateError::Thread)?;
        return Ok(Opened {
            writer,
            freshness: None,
        });
    };
    let started = Instant::now();
    let (dir, recovered) = recover_dir(path, settings.discard_corrupt)?;
    let Recovered {
        index,
        mut meta,
        log,
        snapshot_position,
        replayed,
    } = recovered;
    let stats = index.stats();
    tracing::info!(
        dir = %dir.path().display(),
        snapshot_position,
        replayed,
        placements = stats.placements,
        workers = stats.workers,
        took_ms = started.elapsed().as_millis() as u64,
        "state recovered"
    );
    fresh_ttl(&mut meta, settings.clock.now_ms());
    // Both copies: the published one, and the writer's twin of it.
    let mut copies = IndexWriter::new(cell.clone());
    copies.replace(index);
    crate::observe::index_size(stats, crate::meta::live_workers(&meta));
    let durable = Durable::new(
        dir,
        log,
        snapshot_position,
        settings.sync,
        settings.snapshot_method,
    );
    let writer = Writer::start(
        copies,
        Some(durable),
        meta,
        settings.worker_ttl,
        settings.clock.clone(),
    )
    .map_err(StateError::Thread)?;
    Ok(Opened {
        writer,
        freshness: None,
    })
}

/// Starts a single server's periodic liveness sweeps and snapshots until `stop` (a replica's
/// applier runs its own).
pub fn spawn_ticks(writer: Writer, settings: &StateConfig, stop: CancellationToken) {
    if settings.fleet.is_some() {
        return;
    }
    let snapshot_every = settings.dir.as_ref().and(settings.snapshot_interval);
    for (every, job) in [
        (settings.worker_ttl.map(sweep_interval), Tick::Sweep),
        (snapshot_every, Tick::Snapshot),
    ] {
        let Some(every) = every else { continue };
        tokio::spawn(tick(writer.clone(), every, job, stop.clone()));
    }
}

#[derive(Clone, Copy)]
enum Tick {
    Sweep,
    Snapshot,
}

async fn tick(writer: Writer, every: Duration, job: Tick, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match job {
            Tick::Sweep => writer.sweep(),
            Tick::Snapshot => writer.snapshot(),
        }
    }
}
