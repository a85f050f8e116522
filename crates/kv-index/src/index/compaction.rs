//! Lazy deletion's clean-up: purging stale table entries, trimming and compacting chunks,
//! freeing empty ones, and compacting reverse holdings.

use super::effects::Lookups;
use super::layout::{Chunk, Holder, Holdings, Piece, Tokens, live_at};
use super::{CHUNK_COMPACTION_SLACK, HOLDINGS_COMPACTION_SLACK, Index};
use crate::table::SharedTable;

impl Index {
    /// After blocks of chunk `c` died: frees it when nothing is live, trims a dead end, and
    /// compacts it when dead positions outweigh live ones.
    pub(super) fn tidy(&mut self, c: u32, lookups: &mut impl Lookups) {
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
            self.compact_chunk(c, lookups);
        }
    }

    /// Rewrites chunk `c` with its live positions only, with new table entries for them where
    /// they go (the old ones stay behind: a twin behind this index still needs them).
    fn compact_chunk(&mut self, c: u32, lookups: &mut impl Lookups) {
        let live = self.chunks[c as usize].live as usize;
        lookups.make_room(self, live);
        let chunk = &self.chunks[c as usize];
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
        // Moved while the chunk is as it was: an entry is judged by the hash at its offset.
        for (offset, hash) in hashes.iter().enumerate() {
            let old = lookups.move_entry(&self.table, &self.chunks, *hash, offset as u32);
            debug_assert_eq!(
                old.map(|loc| loc.chunk),
                Some(c),
                "a live block has an entry"
            );
        }
        let chunk = &mut self.chunks[c as usize];
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

    /// Before a new table entry: rebuilds the table when it is full (at the same size when
    /// that leaves room, else bigger: see `Lookups::make_room`). A writer that can rebuild
    /// where no reader waits does it before the change ([`Index::table_for`]).
    pub(super) fn make_room(&mut self, lookups: &mut impl Lookups) {
        lookups.make_room(self, 1);
    }

    /// The block table a change adding at most `blocks` new blocks would rebuild, built now
    /// from `&self` (as big as before if that leaves the room, else doubled as need be; filled
    /// from the live blocks, leaving no stale entry, unless it is doubled from its own slots:
    /// see `BlockTable::replacement`); `None` when it has the room. A caller holding the index
    /// behind a lock builds it under a read lock and swaps it in with [`Index::install_table`]
    /// under the write lock, just before the change: readers go on meanwhile, where a rebuild
    /// inside the change would hold them for its whole length (it touches every entry: seconds
    /// at 100 M placements).
    pub fn table_for(&self, blocks: usize) -> Option<SpareTable> {
        if self.table.has_room(blocks) {
            return None;
        }
        // The slots hold fingerprints, not hashes: the live blocks, chunk by chunk, are where
        // the hashes are (a table doubled from its slots reads only a few of them).
        let table = self
            .table
            .replacement(self.blocks, blocks, self.live_blocks(), |loc| {
                live_at(&self.chunks, loc).map(|(hash, _)| hash)
            });
        Some(SpareTable {
            table: SharedTable::new(table),
            room: blocks,
            built_from: Some(self.identity()),
        })
    }

    /// Swaps in a table from [`Index::table_for`] if it was built from this index as it is
    /// (no change since): `Ok` with the table it replaced (drop it after the lock: freeing a
    /// large table takes a while), or `Err` with `spare` itself, and nothing changed.
    pub fn install_table(&mut self, mut spare: SpareTable) -> Result<SpareTable, SpareTable> {
        if spare.built_from != Some(self.identity()) {
            return Err(spare);
        }
        std::mem::swap(&mut self.table, &mut spare.table);
        spare.built_from = None;
        Ok(spare)
    }

    /// This index as it is: its count of changes, and where its table is (no two allocated
    /// tables share an address, so another index with as many changes differs in it; empty
    /// tables all have one, but a table built from an empty one holds nothing either).
    fn identity(&self) -> (u64, usize) {
        (self.changes, self.table.memory().start)
    }
}

/// A block table outside the index: one built for it ([`Index::table_for`]), or the one it
/// replaced.
#[derive(Debug)]
pub struct SpareTable {
    pub(super) table: SharedTable,
    /// The new entries it was built to make room for.
    pub(super) room: usize,
    /// The identity of the index it was built from, as it was then; `None` for a table taken
    /// out of an index, never installed again.
    pub(super) built_from: Option<(u64, usize)>,
}

impl SpareTable {
    /// Entries it holds (live or stale).
    pub fn entries(&self) -> usize {
        self.table.len()
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

#[cfg(test)]
mod tests {
    use crate::{ActionRequest, ApplyRequest, Index, ValidApply};

    /// `worker` REPORTs (action 1) or REVOKEs (2) `hashes` at HBM.
    fn change(worker: &str, action_type: i32, hashes: std::ops::Range<i64>) -> ValidApply {
        ApplyRequest {
            worker_id: worker.to_owned(),
            seq: 0,
            worker_address: format!("http://{worker}"),
            cache_spec: None,
            actions: vec![ActionRequest {
                action_type,
                tier: 1,
                hashes: hashes.collect(),
                component_masks: Vec::new(),
                block_sizes: Vec::new(),
                parent_block_hash: None,
            }],
        }
        .validate()
        .expect("a valid change")
    }

    #[test]
    fn a_table_built_beside_the_index_is_swapped_in_whole() {
        let mut index = Index::new();
        index.apply(&change("w", 1, 0..100));
        let grow = change("w", 1, 100..1000);
        let spare = index
            .table_for(grow.reported_blocks())
            .expect("900 more do not fit");
        assert_eq!(spare.entries(), 100);
        let old = index.install_table(spare).expect("built from this index");
        assert_eq!(old.entries(), 100);
        assert!(index.table_for(grow.reported_blocks()).is_none());
        index.apply(&grow);
        assert_eq!(index.table.len(), 1000);
        // A retired table never goes back in.
        assert!(index.install_table(old).is_err());
        index.check_invariants();
    }

    #[test]
    fn a_rebuild_inside_a_change_is_in_its_record() {
        let mut index = Index::new();
        let mut effects = crate::Effects::new();
        index.apply_recording(&change("w", 1, 0..100), &mut effects);
        let mark = effects.mark();
        // No table made before the change: it rebuilds inside it, as it grows.
        index.apply_recording(&change("w", 1, 100..1000), &mut effects);
        let rebuilt: Vec<usize> = effects.tables_since(mark).collect();
        assert!(
            !rebuilt.is_empty(),
            "900 more blocks do not fit the first table"
        );
        assert!(
            rebuilt
                .iter()
                .all(|&entries| (100..1000).contains(&entries))
        );
        assert_eq!(effects.tables_since(effects.mark()).count(), 0);
    }

    #[test]
    fn a_purge_built_beside_the_index_drops_only_stale_entries() {
        let mut index = Index::new();
        index.apply(&change("w", 1, 0..1000));
        index.apply(&change("w", 2, 0..900));
        // Fills the table up with blocks that come and go, so that it has to be rebuilt.
        let mut next = 5000..;
        let spare = loop {
            if let Some(spare) = index.table_for(1) {
                break spare;
            }
            let hash = next.next().expect("endless");
            index.apply(&change("v", 1, hash..hash + 1));
            index.apply(&change("v", 2, hash..hash + 1));
        };
        assert_eq!(spare.entries(), 100, "the live blocks 900..1000");
        index.install_table(spare).expect("built from this index");
        index.check_invariants();
        assert!(index.match_kv(&[950]).is_ok_and(|m| m.len() == 1));
    }

    #[test]
    fn a_table_built_from_another_index_is_refused() {
        let mut one = Index::new();
        let mut other = Index::new();
        one.apply(&change("w", 1, 0..100));
        other.apply(&change("w", 1, 0..100));
        let spare = one.table_for(1000).expect("1000 more do not fit");
        assert!(
            other.install_table(spare).is_err(),
            "as many changes, not the same index"
        );
    }

    #[test]
    fn a_table_built_before_a_change_is_refused_after_it() {
        let mut index = Index::new();
        index.apply(&change("w", 1, 0..100));
        let spare = index.table_for(1000).expect("1000 more do not fit");
        index.apply(&change("w", 2, 0..50));
        let spare = index
            .install_table(spare)
            .expect_err("the index changed since");
        assert_eq!(spare.entries(), 100);
        assert_eq!(index.table.len(), 100, "the index's own table stays");
        index.check_invariants();
    }
}
