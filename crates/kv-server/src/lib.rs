//! The KV-cache Indexer server library (`kv-indexer-server` is its thin main): the
//! `kv_indexer.v1` gRPC service over the pure index of the `kv-index` crate, with admission
//! control, deadline shedding, health, reflection and metrics. It knows nothing of ZMQ or of
//! SGLang's events; wire ↔ index conversion is `kv_indexer_proto::convert`.
//!
//! - [`serve`]: the server's whole life (listen, recover, serve, drain, final snapshot), as
//!   the binary and the tests run it;
//! - [`boot`]: opens the state beneath (`kv_state`) and keeps health in step with it;
//! - [`access`]: TLS (optionally mutual) and the read and write tokens;
//! - [`config`]: flags and environment variables;
//! - [`server`]: assembles the gRPC server and runs it on a bound listener;
//! - [`service`]: the RPCs, locking and deadline checks;
//! - [`admission`]: the prefix queries' in-flight bound, shedding and their counts;
//! - [`admin`]: the operator's service (state, workers, drop) and the `/state` report;
//! - [`predict`]: routers' predicted placements, in memory only, with their TTL;
//! - [`pool`]: the query threads prefix scans run on, below the runtime's priority;
//! - [`deadline`]: arrival stamps and `grpc-timeout` parsing;
//! - [`error`]: every error and its status code;
//! - [`observe`]: Prometheus metrics and their admin endpoint;

pub mod access;
pub mod admin;
pub mod admission;
pub mod boot;
pub mod config;
pub mod deadline;
pub mod error;
pub mod observe;
pub mod pool;
pub mod predict;
mod prefix_route;
pub mod serve;
pub mod server;
pub mod service;

pub use config::{Args, Config};
pub use serve::serve;
pub use server::run;
pub use service::Shared;
