//! `kv-indexer-bridge`: follows one SGLang worker's KV event stream (ZMQ SUB), decodes and maps
//! each batch to ordered apply RPCs, and delivers them to the Indexer.
//!
//! - [`error`]: why the bridge stopped;
//! - [`config`]: variables and flags of the contract's "Bridge contract";
//! - [`subscriber`]: the SUB socket, connected with retries for as long as the publisher is away;
//! - [`batch`]: a payload's pure path to apply messages (decode, map, split, convert);
//! - [`sequence`]: gap and restart detection;
//! - [`replay`]: fetching lost batches from the publisher's replay ROUTER;
//! - [`outbox`]: the bounded queue (overflow → clear the worker);
//! - [`sender`]: in-order delivery with backoff, permanent errors stop the bridge;
//! - [`backoff`]: the doubling, jittered waits of every retry;
//! - [`stats`]: counters and metrics;
//! - `follow`: the loop itself ([`run`]), tying them together.
//!
//! Decoding, mapping and splitting are pure and live in the `kv-events` crate.
//!
//! Only a misconfiguration or a permanent status from the Indexer stops the bridge: a
//! publisher that is away, for however long, is waited for.
//!
//! When events are lost and cannot be replayed (no replay endpoint, a failed or evicted replay,
//! a publisher restart, a queue overflow, start-up), the bridge clears the worker's tiers before
//! going on: the index may under-claim, never over-claim.

pub mod backoff;
pub mod batch;
pub mod config;
pub mod error;
mod follow;
pub mod outbox;
pub mod replay;
pub mod sender;
pub mod sequence;
pub mod stats;
pub mod subscriber;

pub use self::error::BridgeError;
pub use self::follow::run;
