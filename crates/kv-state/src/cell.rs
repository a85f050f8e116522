//! The index cell the state's one writer changes and every reader shares, and the guard that
//! keeps a half-changed index from ever being served.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Instant;

use kv_index::{Index, SpareTable};
use parking_lot::{RwLock, RwLockWriteGuard};

/// The index, shared by the readers (the service) and the one writer thread (a single server's
/// writer, or a replica's applier).
pub type IndexCell = Arc<RwLock<Index>>;

/// A new, empty index cell.
pub fn empty() -> IndexCell {
    Arc::new(RwLock::new(Index::new()))
}

/// The write lock for one change that adds at most `blocks` new blocks, taken by the one writer
/// thread. When the change would rebuild the block table (grow it, or purge it of stale
/// entries: it touches every entry, about 70 ms at 2 M placements and seconds at 100 M), the
/// new table is built first under a read lock, so queries go on meanwhile, and swapped in
/// under this lock; the old one is freed after the lock is released.
pub fn write_for(cell: &IndexCell, blocks: usize) -> Writing<'_> {
    let spare = if blocks == 0 {
        None
    } else {
        let start = Instant::now();
        let spare = cell.read().table_for(blocks);
        if let Some(spare) = &spare {
            crate::observe::table_rebuilt(spare.entries(), start.elapsed());
        }
        spare
    };
    let mut index = cell.write();
    let retired = spare.map(|spare| {
        // Only another writer could change the index in between; then the change rebuilds
        // the table itself, under this lock.
        index.install_table(spare).unwrap_or_else(|stale| {
            tracing::warn!(
                "the block table built beside the index is stale: rebuilt under the lock"
            );
            stale
        })
    });
    Writing { index, retired }
}

/// The index's write lock ([`write_for`]), and the block table it replaced, freed after it.
pub struct Writing<'a> {
    // Fields drop in order: the lock is released before the old table is freed.
    index: RwLockWriteGuard<'a, Index>,
    retired: Option<SpareTable>,
}

impl Writing<'_> {
    /// Releases the lock and hands back the table it replaced, if any, for the caller to free
    /// once it has answered (freeing a large table takes a while).
    pub fn unlock(self) -> Option<SpareTable> {
        let Writing { index, retired } = self;
        drop(index);
        retired
    }
}

impl Deref for Writing<'_> {
    type Target = Index;

    fn deref(&self) -> &Index {
        &self.index
    }
}

impl DerefMut for Writing<'_> {
    fn deref_mut(&mut self) -> &mut Index {
        &mut self.index
    }
}

/// Aborts the process when dropped by a panic's unwinding: held while the index is being
/// changed, where an unwinding panic would release the write lock over a half-applied index
/// that every later query would be served from. Aborting instead leaves recovery to a restart
/// (with the bridges' resync, the index then under-claims, never over-claims).
pub struct AbortOnPanic(pub &'static str);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(
                during = self.0,
                "panic while the index was half-changed: aborting rather than serving it"
            );
            eprintln!(
                "kv-indexer: panic while {}: aborting rather than serving a half-changed index",
                self.0
            );
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process of `a_panic_while_changing_the_index_aborts`.
    const CHILD: &str = "KV_STATE_TEST_PANIC_CHILD";

    #[test]
    fn a_panic_while_changing_the_index_aborts() {
        if std::env::var_os(CHILD).is_some() {
            let _abort = AbortOnPanic("a test apply");
            panic!("a bug inside an apply");
        }
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cell::tests::a_panic_while_changing_the_index_aborts",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(output.status.signal(), Some(6), "not aborted: {stderr}");
        assert!(stderr.contains("aborting rather than serving"), "{stderr}");
    }

    #[test]
    fn the_writers_lock_comes_with_room_for_the_change() {
        let cell = empty();
        let report = |hashes: std::ops::Range<i64>| {
            kv_index::ApplyRequest {
                worker_id: "w".into(),
                actions: vec![kv_index::ActionRequest {
                    action_type: kv_index::ActionKind::Report as i32,
                    tier: kv_index::Tier::Hbm.wire(),
                    hashes: hashes.collect(),
                    ..Default::default()
                }],
                ..Default::default()
            }
            .validate()
            .unwrap()
        };
        cell.write().apply(&report(0..10));
        let change = report(10..5000);
        assert!(cell.read().table_for(change.reported_blocks()).is_some());
        let mut index = write_for(&cell, change.reported_blocks());
        assert!(index.table_for(change.reported_blocks()).is_none());
        index.apply(&change);
        assert_eq!(index.stats().blocks, 5000);
    }

    #[test]
    fn the_guard_does_nothing_without_a_panic() {
        let guard = AbortOnPanic("a test apply");
        drop(guard);
    }
}
