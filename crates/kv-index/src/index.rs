//! The index state and apply.
//!
//! Layout, chosen for memory:
//! - one hash table entry per block hash: its token count and its placements inline (a
//!   `SmallVec` of two 8-byte placements, so one or two holders need no heap allocation);
//! - a placement packs `(worker, tier)` into one `u32` next to the `u32` component mask, with
//!   workers interned as dense indices;
//! - reverse holdings per `(worker, tier)` are a plain `Vec` of hashes with lazy deletion: REVOKE
//!   leaves a stale entry behind and the vector is compacted when stale entries outnumber live
//!   ones, so CLEAR walks one contiguous array.
//!
//! Hit counts live in a side table, since few blocks ever get one; a flag on the block says
//! whether to look there when the block is deleted.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;
use smallvec::SmallVec;

use crate::types::{Action, ActionKind, CacheSpec, IndexStats, Tier, ValidApply};

/// The largest number of workers a placement can name (30 bits; 2 bits hold the tier).
pub const MAX_WORKERS: usize = 1 << 30;

/// Stale reverse-holding entries tolerated before compaction, beyond the live count.
const COMPACTION_SLACK: usize = 64;

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
        match self.holder & 3 {
            1 => Tier::Hbm,
            2 => Tier::Dram,
            _ => Tier::Ssd,
        }
    }
}

/// One block hash: its token count and who holds it where.
#[derive(Debug, Clone, Default)]
pub(crate) struct Block {
    pub(crate) placements: SmallVec<[Placement; 2]>,
    /// Tokens in the block; 0 = unknown.
    pub(crate) tokens: u32,
    /// Whether the hit-count table has an entry for this block.
    pub(crate) has_hits: bool,
}

/// The hashes a worker holds at one tier, with stale entries allowed (see the module docs).
#[derive(Debug, Clone, Default)]
struct Holdings {
    hashes: Vec<i64>,
    live: usize,
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
    pub(crate) blocks: HashMap<i64, Block, FxBuildHasher>,
    pub(crate) workers: Vec<Worker>,
    worker_ids: HashMap<String, u32, FxBuildHasher>,
    pub(crate) hits: HashMap<i64, u64, FxBuildHasher>,
    placements: usize,
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// Sizes of the index.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks.len(),
            placements: self.placements,
            workers: self.workers.len(),
        }
    }

    /// Applies a validated batch: overwrites the worker's address and spec, then applies the
    /// actions in order. Cannot fail, so a batch is applied whole.
    pub fn apply(&mut self, batch: &ValidApply) {
        let worker = self.intern(&batch.worker_id);
        let w = &mut self.workers[worker as usize];
        w.address.clone_from(&batch.worker_address);
        w.spec = batch.cache_spec;
        for action in &batch.actions {
            match action.kind {
                ActionKind::Report => self.report(worker, action),
                ActionKind::Revoke => {
                    for &hash in &action.hashes {
                        self.revoke(worker, action.tier, hash);
                    }
                }
                ActionKind::ClearAllAtTier => self.clear(worker, action.tier),
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
        // New workers are rare (once per worker lifetime): re-rank all of them.
        let mut order: Vec<u32> = (0..self.workers.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| self.workers[a as usize].id.cmp(&self.workers[b as usize].id));
        for (rank, w) in order.into_iter().enumerate() {
            self.workers[w as usize].rank = rank as u32;
        }
        worker
    }

    fn report(&mut self, worker: u32, action: &Action) {
        let holder = Placement::holder(worker, action.tier);
        let w = &mut self.workers[worker as usize];
        let holdings = &mut w.holdings[action.tier.index()];
        for (i, &hash) in action.hashes.iter().enumerate() {
            let mask = action.component_masks.get(i).copied().unwrap_or(0);
            let tokens = action.block_sizes.get(i).copied().unwrap_or(0);
            let block = self.blocks.entry(hash).or_default();
            if tokens > 0 {
                block.tokens = tokens;
            }
            match block.placements.iter_mut().find(|p| p.holder == holder) {
                Some(placement) => {
                    w.nonzero_masks -= usize::from(placement.mask != 0);
                    placement.mask = mask;
                }
                None => {
                    block.placements.push(Placement { holder, mask });
                    holdings.hashes.push(hash);
                    holdings.live += 1;
                    self.placements += 1;
                }
            }
            w.nonzero_masks += usize::from(mask != 0);
        }
    }

    fn revoke(&mut self, worker: u32, tier: Tier, hash: i64) {
        if self.remove_placement(worker, tier, hash) {
            let w = &mut self.workers[worker as usize];
            let holdings = &mut w.holdings[tier.index()];
            holdings.live -= 1;
            if holdings.hashes.len() > 2 * holdings.live + COMPACTION_SLACK {
                self.compact(worker, tier);
            }
        }
    }

    fn clear(&mut self, worker: u32, tier: Tier) {
        let hashes = std::mem::take(&mut self.workers[worker as usize].holdings[tier.index()]);
        for hash in hashes.hashes {
            self.remove_placement(worker, tier, hash);
        }
    }

    /// Removes one placement, deleting the block (and its hit count) when it was the last.
    /// Returns whether the placement existed. Leaves reverse holdings to the caller.
    fn remove_placement(&mut self, worker: u32, tier: Tier, hash: i64) -> bool {
        let holder = Placement::holder(worker, tier);
        let Some(block) = self.blocks.get_mut(&hash) else {
            return false;
        };
        let Some(pos) = block.placements.iter().position(|p| p.holder == holder) else {
            return false;
        };
        let removed = block.placements.swap_remove(pos);
        self.workers[worker as usize].nonzero_masks -= usize::from(removed.mask != 0);
        self.placements -= 1;
        if block.placements.is_empty() {
            if block.has_hits {
                self.hits.remove(&hash);
            }
            self.blocks.remove(&hash);
        }
        true
    }

    /// Drops stale and duplicate entries from one `(worker, tier)` reverse holding.
    fn compact(&mut self, worker: u32, tier: Tier) {
        let holder = Placement::holder(worker, tier);
        let blocks = &self.blocks;
        let holdings = &mut self.workers[worker as usize].holdings[tier.index()];
        holdings.hashes.sort_unstable();
        holdings.hashes.dedup();
        holdings.hashes.retain(|hash| {
            blocks
                .get(hash)
                .is_some_and(|b| b.placements.iter().any(|p| p.holder == holder))
        });
        holdings.hashes.shrink_to(holdings.hashes.len() * 2);
        debug_assert_eq!(holdings.hashes.len(), holdings.live);
    }
}
