//! Domain types of the index: tiers, actions, cache specs, requests and answers.
//!
//! Requests carry the raw wire values of enums (`i32`) so that validation can name an undefined
//! value; a validated batch carries the typed enums.

/// Component bit of the full-attention KV.
pub const COMPONENT_FULL: u32 = 1;
/// Component bit of the sliding-window-attention KV.
pub const COMPONENT_SWA: u32 = 2;
/// Component bit of the Mamba state.
pub const COMPONENT_MAMBA: u32 = 4;

/// The limit on actions in one apply.
pub const MAX_ACTIONS_PER_APPLY: usize = 256;
/// The limit on hashes summed over one apply's actions, and on hashes in a `MatchExternalKv` or
/// `GetExternalKvHitCounts` request.
pub const MAX_HASHES_PER_REQUEST: usize = 16_384;

/// A storage tier, with the wire value of `TierType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Hbm = 1,
    Dram = 2,
    Ssd = 3,
}

impl Tier {
    /// Every tier, in wire (and answer) order.
    pub const ALL: [Tier; 3] = [Tier::Hbm, Tier::Dram, Tier::Ssd];

    /// The tier for a wire value, or `None` for `TIER_UNKNOWN` and undefined values.
    pub fn from_wire(value: i32) -> Option<Tier> {
        match value {
            1 => Some(Tier::Hbm),
            2 => Some(Tier::Dram),
            3 => Some(Tier::Ssd),
            _ => None,
        }
    }

    /// The `TierType` wire value.
    pub fn wire(self) -> i32 {
        self as i32
    }

    /// Position in `Tier::ALL` (0..3).
    pub fn index(self) -> usize {
        self as usize - 1
    }

    /// This tier's bit in a `WorkerCacheSpec` tier mask (`1 << TierType`).
    pub fn mask_bit(self) -> u32 {
        1 << (self as u32)
    }

    /// Whether a component may be served from this tier at all (SSD never is).
    pub fn is_servable(self) -> bool {
        matches!(self, Tier::Hbm | Tier::Dram)
    }
}

/// What an action does, with the wire value of `ExternalKvActionType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionKind {
    Report = 1,
    Revoke = 2,
    ClearAllAtTier = 3,
}

impl ActionKind {
    /// The kind for a wire value, or `None` for `ACTION_UNKNOWN` and undefined values.
    pub fn from_wire(value: i32) -> Option<ActionKind> {
        match value {
            1 => Some(ActionKind::Report),
            2 => Some(ActionKind::Revoke),
            3 => Some(ActionKind::ClearAllAtTier),
            _ => None,
        }
    }
}

/// A worker's `WorkerCacheSpec`, as sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheSpec {
    pub version: u32,
    pub components: u32,
    pub swa_window_tokens: u32,
    pub full_tier_mask: u32,
    pub swa_tier_mask: u32,
    pub mamba_tier_mask: u32,
}

impl CacheSpec {
    /// Its fields in the order snapshots store them: version, components, SWA window, and the
    /// full, SWA and Mamba tier masks.
    pub fn to_words(self) -> [u32; 6] {
        [
            self.version,
            self.components,
            self.swa_window_tokens,
            self.full_tier_mask,
            self.swa_tier_mask,
            self.mamba_tier_mask,
        ]
    }

    /// The spec that [`CacheSpec::to_words`] gave `words`.
    pub fn from_words(words: [u32; 6]) -> CacheSpec {
        let [
            version,
            components,
            swa_window_tokens,
            full_tier_mask,
            swa_tier_mask,
            mamba_tier_mask,
        ] = words;
        CacheSpec {
            version,
            components,
            swa_window_tokens,
            full_tier_mask,
            swa_tier_mask,
            mamba_tier_mask,
        }
    }

    /// A spec that the prefix rules can use: version 0 or 1, some component, and a window when
    /// SWA is configured. Workers with an invalid spec match nothing.
    pub fn is_valid(&self) -> bool {
        self.version <= 1
            && self.components != 0
            && (self.components & COMPONENT_SWA == 0 || self.swa_window_tokens > 0)
    }

    /// The component bits servable from `tier`: those whose tier mask includes it, never on SSD.
    pub fn servable_components(&self, tier: Tier) -> u32 {
        if !tier.is_servable() {
            return 0;
        }
        let bit = tier.mask_bit();
        let mut components = 0;
        for (component, mask) in [
            (COMPONENT_FULL, self.full_tier_mask),
            (COMPONENT_SWA, self.swa_tier_mask),
            (COMPONENT_MAMBA, self.mamba_tier_mask),
        ] {
            if mask & bit != 0 {
                components |= component;
            }
        }
        components
    }
}

/// One action of an apply, with raw wire enums (see [`ApplyRequest::validate`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActionRequest {
    pub action_type: i32,
    pub tier: i32,
    pub hashes: Vec<i64>,
    pub component_masks: Vec<u32>,
    pub block_sizes: Vec<u32>,
    /// The chain hint of the contract's extensions. It never changes an answer.
    pub parent_block_hash: Option<i64>,
}

/// `ApplyExternalKvBatchRequest` as the index sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyRequest {
    pub worker_id: String,
    pub seq: u64,
    pub worker_address: String,
    pub cache_spec: Option<CacheSpec>,
    pub actions: Vec<ActionRequest>,
}

/// One validated action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    pub kind: ActionKind,
    pub tier: Tier,
    pub hashes: Vec<i64>,
    /// Empty (legacy: every mask 0) or aligned with `hashes`.
    pub component_masks: Vec<u32>,
    /// Empty (unknown) or aligned with `hashes`.
    pub block_sizes: Vec<u32>,
    /// The chain hint, as sent: the parent of `hashes[0]`, each later hash the child of the one
    /// before. Only a storage hint (which run to extend); it never changes an answer.
    pub parent_block_hash: Option<i64>,
}

/// An apply that passed validation; only [`ApplyRequest::validate`] makes one, so applying it
/// cannot fail half-way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidApply {
    pub(crate) worker_id: String,
    pub(crate) worker_address: String,
    pub(crate) cache_spec: Option<CacheSpec>,
    pub(crate) actions: Vec<Action>,
}

impl ValidApply {
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    pub fn actions(&self) -> &[Action] {
        &self.actions
    }

    /// The hashes its REPORT actions name: at most the new blocks applying it adds (see
    /// [`crate::Index::table_for`]).
    pub fn reported_blocks(&self) -> usize {
        self.actions
            .iter()
            .filter(|action| action.kind == ActionKind::Report)
            .map(|action| action.hashes.len())
            .sum()
    }
}

/// One worker's holdings at one tier among the hashes of a `MatchExternalKv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierHashes {
    pub tier: Tier,
    pub hashes: Vec<i64>,
    pub component_masks: Vec<u32>,
    pub block_sizes: Vec<u32>,
}

/// One worker's entry in a `MatchExternalKv` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMatch {
    pub worker_id: String,
    pub address: String,
    /// Tiers in ascending order, only those holding some requested hash.
    pub hashes_by_tier: Vec<TierHashes>,
}

/// One worker's entry in a `MatchExternalKvPrefix` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    pub worker_address: String,
    pub matched_prefix_blocks: u32,
    pub worker_id: String,
}

/// The answer to `MatchExternalKvPrefix`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixAnswer {
    /// Longest prefix first; ties ordered by worker id.
    pub matches: Vec<PrefixMatch>,
    pub best_prefix_blocks: u32,
    pub blocks_read: u32,
}

/// A worker as an answer names it: a handle into the [`crate::Index`] that answered, whose
/// `worker_id` and `worker_address` give its strings. Workers are never forgotten, so a handle
/// stays valid for that index's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerHandle(pub(crate) u32);

/// One worker's entry in a [`PrefixHits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHit {
    pub worker: WorkerHandle,
    pub matched_prefix_blocks: u32,
}

/// The answer to `MatchExternalKvPrefix` with workers by handle: what the server encodes from,
/// without a `String` per match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHits {
    /// Longest prefix first; ties ordered by worker id.
    pub matches: Vec<PrefixHit>,
    pub best_prefix_blocks: u32,
    pub blocks_read: u32,
}

/// Sizes of the index, for metrics and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block hashes with at least one placement.
    pub blocks: usize,
    /// `(worker, tier, block)` placements.
    pub placements: usize,
    /// Workers ever seen.
    pub workers: usize,
}
