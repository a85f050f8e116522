//! A deliberately naive reference model of the index, written only from
//! `docs/indexer-contract.md` and the crate's documented decisions (validation order, answer
//! ordering, the exact `blocks_read` rule). It is meant to be obviously correct by reading:
//! plain ordered maps, no incremental bookkeeping, every answer recomputed from scratch, and the
//! prefix of every candidate computed in full (no early stop).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use kv_index::{
    ActionKind, ApplyRequest, CacheSpec, IndexStats, NodeMatch, PrefixAnswer, PrefixMatch, Tier,
    TierHashes, ValidationError,
};

const FULL: u32 = 1;
const SWA: u32 = 2;
const MAMBA: u32 = 4;

const MAX_ACTIONS: usize = 256;
const MAX_HASHES: usize = 16_384;

const REPORT: i32 = 1;
const REVOKE: i32 = 2;
const CLEAR_ALL_AT_TIER: i32 = 3;

/// Every tier, in answer order.
const TIERS: [Tier; 3] = [Tier::Hbm, Tier::Dram, Tier::Ssd];

/// The tier for a wire value (`TIER_UNKNOWN` and undefined values have none).
fn tier_from_wire(value: i32) -> Option<Tier> {
    match value {
        1 => Some(Tier::Hbm),
        2 => Some(Tier::Dram),
        3 => Some(Tier::Ssd),
        _ => None,
    }
}

/// The wire value of a tier.
fn tier_wire(tier: Tier) -> u32 {
    match tier {
        Tier::Hbm => 1,
        Tier::Dram => 2,
        Tier::Ssd => 3,
    }
}

/// One block hash: who holds it where (with which component mask), its token count, its hits.
#[derive(Debug, Clone, Default)]
struct Block {
    /// `(worker id, tier)` -> the component mask of that placement.
    placements: BTreeMap<(String, Tier), u32>,
    /// Token count; 0 = unknown.
    tokens: u32,
    /// Cumulative hit count; 0 = never counted (no entry in `hit_counts`).
    hits: u64,
}

/// What the last accepted apply of a worker said about it.
#[derive(Debug, Clone, Default)]
struct Worker {
    address: String,
    spec: Option<CacheSpec>,
}

/// The whole state. A block exists exactly while it has at least one placement.
#[derive(Debug, Clone, Default)]
pub struct Model {
    blocks: BTreeMap<i64, Block>,
    /// Every worker ever registered by an accepted apply.
    workers: BTreeMap<String, Worker>,
}

/// The validation rules of an apply, in the documented order (first failing rule wins).
fn validate_apply(req: &ApplyRequest) -> Result<(), ValidationError> {
    if req.worker_id.is_empty() {
        return Err(ValidationError::EmptyWorkerId);
    }
    if req.actions.len() > MAX_ACTIONS {
        return Err(ValidationError::TooManyActions {
            count: req.actions.len(),
        });
    }
    let mut total = 0;
    for action in &req.actions {
        total += action.hashes.len();
    }
    if total > MAX_HASHES {
        return Err(ValidationError::TooManyApplyHashes { count: total });
    }
    for (i, action) in req.actions.iter().enumerate() {
        let kind = match action.action_type {
            REPORT => ActionKind::Report,
            REVOKE => ActionKind::Revoke,
            CLEAR_ALL_AT_TIER => ActionKind::ClearAllAtTier,
            _ => {
                return Err(ValidationError::UnknownActionType {
                    action: i,
                    value: action.action_type,
                });
            }
        };
        if tier_from_wire(action.tier).is_none() {
            return Err(ValidationError::UnknownTier {
                action: i,
                value: action.tier,
            });
        }
        if action.action_type != CLEAR_ALL_AT_TIER && action.hashes.is_empty() {
            return Err(ValidationError::EmptyAction { action: i, kind });
        }
        let n = action.hashes.len();
        let sides = [
            ("component_masks", action.component_masks.len()),
            ("block_sizes", action.block_sizes.len()),
        ];
        for (field, len) in sides {
            if len != 0 && len != n {
                return Err(ValidationError::MisalignedSideArray {
                    action: i,
                    field,
                    len,
                    hashes: n,
                });
            }
        }
    }
    Ok(())
}

/// The validation rules of `MatchExternalKv` and `GetExternalKvHitCounts`.
fn validate_lookup(hashes: &[i64]) -> Result<(), ValidationError> {
    match hashes.len() {
        0 => Err(ValidationError::NoHashes),
        count if count > MAX_HASHES => Err(ValidationError::TooManyQueryHashes { count }),
        _ => Ok(()),
    }
}

/// The hashes without repeats, in first-occurrence order.
fn dedup(hashes: &[i64]) -> Vec<i64> {
    let mut out: Vec<i64> = Vec::new();
    for &h in hashes {
        if !out.contains(&h) {
            out.push(h);
        }
    }
    out
}

/// A spec the prefix rules can use.
fn spec_is_valid(spec: &CacheSpec) -> bool {
    if spec.version > 1 {
        return false;
    }
    if spec.components == 0 {
        return false;
    }
    if spec.components & SWA != 0 && spec.swa_window_tokens == 0 {
        return false;
    }
    true
}

/// The spec's tier mask for one component bit.
fn tier_mask_of(spec: &CacheSpec, component: u32) -> u32 {
    match component {
        FULL => spec.full_tier_mask,
        SWA => spec.swa_tier_mask,
        MAMBA => spec.mamba_tier_mask,
        _ => unreachable!("not a component bit: {component}"),
    }
}

impl Model {
    pub fn new() -> Model {
        Model::default()
    }

    // ----- apply -------------------------------------------------------------------------------

    pub fn apply(&mut self, req: &ApplyRequest) -> Result<(), ValidationError> {
        validate_apply(req)?;
        let worker = req.worker_id.clone();
        self.workers.insert(
            worker.clone(),
            Worker {
                address: req.worker_address.clone(),
                spec: req.cache_spec,
            },
        );
        for action in &req.actions {
            let tier = tier_from_wire(action.tier).expect("validated");
            match action.action_type {
                REPORT => {
                    for (i, &hash) in action.hashes.iter().enumerate() {
                        let mask = if action.component_masks.is_empty() {
                            0
                        } else {
                            action.component_masks[i]
                        };
                        let size = if action.block_sizes.is_empty() {
                            0
                        } else {
                            action.block_sizes[i]
                        };
                        let block = self.blocks.entry(hash).or_default();
                        block.placements.insert((worker.clone(), tier), mask);
                        if size > 0 {
                            block.tokens = size;
                        }
                    }
                }
                REVOKE => {
                    for &hash in &action.hashes {
                        self.revoke(&worker, tier, hash);
                    }
                }
                CLEAR_ALL_AT_TIER => {
                    let mut held = Vec::new();
                    for (&hash, block) in &self.blocks {
                        if block.placements.contains_key(&(worker.clone(), tier)) {
                            held.push(hash);
                        }
                    }
                    for hash in held {
                        self.revoke(&worker, tier, hash);
                    }
                }
                _ => unreachable!("validated"),
            }
        }
        Ok(())
    }

    fn revoke(&mut self, worker: &str, tier: Tier, hash: i64) {
        let mut now_empty = false;
        if let Some(block) = self.blocks.get_mut(&hash) {
            block.placements.remove(&(worker.to_string(), tier));
            now_empty = block.placements.is_empty();
        }
        if now_empty {
            // The block goes, with its token count and hit count.
            self.blocks.remove(&hash);
        }
    }

    // ----- stats -------------------------------------------------------------------------------

    pub fn stats(&self) -> IndexStats {
        let mut placements = 0;
        for block in self.blocks.values() {
            placements += block.placements.len();
        }
        IndexStats {
            blocks: self.blocks.len(),
            placements,
            workers: self.workers.len(),
        }
    }

    // ----- MatchExternalKv and hit counts ------------------------------------------------------

    /// The workers holding `hash` at any tier, by worker id (byte order).
    fn holders(&self, hash: i64) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        if let Some(block) = self.blocks.get(&hash) {
            for (worker, _tier) in block.placements.keys() {
                out.insert(worker.clone());
            }
        }
        out
    }

    pub fn match_kv(&self, hashes: &[i64]) -> Result<Vec<NodeMatch>, ValidationError> {
        validate_lookup(hashes)?;
        let hashes = dedup(hashes);
        let mut order: Vec<String> = Vec::new();
        for &hash in &hashes {
            for worker in self.holders(hash) {
                if !order.contains(&worker) {
                    order.push(worker);
                }
            }
        }
        let mut out = Vec::new();
        for worker in order {
            let mut hashes_by_tier = Vec::new();
            for tier in TIERS {
                let mut th = TierHashes {
                    tier,
                    hashes: Vec::new(),
                    component_masks: Vec::new(),
                    block_sizes: Vec::new(),
                };
                for &hash in &hashes {
                    if let Some(block) = self.blocks.get(&hash)
                        && let Some(&mask) = block.placements.get(&(worker.clone(), tier))
                    {
                        th.hashes.push(hash);
                        th.component_masks.push(mask);
                        th.block_sizes.push(block.tokens);
                    }
                }
                if !th.hashes.is_empty() {
                    hashes_by_tier.push(th);
                }
            }
            out.push(NodeMatch {
                address: self.workers[&worker].address.clone(),
                worker_id: worker,
                hashes_by_tier,
            });
        }
        Ok(out)
    }

    /// The `count_as_hit` step: one more hit on each distinct requested hash that exists.
    pub fn count_hits(&mut self, hashes: &[i64]) {
        for hash in dedup(hashes) {
            if let Some(block) = self.blocks.get_mut(&hash) {
                block.hits += 1;
            }
        }
    }

    pub fn hit_counts(&self, hashes: &[i64]) -> Result<Vec<(i64, u64)>, ValidationError> {
        validate_lookup(hashes)?;
        let mut out = Vec::new();
        for hash in dedup(hashes) {
            if let Some(block) = self.blocks.get(&hash)
                && block.hits > 0
            {
                out.push((hash, block.hits));
            }
        }
        Ok(out)
    }

    // ----- MatchExternalKvPrefix ---------------------------------------------------------------

    /// Whether `worker` holds `hash` at any tier.
    fn holds(&self, worker: &str, hash: i64) -> bool {
        self.holders(hash).contains(worker)
    }

    /// Whether `worker` has a placement with a non-zero mask on `hash` (any tier).
    fn has_nonzero_mask_on(&self, worker: &str, hash: i64) -> bool {
        match self.blocks.get(&hash) {
            None => false,
            Some(block) => block
                .placements
                .iter()
                .any(|((w, _tier), &mask)| w == worker && mask != 0),
        }
    }

    /// Whether `worker` has a placement with a non-zero mask anywhere in the index.
    fn has_nonzero_mask_anywhere(&self, worker: &str) -> bool {
        self.blocks
            .keys()
            .any(|&hash| self.has_nonzero_mask_on(worker, hash))
    }

    /// Whether `component` is available to a component-aware `worker` on `hash`: its bit is set
    /// at some servable tier (HBM or DRAM) that is in the component's tier mask.
    fn available(&self, worker: &str, spec: &CacheSpec, hash: i64, component: u32) -> bool {
        let Some(block) = self.blocks.get(&hash) else {
            return false;
        };
        for ((w, tier), &mask) in &block.placements {
            if w != worker {
                continue;
            }
            let servable = *tier == Tier::Hbm || *tier == Tier::Dram;
            let allowed = tier_mask_of(spec, component) & (1u32 << tier_wire(*tier)) != 0;
            if mask & component != 0 && servable && allowed {
                return true;
            }
        }
        false
    }

    fn tokens(&self, hash: i64) -> u64 {
        self.blocks.get(&hash).map_or(0, |b| u64::from(b.tokens))
    }

    /// A legacy worker's (prefix, settle point) over the considered blocks.
    fn legacy_prefix(&self, worker: &str, blocks: &[i64]) -> (usize, usize) {
        let n = blocks.len();
        let mut run = 0;
        while run < n && self.holds(worker, blocks[run]) {
            run += 1;
        }
        let tainted = blocks.iter().any(|&h| self.has_nonzero_mask_on(worker, h));
        let prefix = if tainted { 0 } else { run };

        let settle = if self.has_nonzero_mask_anywhere(worker) {
            match blocks
                .iter()
                .position(|&h| self.has_nonzero_mask_on(worker, h))
            {
                Some(i) => i + 1,
                None => n,
            }
        } else {
            match blocks.iter().position(|&h| !self.holds(worker, h)) {
                Some(i) => i + 1,
                None => n,
            }
        };
        (prefix, settle)
    }

    /// A component-aware worker's (prefix, settle point) over the considered blocks; the spec is
    /// valid.
    fn component_prefix(&self, worker: &str, spec: &CacheSpec, blocks: &[i64]) -> (usize, usize) {
        let n = blocks.len();
        let mut prefix = 0;
        let mut settle = n;
        let mut swa_run: u64 = 0;
        let mut swa_broken = false;
        for (i, &hash) in blocks.iter().enumerate() {
            if !self.available(worker, spec, hash, FULL) {
                settle = i + 1;
                break;
            }
            let mut all_ok = true;
            if spec.components & SWA != 0 {
                if self.available(worker, spec, hash, SWA) {
                    swa_run += self.tokens(hash);
                } else {
                    swa_run = 0;
                    swa_broken = true;
                }
                let swa_ok = !swa_broken || swa_run >= u64::from(spec.swa_window_tokens);
                all_ok = all_ok && swa_ok;
            }
            if spec.components & MAMBA != 0 {
                let mamba_ok = self.available(worker, spec, hash, MAMBA);
                all_ok = all_ok && mamba_ok;
            }
            if all_ok {
                prefix = i + 1;
            }
        }
        (prefix, settle)
    }

    pub fn match_prefix(
        &self,
        hashes: &[i64],
        max_blocks: u32,
    ) -> Result<PrefixAnswer, ValidationError> {
        if hashes.is_empty() {
            return Err(ValidationError::NoHashes);
        }
        let n = if max_blocks == 0 {
            hashes.len()
        } else {
            hashes.len().min(max_blocks as usize)
        };
        let blocks = &hashes[..n];
        let candidates = self.holders(hashes[0]);
        if candidates.is_empty() {
            return Ok(PrefixAnswer {
                matches: Vec::new(),
                best_prefix_blocks: 0,
                blocks_read: 1,
            });
        }
        let mut matches = Vec::new();
        let mut max_settle = 0;
        for worker_id in candidates {
            let worker = &self.workers[&worker_id];
            let (prefix, settle) = match &worker.spec {
                None => self.legacy_prefix(&worker_id, blocks),
                Some(spec) if !spec_is_valid(spec) => (0, 1),
                Some(spec) => self.component_prefix(&worker_id, spec, blocks),
            };
            let settle = if worker.address.is_empty() { 1 } else { settle };
            max_settle = max_settle.max(settle);
            if !worker.address.is_empty() && prefix > 0 {
                matches.push(PrefixMatch {
                    worker_address: worker.address.clone(),
                    matched_prefix_blocks: u32::try_from(prefix).expect("prefix fits u32"),
                    worker_id,
                });
            }
        }
        matches.sort_by_key(|m| (Reverse(m.matched_prefix_blocks), m.worker_id.clone()));
        let best_prefix_blocks = matches.first().map_or(0, |m| m.matched_prefix_blocks);
        let blocks_read = max_settle.min(n).max(1);
        Ok(PrefixAnswer {
            matches,
            best_prefix_blocks,
            blocks_read: u32::try_from(blocks_read).expect("blocks_read fits u32"),
        })
    }
}
