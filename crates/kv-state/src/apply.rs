//! One record applied to the index and the workers' meta: the step the writer, replay, a
//! replica's applier and snapshot building all share, so that each decides alike.

use kv_index::{ActionRequest, ApplyRequest, Index, IndexStats, NodeMatch, Tier, ValidApply};
use kv_indexer_proto::convert;

use crate::error::ChangeError;
use crate::meta::{Meta, fence, worker_meta};
use crate::record::{Change, Record};

/// What one applied record produced.
#[derive(Debug)]
pub enum Applied {
    Apply(IndexStats),
    CountHits(Vec<NodeMatch>),
    Expire,
}

/// Applies a validated apply and notes the worker as seen: the one step live applies and
/// replay share.
pub fn apply_valid(
    index: &mut Index,
    meta: &mut Meta,
    valid: &ValidApply,
    incarnation: Option<u64>,
    time_ms: u64,
) -> IndexStats {
    index.apply(valid);
    let entry = worker_meta(meta, valid.worker_id());
    entry.last_seen_ms = entry.last_seen_ms.max(time_ms);
    entry.expired = false;
    if let Some(incarnation) = incarnation {
        entry.incarnation = entry.incarnation.max(incarnation);
    }
    index.stats()
}

/// Applies any record (replay, snapshot building, and the writer's non-apply changes).
pub fn apply_record(
    index: &mut Index,
    meta: &mut Meta,
    record: &Record,
) -> Result<Applied, ChangeError> {
    match &record.change {
        Change::Apply(request) => {
            let incarnation = request.bridge_incarnation;
            // Live applies were fenced before they were logged, so this passes on replay; a
            // fleet's replicas fence here, in log order, all alike.
            fence(meta, &request.worker_id, incarnation)?;
            let valid = convert::apply_request(request.clone()).validate()?;
            Ok(Applied::Apply(apply_valid(
                index,
                meta,
                &valid,
                incarnation,
                record.time_ms,
            )))
        }
        Change::CountHits(hashes) => {
            let matches = index.match_kv(hashes)?;
            index.count_hits(hashes);
            Ok(Applied::CountHits(matches))
        }
        Change::Expire(workers) => {
            for worker in workers {
                index.apply(&clear_all(worker)?);
                worker_meta(meta, worker).expired = true;
            }
            Ok(Applied::Expire)
        }
        Change::ExpireUnseen(workers) => {
            for (worker, seen) in workers {
                let unseen_since = meta
                    .get(worker)
                    .is_some_and(|known| !known.expired && known.last_seen_ms <= *seen);
                if unseen_since {
                    index.apply(&clear_all(worker)?);
                    worker_meta(meta, worker).expired = true;
                }
            }
            Ok(Applied::Expire)
        }
    }
}

/// Clears every tier of `worker`, keeping its address and spec.
fn clear_all(worker: &str) -> Result<ValidApply, ChangeError> {
    ApplyRequest {
        worker_id: worker.to_owned(),
        actions: Tier::ALL
            .iter()
            .map(|tier| ActionRequest {
                action_type: kv_index::ActionKind::ClearAllAtTier as i32,
                tier: tier.wire(),
                ..ActionRequest::default()
            })
            .collect(),
        ..ApplyRequest::default()
    }
    .validate()
    .map_err(ChangeError::from)
}
