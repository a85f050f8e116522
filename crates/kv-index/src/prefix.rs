//! `MatchExternalKvPrefix`: the longest reusable prefix per worker, in one forward scan.
//!
//! Candidates are the holders of `hashes[0]`. Each keeps O(1) state and is *settled* once nothing
//! later can change its answer; the scan stops when every candidate is settled:
//! - a worker with an empty address or an invalid spec is settled before the scan (prefix 0);
//! - a component-aware worker at its first block without servable FULL;
//! - a legacy worker at its first gap when it holds no non-zero mask anywhere, or at the first
//!   considered block where it shows a non-zero mask (it then fails closed with prefix 0).
//!
//! `blocks_read` counts the blocks examined: block 0 always, then each block while some
//! candidate is unsettled, up to `n`.

use crate::index::{Block, Index};
use crate::types::{
    COMPONENT_FULL, COMPONENT_MAMBA, COMPONENT_SWA, PrefixAnswer, PrefixMatch, Tier,
};
use crate::validate::{ValidationError, validate_prefix};

const NO_SLOT: u32 = u32::MAX;

/// Lookups issued together while scanning: the first window and the largest.
const MIN_WINDOW: usize = 4;
const MAX_WINDOW: usize = 32;

/// The per-candidate scan state.
#[derive(Debug, Clone)]
struct Candidate {
    worker: u32,
    rule: Rule,
    prefix: u32,
    /// What this candidate holds in the block being examined, valid when `seen_at` is its
    /// position + 1.
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

impl Candidate {
    /// Folds one placement of the block being examined into this candidate's view of it.
    fn observe(&mut self, position: u32, tier: Tier, mask: u32) {
        if self.seen_at != position + 1 {
            self.seen_at = position + 1;
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

    /// Advances over block `position`; returns whether the candidate is now settled.
    fn step(&mut self, position: u32, block: Option<&Block>) -> bool {
        let seen = self.seen_at == position + 1;
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
                    self.prefix = position + 1;
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
                let mut boundary = true;
                if *components & COMPONENT_SWA != 0 {
                    if available & COMPONENT_SWA != 0 {
                        let tokens = block.map_or(0, |b| b.tokens);
                        *swa_run = swa_run.saturating_add(u64::from(tokens));
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
                    self.prefix = position + 1;
                }
                false
            }
        }
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
        let Some(first) = self.blocks.get(&hashes[0]) else {
            return Ok(PrefixAnswer {
                blocks_read: 1,
                ..PrefixAnswer::default()
            });
        };

        let mut slot_of = vec![NO_SLOT; self.workers.len()];
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut active: Vec<u32> = Vec::new();
        for placement in &first.placements {
            let worker = placement.worker();
            if slot_of[worker as usize] != NO_SLOT {
                continue;
            }
            slot_of[worker as usize] = candidates.len() as u32;
            let (candidate, settled) = self.candidate(worker);
            if !settled {
                active.push(candidates.len() as u32);
            }
            candidates.push(candidate);
        }

        // Block 0 is always examined; later blocks are looked up a window at a time so that
        // the hash-table misses of independent lookups overlap. The window starts small (most
        // scans settle early) and doubles up to `MAX_WINDOW`.
        let mut examine = |position: usize, block: Option<&Block>| {
            let position = position as u32;
            if let Some(block) = block {
                for placement in &block.placements {
                    let slot = slot_of[placement.worker() as usize];
                    if slot != NO_SLOT {
                        candidates[slot as usize].observe(position, placement.tier(), placement.mask);
                    }
                }
            }
            active.retain(|&slot| !candidates[slot as usize].step(position, block));
            active.is_empty()
        };
        let mut examined = 1;
        let mut settled = examine(0, Some(first));
        let mut window = MIN_WINDOW;
        let mut found: [Option<&Block>; MAX_WINDOW] = [None; MAX_WINDOW];
        while !settled && examined < n {
            let end = (examined + window).min(n);
            for (slot, hash) in found.iter_mut().zip(&hashes[examined..end]) {
                *slot = self.blocks.get(hash);
            }
            for (offset, block) in found[..end - examined].iter().enumerate() {
                settled = examine(examined + offset, *block);
                if settled {
                    examined += offset;
                    break;
                }
            }
            examined = if settled { examined + 1 } else { end };
            window = (window * 2).min(MAX_WINDOW);
        }
        let position = examined as u32;

        let mut matches: Vec<&Candidate> = candidates.iter().filter(|c| c.prefix > 0).collect();
        matches.sort_unstable_by_key(|c| (std::cmp::Reverse(c.prefix), self.workers[c.worker as usize].rank));
        let matches: Vec<PrefixMatch> = matches
            .into_iter()
            .map(|c| {
                let worker = &self.workers[c.worker as usize];
                PrefixMatch {
                    worker_address: worker.address.clone(),
                    matched_prefix_blocks: c.prefix,
                    worker_id: worker.id.clone(),
                }
            })
            .collect();
        Ok(PrefixAnswer {
            best_prefix_blocks: matches.first().map_or(0, |m| m.matched_prefix_blocks),
            matches,
            blocks_read: position,
        })
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
            worker,
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
