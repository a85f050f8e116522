//! The worker registry: URLs, health, and each worker's load: active requests and prefill
//! pressure (the uncached prompt tokens of requests whose first token has not come back).
//!
//! A router counts only what it sent itself; with several routers in front of one fleet each
//! sees a share of the truth and they pile onto the same "idle" worker. So the router also polls
//! each worker's `GET /get_load` (SGLang's per-rank list; `num_reqs`, and the queued prefill
//! work `num_waiting_uncached_tokens` where the worker reports it) and, while the last report
//! is good, a worker's load is that report plus what this router sent it since the poll was
//! sent. A worker that does not answer the poll, or answers without the field, falls back to
//! this router's own count for what is missing.
//!
//! A worker's URL is used exactly as configured, with no normalisation: it is matched byte for
//! byte to the Indexer's answers (the address its bridge sends, `KV_INDEXER_WORKER_ADDRESS`)
//! and is the `worker` label of the router's metrics, so that label equals the bridge's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use metrics::{Counter, Gauge, SharedString};
use parking_lot::Mutex;
use rand::seq::IndexedRandom;
use serde_json::Value;
use tracing::{info, warn};

use crate::selection::Load;

#[derive(Debug)]
pub struct Worker {
    /// The URL as configured; Indexer answers are matched to it byte for byte.
    pub url: String,
    /// The URL as a metrics label, built once: labelling a request clones a reference.
    pub label: SharedString,
    /// `kv_router_worker_healthy{worker}`.
    healthy_gauge: Gauge,
    /// `kv_router_worker_indexer_matches_total{worker}`: Indexer answers that named it.
    pub indexer_matches: Counter,
    healthy: AtomicBool,
    /// A health check has answered (either way): until then "healthy" is only assumed.
    checked: AtomicBool,
    /// Refused because its block size or hashing differs from the first worker's.
    refused: AtomicBool,
    active: AtomicUsize,
    /// Uncached prompt tokens (as estimated when routing) of the requests sent here whose
    /// answer has not started yet: the prefill work queued on the worker.
    pressure: AtomicUsize,
    /// Requests sent so far: the tie-break between equally loaded workers, so that sequential
    /// traffic spreads.
    routed: AtomicUsize,
    /// Uncached prompt tokens sent so far (never decreases).
    routed_tokens: AtomicUsize,
    /// The worker's last good load report, if the last poll gave one.
    reported: Mutex<Option<Reported>>,
    /// `kv_router_worker_load_polls_total{worker, outcome}`: ok, failed.
    polls_ok: Counter,
    polls_failed: Counter,
}

/// A worker's own account of its load, and this router's counters when the poll was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    /// Requests in the engine (`num_reqs`, over all ranks).
    pub requests: usize,
    /// Queued prefill tokens (`num_waiting_uncached_tokens`), when every rank reports them.
    pub pressure: Option<usize>,
    routed_at_send: usize,
    routed_tokens_at_send: usize,
}

/// Where a worker reports its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSource {
    /// SGLang's `GET /get_load`: a list of ranks.
    SglangGetLoad,
    /// vLLM's `GET /metrics`: the `vllm:num_requests_running` and `vllm:num_requests_waiting`
    /// gauges (summed over engines).
    VllmMetrics,
}

impl LoadSource {
    fn path(self) -> &'static str {
        match self {
            LoadSource::SglangGetLoad => "/get_load",
            LoadSource::VllmMetrics => "/metrics",
        }
    }

    /// `(requests, queued prefill tokens)` from the body.
    fn parse(self, body: &[u8]) -> Result<(usize, Option<usize>), LoadReportError> {
        match self {
            LoadSource::SglangGetLoad => {
                let body: Value = serde_json::from_slice(body)
                    .map_err(|error| LoadReportError::Shape(format!("not JSON: {error}")))?;
                Reported::parse(&body)
            }
            LoadSource::VllmMetrics => Reported::parse_vllm(&String::from_utf8_lossy(body)),
        }
    }
}

/// One sample line of a Prometheus text page, `name{labels} value [timestamp]`, as `(name, the
/// labels between the braces, the value token)`; `None` for comments and lines without a value.
pub fn prometheus_sample(line: &str) -> Option<(&str, &str, &str)> {
    if line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match (line.find('{'), line.rfind('}')) {
        (Some(open), Some(close)) if open < close => {
            (&line[..open], &line[open + 1..close], &line[close + 1..])
        }
        _ => {
            let end = line.find(char::is_whitespace)?;
            (&line[..end], "", &line[end..])
        }
    };
    Some((name, labels, rest.split_whitespace().next()?))
}

/// Why a load report cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadReportError {
    #[error("the load report's GET failed")]
    Request(#[source] reqwest::Error),
    #[error("the load report's GET answered {0}")]
    Status(reqwest::StatusCode),
    #[error("GET /get_load is not a list of ranks, each with a non-negative num_reqs ({0})")]
    Shape(String),
    #[error("GET /metrics has no vllm:num_requests_running and vllm:num_requests_waiting gauges")]
    NoVllmGauges,
}

impl Reported {
    /// `(requests, queued prefill tokens)` from SGLang's `/get_load` body, summed over ranks.
    pub fn parse(body: &Value) -> Result<(usize, Option<usize>), LoadReportError> {
        let shape = || LoadReportError::Shape(body.to_string().chars().take(200).collect());
        let ranks = body.as_array().ok_or_else(shape)?;
        let mut requests = 0usize;
        let mut pressure = Some(0usize);
        for rank in ranks {
            let count = |key: &str| rank.get(key).and_then(Value::as_u64).map(|n| n as usize);
            requests = requests.saturating_add(count("num_reqs").ok_or_else(shape)?);
            pressure = pressure
                .zip(count("num_waiting_uncached_tokens"))
                .map(|(sum, n)| sum.saturating_add(n));
        }
        Ok((requests, pressure))
    }

    /// `(running + waiting requests, None)` from vLLM's Prometheus text, summed over its
    /// series (one per engine); both gauges must be there.
    pub fn parse_vllm(text: &str) -> Result<(usize, Option<usize>), LoadReportError> {
        let mut found = [false; 2];
        let mut requests = 0usize;
        for (name, _, value) in text.lines().filter_map(prometheus_sample) {
            let gauge = match name {
                "vllm:num_requests_running" => 0,
                "vllm:num_requests_waiting" => 1,
                _ => continue,
            };
            let value = value.parse::<f64>().ok();
            let Some(value) = value.filter(|v| v.is_finite()) else {
                continue;
            };
            found[gauge] = true;
            requests = requests.saturating_add(value.max(0.0) as usize);
        }
        if found == [true, true] {
            Ok((requests, None))
        } else {
            Err(LoadReportError::NoVllmGauges)
        }
    }
}

impl Worker {
    fn new(url: &str) -> Worker {
        let label = SharedString::from(Arc::<str>::from(url));
        let healthy_gauge = metrics::gauge!("kv_router_worker_healthy", "worker" => label.clone());
        healthy_gauge.set(1.0);
        let polls = |outcome: &'static str| {
            let counter = metrics::counter!("kv_router_worker_load_polls_total",
                "worker" => label.clone(), "outcome" => outcome);
            counter.increment(0);
            counter
        };
        let indexer_matches = metrics::counter!("kv_router_worker_indexer_matches_total",
            "worker" => label.clone());
        indexer_matches.increment(0);
        Worker {
            indexer_matches,
            polls_ok: polls("ok"),
            polls_failed: polls("failed"),
            routed_tokens: AtomicUsize::new(0),
            reported: Mutex::new(None),
            url: url.to_string(),
            healthy_gauge,
            label,
            healthy: AtomicBool::new(true),
            checked: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            pressure: AtomicUsize::new(0),
            routed: AtomicUsize::new(0),
        }
    }

    pub fn is_routable(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.refused.load(Ordering::Relaxed)
    }

    /// Routable, and a health check has said so (not only assumed at start).
    pub fn is_known_routable(&self) -> bool {
        self.checked.load(Ordering::Relaxed) && self.is_routable()
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    pub fn pressure(&self) -> usize {
        self.pressure.load(Ordering::Relaxed)
    }

    /// The worker's load: its last report plus what this router sent it since, or this
    /// router's own count where there is no report.
    pub fn load(&self) -> Load {
        let routed = self.routed.load(Ordering::Relaxed);
        let Some(report) = *self.reported.lock() else {
            return Load {
                pressure: self.pressure(),
                active: self.active(),
                routed,
            };
        };
        let since = routed.saturating_sub(report.routed_at_send);
        let since_tokens = self
            .routed_tokens
            .load(Ordering::Relaxed)
            .saturating_sub(report.routed_tokens_at_send);
        Load {
            pressure: report
                .pressure
                .map_or(self.pressure(), |p| p.saturating_add(since_tokens)),
            active: report.requests.saturating_add(since),
            routed,
        }
    }

    /// Asks the worker for its load and keeps the answer (or forgets the last one).
    pub async fn poll_load(
        &self,
        http: &reqwest::Client,
        timeout: Duration,
        source: LoadSource,
    ) -> Result<Reported, LoadReportError> {
        let routed_at_send = self.routed.load(Ordering::Relaxed);
        let routed_tokens_at_send = self.routed_tokens.load(Ordering::Relaxed);
        let answer = async {
            let response = http
                .get(format!("{}{}", self.url, source.path()))
                .timeout(timeout)
                .send()
                .await
                .map_err(LoadReportError::Request)?;
            if !response.status().is_success() {
                return Err(LoadReportError::Status(response.status()));
            }
            let bytes = response.bytes().await.map_err(LoadReportError::Request)?;
            source.parse(&bytes)
        }
        .await;
        let report = answer.map(|(requests, pressure)| Reported {
            requests,
            pressure,
            routed_at_send,
            routed_tokens_at_send,
        });
        *self.reported.lock() = report.as_ref().ok().copied();
        match &report {
            Ok(_) => self.polls_ok.increment(1),
            Err(_) => self.polls_failed.increment(1),
        }
        report
    }

    pub fn refuse(&self) {
        self.refused.store(true, Ordering::Relaxed);
    }
}

/// Counts one request as active on a worker until dropped, and its uncached prompt tokens as
/// the worker's prefill pressure until [`LoadGuard::prefilled`] (or the drop).
#[derive(Debug)]
pub struct LoadGuard {
    workers: Arc<Workers>,
    index: usize,
    prefill_tokens: usize,
}

impl LoadGuard {
    /// The answer has started: the prefill is done.
    pub fn prefilled(&mut self) {
        let tokens = std::mem::take(&mut self.prefill_tokens);
        if tokens > 0 {
            self.workers.list[self.index]
                .pressure
                .fetch_sub(tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.prefilled();
        self.workers.list[self.index]
            .active
            .fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug)]
pub struct Workers {
    pub list: Vec<Worker>,
}

impl Workers {
    /// The registry of `urls`, each healthy until checked. Registers each worker's health
    /// gauge (at 1): install the metrics recorder first.
    pub fn new(urls: &[String]) -> Workers {
        Workers {
            list: urls.iter().map(|url| Worker::new(url)).collect(),
        }
    }

    /// The worker whose URL is exactly `url`.
    pub fn by_url(&self, url: &str) -> Option<usize> {
        self.list.iter().position(|w| w.url == url)
    }

    /// Indices of the workers that can take a request now.
    pub fn routable(&self) -> Vec<usize> {
        (0..self.list.len())
            .filter(|&i| self.list[i].is_routable())
            .collect()
    }

    /// The worker with the lowest load among `among` (prefill pressure, then active requests,
    /// then the one sent fewest requests so far, then the first), if any.
    pub fn least_loaded(&self, among: &[usize]) -> Option<usize> {
        among
            .iter()
            .copied()
            .min_by_key(|&i| (self.list[i].load(), i))
    }

    /// A worker drawn at random among those of `among` whose prefill pressure is within
    /// `margin` tokens of the lowest, if any: gateways deciding on the same load reports then
    /// spread their requests over the nearly idle workers instead of all picking the same one.
    pub fn near_least_loaded(
        &self,
        among: &[usize],
        margin: usize,
        rng: &mut impl rand::Rng,
    ) -> Option<usize> {
        let pressure: Vec<(usize, usize)> = among
            .iter()
            .map(|&i| (i, self.list[i].load().pressure))
            .collect();
        let lowest = pressure.iter().map(|&(_, p)| p).min()?;
        let near: Vec<usize> = pressure
            .iter()
            .filter(|&&(_, p)| p <= lowest.saturating_add(margin))
            .map(|&(i, _)| i)
            .collect();
        near.choose(rng).copied()
    }

    /// Counts a request sent to worker `index` whose prefill computes `prefill_tokens`.
    pub fn start(self: &Arc<Self>, index: usize, prefill_tokens: usize) -> LoadGuard {
        let worker = &self.list[index];
        worker.active.fetch_add(1, Ordering::Relaxed);
        worker.routed.fetch_add(1, Ordering::Relaxed);
        worker
            .routed_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        worker.pressure.fetch_add(prefill_tokens, Ordering::Relaxed);
        LoadGuard {
            workers: self.clone(),
            index,
            prefill_tokens,
        }
    }

    /// Checks `GET /health` of every worker once; true when every one passed.
    pub async fn check_health(&self, http: &reqwest::Client, timeout: Duration) -> bool {
        let mut all = true;
        for worker in &self.list {
            let healthy = matches!(
                http.get(format!("{}/health", worker.url)).timeout(timeout).send().await,
                Ok(response) if response.status().is_success()
            );
            let was = worker.healthy.swap(healthy, Ordering::Relaxed);
            worker.checked.store(true, Ordering::Relaxed);
            if was != healthy {
                if healthy {
                    info!(url = %worker.url, "worker is healthy");
                } else {
                    warn!(url = %worker.url, "worker is unhealthy");
                }
            }
            worker.healthy_gauge.set(f64::from(u8::from(healthy)));
            all &= healthy;
        }
        all
    }
}

/// Polls every worker's load every `every` until cancelled; a worker whose poll fails is
/// logged when it starts and stops failing, and counted each time.
pub async fn poll_loads(
    workers: Arc<Workers>,
    http: reqwest::Client,
    every: Duration,
    source: LoadSource,
) {
    let mut failing = vec![false; workers.list.len()];
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let polls = workers
            .list
            .iter()
            .map(|w| w.poll_load(&http, every.max(Duration::from_millis(50)), source));
        let results = futures_util::future::join_all(polls).await;
        for ((worker, result), failed) in workers.list.iter().zip(results).zip(&mut failing) {
            match (result, *failed) {
                (Err(error), false) => {
                    warn!(url = %worker.url, error = %kv_common::error_chain(&error),
                          "the worker's load report cannot be used; counting only what this router sent it");
                    *failed = true;
                }
                (Ok(_), true) => {
                    info!(url = %worker.url, "the worker reports its load again");
                    *failed = false;
                }
                _ => {}
            }
        }
    }
}

/// The first pause before checking again what failed (a worker's health, its block hashing).
pub const RECHECK_START: Duration = Duration::from_millis(100);

/// When to check again: after a check that failed, [`RECHECK_START`] doubling up to the
/// interval; after one that passed, the interval. So a worker that starts listening just after
/// the router (as when both start together) joins within a fraction of a second instead of a
/// whole interval later, and a worker that stays down costs a check per interval.
#[derive(Debug, Clone)]
pub struct Recheck {
    interval: Duration,
    next: Duration,
}

impl Recheck {
    pub fn new(interval: Duration) -> Recheck {
        Recheck {
            interval,
            next: RECHECK_START.min(interval),
        }
    }

    /// The pause after a check that `passed`.
    pub fn after(&mut self, passed: bool) -> Duration {
        if passed {
            self.next = RECHECK_START.min(self.interval);
            return self.interval;
        }
        let pause = self.next;
        self.next = (pause * 2).min(self.interval);
        pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_load_report_sums_ranks_and_names_a_bad_shape() {
        let two = json!([
            {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 9, "num_waiting_uncached_tokens": 100},
            {"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 4, "num_waiting_uncached_tokens": 20},
        ]);
        assert_eq!(Reported::parse(&two).unwrap(), (5, Some(120)));
        // SGLang's own /get_load has no queued-token field: requests only.
        let sglang =
            json!([{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 2, "num_tokens": 800}]);
        assert_eq!(Reported::parse(&sglang).unwrap(), (7, None));
        for bad in [
            json!({"num_reqs": 1}),
            json!([{"num_reqs": -1}]),
            json!([{}]),
            json!("x"),
        ] {
            let error = Reported::parse(&bad).unwrap_err().to_string();
            assert!(error.contains("num_reqs"), "{error}");
        }
    }

    #[test]
    fn a_vllm_load_report_sums_its_gauges_over_engines() {
        let two_engines = "# HELP vllm:num_requests_running Number of requests.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0 1767225600000\n\
            vllm:num_requests_waiting{engine=\"2\",model_name=\"m\"} +Inf\n\
            vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 9.0\n";
        assert_eq!(Reported::parse_vllm(two_engines).unwrap(), (6, None));
        let source = LoadSource::VllmMetrics;
        assert_eq!(source.parse(two_engines.as_bytes()).unwrap(), (6, None));
        for missing in ["", "vllm:num_requests_running 1.0\n", "other_metric 2\n"] {
            let error = Reported::parse_vllm(missing).unwrap_err().to_string();
            assert!(error.contains("vllm:num_requests_waiting"), "{error}");
        }
    }

    #[test]
    fn load_is_the_report_plus_what_was_sent_since_the_poll() {
        let workers = Arc::new(Workers::new(&["http://w:1".to_string()]));
        let worker = &workers.list[0];
        let before = workers.start(0, 500);
        assert_eq!((worker.load().pressure, worker.load().active), (500, 1));
        // Another router's requests: the worker reports 3 requests and 2,000 queued tokens,
        // polled after this router sent its first request.
        *worker.reported.lock() = Some(Reported {
            requests: 3,
            pressure: Some(2000),
            routed_at_send: 1,
            routed_tokens_at_send: 500,
        });
        assert_eq!((worker.load().pressure, worker.load().active), (2000, 3));
        let after = workers.start(0, 300);
        assert_eq!((worker.load().pressure, worker.load().active), (2300, 4));
        // A report without queued tokens: pressure is this router's own count.
        *worker.reported.lock() = Some(Reported {
            requests: 3,
            pressure: None,
            routed_at_send: 2,
            routed_tokens_at_send: 800,
        });
        assert_eq!((worker.load().pressure, worker.load().active), (800, 3));
        // No report: this router's own count.
        *worker.reported.lock() = None;
        drop((before, after));
        assert_eq!((worker.load().pressure, worker.load().active), (0, 0));
    }

    #[test]
    fn near_least_loaded_draws_only_among_workers_within_the_margin() {
        use rand::SeedableRng;
        let urls: Vec<String> = (0..4).map(|i| format!("http://w:{i}")).collect();
        let workers = Arc::new(Workers::new(&urls));
        // Prefill pressure 1,000, 1,400, 1,600 and 5,000 tokens.
        let _sent: Vec<LoadGuard> = [1000, 1400, 1600, 5000]
            .iter()
            .enumerate()
            .map(|(i, &tokens)| workers.start(i, tokens))
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let all = [0, 1, 2, 3];
        let mut drawn = [0; 4];
        for _ in 0..400 {
            drawn[workers.near_least_loaded(&all, 500, &mut rng).unwrap()] += 1;
        }
        // Within 500 of the lowest (1,000): workers 0 and 1, each drawn about half the time.
        assert_eq!((drawn[2], drawn[3]), (0, 0));
        assert!(drawn[0] > 120 && drawn[1] > 120, "{drawn:?}");
        // A margin of 0 keeps only the lowest; no workers, no answer.
        assert_eq!(workers.near_least_loaded(&all, 0, &mut rng), Some(0));
        assert_eq!(workers.near_least_loaded(&[2, 3], 100, &mut rng), Some(2));
        assert_eq!(workers.near_least_loaded(&[], 100, &mut rng), None);
    }

    #[test]
    fn rechecks_a_failure_soon_then_less_often_and_a_pass_at_the_interval() {
        let ms = Duration::from_millis;
        let mut recheck = Recheck::new(ms(1000));
        let failing: Vec<Duration> = (0..6).map(|_| recheck.after(false)).collect();
        assert_eq!(
            failing,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        assert_eq!(recheck.after(true), ms(1000));
        assert_eq!(
            recheck.after(false),
            ms(100),
            "a new failure starts soon again"
        );
        let mut short = Recheck::new(ms(50));
        assert_eq!([short.after(false), short.after(false)], [ms(50), ms(50)]);
    }
}
