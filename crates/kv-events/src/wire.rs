//! What SGLang writes: the msgpack batch `[ts, events, attn_dp_rank, ...]` and its events, in
//! the map era (`{"type": "BlockStored", ...}`, 0.5.20 and later) and the array era
//! (`["BlockStored", ...]`, up to 0.5.18); and what vLLM writes, the same batch shape with map
//! events of its own (`[ts, events, data_parallel_rank]`, `scripts/vllm/FACTS.md`). The
//! [`Engine`] decides the medium names and whether a hash may be a raw digest.
//!
//! Everything is read with `deserialize_any` through one lenient visitor, `Lenient`, shaped by a
//! `Shape`: a value of the expected shape becomes `Field::Value`, nil becomes `Field::Missing`,
//! anything else is consumed and becomes `Field::Bad`. So a wrongly typed field never aborts the
//! stream: `decode` turns it into a skipped event, and only broken msgpack or a wrongly shaped
//! batch fails the whole payload. A derived `#[serde(tag)]` enum could do neither, and breaks on
//! trailing fields.

use std::fmt;

use serde::Deserializer as _;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Nesting deeper than this is a malformed batch. SGLang's deepest value is 4 levels (batch,
/// events, event, hashes); the limit keeps the recursion of skipped values far from the stack's
/// end.
pub const MAX_DEPTH: usize = 32;

/// Vectors are preallocated from the length a msgpack header claims, but never beyond this: the
/// header of a hostile payload may claim 2^32 elements.
const MAX_PREALLOC: usize = 1 << 16;

/// Which engine wrote the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    #[default]
    Sglang,
    Vllm,
}

impl std::str::FromStr for Engine {
    type Err = String;

    fn from_str(value: &str) -> Result<Engine, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "sglang" => Ok(Engine::Sglang),
            "vllm" => Ok(Engine::Vllm),
            other => Err(format!("unknown engine {other:?}: expected sglang or vllm")),
        }
    }
}

/// vLLM's hash as our signed 64-bit field: the digest's last 8 bytes, big-endian, the bits of
/// the unsigned int vLLM publishes by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), so both
/// forms of one hash meet. `kv_indexer_client::vllm_hashing::event_hash` is the same rule.
pub fn vllm_digest_hash(digest: &[u8]) -> Option<i64> {
    let tail: [u8; 8] = digest
        .get(digest.len().checked_sub(8)?..)?
        .try_into()
        .ok()?;
    Some(i64::from_be_bytes(tail))
}

/// Why a whole payload was rejected. None of its events are used.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("payload is not valid msgpack")]
    Msgpack(#[source] rmp_serde::decode::Error),
    #[error("batch is not a msgpack array")]
    NotAnArray,
    #[error("batch array has {len} elements, at least 2 expected")]
    TooShort { len: usize },
    #[error("batch timestamp is not a number")]
    BadTimestamp,
    #[error("batch events are not an array")]
    EventsNotAnArray,
    #[error("batch attn_dp_rank is neither an integer nor nil")]
    BadRank,
    #[error("{count} bytes follow the batch")]
    TrailingBytes { count: usize },
}

impl BatchError {
    /// A short stable label, for a metric.
    pub fn reason(&self) -> &'static str {
        match self {
            BatchError::Msgpack(_) => "bad_msgpack",
            BatchError::NotAnArray => "not_an_array",
            BatchError::TooShort { .. } => "too_short",
            BatchError::BadTimestamp => "bad_timestamp",
            BatchError::EventsNotAnArray => "events_not_an_array",
            BatchError::BadRank => "bad_rank",
            BatchError::TrailingBytes { .. } => "trailing_bytes",
        }
    }
}

/// One field as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) enum Field<T> {
    /// Absent, or nil.
    #[default]
    Missing,
    Value(T),
    /// Present with another shape.
    Bad,
}

/// The event class, from `"type"` (map era) or the tag (array era).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown(String),
}

/// `medium` as written (SGLang's `GPU`/`CPU_PINNED`/`DISK`, vLLM's `GPU`/`CPU`/`STORAGE`).
/// Which of them are indexed is `decode`'s business.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Medium {
    Gpu,
    Host,
    Disk,
    External,
    Other(String),
}

/// One event with every field either encoding may carry; which ones count depends on `kind`.
#[derive(Debug, Default)]
pub(crate) struct RawEvent {
    pub kind: Field<Kind>,
    pub block_hashes: Field<Vec<i64>>,
    pub parent_block_hash: Field<i64>,
    /// `token_ids`, counted rather than kept: nothing downstream needs the tokens.
    pub token_count: Field<usize>,
    pub block_size: Field<i64>,
    pub lora_id: Field<i64>,
    pub medium: Field<Medium>,
    pub cache_salt: Field<String>,
    pub session_id: Field<String>,
    pub lora_name: Field<String>,
    /// `component_types`, already OR'd into a mask.
    pub component_mask: Field<u32>,
    /// vLLM's KV-cache group (hybrid models have several).
    pub group_idx: Field<i64>,
    /// vLLM's `kv_cache_spec_kind` (set by the offloading connectors).
    pub spec_kind: Field<String>,
}

/// The batch around the events.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Header {
    pub ts: f64,
    pub attn_dp_rank: Option<i64>,
}

/// Reads one payload, handing each event (or the [`Field::Missing`]/[`Field::Bad`] that stood in
/// its place) to `on_event` in order.
pub(crate) fn read_batch(
    payload: &[u8],
    engine: Engine,
    on_event: impl FnMut(Field<RawEvent>),
) -> Result<Header, BatchError> {
    // A cursor rather than `from_read_ref`: only it tells how much was read.
    let mut deserializer = rmp_serde::Deserializer::new(std::io::Cursor::new(payload));
    deserializer.set_max_depth(MAX_DEPTH);
    let batch = (&mut deserializer)
        .deserialize_any(Lenient(BatchShape { engine, on_event }))
        .map_err(BatchError::Msgpack)?;
    let header = match batch {
        Field::Value(header) => header?,
        Field::Missing | Field::Bad => return Err(BatchError::NotAnArray),
    };
    let read = usize::try_from(deserializer.position()).unwrap_or(usize::MAX);
    let count = payload.len().saturating_sub(read);
    if count != 0 {
        return Err(BatchError::TrailingBytes { count });
    }
    Ok(header)
}

/// What one value may be; every hook not overridden turns the value into [`Field::Bad`].
pub(crate) trait Shape<'de>: Sized {
    type Out;

    fn int(self, _value: i64) -> Field<Self::Out> {
        Field::Bad
    }

    /// Unsigned values are written as msgpack uints: SGLang's hashes are i64 on the wire
    /// contract, so the default reinterprets the bits, as msgspec's encoder made them.
    fn uint(self, value: u64) -> Field<Self::Out> {
        self.int(value as i64)
    }

    fn float(self, _value: f64) -> Field<Self::Out> {
        Field::Bad
    }

    fn str(self, _value: &str) -> Field<Self::Out> {
        Field::Bad
    }

    fn bytes(self, _value: &[u8]) -> Field<Self::Out> {
        Field::Bad
    }

    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Field<Self::Out>, A::Error> {
        drain_seq(seq)?;
        Ok(Field::Bad)
    }

    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Field<Self::Out>, A::Error> {
        drain_map(map)?;
        Ok(Field::Bad)
    }
}

/// The one visitor: accepts every msgpack value and lets the shape judge it.
pub(crate) struct Lenient<S>(pub S);

impl<'de, S: Shape<'de>> DeserializeSeed<'de> for Lenient<S> {
    type Value = Field<S::Out>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, S: Shape<'de>> Visitor<'de> for Lenient<S> {
    type Value = Field<S::Out>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any msgpack value")
    }

    fn visit_bool<E: de::Error>(self, _value: bool) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        Ok(self.0.int(value))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        Ok(self.0.uint(value))
    }

    fn visit_i128<E: de::Error>(self, _value: i128) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }

    fn visit_u128<E: de::Error>(self, _value: u128) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        Ok(self.0.float(value))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(self.0.str(value))
    }

    /// Binaries, and strings that are not UTF-8 (rmp-serde offers those as bytes).
    fn visit_bytes<E: de::Error>(self, value: &[u8]) -> Result<Self::Value, E> {
        Ok(self.0.bytes(value))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Field::Missing)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Field::Missing)
    }

    fn visit_some<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    /// Msgpack extension values arrive here.
    fn visit_newtype_struct<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_ignored_any(IgnoredAny)?;
        Ok(Field::Bad)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        self.0.seq(seq)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.0.map(map)
    }
}

/// rmp-serde fails a sequence that its visitor left unfinished, so every early exit drains.
fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

fn prealloc<T>(hint: Option<usize>) -> Vec<T> {
    Vec::with_capacity(hint.unwrap_or(0).min(MAX_PREALLOC))
}

/// Reads the next element into `slot`; false once the sequence is exhausted (missing trailing
/// elements stay [`Field::Missing`]).
fn next_into<'de, A: SeqAccess<'de>, S: Shape<'de>>(
    seq: &mut A,
    shape: S,
    slot: &mut Field<S::Out>,
) -> Result<bool, A::Error> {
    match seq.next_element_seed(Lenient(shape))? {
        Some(field) => {
            *slot = field;
            Ok(true)
        }
        None => Ok(false),
    }
}

struct IntShape;

impl Shape<'_> for IntShape {
    type Out = i64;

    fn int(self, value: i64) -> Field<i64> {
        Field::Value(value)
    }
}

struct NumberShape;

impl Shape<'_> for NumberShape {
    type Out = f64;

    fn int(self, value: i64) -> Field<f64> {
        Field::Value(value as f64)
    }

    fn uint(self, value: u64) -> Field<f64> {
        Field::Value(value as f64)
    }

    fn float(self, value: f64) -> Field<f64> {
        Field::Value(value)
    }
}

struct StringShape;

impl Shape<'_> for StringShape {
    type Out = String;

    fn str(self, value: &str) -> Field<String> {
        Field::Value(value.to_owned())
    }
}

struct KindShape;

impl Shape<'_> for KindShape {
    type Out = Kind;

    fn str(self, value: &str) -> Field<Kind> {
        Field::Value(match value {
            "BlockStored" => Kind::Stored,
            "BlockRemoved" => Kind::Removed,
            "AllBlocksCleared" => Kind::Cleared,
            other => Kind::Unknown(other.to_owned()),
        })
    }
}

struct MediumShape(Engine);

impl Shape<'_> for MediumShape {
    type Out = Medium;

    /// Exact names only. vLLM's Mooncake and LMCache connectors write `"cpu"` and never remove
    /// what they stored: read, those stores would be over-claims forever, so they stay unknown.
    fn str(self, value: &str) -> Field<Medium> {
        Field::Value(match (self.0, value) {
            (_, "GPU") => Medium::Gpu,
            (Engine::Sglang, "CPU_PINNED") | (Engine::Vllm, "CPU") => Medium::Host,
            (Engine::Sglang, "DISK") | (Engine::Vllm, "STORAGE") => Medium::Disk,
            (Engine::Sglang, "EXTERNAL") => Medium::External,
            (_, other) => Medium::Other(other.to_owned()),
        })
    }
}

/// One block hash: an integer, or for vLLM also the raw digest ([`vllm_digest_hash`]).
struct HashShape(Engine);

impl Shape<'_> for HashShape {
    type Out = i64;

    fn int(self, value: i64) -> Field<i64> {
        Field::Value(value)
    }

    fn bytes(self, value: &[u8]) -> Field<i64> {
        match (self.0, vllm_digest_hash(value)) {
            (Engine::Vllm, Some(hash)) => Field::Value(hash),
            _ => Field::Bad,
        }
    }
}

/// A list of hashes; one element of another shape (nil included) spoils the list.
struct HashesShape(Engine);

impl<'de> Shape<'de> for HashesShape {
    type Out = Vec<i64>;

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field<Vec<i64>>, A::Error> {
        let mut hashes = prealloc(seq.size_hint());
        let mut all_ints = true;
        while let Some(element) = seq.next_element_seed(Lenient(HashShape(self.0)))? {
            match element {
                Field::Value(hash) => hashes.push(hash),
                Field::Missing | Field::Bad => all_ints = false,
            }
        }
        Ok(if all_ints {
            Field::Value(hashes)
        } else {
            Field::Bad
        })
    }
}

/// A list of anything, counted.
struct CountShape;

impl<'de> Shape<'de> for CountShape {
    type Out = usize;

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field<usize>, A::Error> {
        let mut count = 0;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            count += 1;
        }
        Ok(Field::Value(count))
    }
}

/// One component label's bit; labels this version does not know are 0.
struct LabelShape;

impl Shape<'_> for LabelShape {
    type Out = u32;

    fn str(self, value: &str) -> Field<u32> {
        Field::Value(match value {
            "full" => kv_index::COMPONENT_FULL,
            "swa" => kv_index::COMPONENT_SWA,
            "mamba" => kv_index::COMPONENT_MAMBA,
            _ => 0,
        })
    }
}

/// `component_types`: the OR of its labels. Elements that are not strings are ignored like
/// unknown labels: a newer engine's additions must not cost us the event.
struct LabelsShape;

impl<'de> Shape<'de> for LabelsShape {
    type Out = u32;

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field<u32>, A::Error> {
        let mut mask = 0;
        while let Some(label) = seq.next_element_seed(Lenient(LabelShape))? {
            if let Field::Value(bit) = label {
                mask |= bit;
            }
        }
        Ok(Field::Value(mask))
    }
}

/// The map-era keys this crate reads; the rest are skipped.
enum Key {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    CacheSalt,
    SessionId,
    LoraName,
    ComponentTypes,
    GroupIdx,
    SpecKind,
    Other,
}

struct KeyShape;

impl Shape<'_> for KeyShape {
    type Out = Key;

    fn str(self, value: &str) -> Field<Key> {
        Field::Value(match value {
            "type" => Key::Type,
            "block_hashes" => Key::BlockHashes,
            "parent_block_hash" => Key::ParentBlockHash,
            "token_ids" => Key::TokenIds,
            "block_size" => Key::BlockSize,
            "lora_id" => Key::LoraId,
            "medium" => Key::Medium,
            "cache_salt" => Key::CacheSalt,
            "session_id" => Key::SessionId,
            "lora_name" => Key::LoraName,
            "component_types" => Key::ComponentTypes,
            "group_idx" => Key::GroupIdx,
            "kv_cache_spec_kind" => Key::SpecKind,
            _ => Key::Other,
        })
    }
}

struct EventShape(Engine);

impl<'de> Shape<'de> for EventShape {
    type Out = RawEvent;

    /// Array era: the tag, then the fields by position. Missing trailing elements stay
    /// [`Field::Missing`]; extra ones are skipped.
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field<RawEvent>, A::Error> {
        let mut event = RawEvent::default();
        if next_into(&mut seq, KindShape, &mut event.kind)? {
            let e = &mut event;
            let s = &mut seq;
            let engine = self.0;
            match e.kind {
                Field::Value(Kind::Stored) => {
                    let _ = next_into(s, HashesShape(engine), &mut e.block_hashes)?
                        && next_into(s, HashShape(engine), &mut e.parent_block_hash)?
                        && next_into(s, CountShape, &mut e.token_count)?
                        && next_into(s, IntShape, &mut e.block_size)?
                        && next_into(s, IntShape, &mut e.lora_id)?
                        && next_into(s, MediumShape(engine), &mut e.medium)?
                        && next_into(s, LabelsShape, &mut e.component_mask)?;
                }
                Field::Value(Kind::Removed) => {
                    let _ = next_into(s, HashesShape(engine), &mut e.block_hashes)?
                        && next_into(s, MediumShape(engine), &mut e.medium)?;
                }
                _ => {}
            }
        }
        drain_seq(seq)?;
        Ok(Field::Value(event))
    }

    /// Map era: keys in any order, unknown keys skipped, a repeated key's last value wins.
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Field<RawEvent>, A::Error> {
        let mut e = RawEvent::default();
        let engine = self.0;
        while let Some(key) = map.next_key_seed(Lenient(KeyShape))? {
            let Field::Value(key) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            match key {
                Key::Type => e.kind = map.next_value_seed(Lenient(KindShape))?,
                Key::BlockHashes => {
                    e.block_hashes = map.next_value_seed(Lenient(HashesShape(engine)))?;
                }
                Key::ParentBlockHash => {
                    e.parent_block_hash = map.next_value_seed(Lenient(HashShape(engine)))?;
                }
                Key::TokenIds => e.token_count = map.next_value_seed(Lenient(CountShape))?,
                Key::BlockSize => e.block_size = map.next_value_seed(Lenient(IntShape))?,
                Key::LoraId => e.lora_id = map.next_value_seed(Lenient(IntShape))?,
                Key::Medium => e.medium = map.next_value_seed(Lenient(MediumShape(engine)))?,
                Key::CacheSalt => e.cache_salt = map.next_value_seed(Lenient(StringShape))?,
                Key::SessionId => e.session_id = map.next_value_seed(Lenient(StringShape))?,
                Key::LoraName => e.lora_name = map.next_value_seed(Lenient(StringShape))?,
                Key::ComponentTypes => {
                    e.component_mask = map.next_value_seed(Lenient(LabelsShape))?;
                }
                Key::GroupIdx => e.group_idx = map.next_value_seed(Lenient(IntShape))?,
                Key::SpecKind => e.spec_kind = map.next_value_seed(Lenient(StringShape))?,
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Field::Value(e))
    }
}

/// The events array: each element goes to the callback as soon as it is read.
struct EventsShape<'f, F> {
    engine: Engine,
    on_event: &'f mut F,
}

impl<'de, F: FnMut(Field<RawEvent>)> Shape<'de> for EventsShape<'_, F> {
    type Out = ();

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field<()>, A::Error> {
        while let Some(event) = seq.next_element_seed(Lenient(EventShape(self.engine)))? {
            (self.on_event)(event);
        }
        Ok(Field::Value(()))
    }
}

/// `[ts, events, attn_dp_rank, ...]`. Its verdict is a value, so that the error stays typed
/// rather than going through serde's string errors.
struct BatchShape<F> {
    engine: Engine,
    on_event: F,
}

impl<'de, F: FnMut(Field<RawEvent>)> Shape<'de> for BatchShape<F> {
    type Out = Result<Header, BatchError>;

    fn seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Field<Self::Out>, A::Error> {
        let verdict = read_batch_elements(&mut seq, self.engine, &mut self.on_event)?;
        drain_seq(seq)?;
        Ok(Field::Value(verdict))
    }
}

fn read_batch_elements<'de, A: SeqAccess<'de>, F: FnMut(Field<RawEvent>)>(
    seq: &mut A,
    engine: Engine,
    on_event: &mut F,
) -> Result<Result<Header, BatchError>, A::Error> {
    let ts = match seq.next_element_seed(Lenient(NumberShape))? {
        None => return Ok(Err(BatchError::TooShort { len: 0 })),
        Some(Field::Value(ts)) => ts,
        Some(Field::Missing | Field::Bad) => return Ok(Err(BatchError::BadTimestamp)),
    };
    match seq.next_element_seed(Lenient(EventsShape { engine, on_event }))? {
        None => return Ok(Err(BatchError::TooShort { len: 1 })),
        Some(Field::Value(())) => {}
        Some(Field::Missing | Field::Bad) => return Ok(Err(BatchError::EventsNotAnArray)),
    }
    let attn_dp_rank = match seq.next_element_seed(Lenient(IntShape))? {
        None | Some(Field::Missing) => None,
        Some(Field::Value(rank)) => Some(rank),
        Some(Field::Bad) => return Ok(Err(BatchError::BadRank)),
    };
    Ok(Ok(Header { ts, attn_dp_rank }))
}
