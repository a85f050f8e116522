//! The block hash table: block hash -> where the block is stored.
//!
//! Open addressing over 8-byte slots, eight to a 64-byte bucket aligned to a cache line. A slot
//! holds a fingerprint of the hash ([`FP_BITS`] bits of its mixed value, right below those that
//! choose its home bucket) and how far past its home bucket it sits, beside the chunk and offset
//! where the block is stored; the hash itself is the chunk's, at that offset. So a slot whose
//! fingerprint matches is only a candidate: the caller judges it against the chunks
//! ([`BlockTable::probe`]). A hash's probe starts at its home bucket's first slot and goes on
//! slot by slot (linear probing from a line boundary), so a lookup or an insert usually touches
//! that one line.
//!
//! A table that must grow is doubled from its own slots when it can ([`BlockTable::doubled`]):
//! a slot's home and its fingerprint's first bit give its home in the doubled table, so one
//! pass in bucket order re-homes nearly every entry without reading the chunks, at the price of
//! a fingerprint bit. Otherwise (a small table, one with many stale entries, or one whose
//! fingerprints are down to [`MIN_FP_BITS`]) a new one is filled from the live blocks.
//!
//! An entry is never changed or removed once filled, only left behind: the index deletes
//! lazily. An entry whose block died stays (stale) until a rebuild from the live blocks; one
//! whose block moved (a compaction, or a block that died and was stored again elsewhere) is
//! left where it was and a new entry points to where the block is now. An entry may
//! therefore lead to a hash that other entries lead to as well, but only one of them to where
//! the hash is live: a probe looks on until it finds that one ([`BlockTable::probe`]).
//!
//! That is what lets two copies of the index share one table (a left-right cell's: see
//! [`SharedTable`]): the writer fills vacant slots for the copy it changes while readers probe
//! the same slots for the copy they read, which is behind it. Every entry a reader's copy needs
//! was filled before that copy was published, and nothing overwrites it; entries filled since
//! lead, in the reader's copy, to another hash or to nothing, and a probe passes them. The
//! slots and the count are atomics, read and written `Relaxed` (plain loads and stores on x86;
//! the one filler adds to the count by a load and a store): the publication that hands a copy
//! to readers orders everything filled before it.

mod image;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Where a hash is stored: a chunk and a position in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) chunk: u32,
    pub(crate) offset: u32,
}

/// A slot: `fingerprint << 42 | displacement << 40 | (chunk + 1) << 12 | offset` (0 =
/// vacant). `displacement`: how many buckets past its home bucket the entry sits, up to
/// [`FAR`].
type Slot = u64;

/// Bits of a slot's fingerprint: the bits of the mixed hash right below its home bits. A false
/// match costs a read of the chunk it names.
const FP_BITS: u32 = 22;
/// A fingerprint's bits.
const FP_MASK: u64 = (1 << FP_BITS) - 1;
/// Bits of a slot's displacement.
const DISPLACEMENT_BITS: u32 = 2;
/// Where a slot's displacement starts.
const DISPLACEMENT_SHIFT: u32 = 64 - FP_BITS - DISPLACEMENT_BITS;
/// The displacement of an entry that far or farther from its home bucket (rare: see
/// [`BlockTable::doubled`]).
const FAR: usize = (1 << DISPLACEMENT_BITS) - 1;
/// The fewest fingerprint bits a table doubled from its slots may be left to judge by (each
/// doubling takes one for the home; see [`BlockTable::doubled`]): a probe of about eight slots
/// then reads a chunk for nothing once in about 500. Debug builds (the tests) go down to 6, so
/// that false matches happen all the time.
const MIN_FP_BITS: u32 = if cfg!(debug_assertions) { 6 } else { 12 };
/// The fewest buckets a table is doubled from its slots at (4 MB): a smaller one is filled
/// from the live blocks, which is quick, and gives its slots every fingerprint bit back, so
/// that doublings from its slots last it to 2^10 times the size. Debug builds (the tests)
/// double any table from its slots.
const DOUBLE_FROM: usize = if cfg!(debug_assertions) {
    MIN_BUCKETS
} else {
    1 << 16
};
/// Bits of a slot's offset: a chunk holds at most 4,096 positions.
const OFFSET_BITS: u32 = 12;
/// Bits of a slot's chunk number (plus one).
const CHUNK_BITS: u32 = DISPLACEMENT_SHIFT - OFFSET_BITS;
/// Chunks a table can name: 256 M, far past any index that fits in memory (at 8 bytes a slot
/// alone, the table of that many one-block chunks would be over 2 GB, and each chunk takes
/// 100 bytes or more). Past it, an apply panics and the process aborts rather than serve a
/// half-applied index; an image naming more is refused.
pub(crate) const MAX_CHUNKS: u32 = (1 << CHUNK_BITS) - 1;

/// Slots per bucket: one cache line.
const LANES: usize = 8;

/// One cache line of slots.
#[repr(C, align(64))]
#[derive(Debug, Default)]
struct Bucket([AtomicU64; LANES]);

impl Bucket {
    fn slot(&self, lane: usize) -> Slot {
        self.0[lane].load(Relaxed)
    }

    fn slots(&self) -> impl Iterator<Item = Slot> + '_ {
        self.0.iter().map(|slot| slot.load(Relaxed))
    }

    /// Starts loading this bucket into the cache: a prefetch, or where there is none, a load
    /// whose value nothing waits for.
    fn prefetch(&self) {
        if crate::memory::PREFETCHES {
            crate::memory::prefetch(self);
        } else {
            std::hint::black_box(self.slot(0));
        }
    }

    fn of(slots: [Slot; LANES]) -> Bucket {
        Bucket(slots.map(AtomicU64::new))
    }
}

/// `hash` mixed: its top bits choose its home bucket, the next ones are its fingerprint.
fn mixed(hash: i64) -> u64 {
    (hash as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `hash`'s fingerprint in a table whose home buckets take its mixed value's top `64 - shift`
/// bits: the [`FP_BITS`] below those.
fn fingerprint(hash: i64, shift: u32) -> u64 {
    mixed(hash).checked_shl(64 - shift).unwrap_or(0) >> (64 - FP_BITS)
}

fn pack(fp: u64, loc: Loc) -> Slot {
    assert!(
        loc.chunk < MAX_CHUNKS,
        "chunk {} past the table's reach",
        loc.chunk
    );
    debug_assert!(loc.offset < 1 << OFFSET_BITS);
    (fp << (64 - FP_BITS)) | (u64::from(loc.chunk + 1) << OFFSET_BITS) | u64::from(loc.offset)
}

fn slot_fp(slot: Slot) -> u64 {
    slot >> (64 - FP_BITS)
}

/// `slot` naming `loc` instead, its fingerprint and displacement kept.
fn relocated(slot: Slot, loc: Loc) -> Slot {
    (slot & (!0 << DISPLACEMENT_SHIFT)) | pack(0, loc)
}

fn displacement(slot: Slot) -> usize {
    (slot >> DISPLACEMENT_SHIFT) as usize & FAR
}

/// The displacement of an entry in bucket `at` whose home is `home`, in a table of `mask + 1`
/// buckets: how many buckets past home it sits (wrapping around), up to [`FAR`].
fn distance(home: usize, at: usize, mask: usize) -> usize {
    (at.wrapping_sub(home) & mask).min(FAR)
}

/// `slot` with the displacement of sitting in bucket `at` when its home is `home`.
fn displaced(slot: Slot, home: usize, at: usize, mask: usize) -> Slot {
    slot | (distance(home, at, mask) as u64) << DISPLACEMENT_SHIFT
}

/// The chunk number plus one (0: vacant).
fn slot_chunk(slot: Slot) -> u64 {
    (slot >> OFFSET_BITS) & ((1 << CHUNK_BITS) - 1)
}

fn unpack(slot: Slot) -> Loc {
    Loc {
        chunk: slot_chunk(slot) as u32 - 1,
        offset: (slot & ((1 << OFFSET_BITS) - 1)) as u32,
    }
}

/// How many entries ahead of its insert a rebuild prefetches an entry's home bucket (see
/// [`BlockTable::filled`]): 32 was 5 % faster than 16 or 64 at 5 M entries.
const FILL_AHEAD: usize = 32;

/// Whether `entries` in `buckets` would load the table past 4/5, its most.
fn over_max_load(entries: usize, buckets: usize) -> bool {
    entries * 5 > buckets * LANES * 4
}

/// The smallest non-empty table, in buckets.
const MIN_BUCKETS: usize = 4;

/// The fewest buckets, `at_least` or that doubled (and never under [`MIN_BUCKETS`]), that hold
/// `entries` within the load limit.
fn buckets_for(entries: usize, at_least: usize) -> usize {
    let mut buckets = at_least.max(MIN_BUCKETS);
    while over_max_load(entries, buckets) {
        buckets *= 2;
    }
    buckets
}

/// What [`BlockTable::probe`] found: where the hash is live, or the vacant slot where its
/// entry would go (a slot is `bucket * LANES + lane`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Probe {
    Found(Loc),
    Vacant(usize),
}

#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    /// A power of two in length, or empty.
    buckets: Box<[Bucket]>,
    len: AtomicUsize,
    /// `64 - log2(buckets.len())`.
    shift: u32,
    /// Low fingerprint bits that slots filled before the table was last doubled from its slots
    /// do not hold (one per such doubling: see [`BlockTable::doubled`]); no probe judges by
    /// them.
    fp_drop: u32,
}

/// A copy of the slots, counted as copied (a fill beside it cannot make the count disagree).
impl Clone for BlockTable {
    fn clone(&self) -> BlockTable {
        let buckets: Box<[Bucket]> = self
            .buckets
            .iter()
            .map(|bucket| Bucket(std::array::from_fn(|lane| bucket.slot(lane).into())))
            .collect();
        let len = buckets
            .iter()
            .flat_map(Bucket::slots)
            .filter(|&s| s != 0)
            .count();
        BlockTable {
            buckets,
            len: len.into(),
            shift: self.shift,
            fp_drop: self.fp_drop,
        }
    }
}

/// An index's block table, which it may share with a twin ([`SharedTable::share`]): the two
/// copies of a left-right cell, of which only the first fills it (the other replays what the
/// first found: `Index::replay_apply`). Cloned, it is copied: an index cloned for any other
/// use fills its own.
#[derive(Default)]
pub(crate) struct SharedTable(Arc<BlockTable>);

/// Which table and how full, not its slots (a recorded table may be hundreds of MB).
impl std::fmt::Debug for SharedTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTable")
            .field("id", &self.id())
            .field("buckets", &self.buckets.len())
            .field("len", &self.len())
            .finish()
    }
}

impl Clone for SharedTable {
    fn clone(&self) -> SharedTable {
        SharedTable(Arc::new(BlockTable::clone(&self.0)))
    }
}

impl std::ops::Deref for SharedTable {
    type Target = BlockTable;

    fn deref(&self) -> &BlockTable {
        &self.0
    }
}

impl SharedTable {
    pub(crate) fn new(table: BlockTable) -> SharedTable {
        SharedTable(Arc::new(table))
    }

    /// The same table, for a twin.
    pub(crate) fn share(&self) -> SharedTable {
        SharedTable(Arc::clone(&self.0))
    }

    /// This very table, among those alive (its address): a twin's is the same.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }
}

impl BlockTable {
    /// Entries held (live, stale or garbage).
    pub(crate) fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Whether one more entry needs a [`BlockTable::replacement`]: the load stays at most 4/5.
    pub(crate) fn is_full(&self) -> bool {
        !self.has_room(1)
    }

    /// Whether `more` entries fit without a bigger table.
    pub(crate) fn has_room(&self, more: usize) -> bool {
        !over_max_load(self.len() + more, self.buckets.len())
    }

    /// `hash`'s home bucket.
    fn home(&self, hash: i64) -> usize {
        (mixed(hash) >> self.shift) as usize
    }

    /// `hash`'s fingerprint in this table.
    fn fingerprint(&self, hash: i64) -> u64 {
        fingerprint(hash, self.shift)
    }

    /// Whether `slot` may be the entry of a hash with fingerprint `fp`.
    #[inline]
    fn matches(&self, slot: Slot, fp: u64) -> bool {
        (slot_fp(slot) ^ fp) >> self.fp_drop == 0
    }

    /// Starts loading `hash`'s home bucket into the cache, without waiting for it, so that
    /// many of them (see `Index::warm_ahead`) miss the cache at once.
    pub(crate) fn prefetch(&self, hash: i64) {
        if let Some(bucket) = self.buckets.get(self.home(hash)) {
            bucket.prefetch();
        }
    }

    /// Looks `hash` up, asking `live` of each entry with its fingerprint whether the hash is
    /// live where it leads, up to the first vacant slot: the first such entry, else that
    /// vacant slot. With an empty table, reports slot 0 as vacant: replace it
    /// ([`BlockTable::replacement`]) before filling one.
    #[inline]
    pub(crate) fn probe(&self, hash: i64, mut live: impl FnMut(Loc) -> bool) -> Probe {
        if self.buckets.is_empty() {
            return Probe::Vacant(0);
        }
        let mask = self.buckets.len() - 1;
        let fp = self.fingerprint(hash);
        let mut b = self.home(hash);
        loop {
            for (lane, slot) in self.buckets[b].slots().enumerate() {
                if slot == 0 {
                    return Probe::Vacant(b * LANES + lane);
                }
                if self.matches(slot, fp) && live(unpack(slot)) {
                    return Probe::Found(unpack(slot));
                }
            }
            b = (b + 1) & mask;
        }
    }

    /// Checks (for `Index::check_invariants`) that the entry of `hash` leading to `loc` is
    /// there and says how far from home it sits, which a doubling relies on.
    pub(crate) fn check_displacement(&self, hash: i64, loc: Loc) {
        let mask = self.buckets.len() - 1;
        let (home, fp) = (self.home(hash), self.fingerprint(hash));
        let mut b = home;
        loop {
            for slot in self.buckets[b].slots() {
                assert_ne!(slot, 0, "no entry of {hash} leads to {loc:?}");
                if self.matches(slot, fp) && unpack(slot) == loc {
                    let far = distance(home, b, mask);
                    assert_eq!(displacement(slot), far, "displacement of {hash}'s entry");
                    return;
                }
            }
            b = (b + 1) & mask;
        }
    }

    /// The vacant slot where a new entry for `hash` goes (past any it has already).
    pub(crate) fn vacant(&self, hash: i64) -> usize {
        match self.probe(hash, |_| false) {
            Probe::Vacant(slot) => slot,
            Probe::Found(_) => unreachable!("no entry is judged live"),
        }
    }

    /// Fills the vacant slot that [`BlockTable::probe`] or [`BlockTable::vacant`] gave for
    /// `hash` (with no fill in between, and not when it is full). Only one thread fills a
    /// table; others may probe it meanwhile.
    pub(crate) fn fill(&self, slot: usize, hash: i64, loc: Loc) {
        debug_assert!(!self.is_full());
        let mask = self.buckets.len() - 1;
        let value = pack(self.fingerprint(hash), loc);
        let value = displaced(value, self.home(hash), slot / LANES, mask);
        let slot = &self.buckets[slot / LANES].0[slot % LANES];
        debug_assert_eq!(slot.load(Relaxed), 0);
        slot.store(value, Relaxed);
        // One thread fills: a load and a store, no locked add.
        self.len.store(self.len() + 1, Relaxed);
    }

    /// A table of `entries` (each hash once, `len` of them) with as few buckets as a grown
    /// table could have for them: at most 4/5 full, room for one more.
    pub(crate) fn with_entries(
        len: usize,
        entries: impl Iterator<Item = (i64, Loc)>,
    ) -> BlockTable {
        if len == 0 {
            return BlockTable::default();
        }
        BlockTable::filled(buckets_for(len + 1, MIN_BUCKETS), len, entries)
    }

    /// Where the buckets are in memory (addresses), for a process that forks: see
    /// [`crate::Index::table_memory`].
    pub(crate) fn memory(&self) -> std::ops::Range<usize> {
        let start = self.buckets.as_ptr() as usize;
        start..start + std::mem::size_of_val(&*self.buckets)
    }

    /// A table to replace this one, holding the live `entries` (each hash once, `len` of them)
    /// with room for `more` beyond them: this table's size if that leaves the room, else as
    /// many times doubled as it takes. Built from `&self`, so that a caller can build it beside
    /// readers and swap it in (see `Index::table_for`). Where doubling once is enough and few
    /// of its entries are stale, it is doubled from its own slots ([`BlockTable::doubled`],
    /// which asks `live_hash` for the hash live at an entry's location, if any), else filled
    /// with `entries`.
    pub(crate) fn replacement(
        &self,
        len: usize,
        more: usize,
        entries: impl Iterator<Item = (i64, Loc)>,
        live_hash: impl FnMut(Loc) -> Option<i64>,
    ) -> BlockTable {
        let buckets = buckets_for(len + more, self.buckets.len());
        if self.doubles_into(buckets, len, more) {
            return self.doubled(live_hash);
        }
        BlockTable::filled(buckets, len, entries)
    }

    /// Whether a table of `buckets` for `live` entries and `more` can be this one doubled from
    /// its slots: twice its size, with room for `more` beside the stale entries it carries
    /// over, which are at most an eighth of its entries, and fingerprint bits to spare.
    fn doubles_into(&self, buckets: usize, live: usize, more: usize) -> bool {
        let stale = self.len().saturating_sub(live);
        self.buckets.len() >= DOUBLE_FROM
            && buckets == 2 * self.buckets.len()
            && stale * 8 <= self.len()
            && FP_BITS - self.fp_drop > MIN_FP_BITS
            && !over_max_load(self.len() + more, buckets)
    }

    /// This table doubled from its own slots, in one pass in bucket order that reads no chunk
    /// for nearly all of them. An entry's home bucket `h` is where it sits less its
    /// displacement; in the doubled table it is `2h` or `2h + 1`, as its fingerprint's first
    /// bit says (the next bit of the mixed hash), and the fingerprint shifts up by that bit, so
    /// the new table's slots hold one bit fewer (`fp_drop`). Inserted in this order, the
    /// entries land near one another, so the new table is written almost in order. An entry
    /// [`FAR`] or farther from home (rare) cannot tell its home: it is re-homed from the hash
    /// `live_hash` gives for its location, and dropped when none is live there or that hash
    /// is not the entry's. Stale entries elsewhere are carried over.
    fn doubled(&self, mut live_hash: impl FnMut(Loc) -> Option<i64>) -> BlockTable {
        let mut table = BlockTable::empty(self.buckets.len() * 2);
        table.fp_drop = self.fp_drop + 1;
        let mask = self.buckets.len() - 1;
        let mut far = Vec::new();
        for (b, bucket) in self.buckets.iter().enumerate() {
            for slot in bucket.slots().take_while(|&slot| slot != 0) {
                let loc = unpack(slot);
                match displacement(slot) {
                    FAR => {
                        if let Some(hash) = live_hash(loc)
                            && self.matches(slot, self.fingerprint(hash))
                        {
                            far.push((hash, loc));
                        }
                    }
                    d => {
                        let fp = slot_fp(slot);
                        let home = 2 * (b.wrapping_sub(d) & mask) + (fp >> (FP_BITS - 1)) as usize;
                        table.insert_at(home, pack(fp << 1 & FP_MASK, loc));
                    }
                }
            }
        }
        for (hash, loc) in far {
            table.insert_at(table.home(hash), pack(table.fingerprint(hash), loc));
        }
        table
    }

    /// `buckets` vacant buckets.
    fn empty(buckets: usize) -> BlockTable {
        debug_assert!(buckets.is_power_of_two());
        // Mapped at once and written out in order, not left to fault in at random during the
        // inserts (twice each, lazily zeroed: a probe's read maps the zero page, the insert's
        // write copies it). Allocated zeroed and mapped, the write could go (about 14 ms per
        // 128 MB), but std zeroes an allocation aligned to 64 bytes by writing it anyway.
        let mut new = crate::memory::mapped_for_writing(buckets);
        new.extend((0..buckets).map(|_| Bucket::default()));
        let new = new.into_boxed_slice();
        BlockTable {
            buckets: new,
            len: 0.into(),
            shift: 64 - buckets.trailing_zeros(),
            fp_drop: 0,
        }
    }

    /// A table of `buckets` buckets holding `entries` (each hash once, `len` of them).
    fn filled(buckets: usize, len: usize, entries: impl Iterator<Item = (i64, Loc)>) -> BlockTable {
        debug_assert!(!over_max_load(len, buckets));
        let mut table = BlockTable::empty(buckets);
        // Each entry's home bucket is prefetched [`FILL_AHEAD`] entries before its insert, so
        // that the cache misses of that many overlap all through the fill. Entries are
        // inserted in the order given: the layout is that of inserting them one by one.
        let mut ahead = [(0, 0); FILL_AHEAD];
        let mut taken = 0;
        for (hash, loc) in entries {
            let home = table.home(hash);
            table.buckets[home].prefetch();
            let next = std::mem::replace(
                &mut ahead[taken % FILL_AHEAD],
                (home, pack(table.fingerprint(hash), loc)),
            );
            if taken >= FILL_AHEAD {
                table.insert_filling(next, len);
            }
            taken += 1;
        }
        for n in taken.saturating_sub(FILL_AHEAD)..taken {
            table.insert_filling(ahead[n % FILL_AHEAD], len);
        }
        debug_assert_eq!(table.len(), len, "entries counted");
        table
    }

    /// [`BlockTable::insert_at`] for a fill of `len` entries, which must not overflow it.
    fn insert_filling(&mut self, (home, slot): (usize, Slot), len: usize) {
        assert!(!self.is_full(), "more entries than the {len} counted");
        self.insert_at(home, slot);
    }

    /// Puts `slot` (with no displacement) into the first vacant slot from bucket `home` on,
    /// with its displacement there.
    fn insert_at(&mut self, home: usize, slot: Slot) {
        let mask = self.buckets.len() - 1;
        let mut b = home;
        loop {
            if let Some(vacant) = self.buckets[b].0.iter_mut().find(|s| s.load(Relaxed) == 0) {
                *vacant.get_mut() = displaced(slot, home, b, mask);
                *self.len.get_mut() += 1;
                return;
            }
            b = (b + 1) & mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::image_io::ImageInput;

    /// What the chunks would say: the hash stored at each location (all live).
    type Stored = HashMap<(u32, u32), i64>;

    fn judge(stored: &Stored, hash: i64) -> impl Fn(Loc) -> bool + '_ {
        move |loc| stored.get(&(loc.chunk, loc.offset)) == Some(&hash)
    }

    fn get(table: &BlockTable, stored: &Stored, hash: i64) -> Option<Loc> {
        match table.probe(hash, judge(stored, hash)) {
            Probe::Found(loc) => Some(loc),
            Probe::Vacant(_) => None,
        }
    }

    /// Points `hash` at `loc` with a new entry (the table rebuilt from what is stored first
    /// when full), leaving any old one behind, as the index does.
    fn insert(table: &mut BlockTable, stored: &mut Stored, hash: i64, loc: Loc) {
        if table.is_full() {
            let entries = stored
                .iter()
                .map(|(&(chunk, offset), &hash)| (hash, Loc { chunk, offset }));
            *table = table.replacement(stored.len(), 1, entries, |loc| {
                stored.get(&(loc.chunk, loc.offset)).copied()
            });
        }
        if let Some(old) = get(table, stored, hash) {
            stored.remove(&(old.chunk, old.offset));
        }
        stored.insert((loc.chunk, loc.offset), hash);
        table.fill(table.vacant(hash), hash, loc);
    }

    proptest! {
        /// Inserts, moves and purges agree with a map, across growth (one entry at a time,
        /// or room for many at once) and across hashes that share home buckets and
        /// fingerprints (few distinct values, many collisions).
        #[test]
        fn agrees_with_a_map(
            ops in prop::collection::vec((0i64..64, 0u32..1000, any::<bool>()), 1..400),
            spread in prop::sample::select(vec![1i64, 1 << 58, 0x9E37_79B9, 1 << 63]),
        ) {
            let mut table = BlockTable::default();
            let mut stored = Stored::new();
            let mut model = HashMap::new();
            for (i, &(key, value, retain)) in ops.iter().enumerate() {
                let hash = key.wrapping_mul(spread);
                let loc = Loc { chunk: value, offset: i as u32 % 4096 };
                if stored.contains_key(&(loc.chunk, loc.offset)) {
                    continue;
                }
                insert(&mut table, &mut stored, hash, loc);
                model.insert(hash, loc);
                if retain && i % 7 == 0 {
                    let keep = |hash: i64, loc: Loc| (hash ^ i64::from(loc.chunk)) % 3 != 0;
                    model.retain(|&hash, &mut loc| keep(hash, loc));
                    stored.retain(|_, hash| model.contains_key(hash));
                    let more = value as usize % 50;
                    let kept = model.iter().map(|(&hash, &loc)| (hash, loc));
                    let live_hash = |loc: Loc| stored.get(&(loc.chunk, loc.offset)).copied();
                    table = table.replacement(model.len(), more, kept, live_hash);
                    prop_assert!(table.has_room(more));
                }
                // Moved hashes leave their old entries behind until a rebuild.
                prop_assert!(table.len() >= model.len());
            }
            // Its image reads back slot for slot (chunks up to 1000 named).
            let mut image = Vec::new();
            table.write_image(1000, &mut image, &mut Vec::new()).unwrap();
            let mut input = ImageInput::new(&image[..], image.len() as u64);
            let read = BlockTable::read_image(&mut input, 1000).unwrap();
            prop_assert_eq!(input.offset(), image.len() as u64);
            prop_assert_eq!(read.len(), table.len());
            prop_assert_eq!(read.shift, table.shift);
            prop_assert_eq!(read.fp_drop, table.fp_drop);
            let slots = |table: &BlockTable| -> Vec<Slot> {
                table.buckets.iter().flat_map(Bucket::slots).collect()
            };
            prop_assert_eq!(slots(&read), slots(&table));
            prop_assert_eq!(read.buckets.len(), table.buckets.len());
            for key in 0i64..64 {
                let hash = key.wrapping_mul(spread);
                prop_assert_eq!(get(&table, &stored, hash), model.get(&hash).copied());
                prop_assert_eq!(get(&read, &stored, hash), model.get(&hash).copied());
            }
        }
    }

    #[test]
    fn a_full_bucket_spills_into_the_next() {
        let mut table = BlockTable::default().replacement(0, 1, std::iter::empty(), |_| None);
        let mut stored = Stored::new();
        // Hashes with one home bucket: the multiplier's top bits decide it, so look for them.
        let home = table.home(1);
        let same: Vec<i64> = (1i64..)
            .filter(|&h| table.home(h) == home)
            .take(LANES + 2)
            .collect();
        let loc = |i: usize| Loc {
            chunk: 0,
            offset: i as u32,
        };
        for (i, &hash) in same.iter().enumerate() {
            insert(&mut table, &mut stored, hash, loc(i));
        }
        for (i, &hash) in same.iter().enumerate() {
            assert_eq!(get(&table, &stored, hash), Some(loc(i)));
        }
        assert_eq!(get(&table, &stored, 0), None);
    }

    /// Entries of one hash that lead elsewhere are passed until the one that leads to where
    /// it lives; a new entry goes past all of them.
    #[test]
    fn a_probe_finds_the_live_entry_past_old_ones() {
        let table = BlockTable::default().replacement(0, 1, std::iter::empty(), |_| None);
        let hash = 77;
        let loc = |offset| Loc { chunk: 3, offset };
        for offset in 0..3 {
            table.fill(table.vacant(hash), hash, loc(offset));
        }
        let live = |live: u32| move |at: Loc| at.offset == live;
        assert!(matches!(table.probe(hash, live(2)), Probe::Found(l) if l == loc(2)));
        assert!(matches!(table.probe(hash, live(0)), Probe::Found(l) if l == loc(0)));
        let Probe::Vacant(slot) = table.probe(hash, live(9)) else {
            panic!("not live anywhere");
        };
        assert_eq!(slot, table.vacant(hash));
        assert_eq!(table.len(), 3);
    }

    /// Every entry is found again across the rebuilds that grow the table.
    /// A fill lays entries out as inserting them one by one in the given order would (images
    /// and twins depend on it), whether it holds fewer entries than it prefetches ahead, as
    /// many, or more; the hashes crowd a few home buckets so that probes run on.
    #[test]
    fn a_fill_lays_entries_out_as_inserts_in_order_would() {
        for n in [0, 1, FILL_AHEAD - 1, FILL_AHEAD, FILL_AHEAD + 1, 100] {
            let buckets = buckets_for(n, MIN_BUCKETS);
            let entries: Vec<(i64, Loc)> = (0..n)
                .map(|i| {
                    // Homes in the first quarter of the table only.
                    let hash = (i as i64 % 7) << 61 | i as i64;
                    let loc = Loc {
                        chunk: i as u32 / 16,
                        offset: i as u32 % 16,
                    };
                    (hash, loc)
                })
                .collect();
            let filled = BlockTable::filled(buckets, n, entries.iter().copied());
            let mut one_by_one = BlockTable::empty(buckets);
            for &(hash, loc) in &entries {
                one_by_one.insert_at(
                    one_by_one.home(hash),
                    pack(one_by_one.fingerprint(hash), loc),
                );
            }
            let slots = |table: &BlockTable| -> Vec<Slot> {
                table.buckets.iter().flat_map(Bucket::slots).collect()
            };
            assert_eq!(slots(&filled), slots(&one_by_one), "{n} entries");
            assert_eq!(filled.len(), n);
        }
    }

    /// Doubled from its slots, a table finds every live entry where a filled one would, with
    /// one fingerprint bit fewer each time. Hashes crowd two home buckets, one of them the
    /// last (its overflow wraps around to the first), so that entries sit near home and
    /// [`FAR`] from it. Moved hashes leave stale entries: those near home are carried over,
    /// those far from home are dropped, whether nothing is live at their location or another
    /// hash is. Past the fingerprint bits it may spend, the table is filled from the live
    /// blocks again. (Release builds double only big tables.)
    #[cfg(debug_assertions)]
    #[test]
    fn a_table_doubles_from_its_slots() {
        let mut table = BlockTable::default().replacement(0, 60, std::iter::empty(), |_| None);
        assert_eq!(table.buckets.len(), 16);
        let mut stored = Stored::new();
        let at_home = |home: usize, n: usize| -> Vec<i64> {
            (1i64..)
                .filter(|&h| table.home(h) == home)
                .take(n)
                .collect()
        };
        // 10 at home in the last bucket, inserted first, then 34 at home in the first.
        let hashes: Vec<i64> = [at_home(15, 10), at_home(0, 34)].concat();
        for (i, &hash) in hashes.iter().enumerate() {
            table.fill(
                table.vacant(hash),
                hash,
                Loc {
                    chunk: 1,
                    offset: i as u32,
                },
            );
            stored.insert((1, i as u32), hash);
        }
        let far = |table: &BlockTable| -> usize {
            let slots = table.buckets.iter().flat_map(Bucket::slots);
            slots.filter(|&s| s != 0 && displacement(s) == FAR).count()
        };
        assert!(far(&table) > 0);
        // Five move; two of them leave entries far from home, and another hash takes the
        // location of one of those.
        for i in [0, 12, 20, 34, 42] {
            let moved = Loc {
                chunk: 2,
                offset: i,
            };
            let hash = stored.remove(&(1, i)).unwrap();
            stored.insert((2, i), hash);
            table.fill(table.vacant(hash), hash, moved);
        }
        let other = (1i64 << 40..).find(|h| !hashes.contains(h)).unwrap();
        table.fill(
            table.vacant(other),
            other,
            Loc {
                chunk: 1,
                offset: 34,
            },
        );
        stored.insert((1, 34), other);
        let live_hash = |loc: Loc| stored.get(&(loc.chunk, loc.offset)).copied();
        for doublings in 1..=FP_BITS - MIN_FP_BITS {
            let live = stored.len();
            let room = table.buckets.len() * LANES * 4 / 5 + 1 - live;
            let before = table.len();
            table = table.replacement(live, room, std::iter::empty(), live_hash);
            assert_eq!(table.fp_drop, doublings);
            if doublings == 1 {
                assert_eq!(
                    table.len(),
                    before - 2,
                    "two stale entries far from home dropped"
                );
            }
            for (&(chunk, offset), &hash) in &stored {
                assert_eq!(get(&table, &stored, hash), Some(Loc { chunk, offset }));
                table.check_displacement(hash, Loc { chunk, offset });
            }
        }
        let entries = stored
            .iter()
            .map(|(&(chunk, offset), &hash)| (hash, Loc { chunk, offset }));
        let room = table.buckets.len() * LANES * 4 / 5 + 1 - stored.len();
        let filled = table.replacement(stored.len(), room, entries, live_hash);
        assert_eq!((filled.fp_drop, filled.len()), (0, stored.len()));
    }

    #[test]
    fn growth_keeps_every_entry() {
        let mut table = BlockTable::default();
        let mut stored = Stored::new();
        let hashes: Vec<i64> = (0..5000i64)
            .map(|i| i.wrapping_mul(0x5851_F42D_4C95_7F2D))
            .collect();
        for (i, &hash) in hashes.iter().enumerate() {
            let at = Loc {
                chunk: i as u32 / 4096,
                offset: i as u32 % 4096,
            };
            insert(&mut table, &mut stored, hash, at);
        }
        for (i, &hash) in hashes.iter().enumerate() {
            let at = Loc {
                chunk: i as u32 / 4096,
                offset: i as u32 % 4096,
            };
            assert_eq!(get(&table, &stored, hash), Some(at));
        }
    }
}
