//! Recorded effects: a change made to one index with what its block-table lookups found
//! recorded, then made to an equal index (a left-right cell's other copy) from that record,
//! without looking anything up in its table.
//!
//! Two equal indexes have equal tables slot for slot (the table is deterministic: the same
//! entries inserted in the same order into as many buckets), so each lookup of a change finds
//! the same slot in both. The change itself (chunks, pieces, workers, counters, the table's
//! stores) is made alike on both; only the lookups differ:
//! - [`Live`] probes the table (every plain apply);
//! - [`Record`] probes it and records what it found: the live block a `locate` found (or none),
//!   the slot a new block's entry takes (stale or vacant), the slot of an entry a compaction
//!   moves, and where the table was rebuilt;
//! - [`Replay`] takes those in order instead, touching the slots it will fill a few ahead (so
//!   that their cache misses overlap, as a REPORT's lookups do), and rebuilds the table where
//!   it was rebuilt: the rebuild is deterministic, so the tables stay equal. (Installing a copy
//!   of the first index's new table instead costs more: a doubling's rehash writes the new
//!   table almost in order, and the copy is one more table-sized allocation, faulted in.)
//!
//! A replay's lookups are checked against the table in debug builds; in every build, each
//! change checks that the record was made on an index at the same count of changes, and that
//! the record is taken in order, entry kind by entry kind.

use crate::table::{BlockTable, Loc};

use super::layout::{Chunk, Found, Lookup, lookup};
use super::{Index, SpareTable, WARM_AHEAD};

/// What the lookups of changes made to one index found, in order, to make the same changes to
/// an equal index ([`Index::apply_recording`], [`Index::install_table_recording`], then
/// [`Index::replay_apply`], [`Index::replay_table`]).
#[derive(Debug, Default)]
pub struct Effects {
    list: Vec<Effect>,
    /// The next entry a replay takes.
    next: usize,
    /// Where the replay's touching of slots ahead has reached.
    warmed: usize,
}

/// Entries kept between changes: a longer list is freed once replayed.
const KEEP_ENTRIES: usize = 1 << 16;

impl Effects {
    pub fn new() -> Effects {
        Effects::default()
    }

    /// Whether every recorded entry has been replayed (or none was recorded).
    pub fn is_replayed(&self) -> bool {
        self.next == self.list.len()
    }

    /// Forgets every entry, replayed or not.
    pub fn clear(&mut self) {
        if self.list.capacity() > KEEP_ENTRIES {
            self.list = Vec::new();
        } else {
            self.list.clear();
        }
        self.next = 0;
        self.warmed = 0;
    }

    fn push(&mut self, effect: Effect) {
        self.list.push(effect);
    }

    /// The next entry, taken out.
    fn take(&mut self) -> Effect {
        let effect = std::mem::replace(
            self.list
                .get_mut(self.next)
                .expect("a replay takes no more than was recorded"),
            Effect::Missing,
        );
        self.next += 1;
        effect
    }

    /// Touches the table lines of the slots the next entries fill or move, once the replay
    /// has reached the end of the last stretch touched.
    #[inline]
    fn warm(&mut self, table: &BlockTable) {
        if self.next < self.warmed {
            return;
        }
        self.warmed = (self.next + WARM_AHEAD).min(self.list.len());
        let touched = self.list[self.next..self.warmed]
            .iter()
            .fold(0u64, |sum, effect| match *effect {
                Effect::Stale(slot) | Effect::Vacant(slot) | Effect::Moved(slot, _) => {
                    sum.wrapping_add(table.touch_slot(slot))
                }
                _ => sum,
            });
        std::hint::black_box(touched);
    }
}

#[derive(Debug)]
enum Effect {
    /// A change began on an index that had made this many changes.
    Begin(u64),
    /// A `locate` found this live block, or a new block's hash was this live block already.
    Live(Found),
    /// A `locate` found no live block.
    Missing,
    /// A new block's entry re-points this stale slot.
    Stale(usize),
    /// A new block's entry fills this vacant slot.
    Vacant(usize),
    /// A compaction moves the entry in this slot, which was there, to a new offset.
    Moved(usize, Loc),
    /// The table was rebuilt, with room for this many new entries, at this count of changes.
    Table { room: usize, changes: u64 },
}

/// What a new block's hash is in the table: a live block, or the slot its entry takes.
pub(super) enum Look {
    Live(Found),
    Stale(usize),
    Vacant(usize),
}

/// How a change looks up the block table (see the module docs).
pub(super) trait Lookups {
    /// Whether a REPORT touches its new blocks' slots ahead of their lookups.
    const WARMS: bool;

    /// A change begins on `index`.
    fn begin(&mut self, index: &Index);

    /// The live block `hash`, if any (`Index::locate`).
    fn locate(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Option<Found>;

    /// A REPORTed block: live already, or the slot its entry takes.
    fn look(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Look;

    /// Moves the entry of live `hash` to `offset` in its chunk (`chunks` as they are before
    /// the move); where it was.
    fn move_entry(
        &mut self,
        table: &mut BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc>;

    /// Rebuilds the table when one more entry would not fit (`Index::make_room`).
    fn make_room(&mut self, index: &mut Index);
}

/// Probes the table: a plain change.
pub(super) struct Live;

impl Lookups for Live {
    const WARMS: bool = true;

    #[inline]
    fn begin(&mut self, _: &Index) {}

    #[inline]
    fn locate(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Option<Found> {
        match lookup(table, chunks, hash) {
            Lookup::Live(_, found) => Some(found),
            Lookup::Held(..) | Lookup::Vacant(_) => None,
        }
    }

    #[inline]
    fn look(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Look {
        match lookup(table, chunks, hash) {
            Lookup::Live(_, found) => Look::Live(found),
            Lookup::Held(slot, _) => Look::Stale(slot),
            Lookup::Vacant(slot) => Look::Vacant(slot),
        }
    }

    #[inline]
    fn move_entry(
        &mut self,
        table: &mut BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc> {
        let (slot, loc) = match lookup(table, chunks, hash) {
            Lookup::Live(slot, found) => (slot, found.loc()),
            Lookup::Held(slot, loc) => (slot, loc),
            Lookup::Vacant(_) => return None,
        };
        table.set(slot, Loc { offset, ..loc });
        Some(loc)
    }

    #[inline]
    fn make_room(&mut self, index: &mut Index) {
        if let Some(spare) = index.table_for(1) {
            index
                .install_table(spare)
                .expect("a table built from this index just now");
        }
    }
}

/// Probes the table and records what it found.
pub(super) struct Record<'a>(pub(super) &'a mut Effects);

impl Lookups for Record<'_> {
    const WARMS: bool = true;

    fn begin(&mut self, index: &Index) {
        self.0.push(Effect::Begin(index.changes));
    }

    #[inline]
    fn locate(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Option<Found> {
        let found = Live.locate(table, chunks, hash);
        self.0.push(found.map_or(Effect::Missing, Effect::Live));
        found
    }

    #[inline]
    fn look(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Look {
        let look = Live.look(table, chunks, hash);
        self.0.push(match look {
            Look::Live(found) => Effect::Live(found),
            Look::Stale(slot) => Effect::Stale(slot),
            Look::Vacant(slot) => Effect::Vacant(slot),
        });
        look
    }

    #[inline]
    fn move_entry(
        &mut self,
        table: &mut BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc> {
        let (slot, loc) = match lookup(table, chunks, hash) {
            Lookup::Live(slot, found) => (slot, found.loc()),
            Lookup::Held(..) | Lookup::Vacant(_) => unreachable!("a live block has an entry"),
        };
        table.set(slot, Loc { offset, ..loc });
        self.0.push(Effect::Moved(slot, loc));
        Some(loc)
    }

    fn make_room(&mut self, index: &mut Index) {
        if let Some(spare) = index.table_for(1) {
            index
                .install_table(spare)
                .expect("a table built from this index just now");
            self.0.push(Effect::Table {
                room: 1,
                changes: index.changes,
            });
        }
    }
}

/// Takes what a [`Record`] recorded instead of probing.
pub(super) struct Replay<'a>(pub(super) &'a mut Effects);

impl Lookups for Replay<'_> {
    const WARMS: bool = false;

    fn begin(&mut self, index: &Index) {
        match self.0.take() {
            Effect::Begin(changes) => assert_eq!(
                changes, index.changes,
                "effects recorded on an index at another change"
            ),
            other => panic!("a change replayed where {other:?} was recorded"),
        }
    }

    #[inline]
    fn locate(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Option<Found> {
        let found = match self.0.take() {
            Effect::Live(found) => Some(found),
            Effect::Missing => None,
            other => panic!("a lookup replayed where {other:?} was recorded"),
        };
        debug_assert_eq!(found, Live.locate(table, chunks, hash), "replayed {hash}");
        found
    }

    #[inline]
    fn look(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Look {
        self.0.warm(table);
        let look = match self.0.take() {
            Effect::Live(found) => Look::Live(found),
            Effect::Stale(slot) => Look::Stale(slot),
            Effect::Vacant(slot) => Look::Vacant(slot),
            other => panic!("a new block replayed where {other:?} was recorded"),
        };
        #[cfg(debug_assertions)]
        match (&look, Live.look(table, chunks, hash)) {
            (Look::Live(a), Look::Live(b)) => assert_eq!(*a, b, "replayed {hash}"),
            (Look::Stale(a), Look::Stale(b)) | (Look::Vacant(a), Look::Vacant(b)) => {
                assert_eq!(*a, b, "replayed {hash}")
            }
            _ => panic!("replayed {hash}: another kind of lookup"),
        }
        let _ = (table, chunks, hash);
        look
    }

    #[inline]
    fn move_entry(
        &mut self,
        table: &mut BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc> {
        self.0.warm(table);
        let Effect::Moved(slot, loc) = self.0.take() else {
            panic!("an entry moved where it was not recorded");
        };
        debug_assert!(
            matches!(lookup(table, chunks, hash), Lookup::Live(s, f) if s == slot && f.loc() == loc)
        );
        let _ = (chunks, hash);
        table.set(slot, Loc { offset, ..loc });
        Some(loc)
    }

    fn make_room(&mut self, index: &mut Index) {
        if index.table.is_full() {
            let replaced = index.replay_table_effect(self.0.take(), Some(1));
            drop(replaced);
        }
    }
}

impl Index {
    /// [`Index::apply`], recording in `effects` what its table lookups found and any table it
    /// rebuilt, for [`Index::replay_apply`] onto an index equal to this one as it was.
    pub fn apply_recording(&mut self, batch: &crate::ValidApply, effects: &mut Effects) {
        self.apply_with(batch, &mut Record(effects));
    }

    /// Applies `batch` to this index as [`Index::apply_recording`] did to an equal one, taking
    /// its lookups from `effects` (the next entries, in the order recorded) instead of probing
    /// the table. Panics if the record was made for another change or another index state.
    pub fn replay_apply(&mut self, batch: &crate::ValidApply, effects: &mut Effects) {
        self.apply_with(batch, &mut Replay(effects));
    }

    /// [`Index::install_table`], recording the rebuild in `effects`, for
    /// [`Index::replay_table`] onto an index equal to this one as it was.
    pub fn install_table_recording(
        &mut self,
        spare: SpareTable,
        effects: &mut Effects,
    ) -> Result<SpareTable, SpareTable> {
        let room = spare.room;
        let replaced = self.install_table(spare)?;
        effects.push(Effect::Table {
            room,
            changes: self.changes,
        });
        Ok(replaced)
    }

    /// Rebuilds the table as [`Index::install_table_recording`] recorded next in `effects`
    /// (equal indexes build equal tables); the table it replaced. Panics if the next entry is
    /// not one, or was recorded on an index at another count of changes, or this index would
    /// not rebuild its table there.
    pub fn replay_table(&mut self, effects: &mut Effects) -> SpareTable {
        self.replay_table_effect(effects.take(), None)
    }

    /// Rebuilds the table where `effect` says it was (with room for `room` entries when
    /// given, which it must match).
    fn replay_table_effect(&mut self, effect: Effect, room: Option<usize>) -> SpareTable {
        let Effect::Table {
            room: recorded,
            changes,
        } = effect
        else {
            panic!("a table rebuilt where {effect:?} was recorded");
        };
        assert_eq!(
            changes, self.changes,
            "a table rebuild recorded on an index at another change"
        );
        assert!(room.is_none_or(|room| room == recorded), "another rebuild");
        let spare = self
            .table_for(recorded)
            .expect("an equal index rebuilds its table where the first one did");
        self.install_table(spare)
            .expect("a table built from this index just now")
    }
}
