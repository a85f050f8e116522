//! How long to wait before a retry: a ceiling that doubles from a start to a maximum, and each
//! wait drawn uniformly from the upper half of the ceiling ("equal jitter"). The doubling keeps
//! a long outage cheap; the jitter keeps a fleet of bridges that failed together (a server
//! restart) from retrying together, and the lower half left out keeps a retry from coming at
//! once.

use std::time::Duration;

use rand::Rng;

#[derive(Debug, Clone)]
pub struct Backoff {
    start: Duration,
    max: Duration,
    ceiling: Duration,
}

impl Backoff {
    /// Waits up to `start` first, doubling to `max`.
    pub fn new(start: Duration, max: Duration) -> Backoff {
        Backoff {
            start,
            max,
            ceiling: start.min(max),
        }
    }

    /// The next wait, drawn from the thread's random generator.
    pub fn next_wait(&mut self) -> Duration {
        self.next_wait_with(&mut rand::rng())
    }

    /// The next wait: uniform in `[ceiling / 2, ceiling]`; then the ceiling doubles, up to the
    /// maximum.
    pub fn next_wait_with(&mut self, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling;
        self.ceiling = ceiling.saturating_mul(2).min(self.max);
        let half = ceiling / 2;
        half + rng.random_range(Duration::ZERO..=ceiling - half)
    }

    /// Starts again from the first wait (after a success).
    pub fn reset(&mut self) {
        self.ceiling = self.start.min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Draws `steps` waits from a fresh schedule for each of many seeds and checks each against
    /// its ceiling, `start · 2^step` capped at `max`: within `[ceiling / 2, ceiling]`.
    fn check(start: Duration, max: Duration, ceilings: &[Duration]) {
        let mut seen_low = vec![false; ceilings.len()];
        let mut seen_high = vec![false; ceilings.len()];
        for seed in 0..500 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut backoff = Backoff::new(start, max);
            for (step, &ceiling) in ceilings.iter().enumerate() {
                let wait = backoff.next_wait_with(&mut rng);
                assert!(
                    wait >= ceiling / 2 && wait <= ceiling,
                    "step {step}: {wait:?} outside [{:?}, {ceiling:?}]",
                    ceiling / 2
                );
                seen_low[step] |= wait < ceiling * 3 / 5;
                seen_high[step] |= wait > ceiling * 9 / 10;
            }
        }
        // Jitter: across seeds, each step's waits spread over its whole range.
        assert!(seen_low.iter().all(|&seen| seen), "{seen_low:?}");
        assert!(seen_high.iter().all(|&seen| seen), "{seen_high:?}");
    }

    #[test]
    fn the_senders_waits_double_from_500_ms_to_10_s_within_jitter() {
        let ceilings = [500, 1_000, 2_000, 4_000, 8_000, 10_000, 10_000, 10_000].map(|ms| ms * MS);
        check(500 * MS, 10_000 * MS, &ceilings);
    }

    #[test]
    fn a_start_above_the_maximum_is_capped() {
        check(3_000 * MS, 1_000 * MS, &[1_000 * MS, 1_000 * MS]);
    }

    #[test]
    fn reset_starts_from_the_first_wait_again() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut backoff = Backoff::new(100 * MS, 10_000 * MS);
        for _ in 0..10 {
            backoff.next_wait_with(&mut rng);
        }
        assert!(backoff.next_wait_with(&mut rng) >= 5_000 * MS);
        backoff.reset();
        assert!(backoff.next_wait_with(&mut rng) <= 100 * MS);
    }
}
