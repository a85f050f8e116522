//! How current a replica's index is: read by every query, written by its applier.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::now_ms;
use crate::error::ChangeError;
use crate::stream::READ_BLOCK;

/// How current this replica's index is; read by every query.
#[derive(Debug)]
pub struct Freshness {
    /// Caught up with the stream's tail as of the last (re)start.
    pub(super) ready: AtomicBool,
    /// When this replica last knew it had applied the whole stream (ms since the epoch).
    caught_up_at_ms: AtomicU64,
    /// Entries in the stream not yet applied, at the last check.
    pub(super) behind: AtomicU64,
    /// The next position to apply.
    pub(super) position: AtomicU64,
    max_lag_ms: u64,
}

impl Freshness {
    pub(super) fn new(max_lag: Duration) -> Freshness {
        Freshness {
            ready: AtomicBool::new(false),
            caught_up_at_ms: AtomicU64::new(now_ms()),
            behind: AtomicU64::new(0),
            position: AtomicU64::new(0),
            max_lag_ms: max_lag.as_millis() as u64,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Milliseconds since this replica last knew it had applied the whole stream (a blocked
    /// read counts as caught up for [`READ_BLOCK`]).
    pub fn lag_ms(&self) -> u64 {
        let since = now_ms().saturating_sub(self.caught_up_at_ms.load(Ordering::Acquire));
        since.saturating_sub(READ_BLOCK.as_millis() as u64)
    }

    pub fn behind(&self) -> u64 {
        self.behind.load(Ordering::Relaxed)
    }

    pub fn position(&self) -> u64 {
        self.position.load(Ordering::Relaxed)
    }

    /// Whether queries may be answered: ready and no further behind than the bound.
    pub fn check(&self) -> Result<(), ChangeError> {
        if !self.is_ready() {
            return Err(ChangeError::NotReady);
        }
        let lag_ms = self.lag_ms();
        if lag_ms > self.max_lag_ms {
            return Err(ChangeError::Stale {
                lag_ms,
                max_ms: self.max_lag_ms,
            });
        }
        Ok(())
    }

    pub(super) fn caught_up(&self, at_ms: u64) {
        self.caught_up_at_ms.store(at_ms, Ordering::Release);
        self.behind.store(0, Ordering::Relaxed);
    }
}
