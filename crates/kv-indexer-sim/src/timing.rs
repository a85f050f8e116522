//! The time model: how long the simulated engine takes, so that cache hits show up as a
//! shorter time to first token and load as queueing (the running-request limit is the
//! scheduler's).

use std::time::Duration;

/// Costs per token. Zero costs make a worker that answers as fast as it can.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeModel {
    /// Per prompt token not found in the cache.
    pub prefill_per_token: Duration,
    /// Per generated token.
    pub decode_per_token: Duration,
}

impl TimeModel {
    /// The prefill of a prompt with `uncached_tokens` to compute.
    pub fn prefill(&self, uncached_tokens: usize) -> Duration {
        self.prefill_per_token * saturating_u32(uncached_tokens)
    }

    /// When output token `index` (from 0) is ready, counted from the end of the prefill: the
    /// first token comes out of the prefill itself.
    pub fn token_offset(&self, index: usize) -> Duration {
        self.decode_per_token * saturating_u32(index)
    }
}

fn saturating_u32(value: usize) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_uncached_prompt_tokens_and_each_token_after_the_first() {
        let model = TimeModel {
            prefill_per_token: Duration::from_micros(50),
            decode_per_token: Duration::from_millis(2),
        };
        assert_eq!(model.prefill(0), Duration::ZERO);
        assert_eq!(model.prefill(1000), Duration::from_millis(50));
        assert_eq!(model.token_offset(0), Duration::ZERO);
        assert_eq!(model.token_offset(10), Duration::from_millis(20));
    }
}
