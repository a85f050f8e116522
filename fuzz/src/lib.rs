//! What the fuzz targets share: the bridge's path from a msgpack payload to the apply messages
//! it sends, and the framing of a multipart ZMQ message in a fuzz input.

use kv_index::Tier;
use kv_indexer_proto::convert::WorkerHeader;
use kv_indexer_proto::v1 as pb;

/// The tiers a bridge clears by default.
pub const TIERS: [Tier; 3] = [Tier::Hbm, Tier::Dram, Tier::Ssd];

/// The apply messages an SGLang bridge sends for `payload` (through the bridge's own
/// `kv_bridge::batch`), or `None` when the batch is rejected.
pub fn bridge_messages(
    payload: &[u8],
    worker_id: &str,
) -> Option<Vec<pb::ApplyExternalKvBatchRequest>> {
    engine_messages(kv_events::Engine::Sglang, payload, worker_id)
}

/// As [`bridge_messages`], for a bridge following `engine`.
pub fn engine_messages(
    engine: kv_events::Engine,
    payload: &[u8],
    worker_id: &str,
) -> Option<Vec<pb::ApplyExternalKvBatchRequest>> {
    let header = WorkerHeader {
        worker_id: worker_id.into(),
        ..WorkerHeader::default()
    };
    kv_bridge::batch::messages(engine, payload, &header, 0, &TIERS).ok()
}

/// Splits `data` into `(length-prefixed part, rest)`: a little-endian u32 length, then that many
/// bytes (fewer when the input ends first).
pub fn take_prefixed(data: &[u8]) -> (&[u8], &[u8]) {
    let Some((len, rest)) = data.split_first_chunk::<4>() else {
        return (data, &[]);
    };
    let len = (u32::from_le_bytes(*len) as usize).min(rest.len());
    rest.split_at(len)
}

/// A multipart message: length-prefixed frames until the input ends.
pub fn frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    while !data.is_empty() {
        let (frame, rest) = take_prefixed(data);
        frames.push(frame);
        data = rest;
    }
    frames
}
