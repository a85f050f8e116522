//! `MatchExternalKvPrefix`: the longest reusable prefix per worker, in one forward scan.
//!
//! Candidates are the holders of `hashes[0]`. Each keeps O(1) state and is *settled* once nothing
//! later can change its answer; the scan stops when every candidate is settled:
//! - a worker with an empty address or an invalid spec is settled before the scan (prefix 0);
//! - a component-aware worker at its first block without servable FULL;
//! - a legacy worker at its first gap when it holds no non-zero mask anywhere, or at the first
//!   considered block where it shows a non-zero mask (it then fails closed with prefix 0).
//!
//! The scan goes a *segment* at a time: a stretch of the query that matches consecutive
//! positions of one piece of a chunk (see `index`). After one hash-table probe for its first
//! hash, a segment is found by comparing the query with the chunk's hash array; every block in it
//! has the same placements, so each candidate steps over the whole segment at once (only SWA needs
//! the segment's token sum, and only the run after the segment decides its boundary). When a
//! segment ends at the end of its piece, the next piece of the same chunk is tried before probing
//! again. A query hash nobody holds is a segment of one block without placements.
//!
//! `blocks_read` counts the blocks examined: block 0 always, then each block while some
//! candidate is unsettled, up to `n`. Candidates settle only at the first block of a segment, so
//! the scan ends right there.

use smallvec::{SmallVec, smallvec};

use crate::index::{Chunk, Found, Index, Placement};
use crate::types::{
    COMPONENT_FULL, COMPONENT_MAMBA, COMPONENT_SWA, PrefixAnswer, PrefixMatch, Tier,
};
use crate::validate::{ValidationError, validate_prefix};

const NO_SLOT: u32 = u32::MAX;

/// Scratch kept on the stack up to these sizes (see `Index::answer`): the worker -> candidate
/// map has one entry per worker ever seen (so it is on the heap, and filled at O(workers) cost,
/// in every query of an index that has seen more than `INLINE_WORKERS`); the per-candidate
/// vectors spill beyond `INLINE_CANDIDATES` holders of the first block.
const INLINE_WORKERS: usize = 256;
const INLINE_CANDIDATES: usize = 128;

/// The per-candidate scan state.
#[derive(Debug, Clone)]
struct Candidate {
    /// The worker's rank (its position in worker-id order).
    rank: u32,
    rule: Rule,
    prefix: u32,
    /// What this candidate holds in the segment being examined, valid when `seen_at` is its
    /// first position + 1.
    seen_at: u32,
    held: bool,
    nonzero: bool,
    available: u32,
}

#[derive(Debug, Clone)]
enum Rule {
    Legacy {
        /// Whether the worker holds a non-zero mask anywhere: then it cannot settle at a gap.
        may_fail_closed: bool,
        gap: bool,
    },
    Aware {
        components: u32,
        swa_window: u64,
        /// Component bits servable per tier index.
        servable: [u32; 3],
        swa_run: u64,
        swa_broken: bool,
    },
}

/// The segment being examined: query positions `start..end`, stored at `offset..` of `chunk`
/// (none when the block does not exist).
struct Segment<'a> {
    start: u32,
    end: u32,
    chunk: Option<&'a Chunk>,
    offset: usize,
    /// The token sum, computed on first need.
    tokens: Option<u64>,
}

impl Segment<'_> {
    /// A query hash nobody holds: one block without placements.
    fn missing(pos: usize) -> Segment<'static> {
        Segment {
            start: pos as u32,
            end: pos as u32 + 1,
            chunk: None,
            offset: 0,
            tokens: None,
        }
    }

    fn tokens(&mut self) -> u64 {
        *self.tokens.get_or_insert_with(|| {
            self.chunk.map_or(0, |chunk| {
                let len = (self.end - self.start) as usize;
                chunk.token_sum(self.offset, self.offset + len)
            })
        })
    }
}

impl Candidate {
    /// Folds one placement of the segment being examined into this candidate's view of it.
    fn observe(&mut self, stamp: u32, tier: Tier, mask: u32) {
        if self.seen_at != stamp {
            self.seen_at = stamp;
            self.held = false;
            self.nonzero = false;
            self.available = 0;
        }
        self.held = true;
        self.nonzero |= mask != 0;
        if let Rule::Aware { servable, .. } = &self.rule {
            self.available |= mask & servable[tier.index()];
        }
    }

    /// Advances over the segment (every block of it alike); returns whether the candidate is
    /// now settled (at the segment's first block).
    fn step(&mut self, segment: &mut Segment<'_>) -> bool {
        let seen = self.seen_at == segment.start + 1;
        let (held, nonzero, available) = if seen {
            (self.held, self.nonzero, self.available)
        } else {
            (false, false, 0)
        };
        match &mut self.rule {
            Rule::Legacy {
                may_fail_closed,
                gap,
            } => {
                if nonzero {
                    self.prefix = 0;
                    return true;
                }
                if held && !*gap {
                    self.prefix = segment.end;
                    return false;
                }
                if !held {
                    *gap = true;
                }
                !*may_fail_closed
            }
            Rule::Aware {
                components,
                swa_window,
                swa_run,
                swa_broken,
                ..
            } => {
                if available & COMPONENT_FULL == 0 {
                    return true;
                }
                // Within the segment the SWA run only grows, so its last block is a boundary
                // whenever any of its blocks is.
                let mut boundary = true;
                if *components & COMPONENT_SWA != 0 {
                    if available & COMPONENT_SWA != 0 {
                        *swa_run = swa_run.saturating_add(segment.tokens());
                    } else {
                        *swa_run = 0;
                        *swa_broken = true;
                    }
                    boundary &= !*swa_broken || *swa_run >= *swa_window;
                }
                if *components & COMPONENT_MAMBA != 0 {
                    boundary &= available & COMPONENT_MAMBA != 0;
                }
                if boundary {
                    self.prefix = segment.end;
                }
                false
            }
        }
    }
}

/// How many leading elements `a` and `b` share.
fn common_prefix(a: &[i64], b: &[i64]) -> usize {
    const LANES: usize = 8;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut same = 0;
    for (x, y) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        let diff = x.iter().zip(y).fold(0, |acc, (x, y)| acc | (x ^ y));
        if diff != 0 {
            break;
        }
        same += LANES;
    }
    same + a[same..]
        .iter()
        .zip(&b[same..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// The scan's candidates: the workers holding `hashes[0]`, in worker order.
struct Candidates {
    /// Per worker (dense index), its slot in `all`, or `NO_SLOT`. O(workers ever seen): on the
    /// heap beyond `INLINE_WORKERS`.
    slot_of: SmallVec<[u32; INLINE_WORKERS]>,
    all: SmallVec<[Candidate; INLINE_CANDIDATES]>,
    /// Slots of the unsettled candidates.
    active: SmallVec<[u32; INLINE_CANDIDATES]>,
}

impl Candidates {
    /// Folds the placements of the segment starting at query position `stamp - 1` into the
    /// candidates' views of it.
    #[inline]
    fn observe(&mut self, placements: &[Placement], stamp: u32) {
        for placement in placements {
            let slot = self.slot_of[placement.worker() as usize];
            if slot != NO_SLOT {
                self.all[slot as usize].observe(stamp, placement.tier(), placement.mask);
            }
        }
    }

    /// Steps every unsettled candidate over the segment; returns whether all are now settled.
    #[inline]
    fn settle(&mut self, segment: &mut Segment<'_>) -> bool {
        let all = &mut self.all;
        self.active
            .retain(|slot| !all[*slot as usize].step(segment));
        self.active.is_empty()
    }
}

impl Index {
    /// Answers `MatchExternalKvPrefix` over `min(len, max_blocks or ∞)` blocks.
    pub fn match_prefix(
        &self,
        hashes: &[i64],
        max_blocks: u32,
    ) -> Result<PrefixAnswer, ValidationError> {
        validate_prefix(hashes)?;
        let n = match max_blocks {
            0 => hashes.len(),
            max => hashes.len().min(max as usize),
        };
        let Some(first) = self.locate(hashes[0]) else {
            return Ok(PrefixAnswer {
                blocks_read: 1,
                ..PrefixAnswer::default()
            });
        };
        let mut candidates = Candidates {
            slot_of: smallvec![NO_SLOT; self.workers.len()],
            all: SmallVec::new(),
            active: SmallVec::new(),
        };
        self.enlist(&mut candidates, first);
        let blocks_read = self.scan(hashes, n, first, &mut candidates);
        Ok(self.answer(&candidates.all, blocks_read as u32))
    }

    /// Makes a candidate of every worker holding the first block (`first`).
    fn enlist(&self, candidates: &mut Candidates, first: Found) {
        let first_piece = &self.chunks[first.chunk as usize].pieces[first.piece as usize];
        for placement in &first_piece.placements {
            let worker = placement.worker();
            if candidates.slot_of[worker as usize] != NO_SLOT {
                continue;
            }
            candidates.slot_of[worker as usize] = candidates.all.len() as u32;
            let (candidate, settled) = self.candidate(worker);
            if !settled {
                candidates.active.push(candidates.all.len() as u32);
            }
            candidates.all.push(candidate);
        }
    }

    /// Scans the first `n` query hashes a segment at a time, from block 0 stored at `first`,
    /// until every candidate is settled; returns `blocks_read`.
    #[inline]
    fn scan(&self, hashes: &[i64], n: usize, first: Found, candidates: &mut Candidates) -> usize {
        let mut at: Option<Found> = Some(first);
        let mut pos = 0usize;
        loop {
            let mut segment = Segment::missing(pos);
            if let Some(found) = at {
                segment = self.segment_at(found, hashes, pos, n);
                let piece = &self.chunks[found.chunk as usize].pieces[found.piece as usize];
                candidates.observe(&piece.placements, pos as u32 + 1);
            }
            if candidates.settle(&mut segment) {
                return pos + 1;
            }
            let len = (segment.end - segment.start) as usize;
            pos += len;
            if pos >= n {
                return n;
            }
            at = at
                .and_then(|found| self.next_piece(found, len, hashes[pos]))
                .or_else(|| self.locate(hashes[pos]));
        }
    }

    /// The segment at query position `pos`, whose block is stored at `found`: the query is
    /// compared with the chunk's hashes up to the end of the piece (and of the `n` blocks).
    #[inline]
    fn segment_at(&self, found: Found, hashes: &[i64], pos: usize, n: usize) -> Segment<'_> {
        let chunk = &self.chunks[found.chunk as usize];
        let offset = found.offset as usize;
        let piece_end = chunk.piece_end(found.piece as usize);
        let limit = (piece_end - offset).min(n - pos);
        let len = 1 + common_prefix(
            &hashes[pos + 1..pos + limit],
            &chunk.hashes[offset + 1..offset + limit],
        );
        Segment {
            start: pos as u32,
            end: (pos + len) as u32,
            chunk: Some(chunk),
            offset,
            tokens: None,
        }
    }

    /// Where the query goes on after a segment of `len` blocks stored from `found`, when it ran
    /// to the end of its piece and the next piece of the same chunk is live and stores `hash`
    /// next; otherwise `None` (the caller probes).
    #[inline]
    fn next_piece(&self, found: Found, len: usize, hash: i64) -> Option<Found> {
        let chunk = &self.chunks[found.chunk as usize];
        let next = found.offset as usize + len;
        let piece = found.piece as usize + 1;
        (next == chunk.piece_end(found.piece as usize)
            && chunk.hashes.get(next) == Some(&hash)
            && !chunk.pieces[piece].placements.is_empty())
        .then_some(Found {
            chunk: found.chunk,
            offset: next as u32,
            piece: piece as u32,
        })
    }

    /// The answer: candidates with a prefix, longest first, ties by rank (worker-id order).
    fn answer(&self, candidates: &[Candidate], blocks_read: u32) -> PrefixAnswer {
        // One packed key per match.
        let mut order: SmallVec<[u64; INLINE_CANDIDATES]> = candidates
            .iter()
            .filter(|c| c.prefix > 0)
            .map(|c| (u64::from(!c.prefix) << 32) | u64::from(c.rank))
            .collect();
        order.sort_unstable();
        // The answer's strings are cloned before its vector is allocated: all scratch so far is
        // on the stack (within the `INLINE_*` sizes), so the strings reuse the previous answer's freed ones straight from the
        // allocator's small-size caches, and the one large request comes last (glibc would
        // otherwise first consolidate every cached small chunk).
        let strings: SmallVec<[(String, String); INLINE_CANDIDATES]> = order
            .iter()
            .map(|&key| {
                let worker = &self.workers[self.by_rank[key as u32 as usize] as usize];
                (worker.address.clone(), worker.id.clone())
            })
            .collect();
        let mut matches = Vec::with_capacity(order.len());
        for (key, (worker_address, worker_id)) in order.into_iter().zip(strings) {
            matches.push(PrefixMatch {
                worker_address,
                matched_prefix_blocks: !((key >> 32) as u32),
                worker_id,
            });
        }
        PrefixAnswer {
            best_prefix_blocks: matches.first().map_or(0, |m| m.matched_prefix_blocks),
            matches,
            blocks_read,
        }
    }

    /// The initial scan state of a worker, and whether it is settled (at prefix 0) before the
    /// scan starts.
    fn candidate(&self, worker: u32) -> (Candidate, bool) {
        let w = &self.workers[worker as usize];
        let (rule, settled) = match w.spec {
            None => (
                Rule::Legacy {
                    may_fail_closed: w.nonzero_masks > 0,
                    gap: false,
                },
                false,
            ),
            Some(spec) => (
                Rule::Aware {
                    components: spec.components,
                    swa_window: u64::from(spec.swa_window_tokens),
                    servable: Tier::ALL.map(|tier| spec.servable_components(tier)),
                    swa_run: 0,
                    swa_broken: false,
                },
                !spec.is_valid(),
            ),
        };
        let candidate = Candidate {
            rank: w.rank,
            rule,
            prefix: 0,
            seen_at: 0,
            held: false,
            nonzero: false,
            available: 0,
        };
        (candidate, settled || w.address.is_empty())
    }
}
