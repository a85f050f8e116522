//! Recorded effects: a change made to one index with what its block-table lookups found
//! recorded, then made to its twin (a left-right cell's other copy, sharing its table: see
//! [`Index::twin`]) from that record, without looking anything up or filling anything.
//!
//! The first index fills the shared table as it changes; its twin, equal to it as it was
//! before the changes, makes the same changes to everything else (chunks, pieces, workers,
//! counters) and only needs to know what each lookup found:
//! - [`Live`] probes the table (every plain apply) and fills it;
//! - [`Record`] does that and records what it found: the live block a `locate` found (or none),
//!   whether a REPORTed block was new, where a compaction moved an entry from, and each table
//!   the first index rebuilt and installed;
//! - [`Replay`] takes those in order instead, and installs the very table the first index
//!   installed where it did (the table is shared, not rebuilt again).
//!
//! A replay's lookups are checked against the table in debug builds; in every build, each
//! change checks that the record was made on an index at the same count of changes and with
//! the same table, and that the record is taken in order, entry kind by entry kind.

use crate::table::{BlockTable, Loc, SharedTable};

use super::layout::{Chunk, Found, Lookup, lookup};
use super::{Index, SpareTable};

/// What the lookups of changes made to one index found, in order, to make the same changes to
/// its twin ([`Index::apply_recording`], [`Index::install_table_recording`], then
/// [`Index::replay_apply`], [`Index::replay_table`]).
#[derive(Debug, Default)]
pub struct Effects {
    list: Vec<Effect>,
    /// The next entry a replay takes.
    next: usize,
    /// Tables recorded (installed) in `list`.
    tables: usize,
}

/// Where a record stood, for [`Effects::tables_since`].
#[derive(Debug, Clone, Copy)]
pub struct EffectsMark {
    at: usize,
    tables: usize,
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
        self.tables = 0;
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

    /// Where the record stands now, for [`Effects::tables_since`].
    pub fn mark(&self) -> EffectsMark {
        EffectsMark {
            at: self.list.len(),
            tables: self.tables,
        }
    }

    /// The entries held by each block table installed since `mark` ([`Effects::mark`]): the
    /// rebuilds a change made inside itself, which its writer did not make before it (a
    /// compaction's moves may need room that the reported blocks did not). Reads the record
    /// only when there is one.
    pub fn tables_since(&self, mark: EffectsMark) -> impl Iterator<Item = usize> + '_ {
        let since = if self.tables > mark.tables {
            &self.list[mark.at.min(self.list.len())..]
        } else {
            &[]
        };
        since.iter().filter_map(|effect| match effect {
            Effect::Table(table) => Some(table.entries),
            _ => None,
        })
    }

    /// Whether the next entry is a table rebuild.
    fn table_next(&self) -> bool {
        matches!(self.list.get(self.next), Some(Effect::Table(_)))
    }
}

#[derive(Debug)]
enum Effect {
    /// A change began on an index that had made this many changes, with this table (its
    /// address).
    Begin(u64, usize),
    /// A `locate` found this live block, or a new block's hash was this live block already.
    Live(Found),
    /// A `locate` found no live block.
    Missing,
    /// A REPORTed block was new: it got an entry.
    New,
    /// A compaction gave a live block, which was here, an entry where it moved.
    Moved(Loc),
    /// A table was installed (boxed: rare, and the other entries are half its size).
    Table(Box<TableEffect>),
}

/// A table installed, built with room for `room` new entries at `changes` changes.
#[derive(Debug)]
struct TableEffect {
    room: usize,
    changes: u64,
    table: SharedTable,
    /// Entries it held when installed (it fills on).
    entries: usize,
}

/// What a REPORTed block's hash is in the table: a live block, or new (with the vacant slot
/// its entry takes, unless the table is filled already: a replay).
pub(super) enum Look {
    Live(Found),
    New(Option<usize>),
}

/// How a change looks up the block table (see the module docs).
pub(super) trait Lookups {
    /// Whether a REPORT prefetches its new blocks' home buckets ahead of their lookups.
    const WARMS: bool;

    /// A change begins on `index`.
    fn begin(&mut self, index: &Index);

    /// The live block `hash`, if any (`Index::locate`).
    fn locate(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Option<Found>;

    /// A REPORTed block: live already, or new.
    fn look(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Look;

    /// Gives live `hash` an entry at `offset` in its chunk (`chunks` as they are before the
    /// move); where it was.
    fn move_entry(
        &mut self,
        table: &BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc>;

    /// Rebuilds the table when `room` more entries would not fit (`Index::make_room`).
    fn make_room(&mut self, index: &mut Index, room: usize);
}

/// Probes the table and fills it: a plain change.
pub(super) struct Live;

impl Lookups for Live {
    const WARMS: bool = true;

    #[inline]
    fn begin(&mut self, _: &Index) {}

    #[inline]
    fn locate(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Option<Found> {
        match lookup(table, chunks, hash) {
            Lookup::Live(found) => Some(found),
            Lookup::Vacant(_) => None,
        }
    }

    #[inline]
    fn look(&mut self, table: &BlockTable, chunks: &[Chunk], hash: i64) -> Look {
        match lookup(table, chunks, hash) {
            Lookup::Live(found) => Look::Live(found),
            Lookup::Vacant(slot) => Look::New(Some(slot)),
        }
    }

    #[inline]
    fn move_entry(
        &mut self,
        table: &BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc> {
        let loc = self.locate(table, chunks, hash)?.loc();
        table.fill(table.vacant(hash), hash, Loc { offset, ..loc });
        Some(loc)
    }

    #[inline]
    fn make_room(&mut self, index: &mut Index, room: usize) {
        if let Some(spare) = index.table_for(room) {
            index
                .install_table(spare)
                .expect("a table built from this index just now");
        }
    }
}

/// Probes the table, fills it, and records what it found.
pub(super) struct Record<'a>(pub(super) &'a mut Effects);

impl Lookups for Record<'_> {
    const WARMS: bool = true;

    fn begin(&mut self, index: &Index) {
        self.0.push(Effect::Begin(index.changes, index.table.id()));
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
            Look::New(_) => Effect::New,
        });
        look
    }

    #[inline]
    fn move_entry(
        &mut self,
        table: &BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc> {
        let loc = Live
            .move_entry(table, chunks, hash, offset)
            .expect("a live block has an entry");
        self.0.push(Effect::Moved(loc));
        Some(loc)
    }

    fn make_room(&mut self, index: &mut Index, room: usize) {
        if let Some(spare) = index.table_for(room) {
            index
                .install_table_recording(spare, self.0)
                .expect("a table built from this index just now");
        }
    }
}

/// Takes what a [`Record`] recorded instead of probing, and fills nothing.
pub(super) struct Replay<'a>(pub(super) &'a mut Effects);

impl Lookups for Replay<'_> {
    const WARMS: bool = false;

    fn begin(&mut self, index: &Index) {
        match self.0.take() {
            Effect::Begin(changes, table) => {
                assert_eq!(
                    changes, index.changes,
                    "effects recorded on an index at another change"
                );
                assert_eq!(
                    table,
                    index.table.id(),
                    "effects recorded on an index with another table: not a twin"
                );
            }
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
        let look = match self.0.take() {
            Effect::Live(found) => Look::Live(found),
            Effect::New => Look::New(None),
            other => panic!("a new block replayed where {other:?} was recorded"),
        };
        #[cfg(debug_assertions)]
        match (&look, lookup(table, chunks, hash)) {
            (Look::Live(a), Lookup::Live(b)) => assert_eq!(*a, b, "replayed {hash}"),
            (Look::New(_), Lookup::Vacant(_)) => {}
            _ => panic!("replayed {hash}: another kind of lookup"),
        }
        let _ = (table, chunks, hash);
        look
    }

    #[inline]
    fn move_entry(
        &mut self,
        table: &BlockTable,
        chunks: &[Chunk],
        hash: i64,
        offset: u32,
    ) -> Option<Loc> {
        let Effect::Moved(loc) = self.0.take() else {
            panic!("an entry moved where it was not recorded");
        };
        debug_assert_eq!(Live.locate(table, chunks, hash).map(Found::loc), Some(loc));
        let _ = (table, chunks, hash, offset);
        Some(loc)
    }

    fn make_room(&mut self, index: &mut Index, room: usize) {
        if self.0.table_next() {
            let replaced = index.replay_table_effect(self.0.take(), Some(room));
            drop(replaced);
        }
    }
}

impl Index {
    /// [`Index::apply`], recording in `effects` what its table lookups found and any table it
    /// rebuilt, for [`Index::replay_apply`] onto its twin as it was (see [`Index::twin`]).
    pub fn apply_recording(&mut self, batch: &crate::ValidApply, effects: &mut Effects) {
        self.apply_with(batch, &mut Record(effects));
    }

    /// Applies `batch` to this index as [`Index::apply_recording`] did to its twin, taking its
    /// lookups from `effects` (the next entries, in the order recorded) instead of probing the
    /// table, which the twin filled. Panics if the record was made for another change, another
    /// index state or another table.
    pub fn replay_apply(&mut self, batch: &crate::ValidApply, effects: &mut Effects) {
        self.apply_with(batch, &mut Replay(effects));
    }

    /// [`Index::install_table`], recording the table in `effects`, for [`Index::replay_table`]
    /// onto its twin as it was.
    pub fn install_table_recording(
        &mut self,
        spare: SpareTable,
        effects: &mut Effects,
    ) -> Result<SpareTable, SpareTable> {
        let room = spare.room;
        let replaced = self.install_table(spare)?;
        effects.push(Effect::Table(Box::new(TableEffect {
            room,
            changes: self.changes,
            table: self.table.share(),
            entries: self.table.len(),
        })));
        effects.tables += 1;
        Ok(replaced)
    }

    /// Installs the table [`Index::install_table_recording`] recorded next in `effects` (the
    /// twin's, built from the same state); the table it replaced. Panics if the next entry is
    /// not one, or was recorded on an index at another count of changes.
    pub fn replay_table(&mut self, effects: &mut Effects) -> SpareTable {
        self.replay_table_effect(effects.take(), None)
    }

    /// Installs the table `effect` names (built with room for `room` entries when given, which
    /// it must match).
    fn replay_table_effect(&mut self, effect: Effect, room: Option<usize>) -> SpareTable {
        let Effect::Table(installed) = effect else {
            panic!("a table installed where {effect:?} was recorded");
        };
        let TableEffect {
            room: recorded,
            changes,
            table,
            ..
        } = *installed;
        assert_eq!(
            changes, self.changes,
            "a table rebuild recorded on an index at another change"
        );
        assert!(room.is_none_or(|room| room == recorded), "another rebuild");
        debug_assert!(
            !self.table.has_room(recorded),
            "an equal index rebuilds here"
        );
        SpareTable {
            table: std::mem::replace(&mut self.table, table),
            room: 0,
            built_from: None,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_entry_stays_small() {
        // One per block looked up on the apply path: a table is boxed so that it is not 40.
        assert!(std::mem::size_of::<super::Effect>() <= 24);
    }
}
