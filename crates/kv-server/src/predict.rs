//! Predicted placements: a router that sends a prompt to a worker tells the server
//! (`PredictExternalKv`), so that every router's prefix answers can name that worker for the
//! prompt's blocks before the worker's own events arrive (sibling requests within the event
//! lag: best-of-N, agent fan-out, a new system prompt going live).
//!
//! The rules:
//! - a prediction lives for its TTL (at most [`Predictions::max_ttl`]) and is never answered
//!   after it;
//! - it lives in this server's memory only: never logged, replicated or snapshotted, so it
//!   never becomes a placement;
//! - the worker's own events replace it: a REPORT or REVOKE of a block by the worker drops that
//!   worker's prediction of the block (on the server that received the apply; elsewhere the
//!   TTL bounds it);
//! - answers keep it apart (`predicted`, field 100) and only extend a worker's confirmed prefix:
//!   a worker is listed when its predicted prefix (confirmed blocks, then predicted ones) is
//!   longer than its confirmed one. How much a predicted block is worth is the router's rule.
//!
//! The table is bounded ([`Predictions::max_entries`] block-worker pairs); expired entries are
//! swept at most once a second, on a prediction.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often expired entries are swept (on the next prediction after it).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct Predictions {
    table: Mutex<Table>,
    pub max_entries: usize,
    pub max_ttl: Duration,
}

#[derive(Debug)]
struct Table {
    /// Block hash -> the workers predicted to hold it, with when each prediction expires.
    by_hash: HashMap<i64, Vec<(Arc<str>, Instant)>>,
    entries: usize,
    next_sweep: Instant,
}

impl Predictions {
    pub fn new(max_entries: usize, max_ttl: Duration) -> Predictions {
        Predictions {
            table: Mutex::new(Table {
                by_hash: HashMap::new(),
                entries: 0,
                next_sweep: Instant::now() + SWEEP_EVERY,
            }),
            max_entries,
            max_ttl,
        }
    }

    /// Records that `worker` will hold `hashes` for `ttl` (cut to the maximum) from `now`;
    /// returns how many were recorded (fewer when the table is full).
    pub fn predict(&self, worker: &str, hashes: &[i64], ttl: Duration, now: Instant) -> usize {
        let expires = now + ttl.min(self.max_ttl);
        let worker: Arc<str> = Arc::from(worker);
        let mut table = self.table.lock();
        if now >= table.next_sweep {
            table.sweep(now);
        }
        let mut recorded = 0;
        for &hash in hashes {
            let full = table.entries >= self.max_entries;
            let holders = table.by_hash.entry(hash).or_default();
            if let Some(entry) = holders.iter_mut().find(|(w, _)| **w == *worker) {
                entry.1 = entry.1.max(expires);
            } else if full {
                if holders.is_empty() {
                    table.by_hash.remove(&hash);
                }
                break;
            } else {
                holders.push((worker.clone(), expires));
                table.entries += 1;
            }
            recorded += 1;
        }
        recorded
    }

    /// The worker's own events for `hashes` arrived: its predictions of them are dropped.
    pub fn forget(&self, worker: &str, hashes: impl IntoIterator<Item = i64>) {
        let mut table = self.table.lock();
        if table.entries == 0 {
            return;
        }
        for hash in hashes {
            let Some(holders) = table.by_hash.get_mut(&hash) else {
                continue;
            };
            let before = holders.len();
            holders.retain(|(w, _)| **w != *worker);
            let removed = before - holders.len();
            if holders.is_empty() {
                table.by_hash.remove(&hash);
            }
            table.entries -= removed;
        }
    }

    /// For a prompt's `hashes` and each worker's confirmed prefix (`confirmed`, by address;
    /// absent: 0), the workers whose predicted prefix is longer, with its length, longest
    /// first (then by address).
    pub fn extend<'a>(
        &self,
        hashes: &[i64],
        confirmed: impl Iterator<Item = (&'a str, u32)>,
        now: Instant,
    ) -> Vec<(String, u32)> {
        let table = self.table.lock();
        if table.entries == 0 || hashes.is_empty() {
            return Vec::new();
        }
        let holds = |hash: i64, worker: &str| {
            table.by_hash.get(&hash).is_some_and(|holders| {
                holders
                    .iter()
                    .any(|(w, expires)| &**w == worker && *expires > now)
            })
        };
        let mut starts: Vec<(&str, usize)> = confirmed
            .map(|(worker, blocks)| (worker, blocks as usize))
            .collect();
        for (worker, expires) in table.by_hash.get(&hashes[0]).into_iter().flatten() {
            if *expires > now && !starts.iter().any(|(w, _)| *w == &**worker) {
                starts.push((worker, 0));
            }
        }
        let mut out: Vec<(String, u32)> = starts
            .into_iter()
            .filter_map(|(worker, from)| {
                let mut end = from;
                while end < hashes.len() && holds(hashes[end], worker) {
                    end += 1;
                }
                (end > from).then(|| (worker.to_string(), u32::try_from(end).unwrap_or(u32::MAX)))
            })
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    /// Block-worker pairs held (expired ones until the next sweep included).
    pub fn len(&self) -> usize {
        self.table.lock().entries
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Table {
    fn sweep(&mut self, now: Instant) {
        let mut removed = 0;
        self.by_hash.retain(|_, holders| {
            let before = holders.len();
            holders.retain(|(_, expires)| *expires > now);
            removed += before - holders.len();
            !holders.is_empty()
        });
        self.entries -= removed;
        self.next_sweep = now + SWEEP_EVERY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_prediction_extends_a_confirmed_prefix_and_never_outlives_its_ttl() {
        let p = Predictions::new(100, ms(10_000));
        let t0 = Instant::now();
        assert_eq!(p.predict("a", &[1, 2, 3, 4], ms(200), t0), 4);
        // b holds 1, 2 for sure, and nothing is predicted for it: not listed.
        let confirmed = [("b", 2)];
        assert_eq!(
            p.extend(&[1, 2, 3, 4, 5], confirmed.into_iter(), t0),
            [("a".into(), 4)]
        );
        // a's confirmed prefix is 3: its prediction still reaches 4.
        assert_eq!(
            p.extend(&[1, 2, 3, 4], [("a", 3)].into_iter(), t0 + ms(199)),
            [("a".into(), 4)]
        );
        // Confirmed as long as predicted: nothing to add.
        assert!(
            p.extend(&[1, 2, 3, 4], [("a", 4)].into_iter(), t0)
                .is_empty()
        );
        // At the TTL it is gone, for reads at once and from the table at the next sweep.
        assert!(
            p.extend(&[1, 2, 3, 4], std::iter::empty(), t0 + ms(200))
                .is_empty()
        );
        p.predict("c", &[9], ms(1), t0 + SWEEP_EVERY + ms(1));
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn the_ttl_is_cut_to_the_maximum_and_a_repeat_refreshes_it() {
        let p = Predictions::new(100, ms(500));
        let t0 = Instant::now();
        p.predict("a", &[1], ms(60_000), t0);
        assert!(p.extend(&[1], std::iter::empty(), t0 + ms(500)).is_empty());
        p.predict("a", &[2], ms(100), t0);
        p.predict("a", &[2], ms(300), t0 + ms(100));
        assert_eq!(p.len(), 2);
        let at = |t| p.extend(&[2], std::iter::empty(), t0 + ms(t));
        assert_eq!(at(399), [("a".into(), 1)]);
        assert!(at(400).is_empty());
    }

    #[test]
    fn the_workers_own_events_replace_its_predictions() {
        let p = Predictions::new(100, ms(10_000));
        let t0 = Instant::now();
        p.predict("a", &[1, 2, 3], ms(1000), t0);
        p.predict("b", &[1, 2], ms(1000), t0);
        p.forget("a", [2]);
        assert_eq!(p.len(), 4);
        // a's chain stops at the forgotten block; longest first.
        let answer = p.extend(&[1, 2, 3], std::iter::empty(), t0);
        assert_eq!(answer, [("b".into(), 2), ("a".into(), 1)]);
    }

    #[test]
    fn a_full_table_records_a_prefix_of_the_prompt_and_says_how_much() {
        let p = Predictions::new(3, ms(10_000));
        let t0 = Instant::now();
        assert_eq!(p.predict("a", &[1, 2], ms(1000), t0), 2);
        assert_eq!(p.predict("b", &[1, 2, 3], ms(1000), t0), 1);
        assert_eq!(p.len(), 3);
        // A refresh of what is held still counts.
        assert_eq!(p.predict("a", &[1, 2], ms(1000), t0), 2);
    }
}
