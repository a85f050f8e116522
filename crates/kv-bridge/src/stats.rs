//! What the bridge counts: kept as atomics (for tests and logs) and exported as Prometheus
//! metrics when a recorder is installed. [`register`] describes every metric and exports the
//! series known at start at 0 (the bridge calls it as it starts).

use std::sync::atomic::{AtomicU64, Ordering};

use kv_common::DoublingLog;
use kv_events::SkipReason;
use metrics::Unit;

use crate::outbox::ClearReason;
use crate::replay::Replayed;

/// Why a whole batch is skipped: bad frames, another topic, bad msgpack, a hybrid vLLM model.
pub const BATCH_SKIP_FRAMES: &str = "frames";
pub const BATCH_SKIP_TOPIC: &str = "topic";
pub const BATCH_SKIP_MSGPACK: &str = "msgpack";
pub const BATCH_SKIP_HYBRID: &str = "hybrid";

/// Describes every metric of the bridge (`# HELP`) and registers at 0 the series known at start:
/// the counters without labels, each clear reason, replay outcome and skip reason, the queue's
/// depth and its `capacity`.
pub fn register(capacity: usize) {
    kv_common::series::counters_from_zero(&[
        (
            "kv_bridge_batches_received_total",
            "Event batches received from the publisher (live or replayed)",
        ),
        (
            "kv_bridge_events_received_total",
            "Usable KV events in the batches received",
        ),
        (
            "kv_bridge_gaps_total",
            "Gaps in the publisher's sequence numbers (live batches lost)",
        ),
        (
            "kv_bridge_publisher_reconnects_total",
            "Times the publisher disconnected and the bridge resubscribed (and cleared the worker)",
        ),
        (
            "kv_bridge_publisher_connect_failures_total",
            "Failed attempts to reach the publisher (each retried)",
        ),
    ]);
    let labelled: [(&str, &str, &str, &[&'static str]); 4] = [
        (
            "kv_bridge_events_skipped_total",
            "Events left out of their batch, by reason (unknown_medium, malformed, ...)",
            "reason",
            &skip_reasons(),
        ),
        (
            "kv_bridge_batches_skipped_total",
            "Whole batches skipped, by reason (frames: malformed frames, topic: another topic, msgpack: undecodable, hybrid: a hybrid vLLM model's)",
            "reason",
            &[
                BATCH_SKIP_FRAMES,
                BATCH_SKIP_TOPIC,
                BATCH_SKIP_MSGPACK,
                BATCH_SKIP_HYBRID,
            ],
        ),
        (
            "kv_bridge_replays_total",
            "Replays asked of the publisher's replay endpoint, by outcome (ok, evicted: started later than asked, failed)",
            "outcome",
            &Replayed::ALL.map(Replayed::label),
        ),
        (
            "kv_bridge_clears_total",
            "Times the worker's tiers were cleared in the index because events were or may have been lost, by reason",
            "reason",
            &ClearReason::ALL.map(ClearReason::label),
        ),
    ];
    for (name, help, label, values) in labelled {
        metrics::describe_counter!(name, Unit::Count, help);
        for &value in values {
            metrics::counter!(name, label => value).increment(0);
        }
    }
    metrics::describe_counter!(
        "kv_bridge_rpcs_total",
        Unit::Count,
        "Apply RPCs to the Indexer, by gRPC status code (OK, Unavailable, ...)"
    );
    metrics::describe_gauge!(
        "kv_bridge_queue_depth",
        Unit::Count,
        "Items (batches and clears) waiting to be delivered to the Indexer"
    );
    metrics::gauge!("kv_bridge_queue_depth").set(0.0);
    metrics::describe_gauge!(
        "kv_bridge_queue_capacity",
        Unit::Count,
        "Items the queue holds before it overflows (dropped, and the worker cleared): KV_INDEXER_BRIDGE_QUEUE_BATCHES"
    );
    metrics::gauge!("kv_bridge_queue_capacity").set(capacity as f64);
}

/// The label of every [`SkipReason`].
fn skip_reasons() -> [&'static str; 7] {
    [
        SkipReason::UnknownMedium(String::new()),
        SkipReason::MissingMedium,
        SkipReason::ExternalMedium,
        SkipReason::UnknownEventType(String::new()),
        SkipReason::Malformed(""),
        SkipReason::HybridGroup(0),
        SkipReason::SpecKind(String::new()),
    ]
    .map(|reason| reason.reason())
}

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
        if reason == BATCH_SKIP_FRAMES {
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

    pub fn replay(&self, outcome: Replayed) {
        bump(&self.replays, 1);
        if outcome != Replayed::Ok {
            bump(&self.replays_failed, 1);
        }
        metrics::counter!("kv_bridge_replays_total", "outcome" => outcome.label()).increment(1);
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString};
    use parking_lot::Mutex;

    use super::*;

    /// What was described (`name`) and registered (`name{label="value",…}`, with its gauge).
    #[derive(Default)]
    struct Seen {
        described: Mutex<Vec<String>>,
        registered: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    }

    impl Seen {
        fn register(&self, key: &Key) -> Arc<AtomicU64> {
            let labels: Vec<String> = key
                .labels()
                .map(|label| format!("{}={:?}", label.key(), label.value()))
                .collect();
            let series = format!("{}{{{}}}", key.name(), labels.join(","));
            self.registered.lock().entry(series).or_default().clone()
        }
    }

    impl Recorder for Seen {
        fn describe_counter(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.described.lock().push(key.as_str().to_string());
        }
        fn describe_gauge(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.described.lock().push(key.as_str().to_string());
        }
        fn describe_histogram(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.described.lock().push(key.as_str().to_string());
        }
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.register(key))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(self.register(key))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn registers_every_metric_described_and_the_series_known_at_start() {
        let seen = Seen::default();
        metrics::with_local_recorder(&seen, || register(250));
        let described = seen.described.lock().clone();
        let registered = seen.registered.lock();
        let names: std::collections::BTreeSet<&str> = registered
            .keys()
            .map(|series| &series[..series.find('{').unwrap()])
            .collect();
        for name in &names {
            assert!(
                described.iter().any(|d| d == name),
                "{name} is not described"
            );
        }
        for series in [
            "kv_bridge_batches_received_total{}",
            "kv_bridge_publisher_connect_failures_total{}",
            r#"kv_bridge_events_skipped_total{reason="unknown_medium"}"#,
            r#"kv_bridge_batches_skipped_total{reason="topic"}"#,
            r#"kv_bridge_replays_total{outcome="evicted"}"#,
            r#"kv_bridge_clears_total{reason="index_lost"}"#,
            "kv_bridge_queue_depth{}",
        ] {
            let value = registered.get(series).map(|v| v.load(Ordering::Relaxed));
            assert_eq!(value, Some(0), "{series} at 0 in {registered:?}");
        }
        let capacity = registered["kv_bridge_queue_capacity{}"].load(Ordering::Relaxed);
        assert_eq!(f64::from_bits(capacity), 250.0);
        assert!(described.iter().any(|d| d == "kv_bridge_rpcs_total"));
    }
}
