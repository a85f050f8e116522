//! The storage shapes: holders and placements, pieces, token counts, chunks, workers, and how a
//! new block is appended to a chunk.

use smallvec::{SmallVec, smallvec};

use crate::table::{BlockTable, Loc, Probe};
use crate::types::{CacheSpec, Tier};

use super::MAX_CHUNK_LEN;

/// A `(worker, tier)` pair packed in 32 bits: the worker in the high 30, the tier's wire value
/// in the low 2. Its order (worker first, then tier) is the order of a piece's placements.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Holder(pub(super) u32);

impl Holder {
    /// `worker` must be below [`super::MAX_WORKERS`].
    #[inline]
    pub(crate) fn new(worker: u32, tier: Tier) -> Holder {
        debug_assert!((worker as usize) < super::MAX_WORKERS);
        Holder((worker << 2) | tier as u32)
    }

    #[inline]
    pub(crate) fn worker(self) -> u32 {
        self.0 >> 2
    }

    #[inline]
    pub(crate) fn tier(self) -> Tier {
        match self.0 & 3 {
            1 => Tier::Hbm,
            2 => Tier::Dram,
            _ => Tier::Ssd,
        }
    }
}

/// One `(worker, tier)` placement of a block, 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) holder: Holder,
    pub(crate) mask: u32,
}

impl Placement {
    #[inline]
    pub(crate) fn worker(self) -> u32 {
        self.holder.worker()
    }

    #[inline]
    pub(crate) fn tier(self) -> Tier {
        self.holder.tier()
    }

    /// Holder and mask in one word: equal keys, equal placements.
    #[inline]
    pub(crate) fn key(self) -> u64 {
        (u64::from(self.holder.0) << 32) | u64::from(self.mask)
    }
}

/// The placements of every block of a piece, sorted by holder; empty = the blocks are dead.
pub(crate) type Placements = SmallVec<[Placement; 2]>;

/// A range of a chunk whose blocks have the same placements: from `begin` to the next piece's
/// `begin` (or the chunk's end).
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    pub(crate) begin: u32,
    pub(crate) placements: Placements,
}

/// Token counts of a chunk's positions: one value for all (the usual case) or one each.
#[derive(Debug, Clone)]
pub(super) enum Tokens {
    Uniform(u32),
    PerBlock(Vec<u32>),
}

impl Tokens {
    pub(super) fn get(&self, offset: usize) -> u32 {
        match self {
            Tokens::Uniform(tokens) => *tokens,
            Tokens::PerBlock(tokens) => tokens[offset],
        }
    }

    /// Sum over `begin..end`.
    fn sum(&self, begin: usize, end: usize) -> u64 {
        match self {
            Tokens::Uniform(tokens) => u64::from(*tokens) * (end - begin) as u64,
            Tokens::PerBlock(tokens) => tokens[begin..end].iter().map(|&t| u64::from(t)).sum(),
        }
    }

    /// Appends position `len` (the current length).
    pub(super) fn push(&mut self, len: usize, value: u32) {
        match self {
            _ if len == 0 => *self = Tokens::Uniform(value),
            Tokens::Uniform(tokens) if *tokens == value => {}
            Tokens::Uniform(tokens) => {
                let mut all = Vec::with_capacity(len + 1);
                all.resize(len, *tokens);
                all.push(value);
                *self = Tokens::PerBlock(all);
            }
            Tokens::PerBlock(tokens) => tokens.push(value),
        }
    }

    fn set(&mut self, len: usize, offset: usize, value: u32) {
        match self {
            Tokens::Uniform(tokens) if *tokens == value => {}
            Tokens::Uniform(tokens) => {
                let mut all = vec![*tokens; len];
                all[offset] = value;
                *self = Tokens::PerBlock(all);
            }
            Tokens::PerBlock(tokens) => tokens[offset] = value,
        }
    }

    pub(super) fn truncate(&mut self, len: usize) {
        if let Tokens::PerBlock(tokens) = self {
            tokens.truncate(len);
        }
    }

    pub(super) fn shrink(&mut self) {
        if let Tokens::PerBlock(tokens) = self {
            tokens.shrink_to_fit();
        }
    }
}

/// A run of stored block hashes, cut into pieces (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub(crate) hashes: Vec<i64>,
    pub(super) tokens: Tokens,
    /// Non-empty when `hashes` is; the first begins at 0, begins strictly increase.
    pub(crate) pieces: Vec<Piece>,
    /// Positions in live pieces.
    pub(super) live: u32,
    /// Whether some block of this chunk ever had a hit count.
    pub(super) has_hits: bool,
}

impl Chunk {
    pub(super) fn empty() -> Chunk {
        Chunk {
            hashes: Vec::new(),
            tokens: Tokens::Uniform(0),
            pieces: Vec::new(),
            live: 0,
            has_hits: false,
        }
    }

    /// The piece holding position `offset` (which must be in the chunk).
    #[inline]
    pub(crate) fn piece_at(&self, offset: u32) -> usize {
        self.pieces.partition_point(|p| p.begin <= offset) - 1
    }

    /// Where piece `piece` ends (exclusive).
    #[inline]
    pub(crate) fn piece_end(&self, piece: usize) -> usize {
        self.pieces
            .get(piece + 1)
            .map_or(self.hashes.len(), |p| p.begin as usize)
    }

    pub(crate) fn tokens_at(&self, offset: usize) -> u32 {
        self.tokens.get(offset)
    }

    /// Tokens summed over positions `begin..end`.
    pub(crate) fn token_sum(&self, begin: usize, end: usize) -> u64 {
        self.tokens.sum(begin, end)
    }

    pub(super) fn set_tokens(&mut self, offset: u32, value: u32) {
        let len = self.hashes.len();
        self.tokens.set(len, offset as usize, value);
    }

    /// Cuts piece `i` so that `begin..end` (inside it) is a piece of its own; returns that
    /// piece's index.
    pub(super) fn isolate(&mut self, mut i: usize, begin: u32, end: u32) -> usize {
        let piece_end = self.piece_end(i) as u32;
        if begin > self.pieces[i].begin {
            let placements = self.pieces[i].placements.clone();
            self.pieces.insert(i + 1, Piece { begin, placements });
            i += 1;
        }
        if end < piece_end {
            let placements = self.pieces[i].placements.clone();
            self.pieces.insert(
                i + 1,
                Piece {
                    begin: end,
                    placements,
                },
            );
        }
        i
    }

    /// Merges equal neighbours among pieces `first - 1 ..= last` (as far as they exist).
    pub(super) fn merge_around(&mut self, first: usize, last: usize) {
        let mut j = first.saturating_sub(1);
        let mut last = last.min(self.pieces.len() - 1);
        while j < last {
            if self.pieces[j].placements == self.pieces[j + 1].placements {
                self.pieces.remove(j + 1);
                last -= 1;
            } else {
                j += 1;
            }
        }
    }
}

/// A live block's position, with its piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) chunk: u32,
    pub(crate) offset: u32,
    pub(crate) piece: u32,
}

impl Found {
    pub(super) fn loc(self) -> Loc {
        Loc {
            chunk: self.chunk,
            offset: self.offset,
        }
    }
}

/// What a probe of the block table for a hash found ([`lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookup {
    /// The hash's live block.
    Live(Found),
    /// None: the vacant slot where a new entry for it would go.
    Vacant(usize),
}

/// Looks `hash` up in `table`, judging each candidate entry against `chunks`: an entry is
/// trusted only when its chunk stores the hash at that offset in a live piece (see
/// `BlockTable::probe`).
#[inline]
pub(super) fn lookup(table: &BlockTable, chunks: &[Chunk], hash: i64) -> Lookup {
    let mut live = None;
    let probe = table.probe(hash, |loc| match live_at(chunks, loc) {
        Some((at, found)) if at == hash => {
            live = Some(found);
            true
        }
        _ => false,
    });
    // A live entry ends the probe: `live` is its block.
    match (probe, live) {
        (Probe::Found(loc), Some(found)) if loc == found.loc() => Lookup::Live(found),
        (Probe::Found(_), _) => unreachable!("found only where judged live"),
        (Probe::Vacant(slot), _) => Lookup::Vacant(slot),
    }
}

/// The hash stored at `loc` and where, if it is live there (in a piece with placements).
#[inline]
pub(super) fn live_at(chunks: &[Chunk], loc: Loc) -> Option<(i64, Found)> {
    let chunk = chunks.get(loc.chunk as usize)?;
    let hash = *chunk.hashes.get(loc.offset as usize)?;
    let piece = chunk.piece_at(loc.offset);
    if chunk.pieces[piece].placements.is_empty() {
        return None;
    }
    let found = Found {
        chunk: loc.chunk,
        offset: loc.offset,
        piece: piece as u32,
    };
    Some((hash, found))
}

/// The chunks where a worker holds something at one tier, with repeats and stale entries allowed
/// (see the module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct Holdings {
    pub(super) chunks: Vec<u32>,
    /// The length after the last compaction.
    pub(super) compacted: usize,
}

/// What the index keeps per worker.
#[derive(Debug, Clone)]
pub(crate) struct Worker {
    pub(crate) id: String,
    pub(crate) address: String,
    pub(crate) spec: Option<CacheSpec>,
    /// Position of `id` among all worker ids in ascending order: the tie-break of answers.
    pub(crate) rank: u32,
    /// Placements with a non-zero component mask, at any tier: a legacy worker with none can be
    /// settled at its first gap.
    pub(crate) nonzero_masks: usize,
    /// Placements per tier, in `Tier::ALL` order.
    pub(crate) placements: [usize; 3],
    pub(super) holdings: [Holdings; 3],
}

impl Worker {
    pub(super) fn new(id: &str) -> Worker {
        Worker {
            id: id.to_owned(),
            address: String::new(),
            spec: None,
            rank: 0,
            nonzero_masks: 0,
            placements: [0; 3],
            holdings: Default::default(),
        }
    }
}

/// What a prefix scan reads of a worker, kept apart from [`Worker`] so that an answer naming a
/// thousand workers reads a few cache lines rather than a thousand. Derived from the worker's
/// address, spec, rank and non-zero masks; refreshed wherever one changes (`check_invariants`
/// recomputes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScanProfile {
    pub(crate) rank: u32,
    /// Matches nothing: an empty address or an invalid spec.
    pub(crate) inert: bool,
    /// Holds a non-zero mask somewhere (see `Worker::nonzero_masks`).
    pub(crate) may_fail_closed: bool,
    /// The component-aware rules' inputs; none for a legacy worker.
    pub(crate) aware: Option<AwareSpec>,
}

/// A spec as the component-aware prefix rules use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AwareSpec {
    /// The component bits (the low three: see `COMPONENT_*`).
    pub(crate) components: u8,
    /// Component bits servable per tier index.
    pub(crate) servable: [u8; 3],
    pub(crate) swa_window: u32,
}

impl ScanProfile {
    pub(crate) fn of(worker: &Worker) -> ScanProfile {
        ScanProfile {
            rank: worker.rank,
            inert: worker.address.is_empty() || worker.spec.is_some_and(|s| !s.is_valid()),
            may_fail_closed: worker.nonzero_masks > 0,
            aware: worker.spec.map(|spec| AwareSpec {
                components: spec.components as u8,
                servable: Tier::ALL.map(|tier| spec.servable_components(tier) as u8),
                swa_window: spec.swa_window_tokens,
            }),
        }
    }
}

/// Appends a new block to the chunk that ends with `prev` (when there is one and it has room),
/// else to a new chunk sized for the `remaining` hashes of the action.
pub(super) fn append_block(
    chunks: &mut Vec<Chunk>,
    free_chunks: &mut Vec<u32>,
    prev: Option<Loc>,
    block: NewBlock,
) -> Loc {
    let extend = prev.filter(|p| {
        let len = chunks[p.chunk as usize].hashes.len();
        p.offset as usize + 1 == len && len < MAX_CHUNK_LEN
    });
    let c = match extend {
        Some(p) => p.chunk,
        None => {
            let mut chunk = Chunk::empty();
            chunk
                .hashes
                .reserve_exact(block.remaining.min(MAX_CHUNK_LEN));
            match free_chunks.pop() {
                Some(c) => {
                    chunks[c as usize] = chunk;
                    c
                }
                None => {
                    chunks.push(chunk);
                    (chunks.len() - 1) as u32
                }
            }
        }
    };
    let chunk = &mut chunks[c as usize];
    let offset = chunk.hashes.len();
    if chunk.hashes.len() == chunk.hashes.capacity() {
        chunk
            .hashes
            .reserve(block.remaining.min(MAX_CHUNK_LEN - offset));
    }
    chunk.tokens.push(offset, block.tokens);
    chunk.hashes.push(block.hash);
    chunk.live += 1;
    if !matches!(chunk.pieces.last(), Some(p) if p.placements.as_slice() == [block.placement]) {
        chunk.pieces.push(Piece {
            begin: offset as u32,
            placements: smallvec![block.placement],
        });
    }
    Loc {
        chunk: c,
        offset: offset as u32,
    }
}

/// A block a REPORT adds: its hash, its one placement, its token count, and how many hashes of
/// the action are left counting this one (to size a new chunk).
#[derive(Debug, Clone, Copy)]
pub(super) struct NewBlock {
    pub(super) hash: i64,
    pub(super) placement: Placement,
    pub(super) tokens: u32,
    pub(super) remaining: usize,
}
