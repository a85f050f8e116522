//! The router's Prometheus metrics, as handles registered the first time each label set is
//! seen: recording a request is then a map lookup and an atomic add, with no label built and
//! nothing allocated. Label values are `&'static str` where the set is fixed (routes, reasons,
//! outcomes) and each worker's URL is one shared string built at start ([`Worker::label`]).
//!
//! The process-wide recorder must be installed before the first request (the binary does it
//! before building the state); without one every handle records nothing.
//!
//! [`Worker::label`]: crate::workers::Worker::label

use std::collections::HashMap;
use std::hash::Hash;

use metrics::{Counter, Histogram, SharedString};
use parking_lot::RwLock;

use crate::workers::Workers;

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
            .get(
                reason,
                || metrics::counter!("kv_router_decisions_total", "reason" => reason),
            )
            .increment(1);
    }

    /// `kv_router_worker_response_start_seconds{route}`.
    pub fn response_start(&self, route: &'static str, seconds: f64) {
        self.response_start
            .get(
                route,
                || metrics::histogram!("kv_router_worker_response_start_seconds", "route" => route),
            )
            .record(seconds);
    }
}

/// What the Indexer policy records per query.
#[derive(Debug, Default)]
pub struct IndexerMetrics {
    queries: Family<&'static str, (Counter, Histogram)>,
}

impl IndexerMetrics {
    /// `kv_router_indexer_queries_total{outcome}` and `kv_router_indexer_query_seconds{outcome}`.
    pub fn query(&self, outcome: &'static str, seconds: f64) {
        let (count, latency) = self.queries.get(outcome, || {
            (
                metrics::counter!("kv_router_indexer_queries_total", "outcome" => outcome),
                metrics::histogram!("kv_router_indexer_query_seconds", "outcome" => outcome),
            )
        });
        latency.record(seconds);
        count.increment(1);
    }
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
