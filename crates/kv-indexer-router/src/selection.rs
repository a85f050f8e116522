//! The cache-aware rules, pure: which candidate wins on cache, and when load overrules it.
//!
//! - A candidate is **usable** when its (tier-weighted) match is at least
//!   `--cache-affinity-min-matched-tokens` and at least `--cache-affinity-min-match-ratio` of
//!   the prompt.
//! - The **primary** is the usable candidate with the longest match; candidates within
//!   `--cache-switch-margin-tokens` of it count as tied, and a tie goes to the lower load.
//! - The **pressure guard** (off unless `--pressure-abs-threshold-tokens` is set): the primary
//!   gives way to the least loaded worker (the backup) when its prefill pressure exceeds the
//!   backup's by more than the tokens its cache saves plus `--pressure-abs-threshold-tokens`,
//!   *and* by more than `--pressure-rel-threshold` times, so that a hot prefix does not pile
//!   onto one worker. Counting the saved tokens makes the guard compare estimated prefill
//!   waits (queued + own uncached tokens) rather than queues alone: with fixed thresholds
//!   only, it moved conversations off the workers holding them and cost hits. Even so it cost
//!   hits and bought no time to first token on the Mooncake traces, which have no hot prefix,
//!   hence off by default (`bench/routing/decisions.md`).
//!
//! - The **balance guard** (off unless `--balance-abs-threshold` is set): the primary gives way
//!   to the least loaded worker when its active requests exceed the mean over routable workers
//!   by more than that many *and* by more than `--balance-rel-threshold` times. A hot prefix
//!   (a popular system prompt) then gets a second home instead of piling its requests onto one
//!   worker, and near-ties between its homes go by load.
//!
//! Load is prefill pressure first (the uncached prompt tokens routed to a worker whose first
//! token has not come back yet), then active requests, then requests routed so far.

/// What a decision knows of a worker's load, compared in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Load {
    /// Uncached prompt tokens queued for prefill.
    pub pressure: usize,
    pub active: usize,
    pub routed: usize,
}

/// A worker and how many of the prompt's tokens it can reuse, tier weights applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub worker: usize,
    pub matched_tokens: usize,
}

/// How much a hit in each tier is worth against one on the device (HBM = 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierWeights {
    /// The host tier (SGLang's hierarchical cache, `CPU_PINNED`).
    pub dram: f64,
    /// A block the Indexer only predicts (another router sent the prompt there and the worker
    /// has not reported it yet); below 1, so a prediction never outranks a confirmed placement
    /// of the same prefix.
    pub predicted: f64,
}

impl TierWeights {
    /// Reusable tokens of a prefix of `device` tokens on the device followed by `host` on the
    /// host.
    pub fn weigh(&self, device: usize, host: usize) -> usize {
        device + (host as f64 * self.dram) as usize
    }

    /// Reusable tokens of a worker whose `confirmed` tokens are followed by predicted ones up
    /// to `predicted` tokens.
    pub fn weigh_predicted(&self, confirmed: usize, predicted: usize) -> usize {
        confirmed + (predicted.saturating_sub(confirmed) as f64 * self.predicted) as usize
    }
}

/// The settings of the rules above.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selection {
    pub min_matched_tokens: usize,
    pub min_match_ratio: f64,
    pub switch_margin_tokens: usize,
    /// `None`: no guard.
    pub pressure_abs_threshold_tokens: Option<usize>,
    pub pressure_rel_threshold: f64,
    /// The balance guard (`None`: off): a cache choice gives way to the least loaded worker
    /// when its active requests exceed the routable workers' mean by more than this many...
    pub balance_abs_threshold: Option<usize>,
    /// ... and by more than this factor.
    pub balance_rel_threshold: f64,
    pub weights: TierWeights,
}

impl Selection {
    pub fn usable(&self, matched_tokens: usize, prompt_tokens: usize) -> bool {
        matched_tokens > 0
            && matched_tokens >= self.min_matched_tokens
            && matched_tokens as f64 >= self.min_match_ratio * prompt_tokens as f64
    }

    /// The usable candidate with the longest match, near-ties (within the switch margin) by
    /// lower load, then by worker order.
    pub fn primary(
        &self,
        candidates: &[Candidate],
        prompt_tokens: usize,
        load: impl Fn(usize) -> Load,
    ) -> Option<Candidate> {
        let usable = || {
            candidates
                .iter()
                .filter(|c| self.usable(c.matched_tokens, prompt_tokens))
        };
        let best = usable().map(|c| c.matched_tokens).max()?;
        let floor = best.saturating_sub(self.switch_margin_tokens);
        usable()
            .filter(|c| c.matched_tokens >= floor)
            .min_by_key(|c| {
                (
                    load(c.worker),
                    std::cmp::Reverse(c.matched_tokens),
                    c.worker,
                )
            })
            .copied()
    }

    /// Whether the cache choice holds so many more active requests than the mean (`mean`)
    /// that it gives way: a hot prefix then gets a second home, and ties between its homes go
    /// by load.
    pub fn unbalanced(&self, active: usize, mean: f64) -> bool {
        let Some(threshold) = self.balance_abs_threshold else {
            return false;
        };
        let active = active as f64;
        active > mean + threshold as f64 && active > mean * self.balance_rel_threshold
    }

    /// Whether the primary's pressure overrules its cache in favour of the backup, each with
    /// its load and its matched tokens.
    pub fn guard(&self, primary: (Load, usize), backup: (Load, usize)) -> bool {
        let Some(threshold) = self.pressure_abs_threshold_tokens else {
            return false;
        };
        let ((primary, primary_matched), (backup, backup_matched)) = (primary, backup);
        let saved = primary_matched.saturating_sub(backup_matched);
        primary.pressure.saturating_sub(backup.pressure) > threshold.saturating_add(saved)
            && primary.pressure as f64 > backup.pressure as f64 * self.pressure_rel_threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selection() -> Selection {
        Selection {
            min_matched_tokens: 100,
            min_match_ratio: 0.0,
            switch_margin_tokens: 0,
            pressure_abs_threshold_tokens: Some(1000),
            pressure_rel_threshold: 2.0,
            balance_abs_threshold: Some(4),
            balance_rel_threshold: 1.5,
            weights: TierWeights {
                dram: 0.75,
                predicted: 0.5,
            },
        }
    }

    #[test]
    fn the_balance_guard_needs_both_thresholds_and_is_off_by_default() {
        let on = selection();
        // Mean 2: over by more than 4 and more than 1.5x.
        assert!(on.unbalanced(7, 2.0));
        assert!(!on.unbalanced(6, 2.0), "not more than 4 over");
        // Mean 10: 15 is 5 over but only 1.5x.
        assert!(!on.unbalanced(15, 10.0));
        assert!(on.unbalanced(16, 10.0));
        let off = Selection {
            balance_abs_threshold: None,
            ..on
        };
        assert!(!off.unbalanced(1000, 0.0));
    }

    fn load(pressure: usize) -> Load {
        Load {
            pressure,
            active: 0,
            routed: 0,
        }
    }

    /// The primary among `(worker, matched)` for a prompt of `prompt` tokens, pressures
    /// `pressures` by worker.
    fn check(
        selection: Selection,
        candidates: &[(usize, usize)],
        prompt: usize,
        pressures: &[usize],
    ) -> Option<usize> {
        let candidates: Vec<Candidate> = candidates
            .iter()
            .map(|&(worker, matched_tokens)| Candidate {
                worker,
                matched_tokens,
            })
            .collect();
        selection
            .primary(&candidates, prompt, |w| load(pressures[w]))
            .map(|c| c.worker)
    }

    #[test]
    fn the_longest_usable_match_wins_ties_by_load() {
        let s = selection();
        for (candidates, pressures, expected) in [
            (&[(0, 500), (1, 800)][..], [0, 50, 0], Some(1)),
            // Below the minimum: not usable.
            (&[(0, 99)][..], [0, 0, 0], None),
            (&[][..], [0, 0, 0], None),
            // Equal matches: the lower pressure.
            (&[(0, 800), (1, 800)][..], [10, 5, 0], Some(1)),
            (&[(0, 800), (1, 800)][..], [0, 0, 0], Some(0)),
        ] {
            assert_eq!(
                check(s, candidates, 1000, &pressures),
                expected,
                "{candidates:?}"
            );
        }
    }

    #[test]
    fn a_switch_margin_makes_near_ties_go_by_load() {
        let s = Selection {
            switch_margin_tokens: 400,
            ..selection()
        };
        assert_eq!(check(s, &[(0, 800), (1, 500)], 1000, &[10, 0]), Some(1));
        assert_eq!(check(s, &[(0, 800), (1, 300)], 1000, &[10, 0]), Some(0));
    }

    #[test]
    fn a_match_ratio_below_the_minimum_is_not_usable() {
        let s = Selection {
            min_match_ratio: 0.5,
            ..selection()
        };
        assert!(s.usable(500, 1000));
        assert!(!s.usable(499, 1000));
        assert!(!selection().usable(0, 0));
    }

    #[test]
    fn the_guard_needs_both_the_absolute_and_the_relative_excess_over_the_saving() {
        let s = selection();
        for (primary, backup, saved, overruled) in [
            (2001, 1000, 0, true),
            (2000, 1000, 0, false), // 1,000 over: not more than the absolute threshold
            (3000, 1600, 0, false), // 1,400 over but less than 2×
            (1001, 0, 0, true),
            (1000, 0, 0, false),
            (0, 0, 0, false),
            // The cache saves 500 tokens: the excess must beat 1,000 + 500.
            (1501, 0, 500, true),
            (1500, 0, 500, false),
        ] {
            assert_eq!(
                s.guard((load(primary), saved), (load(backup), 0)),
                overruled,
                "{primary} vs {backup}, saving {saved}"
            );
        }
        // A backup holding as much saves nothing by staying.
        assert!(s.guard((load(1001), 700), (load(0), 700)));
        // Without a threshold there is no guard.
        let off = Selection {
            pressure_abs_threshold_tokens: None,
            ..s
        };
        assert!(!off.guard((load(1_000_000), 0), (load(0), 0)));
    }

    #[test]
    fn host_hits_count_at_their_weight() {
        let weights = TierWeights {
            dram: 0.75,
            predicted: 0.5,
        };
        assert_eq!(weights.weigh(1000, 400), 1300);
        // A prediction counts for half beyond the confirmed part, and never below it.
        assert_eq!(weights.weigh_predicted(1000, 3000), 2000);
        assert_eq!(weights.weigh_predicted(1000, 500), 1000);
        assert_eq!(weights.weigh_predicted(0, 2048), 1024);
        let no_host = TierWeights {
            dram: 0.0,
            predicted: 0.0,
        };
        assert_eq!(no_host.weigh(1000, 400), 1000);
    }
}
