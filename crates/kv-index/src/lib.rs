//! The KV-cache placement index: which workers hold which block hashes, at which tier and with
//! which components, and which worker holds the longest reusable prefix of a prompt.
//!
//! This crate is the semantics of `docs/indexer-contract.md` and nothing else: no I/O, no async
//! runtime, no clock, no wire types. The server wraps an [`Index`] in a lock and converts.
//!
//! - [`types`]: domain types (tiers, actions, specs, requests, answers);
//! - [`validate`]: every validation rule of the contract, as [`ValidationError`];
//! - `index`: the state; `index::layout` (chunks of chained hashes cut into pieces of equal
//!   placements, `Holder`s, workers), `index::apply` (REPORT / REVOKE / CLEAR_ALL_AT_TIER),
//!   `index::compaction` (purge, trim, compact, free), `index::effects` (a change recorded on one
//!   index and replayed onto its twin, sharing its table, without table lookups), `index::export` (the whole index as plain
//!   data and back), `index::image` (the layout itself as bytes and back: snapshots; its byte
//!   helpers in `image_io`) and `index::invariants` (the recount that tests run);
//! - `table`: the block hash table (hash -> position in a chunk); `memory`, where it asks the
//!   machine directly (a cache prefetch, a new table's pages mapped at once);
//! - `prefix`: the longest-prefix scan (`MatchExternalKvPrefix`);
//! - `lookup`: exact lookups (`MatchExternalKv`) and hit counts.

mod image_io;
mod index;
mod lookup;
mod memory;
mod prefix;
mod table;
pub mod types;
pub mod validate;

pub use image_io::{ImageError, ImageInput};
pub use index::{
    Effects, EffectsMark, Export, ExportedWorker, Held, Index, MAX_WORKERS, SpareTable,
    TableLayout, WorkerSummary,
};
pub use types::*;
pub use validate::{ErrorClass, ValidationError, validate_lookup, validate_prefix};
