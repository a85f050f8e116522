//! One record applied to the index and the workers' meta: the step the writer, replay, a
//! replica's applier and snapshot building all share, so that each decides alike. The index is
//! changed through [`IndexChange`]: a plain index (replay) or the writer's copy, which records
//! the change for the other copy.

use kv_index::{ActionRequest, ApplyRequest, IndexStats, NodeMatch, Tier, ValidApply};
use kv_indexer_proto::convert;

use crate::cell::IndexChange;
use crate::error::ChangeError;
use crate::meta::{Gate, Meta, admit, worker_meta};
use crate::record::{Change, Record};

/// What one applied record produced.
#[derive(Debug)]
pub enum Applied {
    Apply(IndexStats),
    /// A batch already applied, acknowledged again and not applied.
    Duplicate(IndexStats),
    /// A batch after a gap: the worker was cleared instead (see [`Gate::Gap`]).
    Resync(ChangeError),
    CountHits(Vec<NodeMatch>),
    /// Workers expired (or dropped), with the placements they held.
    Expire {
        placements: usize,
    },
}

impl Applied {
    /// Logs and counts a re-sync, where a change is applied live (a single server's writer, a
    /// replica's applier): replay and snapshot building decide the same silently.
    pub fn note_live(&self) {
        if let Applied::Resync(gap) = self {
            crate::observe::sequence_gap();
            tracing::warn!(%gap, "acknowledged batches of a worker are lost: cleared it, its bridge re-syncs");
        }
    }

    /// What the caller of an apply is answered: the index's sizes, or a re-sync.
    pub fn answer(self) -> Result<IndexStats, ChangeError> {
        match self {
            Applied::Apply(stats) | Applied::Duplicate(stats) => Ok(stats),
            Applied::Resync(gap) => Err(gap),
            Applied::CountHits(_) | Applied::Expire { .. } => Err(ChangeError::WriterGone),
        }
    }
}

/// Applies an admitted apply: as it is ([`Gate::Next`]), not at all ([`Gate::Duplicate`]), or,
/// after a gap, by clearing the worker. The one step live applies, replay and replicas share.
pub fn apply_admitted(
    index: &mut impl IndexChange,
    meta: &mut Meta,
    valid: &ValidApply,
    gate: Gate,
    time_ms: u64,
) -> Result<Applied, ChangeError> {
    let worker_id = valid.worker_id();
    match gate {
        Gate::Next => Ok(Applied::Apply(apply_valid(index, meta, valid, time_ms))),
        Gate::Duplicate => Ok(Applied::Duplicate(index.index().stats())),
        Gate::Gap { expected } => {
            let cleared = clear_all(worker_id)?;
            apply_valid(index, meta, &cleared, time_ms);
            let known = meta.get(worker_id).copied().unwrap_or_default();
            Ok(Applied::Resync(ChangeError::Gap {
                worker_id: worker_id.to_owned(),
                incarnation: known.incarnation,
                expected,
                got: known.batch,
            }))
        }
    }
}

/// Applies a validated apply and notes the worker as seen.
fn apply_valid(
    index: &mut impl IndexChange,
    meta: &mut Meta,
    valid: &ValidApply,
    time_ms: u64,
) -> IndexStats {
    index.apply(valid);
    let entry = worker_meta(meta, valid.worker_id());
    entry.last_seen_ms = entry.last_seen_ms.max(time_ms);
    entry.expired = false;
    index.index().stats()
}

/// Applies any record (replay, snapshot building, and the writer's non-apply changes).
pub fn apply_record(
    index: &mut impl IndexChange,
    meta: &mut Meta,
    record: &Record,
) -> Result<Applied, ChangeError> {
    match &record.change {
        Change::Apply(request) => {
            let valid = convert::apply_request(request.clone()).validate()?;
            // Live applies were admitted before they were logged, so this decides alike on
            // replay; a fleet's replicas admit here, in log order, all alike.
            let gate = admit(
                meta,
                &request.worker_id,
                request.bridge_incarnation,
                request.bridge_batch,
            )?;
            apply_admitted(index, meta, &valid, gate, record.time_ms)
        }
        Change::CountHits(hashes) => {
            let matches = index.index().match_kv(hashes)?;
            index.count_hits(hashes);
            Ok(Applied::CountHits(matches))
        }
        Change::Expire(workers) => {
            let mut placements = 0;
            for worker in workers {
                placements += expire(index, meta, worker)?;
            }
            Ok(Applied::Expire { placements })
        }
        Change::ExpireUnseen(workers) => {
            let mut placements = 0;
            for (worker, seen) in workers {
                let unseen_since = meta
                    .get(worker)
                    .is_some_and(|known| !known.expired && known.last_seen_ms <= *seen);
                if unseen_since {
                    placements += expire(index, meta, worker)?;
                }
            }
            Ok(Applied::Expire { placements })
        }
    }
}

/// Clears every tier of a worker the index knows (keeping its address and spec) and marks it
/// expired; the placements it held.
fn expire(
    index: &mut impl IndexChange,
    meta: &mut Meta,
    worker: &str,
) -> Result<usize, ChangeError> {
    let Some(placements) = index.index().worker_placements(worker) else {
        return Ok(0);
    };
    index.apply(&clear_all(worker)?);
    worker_meta(meta, worker).expired = true;
    Ok(placements)
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
