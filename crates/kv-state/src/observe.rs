//! The state's Prometheus metrics: names, help texts and labels. The server installs the
//! recorder and calls [`register`] once; without a recorder every call here is a no-op.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kv_index::IndexStats;

/// Every counter and gauge of the state, with its help text.
const COUNTERS: &[(&str, &str)] = &[
    (
        "kv_indexer_mass_expiry_refused_total",
        "Liveness sweeps that would have expired every live worker, refused (a partition, a paused host?)",
    ),
    (
        "kv_indexer_workers_expired_total",
        "Workers whose placements were purged for want of applies within their TTL",
    ),
    ("kv_indexer_snapshots_total", "Snapshots written"),
    (
        "kv_indexer_table_rebuilds_total",
        "Block table rebuilds (grown, or purged of stale entries) on the writer's copy, before the change that needed them or, when a compaction needed room, inside it",
    ),
    (
        "kv_indexer_writer_reader_waits_total",
        "Times the writer waited for queries still reading the copy of the index it was about to change",
    ),
    (
        "kv_indexer_snapshot_failures_total",
        "Snapshots that failed to be written or published",
    ),
    (
        "kv_indexer_event_log_append_failures_total",
        "Groups of changes the shared log refused (Redis unreachable, or fewer replicas than required)",
    ),
    (
        "kv_indexer_fleet_rebootstraps_total",
        "Times a replica found its index no longer explained by the shared log and bootstrapped again",
    ),
    (
        "kv_indexer_fleet_entries_skipped_total",
        "Shared-log entries that did not decode or apply (every replica skips the same ones)",
    ),
    (
        "kv_indexer_sequence_gaps_total",
        "Applies whose bridge batch number showed acknowledged batches of their worker lost (the worker is cleared)",
    ),
    (
        "kv_indexer_fleet_entries_lost_total",
        "Entries a replica had applied that the shared log lost (Redis rolled back)",
    ),
];

const GAUGES: &[(&str, &str)] = &[
    (
        "kv_indexer_blocks",
        "Distinct block hashes with at least one placement",
    ),
    (
        "kv_indexer_placements",
        "(worker, tier, block) placements in the index",
    ),
    (
        "kv_indexer_workers",
        "Live workers: seen, and not expired for want of applies",
    ),
    (
        "kv_indexer_snapshot_bytes",
        "Size of the last snapshot written, in bytes",
    ),
    (
        "kv_indexer_snapshot_seconds",
        "How long the last snapshot took to build and write, in seconds",
    ),
    (
        "kv_indexer_table_rebuild_seconds",
        "How long the last block table rebuild made before a change took (applies waited; queries did not), in seconds",
    ),
    (
        "kv_indexer_snapshot_last_success_timestamp_seconds",
        "Unix time of the last snapshot written (0: none since start)",
    ),
    (
        "kv_indexer_writer_reader_wait_seconds",
        "How long the writer last waited for queries still reading the copy of the index it was about to change, in seconds",
    ),
    (
        "kv_indexer_fleet_lag_seconds",
        "Seconds since this replica last knew it had applied the whole shared log (rises while Redis is unreachable)",
    ),
    (
        "kv_indexer_state_unwritable",
        "1 while applies are refused because the state directory cannot be written (its disk is full); retried with each change",
    ),
    (
        "kv_indexer_fleet_lag_entries",
        "Shared-log entries not yet applied by this replica, at its last read",
    ),
];

/// Describes every metric of the state and exports each at 0, so that a dashboard or an alert
/// sees the series from start, not only after the first event.
pub fn register() {
    kv_common::series::counters_from_zero(COUNTERS);
    kv_common::series::gauges_from_zero(GAUGES);
}

/// A liveness sweep that would have expired every live worker, refused.
pub fn mass_expiry_refused() {
    metrics::counter!("kv_indexer_mass_expiry_refused_total").increment(1);
}

pub fn workers_expired(count: usize) {
    metrics::counter!("kv_indexer_workers_expired_total").increment(count as u64);
}

pub fn snapshot_written(bytes: u64, took: Duration) {
    metrics::counter!("kv_indexer_snapshots_total").increment(1);
    metrics::gauge!("kv_indexer_snapshot_bytes").set(bytes as f64);
    metrics::gauge!("kv_indexer_snapshot_seconds").set(took.as_secs_f64());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    metrics::gauge!("kv_indexer_snapshot_last_success_timestamp_seconds").set(now.as_secs_f64());
}

/// A block table rebuilt on the writer's copy (the other copy takes it when it catches up),
/// now holding `entries`: before a change ([`crate::cell::Changing::make_room`]), which times
/// it (`took`), or inside one (`cell::Changing::apply`: a compaction needed room), counted but
/// not timed: the index has no clock, and the change's own time would overstate it.
pub fn table_rebuilt(entries: usize, took: Option<Duration>) {
    metrics::counter!("kv_indexer_table_rebuilds_total").increment(1);
    if let Some(took) = took {
        metrics::gauge!("kv_indexer_table_rebuild_seconds").set(took.as_secs_f64());
    }
    tracing::debug!(
        entries,
        took_ms = took.map(|took| took.as_millis() as u64),
        "block table rebuilt on the writer's copy"
    );
}

/// The writer waited `took` for the last readers of the copy it was about to change.
pub fn reader_wait(took: Duration) {
    metrics::counter!("kv_indexer_writer_reader_waits_total").increment(1);
    metrics::gauge!("kv_indexer_writer_reader_wait_seconds").set(took.as_secs_f64());
}

/// A snapshot build that failed (`Some`, with its error) or whose thread panicked (`None`):
/// counted and logged.
pub fn snapshot_failed(error: Option<&crate::error::StateError>) {
    metrics::counter!("kv_indexer_snapshot_failures_total").increment(1);
    match error {
        Some(error) => {
            tracing::warn!(error = %kv_common::error_chain(error), "building a snapshot failed")
        }
        None => tracing::warn!("the snapshot thread panicked"),
    }
}

/// Whether applies are refused for a state directory that cannot be written.
pub fn state_unwritable(refused: bool) {
    metrics::gauge!("kv_indexer_state_unwritable").set(if refused { 1.0 } else { 0.0 });
}

/// The index's sizes, with the live workers counted from the workers' meta.
pub fn index_size(stats: IndexStats, live_workers: usize) {
    metrics::gauge!("kv_indexer_blocks").set(stats.blocks as f64);
    metrics::gauge!("kv_indexer_placements").set(stats.placements as f64);
    metrics::gauge!("kv_indexer_workers").set(live_workers as f64);
}

/// A group of changes the shared log refused (Redis unreachable).
pub fn event_log_append_failed() {
    metrics::counter!("kv_indexer_event_log_append_failures_total").increment(1);
}

/// Changes a replica appended but did not read back from the shared log within the bound
/// (refused: their callers retry).
pub fn event_log_changes_unanswered(changes: usize) {
    metrics::counter!("kv_indexer_event_log_unanswered_changes_total").increment(changes as u64);
}

/// A replica that found its index no longer explained by the shared log and bootstrapped again.
pub fn fleet_rebootstraps() {
    metrics::counter!("kv_indexer_fleet_rebootstraps_total").increment(1);
}

/// A shared-log entry that did not decode or apply (skipped by every replica alike).
pub fn fleet_entry_skipped() {
    metrics::counter!("kv_indexer_fleet_entries_skipped_total").increment(1);
}

/// A replica's lag behind the shared log, in time: set by whoever watches its freshness (the
/// server's health watch), so that it rises while Redis is unreachable too.
pub fn fleet_lag(lag_ms: u64) {
    metrics::gauge!("kv_indexer_fleet_lag_seconds").set(lag_ms as f64 / 1000.0);
}

/// Shared-log entries a replica has not applied, at its last read.
pub fn fleet_lag_entries(entries: u64) {
    metrics::gauge!("kv_indexer_fleet_lag_entries").set(entries as f64);
}

/// An apply whose batch number showed acknowledged batches of its worker lost.
pub fn sequence_gap() {
    metrics::counter!("kv_indexer_sequence_gaps_total").increment(1);
}

/// Entries a replica had applied that the shared log lost (Redis rolled back).
pub fn fleet_entries_lost(entries: u64) {
    metrics::counter!("kv_indexer_fleet_entries_lost_total").increment(entries);
}
