//! The index state: its layout, apply, and the clean-up of lazy deletion.
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
//! entries of its blocks become stale. An entry (a fingerprint, a chunk and an offset) is
//! trusted only when its chunk stores the hash at that offset in a live piece, so stale entries
//! are harmless, and none is ever changed: a block that moves (compacted, or dead and stored
//! again) gets a new entry. They go when the table is full and is rebuilt from the live blocks
//! (at the same size when that leaves room, else bigger; a table that grows with few stale
//! entries is doubled from its own slots instead, carrying them over). Dead space in a chunk is
//! trimmed at its end and compacted when it outweighs the live blocks; a chunk without live
//! blocks is freed and its slot reused.
//!
//! REVOKE gathers consecutive hashes stored consecutively into ranges and changes a range a
//! piece at a time. Reverse holdings per `(worker, tier)` are the chunks where it holds something
//! (possibly stale or repeated; compacted when the list doubles), so CLEAR works per piece.
//! Hit counts live in a side table, since few blocks ever get one; a flag on the chunk says
//! whether to look there when some of its blocks die.
//!
//! Modules: `layout` (holders, placements, pieces, chunks, workers, appending a block), `apply`
//! (REPORT / REVOKE / CLEAR and the range update they share), `compaction` (purge, trim, compact,
//! free), `effects` (changes recorded on one index, replayed onto its twin, which shares its
//! table, without table lookups: a left-right cell's other copy), `export` (the contents as
//! plain data), `image` (the layout itself as bytes, for snapshots), `invariants`
//! (`Index::check_invariants`, for tests).

mod apply;
mod compaction;
mod effects;
mod export;
mod image;
mod invariants;
mod layout;

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::table::SharedTable;
use crate::types::{IndexStats, ValidApply};

pub use compaction::SpareTable;
pub use effects::{Effects, EffectsMark};
pub use export::{Export, ExportedWorker, Held, WorkerSummary};
pub use image::TableLayout;
pub(crate) use layout::{Chunk, Found, Placement};
use layout::{Lookup, ScanProfile, Worker};

/// The largest number of workers a placement can name (30 bits; 2 bits hold the tier).
pub const MAX_WORKERS: usize = 1 << 30;

// Debug builds (the tests) use tiny limits so that chunk ends and compactions happen all the
// time; none of them changes an answer.

/// The longest chunk; a longer run goes on in a new chunk. It bounds what one change costs: a
/// split shifts the chunk's later pieces, a compaction copies the chunk.
const MAX_CHUNK_LEN: usize = if cfg!(debug_assertions) { 40 } else { 1 << 12 };

/// Hashes of a REPORT whose home buckets are prefetched ahead (rolling) while it adds new
/// blocks.
const WARM_AHEAD: usize = 32;

/// Dead positions tolerated in a chunk beyond its live ones before it is compacted.
const CHUNK_COMPACTION_SLACK: u32 = if cfg!(debug_assertions) { 2 } else { 64 };

/// Repeated or stale reverse-holding entries tolerated beyond twice the compacted length.
const HOLDINGS_COMPACTION_SLACK: usize = if cfg!(debug_assertions) { 2 } else { 64 };

/// The in-memory KV placement index. Pure: no I/O, no clock, no locking; the server wraps it.
#[derive(Debug, Default, Clone)]
pub struct Index {
    /// Block hash -> where it is stored (maybe stale: see `layout::lookup`); shared with a
    /// twin ([`Index::twin`]), copied by a clone.
    table: SharedTable,
    pub(crate) chunks: Vec<Chunk>,
    free_chunks: Vec<u32>,
    pub(crate) workers: Vec<Worker>,
    /// Per worker, what a prefix scan reads of it.
    pub(crate) profiles: Vec<ScanProfile>,
    worker_ids: HashMap<String, u32, FxBuildHasher>,
    /// Workers in rank order.
    pub(crate) by_rank: Vec<u32>,
    pub(crate) hits: HashMap<i64, u64, FxBuildHasher>,
    placements: usize,
    /// Live blocks.
    blocks: usize,
    /// Applies so far: a [`SpareTable`] is installed only into the index it was built from, as
    /// it was then.
    changes: u64,
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// An equal index that shares this one's block table (a clone copies it): the other copy
    /// of a left-right cell. Only this index may then fill the table, by its changes
    /// ([`Index::apply_recording`]); the twin makes them after it, from what they recorded
    /// ([`Index::replay_apply`]), and reads the table meanwhile. That is sound because an entry
    /// is never changed once filled (see `table.rs`): what the twin's state needs stays, and
    /// what was filled since leads nowhere in it.
    pub fn twin(&self) -> Index {
        Index {
            table: self.table.share(),
            chunks: self.chunks.clone(),
            free_chunks: self.free_chunks.clone(),
            workers: self.workers.clone(),
            profiles: self.profiles.clone(),
            worker_ids: self.worker_ids.clone(),
            by_rank: self.by_rank.clone(),
            hits: self.hits.clone(),
            placements: self.placements,
            blocks: self.blocks,
            changes: self.changes,
        }
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
    #[inline]
    pub(crate) fn locate(&self, hash: i64) -> Option<Found> {
        match layout::lookup(&self.table, &self.chunks, hash) {
            Lookup::Live(found) => Some(found),
            Lookup::Vacant(_) => None,
        }
    }

    /// Applies a validated batch: overwrites the worker's address and spec, then applies the
    /// actions in order. Cannot fail, so a batch is applied whole.
    pub fn apply(&mut self, batch: &ValidApply) {
        self.apply_with(batch, &mut effects::Live);
    }

    /// [`Index::apply`], looking the table up through `lookups` (see `effects`).
    fn apply_with(&mut self, batch: &ValidApply, lookups: &mut impl effects::Lookups) {
        lookups.begin(self);
        self.changes += 1;
        let worker = self.intern(&batch.worker_id);
        let w = &mut self.workers[worker as usize];
        w.address.clone_from(&batch.worker_address);
        w.spec = batch.cache_spec;
        self.profiles[worker as usize] = ScanProfile::of(w);
        for action in &batch.actions {
            self.apply_action(worker, action, lookups);
        }
    }

    /// The dense index of a worker id, registering it on first sight.
    fn intern(&mut self, id: &str) -> u32 {
        if let Some(&worker) = self.worker_ids.get(id) {
            return worker;
        }
        assert!(self.workers.len() < MAX_WORKERS, "worker table is full");
        let worker = self.workers.len() as u32;
        self.workers.push(Worker::new(id));
        self.profiles
            .push(ScanProfile::of(&self.workers[worker as usize]));
        self.worker_ids.insert(id.to_owned(), worker);
        // Insert it in worker-id order; the workers after it move one rank down.
        let workers = &self.workers;
        let rank = self
            .by_rank
            .partition_point(|&w| workers[w as usize].id.as_str() < id);
        self.by_rank.insert(rank, worker);
        for (rank, &w) in self.by_rank.iter().enumerate().skip(rank) {
            self.workers[w as usize].rank = rank as u32;
            self.profiles[w as usize].rank = rank as u32;
        }
        worker
    }

    /// The addresses of the block table's memory. It is most of the index, and applies write to
    /// it at random; so a process that forks a child to write a snapshot keeps these pages out
    /// of the child (`MADV_DONTFORK`), where copy-on-write would fault on nearly every one of
    /// them after the fork, and the child writes [`Index::write_image_with_fresh_table`],
    /// which never reads them. Valid until the next change to the index.
    pub fn table_memory(&self) -> std::ops::Range<usize> {
        self.table.memory()
    }

    /// Entries the block table holds (live or stale).
    pub fn table_entries(&self) -> usize {
        self.table.len()
    }

    /// Marks chunk `c` as having a block with a hit count.
    pub(crate) fn note_hits(&mut self, c: u32) {
        self.chunks[c as usize].has_hits = true;
    }
}
