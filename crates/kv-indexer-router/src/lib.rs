//! `kv-indexer-router`: a cache-aware HTTP router for SGLang workers that uses the KV Indexer
//! as its cache signal, with a local approximate radix tree when no Indexer is configured.
//!
//! - [`config`]: flags and variables (the SGLang router's quickstart flags);
//! - [`workers`]: registry, health checks, load (this router's own count, and the workers'
//!   `/get_load` reports so that several routers balance on the fleet's load);
//! - [`policy`]: choosing a worker (cache-aware on the Indexer, the radix tree or the
//!   workers' own views, round robin, random, power of two), with every Indexer failure
//!   falling back to load;
//! - [`selection`]: the cache-aware rules, pure (usable matches, near-ties, the pressure guard);
//! - [`radix`]: the local approximate radix tree (a source, and the conversation affinity
//!   signal beside an exact source);
//! - [`oracle`]: the workers' own cache views as a source, for benchmarks;
//! - [`app`]: the proxied HTTP routes, and the one place that picks the router's own HTTP
//!   status codes ([`app::AppError`]);
//! - [`observe`]: metrics handles, registered once per label set;
//! - [`throttle`]: warnings at doubling totals;
//! - `start`: the start-up ([`state`], [`run`]), tying them together.
//!
//! Prompt text becomes token ids through `kv_indexer_client::tokenizer`, the tokenizer the
//! simulated worker uses too, encoding as SGLang does; chat messages become prompt text
//! through `kv_indexer_client::chat`, the model's chat template, rendered as the worker does.

pub mod app;
pub mod config;
pub mod observe;
pub mod oracle;
pub mod policy;
pub mod radix;
pub mod selection;
mod start;
pub mod throttle;
pub mod workers;

pub use self::start::{RouterError, run, state};
