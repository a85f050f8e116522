//! SGLang and vLLM KV events, from ZMQ frames to index actions: the pure half of
//! `kv-indexer-bridge`.
//!
//! No I/O, no async runtime, no clock: every function takes bytes or values and returns values,
//! so all of it is tested against golden vectors captured from the real publisher
//! (`kv-testkit/fixtures/`). The path of one message is [`frames`] → [`decode`] → [`mapping`] →
//! [`chunk`]:
//!
//! - [`frames`]: ZMQ multipart messages: live `[topic, seq, payload]` (and `[seq, payload]`),
//!   replay replies and the end marker seen by a DEALER, and the replay request;
//! - [`wire`]: what SGLang writes: the msgpack batch and both event encodings (map era, array
//!   era), read by hand-written serde visitors that never fail on the shape of one event;
//! - [`decode`]: wire events to domain [`Event`]s (medium → [`Tier`], labels → component mask),
//!   skipping a bad event with a [`SkipReason`] and rejecting a bad batch with a [`BatchError`];
//! - [`mapping`]: events to index [`Action`]s (REPORT / REVOKE / CLEAR_ALL_AT_TIER), merging
//!   consecutive events and computing the chain hint;
//! - [`chunk`]: actions cut and packed into groups that fit one `ApplyExternalKvBatch` each.
//!
//! [`Tier`]: kv_index::Tier

#![forbid(unsafe_code)]

pub mod chunk;
pub mod decode;
pub mod frames;
pub mod mapping;
pub mod wire;

pub use chunk::split;
pub use decode::{BlockStored, DecodedBatch, Event, SkipReason, decode_batch, decode_engine_batch};
pub use frames::{FrameError, LiveMessage, ReplayFrame, parse_live, parse_replay, replay_request};
pub use mapping::{Action, clear_action, map_events};
pub use wire::{BatchError, Engine, vllm_digest_hash};
