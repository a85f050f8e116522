//! Durable state: the index as a materialized view of an ordered log of accepted changes.
//!
//! Every change that passes validation (an apply, a hit-counting match, an expiry) becomes a
//! [`record::Record`], is appended to the log, and is applied to the index in log order by one
//! writer thread ([`writer`]). A snapshot ([`snapshot`]) holds the whole state at a log
//! position; start-up ([`recover`]) loads the newest snapshot and replays the log after it, so
//! a restarted server answers exactly what it answered before.
//!
//! - [`log`]: the local append-only log behind [`log::EventLog`];
//! - [`record`]: the records and their encoding;
//! - [`snapshot`]: snapshot files;
//! - [`writer`]: the writer thread (fencing, group commit, liveness sweeps, snapshots);
//! - [`dir`]: the state directory and its lock.

pub mod dir;
pub mod fleet;
pub mod log;
pub mod record;
pub mod snapshot;
pub mod stream;
pub mod writer;

use std::collections::HashMap;
use std::path::PathBuf;

use kv_index::{ActionRequest, ApplyRequest, Index, IndexStats, NodeMatch, Tier, ValidApply};
use kv_indexer_proto::convert;

use self::log::{EventLog, FileLog, LogError};
use self::record::{Change, Record, RecordError};
use crate::error::ServerError;

/// What the server keeps per worker beside the index: fencing and liveness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerMeta {
    /// The highest bridge incarnation seen for the worker (0: none sent).
    pub incarnation: u64,
    /// Wall-clock time (ms since the Unix epoch) of its last accepted apply.
    pub last_seen_ms: u64,
    /// Its placements were purged for want of applies; cleared by its next apply.
    pub expired: bool,
}

pub type Meta = HashMap<String, WorkerMeta>;

/// Why the state could not be loaded or kept.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("{path:?}: record {position} does not decode")]
    Record {
        path: PathBuf,
        position: u64,
        #[source]
        source: RecordError,
    },
    #[error("{path:?}: record {position} does not apply")]
    Invalid {
        path: PathBuf,
        position: u64,
        #[source]
        source: ServerError,
    },
    #[error(transparent)]
    Dir(#[from] dir::DirError),
    #[error("starting a state thread")]
    Thread(#[source] std::io::Error),
    #[error(transparent)]
    Fleet(std::sync::Arc<stream::StreamError>),
}

impl StateError {
    /// Whether the files themselves are bad (the operator may choose to start empty).
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            StateError::Log(
                LogError::Corrupt { .. } | LogError::NewerVersion { .. } | LogError::Gap { .. }
            ) | StateError::Record { .. }
                | StateError::Invalid { .. }
        )
    }
}

/// What one applied record produced.
#[derive(Debug)]
pub enum Applied {
    Apply(IndexStats),
    CountHits(Vec<NodeMatch>),
    Expire,
}

/// Refuses an apply from an older bridge incarnation than the worker's newest.
pub fn fence(meta: &Meta, worker_id: &str, incarnation: Option<u64>) -> Result<(), ServerError> {
    let (Some(incarnation), Some(known)) = (incarnation, meta.get(worker_id)) else {
        return Ok(());
    };
    if incarnation < known.incarnation {
        return Err(ServerError::Fenced {
            worker_id: worker_id.to_owned(),
            incarnation,
            newest: known.incarnation,
        });
    }
    Ok(())
}

/// Applies a validated apply and notes the worker as seen: the one step live applies and
/// replay share.
pub fn apply_valid(
    index: &mut Index,
    meta: &mut Meta,
    valid: &ValidApply,
    incarnation: Option<u64>,
    time_ms: u64,
) -> IndexStats {
    index.apply(valid);
    let entry = worker_meta(meta, valid.worker_id());
    entry.last_seen_ms = entry.last_seen_ms.max(time_ms);
    entry.expired = false;
    if let Some(incarnation) = incarnation {
        entry.incarnation = entry.incarnation.max(incarnation);
    }
    index.stats()
}

/// The meta of `worker`, added on first sight (the id is copied only then).
pub fn worker_meta<'m>(meta: &'m mut Meta, worker: &str) -> &'m mut WorkerMeta {
    if !meta.contains_key(worker) {
        meta.insert(worker.to_owned(), WorkerMeta::default());
    }
    meta.get_mut(worker).expect("inserted above")
}

/// Applies any record (replay, snapshot building, and the writer's non-apply changes).
pub fn apply_record(
    index: &mut Index,
    meta: &mut Meta,
    record: &Record,
) -> Result<Applied, ServerError> {
    match &record.change {
        Change::Apply(request) => {
            let incarnation = request.bridge_incarnation;
            // Live applies were fenced before they were logged, so this passes on replay; a
            // fleet's replicas fence here, in log order, all alike.
            fence(meta, &request.worker_id, incarnation)?;
            let valid = convert::apply_request(request.clone()).validate()?;
            Ok(Applied::Apply(apply_valid(
                index,
                meta,
                &valid,
                incarnation,
                record.time_ms,
            )))
        }
        Change::CountHits(hashes) => {
            let matches = index.match_kv(hashes)?;
            index.count_hits(hashes);
            Ok(Applied::CountHits(matches))
        }
        Change::Expire(workers) => {
            for worker in workers {
                index.apply(&clear_all(worker)?);
                worker_meta(meta, worker).expired = true;
            }
            Ok(Applied::Expire)
        }
        Change::ExpireUnseen(workers) => {
            for (worker, seen) in workers {
                let unseen_since = meta
                    .get(worker)
                    .is_some_and(|known| !known.expired && known.last_seen_ms <= *seen);
                if unseen_since {
                    index.apply(&clear_all(worker)?);
                    worker_meta(meta, worker).expired = true;
                }
            }
            Ok(Applied::Expire)
        }
    }
}

/// Clears every tier of `worker`, keeping its address and spec.
fn clear_all(worker: &str) -> Result<ValidApply, ServerError> {
    ApplyRequest {
        worker_id: worker.to_owned(),
        actions: Tier::ALL
            .iter()
            .map(|tier| ActionRequest {
                action_type: kv_index::ActionKind::ClearAllAtTier as i32,
                tier: tier.wire(),
                ..ActionRequest::default()
            })
            .collect(),
        ..ApplyRequest::default()
    }
    .validate()
    .map_err(ServerError::from)
}

/// The state rebuilt from a directory: the newest snapshot plus the log after it.
pub struct Recovered {
    pub index: Index,
    pub meta: Meta,
    pub log: FileLog,
    /// The position of the snapshot loaded (0 without one).
    pub snapshot_position: u64,
    /// Log records replayed after it.
    pub replayed: u64,
}

/// Loads the newest snapshot in `dir` and replays the log after it. A torn last record is
/// cut (with a WARN); anything else that does not check is an error naming the file.
pub fn recover(dir: &std::path::Path) -> Result<Recovered, StateError> {
    let newest = snapshot::list(dir)?.pop().map(|(_, path)| path);
    let log = FileLog::open(dir)?;
    let (index, meta, position, replayed) = rebuild(dir, newest.as_deref(), None)?;
    if log.end() < position {
        return Err(StateError::Log(LogError::Corrupt {
            path: dir.to_path_buf(),
            offset: 0,
            what: format!(
                "the log ends at position {} before the newest snapshot's {position}",
                log.end()
            ),
        }));
    }
    Ok(Recovered {
        index,
        meta,
        log,
        snapshot_position: position,
        replayed,
    })
}

/// The state of the snapshot file `snapshot` (none: empty, at position 0) with the log's
/// records from its position on (before `until`, when given) replayed: what recovery and
/// snapshot building share. Returns the state, the snapshot's position and the records
/// replayed.
pub fn rebuild(
    dir: &std::path::Path,
    snapshot: Option<&std::path::Path>,
    until: Option<u64>,
) -> Result<(Index, Meta, u64, u64), StateError> {
    let (mut index, mut meta, position) = match snapshot {
        None => (Index::new(), Meta::new(), 0),
        Some(path) => {
            let contents = snapshot::read(path)?;
            (
                Index::import(&contents.export),
                contents.meta,
                contents.position,
            )
        }
    };
    let mut replayed = 0;
    for (at, bytes) in log::read_dir_from(dir, position, until)? {
        replay(&mut index, &mut meta, dir, at, &bytes)?;
        replayed += 1;
    }
    Ok((index, meta, position, replayed))
}

/// Replays the record at `position`.
pub fn replay(
    index: &mut Index,
    meta: &mut Meta,
    dir: &std::path::Path,
    position: u64,
    bytes: &[u8],
) -> Result<(), StateError> {
    let record = Record::decode(bytes).map_err(|source| StateError::Record {
        path: dir.to_path_buf(),
        position,
        source,
    })?;
    apply_record(index, meta, &record).map_err(|source| StateError::Invalid {
        path: dir.to_path_buf(),
        position,
        source,
    })?;
    Ok(())
}

/// A SHA-256 (hex) of `export` in canonical order: equal for indexes that hold the same.
pub fn digest(export: kv_index::Export) -> String {
    use sha2::{Digest, Sha256};
    let export = export.canonical();
    let mut hasher = Sha256::new();
    let mut put = |bytes: &[u8]| hasher.update(bytes);
    put(&(export.workers.len() as u64).to_le_bytes());
    for worker in &export.workers {
        for text in [&worker.id, &worker.address] {
            put(&(text.len() as u64).to_le_bytes());
            put(text.as_bytes());
        }
        put(format!("{:?}", worker.spec).as_bytes());
        for held in &worker.held {
            put(&(held.len() as u64).to_le_bytes());
            for block in held {
                put(&block.hash.to_le_bytes());
                put(&block.mask.to_le_bytes());
                put(&block.tokens.to_le_bytes());
            }
        }
    }
    for (hash, count) in &export.hits {
        put(&hash.to_le_bytes());
        put(&count.to_le_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The live workers of `meta` whose TTL ran out at `now_ms`, each with the last-seen time it
/// had, by name; none when that would be every live worker (a partition, a paused host, a
/// clock jump?), which is counted in `trips` and logged instead.
pub fn due_for_expiry(
    meta: &Meta,
    ttl: std::time::Duration,
    now_ms: u64,
    trips: &mut u64,
) -> Vec<(String, u64)> {
    let ttl_ms = ttl.as_millis() as u64;
    let live = meta.values().filter(|meta| !meta.expired).count();
    let mut expired: Vec<(String, u64)> = meta
        .iter()
        .filter(|(_, meta)| !meta.expired && now_ms.saturating_sub(meta.last_seen_ms) > ttl_ms)
        .map(|(id, meta)| (id.clone(), meta.last_seen_ms))
        .collect();
    if expired.is_empty() {
        return expired;
    }
    if expired.len() == live {
        *trips += 1;
        crate::observe::mass_expiry_refused();
        tracing::warn!(
            workers = live,
            ttl_s = ttl.as_secs_f64(),
            trips = *trips,
            "every live worker's TTL ran out in one sweep (a partition, a paused host, a clock jump?): expiring none"
        );
        return Vec::new();
    }
    expired.sort();
    let names: Vec<&str> = expired.iter().map(|(id, _)| id.as_str()).collect();
    tracing::info!(workers = ?names, ttl_s = ttl.as_secs_f64(), "expiring workers with no apply within their TTL");
    crate::observe::workers_expired(expired.len());
    expired
}

/// Gives every known, unexpired worker a fresh TTL from `now_ms`: a restarted server neither
/// expires every worker at once nor keeps a dead one forever.
pub fn fresh_ttl(meta: &mut Meta, now_ms: u64) {
    for entry in meta.values_mut() {
        entry.last_seen_ms = entry.last_seen_ms.max(now_ms);
    }
}

/// Brings `shared` to ready: in memory at once, or with a state directory by recovering it
/// (on the blocking pool, while the listeners already answer NOT_SERVING / UNAVAILABLE), then
/// starting the writer on the recovered index. Publishes SERVING when done.
pub async fn boot(
    shared: &std::sync::Arc<crate::service::Shared>,
    config: &crate::config::Config,
) -> Result<(), StateError> {
    let writer_config = config.writer.clone();
    if let Some(fleet) = &config.fleet {
        let dir = match &config.state_dir {
            Some(path) => Some(dir::StateDir::lock(path)?),
            None => None,
        };
        let started = fleet::start(
            shared.index_cell(),
            fleet,
            dir,
            writer_config.worker_ttl,
            config.snapshot_interval,
        )?;
        shared.install_fleet(started.freshness);
        shared.install(None, started.writer);
        return Ok(());
    }
    let Some(path) = config.state_dir.clone() else {
        let writer = writer::Writer::start(shared.index_cell(), None, Meta::new(), writer_config)
            .map_err(StateError::Thread)?;
        shared.install(None, writer);
        shared.publish_health().await;
        return Ok(());
    };
    let discard = config.discard_corrupt_state;
    let started = std::time::Instant::now();
    let (dir, recovered) = tokio::task::spawn_blocking(move || recover_dir(&path, discard))
        .await
        .map_err(|error| StateError::Thread(std::io::Error::other(error)))??;
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
    fresh_ttl(&mut meta, writer::now_ms());
    let durable = writer::Durable::new(dir, log, snapshot_position, writer_config.sync);
    let writer = writer::Writer::start(shared.index_cell(), Some(durable), meta, writer_config)
        .map_err(StateError::Thread)?;
    shared.install(Some(index), writer);
    crate::observe::index_size(stats);
    shared.publish_health().await;
    Ok(())
}

/// Locks and recovers a state directory; with `discard`, a corrupt one is moved aside and
/// the server starts empty.
fn recover_dir(
    path: &std::path::Path,
    discard: bool,
) -> Result<(dir::StateDir, Recovered), StateError> {
    let dir = dir::StateDir::lock(path)?;
    for entry in std::fs::read_dir(path).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".tmp") {
            // A snapshot that was being written when the server stopped.
            let _ = std::fs::remove_file(entry.path());
        }
    }
    match recover(path) {
        Ok(recovered) => Ok((dir, recovered)),
        Err(error) if discard && error.is_corruption() => {
            let aside = dir.set_aside(writer::now_ms())?;
            tracing::error!(
                error = %kv_common::error_chain(&error),
                moved_to = %aside.display(),
                "the state directory is corrupt: starting empty (KV_INDEXER_DISCARD_CORRUPT_STATE)"
            );
            let recovered = recover(path)?;
            Ok((dir, recovered))
        }
        Err(error) => Err(error),
    }
}

/// Starts the periodic liveness sweeps and snapshots until `stop`.
pub fn spawn_maintenance(
    shared: std::sync::Arc<crate::service::Shared>,
    config: &crate::config::Config,
    stop: tokio_util::sync::CancellationToken,
) {
    let sweep_every = config.writer.worker_ttl.map(|ttl| {
        (ttl / 4).clamp(
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(5),
        )
    });
    let snapshot_every = config.state_dir.as_ref().and(config.snapshot_interval);
    if config.fleet.is_some() {
        spawn_health_watch(shared.clone(), stop.clone());
    }
    for (every, job) in [(sweep_every, Job::Sweep), (snapshot_every, Job::Snapshot)] {
        let Some(every) = every else { continue };
        let (shared, stop) = (shared.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                if let Ok(writer) = shared.writer() {
                    match job {
                        Job::Sweep => writer.sweep(),
                        Job::Snapshot => writer.snapshot(),
                    }
                }
            }
        });
    }
}

/// A replica's readiness and freshness change on the applier's thread: publishes health when
/// they do (checked every 100 ms).
fn spawn_health_watch(
    shared: std::sync::Arc<crate::service::Shared>,
    stop: tokio_util::sync::CancellationToken,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
        let mut serving = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now = shared.check_fresh().is_ok();
            if serving != Some(now) {
                serving = Some(now);
                shared.publish_health().await;
            }
        }
    });
}

#[derive(Clone, Copy)]
enum Job {
    Sweep,
    Snapshot,
}
