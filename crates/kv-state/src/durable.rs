//! The local log's side of the writer: the state directory, its log made as durable as the
//! sync policy says, and snapshots written in the background (by a forked child from the live
//! index, [`crate::fork`], or built from the previous snapshot and the closed log segments when
//! no child can be made), after which the log below them is trimmed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{error, info, warn};

use crate::config::{SnapshotMethod, SyncPolicy};
use crate::dir::StateDir;
use crate::error::StateError;
use crate::log::{FileLog, StateFileError};
use crate::meta::Meta;
use crate::recover::rebuild;
use crate::snapshot::{self, Built};

/// The longest a `batch`-synced record waits for its fdatasync.
pub const BATCH_SYNC_BOUND: Duration = Duration::from_millis(5);

/// Whether the state directory takes changes.
#[derive(Debug, Clone, Default)]
pub enum WriteState {
    #[default]
    Writable,
    /// Its disk is full (ENOSPC, EDQUOT): applies are refused, each new one retries the write,
    /// and the first that succeeds ends this. Queries are answered.
    DiskFull(Arc<StateError>),
    /// A write or an fdatasync failed otherwise: nothing more is accepted, and the server
    /// stops so that a restart recovers from the log (a failed sync is not retried: what it
    /// did not write back is unknown).
    Failed(Arc<StateError>),
}

impl WriteState {
    /// Why changes are refused; none when writable.
    pub fn refusal(&self) -> Option<crate::error::ChangeError> {
        use crate::error::ChangeError;
        match self {
            WriteState::Writable => None,
            WriteState::DiskFull(error) => Some(ChangeError::DiskFull(error.clone())),
            WriteState::Failed(error) => Some(ChangeError::LogUnwritable(error.clone())),
        }
    }
}

/// Where the writer and the syncer say what [`WriteState`] the directory is in.
pub(crate) type WriteStatus = Arc<tokio::sync::watch::Sender<WriteState>>;

/// The log, its directory and the snapshot in progress.
pub struct Durable {
    pub(crate) dir: StateDir,
    pub(crate) log: FileLog,
    policy: SyncPolicy,
    syncer: Option<Syncer>,
    /// The newest snapshot's position.
    pub(crate) snapshot_position: u64,
    pub(crate) method: SnapshotMethod,
    pub(crate) building: Option<Building>,
    pub(crate) status: WriteStatus,
}

/// A snapshot child running longer than this is taken for hung (a forked child can deadlock
/// on a lock another thread held at the fork, or block on a dead disk) and killed, so that the
/// next interval tries again. Snapshots of 100 M placements take about 15 s.
pub const SNAPSHOT_WATCHDOG: Duration = Duration::from_secs(600);

/// A snapshot being built: the thread that builds it or waits for its child, and the child.
pub(crate) struct Building {
    pub(crate) thread: std::thread::JoinHandle<Result<Built, StateError>>,
    /// The child writing it, when a child writes it.
    pub(crate) child: Option<crate::fork::Stopper>,
}

impl Durable {
    /// The recovered log of `dir`, whose newest snapshot is at `snapshot_position`.
    pub fn new(
        dir: StateDir,
        log: FileLog,
        snapshot_position: u64,
        policy: SyncPolicy,
        method: SnapshotMethod,
    ) -> Durable {
        let status: WriteStatus = Arc::new(tokio::sync::watch::Sender::new(WriteState::Writable));
        let syncer = (policy == SyncPolicy::Batch)
            .then(|| Syncer::start(dir.path().to_path_buf(), status.clone()));
        Durable {
            dir,
            log,
            policy,
            syncer,
            snapshot_position,
            method,
            building: None,
            status,
        }
    }

    /// Appends a group and makes it as durable as the policy says.
    pub(crate) fn append(&mut self, records: &[Vec<u8>]) -> Result<(), StateError> {
        self.log.append(records)?;
        match self.policy {
            SyncPolicy::Always => self.log.sync()?,
            SyncPolicy::Batch => {
                if let Some(syncer) = &self.syncer {
                    syncer.due(&self.log)?;
                }
            }
            SyncPolicy::Off => {}
        }
        Ok(())
    }
}

/// Runs fdatasync on the log within [`BATCH_SYNC_BOUND`] of a write, off the writer thread.
struct Syncer {
    shared: Arc<SyncState>,
}

struct SyncState {
    /// The segment to sync. Taken out of the lock before syncing: an fdatasync can wait long
    /// behind other writeback (a snapshot's), and the writer takes this lock at every group.
    file: Mutex<Option<Arc<std::fs::File>>>,
    dirty: AtomicBool,
}

impl Syncer {
    fn start(dir: PathBuf, status: WriteStatus) -> Syncer {
        let shared = Arc::new(SyncState {
            file: Mutex::new(None),
            dirty: AtomicBool::new(false),
        });
        let state = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("kv-indexer-sync".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(BATCH_SYNC_BOUND);
                    if Arc::strong_count(&state) == 1 {
                        return;
                    }
                    if state.dirty.swap(false, Ordering::AcqRel)
                        && let Some(file) = state.file.lock().clone()
                        && let Err(error) = file.sync_data()
                    {
                        let error = StateError::Log(crate::log::io("syncing", &dir)(error));
                        let reason = kv_common::error_chain(&error);
                        error!(%reason, "fdatasync of the log failed: refusing changes and stopping");
                        status.send_replace(WriteState::Failed(Arc::new(error)));
                        return;
                    }
                }
            });
        if let Err(error) = spawned {
            warn!(%error, "no syncer thread: the log is synced at snapshots only");
        }
        Syncer { shared }
    }

    /// Marks the log's current segment as needing a sync.
    fn due(&self, log: &FileLog) -> Result<(), StateError> {
        let mut file = self.shared.file.lock();
        if file.is_none() {
            *file = Some(Arc::new(log.segment_file()?));
        }
        self.shared.dirty.store(true, Ordering::Release);
        Ok(())
    }

    /// Forgets the segment (after a rotation).
    fn rotated(&self) {
        *self.shared.file.lock() = None;
    }
}

impl Durable {
    pub(crate) fn rotate(&mut self) -> Result<(), StateError> {
        self.log.rotate()?;
        if let Some(syncer) = &self.syncer {
            syncer.rotated();
        }
        Ok(())
    }

    /// At shutdown: stops a snapshot's child (the final snapshot supersedes it) and takes the
    /// result of whatever was being built.
    pub(crate) fn stop_building(&mut self) {
        let Some(building) = self.building.take() else {
            return;
        };
        let Some(child) = &building.child else {
            return self.note_built(building);
        };
        child.stop();
        match building.thread.join() {
            Ok(Ok(built)) => self.retire(&built),
            _ => info!("the snapshot in progress was stopped for the final one"),
        }
    }

    /// Takes a finished snapshot build's result.
    pub(crate) fn note_built(&mut self, building: Building) {
        match building.thread.join() {
            Ok(Ok(built)) => self.retire(&built),
            Ok(Err(error)) => crate::observe::snapshot_failed(Some(&error)),
            Err(_) => crate::observe::snapshot_failed(None),
        }
    }

    /// Records a written snapshot (its builder deleted what it covers: [`prune`]).
    pub(crate) fn retire(&mut self, built: &Built) {
        self.snapshot_position = built.position;
        crate::observe::snapshot_written(built.bytes, built.took);
        info!(
            position = built.position,
            bytes = built.bytes,
            took_ms = built.took.as_millis() as u64,
            fork_us = built.fork.as_micros() as u64,
            "snapshot written"
        );
    }
}

/// Builds the snapshot at `to` from the one at `from` (or nothing) and the records between,
/// then deletes what it covers.
pub(crate) fn build_snapshot(dir: &Path, from: u64, to: u64) -> Result<Built, StateError> {
    let start = Instant::now();
    let base = snapshot::path(dir, from);
    if from > 0 && !base.exists() {
        return Err(StateError::Log(StateFileError::Corrupt {
            path: base,
            offset: 0,
            what: "the snapshot to build on is gone".into(),
        }));
    }
    let (index, meta, _, replayed) = rebuild(dir, (from > 0).then_some(base.as_path()), Some(to))?;
    if from + replayed != to {
        return Err(StateError::Log(StateFileError::Corrupt {
            path: dir.to_path_buf(),
            offset: 0,
            what: format!(
                "the log from {from} holds {replayed} records, not the {} up to {to}",
                to - from
            ),
        }));
    }
    let built = write_snapshot(dir, to, &index, &meta, start)?;
    prune(dir, to);
    Ok(built)
}

/// Deletes the snapshots before `position` and the log segments the one at `position` covers.
/// The snapshot thread does it, not the writer: deleting files of tens of MB (a journal
/// commit, discards) held the writer for tens of ms.
pub(crate) fn prune(dir: &Path, position: u64) {
    let pruned = snapshot::list(dir).and_then(|snapshots| {
        for (older, path) in snapshots {
            if older < position {
                let _ = std::fs::remove_file(path);
            }
        }
        crate::log::trim_dir_before(dir, position)
    });
    if let Err(error) = pruned {
        warn!(error = %kv_common::error_chain(&error), "cannot trim the log below the snapshot");
    }
}

/// Writes the snapshot of `index` and `meta` at `position`; `start` is when it was begun.
pub(crate) fn write_snapshot(
    dir: &Path,
    position: u64,
    index: &kv_index::Index,
    meta: &Meta,
    start: Instant,
) -> Result<Built, StateError> {
    let bytes = snapshot::write(dir, position, index, meta)?;
    Ok(Built {
        position,
        bytes,
        took: start.elapsed(),
        fork: Duration::ZERO,
    })
}

#[cfg(test)]
mod tests {
    use kv_testkit::indexer::report_request;

    use super::*;
    use crate::record::{Change, Record};

    /// The build used when no snapshot process can be forked: the previous snapshot (none
    /// here) and the closed segments, to the state their replay gives; the segments it covers
    /// are deleted.
    #[test]
    fn a_snapshot_built_from_the_log_holds_what_replay_gives() {
        let dir = kv_testkit::temp_dir("kv-state-durable", "built-from-log");
        std::fs::create_dir_all(&dir).unwrap();
        let mut log = FileLog::open(&dir).unwrap();
        let records: Vec<Vec<u8>> = (0..5)
            .map(|i| {
                let request =
                    report_request(&format!("w-{}", i % 2), (i * 10..i * 10 + 30).collect());
                Record {
                    time_ms: 1_000 + i as u64,
                    change: Change::Apply(request),
                }
                .encode()
            })
            .chain([Record {
                time_ms: 2_000,
                change: Change::CountHits(vec![0, 1, 2]),
            }
            .encode()])
            .collect();
        log.append(&records).unwrap();
        log.rotate().unwrap();
        let (index, meta, _, replayed) = rebuild(&dir, None, Some(6)).unwrap();
        assert_eq!(replayed, 6);
        assert!(index.stats().placements > 0);

        let built = build_snapshot(&dir, 0, 6).unwrap();
        assert_eq!((built.position, built.fork), (6, Duration::ZERO));
        let contents = snapshot::read(&snapshot::path(&dir, 6)).unwrap();
        assert_eq!(contents.index.export(), index.export());
        assert_eq!(contents.meta, meta);
        assert!(
            crate::log::segments(&dir)
                .unwrap()
                .iter()
                .all(|s| s.first >= 6)
        );
        // Building on a snapshot that is gone is refused, naming why.
        let error = build_snapshot(&dir, 3, 6).unwrap_err();
        assert!(kv_common::error_chain(&error).contains("is gone"));
    }
}
