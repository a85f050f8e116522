//! The block hash table: block hash -> where the block is stored.
//!
//! Open addressing over 8-byte slots, eight to a 64-byte bucket aligned to a cache line. A slot
//! holds a fingerprint of the hash ([`FP_BITS`] bits of its mixed value, below those that
//! choose its home bucket) beside the chunk and offset where the block is stored; the hash
//! itself is the chunk's, at that offset. So a slot whose fingerprint matches is only a
//! candidate: the caller judges it against the chunks ([`BlockTable::probe`]). A table is never
//! re-homed from its slots (they do not hold the hashes): a bigger one is built from the live
//! blocks. A hash's probe starts at its home bucket's first slot and goes on slot by slot (linear probing from a line
//! boundary), so a lookup or an insert usually touches that one line.
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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crate::image_io::{ImageError, ImageInput, put_all, put_u64};

/// Where a hash is stored: a chunk and a position in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) chunk: u32,
    pub(crate) offset: u32,
}

/// A slot: `fingerprint << 42 | (chunk + 1) << 12 | offset` (0 = vacant).
type Slot = u64;

/// Bits of a slot's fingerprint: a false match costs a read of the chunk it names.
const FP_BITS: u32 = 22;
/// Where the fingerprint's bits start in the mixed value: below the home bits of any table of
/// up to 2^20 buckets (8 M slots), so that entries sharing a bucket rarely share it.
const FP_SHIFT: u32 = 64 - 20 - FP_BITS;
/// Bits of a slot's offset: a chunk holds at most 4,096 positions.
const OFFSET_BITS: u32 = 12;
/// Bits of a slot's chunk number (plus one).
const CHUNK_BITS: u32 = 64 - FP_BITS - OFFSET_BITS;
/// Chunks a table can name: 1 G, far past any index that fits in memory (at 8 bytes a slot
/// alone, the table of that many one-block chunks would be over 8 GB). Past it, an apply panics
/// and the process aborts rather than serve a half-applied index.
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

/// `hash`'s fingerprint.
fn fingerprint(hash: i64) -> u64 {
    (mixed(hash) >> FP_SHIFT) & ((1 << FP_BITS) - 1)
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

/// Buckets per run of the image (see [`BlockTable::write_image`]).
const IMAGE_RUN: usize = 1 << 12;

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
        let fp = fingerprint(hash);
        let mut b = self.home(hash);
        loop {
            for (lane, slot) in self.buckets[b].slots().enumerate() {
                if slot == 0 {
                    return Probe::Vacant(b * LANES + lane);
                }
                if slot_fp(slot) == fp && live(unpack(slot)) {
                    return Probe::Found(unpack(slot));
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
        let slot = &self.buckets[slot / LANES].0[slot % LANES];
        debug_assert_eq!(slot.load(Relaxed), 0);
        slot.store(pack(fingerprint(hash), loc), Relaxed);
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

    /// A table to replace this one, holding `entries` (each hash once, `len` of them) with room
    /// for `more` beyond them: this table's size if that leaves the room, else as many times
    /// doubled as it takes. Built from `&self`, so that a caller can build it beside readers
    /// and swap it in (see `Index::table_for`).
    pub(crate) fn replacement(
        &self,
        len: usize,
        more: usize,
        entries: impl Iterator<Item = (i64, Loc)>,
    ) -> BlockTable {
        BlockTable::filled(buckets_for(len + more, self.buckets.len()), len, entries)
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
                (home, pack(fingerprint(hash), loc)),
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

    /// Puts `slot` into the first vacant slot from bucket `home` on.
    fn insert_at(&mut self, home: usize, slot: Slot) {
        let mask = self.buckets.len() - 1;
        let mut b = home;
        loop {
            if let Some(vacant) = self.buckets[b].0.iter_mut().find(|s| s.load(Relaxed) == 0) {
                *vacant.get_mut() = slot;
                *self.len.get_mut() += 1;
                return;
            }
            b = (b + 1) & mask;
        }
    }

    /// Writes the table as its image, for an index of `chunks` chunks: the bucket and entry
    /// counts, then per run of [`IMAGE_RUN`] buckets each bucket's occupied slot count (a byte)
    /// and those slots. With no removal, a bucket's occupied slots are always its first ones (a
    /// probe fills the first vacant slot it meets), so the counts say where every slot goes and
    /// vacant ones take no room. An entry naming a chunk past `chunks` was filled by a twin
    /// that is ahead (see [`SharedTable`]): it is written naming chunk 0's first position,
    /// garbage that keeps its slot occupied, so that probes still pass it. Nothing may fill the
    /// table meanwhile (a forked child's copy, or its writer's thread between changes).
    pub(crate) fn write_image(
        &self,
        chunks: usize,
        out: &mut impl std::io::Write,
        scratch: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        if chunks == 0 {
            // Nothing is live, so every entry is garbage: an empty table.
            return BlockTable::default().write_image(1, out, scratch);
        }
        put_u64(out, self.buckets.len() as u64)?;
        put_u64(out, self.len() as u64)?;
        let own = |slot: Slot| match slot_chunk(slot) {
            c if c <= chunks as u64 => slot,
            _ => pack(
                slot_fp(slot),
                Loc {
                    chunk: 0,
                    offset: 0,
                },
            ),
        };
        let mut slots: Vec<Slot> = Vec::with_capacity(IMAGE_RUN * LANES);
        for run in self.buckets.chunks(IMAGE_RUN) {
            slots.clear();
            let counts: Vec<u8> = run
                .iter()
                .map(|bucket| {
                    let occupied = bucket.slots().take_while(|&slot| slot != 0).map(own);
                    let before = slots.len();
                    slots.extend(occupied);
                    (slots.len() - before) as u8
                })
                .collect();
            out.write_all(&counts)?;
            put_all(out, scratch, &slots, |slot| slot.to_le_bytes())?;
        }
        Ok(())
    }

    /// Reads what [`BlockTable::write_image`] wrote, for an index of `chunks` chunks: every
    /// entry must name one of them, and the entry count must be right.
    pub(crate) fn read_image(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
    ) -> Result<BlockTable, ImageError> {
        let (buckets, len) = read_sizes(input)?;
        // Allocated as the runs arrive: a damaged count must fail on the bytes, not abort on a
        // reservation 64 times the file.
        let mut read: Vec<Bucket> = Vec::with_capacity(buckets.min(IMAGE_RUN));
        let mut total_read = 0;
        let mut bad = None;
        let mut left = buckets;
        while left > 0 {
            let counts = read_counts(input, left.min(IMAGE_RUN), LANES)?;
            let total = counts.iter().map(|&c| usize::from(c)).sum();
            let slots = input.all(total, u64::from_le_bytes)?;
            let mut slots = slots.into_iter();
            for &count in &counts {
                let mut bucket = [0; LANES];
                for slot in &mut bucket[..usize::from(count)] {
                    *slot = slots.next().expect("counted");
                    let chunk = slot_chunk(*slot);
                    if chunk == 0 || chunk > chunks as u64 {
                        bad.get_or_insert(chunk);
                    }
                }
                read.push(Bucket::of(bucket));
            }
            total_read += total;
            left -= counts.len();
        }
        check_read(bad, chunks, total_read, len, buckets)?;
        Ok(BlockTable {
            buckets: read.into_boxed_slice(),
            len: total_read.into(),
            shift: 64 - buckets.max(1).trailing_zeros(),
        })
    }

    /// Reads a table image of snapshot format 3 (16-byte slots, four to a bucket, the whole
    /// hash in each) into this layout: the same entries, re-homed.
    pub(crate) fn read_image_wide(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
    ) -> Result<BlockTable, ImageError> {
        const WIDE_LANES: usize = 4;
        let (buckets, len) = read_sizes(input)?;
        let mut entries = Vec::with_capacity(len.min(1 << 20));
        let mut bad = None;
        let mut left = buckets;
        while left > 0 {
            let counts = read_counts(input, left.min(IMAGE_RUN), WIDE_LANES)?;
            let total = counts.iter().map(|&c| usize::from(c)).sum();
            input.each(total, |bytes: [u8; 16]| {
                let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
                let (hash, value) = (word(0) as i64, word(8));
                let chunk = value >> 32;
                if chunk == 0 || chunk > chunks as u64 {
                    bad.get_or_insert(chunk);
                } else {
                    entries.push((
                        hash,
                        Loc {
                            chunk: chunk as u32 - 1,
                            offset: value as u32,
                        },
                    ));
                }
            })?;
            left -= counts.len();
        }
        check_read(
            bad,
            chunks,
            entries.len(),
            len,
            buckets_for(len, MIN_BUCKETS),
        )?;
        if entries.is_empty() {
            return Ok(BlockTable::default());
        }
        let buckets = buckets_for(entries.len() + 1, MIN_BUCKETS);
        Ok(BlockTable::filled(
            buckets,
            entries.len(),
            entries.into_iter(),
        ))
    }
}

/// The bucket and entry counts an image of the table starts with, the buckets checked.
fn read_sizes(input: &mut ImageInput<impl std::io::Read>) -> Result<(usize, usize), ImageError> {
    let buckets = input.u64()? as usize;
    let len = input.u64()? as usize;
    if buckets != 0 && (!buckets.is_power_of_two() || buckets < MIN_BUCKETS) {
        return Err(table_malformed(format!("{buckets} buckets")));
    }
    // Every bucket has its count byte; the table gets no more buckets than that allows.
    input.expect(buckets as u128)?;
    Ok((buckets, len))
}

/// One run's occupied-slot counts, each at most `lanes`.
fn read_counts(
    input: &mut ImageInput<impl std::io::Read>,
    run: usize,
    lanes: usize,
) -> Result<Vec<u8>, ImageError> {
    let counts = input.bytes(run as u64)?;
    if let Some(&count) = counts.iter().find(|&&c| usize::from(c) > lanes) {
        return Err(table_malformed(format!("a bucket of {count} slots")));
    }
    Ok(counts)
}

/// Fails when an entry named a chunk past `chunks` (`bad`), or the entries read are not the
/// `written` count or overload the buckets.
fn check_read(
    bad: Option<u64>,
    chunks: usize,
    read: usize,
    written: usize,
    buckets: usize,
) -> Result<(), ImageError> {
    if let Some(chunk) = bad {
        return Err(table_malformed(format!(
            "an entry names chunk slot {chunk} of {chunks}"
        )));
    }
    if read != written || over_max_load(written, buckets) {
        return Err(table_malformed(format!(
            "{read} entries where {written} were written, in {buckets} buckets"
        )));
    }
    Ok(())
}

fn table_malformed(what: String) -> ImageError {
    ImageError::Malformed(format!("the block table: {what}"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

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
            *table = table.replacement(stored.len(), 1, entries);
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
                    table = table.replacement(model.len(), more, kept);
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
        let mut table = BlockTable::default().replacement(0, 1, std::iter::empty());
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
        let table = BlockTable::default().replacement(0, 1, std::iter::empty());
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
                one_by_one.insert_at(one_by_one.home(hash), pack(fingerprint(hash), loc));
            }
            let slots = |table: &BlockTable| -> Vec<Slot> {
                table.buckets.iter().flat_map(Bucket::slots).collect()
            };
            assert_eq!(slots(&filled), slots(&one_by_one), "{n} entries");
            assert_eq!(filled.len(), n);
        }
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
