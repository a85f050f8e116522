//! A fleet of replicas on one shared log (`KV_INDEXER_EVENT_LOG`): every replica appends the
//! changes it accepts to the stream ([`super::stream`]) and applies the whole stream in order,
//! so every replica holds the same index.
//!
//! Two threads per replica:
//! - the **appender** takes the service's jobs (the same [`Writer`] handle as a single server) and
//!   appends each group in one round trip, only to the history (epoch) the applier follows (while
//!   it bootstraps, the stream's current one). It does not touch the index: each job waits, under
//!   its own number, until the applier reaches its entry, and is answered with what applying it did
//!   (read-your-writes: an answered apply is in this replica's index), or refused after
//!   [`waiters::ANSWER_BOUND`] (an entry Redis lost in a failover is never read back). A Redis that
//!   cannot be reached answers UNAVAILABLE; the bridges queue and retry.
//! - the **applier** reads the stream (`XREAD BLOCK` from its position: no consumer group,
//!   every replica needs every entry) and applies every entry in order, fencing in log order
//!   so all replicas decide alike. It also runs the replica's upkeep: it checks that the log
//!   still explains its index (the epoch, the tail, no gap in the positions; otherwise it
//!   bootstraps again), measures its lag, takes the fleet's maintenance lease, and under it
//!   expires silent workers (an `ExpireUnseen` record, so every replica expires alike) and
//!   publishes snapshots.
//!
//! Start-up: the replica loads its newest local snapshot when the stream still holds every
//! entry after it, else the snapshot another replica published, else starts empty at position
//! 0 (only when the stream still starts there); it is NOT_SERVING until it has applied the
//! stream's tail as of its start. A snapshot is built in the background from the previous one
//! and the stream's entries (never from the live index), written to the state directory (when
//! there is one) and, by the lease holder, published; the stream is trimmed only below a
//! published snapshot.

mod appender;
mod applier;
mod bootstrap;
mod build;
mod freshness;
mod maintenance;
mod rollback;
mod waiters;

pub use freshness::Freshness;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use tracing::{info, warn};

use self::appender::Appender;
use self::applier::Applier;
use self::waiters::Waiters;
use crate::cell::{IndexCell, IndexWriter};
use crate::config::{FleetConfig, StateConfig};
use crate::dir::StateDir;
use crate::error::StateError;
use crate::meta::Meta;
use crate::writer::Writer;

/// What boot hands over: the running replica.
pub struct Started {
    pub writer: Writer,
    pub freshness: Arc<Freshness>,
}

/// Starts a replica on the shared log: the applier bootstraps in the background (the replica
/// is NOT_SERVING until it has caught up) and the appender accepts changes at once.
pub fn start(
    index: IndexCell,
    fleet: &FleetConfig,
    dir: Option<StateDir>,
    settings: &StateConfig,
) -> Result<Started, StateError> {
    let (worker_ttl, snapshot_interval) = (settings.worker_ttl, settings.snapshot_interval);
    let replica = format!("{:016x}", rand::random::<u64>());
    let freshness = Arc::new(Freshness::new(fleet.max_lag));
    let waiters = Waiters::default();
    let stop = Arc::new(AtomicBool::new(false));
    info!(
        replica,
        log = fleet.stream.url(),
        key = fleet.stream.key,
        "joining the shared log"
    );
    if snapshot_interval.is_none() {
        warn!(
            "KV_INDEXER_SNAPSHOT_INTERVAL_S is 0: this replica never publishes a snapshot, so under its lease the stream is never trimmed and grows in Redis's memory"
        );
    }
    let applier = Applier {
        config: fleet.stream.clone(),
        replica: replica.clone(),
        index: IndexWriter::new(index),
        meta: Meta::new(),
        next: 0,
        ready_at: None,
        last_origin: None,
        ready_since: settings.clock.now(),
        expiries: 0,
        epoch: None,
        stream: None,
        waiters: waiters.clone(),
        freshness: freshness.clone(),
        dir,
        worker_ttl,
        clock: settings.clock.clone(),
        snapshot_interval,
        base: None,
        building: None,
        last_snapshot: Instant::now(),
        last_upkeep: None,
        last_overlap_check: None,
        last_sweep: settings.clock.now(),
        lease: false,
        expiry_guard: Default::default(),
        skipped: 0,
        unanswered_log: Default::default(),
        rollback: None,
        stop: stop.clone(),
    };
    let applier = std::thread::Builder::new()
        .name("kv-indexer-applier".into())
        .spawn(move || applier.run())
        .map_err(StateError::Thread)?;
    let appender = Appender {
        config: fleet.stream.clone(),
        replica,
        stream: None,
        next_number: 1,
        waiters,
        stop,
        applier: Some(applier),
        clock: settings.clock.clone(),
    };
    let writer = Writer::start_with(
        "kv-indexer-appender",
        settings.clock.clone(),
        move |queue| appender.run(queue),
    )
    .map_err(StateError::Thread)?;
    Ok(Started { writer, freshness })
}
