//! The index as a materialized view of a log: everything beneath the gRPC service. It knows
//! nothing of tonic, hyper or the server's flags; it takes [`config::StateConfig`] and answers
//! with the typed errors of [`error`].
//!
//! Every change that passes validation (an apply, a hit-counting match, an expiry) becomes a
//! [`record::Record`], is appended to a log, and is applied to the index in log order by one
//! thread. A single server's log is local ([`writer`], [`durable`], [`log`]); a fleet's is one
//! shared Redis stream ([`fleet`], [`stream`]). A snapshot ([`snapshot`]) holds the whole
//! state at a log position; start-up ([`recover`], [`fleet`]'s bootstrap) loads the newest
//! one and replays the log after it, so a restarted server answers what it answered before.
//!
//! Modules, each importing only the ones below it in this list:
//! - [`open`]: opens the state (memory, a directory, a shared log) and runs its periodic jobs;
//! - [`fleet`]: a replica on a shared log (appender, applier, bootstrap, maintenance);
//! - [`writer`]: a single server's writer thread (fencing, group commit, sweeps, snapshots);
//! - [`fork`]: a snapshot of the live index written by a forked child;
//! - [`durable`]: the local log made durable, snapshots built in the background, trimming;
//! - [`recover`]: the state rebuilt from a directory;
//! - [`apply`]: one record applied to the index and the workers' meta;
//! - [`meta`]: per-worker fencing and liveness;
//! - [`record`], [`log`], [`snapshot`], [`stream`], [`dir`]: the formats and the stores;
//! - [`cell`]: the shared index cell, the writer's lock on it (`write_for`: a block table
//!   rebuilt beside queries) and the abort-on-panic guard;
//! - [`config`], [`error`], [`digest`], [`observe`], [`clock`].

pub mod apply;
pub mod cell;
pub mod clock;
pub mod config;
pub mod digest;
pub mod dir;
pub mod durable;
pub mod error;
pub mod fleet;
pub mod fork;
pub mod log;
pub mod meta;
pub mod observe;
pub mod open;
pub mod record;
pub mod recover;
pub mod snapshot;
pub mod stream;
pub mod writer;
