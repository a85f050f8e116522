//! The block hash table: block hash -> where the block is stored.
//!
//! Open addressing over 16-byte slots that hold the key next to its value, four to a 64-byte
//! bucket aligned to a cache line. A hash's probe starts at its home bucket's first slot and
//! goes on slot by slot (linear probing from a line boundary), so a lookup or an insert
//! usually touches that one line, where a control-byte table touches two. A probe from a home
//! *slot* would start anywhere in a line: near the table's top load an insert's probe runs
//! about 13 slots, over 3-4 lines from a random start, and an insert is mostly that probe.
//! There is no single-key removal: the index deletes lazily and stale entries go in
//! [`BlockTable::replacement`], a rebuilt table.

use crate::image_io::{ImageError, ImageInput, put_all, put_u64};

/// Where a hash is stored: a chunk and a position in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) chunk: u32,
    pub(crate) offset: u32,
}

/// A slot: the hash, and `(chunk + 1) << 32 | offset` (0 = vacant).
type Slot = [u64; 2];

/// Slots per bucket: one cache line.
const LANES: usize = 4;

/// One cache line of slots.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default)]
struct Bucket([Slot; LANES]);

fn pack(loc: Loc) -> u64 {
    debug_assert!(loc.chunk < u32::MAX);
    (u64::from(loc.chunk + 1) << 32) | u64::from(loc.offset)
}

fn unpack(value: u64) -> Loc {
    Loc {
        chunk: (value >> 32) as u32 - 1,
        offset: value as u32,
    }
}

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

/// What [`BlockTable::probe`] found: the slot holding the hash, or the vacant slot where it
/// would go (a slot is `bucket * LANES + lane`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Probe {
    Found(usize, Loc),
    Vacant(usize),
}

#[derive(Debug, Default, Clone)]
pub(crate) struct BlockTable {
    /// A power of two in length, or empty.
    buckets: Vec<Bucket>,
    len: usize,
    /// `64 - log2(buckets.len())`.
    shift: u32,
}

impl BlockTable {
    /// Entries held (live or stale).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether one more entry needs a bigger table (or a [`BlockTable::replacement`]): the load stays
    /// at most 4/5.
    pub(crate) fn is_full(&self) -> bool {
        !self.has_room(1)
    }

    /// Whether `more` entries fit without a bigger table.
    pub(crate) fn has_room(&self, more: usize) -> bool {
        !over_max_load(self.len + more, self.buckets.len())
    }

    /// `hash`'s home bucket.
    fn home(&self, hash: i64) -> usize {
        ((hash as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Reads `hash`'s home bucket and nothing else: one load with no branch on what it finds,
    /// so that many of them (see `Index::warm_ahead`) miss the cache at once.
    pub(crate) fn touch(&self, hash: i64) -> u64 {
        self.buckets
            .get(self.home(hash))
            .map_or(0, |bucket| bucket.0[0][1])
    }

    /// Reads the line of `slot` (see [`BlockTable::touch`]): a replay about to fill it.
    pub(crate) fn touch_slot(&self, slot: usize) -> u64 {
        self.buckets
            .get(slot / LANES)
            .map_or(0, |bucket| bucket.0[0][1])
    }

    pub(crate) fn get(&self, hash: i64) -> Option<Loc> {
        match self.probe(hash) {
            Probe::Found(_, loc) => Some(loc),
            Probe::Vacant(_) => None,
        }
    }

    /// Looks `hash` up. With an empty table, reports slot 0 as vacant: grow it
    /// ([`BlockTable::grown`]) before filling one.
    pub(crate) fn probe(&self, hash: i64) -> Probe {
        if self.buckets.is_empty() {
            return Probe::Vacant(0);
        }
        let mask = self.buckets.len() - 1;
        let mut b = self.home(hash);
        loop {
            for (lane, &[key, value]) in self.buckets[b].0.iter().enumerate() {
                if value == 0 {
                    return Probe::Vacant(b * LANES + lane);
                }
                if key == hash as u64 {
                    return Probe::Found(b * LANES + lane, unpack(value));
                }
            }
            b = (b + 1) & mask;
        }
    }

    fn slot_mut(&mut self, slot: usize) -> &mut Slot {
        &mut self.buckets[slot / LANES].0[slot % LANES]
    }

    /// Overwrites the value of an occupied slot.
    pub(crate) fn set(&mut self, slot: usize, loc: Loc) {
        let slot = self.slot_mut(slot);
        debug_assert_ne!(slot[1], 0);
        slot[1] = pack(loc);
    }

    /// Fills the vacant slot that [`BlockTable::probe`] gave for `hash` (with no change to the
    /// table in between, and not when it is full).
    pub(crate) fn fill(&mut self, slot: usize, hash: i64, loc: Loc) {
        debug_assert!(!self.is_full());
        let slot = self.slot_mut(slot);
        debug_assert_eq!(slot[1], 0);
        *slot = [hash as u64, pack(loc)];
        self.len += 1;
    }

    /// Moves an existing entry to a new offset in the same chunk.
    pub(crate) fn set_offset(&mut self, hash: i64, offset: u32) -> Option<Loc> {
        match self.probe(hash) {
            Probe::Found(i, loc) => {
                self.set(i, Loc { offset, ..loc });
                Some(loc)
            }
            Probe::Vacant(_) => None,
        }
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
        start..start + std::mem::size_of_val(self.buckets.as_slice())
    }

    /// A copy with room for `more` entries beyond these: twice the buckets, or more if need be.
    /// Built from `&self`, like [`BlockTable::replacement`], so that a caller can build it
    /// beside readers and swap it in (see `Index::table_for`).
    pub(crate) fn grown(&self, more: usize) -> BlockTable {
        let buckets = buckets_for(self.len + more, self.buckets.len() * 2);
        let held = self.buckets.iter().flat_map(|bucket| bucket.0);
        let entries = held
            .filter(|&[_, value]| value != 0)
            .map(|[key, value]| (key as i64, unpack(value)));
        BlockTable::filled(buckets, self.len, entries)
    }

    /// A table to replace this one, holding `entries` (each hash once, `len` of them) with room
    /// for `more` beyond them: this table's size if that leaves the room, else as many times
    /// doubled as it takes.
    pub(crate) fn replacement(
        &self,
        len: usize,
        more: usize,
        entries: impl Iterator<Item = (i64, Loc)>,
    ) -> BlockTable {
        BlockTable::filled(buckets_for(len + more, self.buckets.len()), len, entries)
    }

    /// A table of `buckets` buckets holding `entries` (each hash once, `len` of them).
    fn filled(buckets: usize, len: usize, entries: impl Iterator<Item = (i64, Loc)>) -> BlockTable {
        debug_assert!(buckets.is_power_of_two() && !over_max_load(len, buckets));
        // Written out explicitly rather than allocated zeroed: lazily mapped zero pages would
        // fault twice each (a probe's read maps the zero page, the insert's write copies it),
        // at random during the inserts, where writing them in order costs less.
        let mut new = Vec::with_capacity(buckets);
        new.resize(buckets, Bucket::default());
        let mut table = BlockTable {
            buckets: new,
            len: 0,
            shift: 64 - buckets.trailing_zeros(),
        };
        for (hash, loc) in entries {
            assert!(!table.is_full(), "more entries than the {len} counted");
            table.insert_new(hash, loc);
        }
        debug_assert_eq!(table.len, len, "entries counted");
        table
    }

    /// Writes the table as its image: the bucket and entry counts, then per run of
    /// [`IMAGE_RUN`] buckets each bucket's occupied slot count (a byte) and those slots as
    /// `(hash, value)`. With no single-key removal, a bucket's occupied slots are always its
    /// first ones (a probe fills the first vacant slot it meets), so the counts say where every
    /// slot goes and vacant ones take no room.
    pub(crate) fn write_image(
        &self,
        out: &mut impl std::io::Write,
        scratch: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        put_u64(out, self.buckets.len() as u64)?;
        put_u64(out, self.len as u64)?;
        let mut slots: Vec<Slot> = Vec::with_capacity(IMAGE_RUN * LANES);
        for run in self.buckets.chunks(IMAGE_RUN) {
            slots.clear();
            let counts: Vec<u8> = run
                .iter()
                .map(|bucket| {
                    let occupied = bucket.0.iter().take_while(|slot| slot[1] != 0);
                    let before = slots.len();
                    slots.extend(occupied);
                    (slots.len() - before) as u8
                })
                .collect();
            out.write_all(&counts)?;
            put_all(out, scratch, &slots, |[key, value]| {
                let mut bytes = [0; 16];
                bytes[..8].copy_from_slice(&key.to_le_bytes());
                bytes[8..].copy_from_slice(&value.to_le_bytes());
                bytes
            })?;
        }
        Ok(())
    }

    /// Reads what [`BlockTable::write_image`] wrote, for an index of `chunks` chunks: every
    /// entry must name one of them, and the entry count must be right.
    pub(crate) fn read_image(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
    ) -> Result<BlockTable, ImageError> {
        let malformed = |what: String| ImageError::Malformed(format!("the block table: {what}"));
        let buckets = input.u64()? as usize;
        let len = input.u64()? as usize;
        if buckets != 0 && (!buckets.is_power_of_two() || buckets < MIN_BUCKETS) {
            return Err(malformed(format!("{buckets} buckets")));
        }
        // Every bucket has its count byte; the table gets no more buckets than that allows.
        input.expect(buckets as u128)?;
        // Allocated as the runs arrive: a damaged count must fail on the bytes, not abort on a
        // reservation 64 times the file.
        let mut table = BlockTable {
            buckets: Vec::with_capacity(buckets.min(IMAGE_RUN)),
            len: 0,
            shift: 64 - buckets.max(1).trailing_zeros(),
        };
        let mut bad = None;
        let mut left = buckets;
        while left > 0 {
            let counts = input.bytes(left.min(IMAGE_RUN) as u64)?;
            if let Some(&count) = counts.iter().find(|&&c| usize::from(c) > LANES) {
                return Err(malformed(format!("a bucket of {count} slots")));
            }
            let total = counts.iter().map(|&c| usize::from(c)).sum();
            let slots = input.all(total, |bytes: [u8; 16]| {
                let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
                [word(0), word(8)]
            })?;
            let mut slots = slots.into_iter();
            for &count in &counts {
                let mut bucket = Bucket::default();
                for slot in &mut bucket.0[..usize::from(count)] {
                    *slot = slots.next().expect("counted");
                    let chunk = (slot[1] >> 32) as usize;
                    if chunk == 0 || chunk > chunks {
                        bad.get_or_insert(slot[1] >> 32);
                    }
                }
                table.buckets.push(bucket);
            }
            table.len += total;
            left -= counts.len();
        }
        if let Some(chunk) = bad {
            return Err(malformed(format!(
                "an entry names chunk slot {chunk} of {chunks}"
            )));
        }
        if table.len != len || over_max_load(len, buckets) {
            return Err(malformed(format!(
                "{} entries where {len} were written, in {buckets} buckets",
                table.len
            )));
        }
        Ok(table)
    }

    /// Adds `hash`, which the table does not hold.
    fn insert_new(&mut self, hash: i64, loc: Loc) {
        match self.probe(hash) {
            Probe::Vacant(slot) => self.fill(slot, hash, loc),
            Probe::Found(..) => unreachable!("a hash is held once"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn insert(table: &mut BlockTable, hash: i64, loc: Loc) {
        match table.probe(hash) {
            Probe::Found(slot, _) => table.set(slot, loc),
            Probe::Vacant(slot) => {
                if table.is_full() {
                    *table = table.grown(1);
                    return insert(table, hash, loc);
                }
                table.fill(slot, hash, loc);
            }
        }
    }

    proptest! {
        /// Inserts, overwrites and purges agree with a map, across growth (one entry at a time,
        /// or room for many at once) and across hashes that share home buckets (few distinct
        /// values, many collisions).
        #[test]
        fn agrees_with_a_map(
            ops in prop::collection::vec((0i64..64, 0u32..1000, any::<bool>()), 1..400),
            spread in prop::sample::select(vec![1i64, 1 << 58, 0x9E37_79B9]),
        ) {
            let mut table = BlockTable::default();
            let mut model = HashMap::new();
            for (i, &(key, value, retain)) in ops.iter().enumerate() {
                let hash = key.wrapping_mul(spread);
                let loc = Loc { chunk: value, offset: i as u32 };
                insert(&mut table, hash, loc);
                model.insert(hash, loc);
                if retain && i % 7 == 0 {
                    let keep = |hash: i64, loc: Loc| (hash ^ i64::from(loc.chunk)) % 3 != 0;
                    model.retain(|&hash, &mut loc| keep(hash, loc));
                    let more = value as usize % 50;
                    let kept = model.iter().map(|(&hash, &loc)| (hash, loc));
                    table = table.replacement(model.len(), more, kept);
                    prop_assert!(table.has_room(more));
                }
                prop_assert_eq!(table.len(), model.len());
            }
            // Its image reads back slot for slot (chunks up to 1000 named).
            let mut image = Vec::new();
            table.write_image(&mut image, &mut Vec::new()).unwrap();
            let mut input = ImageInput::new(&image[..], image.len() as u64);
            let read = BlockTable::read_image(&mut input, 1000).unwrap();
            prop_assert_eq!(input.offset(), image.len() as u64);
            prop_assert_eq!(read.len, table.len);
            prop_assert_eq!(read.shift, table.shift);
            prop_assert!(read.buckets.iter().zip(&table.buckets).all(|(a, b)| a.0 == b.0));
            prop_assert_eq!(read.buckets.len(), table.buckets.len());
            for key in 0i64..64 {
                let hash = key.wrapping_mul(spread);
                prop_assert_eq!(table.get(hash), model.get(&hash).copied());
                prop_assert_eq!(read.get(hash), model.get(&hash).copied());
            }
        }
    }

    #[test]
    fn a_full_bucket_spills_into_the_next() {
        let mut table = BlockTable::default().grown(1);
        // Hashes with one home bucket: the multiplier's top bits decide it, so look for them.
        let home = table.home(1);
        let same: Vec<i64> = (1i64..)
            .filter(|&h| table.home(h) == home)
            .take(LANES + 2)
            .collect();
        for (i, &hash) in same.iter().enumerate() {
            insert(
                &mut table,
                hash,
                Loc {
                    chunk: 0,
                    offset: i as u32,
                },
            );
        }
        for (i, &hash) in same.iter().enumerate() {
            assert_eq!(
                table.get(hash),
                Some(Loc {
                    chunk: 0,
                    offset: i as u32
                })
            );
        }
        assert_eq!(table.get(0), None);
    }
}
