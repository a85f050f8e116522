//! The whole index as plain data, and back: what a snapshot stores.
//!
//! [`Index::export`] lists every worker (id, address, spec) with its placements per tier in the
//! order they are stored (chain order, so that [`Index::import`] rebuilds runs as compact as
//! the ones it read), and every hit count. Importing an export gives an index with the same
//! workers, placements, token counts and hit counts, hence the same answer to every query; its
//! layout (chunks, pieces) may differ, which no answer can see.

use crate::types::{Action, ActionKind, CacheSpec, Tier, ValidApply};

use super::Index;

/// One placement of a block: its hash, the worker's component mask, the block's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub hash: i64,
    pub mask: u32,
    pub tokens: u32,
}

/// One worker and what it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportedWorker {
    pub id: String,
    pub address: String,
    pub spec: Option<CacheSpec>,
    /// Per tier, in `Tier::ALL` order.
    pub held: [Vec<Held>; 3],
}

/// A worker as an operator sees it: its address and how much it holds at each tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSummary {
    pub id: String,
    pub address: String,
    /// Placements per tier, in `Tier::ALL` order.
    pub placements: [usize; 3],
}

/// Everything an index holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Export {
    /// In worker-id order.
    pub workers: Vec<ExportedWorker>,
    /// `(hash, count)` in hash order.
    pub hits: Vec<(i64, u64)>,
}

impl Export {
    /// The same contents in one canonical order (each tier's placements by hash), so that two
    /// indexes that answer alike export equal canonical forms.
    pub fn canonical(mut self) -> Export {
        for worker in &mut self.workers {
            for held in &mut worker.held {
                held.sort_unstable_by_key(|h| h.hash);
            }
        }
        self
    }

    pub fn placements(&self) -> usize {
        self.workers
            .iter()
            .map(|w| w.held.iter().map(Vec::len).sum::<usize>())
            .sum()
    }
}

impl Index {
    /// Every worker the index knows, in worker-id order, with its placements per tier (kept
    /// as the index changes: no scan).
    pub fn worker_summaries(&self) -> Vec<WorkerSummary> {
        self.by_rank
            .iter()
            .map(|&w| {
                let worker = &self.workers[w as usize];
                WorkerSummary {
                    id: worker.id.clone(),
                    address: worker.address.clone(),
                    placements: worker.placements,
                }
            })
            .collect()
    }

    /// The placements `worker` holds, at every tier; none for a worker it does not know.
    pub fn worker_placements(&self, worker: &str) -> Option<usize> {
        let &w = self.worker_ids.get(worker)?;
        Some(self.workers[w as usize].placements.iter().sum())
    }

    /// Everything this index holds (see the module docs).
    pub fn export(&self) -> Export {
        let mut workers: Vec<ExportedWorker> = self
            .workers
            .iter()
            .map(|w| ExportedWorker {
                id: w.id.clone(),
                address: w.address.clone(),
                spec: w.spec,
                held: Default::default(),
            })
            .collect();
        for chunk in &self.chunks {
            for (i, piece) in chunk.pieces.iter().enumerate() {
                if piece.placements.is_empty() {
                    continue;
                }
                for offset in piece.begin as usize..chunk.piece_end(i) {
                    let (hash, tokens) = (chunk.hashes[offset], chunk.tokens_at(offset));
                    for p in &piece.placements {
                        workers[p.worker() as usize].held[p.tier().index()].push(Held {
                            hash,
                            mask: p.mask,
                            tokens,
                        });
                    }
                }
            }
        }
        let mut in_rank_order: Vec<ExportedWorker> = self
            .by_rank
            .iter()
            .map(|&w| std::mem::take(&mut workers[w as usize]))
            .collect();
        in_rank_order.shrink_to_fit();
        let mut hits: Vec<(i64, u64)> = self.hits.iter().map(|(&h, &c)| (h, c)).collect();
        hits.sort_unstable();
        Export {
            workers: in_rank_order,
            hits,
        }
    }

    /// The index that `export` describes.
    pub fn import(export: &Export) -> Index {
        let mut index = Index::new();
        for worker in &export.workers {
            let actions = Tier::ALL
                .iter()
                .zip(&worker.held)
                .filter(|(_, held)| !held.is_empty())
                .map(|(&tier, held)| Action {
                    kind: ActionKind::Report,
                    tier,
                    hashes: held.iter().map(|h| h.hash).collect(),
                    component_masks: held.iter().map(|h| h.mask).collect(),
                    block_sizes: held.iter().map(|h| h.tokens).collect(),
                    parent_block_hash: None,
                })
                .collect();
            index.apply(&ValidApply {
                worker_id: worker.id.clone(),
                worker_address: worker.address.clone(),
                cache_spec: worker.spec,
                actions,
            });
        }
        for &(hash, count) in &export.hits {
            if let Some(found) = index.locate(hash) {
                index.note_hits(found.chunk);
                index.hits.insert(hash, count);
            }
        }
        index
    }
}
