//! Recovery: the state rebuilt from a directory (the newest snapshot plus the log after it),
//! and the state directory locked and recovered, or set aside when corrupt and allowed.

use std::path::Path;

use kv_index::Index;

use crate::apply::apply_record;
use crate::clock::now_ms;
use crate::dir::StateDir;
use crate::error::StateError;
use crate::log::{self, FileLog, StateFileError};
use crate::meta::Meta;
use crate::record::Record;
use crate::snapshot;

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
pub fn recover(dir: &Path) -> Result<Recovered, StateError> {
    let newest = snapshot::list(dir)?.pop().map(|(_, path)| path);
    let log = FileLog::open(dir)?;
    let (index, meta, position, replayed) = rebuild(dir, newest.as_deref(), None)?;
    if log.end() < position {
        return Err(StateError::Log(StateFileError::Corrupt {
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
    dir: &Path,
    snapshot: Option<&Path>,
    until: Option<u64>,
) -> Result<(Index, Meta, u64, u64), StateError> {
    let (mut index, mut meta, position) = match snapshot {
        None => (Index::new(), Meta::new(), 0),
        Some(path) => {
            let contents = snapshot::read(path)?;
            (contents.index, contents.meta, contents.position)
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
    dir: &Path,
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

/// Locks and recovers a state directory; with `discard`, a corrupt one is moved aside and
/// the server starts empty.
pub fn recover_dir(path: &Path, discard: bool) -> Result<(StateDir, Recovered), StateError> {
    let dir = StateDir::lock(path)?;
    for entry in std::fs::read_dir(path).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".tmp") {
            // A snapshot that was being written when the server stopped.
            let _ = std::fs::remove_file(entry.path());
        }
    }
    match recover(path) {
        Ok(recovered) => Ok((dir, recovered)),
        Err(error) if discard && error.is_corruption() => {
            let aside = dir.set_aside(now_ms())?;
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
