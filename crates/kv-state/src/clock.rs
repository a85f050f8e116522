//! The clock liveness reads, in one place: records carry their wall time, TTLs compare it, and
//! the mass-expiry guard times its episodes on the monotonic clock.
//!
//! A [`Clock`] is the system's clocks, plus however far a test has moved it on
//! ([`Clock::advance`]): a test of a TTL moves the clock past it instead of sleeping it out.
//! Both readings move together, so the wall and monotonic views never disagree.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The system's clocks, moved on by [`Clock::advance`] (tests only; the default never moves).
#[derive(Debug, Clone, Default)]
pub struct Clock {
    /// Milliseconds added to both readings; shared by every clone.
    ahead_ms: Arc<AtomicU64>,
}

impl Clock {
    /// Milliseconds since the Unix epoch, now.
    pub fn now_ms(&self) -> u64 {
        let system = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        system + self.ahead().as_millis() as u64
    }

    /// The monotonic clock, now.
    pub fn now(&self) -> Instant {
        Instant::now() + self.ahead()
    }

    /// Moves this clock and every clone of it on by `by`: what a test does instead of sleeping
    /// out a TTL.
    pub fn advance(&self, by: Duration) {
        self.ahead_ms
            .fetch_add(by.as_millis() as u64, Ordering::Relaxed);
    }

    fn ahead(&self) -> Duration {
        Duration::from_millis(self.ahead_ms.load(Ordering::Relaxed))
    }
}

/// Milliseconds since the Unix epoch, now, by the system's clock: for what no TTL reads (a
/// replica's lag, a set-aside directory's name).
pub fn now_ms() -> u64 {
    Clock::default().now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advance_moves_every_clone_and_both_readings() {
        let clock = Clock::default();
        let copy = clock.clone();
        let (wall, mono) = (clock.now_ms(), clock.now());
        copy.advance(Duration::from_secs(60));
        assert!(clock.now_ms() >= wall + 60_000);
        assert!(clock.now() >= mono + Duration::from_secs(60));
        assert!(now_ms() < wall + 60_000, "the system clock does not move");
    }
}
