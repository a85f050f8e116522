//! One payload's way to the Indexer, pure: msgpack → events → actions → RPC-sized groups →
//! apply messages. The bridge's stream and sender go through these functions, and so do the
//! fuzz targets (`fuzz/src/lib.rs`), so the fuzzers exercise the bridge's own path.

use kv_events::{Action, BatchError, Engine, SkipReason, decode_engine_batch, map_events, split};
use kv_index::Tier;
use kv_indexer_proto::convert::{WorkerHeader, apply_message};
use kv_indexer_proto::v1 as pb;

/// A decoded payload as the RPCs it splits into.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    /// The usable events the payload held.
    pub events: usize,
    /// Why each unusable event was left out, in batch order.
    pub skipped: Vec<SkipReason>,
    /// A skipped event may have been a removal: the worker must be cleared after these RPCs.
    pub hides_removal: bool,
    /// The actions of each RPC, in order (empty when the events change nothing).
    pub rpcs: Vec<Vec<Action>>,
}

/// Decodes `payload`, written by `engine`, and maps its events to the actions of each RPC;
/// `AllBlocksCleared` clears `clear_tiers`.
pub fn map(engine: Engine, payload: &[u8], clear_tiers: &[Tier]) -> Result<Mapped, BatchError> {
    let batch = decode_engine_batch(engine, payload)?;
    Ok(Mapped {
        events: batch.events.len(),
        rpcs: split(map_events(&batch.events, clear_tiers)),
        skipped: batch.skipped,
        hides_removal: batch.hides_removal,
    })
}

/// The apply requests of one batch's RPCs, all with the batch's `seq`.
pub fn requests(
    header: &WorkerHeader,
    seq: u64,
    rpcs: Vec<Vec<Action>>,
) -> Vec<pb::ApplyExternalKvBatchRequest> {
    rpcs.into_iter()
        .map(|actions| apply_message(header, seq, actions))
        .collect()
}

/// The apply requests a bridge sends for `payload`, as [`map`] then [`requests`] do.
pub fn messages(
    engine: Engine,
    payload: &[u8],
    header: &WorkerHeader,
    seq: u64,
    clear_tiers: &[Tier],
) -> Result<Vec<pb::ApplyExternalKvBatchRequest>, BatchError> {
    Ok(requests(
        header,
        seq,
        map(engine, payload, clear_tiers)?.rpcs,
    ))
}
