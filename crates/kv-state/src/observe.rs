//! The state's Prometheus metrics: names and labels. The server installs the recorder; without
//! one every call here is a no-op.

use std::time::Duration;

use kv_index::IndexStats;

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
}

pub fn index_size(stats: IndexStats) {
    metrics::gauge!("kv_indexer_blocks").set(stats.blocks as f64);
    metrics::gauge!("kv_indexer_placements").set(stats.placements as f64);
    metrics::gauge!("kv_indexer_workers").set(stats.workers as f64);
}

/// A group of changes the shared log refused (the engine unreachable).
pub fn event_log_append_failed() {
    metrics::counter!("kv_indexer_event_log_append_failures_total").increment(1);
}

/// A replica that found its index no longer explained by the shared log and bootstrapped again.
pub fn fleet_rebootstraps() {
    metrics::counter!("kv_indexer_fleet_rebootstraps_total").increment(1);
}

/// A shared-log entry that did not decode or apply (skipped by every replica alike).
pub fn fleet_entry_skipped() {
    metrics::counter!("kv_indexer_fleet_entries_skipped_total").increment(1);
}

/// A replica's lag behind the shared log.
pub fn fleet_lag(lag_ms: u64, entries: u64) {
    metrics::gauge!("kv_indexer_fleet_lag_ms").set(lag_ms as f64);
    metrics::gauge!("kv_indexer_fleet_lag_entries").set(entries as f64);
}

/// An apply whose batch number showed acknowledged batches of its worker lost.
pub fn sequence_gap() {
    metrics::counter!("kv_indexer_sequence_gaps_total").increment(1);
}

/// Entries a replica had applied that the shared log lost (a rolled-back engine).
pub fn fleet_entries_lost(entries: u64) {
    metrics::counter!("kv_indexer_fleet_entries_lost_total").increment(entries);
}
