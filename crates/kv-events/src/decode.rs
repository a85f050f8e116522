//! SGLang and vLLM batches as domain events: the medium becomes a [`Tier`], `component_types` a
//! mask, and an event the index cannot use is skipped with a [`SkipReason`] while the rest of its
//! batch goes on.

use kv_index::Tier;

use crate::wire::{self, BatchError, Engine, Field, Kind, Medium, RawEvent};

/// One payload, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The publisher's wall clock, in seconds.
    pub ts: f64,
    pub attn_dp_rank: Option<i64>,
    /// The usable events, in batch order.
    pub events: Vec<Event>,
    /// Why each unusable event was left out, in batch order.
    pub skipped: Vec<SkipReason>,
    /// Some skipped event may have been a removal of an indexed block (a malformed
    /// `BlockRemoved`, an event of unknown shape, or one from a hybrid model's second KV-cache
    /// group): the worker's placements can no longer be trusted, so the bridge clears them
    /// after the batch (an under-claim, never an over-claim).
    pub hides_removal: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved { block_hashes: Vec<i64>, tier: Tier },
    AllBlocksCleared,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// A chain: each hash's parent is the one before it, the first's is `parent_block_hash`.
    pub block_hashes: Vec<i64>,
    pub parent_block_hash: Option<i64>,
    /// Tokens per block; 0 when the event does not say.
    pub block_size: u32,
    pub tier: Tier,
    /// The OR of the `component_types` labels; `None` for a legacy whole-block event.
    pub component_mask: Option<u32>,
    pub lora_id: Option<i64>,
    pub cache_salt: Option<String>,
    pub session_id: Option<String>,
    pub lora_name: Option<String>,
    /// How many `token_ids` the event carried (the tokens themselves are not kept).
    pub n_token_ids: usize,
}

/// Why one event was left out of its batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkipReason {
    #[error("unknown medium {0:?}")]
    UnknownMedium(String),
    #[error("event has no medium")]
    MissingMedium,
    /// Blocks in an external store are not placed on this worker.
    #[error("medium EXTERNAL is not indexed")]
    ExternalMedium,
    #[error("unknown event type {0:?}")]
    UnknownEventType(String),
    #[error("malformed event: {0}")]
    Malformed(&'static str),
    /// vLLM's hybrid models (several KV-cache groups, e.g. full attention beside sliding
    /// window) are not indexed: a prefix is only reusable where every group holds it.
    #[error(
        "vLLM KV-cache group {0}: hybrid models (more than one group) are not indexed, the worker is cleared"
    )]
    HybridGroup(i64),
    /// `kv_cache_spec_kind` other than full or MLA attention.
    #[error("vLLM kv_cache_spec_kind {0:?} is not indexed (only full_attention, mla_attention)")]
    SpecKind(String),
}

impl SkipReason {
    /// A short stable label, for a metric.
    pub fn reason(&self) -> &'static str {
        match self {
            SkipReason::UnknownMedium(_) => "unknown_medium",
            SkipReason::MissingMedium => "missing_medium",
            SkipReason::ExternalMedium => "external_medium",
            SkipReason::UnknownEventType(_) => "unknown_event_type",
            SkipReason::Malformed(_) => "malformed",
            SkipReason::HybridGroup(_) => "hybrid_group",
            SkipReason::SpecKind(_) => "spec_kind",
        }
    }
}

/// Decodes one SGLang msgpack payload (the last frame of a live or replayed message).
///
/// Never panics. Broken msgpack, or a batch that is not `[ts, events, ...]`, is an error for the
/// whole payload; an event that is unusable on its own lands in [`DecodedBatch::skipped`].
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, BatchError> {
    decode_engine_batch(Engine::Sglang, payload)
}

/// Decodes one payload written by `engine`, as [`decode_batch`] does for SGLang.
pub fn decode_engine_batch(engine: Engine, payload: &[u8]) -> Result<DecodedBatch, BatchError> {
    let mut events = Vec::new();
    let mut skipped = Vec::new();
    let mut hides_removal = false;
    let header = wire::read_batch(payload, engine, |raw| {
        let removal = may_remove(&raw);
        match event(engine, raw) {
            Ok(event) => events.push(event),
            Err(reason) => {
                // A kind or medium that is never indexed hides no removal of an indexed block.
                hides_removal |= match reason {
                    SkipReason::ExternalMedium
                    | SkipReason::UnknownEventType(_)
                    | SkipReason::SpecKind(_) => false,
                    SkipReason::HybridGroup(_) => true,
                    _ => removal,
                };
                skipped.push(reason);
            }
        }
    })?;
    Ok(DecodedBatch {
        ts: header.ts,
        attn_dp_rank: header.attn_dp_rank,
        events,
        skipped,
        hides_removal,
    })
}

/// Whether an event, before it is judged, may be a removal: a `BlockRemoved`, or one whose
/// type cannot be read. An event type this version does not know is not one: a newer engine's
/// additions must not clear every worker that sends them.
fn may_remove(raw: &Field<RawEvent>) -> bool {
    match raw {
        Field::Value(raw) => matches!(
            raw.kind,
            Field::Value(Kind::Removed) | Field::Missing | Field::Bad
        ),
        Field::Missing | Field::Bad => true,
    }
}

fn event(engine: Engine, raw: Field<RawEvent>) -> Result<Event, SkipReason> {
    let Field::Value(raw) = raw else {
        return Err(SkipReason::Malformed("event is neither an array nor a map"));
    };
    if engine == Engine::Vllm {
        vllm_group(&raw)?;
    }
    match raw.kind {
        Field::Value(Kind::Stored) => stored(engine, raw),
        Field::Value(Kind::Removed) => {
            let block_hashes = hashes(raw.block_hashes)?;
            let tier = tier(engine, raw.medium)?;
            Ok(Event::BlockRemoved { block_hashes, tier })
        }
        Field::Value(Kind::Cleared) => Ok(Event::AllBlocksCleared),
        Field::Value(Kind::Unknown(name)) => Err(SkipReason::UnknownEventType(name)),
        Field::Missing => Err(SkipReason::Malformed("event has no type")),
        Field::Bad => Err(SkipReason::Malformed("event type is not a string")),
    }
}

/// vLLM's group and spec kind: group 0 (or none) of full or MLA attention is what a prefix
/// match means; anything else is refused.
fn vllm_group(raw: &RawEvent) -> Result<(), SkipReason> {
    match raw.group_idx {
        Field::Missing | Field::Value(0) => {}
        Field::Value(group) => return Err(SkipReason::HybridGroup(group)),
        Field::Bad => return Err(SkipReason::Malformed("group_idx is not an integer")),
    }
    match &raw.spec_kind {
        Field::Missing => Ok(()),
        Field::Value(kind) if kind == "full_attention" || kind == "mla_attention" => Ok(()),
        Field::Value(kind) => Err(SkipReason::SpecKind(kind.clone())),
        Field::Bad => Err(SkipReason::Malformed("kv_cache_spec_kind is not a string")),
    }
}

fn stored(engine: Engine, raw: RawEvent) -> Result<Event, SkipReason> {
    let block_hashes = hashes(raw.block_hashes)?;
    let parent_block_hash = optional(raw.parent_block_hash, "parent_block_hash is not an integer")?;
    let block_size = match optional(raw.block_size, "block_size is not an integer")? {
        None => 0,
        Some(size) => {
            u32::try_from(size).map_err(|_| SkipReason::Malformed("block_size is out of range"))?
        }
    };
    let n_token_ids = optional(raw.token_count, "token_ids is not an array")?.unwrap_or(0);
    let lora_id = optional(raw.lora_id, "lora_id is not an integer")?;
    let cache_salt = optional(raw.cache_salt, "cache_salt is not a string")?;
    let session_id = optional(raw.session_id, "session_id is not a string")?;
    let lora_name = optional(raw.lora_name, "lora_name is not a string")?;
    let component_mask = optional(raw.component_mask, "component_types is not an array")?;
    let tier = tier(engine, raw.medium)?;
    Ok(Event::BlockStored(BlockStored {
        block_hashes,
        parent_block_hash,
        block_size,
        tier,
        component_mask,
        lora_id,
        cache_salt,
        session_id,
        lora_name,
        n_token_ids,
    }))
}

fn hashes(field: Field<Vec<i64>>) -> Result<Vec<i64>, SkipReason> {
    match field {
        Field::Value(hashes) => Ok(hashes),
        Field::Missing => Err(SkipReason::Malformed("event has no block_hashes")),
        Field::Bad => Err(SkipReason::Malformed(
            "block_hashes is not an array of integers",
        )),
    }
}

fn optional<T>(field: Field<T>, bad: &'static str) -> Result<Option<T>, SkipReason> {
    match field {
        Field::Value(value) => Ok(Some(value)),
        Field::Missing => Ok(None),
        Field::Bad => Err(SkipReason::Malformed(bad)),
    }
}

/// The medium's tier. vLLM's `medium` is optional: its GPU block pool always names one, and an
/// event without it comes from the GPU pool of a build before the field (as vLLM's own
/// consumers read it), so nil is HBM there; for SGLang it is an error, as the contract says.
fn tier(engine: Engine, medium: Field<Medium>) -> Result<Tier, SkipReason> {
    match medium {
        Field::Value(Medium::Gpu) => Ok(Tier::Hbm),
        Field::Missing if engine == Engine::Vllm => Ok(Tier::Hbm),
        Field::Value(Medium::Host) => Ok(Tier::Dram),
        Field::Value(Medium::Disk) => Ok(Tier::Ssd),
        Field::Value(Medium::External) => Err(SkipReason::ExternalMedium),
        Field::Value(Medium::Other(name)) => Err(SkipReason::UnknownMedium(name)),
        Field::Missing => Err(SkipReason::MissingMedium),
        Field::Bad => Err(SkipReason::Malformed("medium is not a string")),
    }
}
