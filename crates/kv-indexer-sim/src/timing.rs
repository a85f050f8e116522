//! The time model: how long the simulated engine takes, so that cache hits show up as a
//! shorter time to first token and load as queueing.
//!
//! Prefill is compute-bound on a GPU: one forward pass at a time works through the prompts, so
//! the engine runs prefills one after another ([`PrefillQueue`]) and a worker's time to first
//! token grows with the uncached tokens queued before it. Each prefill costs a linear part per
//! uncached token (the weights' matrix products) plus an attention part per pair of (uncached
//! token, token before it), so a long context costs more than its length alone. Decode runs
//! beside the prefills at a fixed cost per token (continuous batching; the decode batch does
//! not slow down with its size in this model).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Costs per token. Zero costs make a worker that answers as fast as it can.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeModel {
    /// Per prompt token not found in the cache.
    pub prefill_per_token: Duration,
    /// Attention, per uncached prompt token and per 1,000 tokens before it in the prompt
    /// (cached or not).
    pub prefill_per_token_per_1k_context: Duration,
    /// Per generated token.
    pub decode_per_token: Duration,
}

impl TimeModel {
    /// The prefill of a prompt whose first `cached_tokens` are in the cache and whose next
    /// `uncached_tokens` must be computed.
    pub fn prefill(&self, cached_tokens: usize, uncached_tokens: usize) -> Duration {
        let (cached, uncached) = (cached_tokens as u128, uncached_tokens as u128);
        // Token i of the uncached part attends to the cached tokens and the i before it.
        let pairs = uncached * cached + uncached * uncached.saturating_sub(1) / 2;
        let linear = self.prefill_per_token.as_nanos() * uncached;
        let attention = self.prefill_per_token_per_1k_context.as_nanos() * pairs / 1000;
        Duration::from_nanos(u64::try_from(linear + attention).unwrap_or(u64::MAX))
    }

    /// When output token `index` (from 0) is ready, counted from the end of the prefill: the
    /// first token comes out of the prefill itself.
    pub fn token_offset(&self, index: usize) -> Duration {
        self.decode_per_token * u32::try_from(index).unwrap_or(u32::MAX)
    }
}

/// The engine's one prefill lane: prefills run one after another, in the order they are
/// queued.
#[derive(Debug, Clone, Default)]
pub struct PrefillQueue {
    /// When the last queued prefill ends.
    busy_until: Arc<Mutex<Option<Instant>>>,
}

impl PrefillQueue {
    /// Queues a prefill of `cost` arriving `now`: it starts when the lane is free and the
    /// returned instant is when it ends.
    pub fn reserve(&self, now: Instant, cost: Duration) -> Instant {
        let mut busy_until = self.busy_until.lock();
        let start = busy_until.map_or(now, |busy| busy.max(now));
        let end = start + cost;
        *busy_until = Some(end);
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_uncached_prompt_tokens_and_each_token_after_the_first() {
        let model = TimeModel {
            prefill_per_token: Duration::from_micros(50),
            prefill_per_token_per_1k_context: Duration::ZERO,
            decode_per_token: Duration::from_millis(2),
        };
        assert_eq!(model.prefill(0, 0), Duration::ZERO);
        assert_eq!(model.prefill(0, 1000), Duration::from_millis(50));
        assert_eq!(model.prefill(5000, 1000), Duration::from_millis(50));
        assert_eq!(model.token_offset(0), Duration::ZERO);
        assert_eq!(model.token_offset(10), Duration::from_millis(20));
    }

    #[test]
    fn attention_grows_with_the_context_before_each_uncached_token() {
        let model = TimeModel {
            prefill_per_token_per_1k_context: Duration::from_micros(1),
            ..TimeModel::default()
        };
        // 1,000 uncached tokens after 2,000 cached: 1,000 × 2,000 + 1,000 × 999 / 2 pairs.
        assert_eq!(model.prefill(2000, 1000), Duration::from_nanos(2_499_500));
        // Cached tokens cost nothing by themselves.
        assert_eq!(model.prefill(2000, 0), Duration::ZERO);
        assert_eq!(model.prefill(0, 1), Duration::ZERO);
        assert_eq!(model.prefill(0, 2), Duration::from_nanos(1));
    }

    #[test]
    fn prefills_queue_behind_each_other() {
        let queue = PrefillQueue::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(queue.reserve(t0, ms(10)), t0 + ms(10));
        // Arrives while the first runs: waits for it.
        assert_eq!(queue.reserve(t0 + ms(5), ms(10)), t0 + ms(20));
        // Arrives after the lane went idle: starts at once.
        assert_eq!(queue.reserve(t0 + ms(50), ms(1)), t0 + ms(51));
        assert_eq!(queue.reserve(t0 + ms(60), Duration::ZERO), t0 + ms(60));
    }
}
