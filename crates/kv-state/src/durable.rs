//! The local log's side of the writer: the state directory, its log made as durable as the
//! sync policy says, and snapshots built in the background from the previous snapshot and the
//! closed log segments (never from the live index), after which the log below them is trimmed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{error, info, warn};

use crate::dir::StateDir;
use crate::error::StateError;
use crate::log::{EventLog, FileLog, LogError};
use crate::meta::Meta;
use crate::recover::rebuild;
use crate::settings::SyncPolicy;
use crate::snapshot;

/// The longest a `batch`-synced record waits for its fdatasync.
pub const BATCH_SYNC_BOUND: Duration = Duration::from_millis(5);

/// The log, its directory and the snapshot in progress.
pub struct Durable {
    pub(crate) dir: StateDir,
    pub(crate) log: FileLog,
    policy: SyncPolicy,
    syncer: Option<Syncer>,
    /// The newest snapshot's position.
    pub(crate) snapshot_position: u64,
    pub(crate) building: Option<std::thread::JoinHandle<Result<Built, StateError>>>,
}

pub(crate) struct Built {
    position: u64,
    bytes: u64,
    took: Duration,
}

impl Durable {
    /// The recovered log of `dir`, whose newest snapshot is at `snapshot_position`.
    pub fn new(dir: StateDir, log: FileLog, snapshot_position: u64, policy: SyncPolicy) -> Durable {
        let syncer = (policy == SyncPolicy::Batch).then(|| Syncer::start(dir.path().to_path_buf()));
        Durable {
            dir,
            log,
            policy,
            syncer,
            snapshot_position,
            building: None,
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
    fn start(dir: PathBuf) -> Syncer {
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
                        error!(%error, dir = %dir.display(), "fdatasync of the log failed");
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

    /// Takes a finished snapshot build's result.
    pub(crate) fn note_built(
        &mut self,
        building: std::thread::JoinHandle<Result<Built, StateError>>,
    ) {
        match building.join() {
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
        return Err(StateError::Log(LogError::Corrupt {
            path: base,
            offset: 0,
            what: "the snapshot to build on is gone".into(),
        }));
    }
    let (index, meta, _, replayed) = rebuild(dir, (from > 0).then_some(base.as_path()), Some(to))?;
    if from + replayed != to {
        return Err(StateError::Log(LogError::Corrupt {
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
    })
}
