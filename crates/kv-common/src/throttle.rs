//! Log throttling: a class of event is logged when its total reaches 1, 2, 4, 8, …, so the
//! first occurrence is visible and a sustained stream does not flood the logs. Shared by the
//! server, the bridge and the router.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts events of one class.
#[derive(Debug, Default)]
pub struct DoublingLog {
    total: AtomicU64,
}

impl DoublingLog {
    /// Counts one event; returns the new total when it is a power of two (time to log).
    pub fn record(&self) -> Option<u64> {
        let total = self.total.fetch_add(1, Ordering::Relaxed) + 1;
        total.is_power_of_two().then_some(total)
    }

    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_at_powers_of_two_only() {
        let log = DoublingLog::default();
        let logged: Vec<u64> = (0..20).filter_map(|_| log.record()).collect();
        assert_eq!(logged, [1, 2, 4, 8, 16]);
        assert_eq!(log.total(), 20);
    }
}
