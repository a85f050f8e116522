//! The index cell the state's one writer changes and every reader shares, and the guard that
//! keeps a half-changed index from ever being served.
//!
//! Two copies of the index (left-right): readers take the published one, the writer changes
//! the other and publishes it, so a query never waits for an apply, and every query sees the
//! state after a whole number of changes, in order.
//!
//! - A reader copies the published pointer ([`IndexCell::read`], an `Arc` clone under a read
//!   lock held for that copy only) and scans that copy for as long as it likes.
//! - The writer ([`IndexWriter`]) owns the other copy. Before changing it, it waits until the
//!   last reader that took it before it was unpublished has let go (`Arc::get_mut`), then
//!   replays onto it the changes it lacks (those of the last publication), applies the new ones
//!   while recording them, and publishes it with one pointer swap. The copy it replaced becomes
//!   the writer's, behind by what was just published.
//! - Each change is made to both copies, in the same order, from the same inputs: `Index` is
//!   deterministic, so the copies stay equal (tested in `kv-index`'s model test and here). The
//!   copies share one block table ([`Index::twin`]): the writer's copy fills it as it changes
//!   and records what its lookups found ([`kv_index::Effects`]); the other copy's replay takes
//!   those and fills nothing (it only reads the table, to count hits). Readers probe the table
//!   while the writer fills it, which is sound because a filled entry never changes
//!   (`kv_index`'s `table.rs`). A block table rebuild happens on the writer's copy, which no
//!   reader sees; the other copy takes the new table where the record says.
//!
//! Nothing here is `unsafe`: the protocol is `Arc` ownership and one `RwLock` around a pointer.

use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_index::{Effects, Index, SpareTable, ValidApply};
use parking_lot::{RwLock, RwLockWriteGuard};

/// How long a writer applies queued changes before it publishes them (and answers them): each
/// publication costs a wait for the last readers of the copy it replaces, so changes queued
/// together share one, while what is applied is seen within about this much. Longer while
/// readers keep the writer waiting ([`IndexWriter::slice`]).
pub const PUBLISH_AFTER: Duration = Duration::from_micros(100);

/// The longest slice a writer applies before it publishes, however long it waits for readers:
/// what is applied is seen (and answered) within about this much.
pub const MAX_PUBLISH_AFTER: Duration = Duration::from_millis(8);

/// A slice lasts this many times the writer's average wait for readers per publication, so that
/// waiting takes about a fifth of its time (while that is under [`MAX_PUBLISH_AFTER`]). A reader
/// preempted in the middle of a query (more runnable threads than cores: the server's own query
/// threads, a neighbour) holds the copy until it runs again, milliseconds; were the writer to
/// publish every [`PUBLISH_AFTER`] regardless, it would wait that long for every 100 µs of work.
const SLICE_PER_WAIT: u32 = 4;

/// The published index, shared by the readers (the service) and the one writer thread (a
/// single server's writer, or a replica's applier), which changes it through an
/// [`IndexWriter`]. Cheap to clone.
#[derive(Clone, Debug)]
pub struct IndexCell {
    published: Arc<RwLock<Arc<Index>>>,
}

/// A new, empty index cell.
pub fn empty() -> IndexCell {
    IndexCell {
        published: Arc::new(RwLock::new(Arc::new(Index::new()))),
    }
}

impl IndexCell {
    /// The index as of the last publication: never waits for a change in progress (only for a
    /// pointer swap, or for [`IndexCell::hold`]). Hold it for one query: the writer waits for
    /// its last reader before it changes this copy again.
    pub fn read(&self) -> Arc<Index> {
        self.published.read().clone()
    }

    /// [`IndexCell::read`], unless the cell is held ([`IndexCell::hold`]) this instant.
    pub fn try_read(&self) -> Option<Arc<Index>> {
        self.published.try_read().map(|index| index.clone())
    }

    /// Keeps every new reader (and the next publication) waiting until the guard is dropped:
    /// for tests that need queries held in flight.
    pub fn hold(&self) -> RwLockWriteGuard<'_, Arc<Index>> {
        self.published.write()
    }
}

/// A change to one copy of the index, as the writer replays it onto the other.
#[derive(Debug)]
enum IndexOp {
    /// An apply, replayed from the effects it recorded.
    Apply(ValidApply),
    /// A block table rebuilt before a change: taken too.
    Table,
    CountHits(Vec<i64>),
}

impl IndexOp {
    /// Makes the op's change to the other copy, taking what the first copy recorded for it
    /// from `effects`.
    fn replay(&self, index: &mut Index, effects: &mut Effects) {
        match self {
            IndexOp::Apply(batch) => index.replay_apply(batch, effects),
            IndexOp::Table => drop(index.replay_table(effects)),
            IndexOp::CountHits(hashes) => index.count_hits(hashes),
        }
    }
}

/// Changes made to one copy, in order, with what they recorded, to make them to the other.
#[derive(Debug, Default)]
struct OpLog {
    ops: Vec<IndexOp>,
    effects: Effects,
}

impl OpLog {
    fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    fn clear(&mut self) {
        self.ops.clear();
        self.effects.clear();
    }

    /// Makes every change to `index`, which is where the first copy was before them.
    fn replay(&mut self, index: &mut Index) {
        for op in self.ops.drain(..) {
            op.replay(index, &mut self.effects);
        }
        assert!(
            self.effects.is_replayed(),
            "the other copy's replay took fewer effects than were recorded"
        );
        self.effects.clear();
    }
}

/// The one writer of an [`IndexCell`]: owns the copy readers do not see.
#[derive(Debug)]
pub struct IndexWriter {
    cell: IndexCell,
    /// The unpublished copy: equal to the published one but for `behind`.
    spare: Arc<Index>,
    /// The changes of the last publication, which `spare` has not had.
    behind: OpLog,
    /// The changes applied to `spare` since the last publication.
    pending: OpLog,
    /// The average wait for readers per change of copy, recent ones weighing most.
    wait: Duration,
}

impl IndexWriter {
    /// The writer of `cell`; its second copy is the published one's twin. One per cell.
    pub fn new(cell: IndexCell) -> IndexWriter {
        let spare = Arc::new(cell.read().twin());
        IndexWriter {
            cell,
            spare,
            behind: OpLog::default(),
            pending: OpLog::default(),
            wait: Duration::ZERO,
        }
    }

    /// How long the next slice applies before it publishes: [`PUBLISH_AFTER`], or
    /// [`SLICE_PER_WAIT`] times the recent average wait for readers if longer, at most
    /// [`MAX_PUBLISH_AFTER`].
    pub fn slice(&self) -> Duration {
        (self.wait * SLICE_PER_WAIT).clamp(PUBLISH_AFTER, MAX_PUBLISH_AFTER)
    }

    /// The cell this writer publishes to.
    pub fn cell(&self) -> &IndexCell {
        &self.cell
    }

    /// The published copy (what readers see, and what a snapshot of the published state
    /// reads).
    pub fn published(&self) -> Arc<Index> {
        self.cell.read()
    }

    /// The block table memory of the unpublished copy, which a snapshot child never reads: the
    /// published copy's, but between a publication that carried a rebuild and the next change
    /// (the unpublished copy still holds the old table until it catches up).
    pub fn spare_table_memory(&self) -> std::ops::Range<usize> {
        self.spare.table_memory()
    }

    /// The unpublished copy, brought up to the published state, to change; its changes are
    /// seen by readers at the next [`IndexWriter::publish`]. Waits for the readers still in
    /// this copy from before the last publication.
    pub fn change(&mut self) -> Changing<'_> {
        let slice = self.slice();
        let (index, waited) = exclusive(&mut self.spare);
        if !self.behind.is_empty() {
            // An average over about the last eight changes of copy.
            self.wait = (self.wait * 7 + waited) / 8;
        }
        let abort = AbortOnPanic("changing the index");
        self.behind.replay(index);
        Changing {
            index,
            log: &mut self.pending,
            started: Instant::now(),
            slice,
            _abort: abort,
        }
    }

    /// Publishes the changes made since the last publication (none: nothing happens). Readers
    /// that start after this see them.
    pub fn publish(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let _abort = AbortOnPanic("publishing the index");
        {
            let mut published = self.cell.published.write();
            std::mem::swap(&mut *published, &mut self.spare);
        }
        debug_assert!(self.behind.is_empty());
        std::mem::swap(&mut self.behind, &mut self.pending);
    }

    /// Publishes `index` in place of everything before it (a recovered or bootstrapped state),
    /// and its twin as the writer's copy. The replaced copies are dropped after their readers
    /// are done with them.
    pub fn replace(&mut self, index: Index) -> (Arc<Index>, Arc<Index>) {
        debug_assert!(self.pending.is_empty(), "replaced with changes unpublished");
        let spare = Arc::new(index.twin());
        let old_published = std::mem::replace(&mut *self.cell.published.write(), Arc::new(index));
        self.behind.clear();
        self.pending.clear();
        let old_spare = std::mem::replace(&mut self.spare, spare);
        (old_published, old_spare)
    }

    /// Publishes what is pending, then whether both copies hold the same index once the
    /// writer's has caught up, in the same layout (their images), sharing one block table (the
    /// replay of recorded effects relies on it), for tests.
    pub fn copies_equal(&mut self) -> bool {
        self.publish();
        let published = self.published();
        let spare = &*self.change();
        let image = |index: &Index| {
            let mut image = Vec::new();
            index.write_image(&mut image).expect("written to memory");
            image
        };
        published.table_memory() == spare.table_memory()
            && published.export() == spare.export()
            && image(&published) == image(spare)
    }
}

/// A wait for readers this long is logged.
const LONG_READER_WAIT: Duration = Duration::from_secs(1);

/// The copy in `slot`, once no reader holds it, and how long that took.
fn exclusive(slot: &mut Arc<Index>) -> (&mut Index, Duration) {
    let start = Instant::now();
    let mut spins = 0u32;
    while Arc::strong_count(slot) > 1 {
        // A reader took this copy before it was unpublished and is still scanning it: a scan
        // is microseconds, unless its thread was preempted.
        spins += 1;
        match spins {
            0..64 => std::hint::spin_loop(),
            64..1024 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(50)),
        }
    }
    let mut waited = Duration::ZERO;
    if spins > 0 {
        waited = start.elapsed();
        crate::observe::reader_wait(waited);
        if waited >= LONG_READER_WAIT {
            // A reader held this copy that long: a huge scan, or an export (`/state`'s digest).
            tracing::warn!(
                waited_ms = waited.as_millis() as u64,
                "the writer waited for a long read of the copy it changes: applies were held meanwhile"
            );
        }
    }
    let index = Arc::get_mut(slot).expect("no other holder: readers take only the published copy");
    (index, waited)
}

/// Changes the index, whichever copy or kind: the replay of a record onto one index
/// (recovery, snapshot building) or the writer's change of its copy, which records them for
/// the other copy.
pub trait IndexChange {
    /// The index as changed so far.
    fn index(&self) -> &Index;
    fn apply(&mut self, batch: &ValidApply);
    fn count_hits(&mut self, hashes: &[i64]);
}

/// A plain index, changed in place (replay, snapshot building, tests).
impl IndexChange for Index {
    fn index(&self) -> &Index {
        self
    }

    fn apply(&mut self, batch: &ValidApply) {
        Index::apply(self, batch);
    }

    fn count_hits(&mut self, hashes: &[i64]) {
        Index::count_hits(self, hashes);
    }
}

/// The writer's copy being changed ([`IndexWriter::change`]): each change is applied and
/// recorded, to be replayed onto the other copy after the next publication. A panic while it
/// lives aborts the process.
pub struct Changing<'a> {
    index: &'a mut Index,
    log: &'a mut OpLog,
    /// When the catch-up ended: the slice's own work is timed from here.
    started: Instant,
    /// How long it applies before it publishes ([`IndexWriter::slice`]).
    slice: Duration,
    /// A panic while this copy is half-changed aborts (an unwinding one could let a later
    /// publication serve it).
    _abort: AbortOnPanic,
}

impl Changing<'_> {
    /// Whether this slice has applied for [`IndexWriter::slice`] (the wait for readers and the
    /// catch-up not counted): time to publish and answer what it holds.
    pub fn slice_spent(&self) -> bool {
        self.started.elapsed() >= self.slice
    }

    /// Rebuilds the block table now when a change adding at most `blocks` blocks would (grow
    /// it, or purge it of stale entries), so that the rebuild is counted and timed. On the
    /// writer's copy no reader waits for it; the other copy takes the same table when it
    /// catches up. (A compaction inside a change may still rebuild there: counted by the
    /// change's `apply`.) The writer's hold on the table replaced, to drop once it has
    /// answered: the other copy holds it too until it catches up, which frees it.
    pub fn make_room(&mut self, blocks: usize) -> Option<SpareTable> {
        if blocks == 0 {
            return None;
        }
        let start = Instant::now();
        let spare = self.index.table_for(blocks)?;
        crate::observe::table_rebuilt(spare.entries(), Some(start.elapsed()));
        // Built from this index just now, so installed (a refusal would hand it back unused).
        match self
            .index
            .install_table_recording(spare, &mut self.log.effects)
        {
            Ok(replaced) => {
                self.log.ops.push(IndexOp::Table);
                Some(replaced)
            }
            Err(unused) => Some(unused),
        }
    }
}

impl Deref for Changing<'_> {
    type Target = Index;

    fn deref(&self) -> &Index {
        self.index
    }
}

impl IndexChange for Changing<'_> {
    fn index(&self) -> &Index {
        self.index
    }

    fn apply(&mut self, batch: &ValidApply) {
        let mark = self.log.effects.mark();
        self.index.apply_recording(batch, &mut self.log.effects);
        // A rebuild inside the change (not made before it by `make_room`) is counted too.
        for entries in self.log.effects.tables_since(mark) {
            crate::observe::table_rebuilt(entries, None);
        }
        self.log.ops.push(IndexOp::Apply(batch.clone()));
    }

    fn count_hits(&mut self, hashes: &[i64]) {
        self.index.count_hits(hashes);
        self.log.ops.push(IndexOp::CountHits(hashes.to_vec()));
    }
}

/// Aborts the process when dropped by a panic's unwinding: held while the index is being
/// changed, where an unwinding panic could leave a half-applied copy that a later publication
/// would serve, or copies that differ. Aborting instead leaves recovery to a restart (with the
/// bridges' resync, the index then under-claims, never over-claims).
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

    fn report(worker: &str, hashes: std::ops::Range<i64>) -> ValidApply {
        kv_index::ApplyRequest {
            worker_id: worker.into(),
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
    }

    #[test]
    fn readers_see_a_change_only_once_published_and_the_copies_stay_equal() {
        let cell = empty();
        let mut writer = IndexWriter::new(cell.clone());
        let before = cell.read();
        {
            let mut index = writer.change();
            index.make_room(5000);
            index.apply(&report("w", 0..5000));
            index.count_hits(&[1, 2, 3]);
            assert_eq!(index.stats().blocks, 5000);
        }
        assert_eq!(cell.read().stats().blocks, 0, "seen before its publication");
        writer.publish();
        assert_eq!(cell.read().stats().blocks, 5000);
        // A reader that took the old copy keeps it, whole, while the writer waits for it.
        assert_eq!(before.stats().blocks, 0);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            before.stats().blocks
        });
        writer.change().apply(&report("v", 10..20));
        assert_eq!(reader.join().unwrap(), 0);
        writer.publish();
        assert!(writer.copies_equal());
        assert_eq!(
            cell.read().hit_counts(&[1, 2, 3]).unwrap(),
            vec![(1, 1), (2, 1), (3, 1)]
        );
    }

    #[test]
    fn a_writer_kept_waiting_by_readers_publishes_less_often_until_they_keep_up() {
        let cell = empty();
        let mut writer = IndexWriter::new(cell.clone());
        assert_eq!(writer.slice(), PUBLISH_AFTER);
        // A reader holds the copy the writer changes next for 40 ms (a preempted query).
        writer.change().apply(&report("w", 0..10));
        let held = cell.read();
        writer.publish();
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(40));
            drop(held);
        });
        writer.change().apply(&report("w", 10..20));
        reader.join().unwrap();
        // A wait of 16 ms or more (the hold, less the moment before the writer started to
        // wait) makes an average of 2 ms or more: slices of four times that, the bound.
        assert_eq!(writer.slice(), MAX_PUBLISH_AFTER);
        // Changes of copy that wait for nobody bring it back down.
        for i in 0..64 {
            writer.publish();
            writer.change().apply(&report("w", 20 + i..21 + i));
            // Changes without a publication in between are not changes of copy.
            writer.change().apply(&report("v", i..i + 1));
        }
        assert_eq!(writer.slice(), PUBLISH_AFTER);
        assert!(writer.copies_equal());
    }

    #[test]
    fn a_replaced_index_is_published_in_both_copies() {
        let cell = empty();
        let mut writer = IndexWriter::new(cell.clone());
        let mut index = Index::new();
        index.apply(&report("w", 0..10));
        writer.replace(index);
        assert_eq!(cell.read().stats().blocks, 10);
        writer.change().apply(&report("w", 10..20));
        writer.publish();
        assert_eq!(cell.read().stats().blocks, 20);
        assert!(writer.copies_equal());
    }

    #[test]
    fn the_guard_does_nothing_without_a_panic() {
        let guard = AbortOnPanic("a test apply");
        drop(guard);
    }
}
