//! Choosing a worker for a request: `cache_aware` on a prefix source (the Indexer, the local
//! radix tree, or, in benchmarks, the workers' own cache views), `round_robin`, `random` and
//! `power_of_two`. Every Indexer failure falls back to load: losing the Indexer costs cache
//! affinity, never availability.
//!
//! `cache_aware`, in order (the rules are [`crate::selection`]'s):
//! 1. the usable exact match (tier-weighted) with the longest prefix, near-ties by load;
//! 2. else, with conversation affinity on, the worker the local radix tree last sent this
//!    prompt's longest prefix to (where the conversation went before);
//! 3. else the least loaded worker (prefill pressure first).
//!
//! A choice made on cache in 1 or 2 gives way to the least loaded worker when the pressure
//! guard says it is materially more loaded.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kv_indexer_client::BlockHasher;
use kv_indexer_client::{IndexerClient, PrefixMatch, PrefixOutcome};
use parking_lot::{Mutex, RwLock};
use rand::Rng;
use rand::seq::IndexedRandom;
use tracing::{info, warn};

use crate::observe::IndexerMetrics;
use crate::oracle;
use crate::radix::RadixTree;
use crate::selection::{Candidate, Selection};
use crate::throttle::DoublingLogs;
use crate::workers::Workers;

/// Why a worker was chosen: a metrics label and part of the routing log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The longest usable exact match (the Indexer's or the workers' own).
    CacheHit,
    /// The longest usable match counted a prefix the Indexer only predicts (another router
    /// sent this prompt's prefix there, and the worker has not reported it yet).
    PredictedHit,
    /// No usable exact match: where the radix tree sent this prompt's prefix before.
    Affinity,
    /// The cache choice was materially more loaded than the least loaded worker.
    PressureGuard,
    /// The cache choice held many more active requests than the mean (the balance guard).
    Balance,
    /// The exact source answered, but no healthy worker holds a usable prefix.
    NoUsableMatch,
    /// The Indexer could not answer (the outcome's label says why).
    IndexerFallback(&'static str),
    /// The block size is not known yet (no worker's `/server_info` answered).
    HashingUnknown,
    /// The local radix tree's longest match (the tree as the only source).
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
            Reason::PredictedHit => "predicted_hit",
            Reason::Affinity => "affinity",
            Reason::PressureGuard => "pressure_guard",
            Reason::Balance => "balance",
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
    /// Reusable tokens on the chosen worker: its matched blocks times the block size, at most
    /// the prompt (tier-weighted for sources that know tiers; the radix tree's own count).
    pub matched_tokens: usize,
}

/// The outcomes of a prefix query that route by load ([`Reason::IndexerFallback`]).
const FALLBACKS: [PrefixOutcome; 4] = [
    PrefixOutcome::Unreachable,
    PrefixOutcome::Timeout,
    PrefixOutcome::Overloaded,
    PrefixOutcome::TooLarge,
];

/// Every outcome of a prefix query, as metrics labels: the series of
/// `kv_router_indexer_queries_total` exported from start.
pub fn query_outcomes() -> Vec<&'static str> {
    let answered = [
        PrefixOutcome::Matched {
            matches: Vec::new(),
            best_prefix_blocks: 0,
            query_blocks: 0,
            blocks_read: 0,
        },
        PrefixOutcome::NoMatch,
        PrefixOutcome::Rejected {
            code: tonic::Code::Unknown,
            message: String::new(),
        },
    ];
    answered
        .iter()
        .chain(&FALLBACKS)
        .map(PrefixOutcome::label)
        .collect()
}

/// The Indexer could not be used and the request must fail: the two sides disagree on the
/// contract (any status the contract does not list).
#[derive(Debug, thiserror::Error)]
#[error("the indexer rejected the query with {code:?}: {message}")]
pub struct Rejected {
    pub code: tonic::Code,
    pub message: String,
}

/// Where `cache_aware` learns which worker holds what.
pub enum PrefixSource {
    /// The Indexer's longest-prefix answer (no tiers: every matched block counts as HBM), with
    /// its predictions when `prediction_ttl` is set: each decision is then sent to the Indexer
    /// as a prediction that lives that long.
    Indexer {
        client: Arc<IndexerClient>,
        metrics: IndexerMetrics,
        prediction_ttl: Option<Duration>,
    },
    /// Each worker's own view (`POST /cache_prefix`, served by `kv-indexer-sim`): perfect,
    /// instant knowledge, the ceiling benchmarks measure the Indexer against.
    Oracle { http: reqwest::Client },
    /// The local radix tree of prompts routed so far.
    Radix,
}

pub struct CacheAware {
    pub source: PrefixSource,
    /// Learned from the first worker's `/server_info` (the exact sources hash with it).
    pub hashing: Arc<RwLock<Option<BlockHasher>>>,
    /// The radix tree: the source itself for [`PrefixSource::Radix`], else the conversation
    /// affinity signal (`None`: affinity off).
    pub tree: Option<Mutex<RadixTree>>,
    pub selection: Selection,
    /// The least loaded worker is picked among this many drawn at random (0: all).
    pub min_load_choices: usize,
    /// A request with no usable match draws among the workers within this many tokens of
    /// prefill pressure of the lowest (`None`: the lowest); the guards' backup never draws.
    pub load_tie_tokens: Option<usize>,
    pub logs: DoublingLogs,
}

pub enum Policy {
    CacheAware(Box<CacheAware>),
    RoundRobin(AtomicUsize),
    Random,
    PowerOfTwo,
}

impl Policy {
    /// Every reason this policy can give, as metrics labels: the series of
    /// `kv_router_decisions_total` exported from start.
    pub fn reasons(&self) -> Vec<&'static str> {
        let reasons = match self {
            Policy::RoundRobin(_) => vec![Reason::RoundRobin],
            Policy::Random => vec![Reason::Random],
            Policy::PowerOfTwo => vec![Reason::PowerOfTwo],
            Policy::CacheAware(policy) => {
                let mut reasons = match policy.source {
                    PrefixSource::Radix => vec![Reason::RadixHit, Reason::RadixMiss],
                    PrefixSource::Oracle { .. } => vec![
                        Reason::CacheHit,
                        Reason::NoUsableMatch,
                        Reason::HashingUnknown,
                    ],
                    PrefixSource::Indexer { .. } => [
                        Reason::CacheHit,
                        Reason::PredictedHit,
                        Reason::NoUsableMatch,
                        Reason::HashingUnknown,
                    ]
                    .into_iter()
                    .chain(FALLBACKS.map(|outcome| Reason::IndexerFallback(outcome.label())))
                    .collect(),
                };
                if policy.tree.is_some() && !matches!(policy.source, PrefixSource::Radix) {
                    reasons.push(Reason::Affinity);
                }
                if policy.selection.pressure_abs_threshold_tokens.is_some() {
                    reasons.push(Reason::PressureGuard);
                }
                if policy.selection.balance_abs_threshold.is_some() {
                    reasons.push(Reason::Balance);
                }
                reasons
            }
        };
        reasons.into_iter().map(Reason::label).collect()
    }

    /// Chooses among the routable workers for a prompt of `tokens`. `None` when no worker is
    /// routable.
    pub async fn choose(
        &self,
        workers: &Workers,
        tokens: &[u64],
    ) -> Result<Option<Decision>, Rejected> {
        let routable = workers.routable();
        if routable.is_empty() {
            return Ok(None);
        }
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
            Policy::CacheAware(policy) => policy.choose(workers, &routable, tokens).await?,
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

/// The less loaded (in active requests) of two routable workers drawn at random.
fn power_of_two(workers: &Workers, routable: &[usize]) -> Decision {
    let mut rng = rand::rng();
    let a = routable[rng.random_range(0..routable.len())];
    let b = routable[rng.random_range(0..routable.len())];
    let active = |w: usize| workers.list[w].load().active;
    let chosen = if active(b) < active(a) { b } else { a };
    Decision::plain(chosen, Reason::PowerOfTwo)
}

/// What the exact source said about one prompt.
struct Exact {
    candidates: Vec<Candidate>,
    /// The reason when no candidate is usable.
    miss: Reason,
    matched_blocks: Vec<(usize, u32)>,
    query_blocks: usize,
    /// Workers whose candidate counts predicted blocks.
    predicted: Vec<usize>,
    /// The prompt's block hashes, when the decision is to be sent as a prediction.
    to_predict: Vec<i64>,
}

impl Exact {
    fn none(miss: Reason) -> Exact {
        Exact {
            candidates: Vec::new(),
            miss,
            matched_blocks: Vec::new(),
            query_blocks: 0,
            predicted: Vec::new(),
            to_predict: Vec::new(),
        }
    }
}

impl CacheAware {
    async fn choose(
        &self,
        workers: &Workers,
        routable: &[usize],
        tokens: &[u64],
    ) -> Result<Decision, Rejected> {
        let exact = match &self.source {
            PrefixSource::Radix => self.radix_candidates(workers, tokens),
            source => self.exact(source, workers, routable, tokens).await?,
        };
        let load = |w: usize| workers.list[w].load();
        let pool = self.load_pool(routable);
        // The guards' backup is the least loaded worker itself: a hot prefix's second home is
        // chosen on load alone (drawing it among near ties spread the load worse, measured).
        let backup = workers.least_loaded(&pool).expect("routable is not empty");
        let matched_on = |w: usize| {
            exact
                .candidates
                .iter()
                .find(|c| c.worker == w)
                .map_or(0, |c| c.matched_tokens)
        };
        let hit = |worker: usize| match self.source {
            PrefixSource::Radix => Reason::RadixHit,
            _ if exact.predicted.contains(&worker) => Reason::PredictedHit,
            _ => Reason::CacheHit,
        };
        let primary = match self
            .selection
            .primary(&exact.candidates, tokens.len(), load)
        {
            Some(candidate) => Some((candidate.worker, hit(candidate.worker))),
            None => self
                .affinity(workers, tokens)
                .map(|w| (w, Reason::Affinity)),
        };
        let (worker, reason) = match primary {
            Some((worker, _)) if self.unbalanced(workers, routable, worker) => {
                (backup, Reason::Balance)
            }
            Some((worker, _))
                if self.selection.guard(
                    (load(worker), matched_on(worker)),
                    (load(backup), matched_on(backup)),
                ) =>
            {
                (backup, Reason::PressureGuard)
            }
            Some(chosen) => chosen,
            None => {
                if let Some(total) = self.logs.no_usable_match.record()
                    && exact.miss == Reason::NoUsableMatch
                {
                    // A new prompt has no match: ordinary, not a warning.
                    info!(total, "no usable cache match; routing by load");
                }
                (self.by_load(workers, &pool, backup), exact.miss)
            }
        };
        if let Some(tree) = &self.tree {
            tree.lock().insert(tokens, worker);
        }
        let decision = Decision {
            worker,
            reason,
            matched_blocks: exact
                .matched_blocks
                .iter()
                .find(|(w, _)| *w == worker)
                .map_or(0, |(_, blocks)| *blocks),
            query_blocks: exact.query_blocks,
            matched_tokens: matched_on(worker),
        };
        self.send_prediction(workers, worker, exact.to_predict);
        Ok(decision)
    }

    /// Whether the balance guard moves a request off `worker` (its active requests against
    /// the routable workers' mean).
    fn unbalanced(&self, workers: &Workers, routable: &[usize], worker: usize) -> bool {
        if self.selection.balance_abs_threshold.is_none() {
            return false;
        }
        let total: usize = routable
            .iter()
            .map(|&w| workers.list[w].load().active)
            .sum();
        let mean = total as f64 / routable.len() as f64;
        self.selection
            .unbalanced(workers.list[worker].load().active, mean)
    }

    /// Tells the Indexer, in the background, that `worker` will hold the prompt's blocks
    /// (`hashes`; none: nothing to tell).
    fn send_prediction(&self, workers: &Workers, worker: usize, hashes: Vec<i64>) {
        let PrefixSource::Indexer {
            client,
            prediction_ttl: Some(ttl),
            ..
        } = &self.source
        else {
            return;
        };
        if hashes.is_empty() {
            return;
        }
        let (client, ttl, url) = (client.clone(), *ttl, workers.list[worker].url.clone());
        tokio::spawn(async move {
            // A lost prediction costs a sibling's hit at most; the query path logs outages.
            let _ = client.predict(&url, &hashes, ttl).await;
        });
    }

    /// The workers routing by load chooses among: `min_load_choices` drawn at random when
    /// set, else every routable one.
    fn load_pool(&self, routable: &[usize]) -> Vec<usize> {
        if self.min_load_choices == 0 || self.min_load_choices >= routable.len() {
            routable.to_vec()
        } else {
            routable
                .choose_multiple(&mut rand::rng(), self.min_load_choices)
                .copied()
                .collect()
        }
    }

    /// Where a request with no usable match goes: `least` (the least loaded of `pool`), or
    /// with `load_tie_tokens` one drawn among the nearly least loaded of `pool`.
    fn by_load(&self, workers: &Workers, pool: &[usize], least: usize) -> usize {
        self.load_tie_tokens
            .and_then(|margin| workers.near_least_loaded(pool, margin, &mut rand::rng()))
            .unwrap_or(least)
    }

    /// The radix tree as the source: its longest match, every holder a candidate.
    fn radix_candidates(&self, workers: &Workers, tokens: &[u64]) -> Exact {
        let tree = self.tree.as_ref().expect("the radix source has its tree");
        let (matched, holders) = tree
            .lock()
            .longest_match(tokens, |w| workers.list[w].is_routable());
        Exact {
            candidates: holders
                .into_iter()
                .map(|worker| Candidate {
                    worker,
                    matched_tokens: matched,
                })
                .collect(),
            ..Exact::none(Reason::RadixMiss)
        }
    }

    /// Conversation affinity: the least loaded of the workers the tree last sent this
    /// prompt's longest (usable) prefix to, when the exact source is not the tree itself.
    fn affinity(&self, workers: &Workers, tokens: &[u64]) -> Option<usize> {
        if matches!(self.source, PrefixSource::Radix) {
            return None;
        }
        let (matched, holders) = self
            .tree
            .as_ref()?
            .lock()
            .longest_match(tokens, |w| workers.list[w].is_routable());
        if !self.selection.usable(matched, tokens.len()) {
            return None;
        }
        workers.least_loaded(&holders)
    }

    /// Asks the Indexer or the workers.
    async fn exact(
        &self,
        source: &PrefixSource,
        workers: &Workers,
        routable: &[usize],
        tokens: &[u64],
    ) -> Result<Exact, Rejected> {
        let Some(config) = *self.hashing.read() else {
            return Ok(Exact::none(Reason::HashingUnknown));
        };
        let hashes = config.block_hashes(tokens, None);
        match source {
            PrefixSource::Indexer {
                client,
                metrics,
                prediction_ttl,
            } => {
                let start = Instant::now();
                let (outcome, predicted) = match prediction_ttl {
                    Some(_) => client.longest_prefix_with_predictions(&hashes).await,
                    None => (client.longest_prefix(&hashes).await, Vec::new()),
                };
                metrics.query(outcome.label(), start.elapsed().as_secs_f64());
                let asked = Asked {
                    prompt_tokens: tokens.len(),
                    block_size: config.block_size(),
                    hashed_blocks: hashes.len(),
                };
                let mut exact = self.indexer_answer(workers, asked, outcome)?;
                self.add_predicted(&mut exact, workers, asked, predicted);
                // Only an Indexer that answered is told (an outage would fail each one again).
                if prediction_ttl.is_some() && !matches!(exact.miss, Reason::IndexerFallback(_)) {
                    exact.to_predict = hashes;
                }
                Ok(exact)
            }
            PrefixSource::Oracle { http } => {
                let views = oracle::cached_prefixes(http, workers, routable, &hashes).await;
                let candidates = views
                    .into_iter()
                    .map(|(worker, prefix)| Candidate {
                        worker,
                        matched_tokens: self
                            .selection
                            .weights
                            .weigh(
                                prefix.device_pages * config.block_size(),
                                prefix.host_pages * config.block_size(),
                            )
                            .min(tokens.len()),
                    })
                    .collect();
                Ok(Exact {
                    candidates,
                    query_blocks: hashes.len(),
                    ..Exact::none(Reason::NoUsableMatch)
                })
            }
            PrefixSource::Radix => unreachable!("the radix tree is not an exact source"),
        }
    }

    /// The Indexer's outcome as candidates, for routable workers whose URL is the answer's
    /// address byte for byte: matched tokens = matched blocks × block size, at most the prompt
    /// (a matched last block may be partial). Exact, where the upstream router's estimate
    /// (prompt tokens × matched blocks ÷ query blocks) is off by up to a block.
    fn indexer_answer(
        &self,
        workers: &Workers,
        asked: Asked,
        outcome: PrefixOutcome,
    ) -> Result<Exact, Rejected> {
        let (matches, query_blocks): (Vec<PrefixMatch>, usize) = match outcome {
            PrefixOutcome::Matched {
                matches,
                query_blocks,
                ..
            } => (matches, query_blocks),
            PrefixOutcome::NoMatch => (Vec::new(), asked.hashed_blocks),
            PrefixOutcome::Rejected { code, message } => return Err(Rejected { code, message }),
            other => {
                let label = other.label();
                if let Some(total) = self.logs.fallback.record() {
                    warn!(outcome = label, total, "indexer unusable; routing by load");
                }
                return Ok(Exact::none(Reason::IndexerFallback(label)));
            }
        };
        let mut exact = Exact {
            query_blocks,
            ..Exact::none(Reason::NoUsableMatch)
        };
        for m in matches {
            let Some(worker) = workers.by_url(&m.worker_address) else {
                metrics::counter!("kv_router_indexer_unknown_addresses_total").increment(1);
                if let Some(total) = self.logs.unknown_address.record() {
                    let urls: Vec<&str> = workers.list.iter().map(|w| w.url.as_str()).collect();
                    warn!(address = %m.worker_address, worker_urls = ?urls, total, "indexer names an address that matches none of this router's worker URLs (compared byte for byte): the worker's KV_INDEXER_WORKER_ADDRESS must equal its URL here, or its cache is never used");
                }
                continue;
            };
            // Per worker: one whose cache is never named while others' are has a hashing
            // mismatch (scheme, seed, block size, tokenizer): alert KvRouterWorkerNeverMatched.
            workers.list[worker].indexer_matches.increment(1);
            if !workers.list[worker].is_routable() {
                continue;
            }
            let blocks = m.matched_prefix_blocks.min(query_blocks as u32);
            exact.matched_blocks.push((worker, blocks));
            exact.candidates.push(Candidate {
                worker,
                matched_tokens: (blocks as usize)
                    .saturating_mul(asked.block_size)
                    .min(asked.prompt_tokens),
            });
        }
        Ok(exact)
    }
}

impl CacheAware {
    /// Raises each routable worker's candidate by the blocks the Indexer predicts beyond its
    /// confirmed prefix, weighted below confirmed ones (`TierWeights::predicted`).
    fn add_predicted(
        &self,
        exact: &mut Exact,
        workers: &Workers,
        asked: Asked,
        predicted: Vec<PrefixMatch>,
    ) {
        for m in predicted {
            let Some(worker) = workers.by_url(&m.worker_address) else {
                continue;
            };
            if !workers.list[worker].is_routable() {
                continue;
            }
            let tokens = (m.matched_prefix_blocks as usize)
                .saturating_mul(asked.block_size)
                .min(asked.prompt_tokens);
            let at = exact.candidates.iter().position(|c| c.worker == worker);
            let confirmed = at.map_or(0, |i| exact.candidates[i].matched_tokens);
            let weighted = self.selection.weights.weigh_predicted(confirmed, tokens);
            if weighted <= confirmed {
                continue;
            }
            exact.predicted.push(worker);
            match at {
                Some(i) => exact.candidates[i].matched_tokens = weighted,
                None => exact.candidates.push(Candidate {
                    worker,
                    matched_tokens: weighted,
                }),
            }
        }
    }
}

/// What a prefix query to the Indexer asked.
#[derive(Debug, Clone, Copy)]
struct Asked {
    prompt_tokens: usize,
    block_size: usize,
    /// The prompt's blocks (the last one may be partial).
    hashed_blocks: usize,
}
