//! `Index::check_invariants`: every internal invariant checked against a recount, for tests.

use crate::table::Loc;

use super::layout::Lookup;

use super::Index;
use super::layout::{Chunk, Tokens};

/// What the chunks say, recounted.
struct Recount {
    blocks: usize,
    placements: usize,
    /// Per worker: placements with a non-zero mask.
    nonzero: Vec<usize>,
    /// Per worker and tier: placements.
    per_tier: Vec<[usize; 3]>,
    /// Per worker and tier: the chunks where it holds something.
    held: Vec<[Vec<u32>; 3]>,
}

impl Index {
    /// Checks every internal invariant against a recount; panics on the first violation. For
    /// tests (O(size of the index)).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut recount = Recount {
            blocks: 0,
            placements: 0,
            nonzero: vec![0; self.workers.len()],
            per_tier: vec![[0; 3]; self.workers.len()],
            held: vec![Default::default(); self.workers.len()],
        };
        for (c, chunk) in self.chunks.iter().enumerate() {
            self.check_chunk(c, chunk, &mut recount);
        }
        self.check_ranks();
        assert_eq!(self.blocks, recount.blocks, "live blocks");
        assert_eq!(self.placements, recount.placements, "placements");
        self.check_workers(&recount);
        for &hash in self.hits.keys() {
            assert!(
                self.locate(hash).is_some(),
                "hit count of dead block {hash}"
            );
        }
    }

    /// One chunk's shape, pieces and table entries; adds what it holds to `recount`.
    fn check_chunk(&self, c: usize, chunk: &Chunk, recount: &mut Recount) {
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
            return;
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
            recount.placements += len * piece.placements.len();
            for p in &piece.placements {
                recount.nonzero[p.worker() as usize] += len * usize::from(p.mask != 0);
                recount.per_tier[p.worker() as usize][p.tier().index()] += len;
                recount.held[p.worker() as usize][p.tier().index()].push(c as u32);
            }
            for offset in piece.begin as usize..end {
                let hash = chunk.hashes[offset];
                assert_eq!(
                    match super::layout::lookup(&self.table, &self.chunks, hash) {
                        Lookup::Live(found) => Some(found.loc()),
                        Lookup::Vacant(_) => None,
                    },
                    Some(Loc {
                        chunk: c as u32,
                        offset: offset as u32
                    }),
                    "table entry of live block {hash}"
                );
                let loc = Loc {
                    chunk: c as u32,
                    offset: offset as u32,
                };
                self.table.check_displacement(hash, loc);
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
        recount.blocks += live;
    }

    /// `by_rank` lists every worker in worker-id order, and each knows its rank.
    fn check_ranks(&self) {
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
    }

    /// Each worker's non-zero-mask count, and reverse holdings covering every chunk it holds.
    fn check_workers(&self, recount: &Recount) {
        for (w, worker) in self.workers.iter().enumerate() {
            assert_eq!(
                worker.nonzero_masks, recount.nonzero[w],
                "non-zero masks of worker {w}"
            );
            assert_eq!(
                worker.placements, recount.per_tier[w],
                "placements per tier of worker {w}"
            );
            assert_eq!(
                self.profiles[w],
                super::ScanProfile::of(worker),
                "scan profile of worker {w}"
            );
            for (tier, chunks) in recount.held[w].iter().enumerate() {
                for c in chunks {
                    assert!(
                        worker.holdings[tier].chunks.contains(c),
                        "holdings of worker {w} tier {tier} miss chunk {c}"
                    );
                }
            }
        }
    }
}
