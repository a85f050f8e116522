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
//! Most candidates are *steady*: a legacy worker held at every block so far, or a component-aware
//! worker whose spec has FULL alone. Whether such a one goes on depends only on its own
//! placements in the segment, and while it goes on its prefix is the end of the segments so far,
//! so it keeps no per-segment state. When the next segment is the next piece of the same chunk,
//! only workers whose placements differ between the two pieces can leave: the scan compares the
//! two pieces' placement arrays (equal stretches at memory speed) and looks at those workers
//! alone. A prompt whose shared prefix many workers hold to different depths (a piece boundary
//! at each depth) then costs O(pieces + candidates), not O(pieces × candidates). Every other
//! candidate steps over every segment.
//!
//! `blocks_read` counts the blocks examined: block 0 always, then each block while some
//! candidate is unsettled, up to `n`. Candidates settle only at the first block of a segment, so
//! the scan ends right there.

use std::cell::Cell;

use smallvec::SmallVec;

use crate::index::{Chunk, Found, Index, Placement};
use crate::types::{
    COMPONENT_FULL, COMPONENT_MAMBA, COMPONENT_SWA, PrefixAnswer, PrefixHit, PrefixHits,
    PrefixMatch, WorkerHandle,
};
use crate::validate::{ValidationError, validate_prefix};

/// Scratch capacity (bytes) a thread keeps between scans; a larger scan's is freed after it.
const SCRATCH_KEEP_BYTES: usize = 1 << 20;

/// Placements of lower workers skipped one by one before a binary search takes over (see
/// [`take_worker`]).
const LINEAR_SKIP: usize = 8;

/// Answers with more matches than this, naming at least one in [`DENSE_SPREAD`] of the
/// index's workers, are ordered by bucketing ranks rather than sorted (see `Index::hits`).
const BUCKET_MIN_MATCHES: usize = 64;
const DENSE_SPREAD: usize = 16;
/// The most distinct prefix lengths bucketing takes; more, and the answer is sorted.
const MAX_LENGTHS: usize = 32;

/// The per-candidate scan state.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    /// The worker's dense index in the index.
    worker: u32,
    /// The worker's rank (its position in worker-id order): the answer's tie-break.
    rank: u32,
    prefix: u32,
    rule: Rule,
}

#[derive(Debug, Clone, Copy)]
enum Rule {
    /// A legacy worker past its first gap (its prefix is set there) that holds a non-zero mask
    /// somewhere: it fails closed (prefix 0) at the first block showing one. Legacy workers
    /// before their first gap are steady candidates.
    LegacyPastGap,
    Aware {
        components: u8,
        /// Component bits servable per tier index.
        servable: [u8; 3],
        swa_window: u32,
        swa_broken: bool,
        /// Saturates, like the window it is compared with.
        swa_run: u32,
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

/// The placements of `worker` at the front of `rest` (sorted by holder, so by worker), after
/// dropping those of lower workers; `rest` moves past them. Candidates come in worker order
/// too, so one segment costs O(candidates + placements) at most, and a few candidates facing a
/// crowded piece binary-search past the workers in between.
#[inline(always)]
fn take_worker<'p>(rest: &mut &'p [Placement], worker: u32) -> &'p [Placement] {
    let all = *rest;
    let mut skip = 0;
    while skip < all.len() && all[skip].worker() < worker {
        skip += 1;
        if skip == LINEAR_SKIP {
            skip += all[skip..].partition_point(|p| p.worker() < worker);
            break;
        }
    }
    let from = &all[skip..];
    let held = from.iter().take_while(|p| p.worker() == worker).count();
    let (mine, after) = from.split_at(held);
    *rest = after;
    mine
}

/// A steady candidate (see the module docs): goes on while its placements allow, with its
/// prefix the end of the segments so far.
#[derive(Debug, Clone, Copy)]
struct Steady {
    worker: u32,
    rank: u32,
    /// The servable component bits per tier index of a FULL-only aware worker; none: legacy.
    servable: Option<[u8; 3]>,
    /// A legacy worker holding a non-zero mask somewhere: at a gap it goes on as a general
    /// candidate (it may still fail closed).
    may_fail_closed: bool,
    /// Left at an earlier segment: skipped, and dropped at the next compaction.
    gone: bool,
}

/// What a steady candidate's placements in a segment mean for it.
enum Verdict {
    Stays,
    /// Its prefix ends where the segment starts.
    Leaves,
    /// A legacy worker showing a non-zero mask: prefix 0.
    FailsClosed,
}

impl Steady {
    #[inline]
    fn judge(&self, mine: &[Placement]) -> Verdict {
        match self.servable {
            None if mine.iter().any(|p| p.mask != 0) => Verdict::FailsClosed,
            None if mine.is_empty() => Verdict::Leaves,
            None => Verdict::Stays,
            Some(servable) => {
                let full = mine
                    .iter()
                    .any(|p| p.mask & u32::from(servable[p.tier().index()]) & COMPONENT_FULL != 0);
                if full {
                    Verdict::Stays
                } else {
                    Verdict::Leaves
                }
            }
        }
    }
}

impl Candidate {
    /// Records this settled candidate's answer, when it has a prefix.
    #[inline]
    fn finish(&self, matched: &mut Vec<Matched>) {
        if self.prefix > 0 {
            matched.push(Matched {
                rank: self.rank,
                prefix: self.prefix,
            });
        }
    }

    /// Advances over the segment (every block of it alike), given this worker's placements of
    /// it; returns whether the candidate is now settled (at the segment's first block).
    #[inline]
    fn step(&mut self, mine: &[Placement], segment: &mut Segment<'_>) -> bool {
        match &mut self.rule {
            Rule::LegacyPastGap => {
                let fails_closed = mine.iter().any(|p| p.mask != 0);
                if fails_closed {
                    self.prefix = 0;
                }
                fails_closed
            }
            Rule::Aware {
                components,
                servable,
                swa_window,
                swa_broken,
                swa_run,
            } => {
                let available = mine.iter().fold(0, |bits, p| {
                    bits | (p.mask & u32::from(servable[p.tier().index()]))
                });
                if available & COMPONENT_FULL == 0 {
                    return true;
                }
                // Within the segment the SWA run only grows, so its last block is a boundary
                // whenever any of its blocks is.
                let components = u32::from(*components);
                let mut boundary = true;
                if components & COMPONENT_SWA != 0 {
                    if available & COMPONENT_SWA != 0 {
                        let tokens = u32::try_from(segment.tokens()).unwrap_or(u32::MAX);
                        *swa_run = swa_run.saturating_add(tokens);
                    } else {
                        *swa_run = 0;
                        *swa_broken = true;
                    }
                    boundary &= !*swa_broken || *swa_run >= *swa_window;
                }
                if components & COMPONENT_MAMBA != 0 {
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

/// How many leading elements `a` and `b` share, comparing `key`s eight at a time (which the
/// compiler vectorizes).
#[inline]
fn common_prefix<T>(a: &[T], b: &[T], key: impl Fn(&T) -> u64) -> usize {
    const LANES: usize = 8;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut same = 0;
    for (x, y) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        let diff = x
            .iter()
            .zip(y)
            .fold(0, |acc, (x, y)| acc | (key(x) ^ key(y)));
        if diff != 0 {
            break;
        }
        same += LANES;
    }
    same + a[same..]
        .iter()
        .zip(&b[same..])
        .take_while(|(x, y)| key(x) == key(y))
        .count()
}

/// Calls `changed` with every worker whose placements differ between `a` and `b` (each sorted
/// by holder), in worker order, maybe more than once. Equal stretches cost a vector compare.
#[inline]
fn for_each_changed(a: &[Placement], b: &[Placement], mut changed: impl FnMut(u32)) {
    let (mut i, mut k) = (0, 0);
    loop {
        let same = common_prefix(&a[i..], &b[k..], |p| p.key());
        i += same;
        k += same;
        match (a.get(i), b.get(k)) {
            (None, None) => return,
            (Some(x), None) => {
                changed(x.worker());
                i += 1;
            }
            (None, Some(y)) => {
                changed(y.worker());
                k += 1;
            }
            (Some(x), Some(y)) => {
                changed(x.worker().min(y.worker()));
                if x.holder <= y.holder {
                    i += 1;
                }
                if y.holder <= x.holder {
                    k += 1;
                }
            }
        }
    }
}

/// A worker with a prefix, as the answer is ordered: by length (longest first), then rank.
#[derive(Debug, Clone, Copy)]
struct Matched {
    rank: u32,
    prefix: u32,
}

/// A scan's working memory. The workers holding `hashes[0]` are its candidates: those still
/// unsettled (in worker order), and the settled ones with a prefix. Each thread keeps one
/// between scans (see [`Candidates::take`]), so that a scan allocates only its answer.
#[derive(Default)]
struct Candidates {
    /// Steady candidates, in worker order, some `gone`.
    steady: Vec<Steady>,
    /// Steady candidates not gone.
    steady_left: usize,
    /// The other unsettled candidates, in worker order.
    active: Vec<Candidate>,
    matched: Vec<Matched>,
    /// For ordering the answer (see `Index::hits`).
    keys: Vec<u64>,
    bucket_at_rank: Vec<u8>,
}

thread_local! {
    static SCRATCH: Cell<Candidates> = Cell::new(Candidates::default());
}

impl Candidates {
    /// This thread's scratch, empty (a fresh one if a scan on this thread already holds it).
    fn take() -> Candidates {
        SCRATCH.with(Cell::take)
    }

    /// Hands the scratch back to this thread, keeping its capacity when small.
    fn put_back(mut self) {
        let bytes = self.steady.capacity() * size_of::<Steady>()
            + self.active.capacity() * size_of::<Candidate>()
            + self.matched.capacity() * size_of::<Matched>()
            + self.keys.capacity() * size_of::<u64>()
            + self.bucket_at_rank.capacity();
        if bytes <= SCRATCH_KEEP_BYTES {
            self.steady.clear();
            self.steady_left = 0;
            self.active.clear();
            self.matched.clear();
            self.keys.clear();
            self.bucket_at_rank.clear();
            SCRATCH.with(|scratch| scratch.set(self));
        }
    }

    /// Takes every unsettled candidate over the segment, whose blocks have `placements`;
    /// `previous` is the previous segment's placements when this segment is the next piece of
    /// the same chunk. Returns whether all are now settled.
    #[inline]
    fn settle(
        &mut self,
        placements: &[Placement],
        previous: Option<&[Placement]>,
        segment: &mut Segment<'_>,
    ) -> bool {
        if self.steady_left > 0 {
            match previous {
                Some(previous) => self.settle_changed(previous, placements, segment.start),
                None => self.settle_steady(placements, segment.start),
            }
        }
        if !self.active.is_empty() {
            self.settle_active(placements, segment);
        }
        self.steady_left == 0 && self.active.is_empty()
    }

    /// Judges every steady candidate by its placements in the segment starting at `start`.
    fn settle_steady(&mut self, placements: &[Placement], start: u32) {
        if placements.is_empty() {
            // Nobody holds the segment: every one leaves.
            let steady = std::mem::take(&mut self.steady);
            for candidate in steady.iter().filter(|c| !c.gone) {
                self.leave(*candidate, Verdict::Leaves, start);
            }
            self.steady = steady;
            self.steady.clear();
            self.steady_left = 0;
            return;
        }
        let mut rest = placements;
        let mut kept = 0;
        for i in 0..self.steady.len() {
            let candidate = self.steady[i];
            if candidate.gone {
                continue;
            }
            let verdict = candidate.judge(take_worker(&mut rest, candidate.worker));
            if let Verdict::Stays = verdict {
                self.steady[kept] = candidate;
                kept += 1;
            } else {
                self.leave(candidate, verdict, start);
            }
        }
        self.steady.truncate(kept);
        self.steady_left = kept;
    }

    /// Judges the steady candidates whose placements changed from `previous` (where every
    /// steady candidate stayed) to `placements`, in the segment starting at `start`.
    fn settle_changed(&mut self, previous: &[Placement], placements: &[Placement], start: u32) {
        let mut last = None;
        let mut gone = 0;
        for_each_changed(previous, placements, |worker| {
            if last == Some(worker) {
                return;
            }
            last = Some(worker);
            let Ok(i) = self.steady.binary_search_by_key(&worker, |c| c.worker) else {
                return;
            };
            let candidate = self.steady[i];
            if candidate.gone {
                return;
            }
            let from = placements.partition_point(|p| p.worker() < worker);
            let mut rest = &placements[from..];
            let verdict = candidate.judge(take_worker(&mut rest, worker));
            if !matches!(verdict, Verdict::Stays) {
                self.steady[i].gone = true;
                gone += 1;
                self.leave(candidate, verdict, start);
            }
        });
        self.steady_left -= gone;
        // Compact once the gone outnumber the left, so that lookups stay short.
        if self.steady.len() > 2 * self.steady_left {
            self.steady.retain(|c| !c.gone);
        }
    }

    /// A steady candidate leaves at the segment starting at `start`.
    #[inline]
    fn leave(&mut self, candidate: Steady, verdict: Verdict, start: u32) {
        match verdict {
            Verdict::Stays | Verdict::FailsClosed => {}
            Verdict::Leaves if candidate.may_fail_closed => {
                // A legacy worker at its first gap that may still fail closed.
                let general = Candidate {
                    worker: candidate.worker,
                    rank: candidate.rank,
                    prefix: start,
                    rule: Rule::LegacyPastGap,
                };
                let at = self.active.partition_point(|c| c.worker < candidate.worker);
                self.active.insert(at, general);
            }
            Verdict::Leaves if start > 0 => self.matched.push(Matched {
                rank: candidate.rank,
                prefix: start,
            }),
            Verdict::Leaves => {}
        }
    }

    /// Steps every general candidate over the segment.
    fn settle_active(&mut self, placements: &[Placement], segment: &mut Segment<'_>) {
        let mut rest = placements;
        let mut kept = 0;
        for i in 0..self.active.len() {
            let candidate = &mut self.active[i];
            let mine = take_worker(&mut rest, candidate.worker);
            if candidate.step(mine, segment) {
                candidate.finish(&mut self.matched);
            } else {
                self.active.swap(kept, i);
                kept += 1;
            }
        }
        self.active.truncate(kept);
    }

    /// The scan ended at `end`: every candidate left is settled where it stands.
    fn finish(&mut self, end: u32) {
        for candidate in &self.active {
            candidate.finish(&mut self.matched);
        }
        for candidate in self.steady.iter().filter(|c| !c.gone) {
            self.matched.push(Matched {
                rank: candidate.rank,
                prefix: end,
            });
        }
    }
}

impl Index {
    /// Answers `MatchExternalKvPrefix` over `min(len, max_blocks or ∞)` blocks, naming workers
    /// by handle (see [`Index::worker_address`] and [`Index::worker_id`]): one allocation, for
    /// the answer's vector, and none per match.
    pub fn match_prefix_hits(
        &self,
        hashes: &[i64],
        max_blocks: u32,
    ) -> Result<PrefixHits, ValidationError> {
        validate_prefix(hashes)?;
        let n = match max_blocks {
            0 => hashes.len(),
            max => hashes.len().min(max as usize),
        };
        let Some(first) = self.locate(hashes[0]) else {
            return Ok(PrefixHits {
                blocks_read: 1,
                ..PrefixHits::default()
            });
        };
        let mut candidates = Candidates::take();
        let blocks_read = self.scan(hashes, n, first, &mut candidates);
        candidates.finish(n as u32);
        let hits = self.hits(&mut candidates, blocks_read as u32);
        candidates.put_back();
        Ok(hits)
    }

    /// [`Index::match_prefix_hits`] with the workers' strings: the answer as the contract
    /// words it.
    pub fn match_prefix(
        &self,
        hashes: &[i64],
        max_blocks: u32,
    ) -> Result<PrefixAnswer, ValidationError> {
        Ok(self.prefix_answer(&self.match_prefix_hits(hashes, max_blocks)?))
    }

    /// An answer of this index with its workers' strings.
    pub fn prefix_answer(&self, hits: &PrefixHits) -> PrefixAnswer {
        PrefixAnswer {
            matches: hits
                .matches
                .iter()
                .map(|hit| PrefixMatch {
                    worker_address: self.worker_address(hit.worker).to_owned(),
                    matched_prefix_blocks: hit.matched_prefix_blocks,
                    worker_id: self.worker_id(hit.worker).to_owned(),
                })
                .collect(),
            best_prefix_blocks: hits.best_prefix_blocks,
            blocks_read: hits.blocks_read,
        }
    }

    /// The id of a worker an answer named.
    pub fn worker_id(&self, worker: WorkerHandle) -> &str {
        &self.workers[worker.0 as usize].id
    }

    /// The address of a worker an answer named, as of this index's state.
    pub fn worker_address(&self, worker: WorkerHandle) -> &str {
        &self.workers[worker.0 as usize].address
    }

    /// Makes a candidate of every worker holding the first segment's blocks (`placements`), in
    /// worker order, and steps it over that segment; returns whether all are now settled.
    #[inline]
    fn enlist(
        &self,
        candidates: &mut Candidates,
        placements: &[Placement],
        segment: &mut Segment<'_>,
    ) -> bool {
        candidates.steady.reserve(placements.len());
        candidates.matched.reserve(placements.len());
        let mut rest = placements;
        while let Some(next) = rest.first() {
            let worker = next.worker();
            let mine = take_worker(&mut rest, worker);
            // A worker settled before the scan has prefix 0: nothing to record.
            match self.candidate(worker) {
                None => {}
                Some(Enlisted::Steady(candidate)) => {
                    // Leaving at block 0 also means prefix 0.
                    if let Verdict::Stays = candidate.judge(mine) {
                        candidates.steady.push(candidate);
                    }
                }
                Some(Enlisted::General(mut candidate)) => {
                    if candidate.step(mine, segment) {
                        candidate.finish(&mut candidates.matched);
                    } else {
                        candidates.active.push(candidate);
                    }
                }
            }
        }
        candidates.steady_left = candidates.steady.len();
        candidates.steady.is_empty() && candidates.active.is_empty()
    }

    /// Scans the first `n` query hashes a segment at a time, from block 0 stored at `first`,
    /// until every candidate is settled; returns `blocks_read`.
    #[inline]
    fn scan(&self, hashes: &[i64], n: usize, first: Found, candidates: &mut Candidates) -> usize {
        let mut at: Option<Found> = Some(first);
        let mut pos = 0usize;
        // The placements of the previous segment when `at` is the next piece of its chunk.
        let mut previous: Option<&[Placement]> = None;
        loop {
            let (mut segment, placements) = match at {
                Some(found) => {
                    let piece = &self.chunks[found.chunk as usize].pieces[found.piece as usize];
                    (
                        self.segment_at(found, hashes, pos, n),
                        &piece.placements[..],
                    )
                }
                None => (Segment::missing(pos), &[][..]),
            };
            let settled = if pos == 0 {
                self.enlist(candidates, placements, &mut segment)
            } else {
                candidates.settle(placements, previous, &mut segment)
            };
            if settled {
                return pos + 1;
            }
            let len = (segment.end - segment.start) as usize;
            pos += len;
            if pos >= n {
                return n;
            }
            let next = at.and_then(|found| self.next_piece(found, len, hashes[pos]));
            previous = next.map(|_| placements);
            at = next.or_else(|| self.locate(hashes[pos]));
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
            |&hash| hash as u64,
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

    /// The answer: the workers with a prefix, longest first, ties by rank (worker-id order).
    fn hits(&self, scratch: &mut Candidates, blocks_read: u32) -> PrefixHits {
        let matched = &scratch.matched;
        let mut matches: Vec<PrefixHit> = Vec::with_capacity(matched.len());
        if !self.hits_by_bucket(matched, &mut scratch.bucket_at_rank, &mut matches) {
            // Sorted as one packed key per match: longest first, then rank.
            let keys = &mut scratch.keys;
            keys.extend(
                matched
                    .iter()
                    .map(|m| (u64::from(!m.prefix) << 32) | u64::from(m.rank)),
            );
            keys.sort_unstable();
            matches.extend(keys.iter().map(|&key| PrefixHit {
                worker: WorkerHandle(self.by_rank[key as u32 as usize]),
                matched_prefix_blocks: !((key >> 32) as u32),
            }));
        }
        PrefixHits {
            best_prefix_blocks: matches.first().map_or(0, |m| m.matched_prefix_blocks),
            matches,
            blocks_read,
        }
    }

    /// Orders a large answer that names a good share of all workers, with few distinct prefix
    /// lengths (the usual shape: a shared system prompt held everywhere), without a sort: each
    /// rank gets its length's bucket in a byte per worker, and one walk in rank order places
    /// every match in its bucket. O(matches + workers), and workers are at most
    /// `DENSE_SPREAD` × matches here. Returns false, leaving `out` empty, for other answers.
    fn hits_by_bucket(
        &self,
        matched: &[Matched],
        bucket_at_rank: &mut Vec<u8>,
        out: &mut Vec<PrefixHit>,
    ) -> bool {
        if matched.len() <= BUCKET_MIN_MATCHES || self.workers.len() > DENSE_SPREAD * matched.len()
        {
            return false;
        }
        // The distinct lengths, longest first.
        let mut lengths: SmallVec<[u32; MAX_LENGTHS]> = SmallVec::new();
        let bucket_of = |lengths: &[u32], prefix: u32| lengths.binary_search_by(|l| prefix.cmp(l));
        let mut last = 0;
        for m in matched {
            if m.prefix == last {
                continue;
            }
            last = m.prefix;
            if let Err(at) = bucket_of(&lengths, m.prefix) {
                if lengths.len() == MAX_LENGTHS {
                    return false;
                }
                lengths.insert(at, m.prefix);
            }
        }
        // Per rank, its bucket + 1 (0: no match); then where each bucket starts in the answer.
        bucket_at_rank.resize(self.workers.len(), 0);
        let mut next = [0usize; MAX_LENGTHS];
        let (mut last, mut bucket) = (0, 0);
        for m in matched {
            if m.prefix != last {
                last = m.prefix;
                bucket = bucket_of(&lengths, m.prefix).unwrap_or_default();
            }
            bucket_at_rank[m.rank as usize] = bucket as u8 + 1;
            next[bucket] += 1;
        }
        let mut sum = 0;
        for start in &mut next[..lengths.len()] {
            (*start, sum) = (sum, sum + *start);
        }
        let unset = PrefixHit {
            worker: WorkerHandle(0),
            matched_prefix_blocks: 0,
        };
        out.resize(matched.len(), unset);
        for (rank, &bucket) in bucket_at_rank.iter().enumerate() {
            if bucket != 0 {
                let bucket = bucket as usize - 1;
                out[next[bucket]] = PrefixHit {
                    worker: WorkerHandle(self.by_rank[rank]),
                    matched_prefix_blocks: lengths[bucket],
                };
                next[bucket] += 1;
            }
        }
        true
    }

    /// The initial scan state of a worker; none when it is settled (at prefix 0) before the
    /// scan starts.
    #[inline]
    fn candidate(&self, worker: u32) -> Option<Enlisted> {
        let profile = &self.profiles[worker as usize];
        if profile.inert {
            return None;
        }
        let steady = |servable: Option<[u8; 3]>| {
            Enlisted::Steady(Steady {
                worker,
                rank: profile.rank,
                // Only the legacy rules fail closed.
                may_fail_closed: servable.is_none() && profile.may_fail_closed,
                servable,
                gone: false,
            })
        };
        let rule = match profile.aware {
            None => return Some(steady(None)),
            Some(spec) if u32::from(spec.components) & (COMPONENT_SWA | COMPONENT_MAMBA) == 0 => {
                return Some(steady(Some(spec.servable)));
            }
            Some(spec) => Rule::Aware {
                components: spec.components,
                servable: spec.servable,
                swa_window: spec.swa_window,
                swa_broken: false,
                swa_run: 0,
            },
        };
        Some(Enlisted::General(Candidate {
            worker,
            rank: profile.rank,
            prefix: 0,
            rule,
        }))
    }
}

/// A worker made a candidate.
enum Enlisted {
    Steady(Steady),
    General(Candidate),
}
