//! Conversion between the generated wire types and the index's domain types, both ways: the
//! only module that knows both. The server turns requests into domain types and answers into
//! wire types; the bridge (and the fuzz targets, through the bridge's own path) turns its
//! actions into requests.

use kv_index::{
    Action, ActionKind, ActionRequest, ApplyRequest, CacheSpec, NodeMatch, PrefixAnswer, TierHashes,
};

use crate::v1 as pb;

/// What every apply request of one worker carries besides its sequence number and actions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerHeader {
    pub worker_id: String,
    pub worker_address: String,
    pub cache_spec: Option<CacheSpec>,
    /// The bridge's incarnation (the `bridge_incarnation` extension), when it sends one.
    pub bridge_incarnation: Option<u64>,
}

/// The apply request a bridge sends for `actions`.
pub fn apply_message(
    header: &WorkerHeader,
    seq: u64,
    actions: Vec<Action>,
) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: header.worker_id.clone(),
        seq,
        actions: actions.into_iter().map(action_message).collect(),
        worker_address: header.worker_address.clone(),
        cache_spec: header.cache_spec.map(cache_spec_message),
        bridge_incarnation: header.bridge_incarnation,
        // Numbered by the sender as it sends (a retry keeps its number).
        bridge_batch: None,
    }
}

pub fn action_message(action: Action) -> pb::ExternalKvAction {
    let kind = match action.kind {
        ActionKind::Report => pb::ExternalKvActionType::ActionReport,
        ActionKind::Revoke => pb::ExternalKvActionType::ActionRevoke,
        ActionKind::ClearAllAtTier => pb::ExternalKvActionType::ActionClearAllAtTier,
    };
    pb::ExternalKvAction {
        r#type: kind as i32,
        tier: action.tier.wire(),
        hashes: action.hashes,
        component_masks: action.component_masks,
        block_sizes: action.block_sizes,
        parent_block_hash: action.parent_block_hash,
    }
}

/// The spec's six fields, the same on both sides: one mapping for both directions.
macro_rules! spec_fields {
    ($spec:expr => $to:path) => {{
        let s = $spec;
        $to {
            version: s.version,
            components: s.components,
            swa_window_tokens: s.swa_window_tokens,
            full_tier_mask: s.full_tier_mask,
            swa_tier_mask: s.swa_tier_mask,
            mamba_tier_mask: s.mamba_tier_mask,
        }
    }};
}

pub fn cache_spec_message(spec: CacheSpec) -> pb::WorkerCacheSpec {
    spec_fields!(spec => pb::WorkerCacheSpec)
}

fn cache_spec(spec: pb::WorkerCacheSpec) -> CacheSpec {
    spec_fields!(spec => CacheSpec)
}

pub fn apply_request(request: pb::ApplyExternalKvBatchRequest) -> ApplyRequest {
    ApplyRequest {
        worker_id: request.worker_id,
        seq: request.seq,
        worker_address: request.worker_address,
        cache_spec: request.cache_spec.map(cache_spec),
        actions: request
            .actions
            .into_iter()
            .map(|action| ActionRequest {
                action_type: action.r#type,
                tier: action.tier,
                hashes: action.hashes,
                component_masks: action.component_masks,
                block_sizes: action.block_sizes,
                parent_block_hash: action.parent_block_hash,
            })
            .collect(),
    }
}

pub fn prefix_response(answer: PrefixAnswer) -> pb::MatchExternalKvPrefixResponse {
    pb::MatchExternalKvPrefixResponse {
        matches: answer
            .matches
            .into_iter()
            .map(|m| pb::ExternalKvPrefixMatch {
                worker_address: m.worker_address,
                matched_prefix_blocks: m.matched_prefix_blocks,
                worker_id: m.worker_id,
            })
            .collect(),
        best_prefix_blocks: answer.best_prefix_blocks,
        blocks_read: answer.blocks_read,
        predicted: Vec::new(),
    }
}

pub fn match_response(matches: Vec<NodeMatch>) -> pb::MatchExternalKvResponse {
    pb::MatchExternalKvResponse {
        matches: matches
            .into_iter()
            .map(|node| pb::ExternalKvNodeMatch {
                worker_id: node.worker_id,
                address: node.address,
                hashes_by_tier: node.hashes_by_tier.into_iter().map(tier_hashes).collect(),
            })
            .collect(),
    }
}

fn tier_hashes(tier: TierHashes) -> pb::TierHashes {
    pb::TierHashes {
        tier: tier.tier.wire(),
        hashes: tier.hashes,
        component_masks: tier.component_masks,
        block_sizes: tier.block_sizes,
    }
}

pub fn hit_counts_response(entries: Vec<(i64, u64)>) -> pb::GetExternalKvHitCountsResponse {
    pb::GetExternalKvHitCountsResponse {
        entries: entries
            .into_iter()
            .map(|(hash, hit_count_total)| pb::HitCountEntry {
                hash,
                hit_count_total,
            })
            .collect(),
    }
}
