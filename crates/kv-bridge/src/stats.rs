//! What the bridge counts: kept as atomics (for tests and logs) and exported as Prometheus
//! metrics when a recorder is installed.

use std::sync::atomic::{AtomicU64, Ordering};

use kv_common::DoublingLog;

#[derive(Debug, Default)]
pub struct Stats {
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub events_skipped: AtomicU64,
    pub batches_skipped: AtomicU64,
    pub frames_malformed: AtomicU64,
    pub gaps: AtomicU64,
    pub reconnects: AtomicU64,
    /// Failed attempts to reach the publisher (each one retried).
    pub connect_failures: AtomicU64,
    pub replays: AtomicU64,
    pub replays_failed: AtomicU64,
    pub clears: AtomicU64,
    pub rpcs_ok: AtomicU64,
    pub rpcs_failed: AtomicU64,
    skip_log: DoublingLog,
    retry_log: DoublingLog,
    connect_log: DoublingLog,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Stats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    pub fn batch(&self, events: usize) {
        bump(&self.batches, 1);
        bump(&self.events, events as u64);
        metrics::counter!("kv_bridge_batches_received_total").increment(1);
        metrics::counter!("kv_bridge_events_received_total").increment(events as u64);
    }

    /// Counts a skipped event; returns the total when it is time to log (doubling totals).
    pub fn event_skipped(&self, reason: &'static str) -> Option<u64> {
        bump(&self.events_skipped, 1);
        metrics::counter!("kv_bridge_events_skipped_total", "reason" => reason).increment(1);
        self.skip_log.record()
    }

    /// Counts a batch skipped whole (bad frames or bad msgpack).
    pub fn batch_skipped(&self, reason: &'static str) -> Option<u64> {
        bump(&self.batches_skipped, 1);
        if reason == "frames" {
            bump(&self.frames_malformed, 1);
        }
        metrics::counter!("kv_bridge_batches_skipped_total", "reason" => reason).increment(1);
        self.skip_log.record()
    }

    pub fn gap(&self) {
        bump(&self.gaps, 1);
        metrics::counter!("kv_bridge_gaps_total").increment(1);
    }

    pub fn reconnect(&self) {
        bump(&self.reconnects, 1);
        metrics::counter!("kv_bridge_publisher_reconnects_total").increment(1);
    }

    /// Counts a failed attempt to reach the publisher; returns the total when it is time to log.
    pub fn connect_failed(&self) -> Option<u64> {
        bump(&self.connect_failures, 1);
        metrics::counter!("kv_bridge_publisher_connect_failures_total").increment(1);
        self.connect_log.record()
    }

    pub fn replay(&self, outcome: &'static str) {
        bump(&self.replays, 1);
        if outcome != "ok" {
            bump(&self.replays_failed, 1);
        }
        metrics::counter!("kv_bridge_replays_total", "outcome" => outcome).increment(1);
    }

    pub fn clear(&self, reason: &'static str) {
        bump(&self.clears, 1);
        metrics::counter!("kv_bridge_clears_total", "reason" => reason).increment(1);
    }

    pub fn rpc(&self, code: tonic::Code) {
        if code == tonic::Code::Ok {
            bump(&self.rpcs_ok, 1);
        } else {
            bump(&self.rpcs_failed, 1);
        }
        metrics::counter!("kv_bridge_rpcs_total", "code" => kv_indexer_proto::code_label(code))
            .increment(1);
    }

    /// Counts a failed delivery attempt; returns the total when it is time to log.
    pub fn retry(&self) -> Option<u64> {
        self.retry_log.record()
    }

    pub fn set_queue_depth(&self, depth: usize) {
        metrics::gauge!("kv_bridge_queue_depth").set(depth as f64);
    }
}
