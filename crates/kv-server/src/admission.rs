//! Admission of prefix queries: a bound on those in the server at once, taken when a query's
//! request head arrives and held until its answer is made ([`Admission`]), so that the bound
//! covers queueing for a CPU too; a query over it is refused at once, one whose deadline is
//! already spent is shed. Both are counted and logged at doubling totals.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_common::DoublingLog;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{info, warn};

use crate::error::ServerError;
use crate::observe;

/// The prefix queries' bound and what it refused.
#[derive(Debug)]
pub struct QueryGate {
    permits: Arc<Semaphore>,
    limit: usize,
    shed: DoublingLog,
    rejected: DoublingLog,
    scans: AtomicU64,
}

impl QueryGate {
    /// At most `limit` prefix queries at once.
    pub fn new(limit: usize) -> QueryGate {
        QueryGate {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
            shed: DoublingLog::default(),
            rejected: DoublingLog::default(),
            scans: AtomicU64::new(0),
        }
    }

    /// The bound.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Prefix queries admitted and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.limit - self.permits.available_permits()
    }

    /// Takes a permit, or rejects at once (never queues).
    pub fn admit(&self) -> Result<Admission, ServerError> {
        let permit = self.permits.clone().try_acquire_owned().map_err(|_| {
            if let Some(total) = self.rejected.record() {
                warn!(
                    total,
                    limit = self.limit,
                    "rejecting prefix queries over the in-flight bound"
                );
            }
            observe::rejection("admission");
            ServerError::Overloaded { limit: self.limit }
        })?;
        Ok(Admission(Arc::new(InFlight::new(permit))))
    }

    /// Counts (and now and then logs) a prefix query shed for its deadline.
    pub fn record_shed(&self) {
        if let Some(total) = self.shed.record() {
            info!(total, "shedding prefix queries whose deadline is spent");
        }
        observe::rejection("deadline");
    }

    /// Prefix queries shed because their deadline was spent, and rejected by admission.
    pub fn shed_and_rejected(&self) -> (u64, u64) {
        (self.shed.total(), self.rejected.total())
    }

    /// Counts a prefix scan that touched the index.
    pub fn count_scan(&self) {
        self.scans.fetch_add(1, Ordering::Relaxed);
    }

    /// Prefix scans that touched the index since start.
    pub fn scans(&self) -> u64 {
        self.scans.load(Ordering::Relaxed)
    }
}

/// A prefix query's admission permit, taken when its request arrived; released when dropped
/// (the last clone), which is when `kv_indexer_prefix_queries_inflight` goes down again.
#[derive(Debug, Clone)]
pub struct Admission(#[allow(dead_code)] Arc<InFlight>);

#[derive(Debug)]
struct InFlight(#[allow(dead_code)] OwnedSemaphorePermit);

impl InFlight {
    fn new(permit: OwnedSemaphorePermit) -> InFlight {
        observe::prefix_queries_inflight(1.0);
        InFlight(permit)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        observe::prefix_queries_inflight(-1.0);
    }
}
