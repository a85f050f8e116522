//! The worker registry: URLs, health, and each worker's load: active requests and prefill
//! pressure (the uncached prompt tokens of requests whose first token has not come back).
//!
//! A worker's URL is used exactly as configured, with no normalisation: it is matched byte for
//! byte to the Indexer's answers (the address its bridge sends, `KV_INDEXER_WORKER_ADDRESS`)
//! and is the `worker` label of the router's metrics, so that label equals the bridge's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use metrics::{Gauge, SharedString};

use crate::selection::Load;
use tracing::{info, warn};

#[derive(Debug)]
pub struct Worker {
    /// The URL as configured; Indexer answers are matched to it byte for byte.
    pub url: String,
    /// The URL as a metrics label, built once: labelling a request clones a reference.
    pub label: SharedString,
    /// `kv_router_worker_healthy{worker}`.
    healthy_gauge: Gauge,
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
}

impl Worker {
    fn new(url: &str) -> Worker {
        let label = SharedString::from(Arc::<str>::from(url));
        let healthy_gauge = metrics::gauge!("kv_router_worker_healthy", "worker" => label.clone());
        healthy_gauge.set(1.0);
        Worker {
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

    pub fn load(&self) -> Load {
        Load {
            pressure: self.pressure(),
            active: self.active(),
            routed: self.routed.load(Ordering::Relaxed),
        }
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

    /// Counts a request sent to worker `index` whose prefill computes `prefill_tokens`.
    pub fn start(self: &Arc<Self>, index: usize, prefill_tokens: usize) -> LoadGuard {
        let worker = &self.list[index];
        worker.active.fetch_add(1, Ordering::Relaxed);
        worker.routed.fetch_add(1, Ordering::Relaxed);
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
