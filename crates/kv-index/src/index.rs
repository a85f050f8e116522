//! The index state and apply.
//!
//! Layout: block hashes are stored in *chunks*, runs of hashes in the order they were reported
//! (a REPORT's hashes, continued by a later REPORT whose first new hash follows a chunk's last
//! block, as the chain hint `parent_block_hash` or the action's own order says). A chunk is cut
//! into *pieces*: maximal ranges whose blocks have exactly the same placements (`(worker, tier)`
//! and component mask), stored once per piece. So a prefix scan, after one hash-table probe,
//! compares the following query hashes with the chunk's array and handles a whole piece with one
//! look at its placements, instead of probing every block.
//!
//! Order within a chunk is only a storage guess: which chunk a hash lands in never changes an
//! answer. What answers rely on:
//! - a live block is stored at exactly one *live* position (one in a piece with placements), and
//!   the hash table maps it there;
//! - a piece's placements are the exact placements of each of its blocks.
//!
//! Deleting blocks is lazy: a piece whose last placement goes is *dead*, and the hash-table
//! entries of its blocks become stale. An entry is trusted only when its chunk still stores the
//! same hash at that offset in a live piece, so stale entries are harmless; they are purged when
//! the table would otherwise grow. Dead space in a chunk is trimmed at its end and compacted when
//! it outweighs the live blocks; a chunk without live blocks is freed and its slot reused.
//!
//! REVOKE gathers consecutive hashes stored consecutively into ranges and changes a range a
//! piece at a time. Reverse holdings per `(worker, tier)` are the chunks where it holds something
//! (possibly stale or repeated; compacted when the list doubles), so CLEAR works per piece.
//! Hit counts live in a side table, since few blocks ever get one; a flag on the chunk says
//! whether to look there when some of its blocks die.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;
use smallvec::{SmallVec, smallvec};

use crate::table::{BlockTable, Loc, Probe};
use crate::types::{Action, ActionKind, CacheSpec, IndexStats, Tier, ValidApply};

/// The largest number of workers a placement can name (30 bits; 2 bits hold the tier).
pub const MAX_WORKERS: usize = 1 << 30;

// Debug builds (the tests) use tiny limits so that chunk ends and compactions happen all the
// time; none of them changes an answer.

/// The longest chunk; a longer run goes on in a new chunk. It bounds what one change costs: a
/// split shifts the chunk's later pieces, a compaction copies the chunk.
const MAX_CHUNK_LEN: usize = if cfg!(debug_assertions) { 40 } else { 1 << 12 };

/// Hashes of a REPORT looked up ahead together while it adds new blocks.
const WARM_AHEAD: usize = 32;

/// Dead positions tolerated in a chunk beyond its live ones before it is compacted.
const CHUNK_COMPACTION_SLACK: u32 = if cfg!(debug_assertions) { 2 } else { 64 };

/// Repeated or stale reverse-holding entries tolerated beyond twice the compacted length.
const HOLDINGS_COMPACTION_SLACK: usize = if cfg!(debug_assertions) { 2 } else { 64 };

/// One `(worker, tier)` placement of a block, 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    /// `worker << 2 | tier`.
    holder: u32,
    pub(crate) mask: u32,
}

impl Placement {
    fn holder(worker: u32, tier: Tier) -> u32 {
        (worker << 2) | tier as u32
    }

    pub(crate) fn worker(self) -> u32 {
        self.holder >> 2
    }

    pub(crate) fn tier(self) -> Tier {
        tier_of(self.holder)
    }
}

fn tier_of(holder: u32) -> Tier {
    match holder & 3 {
        1 => Tier::Hbm,
        2 => Tier::Dram,
        _ => Tier::Ssd,
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
enum Tokens {
    Uniform(u32),
    PerBlock(Vec<u32>),
}

impl Tokens {
    fn get(&self, offset: usize) -> u32 {
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
    fn push(&mut self, len: usize, value: u32) {
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

    fn truncate(&mut self, len: usize) {
        if let Tokens::PerBlock(tokens) = self {
            tokens.truncate(len);
        }
    }

    fn shrink(&mut self) {
        if let Tokens::PerBlock(tokens) = self {
            tokens.shrink_to_fit();
        }
    }
}

/// A run of stored block hashes, cut into pieces (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub(crate) hashes: Vec<i64>,
    tokens: Tokens,
    /// Non-empty when `hashes` is; the first begins at 0, begins strictly increase.
    pub(crate) pieces: Vec<Piece>,
    /// Positions in live pieces.
    live: u32,
    /// Whether some block of this chunk ever had a hit count.
    has_hits: bool,
}

impl Chunk {
    fn empty() -> Chunk {
        Chunk {
            hashes: Vec::new(),
            tokens: Tokens::Uniform(0),
            pieces: Vec::new(),
            live: 0,
            has_hits: false,
        }
    }

    /// The piece holding position `offset` (which must be in the chunk).
    pub(crate) fn piece_at(&self, offset: u32) -> usize {
        self.pieces.partition_point(|p| p.begin <= offset) - 1
    }

    /// Where piece `piece` ends (exclusive).
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

    fn set_tokens(&mut self, offset: u32, value: u32) {
        let len = self.hashes.len();
        self.tokens.set(len, offset as usize, value);
    }
}

/// A live block's position, with its piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) chunk: u32,
    pub(crate) offset: u32,
    pub(crate) piece: u32,
}

/// `loc` is where `hash` lives if the chunk stores that hash there in a live piece.
fn found_at(chunks: &[Chunk], hash: i64, loc: Loc) -> Option<Found> {
    let chunk = &chunks[loc.chunk as usize];
    if chunk.hashes.get(loc.offset as usize) != Some(&hash) {
        return None;
    }
    let piece = chunk.piece_at(loc.offset);
    (!chunk.pieces[piece].placements.is_empty()).then_some(Found {
        chunk: loc.chunk,
        offset: loc.offset,
        piece: piece as u32,
    })
}

/// A range of consecutive live positions of one chunk, gathered from consecutive hashes of an
/// action before it is applied at once.
#[derive(Debug, Clone, Copy)]
struct Run {
    chunk: u32,
    begin: u32,
    end: u32,
    /// The piece of position `end - 1`, and where it ends.
    piece: u32,
    piece_end: u32,
    mask: u32,
}

impl Run {
    fn start(chunks: &[Chunk], found: Found, mask: u32) -> Run {
        Run {
            chunk: found.chunk,
            begin: found.offset,
            end: found.offset + 1,
            piece: found.piece,
            piece_end: chunks[found.chunk as usize].piece_end(found.piece as usize) as u32,
            mask,
        }
    }

    /// Extends the run when `hash` is the live block right after it.
    fn extend(&mut self, chunks: &[Chunk], hash: i64) -> bool {
        let chunk = &chunks[self.chunk as usize];
        if chunk.hashes.get(self.end as usize) != Some(&hash) {
            return false;
        }
        if self.end == self.piece_end {
            let next = self.piece as usize + 1;
            if chunk.pieces[next].placements.is_empty() {
                return false;
            }
            self.piece = next as u32;
            self.piece_end = chunk.piece_end(next) as u32;
        }
        self.end += 1;
        true
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// Add or replace the holder's placement with this mask.
    Set(u32),
    Remove,
}

/// The chunks where a worker holds something at one tier, with repeats and stale entries allowed
/// (see the module docs).
#[derive(Debug, Clone, Default)]
struct Holdings {
    chunks: Vec<u32>,
    /// The length after the last compaction.
    compacted: usize,
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
    holdings: [Holdings; 3],
}

/// The in-memory KV placement index. Pure: no I/O, no clock, no locking; the server wraps it.
#[derive(Debug, Default)]
pub struct Index {
    /// Block hash -> where it is stored (maybe stale: see [`found_at`]).
    table: BlockTable,
    pub(crate) chunks: Vec<Chunk>,
    free_chunks: Vec<u32>,
    pub(crate) workers: Vec<Worker>,
    worker_ids: HashMap<String, u32, FxBuildHasher>,
    /// Workers in rank order.
    pub(crate) by_rank: Vec<u32>,
    pub(crate) hits: HashMap<i64, u64, FxBuildHasher>,
    placements: usize,
    /// Live blocks.
    blocks: usize,
    /// Table entries known to be stale (an estimate: it only decides when to purge).
    stale: usize,
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// Sizes of the index.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks,
            placements: self.placements,
            workers: self.workers.len(),
        }
    }

    /// Where a live block is stored, if it exists.
    pub(crate) fn locate(&self, hash: i64) -> Option<Found> {
        let loc = self.table.get(hash)?;
        found_at(&self.chunks, hash, loc)
    }

    /// Applies a validated batch: overwrites the worker's address and spec, then applies the
    /// actions in order. Cannot fail, so a batch is applied whole.
    pub fn apply(&mut self, batch: &ValidApply) {
        let worker = self.intern(&batch.worker_id);
        let w = &mut self.workers[worker as usize];
        w.address.clone_from(&batch.worker_address);
        w.spec = batch.cache_spec;
        for action in &batch.actions {
            let holder = Placement::holder(worker, action.tier);
            match action.kind {
                ActionKind::Report => self.report(holder, action),
                ActionKind::Revoke => self.revoke(holder, &action.hashes),
                ActionKind::ClearAllAtTier => self.clear(holder),
            }
        }
    }

    /// The dense index of a worker id, registering it on first sight.
    fn intern(&mut self, id: &str) -> u32 {
        if let Some(&worker) = self.worker_ids.get(id) {
            return worker;
        }
        assert!(self.workers.len() < MAX_WORKERS, "worker table is full");
        let worker = self.workers.len() as u32;
        self.workers.push(Worker {
            id: id.to_owned(),
            address: String::new(),
            spec: None,
            rank: 0,
            nonzero_masks: 0,
            holdings: Default::default(),
        });
        self.worker_ids.insert(id.to_owned(), worker);
        // Insert it in worker-id order; the workers after it move one rank down.
        let workers = &self.workers;
        let rank = self
            .by_rank
            .partition_point(|&w| workers[w as usize].id.as_str() < id);
        self.by_rank.insert(rank, worker);
        for (rank, &w) in self.by_rank.iter().enumerate().skip(rank) {
            self.workers[w as usize].rank = rank as u32;
        }
        worker
    }

    /// REPORT: hashes that continue a run of stored blocks are gathered and updated a range at
    /// a time; new hashes are appended to the chunk that ends with the previous hash (or the
    /// chain hint's parent for the first), else to a new chunk.
    fn report(&mut self, holder: u32, action: &Action) {
        let worker = (holder >> 2) as usize;
        let mut prev: Option<Loc> = action
            .parent_block_hash
            .and_then(|parent| self.locate(parent))
            .map(|f| Loc {
                chunk: f.chunk,
                offset: f.offset,
            });
        let mut run: Option<Run> = None;
        let mut appended_to: Option<u32> = None;
        let mut warmed = 0;
        let count = action.hashes.len();
        for (i, &hash) in action.hashes.iter().enumerate() {
            let mask = action.component_masks.get(i).copied().unwrap_or(0);
            let tokens = action.block_sizes.get(i).copied().unwrap_or(0);
            if let Some(r) = &mut run
                && r.mask == mask
                && r.extend(&self.chunks, hash)
            {
                if tokens > 0 {
                    self.chunks[r.chunk as usize].set_tokens(r.end - 1, tokens);
                }
                continue;
            }
            if let Some(r) = run.take() {
                self.update_range(r.chunk, r.begin, r.end, holder, Change::Set(r.mask));
                prev = Some(Loc {
                    chunk: r.chunk,
                    offset: r.end - 1,
                });
            }
            if self.table.is_full() {
                if self.stale > self.table.len() / 4 {
                    self.purge();
                }
                if self.table.is_full() {
                    self.table.grow();
                }
            }
            if i >= warmed && prev.is_some_and(|p| Some(p.chunk) == appended_to) {
                // New blocks come in runs: look the next hashes up together so that their
                // hash-table misses overlap, before taking them one at a time.
                warmed = (i + WARM_AHEAD).min(count);
                for &hash in &action.hashes[i..warmed] {
                    std::hint::black_box(self.table.get(hash));
                }
            }
            let placement = Placement { holder, mask };
            let remaining = count - i;
            let existing = match self.table.probe(hash) {
                Probe::Found(slot, loc) => match found_at(&self.chunks, hash, loc) {
                    Some(found) => Some(found),
                    None => {
                        self.stale = self.stale.saturating_sub(1);
                        let loc = append_block(
                            &mut self.chunks,
                            &mut self.free_chunks,
                            prev,
                            hash,
                            placement,
                            tokens,
                            remaining,
                        );
                        self.table.set(slot, loc);
                        prev = Some(loc);
                        None
                    }
                },
                Probe::Vacant(slot) => {
                    let loc = append_block(
                        &mut self.chunks,
                        &mut self.free_chunks,
                        prev,
                        hash,
                        placement,
                        tokens,
                        remaining,
                    );
                    self.table.fill(slot, hash, loc);
                    prev = Some(loc);
                    None
                }
            };
            match existing {
                Some(found) => {
                    if tokens > 0 {
                        self.chunks[found.chunk as usize].set_tokens(found.offset, tokens);
                    }
                    run = Some(Run::start(&self.chunks, found, mask));
                }
                None => {
                    let chunk = prev.expect("just appended").chunk;
                    if appended_to.is_some_and(|c| c != chunk) {
                        self.trim_capacity(appended_to.take().expect("checked"));
                    }
                    appended_to = Some(chunk);
                    self.blocks += 1;
                    self.placements += 1;
                    self.workers[worker].nonzero_masks += usize::from(mask != 0);
                    self.hold(holder, chunk);
                }
            }
        }
        if let Some(r) = run {
            self.update_range(r.chunk, r.begin, r.end, holder, Change::Set(r.mask));
        }
        if let Some(chunk) = appended_to {
            self.trim_capacity(chunk);
        }
    }

    /// REVOKE: consecutive hashes stored consecutively are removed a range at a time.
    fn revoke(&mut self, holder: u32, hashes: &[i64]) {
        let mut run: Option<Run> = None;
        for &hash in hashes {
            if let Some(r) = &mut run
                && r.extend(&self.chunks, hash)
            {
                continue;
            }
            if let Some(r) = run.take() {
                self.update_range(r.chunk, r.begin, r.end, holder, Change::Remove);
            }
            run = self
                .locate(hash)
                .map(|found| Run::start(&self.chunks, found, 0));
        }
        if let Some(r) = run {
            self.update_range(r.chunk, r.begin, r.end, holder, Change::Remove);
        }
    }

    /// CLEAR_ALL_AT_TIER: every chunk of the reverse holdings, whole.
    fn clear(&mut self, holder: u32) {
        let holdings = std::mem::take(
            &mut self.workers[(holder >> 2) as usize].holdings[tier_of(holder).index()],
        );
        let mut last = None;
        for chunk in holdings.chunks {
            if last == Some(chunk) {
                continue;
            }
            last = Some(chunk);
            let len = self.chunks[chunk as usize].hashes.len() as u32;
            if len > 0 {
                self.update_range(chunk, 0, len, holder, Change::Remove);
            }
        }
    }

    /// Applies `change` for `holder` to positions `begin..end` of a chunk (all live for a
    /// `Set`), splitting pieces where the change starts or ends inside one, merging equal
    /// neighbours after, and tidying the chunk when blocks died.
    fn update_range(&mut self, c: u32, begin: u32, end: u32, holder: u32, change: Change) {
        let worker = (holder >> 2) as usize;
        let chunk = &mut self.chunks[c as usize];
        let first = chunk.piece_at(begin);
        let mut i = first;
        let mut pos = begin;
        let mut gained = false;
        let mut died = false;
        while pos < end {
            let piece_end = chunk.piece_end(i) as u32;
            let stop = piece_end.min(end);
            let len = (stop - pos) as usize;
            let piece = &chunk.pieces[i];
            let found = piece.placements.binary_search_by_key(&holder, |p| p.holder);
            let old_mask = found.ok().map(|j| piece.placements[j].mask);
            let needed = match change {
                Change::Set(mask) => old_mask != Some(mask),
                Change::Remove => old_mask.is_some(),
            };
            if needed {
                if pos > piece.begin {
                    let placements = piece.placements.clone();
                    chunk.pieces.insert(
                        i + 1,
                        Piece {
                            begin: pos,
                            placements,
                        },
                    );
                    i += 1;
                }
                if stop < piece_end {
                    let placements = chunk.pieces[i].placements.clone();
                    chunk.pieces.insert(
                        i + 1,
                        Piece {
                            begin: stop,
                            placements,
                        },
                    );
                }
                let placements = &mut chunk.pieces[i].placements;
                let w = &mut self.workers[worker];
                if let Some(mask) = old_mask {
                    w.nonzero_masks -= len * usize::from(mask != 0);
                }
                match (change, found) {
                    (Change::Set(mask), Ok(j)) => {
                        placements[j].mask = mask;
                        w.nonzero_masks += len * usize::from(mask != 0);
                    }
                    (Change::Set(mask), Err(j)) => {
                        placements.insert(j, Placement { holder, mask });
                        w.nonzero_masks += len * usize::from(mask != 0);
                        self.placements += len;
                        gained = true;
                    }
                    (Change::Remove, Ok(j)) => {
                        placements.remove(j);
                        self.placements -= len;
                        if placements.is_empty() {
                            died = true;
                            chunk.live -= len as u32;
                            self.blocks -= len;
                            self.stale += len;
                            if chunk.has_hits {
                                for hash in &chunk.hashes[pos as usize..stop as usize] {
                                    self.hits.remove(hash);
                                }
                            }
                        }
                    }
                    (Change::Remove, Err(_)) => unreachable!("a removal needs the placement"),
                }
            }
            pos = stop;
            i += 1;
        }
        // Merge equal neighbours around the touched pieces `first..i`.
        let mut j = first.saturating_sub(1);
        let mut last = i.min(chunk.pieces.len() - 1);
        while j < last {
            if chunk.pieces[j].placements == chunk.pieces[j + 1].placements {
                chunk.pieces.remove(j + 1);
                last -= 1;
            } else {
                j += 1;
            }
        }
        if gained {
            self.hold(holder, c);
        }
        if died {
            self.tidy(c);
        }
    }

    /// Notes in the reverse holdings that `holder` holds something in chunk `c`.
    fn hold(&mut self, holder: u32, c: u32) {
        let holdings = &mut self.workers[(holder >> 2) as usize].holdings[tier_of(holder).index()];
        if holdings.chunks.last() == Some(&c) {
            return;
        }
        holdings.chunks.push(c);
        if holdings.chunks.len() > 2 * holdings.compacted + HOLDINGS_COMPACTION_SLACK {
            let chunks = &self.chunks;
            holdings.chunks.sort_unstable();
            holdings.chunks.dedup();
            holdings.chunks.retain(|&c| {
                chunks[c as usize]
                    .pieces
                    .iter()
                    .any(|p| p.placements.iter().any(|p| p.holder == holder))
            });
            holdings.compacted = holdings.chunks.len();
        }
    }

    /// After blocks of chunk `c` died: frees it when nothing is live, trims a dead end, and
    /// compacts it when dead positions outweigh live ones.
    fn tidy(&mut self, c: u32) {
        let chunk = &mut self.chunks[c as usize];
        if chunk.live == 0 {
            *chunk = Chunk::empty();
            self.free_chunks.push(c);
            return;
        }
        let last = chunk.pieces.last().expect("a live chunk has pieces");
        if last.placements.is_empty() {
            let begin = last.begin as usize;
            chunk.hashes.truncate(begin);
            chunk.tokens.truncate(begin);
            chunk.pieces.pop();
        }
        let dead = chunk.hashes.len() as u32 - chunk.live;
        if dead > chunk.live + CHUNK_COMPACTION_SLACK {
            self.compact_chunk(c);
        }
    }

    /// Rewrites chunk `c` with its live positions only, re-pointing their table entries.
    fn compact_chunk(&mut self, c: u32) {
        let chunk = &mut self.chunks[c as usize];
        let mut hashes: Vec<i64> = Vec::with_capacity(chunk.live as usize);
        let mut tokens = Tokens::Uniform(0);
        let mut pieces: Vec<Piece> = Vec::new();
        for (k, piece) in chunk.pieces.iter().enumerate() {
            if piece.placements.is_empty() {
                continue;
            }
            if pieces
                .last()
                .is_none_or(|p| p.placements != piece.placements)
            {
                pieces.push(Piece {
                    begin: hashes.len() as u32,
                    placements: piece.placements.clone(),
                });
            }
            for offset in piece.begin as usize..chunk.piece_end(k) {
                tokens.push(hashes.len(), chunk.tokens.get(offset));
                hashes.push(chunk.hashes[offset]);
            }
        }
        for (offset, hash) in hashes.iter().enumerate() {
            let old = self.table.set_offset(*hash, offset as u32);
            debug_assert_eq!(
                old.map(|loc| loc.chunk),
                Some(c),
                "a live block has an entry"
            );
        }
        chunk.hashes = hashes;
        chunk.tokens = tokens;
        chunk.pieces = pieces;
    }

    /// Gives back the spare capacity of a chunk that was appended to.
    fn trim_capacity(&mut self, c: u32) {
        let chunk = &mut self.chunks[c as usize];
        if chunk.hashes.capacity() > chunk.hashes.len() + chunk.hashes.len() / 8 + 4 {
            chunk.hashes.shrink_to_fit();
            chunk.tokens.shrink();
        }
    }

    /// Drops stale table entries.
    fn purge(&mut self) {
        let chunks = &self.chunks;
        self.table
            .retain(|hash, loc| found_at(chunks, hash, loc).is_some());
        self.stale = 0;
    }

    /// Marks chunk `c` as having a block with a hit count.
    pub(crate) fn note_hits(&mut self, c: u32) {
        self.chunks[c as usize].has_hits = true;
    }

    /// Checks every internal invariant against a recount; panics on the first violation. For
    /// tests (O(size of the index)).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut blocks = 0;
        let mut placements = 0;
        let mut nonzero = vec![0usize; self.workers.len()];
        let mut held: Vec<[Vec<u32>; 3]> = vec![Default::default(); self.workers.len()];
        for (c, chunk) in self.chunks.iter().enumerate() {
            assert_eq!(
                chunk.hashes.is_empty(),
                chunk.pieces.is_empty(),
                "chunk {c}"
            );
            if let Tokens::PerBlock(tokens) = &chunk.tokens {
                assert_eq!(tokens.len(), chunk.hashes.len(), "chunk {c} tokens");
            }
            if chunk.hashes.is_empty() {
                assert!(
                    self.free_chunks.contains(&(c as u32)),
                    "empty chunk {c} not free"
                );
                continue;
            }
            assert_eq!(chunk.pieces[0].begin, 0, "chunk {c}");
            let mut live = 0;
            for (k, piece) in chunk.pieces.iter().enumerate() {
                let end = chunk.piece_end(k);
                assert!((piece.begin as usize) < end, "chunk {c} piece {k} is empty");
                if k > 0 {
                    assert_ne!(
                        chunk.pieces[k - 1].placements,
                        piece.placements,
                        "chunk {c} piece {k} not merged"
                    );
                }
                assert!(
                    piece
                        .placements
                        .windows(2)
                        .all(|w| w[0].holder < w[1].holder),
                    "chunk {c} piece {k} unsorted"
                );
                if piece.placements.is_empty() {
                    continue;
                }
                let len = end - piece.begin as usize;
                live += len;
                placements += len * piece.placements.len();
                for p in &piece.placements {
                    nonzero[p.worker() as usize] += len * usize::from(p.mask != 0);
                    held[p.worker() as usize][p.tier().index()].push(c as u32);
                }
                for offset in piece.begin as usize..end {
                    let hash = chunk.hashes[offset];
                    assert_eq!(
                        self.table.get(hash),
                        Some(Loc {
                            chunk: c as u32,
                            offset: offset as u32
                        }),
                        "table entry of live block {hash}"
                    );
                }
            }
            assert_eq!(chunk.live as usize, live, "chunk {c} live count");
            assert!(
                !chunk
                    .pieces
                    .last()
                    .expect("non-empty")
                    .placements
                    .is_empty(),
                "chunk {c} dead end"
            );
            blocks += live;
        }
        assert_eq!(self.by_rank.len(), self.workers.len(), "ranks");
        for (rank, &w) in self.by_rank.iter().enumerate() {
            assert_eq!(
                self.workers[w as usize].rank as usize, rank,
                "rank of worker {w}"
            );
            if rank > 0 {
                let before = &self.workers[self.by_rank[rank - 1] as usize].id;
                assert!(
                    *before < self.workers[w as usize].id,
                    "rank order at {rank}"
                );
            }
        }
        assert_eq!(self.blocks, blocks, "live blocks");
        assert_eq!(self.placements, placements, "placements");
        for (w, worker) in self.workers.iter().enumerate() {
            assert_eq!(
                worker.nonzero_masks, nonzero[w],
                "non-zero masks of worker {w}"
            );
            for (tier, chunks) in held[w].iter().enumerate() {
                for c in chunks {
                    assert!(
                        worker.holdings[tier].chunks.contains(c),
                        "holdings of worker {w} tier {tier} miss chunk {c}"
                    );
                }
            }
        }
        for &hash in self.hits.keys() {
            assert!(
                self.locate(hash).is_some(),
                "hit count of dead block {hash}"
            );
        }
    }
}

/// Appends a new block to the chunk that ends with `prev` (when there is one and it has room),
/// else to a new chunk sized for the `remaining` hashes of the action.
fn append_block(
    chunks: &mut Vec<Chunk>,
    free_chunks: &mut Vec<u32>,
    prev: Option<Loc>,
    hash: i64,
    placement: Placement,
    tokens: u32,
    remaining: usize,
) -> Loc {
    let extend = prev.filter(|p| {
        let len = chunks[p.chunk as usize].hashes.len();
        p.offset as usize + 1 == len && len < MAX_CHUNK_LEN
    });
    let c = match extend {
        Some(p) => p.chunk,
        None => {
            let mut chunk = Chunk::empty();
            chunk.hashes.reserve_exact(remaining.min(MAX_CHUNK_LEN));
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
        chunk.hashes.reserve(remaining.min(MAX_CHUNK_LEN - offset));
    }
    chunk.tokens.push(offset, tokens);
    chunk.hashes.push(hash);
    chunk.live += 1;
    if !matches!(chunk.pieces.last(), Some(p) if p.placements.as_slice() == [placement]) {
        chunk.pieces.push(Piece {
            begin: offset as u32,
            placements: smallvec![placement],
        });
    }
    Loc {
        chunk: c,
        offset: offset as u32,
    }
}
