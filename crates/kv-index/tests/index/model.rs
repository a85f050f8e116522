//! Model-based test: random sequences of operations are applied both to `kv_index::Index` and
//! to a deliberately naive reference model (`model/reference.rs`, written from the contract and
//! the documented decisions only), and every answer, error and `stats()` must be identical after
//! every operation.
//!
//! Chain hints (`parent_block_hash`) only steer how the index stores hashes, never an answer. So
//! every case runs three indexes against the one model: one fed the requests as generated (true
//! hints on long chains delivered in pieces, random and lying ones elsewhere), one fed them with
//! every hint stripped, and one where every REPORT claims to continue the previous REPORT (true
//! for a chain delivered in pieces, a lie otherwise). Each index also checks its own internal
//! invariants after every step.
//!
//! The first index records its changes' effects ([`Index::apply_recording`], and every other
//! table rebuild before the change with [`Index::install_table_recording`]), and its twin
//! ([`Index::twin`], sharing its block table) replays them ([`Index::replay_apply`],
//! [`Index::replay_table`]), catching up every few steps, as a left-right cell's other copy
//! does. Before each catch-up the twin, behind, must still find each of its live blocks through
//! the table the first index has gone on filling (what a reader of the published copy relies
//! on); after it the two must be equal.
//!
//! The case count defaults to 2000 and can be overridden with `KV_INDEX_MODEL_CASES`.

mod reference;

use kv_index::{
    ActionRequest, ApplyRequest, CacheSpec, Effects, ImageInput, Index, MAX_ACTIONS_PER_APPLY,
    MAX_HASHES_PER_REQUEST, ValidApply, ValidationError,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, RngAlgorithm};
use reference::Model;
// `action` names this file's strategy.
use crate::requests::action as act;

const FULL: u32 = 1;
const SWA: u32 = 2;
const MAMBA: u32 = 4;

/// Worker ids, listed out of byte order and with an upper-case and a non-ASCII one, so that any
/// tie-break other than byte order shows. The last one's usual address is empty (it never
/// appears in prefix answers).
const WORKERS: [&str; 5] = ["w-b", "w-a2", "W-c", "w-a", "w-\u{e9}"];

// ----- operations --------------------------------------------------------------------------------

/// Requests too large (or exactly at the limit) to print usefully; built when the op runs.
#[derive(Debug, Clone)]
enum BigOp {
    /// 257 actions (the first one also has an undefined type: the size rule must win).
    TooManyActions { worker: usize },
    /// Exactly 256 valid one-hash REPORTs.
    MaxActions { worker: usize },
    /// 16,385 hashes over two actions (the second is also misaligned: the size rule must win).
    TooManyApplyHashes { worker: usize },
    /// Exactly 16,384 hashes over two REPORTs, hashes from the small space.
    MaxApplyHashes { worker: usize },
    /// `MatchExternalKv` with 16,385 (error) or 16,384 (valid) hashes.
    MatchKvSized { over: bool, count_as_hit: bool },
    /// `GetExternalKvHitCounts` with 16,385 (error) or 16,384 (valid) hashes.
    HitCountsSized { over: bool },
    /// A 20,000-block prefix query over a repeated chain `0, 1, 2, …, 11, 0, 1, …`.
    LongPrefix { max_blocks: u32 },
}

#[derive(Debug, Clone)]
enum Op {
    Apply(ApplyRequest),
    /// An apply whose `cache_spec` is replaced by the worker's spec for the whole case (what a
    /// real bridge does: the same spec on every batch), so that component-aware state builds up
    /// over several batches. For a legacy worker the masks are dropped; for a component-aware one
    /// empty masks become `FULL | SWA | MAMBA`.
    ApplySticky(ApplyRequest),
    /// Redeliver an earlier apply request (accepted or not): `history[i % history.len()]`.
    Redeliver(usize),
    Prefix {
        hashes: Vec<i64>,
        max_blocks: u32,
    },
    MatchKv {
        hashes: Vec<i64>,
        count_as_hit: bool,
    },
    HitCounts(Vec<i64>),
    Big(BigOp),
    /// A long chain, described compactly and built when the op runs (see [`LongChain`]).
    LongChain(LongChain),
    /// A prefix query over `start, start + 1, …` of up to a few hundred blocks.
    ChainPrefix {
        start: i64,
        len: usize,
        max_blocks: u32,
    },
}

/// The chain hint of a long chain's pieces.
#[derive(Debug, Clone, Copy)]
enum Hint {
    None,
    /// The true parent: the hash before the piece's first.
    True,
    /// The true parent plus this (non-zero) offset.
    Lie(i64),
}

/// Long chains (far longer than the other actions) make an index that walks chain runs
/// (`parent_block_hash`) do so over many blocks, then break them in the middle.
#[derive(Debug, Clone)]
enum LongChain {
    /// REPORT `start .. start + len` at one tier, split into `pieces` consecutive actions, each
    /// with a chain hint (`hints`) and all masks `mask` except at `holes` (position modulo
    /// `len`, mask).
    Report(LongReport),
    /// REVOKE `from .. from + len` at one tier, one action.
    ///
    /// Both use the worker's spec for the whole case.
    Revoke {
        worker: usize,
        tier: i32,
        from: i64,
        len: usize,
        hint: bool,
    },
}

/// A long REPORT (see [`LongChain::Report`]).
#[derive(Debug, Clone)]
struct LongReport {
    worker: usize,
    address: u8,
    tier: i32,
    start: i64,
    len: usize,
    pieces: usize,
    hints: Hint,
    mask: Option<u32>,
    holes: Vec<(usize, u32)>,
    size: Option<u32>,
}

// ----- strategies --------------------------------------------------------------------------------

/// Hashes from a small space so that they collide, plus the extremes of `sfixed64`.
fn hash() -> impl Strategy<Value = i64> + Clone {
    prop_oneof![
        14 => -2i64..12,
        1 => Just(i64::MIN),
        1 => Just(i64::MAX),
    ]
}

/// `start, start + 1, …` (a chain in prompt order).
fn chain(
    start: std::ops::Range<i64>,
    len: std::ops::Range<usize>,
) -> impl Strategy<Value = Vec<i64>> {
    (start, len).prop_map(|(s, l)| (0..l as i64).map(|i| s + i).collect())
}

/// `start, start + 1, …, start + period - 1, start, …` (a chain that revisits its hashes).
fn cycle() -> impl Strategy<Value = Vec<i64>> {
    (0i64..4, 1i64..5, 1usize..12)
        .prop_map(|(s, period, l)| (0..l as i64).map(|i| s + i % period).collect())
}

fn action_hashes() -> BoxedStrategy<Vec<i64>> {
    prop_oneof![
        12 => vec(hash(), 1..6),
        6 => chain(0..1, 1..9),
        6 => chain(1..10, 1..9),
        2 => cycle(),
        1 => Just(Vec::new()),
    ]
    .boxed()
}

fn component_mask() -> BoxedStrategy<u32> {
    prop_oneof![
        3 => Just(FULL | SWA | MAMBA),
        2 => Just(FULL),
        1 => Just(FULL | SWA),
        1 => Just(FULL | MAMBA),
        3 => 0u32..8,
        1 => Just(8u32),
    ]
    .boxed()
}

fn block_size() -> BoxedStrategy<u32> {
    prop_oneof![2 => Just(0u32), 5 => 1u32..20, 1 => Just(u32::MAX)].boxed()
}

/// Empty, aligned with `len` hashes, or of a random (usually misaligned) length.
fn side_array<S>(len: usize, element: S) -> impl Strategy<Value = Vec<u32>>
where
    S: Strategy<Value = u32> + Clone + 'static,
{
    prop_oneof![
        6 => Just(Vec::new()),
        16 => vec(element.clone(), len),
        1 => vec(element, 0..8),
    ]
}

fn action_type() -> BoxedStrategy<i32> {
    prop_oneof![
        24 => Just(1i32),
        10 => Just(2i32),
        4 => Just(3i32),
        1 => prop_oneof![Just(0i32), Just(4i32), Just(-1i32)],
    ]
    .boxed()
}

fn tier() -> BoxedStrategy<i32> {
    prop_oneof![
        40 => 1i32..=3,
        1 => prop_oneof![Just(0i32), Just(7i32), Just(-1i32)],
    ]
    .boxed()
}

fn action() -> BoxedStrategy<ActionRequest> {
    (action_type(), tier(), action_hashes(), 0u8..4, hash())
        .prop_flat_map(|(action_type, tier, hashes, parent_kind, random_parent)| {
            let n = hashes.len();
            // The chain hint: absent, random, or consistent with a chain ending before hashes[0].
            let parent_block_hash = match parent_kind {
                0 | 1 => None,
                2 => Some(random_parent),
                _ => Some(hashes.first().map_or(random_parent, |h| h.wrapping_sub(1))),
            };
            (
                Just(action_type),
                Just(tier),
                Just(hashes),
                side_array(n, component_mask()),
                side_array(n, block_size()),
                Just(parent_block_hash),
            )
        })
        .prop_map(
            |(action_type, tier, hashes, component_masks, block_sizes, parent_block_hash)| {
                ActionRequest {
                    action_type,
                    tier,
                    hashes,
                    component_masks,
                    block_sizes,
                    parent_block_hash,
                }
            },
        )
        .boxed()
}

fn tier_mask() -> BoxedStrategy<u32> {
    prop_oneof![
        10 => Just(2 | 4),
        1 => Just(2u32),
        1 => Just(4u32),
        1 => Just(2 | 4 | 8),
        1 => Just(8u32),
        2 => 0u32..16,
    ]
    .boxed()
}

fn spec(
    version: u32,
    components: u32,
    swa_window_tokens: u32,
    (full_tier_mask, swa_tier_mask, mamba_tier_mask): (u32, u32, u32),
) -> Option<CacheSpec> {
    Some(CacheSpec {
        version,
        components,
        swa_window_tokens,
        full_tier_mask,
        swa_tier_mask,
        mamba_tier_mask,
    })
}

/// An SWA window in tokens (block sizes are mostly 1..20 tokens).
fn window() -> BoxedStrategy<u32> {
    prop_oneof![8 => 1u32..40, 1 => Just(u32::MAX)].boxed()
}

fn cache_spec() -> BoxedStrategy<Option<CacheSpec>> {
    let masks = || (tier_mask(), tier_mask(), tier_mask());
    prop_oneof![
        6 => Just(None),
        3 => (0u32..2, masks()).prop_map(|(v, m)| spec(v, FULL, 0, m)),
        3 => (0u32..2, window(), masks()).prop_map(|(v, w, m)| spec(v, FULL | SWA, w, m)),
        2 => (0u32..2, masks()).prop_map(|(v, m)| spec(v, FULL | MAMBA, 0, m)),
        3 => (0u32..2, window(), masks())
            .prop_map(|(v, w, m)| spec(v, FULL | SWA | MAMBA, w, m)),
        // Invalid: no components, a future version, SWA without a window.
        2 => prop_oneof![
            masks().prop_map(|m| spec(1, 0, 16, m)),
            (2u32..4, masks()).prop_map(|(v, m)| spec(v, FULL, 0, m)),
            (
                masks(),
                prop_oneof![Just(SWA), Just(FULL | SWA), Just(FULL | SWA | MAMBA)]
            )
                .prop_map(|(m, c)| spec(1, c, 0, m)),
        ],
        // Anything.
        1 => (0u32..3, 0u32..16, 0u32..8, (0u32..16, 0u32..16, 0u32..16))
            .prop_map(|(v, c, w, m)| spec(v, c, w, m)),
    ]
    .boxed()
}

fn address_for(worker: &str, choice: u8) -> String {
    match choice {
        0..=7 if worker == WORKERS[4] => String::new(),
        0..=7 => format!("http://{worker}:8000"),
        8 => String::new(),
        _ => format!("http://{worker}:9000"),
    }
}

fn apply_request() -> BoxedStrategy<ApplyRequest> {
    (
        prop_oneof![30 => 0usize..WORKERS.len(), 1 => Just(usize::MAX)],
        0u8..10,
        0u64..100,
        cache_spec(),
        prop_oneof![1 => Just(Vec::new()), 6 => vec(action(), 1..5)],
    )
        .prop_map(|(w, address, seq, cache_spec, actions)| {
            let worker_id = WORKERS.get(w).map_or(String::new(), |w| (*w).to_string());
            ApplyRequest {
                worker_address: address_for(&worker_id, address),
                worker_id,
                seq,
                cache_spec,
                actions,
            }
        })
        .boxed()
}

fn query_hashes() -> BoxedStrategy<Vec<i64>> {
    prop_oneof![
        4 => vec(hash(), 1..10),
        5 => chain(-1..6, 1..16),
        1 => cycle(),
        1 => Just(Vec::new()),
    ]
    .boxed()
}

fn max_blocks() -> BoxedStrategy<u32> {
    prop_oneof![4 => Just(0u32), 3 => 1u32..8, 1 => Just(u32::MAX)].boxed()
}

fn big_op() -> BoxedStrategy<BigOp> {
    let worker = || 0usize..WORKERS.len();
    prop_oneof![
        3 => worker().prop_map(|worker| BigOp::TooManyActions { worker }),
        1 => worker().prop_map(|worker| BigOp::MaxActions { worker }),
        3 => worker().prop_map(|worker| BigOp::TooManyApplyHashes { worker }),
        1 => worker().prop_map(|worker| BigOp::MaxApplyHashes { worker }),
        3 => (any::<bool>(), any::<bool>())
            .prop_map(|(over, count_as_hit)| BigOp::MatchKvSized { over, count_as_hit }),
        2 => any::<bool>().prop_map(|over| BigOp::HitCountsSized { over }),
        1 => prop_oneof![Just(0u32), Just(13u32), Just(19_999u32)]
            .prop_map(|max_blocks| BigOp::LongPrefix { max_blocks }),
    ]
    .boxed()
}

fn long_chain() -> BoxedStrategy<LongChain> {
    let report = (
        (0usize..WORKERS.len(), 0u8..10, 1i32..=3),
        (
            prop_oneof![3 => Just(0i64), 1 => -2i64..12, 2 => 0i64..300],
            12usize..300,
            prop_oneof![3 => 1usize..5, 1 => 5usize..40],
        ),
        (
            prop_oneof![
                6 => Just(Hint::True),
                2 => Just(Hint::None),
                1 => prop_oneof![-3i64..0, 1i64..4, Just(1000i64)].prop_map(Hint::Lie),
            ],
            prop_oneof![1 => Just(None), 3 => component_mask().prop_map(Some)],
            vec((any::<usize>(), component_mask()), 0..4),
            prop_oneof![1 => Just(None), 3 => block_size().prop_map(Some)],
        ),
    )
        .prop_map(
            |((worker, address, tier), (start, len, pieces), (hints, mask, holes, size))| {
                LongChain::Report(LongReport {
                    worker,
                    address,
                    tier,
                    start,
                    len,
                    pieces,
                    hints,
                    mask,
                    holes,
                    size,
                })
            },
        );
    let revoke = (
        0usize..WORKERS.len(),
        1i32..=3,
        0i64..300,
        1usize..30,
        any::<bool>(),
    )
        .prop_map(|(worker, tier, from, len, hint)| LongChain::Revoke {
            worker,
            tier,
            from,
            len,
            hint,
        });
    prop_oneof![3 => report, 2 => revoke].boxed()
}

fn op() -> BoxedStrategy<Op> {
    prop_oneof![
        4 => apply_request().prop_map(Op::Apply),
        6 => apply_request().prop_map(|mut req| {
            req.cache_spec = None;
            Op::ApplySticky(req)
        }),
        2 => any::<usize>().prop_map(Op::Redeliver),
        6 => (query_hashes(), max_blocks())
            .prop_map(|(hashes, max_blocks)| Op::Prefix { hashes, max_blocks }),
        3 => (query_hashes(), any::<bool>())
            .prop_map(|(hashes, count_as_hit)| Op::MatchKv { hashes, count_as_hit }),
        2 => query_hashes().prop_map(Op::HitCounts),
        1 => big_op().prop_map(Op::Big),
        2 => long_chain().prop_map(Op::LongChain),
        3 => (
            prop_oneof![3 => Just(0i64), 1 => -2i64..300],
            1usize..400,
            prop_oneof![3 => Just(0u32), 1 => 1u32..400],
        )
            .prop_map(|(start, len, max_blocks)| Op::ChainPrefix {
                start,
                len,
                max_blocks
            }),
    ]
    .boxed()
}

// ----- running -----------------------------------------------------------------------------------

fn report(hashes: Vec<i64>) -> ActionRequest {
    ActionRequest {
        action_type: 1,
        tier: 1,
        component_masks: vec![FULL; hashes.len()],
        block_sizes: vec![4; hashes.len()],
        hashes,
        parent_block_hash: None,
    }
}

fn big_apply(worker: usize, actions: Vec<ActionRequest>) -> ApplyRequest {
    ApplyRequest {
        worker_id: WORKERS[worker].to_string(),
        seq: 0,
        worker_address: address_for(WORKERS[worker], 0),
        cache_spec: None,
        actions,
    }
}

/// `count` hashes from the small space, in a repeated chain.
fn small_space(count: usize) -> Vec<i64> {
    (0..count).map(|i| (i % 12) as i64).collect()
}

/// How the hints of a request are rewritten for one of the indexes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hints {
    AsGenerated,
    Stripped,
    ChainedToPreviousReport,
    /// Hints as generated, on an index exported and imported again after every step (a
    /// snapshot and a restart at every point).
    RestoredAfterEveryStep,
}

const HINTS: [Hints; 4] = [
    Hints::AsGenerated,
    Hints::Stripped,
    Hints::ChainedToPreviousReport,
    Hints::RestoredAfterEveryStep,
];

/// A change to the first index, as its twin replays it.
enum TwinOp {
    Apply(ValidApply),
    Table,
    CountHits(Vec<i64>),
}

/// The first index's twin (see the module docs): equal to it but for `ops`.
struct Twin {
    index: Index,
    ops: Vec<TwinOp>,
    effects: Effects,
    /// Applies recorded so far: every other one has its table rebuilt before it.
    applies: usize,
}

impl Twin {
    /// Applies `valid` to `first`, recording, as a cell's writer does.
    fn record(&mut self, first: &mut Index, valid: &ValidApply) -> Result<(), TestCaseError> {
        self.applies += 1;
        if self.applies.is_multiple_of(2)
            && let Some(spare) = first.table_for(valid.reported_blocks())
        {
            let installed = first.install_table_recording(spare, &mut self.effects);
            prop_assert!(installed.is_ok(), "a table built from the index is refused");
            self.ops.push(TwinOp::Table);
        }
        first.apply_recording(valid, &mut self.effects);
        self.ops.push(TwinOp::Apply(valid.clone()));
        Ok(())
    }

    fn of(first: &Index) -> Twin {
        Twin {
            index: first.twin(),
            ops: Vec::new(),
            effects: Effects::new(),
            applies: 0,
        }
    }

    /// Replays what it lacks, then checks it equals `first`.
    fn catch_up(&mut self, first: &Index, step: usize) -> Result<(), TestCaseError> {
        // Behind, with the shared table filled further by `first`: it still finds its blocks,
        // and its image (a forked child's, of the published copy) loads as what it holds.
        self.index.check_invariants();
        let mut image = Vec::new();
        self.index.write_image(&mut image).unwrap();
        let read = Index::read_image(&mut ImageInput::new(&image[..], image.len() as u64));
        let read = read.map_err(|e| TestCaseError::fail(format!("a twin's image: {e}")))?;
        read.check_invariants();
        prop_assert_eq!(
            read.export(),
            self.index.export(),
            "a twin's image read back"
        );
        for op in self.ops.drain(..) {
            match op {
                TwinOp::Apply(valid) => self.index.replay_apply(&valid, &mut self.effects),
                TwinOp::Table => drop(self.index.replay_table(&mut self.effects)),
                TwinOp::CountHits(hashes) => self.index.count_hits(&hashes),
            }
        }
        prop_assert!(
            self.effects.is_replayed(),
            "effects left after step {}",
            step
        );
        self.effects.clear();
        self.index.check_invariants();
        prop_assert_eq!(
            self.index.export(),
            first.export(),
            "the twin differs after step {}",
            step
        );
        // The same table (the next replay relies on it), and the layout too.
        prop_assert!(
            self.index.table_memory() == first.table_memory(),
            "the twin holds another table after step {}",
            step
        );
        let image = |index: &Index| {
            let mut image = Vec::new();
            index.write_image(&mut image).unwrap();
            image
        };
        prop_assert!(
            image(&self.index) == image(first),
            "the twin's image differs after step {}",
            step
        );
        Ok(())
    }
}

struct Pair {
    /// One index per [`HINTS`] entry.
    indexes: Vec<Index>,
    /// The first index's twin.
    twin: Twin,
    model: Model,
    history: Vec<ApplyRequest>,
    /// The last hash of the last REPORT action seen (for `ChainedToPreviousReport`).
    last_reported: Option<i64>,
}

impl Pair {
    fn new() -> Pair {
        let indexes: Vec<Index> = HINTS.iter().map(|_| Index::new()).collect();
        Pair {
            twin: Twin::of(&indexes[0]),
            indexes,
            model: Model::new(),
            history: Vec::new(),
            last_reported: None,
        }
    }

    /// `req` with its hints rewritten for one index.
    fn with_hints(&mut self, req: &ApplyRequest, hints: Hints) -> ApplyRequest {
        let mut req = req.clone();
        for action in &mut req.actions {
            match hints {
                Hints::AsGenerated | Hints::RestoredAfterEveryStep => {}
                Hints::Stripped => action.parent_block_hash = None,
                Hints::ChainedToPreviousReport => {
                    if action.action_type == 1 {
                        action.parent_block_hash = self.last_reported;
                        if let Some(&last) = action.hashes.last() {
                            self.last_reported = Some(last);
                        }
                    }
                }
            }
        }
        req
    }

    fn apply(&mut self, req: &ApplyRequest) -> Result<(), TestCaseError> {
        let expected = self.model.apply(req);
        for (k, hints) in HINTS.into_iter().enumerate() {
            let req = self.with_hints(req, hints);
            let index = &mut self.indexes[k];
            let valid = req.validate();
            if k == 0 {
                let real = match valid {
                    Ok(valid) => self.twin.record(index, &valid).map(|()| Ok(()))?,
                    Err(error) => Err(error),
                };
                prop_assert_eq!(&real, &expected, "apply result with hints {:?}", hints);
                continue;
            }
            // Half the indexes get their table rebuilt before the apply, as the server's
            // writer does it (built beside readers, then swapped in), and half inside it.
            if let (Ok(valid), 1) = (&valid, k % 2)
                && let Some(spare) = index.table_for(valid.reported_blocks())
            {
                let old = index.install_table(spare);
                prop_assert!(
                    old.is_ok(),
                    "a table built from the index itself is refused"
                );
                prop_assert!(index.table_for(valid.reported_blocks()).is_none());
            }
            let real: Result<(), ValidationError> = valid.map(|valid| {
                index.apply(&valid);
            });
            prop_assert_eq!(&real, &expected, "apply result with hints {:?}", hints);
        }
        Ok(())
    }

    fn prefix(&mut self, hashes: &[i64], max_blocks: u32) -> Result<(), TestCaseError> {
        let expected = self.model.match_prefix(hashes, max_blocks);
        for (index, hints) in self.indexes.iter().zip(HINTS) {
            let real = index.match_prefix(hashes, max_blocks);
            prop_assert_eq!(
                &real,
                &expected,
                "match_prefix answer with hints {:?}",
                hints
            );
        }
        Ok(())
    }

    fn match_kv(&mut self, hashes: &[i64], count_as_hit: bool) -> Result<(), TestCaseError> {
        let expected = self.model.match_kv(hashes);
        for (index, hints) in self.indexes.iter().zip(HINTS) {
            let real = index.match_kv(hashes);
            prop_assert_eq!(&real, &expected, "match_kv answer with hints {:?}", hints);
        }
        if expected.is_ok() && count_as_hit {
            for index in &mut self.indexes {
                index.count_hits(hashes);
            }
            self.twin.ops.push(TwinOp::CountHits(hashes.to_vec()));
            self.model.count_hits(hashes);
        }
        Ok(())
    }

    fn hit_counts(&mut self, hashes: &[i64]) -> Result<(), TestCaseError> {
        let expected = self.model.hit_counts(hashes);
        for (index, hints) in self.indexes.iter().zip(HINTS) {
            let real = index.hit_counts(hashes);
            prop_assert_eq!(&real, &expected, "hit_counts answer with hints {:?}", hints);
        }
        Ok(())
    }

    fn big(&mut self, op: &BigOp) -> Result<(), TestCaseError> {
        let limit = MAX_HASHES_PER_REQUEST;
        match *op {
            BigOp::TooManyActions { worker } => {
                let mut actions: Vec<ActionRequest> = (0..=MAX_ACTIONS_PER_APPLY)
                    .map(|i| report(vec![(i % 12) as i64]))
                    .collect();
                actions[0].action_type = 0;
                let req = big_apply(worker, actions);
                prop_assert_eq!(
                    self.model.apply(&req),
                    Err(ValidationError::TooManyActions { count: 257 })
                );
                self.apply(&req)
            }
            BigOp::MaxActions { worker } => {
                let actions = (0..MAX_ACTIONS_PER_APPLY)
                    .map(|i| report(vec![(i % 12) as i64]))
                    .collect();
                self.apply(&big_apply(worker, actions))
            }
            BigOp::TooManyApplyHashes { worker } => {
                let mut second = report(small_space(limit / 2 + 1));
                second.block_sizes.pop();
                let req = big_apply(worker, vec![report(small_space(limit / 2)), second]);
                self.apply(&req)
            }
            BigOp::MaxApplyHashes { worker } => {
                let req = big_apply(
                    worker,
                    vec![
                        report(small_space(limit / 2)),
                        report(small_space(limit / 2)),
                    ],
                );
                self.apply(&req)
            }
            BigOp::MatchKvSized { over, count_as_hit } => {
                let hashes = small_space(limit + usize::from(over));
                self.match_kv(&hashes, count_as_hit)
            }
            BigOp::HitCountsSized { over } => {
                let hashes = small_space(limit + usize::from(over));
                self.hit_counts(&hashes)
            }
            BigOp::LongPrefix { max_blocks } => self.prefix(&small_space(20_000), max_blocks),
        }
    }
}

impl LongChain {
    fn request(&self, specs: &[Option<CacheSpec>]) -> ApplyRequest {
        match self {
            LongChain::Report(report) => report.request(specs),
            LongChain::Revoke {
                worker,
                tier,
                from,
                len,
                hint,
            } => ApplyRequest {
                worker_id: WORKERS[*worker].to_string(),
                seq: 0,
                worker_address: address_for(WORKERS[*worker], 0),
                cache_spec: specs[*worker],
                actions: vec![ActionRequest {
                    action_type: 2,
                    tier: *tier,
                    hashes: (0..*len as i64).map(|i| from + i).collect(),
                    component_masks: Vec::new(),
                    block_sizes: Vec::new(),
                    parent_block_hash: hint.then(|| from - 1),
                }],
            },
        }
    }
}

impl LongReport {
    fn request(&self, specs: &[Option<CacheSpec>]) -> ApplyRequest {
        let len = self.len;
        let hashes: Vec<i64> = (0..len as i64).map(|i| self.start + i).collect();
        let mut masks = self.mask.map_or(Vec::new(), |mask| vec![mask; len]);
        if !masks.is_empty() {
            for &(at, hole) in &self.holes {
                masks[at % len] = hole;
            }
        }
        let sizes = self.size.map_or(Vec::new(), |size| vec![size; len]);
        let piece = len.div_ceil(self.pieces);
        let mut actions = Vec::new();
        let mut at = 0;
        while at < len {
            let end = (at + piece).min(len);
            actions.push(ActionRequest {
                action_type: 1,
                tier: self.tier,
                hashes: hashes[at..end].to_vec(),
                component_masks: if masks.is_empty() {
                    Vec::new()
                } else {
                    masks[at..end].to_vec()
                },
                block_sizes: if sizes.is_empty() {
                    Vec::new()
                } else {
                    sizes[at..end].to_vec()
                },
                parent_block_hash: match self.hints {
                    Hint::None => None,
                    Hint::True => Some(hashes[at] - 1),
                    Hint::Lie(offset) => Some(hashes[at] - 1 + offset),
                },
            });
            at = end;
        }
        ApplyRequest {
            worker_id: WORKERS[self.worker].to_string(),
            seq: 0,
            worker_address: address_for(WORKERS[self.worker], self.address),
            cache_spec: specs[self.worker],
            actions,
        }
    }
}

/// One way of writing an index's image.
type WriteImage = fn(&Index, &mut Vec<u8>) -> std::io::Result<()>;

fn run(specs: &[Option<CacheSpec>], ops: &[Op]) -> Result<(), TestCaseError> {
    let mut pair = Pair::new();
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Apply(req) => {
                pair.apply(req)?;
                pair.history.push(req.clone());
            }
            Op::ApplySticky(req) => {
                let mut req = req.clone();
                if let Some(w) = WORKERS.iter().position(|w| *w == req.worker_id) {
                    req.cache_spec = specs[w];
                }
                for action in &mut req.actions {
                    if req.cache_spec.is_none() {
                        // A legacy bridge sends no component masks.
                        action.component_masks.clear();
                    } else if action.component_masks.is_empty() {
                        // A component-aware one always does.
                        action.component_masks = vec![FULL | SWA | MAMBA; action.hashes.len()];
                    }
                }
                pair.apply(&req)?;
                pair.history.push(req);
            }
            Op::Redeliver(i) => {
                if !pair.history.is_empty() {
                    let req = pair.history[i % pair.history.len()].clone();
                    pair.apply(&req)?;
                }
            }
            Op::Prefix { hashes, max_blocks } => pair.prefix(hashes, *max_blocks)?,
            Op::MatchKv {
                hashes,
                count_as_hit,
            } => pair.match_kv(hashes, *count_as_hit)?,
            Op::HitCounts(hashes) => pair.hit_counts(hashes)?,
            Op::Big(big) => pair.big(big)?,
            Op::LongChain(chain) => {
                let req = chain.request(specs);
                pair.apply(&req)?;
                pair.history.push(req);
            }
            Op::ChainPrefix {
                start,
                len,
                max_blocks,
            } => {
                let hashes: Vec<i64> = (0..*len as i64).map(|i| start + i).collect();
                pair.prefix(&hashes, *max_blocks)?;
            }
        }
        let expected = pair.model.stats();
        for (index, hints) in pair.indexes.iter().zip(HINTS) {
            prop_assert_eq!(
                index.stats(),
                expected,
                "stats after step {} with hints {:?}",
                step,
                hints
            );
            index.check_invariants();
        }
        let restored = HINTS.len() - 1;
        let imported = Index::import(&pair.indexes[restored].export());
        imported.check_invariants();
        prop_assert_eq!(
            imported.export().canonical(),
            pair.indexes[0].export().canonical(),
            "an export imported again holds what the index held, after step {}",
            step
        );
        pair.indexes[restored] = imported;
        // Two more go through an image, which must hold what they held (the same layout), so
        // that from then on they go on answering and changing as the model does: one with its
        // own table, one with a table built afresh (what a forked snapshot child writes). The
        // fresh one drops stale entries, so it runs every other step only: the index it
        // replaces still gathers stale entries and purges them.
        let images: [(usize, WriteImage); 2] = [
            (restored - 1, |index, out| index.write_image(out)),
            (restored - 2, |index, out| {
                index.write_image_with_fresh_table(out)
            }),
        ];
        let fresh_too = step % 2 == 1;
        for (imaged, write) in images.into_iter().take(if fresh_too { 2 } else { 1 }) {
            let mut image = Vec::new();
            write(&pair.indexes[imaged], &mut image).unwrap();
            let read =
                Index::read_image(&mut ImageInput::new(&image[..], image.len() as u64)).unwrap();
            read.check_invariants();
            prop_assert_eq!(
                read.export(),
                pair.indexes[imaged].export(),
                "an image read back holds what index {} held, after step {}",
                imaged,
                step
            );
            pair.indexes[imaged] = read;
        }
        // The twin catches up at every third step, and at the end.
        if step % 3 == 2 || step + 1 == ops.len() {
            pair.twin.catch_up(&pair.indexes[0], step)?;
        }
        // A prefix query on the chain start after every step keeps the prefix scan under
        // constant pressure, whatever the op was.
        pair.prefix(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 0)?;
    }
    Ok(())
}

fn config() -> ProptestConfig {
    let cases = std::env::var("KV_INDEX_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            // Absolute, so that running the test binary from anywhere finds the same file.
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/index/model.proptest-regressions"
            ),
        ))),
        // ChaCha, the default, dominates the run time in debug builds.
        rng_algorithm: RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn index_agrees_with_reference_model(
        specs in vec(cache_spec(), WORKERS.len()),
        ops in vec(op(), 1..40),
    ) {
        run(&specs, &ops)?;
    }
}

// ----- sanity checks of the model itself ---------------------------------------------------------

fn req(worker: &str, spec: Option<CacheSpec>, actions: Vec<ActionRequest>) -> ApplyRequest {
    ApplyRequest {
        worker_id: worker.to_string(),
        seq: 0,
        worker_address: format!("http://{worker}"),
        cache_spec: spec,
        actions,
    }
}

fn prefixes(model: &Model, hashes: &[i64]) -> Vec<(String, u32)> {
    model
        .match_prefix(hashes, 0)
        .unwrap()
        .matches
        .into_iter()
        .map(|m| (m.worker_id, m.matched_prefix_blocks))
        .collect()
}

#[test]
fn model_legacy_prefix_and_fail_closed() {
    let mut m = Model::new();
    m.apply(&req("a", None, vec![act(1, 3, &[0, 1, 3], &[], &[])]))
        .unwrap();
    m.apply(&req("b", None, vec![act(1, 1, &[0, 1, 2], &[], &[])]))
        .unwrap();
    assert_eq!(
        prefixes(&m, &[0, 1, 2, 3]),
        vec![("b".to_string(), 3), ("a".to_string(), 2)]
    );
    // A non-zero mask past the gap makes the legacy worker untrusted.
    m.apply(&req("a", None, vec![act(1, 2, &[3], &[1], &[])]))
        .unwrap();
    assert_eq!(prefixes(&m, &[0, 1, 2, 3]), vec![("b".to_string(), 3)]);
    // ... but only among the considered blocks.
    assert_eq!(m.match_prefix(&[0, 1, 2, 3], 2).unwrap().matches.len(), 2);
    // The first-block miss.
    let miss = m.match_prefix(&[99, 0], 0).unwrap();
    assert_eq!((miss.matches.len(), miss.blocks_read), (0, 1));
}

#[test]
fn model_swa_and_mamba_boundaries() {
    let spec = Some(CacheSpec {
        version: 1,
        components: FULL | SWA | MAMBA,
        swa_window_tokens: 8,
        full_tier_mask: 6,
        swa_tier_mask: 6,
        mamba_tier_mask: 6,
    });
    let mut m = Model::new();
    // Block 1 lacks SWA (breaks the head), blocks 2, 3 carry 4 tokens each of SWA; MAMBA only on
    // blocks 0 and 3; block 4 lacks FULL.
    m.apply(&req(
        "a",
        spec,
        vec![act(
            1,
            1,
            &[0, 1, 2, 3, 4],
            &[7, 1, 3, 7, 6],
            &[4, 4, 4, 4, 4],
        )],
    ))
    .unwrap();
    // Boundary 1: unbroken head, MAMBA ok. Boundary 4: run of 8 tokens >= window, MAMBA ok.
    let answer = m.match_prefix(&[0, 1, 2, 3, 4, 5], 0).unwrap();
    assert_eq!(answer.best_prefix_blocks, 4);
    assert_eq!(answer.blocks_read, 5);
    assert_eq!(m.match_prefix(&[0, 1, 2], 0).unwrap().best_prefix_blocks, 1);
    // SSD never serves a component.
    m.apply(&req("b", spec, vec![act(1, 3, &[0, 1], &[7, 7], &[4, 4])]))
        .unwrap();
    assert_eq!(prefixes(&m, &[0, 1]), vec![("a".to_string(), 1)]);
}

#[test]
fn model_hits_vanish_with_the_block() {
    let mut m = Model::new();
    m.apply(&req("a", None, vec![act(1, 1, &[5, 6], &[], &[3, 0])]))
        .unwrap();
    m.count_hits(&[5, 5, 6, 7]);
    m.count_hits(&[5]);
    assert_eq!(m.hit_counts(&[7, 6, 5, 6]).unwrap(), vec![(6, 1), (5, 2)]);
    m.apply(&req("a", None, vec![act(3, 1, &[], &[], &[])]))
        .unwrap();
    assert_eq!(m.stats().blocks, 0);
    m.apply(&req("a", None, vec![act(1, 1, &[5], &[], &[])]))
        .unwrap();
    assert_eq!(m.hit_counts(&[5]).unwrap(), vec![]);
    assert_eq!(
        m.apply(&req(
            "a",
            None,
            vec![act(1, 1, &[5], &[], &[]), act(4, 0, &[], &[], &[1])]
        )),
        Err(ValidationError::UnknownActionType {
            action: 1,
            value: 4
        })
    );
}

/// One worker of [`deep_fleet`]: how it holds a shared chain.
#[derive(Debug, Clone)]
struct Depth {
    /// 0 legacy, 1 legacy with a non-zero mask on a block of its own, 2 aware FULL only,
    /// 3 aware FULL + SWA, 4 aware FULL + Mamba.
    kind: u8,
    tier: i32,
    /// It holds chain blocks `0..cut`...
    cut: usize,
    /// ...but for a revoked stretch `gap.0..gap.0 + gap.1`, if any.
    gap: Option<(usize, usize)>,
    /// Component masks of its blocks (aware workers), cycled.
    masks: Vec<u32>,
}

fn depth() -> impl Strategy<Value = Depth> {
    (
        0u8..5,
        1i32..=3,
        1usize..=CHAIN,
        proptest::option::weighted(0.3, (0usize..CHAIN, 1usize..20)),
        vec(
            prop_oneof![4 => Just(FULL | SWA | MAMBA), 1 => 0u32..8],
            1..4,
        ),
    )
        .prop_map(|(kind, tier, cut, gap, masks)| Depth {
            kind,
            tier,
            cut,
            gap,
            masks,
        })
}

const CHAIN: usize = 120;

/// Many workers holding one chain to different depths, as caches evicting from the tail leave
/// a shared system prompt: every depth is a piece boundary of the chunk, where the scan compares
/// neighbouring pieces instead of stepping every candidate. The answers must be the model's.
fn deep_fleet(fleet: &[Depth], queries: &[(usize, usize, u32)]) -> Result<(), TestCaseError> {
    let chain: Vec<i64> = (0..CHAIN as i64).map(|i| 1_000 + i).collect();
    let mut model = Model::new();
    let mut index = Index::new();
    for (w, worker) in fleet.iter().enumerate() {
        let id = format!("deep-{:02}", (w * 37) % 97);
        let spec = |components| CacheSpec {
            version: 1,
            components,
            swa_window_tokens: 64,
            full_tier_mask: 0b110,
            swa_tier_mask: 0b110,
            mamba_tier_mask: 0b010,
        };
        let (spec, masked) = match worker.kind {
            0 | 1 => (None, false),
            2 => (Some(spec(FULL)), true),
            3 => (Some(spec(FULL | SWA)), true),
            _ => (Some(spec(FULL | MAMBA)), true),
        };
        let hashes = &chain[..worker.cut];
        let masks: Vec<u32> = if masked {
            (0..hashes.len())
                .map(|i| worker.masks[i % worker.masks.len()])
                .collect()
        } else {
            Vec::new()
        };
        let mut actions = vec![act(1, worker.tier, hashes, &masks, &[16])];
        actions[0].block_sizes = vec![16; hashes.len()];
        if worker.kind == 1 {
            // A block off the chain with a non-zero mask: this legacy worker may fail closed.
            actions.push(act(1, worker.tier, &[-(w as i64) - 1], &[FULL], &[]));
        }
        if let Some((from, len)) = worker.gap {
            let end = (from + len).min(worker.cut);
            if from < end {
                actions.push(act(2, worker.tier, &chain[from..end], &[], &[]));
            }
        }
        let request = req(&id, spec, actions);
        let expected = model.apply(&request);
        let real = request.validate().map(|valid| index.apply(&valid));
        prop_assert_eq!(real, expected, "apply of {}", id);
    }
    index.check_invariants();
    for &(from, len, max_blocks) in queries {
        let mut query: Vec<i64> = chain
            .iter()
            .copied()
            .cycle()
            .skip(from % CHAIN)
            .take(len)
            .collect();
        if from % 3 == 0 && len > 2 {
            query[len / 2] = 7; // a hash nobody holds
        }
        prop_assert_eq!(
            index.match_prefix(&query, max_blocks),
            model.match_prefix(&query, max_blocks),
            "query from {} of {} blocks, max {}",
            from,
            len,
            max_blocks
        );
    }
    // The chain from its start, whole.
    prop_assert_eq!(
        index.match_prefix(&chain, 0),
        model.match_prefix(&chain, 0),
        "the whole chain"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..config() })]

    #[test]
    fn a_chain_held_to_many_depths_agrees_with_the_model(
        fleet in vec(depth(), 1..80),
        queries in vec((0usize..4, 1usize..=CHAIN + 10, 0u32..130), 1..6),
    ) {
        deep_fleet(&fleet, &queries)?;
    }
}
