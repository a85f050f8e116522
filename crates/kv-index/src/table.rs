//! The block hash table: block hash -> where the block is stored.
//!
//! Open addressing with linear probing over 16-byte slots that hold the key next to its value,
//! so a lookup or an insert touches one cache line (two when probing crosses a line), where a
//! control-byte table touches two. There is no single-key removal: the index deletes lazily and
//! stale entries go in [`BlockTable::retain`], which rebuilds the table.

/// Where a hash is stored: a chunk and a position in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) chunk: u32,
    pub(crate) offset: u32,
}

/// A slot: the hash, and `(chunk + 1) << 32 | offset` (0 = vacant).
type Slot = [u64; 2];

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

/// The smallest non-empty table.
const MIN_SLOTS: usize = 16;

/// What [`BlockTable::probe`] found: the slot holding the hash, or the vacant slot where it
/// would go.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Probe {
    Found(usize, Loc),
    Vacant(usize),
}

#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    /// A power of two in length, or empty.
    slots: Vec<Slot>,
    len: usize,
    /// `64 - log2(slots.len())`.
    shift: u32,
}

impl BlockTable {
    /// Entries held (live or stale).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether one more entry needs a bigger table (or a [`BlockTable::retain`]): the load stays
    /// at most 4/5.
    pub(crate) fn is_full(&self) -> bool {
        (self.len + 1) * 5 > self.slots.len() * 4
    }

    fn home(&self, hash: i64) -> usize {
        ((hash as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Reads `hash`'s home slot and nothing else: one load with no branch on what it finds,
    /// so that many of them (see `Index::warm_ahead`) miss the cache at once.
    pub(crate) fn touch(&self, hash: i64) -> u64 {
        self.slots.get(self.home(hash)).map_or(0, |slot| slot[1])
    }

    pub(crate) fn get(&self, hash: i64) -> Option<Loc> {
        match self.probe(hash) {
            Probe::Found(_, loc) => Some(loc),
            Probe::Vacant(_) => None,
        }
    }

    /// Looks `hash` up. With an empty table, reports slot 0 as vacant: call
    /// [`BlockTable::grow`] before filling one.
    pub(crate) fn probe(&self, hash: i64) -> Probe {
        if self.slots.is_empty() {
            return Probe::Vacant(0);
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(hash);
        loop {
            let [key, value] = self.slots[i];
            if value == 0 {
                return Probe::Vacant(i);
            }
            if key == hash as u64 {
                return Probe::Found(i, unpack(value));
            }
            i = (i + 1) & mask;
        }
    }

    /// Overwrites the value of an occupied slot.
    pub(crate) fn set(&mut self, slot: usize, loc: Loc) {
        debug_assert_ne!(self.slots[slot][1], 0);
        self.slots[slot][1] = pack(loc);
    }

    /// Fills the vacant slot that [`BlockTable::probe`] gave for `hash` (with no change to the
    /// table in between, and not when it is full).
    pub(crate) fn fill(&mut self, slot: usize, hash: i64, loc: Loc) {
        debug_assert!(!self.is_full());
        debug_assert_eq!(self.slots[slot][1], 0);
        self.slots[slot] = [hash as u64, pack(loc)];
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

    /// Doubles the table (or makes the first one).
    pub(crate) fn grow(&mut self) {
        let slots = (self.slots.len() * 2).max(MIN_SLOTS);
        self.rebuild(slots, |_, _| true);
    }

    /// Keeps only the entries for which `keep` holds, at the same size.
    pub(crate) fn retain(&mut self, keep: impl FnMut(i64, Loc) -> bool) {
        self.rebuild(self.slots.len(), keep);
    }

    fn rebuild(&mut self, slots: usize, mut keep: impl FnMut(i64, Loc) -> bool) {
        debug_assert!(slots.is_power_of_two());
        // Written out explicitly rather than allocated zeroed: lazily mapped zero pages would
        // fault twice each (a probe's read maps the zero page, the insert's write copies it),
        // at random during the inserts, where writing them in order costs less.
        let mut new = Vec::with_capacity(slots);
        new.resize(slots, [0; 2]);
        let old = std::mem::replace(&mut self.slots, new);
        self.shift = 64 - slots.trailing_zeros();
        self.len = 0;
        let mask = slots - 1;
        for slot in old {
            let [key, value] = slot;
            if value == 0 || !keep(key as i64, unpack(value)) {
                continue;
            }
            let mut i = self.home(key as i64);
            while self.slots[i][1] != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = slot;
            self.len += 1;
        }
    }
}
