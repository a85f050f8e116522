//! A simulated SGLang worker, real enough to stand in for SGLang in tests, demos and
//! benchmarks of the KV Indexer: SGLang's HTTP API over a paged prefix cache, publishing the
//! cache's changes as KV events byte for byte as SGLang's ZMQ publisher does.
//!
//! ```text
//! HTTP ─> engine (running slots, time model) ─> scheduler ─> cache ─> events ─> publisher ─> ZMQ PUB
//!                                                                                  └─> replay ROUTER
//! ```
//!
//! - [`cache`]: pages keyed by block hash with parent links, device and host tiers, leaf-first
//!   LRU eviction, pinned pages; each operation returns its events;
//! - [`events`]: `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, their coalescing, and the
//!   msgpack encoding of a batch (map era or array era, optional `component_types`);
//! - [`publisher`]: the PUB socket (`[topic, seq, payload]`), the replay buffer and ROUTER,
//!   and deliberate message loss for fault tests;
//! - [`scheduler`]: the single owner of cache and publisher; one batch per step;
//! - [`engine`]: one request's life: queueing for a running slot, hashing, prefill and decode
//!   time, filler output;
//! - [`timing`]: the time model (one prefill lane; costs per uncached prompt token, per pair
//!   of attention tokens and per output token);
//! - [`http`]: `/generate`, `/v1/completions`, `/server_info`, `/health`, `/get_model_info`,
//!   `/flush_cache`;
//! - [`config`]: flags and environment variables;
//! - [`worker`]: all of it assembled on bound listeners, served until shutdown.

#![forbid(unsafe_code)]

pub mod cache;
pub mod config;
pub mod engine;
pub mod events;
pub mod http;
pub mod publisher;
pub mod scheduler;
pub mod timing;
pub mod worker;

pub use config::{Args, Config};
pub use worker::{Endpoints, Listeners, Worker, run};
