//! Apply: REPORT, REVOKE and CLEAR_ALL_AT_TIER for one holder, and the range update they share.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::table::Loc;
use crate::types::{Action, ActionKind};

use super::effects::{Look, Lookups};
use super::layout::{Chunk, Found, Holder, NewBlock, Placement, Placements, append_block};
use super::{Index, WARM_AHEAD};

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
    #[inline]
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

    /// The run's last position.
    fn last(&self) -> Loc {
        Loc {
            chunk: self.chunk,
            offset: self.end - 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// Add or replace the holder's placement with this mask.
    Set(u32),
    Remove,
}

impl Change {
    /// Whether the change alters a piece where the holder's mask is `old` (`None`: absent).
    fn alters(self, old: Option<u32>) -> bool {
        match self {
            Change::Set(mask) => old != Some(mask),
            Change::Remove => old.is_some(),
        }
    }

    /// Applies the change to a piece's placements, where a binary search for `holder` gave
    /// `found` (and [`Change::alters`] said yes).
    fn apply_to(self, placements: &mut Placements, holder: Holder, found: Result<usize, usize>) {
        match (self, found) {
            (Change::Set(mask), Ok(j)) => placements[j].mask = mask,
            (Change::Set(mask), Err(j)) => placements.insert(j, Placement { holder, mask }),
            (Change::Remove, Ok(j)) => {
                placements.remove(j);
            }
            (Change::Remove, Err(_)) => unreachable!("a removal needs the placement"),
        }
    }
}

/// Where a REPORT's hash ended up.
enum Stored {
    /// It was already a live block.
    Existing(Found),
    /// It was appended as a new block.
    Appended(Loc),
}

impl Index {
    /// Applies one action of a batch.
    pub(super) fn apply_action(
        &mut self,
        worker: u32,
        action: &Action,
        lookups: &mut impl Lookups,
    ) {
        let holder = Holder::new(worker, action.tier);
        match action.kind {
            ActionKind::Report => self.report(holder, action, lookups),
            ActionKind::Revoke => self.revoke(holder, &action.hashes, lookups),
            ActionKind::ClearAllAtTier => self.clear(holder, lookups),
        }
    }

    /// REPORT: hashes that continue a run of stored blocks are gathered and updated a range at
    /// a time; new hashes are appended to the chunk that ends with the previous hash (or the
    /// chain hint's parent for the first), else to a new chunk.
    fn report<L: Lookups>(&mut self, holder: Holder, action: &Action, lookups: &mut L) {
        let mut prev: Option<Loc> = action
            .parent_block_hash
            .and_then(|parent| lookups.locate(&self.table, &self.chunks, parent))
            .map(Found::loc);
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
                let change = Change::Set(r.mask);
                self.update_range(r.chunk, r.begin, r.end, holder, change, lookups);
                prev = Some(r.last());
            }
            self.make_room(lookups);
            if L::WARMS && prev.is_some_and(|p| Some(p.chunk) == appended_to) {
                warmed = self.warm_ahead(&action.hashes, i, warmed);
            }
            let block = NewBlock {
                hash,
                placement: Placement { holder, mask },
                tokens,
                remaining: count - i,
            };
            match self.find_or_append(prev, block, lookups) {
                Stored::Existing(found) => {
                    if tokens > 0 {
                        self.chunks[found.chunk as usize].set_tokens(found.offset, tokens);
                    }
                    run = Some(Run::start(&self.chunks, found, mask));
                }
                Stored::Appended(loc) => {
                    prev = Some(loc);
                    if appended_to.is_some_and(|c| c != loc.chunk) {
                        self.trim_capacity(appended_to.take().expect("checked"));
                    }
                    appended_to = Some(loc.chunk);
                    self.count_new_block(holder, mask, loc.chunk);
                }
            }
        }
        if let Some(r) = run {
            let change = Change::Set(r.mask);
            self.update_range(r.chunk, r.begin, r.end, holder, change, lookups);
        }
        if let Some(chunk) = appended_to {
            self.trim_capacity(chunk);
        }
    }

    /// New blocks come in runs: keeps the table's home buckets of the next [`WARM_AHEAD`]
    /// hashes from `i` on loading (prefetched, from `warmed` on where those before were), so
    /// that their cache misses overlap all along the run; returns where the warmed stretch ends.
    fn warm_ahead(&self, hashes: &[i64], i: usize, warmed: usize) -> usize {
        let end = (i + WARM_AHEAD).min(hashes.len());
        for &hash in &hashes[warmed.max(i)..end] {
            self.table.prefetch(hash);
        }
        end
    }

    /// The live block `block.hash`, or else appends it after `prev` (see [`append_block`]) and
    /// gives it a table entry there.
    #[inline]
    fn find_or_append(
        &mut self,
        prev: Option<Loc>,
        block: NewBlock,
        lookups: &mut impl Lookups,
    ) -> Stored {
        let vacant = match lookups.look(&self.table, &self.chunks, block.hash) {
            Look::Live(found) => return Stored::Existing(found),
            Look::New(vacant) => vacant,
        };
        let loc = append_block(&mut self.chunks, &mut self.free_chunks, prev, block);
        if let Some(slot) = vacant {
            self.table.fill(slot, block.hash, loc);
        }
        Stored::Appended(loc)
    }

    /// Counts a block just appended to chunk `c` with `holder`'s placement.
    fn count_new_block(&mut self, holder: Holder, mask: u32, c: u32) {
        self.blocks += 1;
        self.placements += 1;
        self.workers[holder.worker() as usize].placements[holder.tier().index()] += 1;
        if mask != 0 {
            let w = holder.worker() as usize;
            self.workers[w].nonzero_masks += 1;
            self.profiles[w].may_fail_closed = true;
        }
        self.hold(holder, c);
    }

    /// REVOKE: consecutive hashes stored consecutively are removed a range at a time.
    fn revoke(&mut self, holder: Holder, hashes: &[i64], lookups: &mut impl Lookups) {
        let mut run: Option<Run> = None;
        for &hash in hashes {
            if let Some(r) = &mut run
                && r.extend(&self.chunks, hash)
            {
                continue;
            }
            if let Some(r) = run.take() {
                self.update_range(r.chunk, r.begin, r.end, holder, Change::Remove, lookups);
            }
            run = lookups
                .locate(&self.table, &self.chunks, hash)
                .map(|found| Run::start(&self.chunks, found, 0));
        }
        if let Some(r) = run {
            self.update_range(r.chunk, r.begin, r.end, holder, Change::Remove, lookups);
        }
    }

    /// CLEAR_ALL_AT_TIER: every chunk of the reverse holdings, whole.
    fn clear(&mut self, holder: Holder, lookups: &mut impl Lookups) {
        let holdings = std::mem::take(
            &mut self.workers[holder.worker() as usize].holdings[holder.tier().index()],
        );
        let mut last = None;
        for chunk in holdings.chunks {
            if last == Some(chunk) {
                continue;
            }
            last = Some(chunk);
            let len = self.chunks[chunk as usize].hashes.len() as u32;
            if len > 0 {
                self.update_range(chunk, 0, len, holder, Change::Remove, lookups);
            }
        }
    }

    /// Applies `change` for `holder` to positions `begin..end` of a chunk (all live for a
    /// `Set`), splitting pieces where the change starts or ends inside one, merging equal
    /// neighbours after, and tidying the chunk when blocks died.
    fn update_range(
        &mut self,
        c: u32,
        begin: u32,
        end: u32,
        holder: Holder,
        change: Change,
        lookups: &mut impl Lookups,
    ) {
        let chunk = &mut self.chunks[c as usize];
        let worker = &mut self.workers[holder.worker() as usize];
        let first = chunk.piece_at(begin);
        let mut i = first;
        let mut pos = begin;
        let mut gained = false;
        let mut died = false;
        while pos < end {
            let stop = (chunk.piece_end(i) as u32).min(end);
            let placements = &chunk.pieces[i].placements;
            let found = placements.binary_search_by_key(&holder, |p| p.holder);
            let old_mask = found.ok().map(|j| placements[j].mask);
            if change.alters(old_mask) {
                i = chunk.isolate(i, pos, stop);
                let len = (stop - pos) as usize;
                let placements = &mut chunk.pieces[i].placements;
                change.apply_to(placements, holder, found);
                if let Some(mask) = old_mask {
                    worker.nonzero_masks -= len * usize::from(mask != 0);
                }
                match change {
                    Change::Set(mask) => {
                        worker.nonzero_masks += len * usize::from(mask != 0);
                        if old_mask.is_none() {
                            self.placements += len;
                            worker.placements[holder.tier().index()] += len;
                            gained = true;
                        }
                    }
                    Change::Remove => {
                        self.placements -= len;
                        worker.placements[holder.tier().index()] -= len;
                        if placements.is_empty() {
                            died = true;
                            chunk.live -= len as u32;
                            self.blocks -= len;
                            if chunk.has_hits {
                                forget_hits(
                                    &mut self.hits,
                                    &chunk.hashes[pos as usize..stop as usize],
                                );
                            }
                        }
                    }
                }
            }
            pos = stop;
            i += 1;
        }
        chunk.merge_around(first, i);
        self.profiles[holder.worker() as usize].may_fail_closed = worker.nonzero_masks > 0;
        if gained {
            self.hold(holder, c);
        }
        if died {
            self.tidy(c, lookups);
        }
    }

    /// Notes in the reverse holdings that `holder` holds something in chunk `c`.
    fn hold(&mut self, holder: Holder, c: u32) {
        let holdings = &mut self.workers[holder.worker() as usize].holdings[holder.tier().index()];
        if holdings.chunks.last() == Some(&c) {
            return;
        }
        holdings.chunks.push(c);
        holdings.compact_if_doubled(&self.chunks, holder);
    }
}

/// Drops the hit counts of blocks that died.
fn forget_hits(hits: &mut HashMap<i64, u64, FxBuildHasher>, hashes: &[i64]) {
    for hash in hashes {
        hits.remove(hash);
    }
}
