//! The router's Prometheus metrics, as handles registered the first time each label set is
//! seen: recording a request is then a map lookup and an atomic add, with no label built and
//! nothing allocated. Label values are `&'static str` where the set is fixed (routes, reasons,
//! outcomes) and each worker's URL is one shared string built at start ([`Worker::label`]).
//!
//! The process-wide recorder must be installed before the first request (the binary does it
//! before building the state); without one every handle records nothing. Building the state
//! describes every metric ([`describe`]) and registers the series whose labels are known at
//! start at 0, so that each is exported before its first event.
//!
//! [`Worker::label`]: crate::workers::Worker::label

use std::collections::HashMap;
use std::hash::Hash;

use kv_common::telemetry::{SECONDS_1MS_TO_60S, SECONDS_10US_TO_1S};
use metrics::{Counter, Histogram, SharedString, Unit};
use parking_lot::RwLock;

use crate::workers::Workers;

/// The histograms and their buckets, for `kv_common::telemetry::Metrics::install`.
pub const BUCKETS: &[(&str, &[f64])] = &[
    ("kv_router_indexer_query_seconds", SECONDS_10US_TO_1S),
    (
        "kv_router_worker_response_start_seconds",
        SECONDS_1MS_TO_60S,
    ),
];

/// Gives every metric of the router its `# HELP` text.
pub fn describe() {
    metrics::describe_counter!(
        "kv_router_requests_total",
        Unit::Count,
        "Proxied requests answered, by route, HTTP status and the worker URL that answered (\"none\": the router answered itself)"
    );
    metrics::describe_counter!(
        "kv_router_decisions_total",
        Unit::Count,
        "Routing decisions, by the reason the worker was chosen (cache_hit, no_usable_match, an Indexer fallback such as unreachable, ...)"
    );
    metrics::describe_histogram!(
        "kv_router_worker_response_start_seconds",
        Unit::Seconds,
        "Seconds from sending a request to a worker to the start of its answer (headers), by route"
    );
    metrics::describe_counter!(
        "kv_router_indexer_queries_total",
        Unit::Count,
        "Prefix queries to the Indexer, by outcome (matched, no_match, unreachable, timeout, overloaded, too_large, rejected)"
    );
    metrics::describe_histogram!(
        "kv_router_indexer_query_seconds",
        Unit::Seconds,
        "Seconds a prefix query to the Indexer took, by outcome"
    );
    metrics::describe_counter!(
        "kv_router_indexer_unknown_addresses_total",
        Unit::Count,
        "Workers named in the Indexer's answers whose address matches none of this router's worker URLs (a bridge's KV_INDEXER_WORKER_ADDRESS that differs from the router's URL for it: its cache is never used)"
    );
    metrics::counter!("kv_router_indexer_unknown_addresses_total").absolute(0);
    metrics::describe_counter!(
        "kv_router_worker_indexer_matches_total",
        Unit::Count,
        "Indexer answers that named the worker as holding a prefix of the prompt, by worker URL (none for a worker others get: its published block hashes differ from the router's)"
    );
    metrics::describe_counter!(
        "kv_router_worker_load_polls_total",
        Unit::Count,
        "Polls of a worker's GET /get_load, by worker URL and outcome (ok; failed: no answer, an error status or a body without num_reqs, so its load is this router's own count)"
    );
    metrics::describe_gauge!(
        "kv_router_worker_healthy",
        Unit::Count,
        "1 while the worker passes its health check (GET /health), else 0, by worker URL"
    );
}

/// The handles of one metric name, one per label set.
#[derive(Debug)]
struct Family<K, H> {
    seen: RwLock<HashMap<K, H>>,
}

impl<K, H> Default for Family<K, H> {
    fn default() -> Self {
        Family {
            seen: RwLock::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Copy, H: Clone> Family<K, H> {
    /// Registers the handle for `key` by `register`, unless it is already.
    fn register(&self, key: K, register: impl FnOnce() -> H) {
        self.get(key, register);
    }

    /// The handle for `key`, registered by `register` the first time.
    fn get(&self, key: K, register: impl FnOnce() -> H) -> H {
        if let Some(handle) = self.seen.read().get(&key) {
            return handle.clone();
        }
        self.seen
            .write()
            .entry(key)
            .or_insert_with(register)
            .clone()
    }
}

/// Who answered a proxied request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// The router itself, before any worker was chosen (no healthy worker, a rejected query).
    Router { status: u16 },
    /// The worker at this index of the registry; `status` is the HTTP status it answered.
    Worker { worker: usize, status: u16 },
}

/// What the HTTP routes record.
#[derive(Debug, Default)]
pub struct RequestMetrics {
    requests: Family<(&'static str, Answer), Counter>,
    decisions: Family<&'static str, Counter>,
    response_start: Family<&'static str, Histogram>,
}

impl RequestMetrics {
    /// Registers, at 0, the decisions of each of `reasons` and the response start of each of
    /// `routes`.
    pub fn register(&self, routes: &[&'static str], reasons: &[&'static str]) {
        for &reason in reasons {
            self.decisions.register(reason, || decisions(reason));
        }
        for &route in routes {
            self.response_start
                .register(route, || response_start(route));
        }
    }

    /// `kv_router_requests_total{route, status, worker}`, `worker` being the URL of a worker
    /// of `workers` or `none`.
    pub fn request(&self, route: &'static str, answer: Answer, workers: &Workers) {
        self.requests
            .get((route, answer), || {
                let (status, worker) = match answer {
                    Answer::Router { status } => (status, SharedString::const_str("none")),
                    Answer::Worker { worker, status } => {
                        (status, workers.list[worker].label.clone())
                    }
                };
                metrics::counter!(
                    "kv_router_requests_total",
                    "route" => route,
                    "status" => status.to_string(),
                    "worker" => worker
                )
            })
            .increment(1);
    }

    /// `kv_router_decisions_total{reason}`.
    pub fn decision(&self, reason: &'static str) {
        self.decisions
            .get(reason, || decisions(reason))
            .increment(1);
    }

    /// `kv_router_worker_response_start_seconds{route}`.
    pub fn response_start(&self, route: &'static str, seconds: f64) {
        self.response_start
            .get(route, || response_start(route))
            .record(seconds);
    }
}

fn decisions(reason: &'static str) -> Counter {
    metrics::counter!("kv_router_decisions_total", "reason" => reason)
}

fn response_start(route: &'static str) -> Histogram {
    metrics::histogram!("kv_router_worker_response_start_seconds", "route" => route)
}

/// What the Indexer policy records per query.
#[derive(Debug, Default)]
pub struct IndexerMetrics {
    queries: Family<&'static str, (Counter, Histogram)>,
}

impl IndexerMetrics {
    /// Registers, at 0, the queries of each of `outcomes`.
    pub fn register(&self, outcomes: &[&'static str]) {
        for &outcome in outcomes {
            self.queries.register(outcome, || queries(outcome));
        }
    }

    /// `kv_router_indexer_queries_total{outcome}` and `kv_router_indexer_query_seconds{outcome}`.
    pub fn query(&self, outcome: &'static str, seconds: f64) {
        let (count, latency) = self.queries.get(outcome, || queries(outcome));
        latency.record(seconds);
        count.increment(1);
    }
}

fn queries(outcome: &'static str) -> (Counter, Histogram) {
    (
        metrics::counter!("kv_router_indexer_queries_total", "outcome" => outcome),
        metrics::histogram!("kv_router_indexer_query_seconds", "outcome" => outcome),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_each_label_set_once() {
        let family: Family<(&str, u16), usize> = Family::default();
        let mut registered = 0;
        for key in [("a", 1), ("a", 1), ("b", 1), ("a", 2), ("b", 1)] {
            family.get(key, || {
                registered += 1;
                registered
            });
        }
        assert_eq!(registered, 3);
        assert_eq!(family.get(("a", 2), || 0), 3);
        assert_eq!(family.get(("b", 1), || 0), 2);
    }
}
