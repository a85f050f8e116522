//! The answer check: for every steady-state query, the workers each index credits and the
//! prefix length it credits them with, as sorted `(fleet worker, matched pages)` pairs.

use std::collections::HashMap;

use dynamo_kv_router::protocols::OverlapScores;
use kv_index::PrefixAnswer;

use crate::peer;

/// A query's answer, comparable across the indexes.
pub type Matches = Vec<(usize, u32)>;

/// Maps both indexes' worker names to fleet workers.
pub struct Workers {
    by_name: HashMap<String, usize>,
    by_id: HashMap<u64, usize>,
}

impl Workers {
    pub fn new(ids: &[String]) -> Workers {
        Workers {
            by_name: ids
                .iter()
                .enumerate()
                .map(|(w, id)| (id.clone(), w))
                .collect(),
            by_id: (0..ids.len()).map(|w| (peer::worker_id(w), w)).collect(),
        }
    }

    pub fn ours(&self, answer: &PrefixAnswer) -> Matches {
        let mut matches: Matches = answer
            .matches
            .iter()
            .map(|m| (self.by_name[&m.worker_id], m.matched_prefix_blocks))
            .collect();
        matches.sort_unstable();
        matches
    }

    pub fn peer(&self, scores: &OverlapScores) -> Matches {
        let mut matches: Matches = scores
            .scores
            .iter()
            .map(|(worker, &depth)| (self.by_id[&worker.worker_id], depth))
            .collect();
        matches.sort_unstable();
        matches
    }
}

/// What the check found over all queries.
#[derive(Default)]
pub struct Check {
    pub queries: usize,
    /// Workers in kv-index's answers, over all queries.
    pub credited: usize,
    /// Queries whose answers differ.
    pub mismatched: usize,
    /// Workers credited differently (missing on one side or another length), over all queries.
    pub worker_differences: usize,
    /// The first mismatching query, for the report.
    pub first: Option<(usize, Matches, Matches)>,
}

impl Check {
    pub fn record(&mut self, request: usize, ours: Matches, peer: Matches) {
        self.queries += 1;
        self.credited += ours.len();
        if ours == peer {
            return;
        }
        self.mismatched += 1;
        let theirs: HashMap<usize, u32> = peer.iter().copied().collect();
        let mine: HashMap<usize, u32> = ours.iter().copied().collect();
        self.worker_differences += ours
            .iter()
            .filter(|(w, len)| theirs.get(w) != Some(len))
            .count()
            + peer.iter().filter(|(w, _)| !mine.contains_key(w)).count();
        if self.first.is_none() {
            self.first = Some((request, ours, peer));
        }
    }
}
