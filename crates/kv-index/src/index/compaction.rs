//! Lazy deletion's clean-up: purging stale table entries, trimming and compacting chunks,
//! freeing empty ones, and compacting reverse holdings.

use super::layout::{Chunk, Holder, Holdings, Piece, Tokens, found_at};
use super::{CHUNK_COMPACTION_SLACK, HOLDINGS_COMPACTION_SLACK, Index};

impl Index {
    /// After blocks of chunk `c` died: frees it when nothing is live, trims a dead end, and
    /// compacts it when dead positions outweigh live ones.
    pub(super) fn tidy(&mut self, c: u32) {
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
    pub(super) fn trim_capacity(&mut self, c: u32) {
        let chunk = &mut self.chunks[c as usize];
        if chunk.hashes.capacity() > chunk.hashes.len() + chunk.hashes.len() / 8 + 4 {
            chunk.hashes.shrink_to_fit();
            chunk.tokens.shrink();
        }
    }

    /// Before a new table entry: drops stale entries when they are over a quarter of the table,
    /// and grows it when it is still full.
    pub(super) fn make_room(&mut self) {
        if self.table.is_full() {
            if self.stale > self.table.len() / 4 {
                self.purge();
            }
            if self.table.is_full() {
                self.table.grow();
            }
        }
    }

    /// Drops stale table entries.
    fn purge(&mut self) {
        let chunks = &self.chunks;
        self.table
            .retain(|hash, loc| found_at(chunks, hash, loc).is_some());
        self.stale = 0;
    }
}

impl Holdings {
    /// Once the list has more than doubled since the last compaction: sorts it, drops repeats
    /// and the chunks where `holder` no longer holds anything.
    pub(super) fn compact_if_doubled(&mut self, chunks: &[Chunk], holder: Holder) {
        if self.chunks.len() > 2 * self.compacted + HOLDINGS_COMPACTION_SLACK {
            self.chunks.sort_unstable();
            self.chunks.dedup();
            self.chunks.retain(|&c| {
                chunks[c as usize]
                    .pieces
                    .iter()
                    .any(|p| p.placements.iter().any(|p| p.holder == holder))
            });
            self.compacted = self.chunks.len();
        }
    }
}
