//! `MatchExternalKv` (exact lookups) and hit counts.

use hashbrown::HashSet;
use rustc_hash::FxBuildHasher;

use crate::index::Index;
use crate::types::{NodeMatch, Tier, TierHashes};
use crate::validate::{ValidationError, validate_lookup};

/// The hashes in order, duplicates after the first dropped.
fn dedup_in_order(hashes: &[i64]) -> Vec<i64> {
    let mut seen: HashSet<i64, FxBuildHasher> =
        HashSet::with_capacity_and_hasher(hashes.len(), FxBuildHasher);
    hashes.iter().copied().filter(|h| seen.insert(*h)).collect()
}

impl Index {
    /// Answers `MatchExternalKv`: one entry per worker holding any of the hashes, in first-seen
    /// order (workers first seen at the same hash ordered by worker id), tiers ascending, hashes
    /// in request order with their masks and token counts. Counting hits is a separate step
    /// ([`Index::count_hits`]) because it needs `&mut self`.
    pub fn match_kv(&self, hashes: &[i64]) -> Result<Vec<NodeMatch>, ValidationError> {
        validate_lookup(hashes)?;
        let mut slot_of: Vec<u32> = vec![u32::MAX; self.workers.len()];
        let mut nodes: Vec<(u32, [TierHashes; 3])> = Vec::new();
        let mut holders: Vec<(u32, Tier, u32)> = Vec::new();
        for hash in dedup_in_order(hashes) {
            let Some(found) = self.locate(hash) else {
                continue;
            };
            let chunk = &self.chunks[found.chunk as usize];
            let tokens = chunk.tokens_at(found.offset as usize);
            holders.clear();
            holders.extend(
                chunk.pieces[found.piece as usize]
                    .placements
                    .iter()
                    .map(|p| (p.worker(), p.tier(), p.mask)),
            );
            holders.sort_unstable_by_key(|&(worker, tier, _)| {
                (self.workers[worker as usize].rank, tier)
            });
            for &(worker, tier, mask) in &holders {
                let slot = &mut slot_of[worker as usize];
                if *slot == u32::MAX {
                    *slot = nodes.len() as u32;
                    nodes.push((
                        worker,
                        Tier::ALL.map(|tier| TierHashes {
                            tier,
                            hashes: Vec::new(),
                            component_masks: Vec::new(),
                            block_sizes: Vec::new(),
                        }),
                    ));
                }
                let group = &mut nodes[*slot as usize].1[tier.index()];
                group.hashes.push(hash);
                group.component_masks.push(mask);
                group.block_sizes.push(tokens);
            }
        }
        Ok(nodes
            .into_iter()
            .map(|(worker, tiers)| {
                let w = &self.workers[worker as usize];
                NodeMatch {
                    worker_id: w.id.clone(),
                    address: w.address.clone(),
                    hashes_by_tier: tiers.into_iter().filter(|t| !t.hashes.is_empty()).collect(),
                }
            })
            .collect())
    }

    /// Adds one to the hit count of each distinct hash that some worker holds (the
    /// `count_as_hit` of `MatchExternalKv`).
    pub fn count_hits(&mut self, hashes: &[i64]) {
        for hash in dedup_in_order(hashes) {
            if let Some(found) = self.locate(hash) {
                self.note_hits(found.chunk);
                *self.hits.entry(hash).or_insert(0) += 1;
            }
        }
    }

    /// Answers `GetExternalKvHitCounts`: `(hash, count)` for each distinct requested hash that
    /// has a count, in request order.
    pub fn hit_counts(&self, hashes: &[i64]) -> Result<Vec<(i64, u64)>, ValidationError> {
        validate_lookup(hashes)?;
        Ok(dedup_in_order(hashes)
            .into_iter()
            .filter_map(|hash| self.hits.get(&hash).map(|&count| (hash, count)))
            .collect())
    }
}
