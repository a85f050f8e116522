//! The worker registry: URLs, health, and each worker's load: active requests and prefill
//! pressure (the uncached prompt tokens of requests whose first token has not come back).

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
        Worker {
            url: url.to_string(),
            healthy_gauge: metrics::gauge!("kv_router_worker_healthy", "worker" => label.clone()),
            label,
            healthy: AtomicBool::new(true),
            refused: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            pressure: AtomicUsize::new(0),
            routed: AtomicUsize::new(0),
        }
    }

    pub fn is_routable(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.refused.load(Ordering::Relaxed)
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
    /// gauge: install the metrics recorder first.
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

    /// Checks `GET /health` of every worker once.
    pub async fn check_health(&self, http: &reqwest::Client, timeout: Duration) {
        for worker in &self.list {
            let healthy = matches!(
                http.get(format!("{}/health", worker.url)).timeout(timeout).send().await,
                Ok(response) if response.status().is_success()
            );
            let was = worker.healthy.swap(healthy, Ordering::Relaxed);
            if was != healthy {
                if healthy {
                    info!(url = %worker.url, "worker is healthy");
                } else {
                    warn!(url = %worker.url, "worker is unhealthy");
                }
            }
            worker.healthy_gauge.set(f64::from(u8::from(healthy)));
        }
    }
}
