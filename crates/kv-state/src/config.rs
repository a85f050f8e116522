//! The state's settings, as plain values: the server parses its flags into them.

use std::path::PathBuf;
use std::time::Duration;

use crate::clock::Clock;
use crate::stream::StreamConfig;

/// How the local log is made durable (`KV_INDEXER_LOG_SYNC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum SyncPolicy {
    /// fdatasync before a change is answered.
    Always,
    /// Written before the answer, fdatasync within `writer::BATCH_SYNC_BOUND`.
    Batch,
    /// No fdatasync between snapshots.
    Off,
}

/// How a running server writes its periodic snapshots (`KV_INDEXER_SNAPSHOT_METHOD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum SnapshotMethod {
    /// A forked child writes the live index (copy-on-write, `crate::fork`), except the block
    /// table, which it is not given and builds afresh: applies do not stall after the fork,
    /// and the child holds a table's worth of memory while it runs (about 1.7-1.8x the index
    /// at its peak). The fork pauses the process briefly.
    Fork,
    /// A forked child writes the live index, the block table included, all copy-on-write:
    /// memory stays nearer the index's size (1.0x quiet, 1.4-1.7x under heavy churn,
    /// measured), but the applies after each fork fault on the table's pages, one copy each
    /// (apply p99 about 10x with a snapshot a second).
    ForkShared,
    /// A thread rebuilds the state from the previous snapshot and the log: the writer never
    /// waits, but a second index is held while it is built.
    Rebuild,
}

/// Where the state lives and how it is kept.
#[derive(Debug, Clone)]
pub struct StateConfig {
    /// The state directory (`None`: in memory, unless a shared log is set).
    pub dir: Option<PathBuf>,
    pub sync: SyncPolicy,
    /// A worker with no apply for this long is expired (`None`: never).
    pub worker_ttl: Option<Duration>,
    /// Between periodic snapshots (`None`: only at shutdown).
    pub snapshot_interval: Option<Duration>,
    pub snapshot_method: SnapshotMethod,
    /// Start empty (files moved aside) rather than refuse a corrupt state directory.
    pub discard_corrupt: bool,
    /// A shared log: this state is one replica of a fleet.
    pub fleet: Option<FleetConfig>,
    /// What worker TTLs are measured on (the system's clocks, unless a test moves it on).
    pub clock: Clock,
}

impl Default for StateConfig {
    fn default() -> StateConfig {
        StateConfig {
            dir: None,
            sync: SyncPolicy::Batch,
            worker_ttl: Some(Duration::from_secs(30)),
            snapshot_interval: Some(Duration::from_secs(60)),
            snapshot_method: SnapshotMethod::Fork,
            discard_corrupt: false,
            fleet: None,
            clock: Clock::default(),
        }
    }
}

/// The shared log's settings.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub stream: StreamConfig,
    /// Staler than this, a replica refuses queries (`ChangeError::Stale`).
    pub max_lag: Duration,
}

/// How often the liveness sweep runs for a worker TTL of `ttl`: a quarter of it, within
/// 100 ms to 5 s.
pub fn sweep_interval(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
}
