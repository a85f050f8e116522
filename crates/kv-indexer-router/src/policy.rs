//! Choosing a worker for a request: `cache_aware` on the Indexer or on the local radix tree,
//! `round_robin`, `random` and `power_of_two`. Every Indexer failure falls back to the least
//! loaded worker: losing the Indexer costs cache affinity, never availability.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kv_indexer_client::hashing::{HashConfig, block_hashes};
use kv_indexer_client::{IndexerClient, PrefixMatch, PrefixOutcome};
use parking_lot::{Mutex, RwLock};
use rand::Rng;
use tracing::warn;

use crate::observe::IndexerMetrics;
use crate::radix::RadixTree;
use crate::throttle::DoublingLogs;
use crate::workers::Workers;

/// Why a worker was chosen: a metrics label and part of the routing log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The longest usable Indexer match.
    CacheHit,
    /// The Indexer answered, but no healthy worker holds a usable prefix.
    NoUsableMatch,
    /// The Indexer could not answer (the outcome's label says why).
    IndexerFallback(&'static str),
    /// The block size is not known yet (no worker's `/server_info` answered).
    HashingUnknown,
    /// The local radix tree's longest match.
    RadixHit,
    RadixMiss,
    RoundRobin,
    Random,
    PowerOfTwo,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::CacheHit => "cache_hit",
            Reason::NoUsableMatch => "no_usable_match",
            Reason::IndexerFallback(outcome) => outcome,
            Reason::HashingUnknown => "hashing_unknown",
            Reason::RadixHit => "radix_hit",
            Reason::RadixMiss => "radix_miss",
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::PowerOfTwo => "power_of_two",
        }
    }
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub worker: usize,
    pub reason: Reason,
    /// Blocks the chosen worker holds, as the Indexer said (0 otherwise).
    pub matched_blocks: u32,
    /// Blocks in the query.
    pub query_blocks: usize,
    /// Estimated reusable tokens on the chosen worker.
    pub matched_tokens: usize,
}

/// The Indexer could not be used and the request must fail: the two sides disagree on the
/// contract (any status the contract does not list).
#[derive(Debug, thiserror::Error)]
#[error("the indexer rejected the query with {code:?}: {message}")]
pub struct Rejected {
    pub code: tonic::Code,
    pub message: String,
}

pub enum Policy {
    CacheAwareIndexer {
        client: IndexerClient,
        /// Learned from the first worker's `/server_info`.
        hashing: Arc<RwLock<Option<HashConfig>>>,
        min_matched_tokens: usize,
        logs: DoublingLogs,
        metrics: IndexerMetrics,
    },
    CacheAwareRadix {
        tree: Mutex<RadixTree>,
        min_matched_tokens: usize,
    },
    RoundRobin(AtomicUsize),
    Random,
    PowerOfTwo,
}

impl Policy {
    /// Chooses among the routable workers for a prompt of `tokens`. `None` when no worker is
    /// routable.
    pub async fn choose(
        &self,
        workers: &Workers,
        tokens: &[u64],
    ) -> Result<Option<Decision>, Rejected> {
        let routable = workers.routable();
        let Some(least) = workers.least_loaded(&routable) else {
            return Ok(None);
        };
        let decision = match self {
            Policy::RoundRobin(next) => {
                let i = next.fetch_add(1, Ordering::Relaxed);
                Decision::plain(routable[i % routable.len()], Reason::RoundRobin)
            }
            Policy::Random => Decision::plain(
                routable[rand::rng().random_range(0..routable.len())],
                Reason::Random,
            ),
            Policy::PowerOfTwo => power_of_two(workers, &routable),
            Policy::CacheAwareRadix {
                tree,
                min_matched_tokens,
            } => radix(workers, tree, *min_matched_tokens, tokens, least),
            Policy::CacheAwareIndexer {
                client,
                hashing,
                min_matched_tokens,
                logs,
                metrics,
            } => {
                let Some(config) = *hashing.read() else {
                    return Ok(Some(Decision::plain(least, Reason::HashingUnknown)));
                };
                let hashes = block_hashes(tokens, config, None);
                let start = Instant::now();
                let outcome = client.longest_prefix(&hashes).await;
                metrics.query(outcome.label(), start.elapsed().as_secs_f64());
                let answer = IndexerAnswer {
                    workers,
                    tokens,
                    query_blocks: hashes.len(),
                    least,
                    min_matched_tokens: *min_matched_tokens,
                    logs,
                };
                answer.decide(outcome)?
            }
        };
        Ok(Some(decision))
    }
}

impl Decision {
    /// A decision that owes nothing to a cache.
    fn plain(worker: usize, reason: Reason) -> Decision {
        Decision {
            worker,
            reason,
            matched_blocks: 0,
            query_blocks: 0,
            matched_tokens: 0,
        }
    }
}

/// The less loaded of two routable workers drawn at random.
fn power_of_two(workers: &Workers, routable: &[usize]) -> Decision {
    let mut rng = rand::rng();
    let a = routable[rng.random_range(0..routable.len())];
    let b = routable[rng.random_range(0..routable.len())];
    let chosen = if workers.list[b].active() < workers.list[a].active() {
        b
    } else {
        a
    };
    Decision::plain(chosen, Reason::PowerOfTwo)
}

/// The local radix tree's longest usable match, else `least`; the prompt is then remembered
/// for the chosen worker.
fn radix(
    workers: &Workers,
    tree: &Mutex<RadixTree>,
    min_matched_tokens: usize,
    tokens: &[u64],
    least: usize,
) -> Decision {
    let mut tree = tree.lock();
    let (matched, holders) = tree.longest_match(tokens, |w| workers.list[w].is_routable());
    // As with the Indexer: the longest usable match wins, ties by load.
    let decision = match workers.least_loaded(&holders) {
        Some(worker) if matched > 0 && matched >= min_matched_tokens => Decision {
            worker,
            reason: Reason::RadixHit,
            matched_blocks: 0,
            query_blocks: 0,
            matched_tokens: matched,
        },
        _ => Decision::plain(least, Reason::RadixMiss),
    };
    tree.insert(tokens, decision.worker);
    decision
}

/// What turns the Indexer's outcome for one prompt into a decision.
struct IndexerAnswer<'a> {
    workers: &'a Workers,
    tokens: &'a [u64],
    /// Blocks in the query as hashed (the outcome may report its own count).
    query_blocks: usize,
    least: usize,
    min_matched_tokens: usize,
    logs: &'a DoublingLogs,
}

impl IndexerAnswer<'_> {
    fn decide(&self, outcome: PrefixOutcome) -> Result<Decision, Rejected> {
        Ok(match outcome {
            PrefixOutcome::Matched {
                matches,
                query_blocks,
                ..
            } => self.matched(&matches, query_blocks),
            PrefixOutcome::NoMatch => self.no_usable_match(self.query_blocks),
            PrefixOutcome::Rejected { code, message } => {
                return Err(Rejected { code, message });
            }
            other => {
                let label = other.label();
                if let Some(total) = self.logs.fallback.record() {
                    warn!(outcome = label, total, "indexer unusable; routing by load");
                }
                Decision::plain(self.least, Reason::IndexerFallback(label))
            }
        })
    }

    /// The longest usable match among routable workers, else by load.
    fn matched(&self, matches: &[PrefixMatch], query_blocks: usize) -> Decision {
        let usable = self.best(matches, query_blocks).map(|(blocks, worker)| {
            let matched_tokens = self.tokens.len() * blocks as usize / query_blocks.max(1);
            (blocks, worker, matched_tokens)
        });
        match usable {
            Some((blocks, worker, matched_tokens))
                if matched_tokens >= self.min_matched_tokens && blocks > 0 =>
            {
                Decision {
                    worker,
                    reason: Reason::CacheHit,
                    matched_blocks: blocks,
                    query_blocks,
                    matched_tokens,
                }
            }
            _ => self.no_usable_match(query_blocks),
        }
    }

    /// The routable worker with the longest match (capped at the query), ties by lower load:
    /// `(matched blocks, worker)`.
    fn best(&self, matches: &[PrefixMatch], query_blocks: usize) -> Option<(u32, usize)> {
        let workers = self.workers;
        let mut best: Option<(u32, usize)> = None;
        for m in matches {
            let Some(worker) = workers.by_url(&m.worker_address) else {
                if let Some(total) = self.logs.unknown_address.record() {
                    warn!(address = %m.worker_address, total, "indexer names an address that matches no worker URL (compared byte for byte)");
                }
                continue;
            };
            if !workers.list[worker].is_routable() {
                continue;
            }
            let blocks = m.matched_prefix_blocks.min(query_blocks as u32);
            let better = match best {
                None => true,
                Some((b, w)) => {
                    blocks > b
                        || (blocks == b && workers.list[worker].active() < workers.list[w].active())
                }
            };
            if better {
                best = Some((blocks, worker));
            }
        }
        best
    }

    fn no_usable_match(&self, query_blocks: usize) -> Decision {
        if let Some(total) = self.logs.no_usable_match.record() {
            warn!(total, "indexer found no usable match; routing by load");
        }
        Decision {
            query_blocks,
            ..Decision::plain(self.least, Reason::NoUsableMatch)
        }
    }
}
