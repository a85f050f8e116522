//! One named test per rule of `docs/indexer-contract.md` that concerns the index (everything but
//! the transport rules), with the exact decisions of the index's semantics note where the
//! contract leaves a choice (validation order, tie orders).
//!
//! Every test is a small table run through a helper of its area. Expected answers are written
//! out literally from the contract; none is computed by calling the index.

use kv_index::{
    ActionKind, ActionRequest, ApplyRequest, CacheSpec, ErrorClass, Index, IndexStats, NodeMatch,
    PrefixAnswer, PrefixMatch, Tier, TierHashes, ValidationError, validate_lookup, validate_prefix,
};

// ---------------------------------------------------------------------------------------------
// Wire values and builders
// ---------------------------------------------------------------------------------------------

const TIER_UNKNOWN: i32 = 0;
const HBM: i32 = 1;
const DRAM: i32 = 2;
const SSD: i32 = 3;

const ACTION_UNKNOWN: i32 = 0;
const REPORT: i32 = 1;
const REVOKE: i32 = 2;
const CLEAR: i32 = 3;

/// Component bits.
const F: u32 = 1;
const S: u32 = 2;
const M: u32 = 4;

/// `WorkerCacheSpec` tier-mask bits (`1 << TierType`).
const HBM_BIT: u32 = 2;
const DRAM_BIT: u32 = 4;
const SSD_BIT: u32 = 8;

use crate::requests::action;
use ErrorClass::{InvalidArgument, ResourceExhausted};

/// A legacy REPORT: no masks, no sizes.
fn report(tier: i32, hashes: &[i64]) -> ActionRequest {
    action(REPORT, tier, hashes, &[], &[])
}

fn report_masks(tier: i32, hashes: &[i64], masks: &[u32]) -> ActionRequest {
    action(REPORT, tier, hashes, masks, &[])
}

fn report_sized(tier: i32, hashes: &[i64], masks: &[u32], sizes: &[u32]) -> ActionRequest {
    action(REPORT, tier, hashes, masks, sizes)
}

fn revoke(tier: i32, hashes: &[i64]) -> ActionRequest {
    action(REVOKE, tier, hashes, &[], &[])
}

fn clear(tier: i32) -> ActionRequest {
    action(CLEAR, tier, &[], &[], &[])
}

/// The address convention of these tests: worker `id` serves at `http://id`.
fn address(id: &str) -> String {
    format!("http://{id}")
}

fn batch(
    id: &str,
    addr: &str,
    spec: Option<CacheSpec>,
    actions: Vec<ActionRequest>,
) -> ApplyRequest {
    ApplyRequest {
        worker_id: id.to_owned(),
        seq: 0,
        worker_address: addr.to_owned(),
        cache_spec: spec,
        actions,
    }
}

/// A worker without a cache spec, at `http://id`.
fn legacy(id: &str, actions: Vec<ActionRequest>) -> ApplyRequest {
    batch(id, &address(id), None, actions)
}

/// A worker with a cache spec, at `http://id`.
fn aware(id: &str, spec: CacheSpec, actions: Vec<ActionRequest>) -> ApplyRequest {
    batch(id, &address(id), Some(spec), actions)
}

/// A valid version-1 spec with every component servable from HBM and DRAM, no SWA window.
fn spec(components: u32) -> CacheSpec {
    CacheSpec {
        version: 1,
        components,
        swa_window_tokens: 0,
        full_tier_mask: HBM_BIT | DRAM_BIT,
        swa_tier_mask: HBM_BIT | DRAM_BIT,
        mamba_tier_mask: HBM_BIT | DRAM_BIT,
    }
}

/// `spec(components)` with an SWA window.
fn swa(components: u32, window: u32) -> CacheSpec {
    CacheSpec {
        swa_window_tokens: window,
        ..spec(components)
    }
}

/// Hashes `1..=n`.
fn seq(n: usize) -> Vec<i64> {
    (1..=n as i64).collect()
}

fn apply(index: &mut Index, request: &ApplyRequest) {
    let valid = request.clone().validate().expect("the batch is valid");
    index.apply(&valid);
}

fn build(batches: &[ApplyRequest]) -> Index {
    let mut index = Index::new();
    for request in batches {
        apply(&mut index, request);
    }
    index
}

// ---------------------------------------------------------------------------------------------
// Area helpers
// ---------------------------------------------------------------------------------------------

/// Each request is rejected with exactly this error and status class.
fn check_rejected(rows: Vec<(ApplyRequest, ValidationError, ErrorClass)>) {
    for (request, error, class) in rows {
        let got = request.clone().validate();
        assert_eq!(got.as_ref().err(), Some(&error), "request {request:#?}");
        assert_eq!(error.class(), class, "class of {error:?}");
    }
}

/// Each request passes validation.
fn check_accepted(rows: Vec<ApplyRequest>) {
    for request in rows {
        let got = request.clone().validate();
        assert!(got.is_ok(), "request {request:#?} was rejected: {got:?}");
    }
}

fn stats(blocks: usize, placements: usize, workers: usize) -> IndexStats {
    IndexStats {
        blocks,
        placements,
        workers,
    }
}

/// The expected prefix answer; matches are `(worker id, prefix)` at the conventional address.
fn expect(matches: &[(&str, u32)], best: u32, blocks_read: u32) -> PrefixAnswer {
    PrefixAnswer {
        matches: matches
            .iter()
            .map(|&(id, prefix)| PrefixMatch {
                worker_address: address(id),
                matched_prefix_blocks: prefix,
                worker_id: id.to_owned(),
            })
            .collect(),
        best_prefix_blocks: best,
        blocks_read,
    }
}

fn assert_prefix(index: &Index, query: &[i64], max_blocks: u32, expected: PrefixAnswer) {
    assert_eq!(
        index.match_prefix(query, max_blocks),
        Ok(expected),
        "prefix query {query:?} with max_blocks {max_blocks}"
    );
}

/// Builds an index from the batches, runs one prefix query and compares the whole answer.
/// Nothing matches: no worker, best 0, and block 0 is always read.
fn check_no_match(batches: &[ApplyRequest], query: &[i64]) {
    check_prefix(batches, query, 0, expect(&[], 0, 1));
}

fn check_prefix(batches: &[ApplyRequest], query: &[i64], max_blocks: u32, expected: PrefixAnswer) {
    let index = build(batches);
    assert_eq!(
        index.match_prefix(query, max_blocks),
        Ok(expected),
        "prefix query {query:?} with max_blocks {max_blocks} over {batches:#?}"
    );
}

/// A legacy worker from a pattern, one character per block hash 1, 2, 3, …: `h`/`d`/`s` held at
/// HBM/DRAM/SSD with mask 0 (legacy REPORT), `m`/`M` held at HBM/SSD with mask FULL, `.` not held.
fn legacy_pattern(id: &str, pattern: &str) -> ApplyRequest {
    let mut actions = Vec::new();
    for (i, c) in pattern.chars().enumerate() {
        let hash = [i as i64 + 1];
        actions.push(match c {
            'h' => report(HBM, &hash),
            'd' => report(DRAM, &hash),
            's' => report(SSD, &hash),
            'm' => report_masks(HBM, &hash, &[F]),
            'M' => report_masks(SSD, &hash, &[F]),
            '.' => continue,
            other => panic!("bad pattern character {other:?}"),
        });
    }
    legacy(id, actions)
}

/// Rows `(pattern, max_blocks, prefix, blocks_read)`: one legacy worker "w" from the pattern,
/// queried over hashes `1..=len(pattern)`.
fn check_legacy(rows: &[(&str, u32, u32, u32)]) {
    for &(pattern, max_blocks, prefix, blocks_read) in rows {
        let matches: &[(&str, u32)] = if prefix > 0 { &[("w", prefix)] } else { &[] };
        check_prefix(
            &[legacy_pattern("w", pattern)],
            &seq(pattern.len()),
            max_blocks,
            expect(matches, prefix, blocks_read),
        );
    }
}

/// A row of [`check_runs`]: `(spec, blocks as (component mask, token count), max_blocks, prefix,
/// blocks_read)`.
type RunRow<'a> = (CacheSpec, &'a [(u32, u32)], u32, u32, u32);

/// One component-aware worker "w" that holds block `i + 1` at HBM with
/// `blocks[i] = (component mask, token count)`, queried over hashes `1..=len(blocks)`.
fn check_runs(rows: &[RunRow]) {
    for &(spec, blocks, max_blocks, prefix, blocks_read) in rows {
        let hashes = seq(blocks.len());
        let masks: Vec<u32> = blocks.iter().map(|b| b.0).collect();
        let sizes: Vec<u32> = blocks.iter().map(|b| b.1).collect();
        let matches: &[(&str, u32)] = if prefix > 0 { &[("w", prefix)] } else { &[] };
        check_prefix(
            &[aware(
                "w",
                spec,
                vec![report_sized(HBM, &hashes, &masks, &sizes)],
            )],
            &hashes,
            max_blocks,
            expect(matches, prefix, blocks_read),
        );
    }
}

/// The placements of one block: `(tier, component mask)` each.
type Block<'a> = &'a [(i32, u32)];

/// A row of [`check_tiers`]: `(spec, blocks, prefix, blocks_read)`.
type TierRow<'a> = (CacheSpec, &'a [Block<'a>], u32, u32);

/// One component-aware worker "w" that holds block `i + 1` with the placements `blocks[i]`
/// (16 tokens each), queried over `1..=len(blocks)`.
fn check_tiers(rows: &[TierRow]) {
    for &(spec, blocks, prefix, blocks_read) in rows {
        let mut actions = Vec::new();
        for (i, placements) in blocks.iter().enumerate() {
            for &(tier, mask) in placements.iter() {
                actions.push(report_sized(tier, &[i as i64 + 1], &[mask], &[16]));
            }
        }
        let matches: &[(&str, u32)] = if prefix > 0 { &[("w", prefix)] } else { &[] };
        check_prefix(
            &[aware("w", spec, actions)],
            &seq(blocks.len()),
            0,
            expect(matches, prefix, blocks_read),
        );
    }
}

/// One tier of an expected node match: `(tier, hashes, component masks, block sizes)`.
type TierRowKv<'a> = (Tier, &'a [i64], &'a [u32], &'a [u32]);

/// One expected `ExternalKvNodeMatch` at the conventional address.
fn node(id: &str, tiers: &[TierRowKv]) -> NodeMatch {
    node_at(id, &address(id), tiers)
}

fn node_at(id: &str, addr: &str, tiers: &[TierRowKv]) -> NodeMatch {
    NodeMatch {
        worker_id: id.to_owned(),
        address: addr.to_owned(),
        hashes_by_tier: tiers
            .iter()
            .map(|&(tier, hashes, masks, sizes)| TierHashes {
                tier,
                hashes: hashes.to_vec(),
                component_masks: masks.to_vec(),
                block_sizes: sizes.to_vec(),
            })
            .collect(),
    }
}

fn assert_kv(index: &Index, query: &[i64], expected: &[NodeMatch]) {
    assert_eq!(
        index.match_kv(query),
        Ok(expected.to_vec()),
        "match_kv {query:?}"
    );
}

/// Rows `(batches, query, expected matches)`.
fn check_kv(rows: Vec<(Vec<ApplyRequest>, &[i64], Vec<NodeMatch>)>) {
    for (batches, query, expected) in rows {
        let index = build(&batches);
        assert_eq!(
            index.match_kv(query),
            Ok(expected),
            "match_kv {query:?} over {batches:#?}"
        );
    }
}

fn assert_hits(index: &Index, query: &[i64], expected: &[(i64, u64)]) {
    assert_eq!(
        index.hit_counts(query),
        Ok(expected.to_vec()),
        "hit_counts {query:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

#[test]
fn rejects_apply_with_empty_worker_id() {
    check_rejected(vec![
        (
            batch("", "http://x", None, vec![report(HBM, &[1])]),
            ValidationError::EmptyWorkerId,
            InvalidArgument,
        ),
        (
            batch("", "http://x", Some(spec(F)), vec![]),
            ValidationError::EmptyWorkerId,
            InvalidArgument,
        ),
    ]);
}

#[test]
fn rejects_apply_with_more_than_256_actions() {
    check_rejected(vec![
        (
            legacy("w", vec![report(HBM, &[1]); 257]),
            ValidationError::TooManyActions { count: 257 },
            ResourceExhausted,
        ),
        (
            legacy("w", vec![clear(HBM); 1000]),
            ValidationError::TooManyActions { count: 1000 },
            ResourceExhausted,
        ),
    ]);
    check_accepted(vec![legacy("w", vec![report(HBM, &[1]); 256])]);
}

#[test]
fn rejects_apply_with_more_than_16384_hashes_summed_over_its_actions() {
    check_rejected(vec![
        (
            legacy("w", vec![report(HBM, &seq(16_385))]),
            ValidationError::TooManyApplyHashes { count: 16_385 },
            ResourceExhausted,
        ),
        (
            legacy(
                "w",
                vec![report(HBM, &seq(8_192)), revoke(DRAM, &seq(8_193))],
            ),
            ValidationError::TooManyApplyHashes { count: 16_385 },
            ResourceExhausted,
        ),
    ]);
    check_accepted(vec![
        legacy("w", vec![report(HBM, &seq(16_384))]),
        legacy(
            "w",
            vec![report(HBM, &seq(8_192)), revoke(DRAM, &seq(8_192))],
        ),
    ]);
}

#[test]
fn rejects_action_with_unknown_or_undefined_tier_naming_it() {
    check_rejected(vec![
        (
            legacy("w", vec![report(TIER_UNKNOWN, &[1])]),
            ValidationError::UnknownTier {
                action: 0,
                value: 0,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![report(HBM, &[1]), revoke(4, &[1])]),
            ValidationError::UnknownTier {
                action: 1,
                value: 4,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![report(HBM, &[1]), report(SSD, &[1]), clear(-1)]),
            ValidationError::UnknownTier {
                action: 2,
                value: -1,
            },
            InvalidArgument,
        ),
    ]);
}

#[test]
fn rejects_action_with_unknown_or_undefined_type() {
    check_rejected(vec![
        (
            legacy("w", vec![action(ACTION_UNKNOWN, HBM, &[1], &[], &[])]),
            ValidationError::UnknownActionType {
                action: 0,
                value: 0,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![report(HBM, &[1]), action(4, HBM, &[1], &[], &[])]),
            ValidationError::UnknownActionType {
                action: 1,
                value: 4,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![action(-2, DRAM, &[1], &[], &[])]),
            ValidationError::UnknownActionType {
                action: 0,
                value: -2,
            },
            InvalidArgument,
        ),
    ]);
}

#[test]
fn rejects_report_without_hashes() {
    check_rejected(vec![
        (
            legacy("w", vec![report(HBM, &[])]),
            ValidationError::EmptyAction {
                action: 0,
                kind: ActionKind::Report,
            },
            InvalidArgument,
        ),
        (
            legacy(
                "w",
                vec![report(HBM, &[1]), report_sized(DRAM, &[], &[], &[])],
            ),
            ValidationError::EmptyAction {
                action: 1,
                kind: ActionKind::Report,
            },
            InvalidArgument,
        ),
    ]);
}

#[test]
fn rejects_revoke_without_hashes() {
    check_rejected(vec![(
        legacy("w", vec![report(HBM, &[1]), revoke(HBM, &[])]),
        ValidationError::EmptyAction {
            action: 1,
            kind: ActionKind::Revoke,
        },
        InvalidArgument,
    )]);
}

#[test]
fn accepts_clear_without_hashes() {
    check_accepted(vec![
        legacy("w", vec![clear(HBM)]),
        legacy("w", vec![report(HBM, &[1]), clear(SSD), clear(DRAM)]),
    ]);
}

#[test]
fn rejects_component_masks_neither_empty_nor_aligned_with_hashes() {
    let misaligned = |action, len, hashes| ValidationError::MisalignedSideArray {
        action,
        field: "component_masks",
        len,
        hashes,
    };
    check_rejected(vec![
        (
            legacy("w", vec![report_masks(HBM, &[1, 2], &[F])]),
            misaligned(0, 1, 2),
            InvalidArgument,
        ),
        (
            legacy(
                "w",
                vec![report(HBM, &[1]), report_masks(HBM, &[1, 2], &[F, F, F])],
            ),
            misaligned(1, 3, 2),
            InvalidArgument,
        ),
        // The length rule applies to every action type.
        (
            legacy("w", vec![action(REVOKE, HBM, &[1], &[F, F], &[])]),
            misaligned(0, 2, 1),
            InvalidArgument,
        ),
        (
            legacy("w", vec![action(CLEAR, HBM, &[], &[F], &[])]),
            misaligned(0, 1, 0),
            InvalidArgument,
        ),
    ]);
}

#[test]
fn rejects_block_sizes_neither_empty_nor_aligned_with_hashes() {
    let misaligned = |action, len, hashes| ValidationError::MisalignedSideArray {
        action,
        field: "block_sizes",
        len,
        hashes,
    };
    check_rejected(vec![
        (
            legacy("w", vec![report_sized(HBM, &[1, 2, 3], &[], &[16])]),
            misaligned(0, 1, 3),
            InvalidArgument,
        ),
        (
            legacy(
                "w",
                vec![report_sized(HBM, &[1, 2], &[F, F], &[16, 16, 16])],
            ),
            misaligned(0, 3, 2),
            InvalidArgument,
        ),
        (
            legacy(
                "w",
                vec![clear(DRAM), action(REVOKE, HBM, &[1, 2], &[], &[16])],
            ),
            misaligned(1, 1, 2),
            InvalidArgument,
        ),
    ]);
}

#[test]
fn accepts_side_arrays_empty_or_aligned_with_hashes() {
    check_accepted(vec![
        legacy("w", vec![report(HBM, &[1, 2])]),
        legacy("w", vec![report_masks(HBM, &[1, 2], &[F, S])]),
        legacy("w", vec![report_sized(HBM, &[1, 2], &[], &[16, 0])]),
        legacy("w", vec![report_sized(HBM, &[1, 2], &[F, 0], &[16, 16])]),
        legacy("w", vec![action(REVOKE, HBM, &[1, 2], &[F, F], &[8, 8])]),
    ]);
}

#[test]
fn validation_reports_the_first_failing_rule_in_order() {
    check_rejected(vec![
        (
            batch("", "", None, vec![report(TIER_UNKNOWN, &seq(100)); 300]),
            ValidationError::EmptyWorkerId,
            InvalidArgument,
        ),
        (
            legacy("w", vec![report(TIER_UNKNOWN, &seq(100)); 300]),
            ValidationError::TooManyActions { count: 300 },
            ResourceExhausted,
        ),
        (
            legacy(
                "w",
                vec![action(ACTION_UNKNOWN, TIER_UNKNOWN, &seq(16_385), &[], &[])],
            ),
            ValidationError::TooManyApplyHashes { count: 16_385 },
            ResourceExhausted,
        ),
        (
            legacy(
                "w",
                vec![action(ACTION_UNKNOWN, TIER_UNKNOWN, &[], &[F], &[])],
            ),
            ValidationError::UnknownActionType {
                action: 0,
                value: 0,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![action(REPORT, TIER_UNKNOWN, &[], &[F], &[])]),
            ValidationError::UnknownTier {
                action: 0,
                value: 0,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![action(REPORT, HBM, &[], &[F], &[16])]),
            ValidationError::EmptyAction {
                action: 0,
                kind: ActionKind::Report,
            },
            InvalidArgument,
        ),
        (
            legacy("w", vec![action(REPORT, HBM, &[1], &[F, F], &[16, 16])]),
            ValidationError::MisalignedSideArray {
                action: 0,
                field: "component_masks",
                len: 2,
                hashes: 1,
            },
            InvalidArgument,
        ),
        (
            legacy(
                "w",
                vec![
                    action(REPORT, HBM, &[1], &[F], &[16, 16]),
                    action(ACTION_UNKNOWN, HBM, &[1], &[], &[]),
                ],
            ),
            ValidationError::MisalignedSideArray {
                action: 0,
                field: "block_sizes",
                len: 2,
                hashes: 1,
            },
            InvalidArgument,
        ),
    ]);
}

#[test]
fn rejects_lookups_without_hashes() {
    let index = build(&[legacy("w", vec![report(HBM, &[1])])]);
    assert_eq!(index.match_kv(&[]), Err(ValidationError::NoHashes));
    assert_eq!(index.hit_counts(&[]), Err(ValidationError::NoHashes));
    assert_eq!(validate_lookup(&[]), Err(ValidationError::NoHashes));
    assert_eq!(ValidationError::NoHashes.class(), InvalidArgument);
}

#[test]
fn rejects_lookups_with_more_than_16384_hashes() {
    let index = build(&[legacy("w", vec![report(HBM, &[1])])]);
    let too_many = ValidationError::TooManyQueryHashes { count: 16_385 };
    assert_eq!(index.match_kv(&seq(16_385)), Err(too_many.clone()));
    assert_eq!(index.hit_counts(&seq(16_385)), Err(too_many.clone()));
    assert_eq!(validate_lookup(&seq(16_385)), Err(too_many.clone()));
    assert_eq!(too_many.class(), ResourceExhausted);
    assert_kv(
        &index,
        &seq(16_384),
        &[node("w", &[(Tier::Hbm, &[1], &[0], &[0])])],
    );
    assert_hits(&index, &seq(16_384), &[]);
}

#[test]
fn rejects_prefix_query_without_hashes() {
    let index = build(&[legacy("w", vec![report(HBM, &[1])])]);
    assert_eq!(index.match_prefix(&[], 0), Err(ValidationError::NoHashes));
    assert_eq!(index.match_prefix(&[], 5), Err(ValidationError::NoHashes));
    assert_eq!(validate_prefix(&[]), Err(ValidationError::NoHashes));
}

#[test]
fn prefix_query_has_no_hash_count_cap() {
    let held: Vec<i64> = seq(20_000);
    check_prefix(
        &[
            legacy("w", vec![report(HBM, &held[..10_000])]),
            legacy("w", vec![report(DRAM, &held[10_000..])]),
        ],
        &seq(100_000),
        0,
        expect(&[("w", 20_000)], 20_000, 20_001),
    );
    assert_eq!(validate_prefix(&seq(100_000)), Ok(()));
}

// ---------------------------------------------------------------------------------------------
// State and apply semantics
// ---------------------------------------------------------------------------------------------

#[test]
fn batch_rejected_at_its_last_action_changes_nothing() {
    let mut index = build(&[legacy(
        "w",
        vec![report_sized(HBM, &[1, 2], &[], &[16, 16])],
    )]);
    index.count_hits(&[1]);
    let rejected = [
        batch(
            "w",
            "http://new",
            Some(spec(F)),
            vec![
                revoke(HBM, &[1]),
                report_masks(DRAM, &[3], &[F]),
                clear(HBM),
                report_sized(HBM, &[4], &[], &[16, 16]),
            ],
        ),
        batch(
            "w",
            "http://new",
            Some(spec(F)),
            vec![clear(HBM), report(HBM, &[5]), report(TIER_UNKNOWN, &[6])],
        ),
        batch(
            "new-worker",
            "http://n",
            None,
            vec![report(HBM, &[1]), revoke(HBM, &[])],
        ),
    ];
    for request in rejected {
        let result = request.clone().validate().map(|valid| index.apply(&valid));
        assert!(result.is_err(), "{request:#?} must be rejected");
        assert_eq!(index.stats(), stats(2, 2, 1));
        assert_kv(
            &index,
            &[1, 2, 3, 4, 5, 6],
            &[node("w", &[(Tier::Hbm, &[1, 2], &[0, 0], &[16, 16])])],
        );
        assert_prefix(&index, &[1, 2, 3], 0, expect(&[("w", 2)], 2, 3));
        assert_hits(&index, &[1, 2], &[(1, 1)]);
    }
}

#[test]
fn actions_apply_in_order_within_a_batch() {
    check_kv(vec![
        (
            vec![legacy("w", vec![report(HBM, &[1]), revoke(HBM, &[1])])],
            &[1],
            vec![],
        ),
        (
            vec![legacy("w", vec![revoke(HBM, &[1]), report(HBM, &[1])])],
            &[1],
            vec![node("w", &[(Tier::Hbm, &[1], &[0], &[0])])],
        ),
        (
            vec![legacy(
                "w",
                vec![report(HBM, &[1, 2]), clear(HBM), report(HBM, &[3])],
            )],
            &[1, 2, 3],
            vec![node("w", &[(Tier::Hbm, &[3], &[0], &[0])])],
        ),
    ]);
}

#[test]
fn apply_overwrites_worker_address_and_spec() {
    let mut index = Index::new();
    let query = [1, 2];
    let one = |addr: &str| PrefixAnswer {
        matches: vec![PrefixMatch {
            worker_address: addr.to_owned(),
            matched_prefix_blocks: 2,
            worker_id: "w".to_owned(),
        }],
        best_prefix_blocks: 2,
        blocks_read: 2,
    };
    // Legacy worker with component masks: fails closed.
    apply(
        &mut index,
        &batch(
            "w",
            "http://a",
            None,
            vec![report_masks(HBM, &query, &[F, F])],
        ),
    );
    assert_prefix(&index, &query, 0, expect(&[], 0, 1));
    // The spec arrives with the next batch: the same placements now match.
    apply(&mut index, &batch("w", "http://b", Some(spec(F)), vec![]));
    assert_prefix(&index, &query, 0, one("http://b"));
    assert_kv(
        &index,
        &query,
        &[node_at(
            "w",
            "http://b",
            &[(Tier::Hbm, &[1, 2], &[F, F], &[0, 0])],
        )],
    );
    // A batch without a spec makes the worker legacy again.
    apply(&mut index, &batch("w", "http://c", None, vec![]));
    assert_prefix(&index, &query, 0, expect(&[], 0, 1));
    // An invalid spec, then a valid one at a new address.
    apply(
        &mut index,
        &batch(
            "w",
            "http://d",
            Some(CacheSpec {
                version: 2,
                ..spec(F)
            }),
            vec![],
        ),
    );
    assert_prefix(&index, &query, 0, expect(&[], 0, 1));
    apply(&mut index, &batch("w", "http://e", Some(spec(F)), vec![]));
    assert_prefix(&index, &query, 0, one("http://e"));
    // The address is overwritten even when it becomes empty.
    apply(&mut index, &batch("w", "", Some(spec(F)), vec![]));
    assert_prefix(&index, &query, 0, expect(&[], 0, 1));
    assert_kv(
        &index,
        &query,
        &[node_at("w", "", &[(Tier::Hbm, &[1, 2], &[F, F], &[0, 0])])],
    );
}

#[test]
fn empty_action_list_registers_and_refreshes_a_worker() {
    let mut index = Index::new();
    apply(&mut index, &batch("w", "http://a", None, vec![]));
    assert_eq!(index.stats(), stats(0, 0, 1));
    assert_kv(&index, &[1], &[]);
    apply(
        &mut index,
        &batch("w", "http://a", None, vec![report(HBM, &[1])]),
    );
    apply(&mut index, &batch("v", "http://v", Some(spec(F)), vec![]));
    assert_eq!(index.stats(), stats(1, 1, 2));
    apply(&mut index, &batch("w", "http://b", None, vec![]));
    assert_eq!(index.stats(), stats(1, 1, 2));
    assert_kv(
        &index,
        &[1],
        &[node_at("w", "http://b", &[(Tier::Hbm, &[1], &[0], &[0])])],
    );
}

#[test]
fn report_replaces_the_component_snapshot_of_its_worker_and_tier() {
    check_kv(vec![
        (
            vec![aware(
                "w",
                spec(F | S | M),
                vec![
                    report_masks(HBM, &[1], &[F | S]),
                    report_masks(DRAM, &[1], &[S]),
                    report_masks(HBM, &[1], &[M]),
                ],
            )],
            &[1],
            vec![node(
                "w",
                &[
                    (Tier::Hbm, &[1], &[M], &[0]),
                    (Tier::Dram, &[1], &[S], &[0]),
                ],
            )],
        ),
        // A legacy REPORT (no masks) replaces the mask with 0.
        (
            vec![
                aware("w", spec(F), vec![report_masks(HBM, &[1], &[F])]),
                aware("w", spec(F), vec![report(HBM, &[1])]),
            ],
            &[1],
            vec![node("w", &[(Tier::Hbm, &[1], &[0], &[0])])],
        ),
        // Another worker's placement of the same block keeps its own mask.
        (
            vec![
                aware("w", spec(F), vec![report_masks(HBM, &[1], &[F | S])]),
                aware("v", spec(F), vec![report_masks(HBM, &[1], &[F])]),
                aware("w", spec(F), vec![report_masks(HBM, &[1], &[S])]),
            ],
            &[1],
            vec![
                node("v", &[(Tier::Hbm, &[1], &[F], &[0])]),
                node("w", &[(Tier::Hbm, &[1], &[S], &[0])]),
            ],
        ),
    ]);
}

#[test]
fn report_last_occurrence_within_an_action_wins() {
    check_kv(vec![
        (
            vec![aware(
                "w",
                spec(F),
                vec![report_sized(HBM, &[1, 2, 1], &[F, S, F | M], &[16, 8, 32])],
            )],
            &[1, 2],
            vec![node("w", &[(Tier::Hbm, &[1, 2], &[F | M, S], &[32, 8])])],
        ),
        // The mask of the last occurrence wins; a size of 0 never overwrites one.
        (
            vec![aware(
                "w",
                spec(F),
                vec![report_sized(HBM, &[1, 1], &[F, S], &[16, 0])],
            )],
            &[1],
            vec![node("w", &[(Tier::Hbm, &[1], &[S], &[16])])],
        ),
    ]);
    let index = build(&[aware(
        "w",
        spec(F),
        vec![report_sized(HBM, &[1, 2, 1], &[F, S, F | M], &[16, 8, 32])],
    )]);
    assert_eq!(index.stats(), stats(2, 2, 1));
}

#[test]
fn block_size_is_updated_only_by_a_positive_size() {
    let mut index = Index::new();
    let steps: Vec<(ApplyRequest, u32)> = vec![
        (legacy("w", vec![report(HBM, &[1])]), 0),
        (legacy("w", vec![report_sized(HBM, &[1], &[], &[16])]), 16),
        (legacy("w", vec![report_sized(HBM, &[1], &[], &[0])]), 16),
        (legacy("w", vec![report(HBM, &[1])]), 16),
        (legacy("v", vec![report_sized(DRAM, &[1], &[], &[0])]), 16),
        (legacy("v", vec![report_sized(DRAM, &[1], &[], &[32])]), 32),
        (legacy("w", vec![report_sized(HBM, &[1], &[], &[24])]), 24),
    ];
    for (request, tokens) in steps {
        apply(&mut index, &request);
        let got = index.match_kv(&[1]).expect("valid lookup");
        assert!(!got.is_empty(), "block 1 is held after {request:#?}");
        for node in &got {
            for tier in &node.hashes_by_tier {
                assert_eq!(tier.block_sizes, vec![tokens], "after {request:#?}");
            }
        }
    }
}

#[test]
fn revoke_deletes_a_block_left_without_placements_with_its_hit_count() {
    let mut index = build(&[
        legacy(
            "w",
            vec![
                report_sized(HBM, &[1, 2], &[], &[16, 16]),
                report(DRAM, &[1]),
            ],
        ),
        legacy("v", vec![report(HBM, &[2])]),
    ]);
    index.count_hits(&[1, 2]);
    assert_hits(&index, &[1, 2], &[(1, 1), (2, 1)]);
    assert_eq!(index.stats(), stats(2, 4, 2));

    // Still held at DRAM: the block and its count stay.
    apply(&mut index, &legacy("w", vec![revoke(HBM, &[1])]));
    assert_hits(&index, &[1, 2], &[(1, 1), (2, 1)]);
    assert_eq!(index.stats(), stats(2, 3, 2));

    // The last placement goes: the block goes, with its count and token count.
    apply(&mut index, &legacy("w", vec![revoke(DRAM, &[1])]));
    assert_hits(&index, &[1, 2], &[(2, 1)]);
    assert_eq!(index.stats(), stats(1, 2, 2));
    assert_kv(
        &index,
        &[1, 2],
        &[
            node("v", &[(Tier::Hbm, &[2], &[0], &[16])]),
            node("w", &[(Tier::Hbm, &[2], &[0], &[16])]),
        ],
    );

    // Still held by another worker: kept.
    apply(&mut index, &legacy("w", vec![revoke(HBM, &[2])]));
    assert_hits(&index, &[1, 2], &[(2, 1)]);
    assert_eq!(index.stats(), stats(1, 1, 2));

    // A re-reported block starts from no count and an unknown size.
    apply(&mut index, &legacy("w", vec![report(HBM, &[1])]));
    assert_hits(&index, &[1], &[]);
    assert_kv(&index, &[1], &[node("w", &[(Tier::Hbm, &[1], &[0], &[0])])]);

    // CLEAR deletes the same way.
    apply(&mut index, &legacy("v", vec![clear(HBM)]));
    assert_hits(&index, &[2], &[]);
    assert_eq!(index.stats(), stats(1, 1, 2));
}

#[test]
fn revoke_of_an_absent_placement_changes_nothing() {
    let mut index = build(&[legacy("w", vec![report(HBM, &[1])])]);
    for request in [
        legacy("w", vec![revoke(HBM, &[9])]),
        legacy("w", vec![revoke(DRAM, &[1])]),
        legacy("v", vec![revoke(HBM, &[1])]),
    ] {
        apply(&mut index, &request);
        assert_kv(&index, &[1], &[node("w", &[(Tier::Hbm, &[1], &[0], &[0])])]);
        assert_eq!(index.stats().blocks, 1);
        assert_eq!(index.stats().placements, 1);
    }
}

#[test]
fn clear_at_one_tier_leaves_the_other_tiers_and_workers() {
    let cleared = vec![
        legacy(
            "w",
            vec![
                report(HBM, &[1, 2]),
                report(DRAM, &[2, 3]),
                report(SSD, &[4]),
            ],
        ),
        legacy("v", vec![report(HBM, &[1])]),
        legacy("w", vec![clear(HBM)]),
    ];
    check_kv(vec![
        (
            cleared.clone(),
            &[1, 2, 3, 4],
            vec![
                node("v", &[(Tier::Hbm, &[1], &[0], &[0])]),
                node(
                    "w",
                    &[
                        (Tier::Dram, &[2, 3], &[0, 0], &[0, 0]),
                        (Tier::Ssd, &[4], &[0], &[0]),
                    ],
                ),
            ],
        ),
        // Hashes on a CLEAR are ignored: it clears the whole tier.
        (
            vec![
                legacy("w", vec![report(SSD, &[1, 2]), report(DRAM, &[1])]),
                legacy("w", vec![action(CLEAR, SSD, &[2], &[], &[])]),
            ],
            &[1, 2],
            vec![node("w", &[(Tier::Dram, &[1], &[0], &[0])])],
        ),
    ]);
    assert_eq!(build(&cleared).stats(), stats(4, 4, 2));
}

#[test]
fn report_revoke_and_clear_are_idempotent() {
    let mut index = Index::new();
    let steps: Vec<(ApplyRequest, IndexStats, Vec<NodeMatch>)> = vec![
        (
            legacy("w", vec![report_sized(HBM, &[1, 2], &[F, 0], &[16, 16])]),
            stats(2, 2, 1),
            vec![node("w", &[(Tier::Hbm, &[1, 2], &[F, 0], &[16, 16])])],
        ),
        (
            legacy("w", vec![revoke(HBM, &[1])]),
            stats(1, 1, 1),
            vec![node("w", &[(Tier::Hbm, &[2], &[0], &[16])])],
        ),
        (legacy("w", vec![clear(HBM)]), stats(0, 0, 1), vec![]),
    ];
    for (request, after, expected) in steps {
        for _ in 0..3 {
            apply(&mut index, &request);
            assert_eq!(index.stats(), after, "after {request:#?}");
            assert_kv(&index, &[1, 2], &expected);
        }
    }
}

#[test]
fn redelivered_and_reordered_batches_apply_again_in_arrival_order() {
    let a = legacy("w", vec![report(HBM, &[1, 2])]);
    let b = legacy("w", vec![revoke(HBM, &[1])]);
    let both = node("w", &[(Tier::Hbm, &[1, 2], &[0, 0], &[0, 0])]);
    let two = node("w", &[(Tier::Hbm, &[2], &[0], &[0])]);
    check_kv(vec![
        (
            vec![a.clone(), b.clone(), a.clone()],
            &[1, 2],
            vec![both.clone()],
        ),
        (vec![b.clone(), a.clone()], &[1, 2], vec![both.clone()]),
        (
            vec![a.clone(), b.clone(), b.clone()],
            &[1, 2],
            vec![two.clone()],
        ),
        (
            vec![a.clone(), a.clone(), b.clone()],
            &[1, 2],
            vec![two.clone()],
        ),
    ]);
    // The spec of the batch that arrived last is the one in force.
    let with_spec = aware("w", spec(F), vec![report_masks(HBM, &[1, 2], &[F, F])]);
    let without = legacy("w", vec![]);
    check_prefix(
        &[without.clone(), with_spec.clone()],
        &[1, 2],
        0,
        expect(&[("w", 2)], 2, 2),
    );
    check_no_match(&[with_spec, without], &[1, 2]);
}

#[test]
fn clear_of_a_200k_hash_holding_removes_all_of_it() {
    let mut index = Index::new();
    let all: Vec<i64> = (0..200_000).collect();
    for chunk in all.chunks(16_384) {
        apply(&mut index, &legacy("w1", vec![report(HBM, chunk)]));
    }
    let sparse: Vec<i64> = (0..200_000).step_by(1_000).collect();
    apply(&mut index, &legacy("w2", vec![report(HBM, &sparse)]));
    apply(&mut index, &legacy("w1", vec![report(DRAM, &[7, 8])]));
    assert_eq!(index.stats(), stats(200_000, 200_202, 2));

    apply(&mut index, &legacy("w1", vec![clear(HBM)]));
    assert_eq!(index.stats(), stats(202, 202, 2));
    assert_kv(
        &index,
        &[0, 7, 199_999, 1_000],
        &[
            node("w2", &[(Tier::Hbm, &[0, 1_000], &[0, 0], &[0, 0])]),
            node("w1", &[(Tier::Dram, &[7], &[0], &[0])]),
        ],
    );
    assert_prefix(&index, &[0, 1, 2], 0, expect(&[("w2", 1)], 1, 2));
}

#[test]
fn reverse_holdings_compaction_after_many_report_revoke_cycles_keeps_clear_exact() {
    let mut index = Index::new();
    let stable: Vec<i64> = (1_000..1_010).collect();
    apply(
        &mut index,
        &legacy("w", vec![report(HBM, &stable), report(DRAM, &[1_000])]),
    );
    apply(&mut index, &legacy("v", vec![report(HBM, &[1])]));
    for round in 0..300 {
        let hashes = [1, 2, 500 + round];
        apply(
            &mut index,
            &legacy("w", vec![report(HBM, &hashes), revoke(HBM, &hashes)]),
        );
    }
    apply(&mut index, &legacy("w", vec![report(HBM, &[1, 2])]));
    apply(&mut index, &legacy("w", vec![revoke(HBM, &[1_005])]));
    // w: HBM 1, 2 and nine stable hashes, DRAM 1000; v: HBM 1.
    assert_eq!(index.stats(), stats(11, 13, 2));
    assert_kv(
        &index,
        &[1, 2, 1_000, 1_005, 1_009],
        &[
            node("v", &[(Tier::Hbm, &[1], &[0], &[0])]),
            node(
                "w",
                &[
                    (
                        Tier::Hbm,
                        &[1, 2, 1_000, 1_009],
                        &[0, 0, 0, 0],
                        &[0, 0, 0, 0],
                    ),
                    (Tier::Dram, &[1_000], &[0], &[0]),
                ],
            ),
        ],
    );

    apply(&mut index, &legacy("w", vec![clear(HBM)]));
    assert_eq!(index.stats(), stats(2, 2, 2));
    assert_kv(
        &index,
        &[1, 2, 1_000, 1_005, 1_009],
        &[
            node("v", &[(Tier::Hbm, &[1], &[0], &[0])]),
            node("w", &[(Tier::Dram, &[1_000], &[0], &[0])]),
        ],
    );

    // The tier is usable again after the CLEAR.
    apply(&mut index, &legacy("w", vec![report(HBM, &[3])]));
    apply(&mut index, &legacy("w", vec![clear(HBM)]));
    assert_eq!(index.stats(), stats(2, 2, 2));
}

// ---------------------------------------------------------------------------------------------
// MatchExternalKv and hit counts
// ---------------------------------------------------------------------------------------------

#[test]
fn match_kv_dedups_hashes_keeping_their_order() {
    check_kv(vec![(
        vec![legacy("w", vec![report(HBM, &[1, 2, 3])])],
        &[3, 1, 3, 2, 1],
        vec![node(
            "w",
            &[(Tier::Hbm, &[3, 1, 2], &[0, 0, 0], &[0, 0, 0])],
        )],
    )]);
}

#[test]
fn match_kv_lists_workers_in_first_seen_order_ties_by_worker_id() {
    let batches = vec![
        legacy("w3", vec![report(HBM, &[1, 2])]),
        legacy("w2", vec![report(HBM, &[1])]),
        legacy("w1", vec![report(HBM, &[2])]),
        legacy("w0", vec![report(HBM, &[9])]),
    ];
    check_kv(vec![
        (
            batches.clone(),
            &[1, 2],
            vec![
                node("w2", &[(Tier::Hbm, &[1], &[0], &[0])]),
                node("w3", &[(Tier::Hbm, &[1, 2], &[0, 0], &[0, 0])]),
                node("w1", &[(Tier::Hbm, &[2], &[0], &[0])]),
            ],
        ),
        (
            batches,
            &[2, 1],
            vec![
                node("w1", &[(Tier::Hbm, &[2], &[0], &[0])]),
                node("w3", &[(Tier::Hbm, &[2, 1], &[0, 0], &[0, 0])]),
                node("w2", &[(Tier::Hbm, &[1], &[0], &[0])]),
            ],
        ),
    ]);
}

#[test]
fn match_kv_orders_tiers_ascending_with_hashes_in_request_order() {
    check_kv(vec![(
        vec![legacy(
            "w",
            vec![
                report(SSD, &[1, 2]),
                report(HBM, &[2]),
                report(DRAM, &[3, 1]),
            ],
        )],
        &[3, 2, 1, 4],
        vec![node(
            "w",
            &[
                (Tier::Hbm, &[2], &[0], &[0]),
                (Tier::Dram, &[3, 1], &[0, 0], &[0, 0]),
                (Tier::Ssd, &[2, 1], &[0, 0], &[0, 0]),
            ],
        )],
    )]);
}

#[test]
fn match_kv_returns_each_placement_mask_and_block_token_count() {
    check_kv(vec![(
        vec![
            aware(
                "w",
                spec(F | S | M),
                vec![
                    report_sized(HBM, &[1, 2], &[F | S, F], &[16, 0]),
                    report_sized(DRAM, &[1, 3], &[M, 0], &[0, 32]),
                ],
            ),
            legacy("v", vec![report_sized(SSD, &[2], &[], &[8])]),
        ],
        &[1, 2, 3],
        vec![
            node(
                "w",
                &[
                    (Tier::Hbm, &[1, 2], &[F | S, F], &[16, 8]),
                    (Tier::Dram, &[1, 3], &[M, 0], &[16, 32]),
                ],
            ),
            node("v", &[(Tier::Ssd, &[2], &[0], &[8])]),
        ],
    )]);
}

#[test]
fn match_kv_skips_hashes_nobody_holds() {
    let batches = vec![legacy("w", vec![report(HBM, &[1])])];
    check_kv(vec![
        (batches.clone(), &[9], vec![]),
        (batches.clone(), &[9, 8], vec![]),
        (
            batches,
            &[9, 1],
            vec![node("w", &[(Tier::Hbm, &[1], &[0], &[0])])],
        ),
    ]);
}

#[test]
fn count_as_hit_adds_one_to_each_distinct_matched_hash() {
    let mut index = build(&[
        legacy("w", vec![report(HBM, &[1, 2])]),
        legacy("v", vec![report(DRAM, &[2])]),
    ]);
    index.count_hits(&[1, 1, 2, 9]);
    assert_hits(&index, &[1, 2, 9], &[(1, 1), (2, 1)]);
    index.count_hits(&[2]);
    assert_hits(&index, &[1, 2], &[(1, 1), (2, 2)]);
}

#[test]
fn hit_counts_only_for_counted_hashes_in_request_order() {
    let mut index = build(&[legacy("w", vec![report(HBM, &[1, 2, 3])])]);
    assert_hits(&index, &[1, 2, 3], &[]);
    index.count_hits(&[3, 1]);
    assert_hits(&index, &[2, 3, 2, 1, 9], &[(3, 1), (1, 1)]);
    // A hash nobody holds gets no count, not even once it is reported later.
    index.count_hits(&[9]);
    apply(&mut index, &legacy("w", vec![report(HBM, &[9])]));
    assert_hits(&index, &[9, 1], &[(1, 1)]);
}

#[test]
fn prefix_queries_and_plain_lookups_never_count_hits() {
    let index = build(&[legacy("w", vec![report(HBM, &[1, 2])])]);
    for _ in 0..3 {
        assert_prefix(&index, &[1, 2], 0, expect(&[("w", 2)], 2, 2));
        assert_kv(
            &index,
            &[1, 2],
            &[node("w", &[(Tier::Hbm, &[1, 2], &[0, 0], &[0, 0])])],
        );
    }
    assert_hits(&index, &[1, 2], &[]);
}

// ---------------------------------------------------------------------------------------------
// MatchExternalKvPrefix: legacy workers
// ---------------------------------------------------------------------------------------------

/// Legacy workers (no cache spec), one table with the rows grouped by rule.
#[test]
fn legacy_prefix_is_the_leading_run_and_fails_closed_on_a_mask_it_considers() {
    check_legacy(&[
        // The leading run held at any tier, SSD included.
        ("h", 0, 1, 1),
        ("hhh", 0, 3, 3),
        ("hds", 0, 3, 3),
        ("sss", 0, 3, 3),
        ("dsh.", 0, 3, 4),
        ("hh.h", 0, 2, 3),
        ("h.hh", 0, 1, 2),
        // A nonzero mask fails closed.
        ("m", 0, 0, 1),
        ("mhh", 0, 0, 1),
        ("hmh", 0, 0, 2),
        ("hhm", 0, 0, 3),
        ("hhM", 0, 0, 3),
        // So does one past the first gap.
        ("hh.m", 0, 0, 4),
        ("h.M", 0, 0, 3),
        ("h..hm", 0, 0, 5),
        ("hh.hm.h", 0, 0, 5),
        // A nonzero mask beyond the blocks considered (max_blocks) is ignored.
        ("hm", 1, 1, 1),
        ("hhhm", 3, 3, 3),
        ("hh.hm", 4, 2, 4),
    ]);
}

#[test]
fn legacy_worker_with_nonzero_mask_elsewhere_scans_to_n() {
    let masked_elsewhere = [legacy(
        "w",
        vec![report(HBM, &[1, 2, 4]), report_masks(DRAM, &[99], &[F])],
    )];
    let query = [1, 2, 3, 4, 5];
    check_prefix(&masked_elsewhere, &query, 0, expect(&[("w", 2)], 2, 5));
    check_prefix(&masked_elsewhere, &query, 4, expect(&[("w", 2)], 2, 4));
}

#[test]
fn legacy_fail_closed_looks_only_at_its_own_placements() {
    check_prefix(
        &[
            legacy("w", vec![report(HBM, &[1, 2, 3])]),
            aware("a", spec(F), vec![report_masks(HBM, &[2], &[F])]),
        ],
        &[1, 2, 3],
        0,
        expect(&[("w", 3)], 3, 3),
    );
}

// ---------------------------------------------------------------------------------------------
// MatchExternalKvPrefix: cache specs and component rules
// ---------------------------------------------------------------------------------------------

fn with_version(version: u32, base: CacheSpec) -> CacheSpec {
    CacheSpec { version, ..base }
}

const THREE_FULL_BLOCKS: &[(u32, u32)] = &[(F | S | M, 16), (F | S | M, 16), (F | S | M, 16)];

#[test]
fn spec_without_components_matches_nothing() {
    let without_components = |base| CacheSpec {
        components: 0,
        ..base
    };
    check_runs(&[
        (without_components(spec(F)), THREE_FULL_BLOCKS, 0, 0, 1),
        (without_components(swa(F, 16)), THREE_FULL_BLOCKS, 0, 0, 1),
    ]);
}

#[test]
fn spec_with_version_above_1_matches_nothing() {
    check_runs(&[
        (with_version(2, spec(F)), THREE_FULL_BLOCKS, 0, 0, 1),
        (
            with_version(u32::MAX, spec(F | M)),
            THREE_FULL_BLOCKS,
            0,
            0,
            1,
        ),
    ]);
}

#[test]
fn swa_spec_with_zero_window_matches_nothing() {
    check_runs(&[
        (swa(F | S, 0), THREE_FULL_BLOCKS, 0, 0, 1),
        (swa(S, 0), THREE_FULL_BLOCKS, 0, 0, 1),
        (swa(F | S | M, 0), THREE_FULL_BLOCKS, 0, 0, 1),
    ]);
}

#[test]
fn spec_versions_0_and_1_are_accepted() {
    check_runs(&[
        (with_version(0, spec(F)), THREE_FULL_BLOCKS, 0, 3, 3),
        (spec(F), THREE_FULL_BLOCKS, 0, 3, 3),
        (swa(F | S, 16), THREE_FULL_BLOCKS, 0, 3, 3),
        // A zero window only matters when SWA is configured.
        (spec(F | M), THREE_FULL_BLOCKS, 0, 3, 3),
    ]);
}

#[test]
fn full_is_required_on_every_block() {
    check_runs(&[
        (spec(F), &[(F, 16), (F, 16), (S | M, 16), (F, 16)], 0, 2, 3),
        (spec(F), &[(0, 16), (F, 16)], 0, 0, 1),
        // Even when FULL is not among the configured components.
        (swa(S, 16), &[(F | S, 16), (S, 16), (F | S, 16)], 0, 1, 2),
        (spec(M), &[(F | M, 16), (M, 16)], 0, 1, 2),
        (swa(F | S | M, 16), &[(S | M, 16)], 0, 0, 1),
    ]);
}

#[test]
fn ssd_is_never_servable_for_component_aware_workers() {
    let all = |spec: CacheSpec| CacheSpec {
        full_tier_mask: HBM_BIT | DRAM_BIT | SSD_BIT,
        swa_tier_mask: HBM_BIT | DRAM_BIT | SSD_BIT,
        mamba_tier_mask: HBM_BIT | DRAM_BIT | SSD_BIT,
        ..spec
    };
    check_tiers(&[
        (all(spec(F)), &[&[(SSD, F)]], 0, 1),
        (all(spec(F)), &[&[(HBM, F)], &[(SSD, F)], &[(HBM, F)]], 1, 2),
        (
            all(spec(F)),
            &[&[(HBM, F)], &[(DRAM, F)], &[(SSD, F), (HBM, F)]],
            3,
            3,
        ),
        (all(spec(F | M)), &[&[(HBM, F), (SSD, M)]], 0, 1),
        (
            all(swa(F | S, 32)),
            &[&[(HBM, F | S)], &[(HBM, F), (SSD, S)], &[(HBM, F | S)]],
            1,
            3,
        ),
    ]);
}

#[test]
fn tier_masks_apply_per_component() {
    let full_on = |mask| CacheSpec {
        full_tier_mask: mask,
        ..spec(F)
    };
    let swa_on = |mask| CacheSpec {
        swa_tier_mask: mask,
        ..swa(F | S, 32)
    };
    let mamba_on = |mask| CacheSpec {
        mamba_tier_mask: mask,
        ..spec(F | M)
    };
    check_tiers(&[
        (full_on(HBM_BIT), &[&[(HBM, F)], &[(DRAM, F)]], 1, 2),
        (full_on(DRAM_BIT), &[&[(HBM, F)]], 0, 1),
        (
            full_on(DRAM_BIT),
            &[&[(DRAM, F)], &[(HBM, F | S | M)]],
            1,
            2,
        ),
        (full_on(0), &[&[(HBM, F)]], 0, 1),
        (
            swa_on(HBM_BIT),
            &[&[(HBM, F | S)], &[(HBM, F), (DRAM, S)]],
            1,
            2,
        ),
        (
            swa_on(HBM_BIT | DRAM_BIT),
            &[&[(HBM, F | S)], &[(HBM, F), (DRAM, S)]],
            2,
            2,
        ),
        (mamba_on(HBM_BIT), &[&[(HBM, F), (DRAM, M)]], 0, 1),
        (mamba_on(HBM_BIT), &[&[(DRAM, F), (HBM, M)]], 1, 1),
        // Components available at different servable tiers combine.
        (swa(F | S | M, 16), &[&[(HBM, F), (DRAM, S | M)]], 1, 1),
    ]);
}

#[test]
fn swa_boundary_needs_an_unbroken_head_or_a_run_covering_the_window() {
    let swa32 = swa(F | S, 32);
    check_runs(&[
        // Unbroken head: every block is a boundary.
        (swa32, &[(F | S, 16), (F | S, 16), (F | S, 16)], 0, 3, 3),
        // Broken head: the run must reach the window again.
        (swa32, &[(F | S, 16), (F, 16), (F | S, 16)], 0, 1, 3),
        (
            swa32,
            &[(F | S, 16), (F, 16), (F | S, 16), (F | S, 16), (F | S, 16)],
            0,
            5,
            5,
        ),
        (swa32, &[(F | S, 40), (F, 16), (F | S, 40)], 0, 3, 3),
        (swa32, &[(F, 16), (F | S, 32), (F, 16)], 0, 2, 3),
        (swa32, &[(F, 8), (F | S, 16), (F | S, 16)], 0, 3, 3),
        // Tokens of a block without SWA never count towards the run.
        (swa32, &[(F | S, 16), (F, 100), (F | S, 16)], 0, 1, 3),
        // A run that never reaches the window: no boundary, but the scan goes on.
        (
            swa(F | S, 1_000),
            &[(F, 16), (F | S, 16), (F | S, 16), (F, 16)],
            0,
            0,
            4,
        ),
    ]);
}

#[test]
fn swa_run_with_unknown_token_counts_counts_zero_tokens() {
    let swa32 = swa(F | S, 32);
    check_runs(&[
        (swa32, &[(F | S, 0), (F | S, 0), (F | S, 0)], 0, 3, 3),
        (
            swa32,
            &[(F | S, 0), (F, 0), (F | S, 0), (F | S, 0)],
            0,
            1,
            4,
        ),
        (
            swa32,
            &[(F, 0), (F | S, 16), (F | S, 0), (F | S, 16)],
            0,
            4,
            4,
        ),
        (swa(F | S, 1), &[(F, 16), (F | S, 0), (F | S, 0)], 0, 0, 3),
    ]);
}

#[test]
fn swa_run_uses_the_token_count_reported_by_any_worker() {
    check_prefix(
        &[
            aware(
                "w",
                swa(F | S, 32),
                vec![report_masks(HBM, &[1, 2, 3], &[F, F | S, F | S])],
            ),
            legacy("v", vec![report_sized(SSD, &[2, 3], &[], &[16, 16])]),
        ],
        &[1, 2, 3],
        0,
        expect(&[("w", 3)], 3, 3),
    );
}

#[test]
fn mamba_boundary_block_must_have_mamba() {
    check_runs(&[
        (spec(F | M), &[(F | M, 16), (F, 16), (F | M, 16)], 0, 3, 3),
        (spec(F | M), &[(F | M, 16), (F, 16), (F, 16)], 0, 1, 3),
        (spec(F | M), &[(F, 16), (F | M, 16), (F, 16)], 0, 2, 3),
        (spec(F | M), &[(F, 16), (F, 16), (F, 16)], 0, 0, 3),
        (spec(F | M), &[(F | M, 16), (M, 16), (F | M, 16)], 0, 1, 2),
    ]);
}

#[test]
fn prefix_is_the_last_boundary_where_every_configured_rule_holds() {
    let fsm = swa(F | S | M, 32);
    check_runs(&[
        (
            fsm,
            &[
                (F | S | M, 16),
                (F | M, 16),
                (F | S, 16),
                (F | S | M, 16),
                (F | S | M, 16),
            ],
            0,
            5,
            5,
        ),
        (
            fsm,
            &[(F | S | M, 16), (F | S, 16), (F | S | M, 16), (F | M, 16)],
            0,
            3,
            4,
        ),
        (fsm, &[(F | S, 16), (F | S | M, 16)], 0, 2, 2),
        (fsm, &[(F | S, 16), (F | M, 16), (F | S, 16)], 0, 0, 3),
        // FULL is still required when only SWA and MAMBA are configured.
        (swa(S | M, 16), &[(F | S | M, 16), (S | M, 16)], 0, 1, 2),
    ]);
}

// ---------------------------------------------------------------------------------------------
// MatchExternalKvPrefix: answers, ordering, limits and blocks_read
// ---------------------------------------------------------------------------------------------

#[test]
fn workers_with_an_empty_address_are_left_out() {
    check_prefix(
        &[
            batch("e", "", None, vec![report(HBM, &[1, 2])]),
            legacy("w", vec![report(HBM, &[1])]),
        ],
        &[1, 2],
        0,
        expect(&[("w", 1)], 1, 2),
    );
    check_no_match(&[batch("e", "", None, vec![report(HBM, &[1, 2])])], &[1, 2]);
    check_no_match(
        &[batch(
            "e",
            "",
            Some(spec(F)),
            vec![report_masks(HBM, &[1, 2], &[F, F])],
        )],
        &[1, 2],
    );
}

#[test]
fn prefix_matches_sort_longest_first_ties_by_worker_id() {
    check_prefix(
        &[
            legacy("d", vec![report(HBM, &[1])]),
            legacy("c", vec![report(HBM, &[1, 2])]),
            legacy("z", vec![report(HBM, &[1, 2, 3])]),
            legacy("w9", vec![report(HBM, &[1])]),
            legacy("a", vec![report(DRAM, &[1, 2])]),
            legacy("w10", vec![report(SSD, &[1])]),
            aware("b", spec(F), vec![report_masks(HBM, &[1, 2], &[F, F])]),
        ],
        &[1, 2, 3],
        0,
        expect(
            &[
                ("z", 3),
                ("a", 2),
                ("b", 2),
                ("c", 2),
                ("d", 1),
                ("w10", 1),
                ("w9", 1),
            ],
            3,
            3,
        ),
    );
}

#[test]
fn best_prefix_blocks_is_the_longest_prefix_or_zero() {
    check_prefix(
        &[
            legacy("b", vec![report(HBM, &[1])]),
            legacy("a", vec![report(HBM, &[1, 2, 3])]),
        ],
        &[1, 2, 3, 4],
        0,
        expect(&[("a", 3), ("b", 1)], 3, 4),
    );
    check_no_match(
        &[legacy("a", vec![report_masks(HBM, &[1, 2], &[F, F])])],
        &[1, 2],
    );
    check_no_match(&[], &[1, 2]);
}

#[test]
fn max_blocks_caps_the_considered_blocks() {
    let five = [legacy("w", vec![report(HBM, &seq(5))])];
    check_prefix(&five, &seq(5), 0, expect(&[("w", 5)], 5, 5));
    check_prefix(&five, &seq(5), 10, expect(&[("w", 5)], 5, 5));
    check_prefix(&five, &seq(5), 3, expect(&[("w", 3)], 3, 3));
    check_prefix(&five, &seq(5), 1, expect(&[("w", 1)], 1, 1));
    let swa32 = swa(F | S, 32);
    check_runs(&[
        (swa32, &[(F, 16), (F | S, 16), (F | S, 16)], 2, 0, 2),
        (swa32, &[(F, 16), (F | S, 16), (F | S, 16)], 0, 3, 3),
        (spec(F), &[(F, 16), (F, 16), (0, 16)], 2, 2, 2),
    ]);
}

#[test]
fn first_block_miss_returns_nothing_with_one_block_read() {
    let held = [legacy("w", vec![report(HBM, &[1, 2])])];
    check_no_match(&[], &[1]);
    check_no_match(&held, &[9, 1, 2]);
    check_prefix(&held, &[9, 1, 2], 2, expect(&[], 0, 1));
    check_no_match(
        &[legacy("w", vec![report(HBM, &[1, 2]), revoke(HBM, &[1])])],
        &[1, 2],
    );
}

#[test]
fn only_holders_of_the_first_block_are_candidates() {
    check_prefix(
        &[
            legacy("w", vec![report(HBM, &[1])]),
            legacy("x", vec![report(HBM, &[2, 3, 4, 5])]),
            aware(
                "y",
                spec(F),
                vec![report_masks(HBM, &[2, 3, 4, 5], &[F; 4])],
            ),
        ],
        &seq(5),
        0,
        expect(&[("w", 1)], 1, 2),
    );
}

#[test]
fn blocks_read_stops_when_every_candidate_is_settled() {
    // Component-aware: settled at its first block without FULL.
    check_prefix(
        &[aware(
            "a",
            spec(F),
            vec![report_masks(HBM, &seq(5), &[F, F, 0, F, F])],
        )],
        &seq(5),
        0,
        expect(&[("a", 2)], 2, 3),
    );
    check_prefix(
        &[aware(
            "a",
            spec(F),
            vec![report_masks(HBM, &[1, 2, 4, 5], &[F; 4])],
        )],
        &seq(5),
        0,
        expect(&[("a", 2)], 2, 3),
    );
    // Legacy without non-zero masks: settled at its first gap.
    check_prefix(
        &[legacy("l", vec![report(HBM, &[1, 2, 4, 5])])],
        &seq(5),
        0,
        expect(&[("l", 2)], 2, 3),
    );
    // Legacy with a non-zero mask among the blocks: settled there.
    check_prefix(
        &[legacy(
            "l",
            vec![report(HBM, &[1, 3, 5]), report_masks(HBM, &[4], &[F])],
        )],
        &seq(5),
        0,
        expect(&[], 0, 4),
    );
    // Empty address and invalid spec: settled before the scan (block 0 is always read).
    check_no_match(&[batch("e", "", None, vec![report(HBM, &seq(5))])], &seq(5));
    check_no_match(
        &[aware(
            "i",
            CacheSpec {
                components: 0,
                ..spec(F)
            },
            vec![report_masks(HBM, &seq(5), &[F; 5])],
        )],
        &seq(5),
    );
    // The scan goes on while any candidate is unsettled.
    check_prefix(
        &[
            legacy("l", vec![report(HBM, &[1, 2])]),
            aware("a", spec(F), vec![report_masks(HBM, &seq(4), &[F; 4])]),
            batch("e", "", None, vec![report(HBM, &seq(6))]),
        ],
        &seq(6),
        0,
        expect(&[("a", 4), ("l", 2)], 4, 5),
    );
    // ... and never past max_blocks.
    check_prefix(
        &[
            legacy("l", vec![report(HBM, &[1, 2])]),
            aware("a", spec(F), vec![report_masks(HBM, &seq(4), &[F; 4])]),
        ],
        &seq(6),
        3,
        expect(&[("a", 3), ("l", 2)], 3, 3),
    );
}

#[test]
fn chain_hints_never_change_an_answer() {
    let chained = |mut action: ActionRequest, parent: i64| {
        action.parent_block_hash = Some(parent);
        action
    };
    check_prefix(
        &[
            legacy(
                "w",
                vec![chained(report(HBM, &[1, 2, 3, 4]), 0), revoke(HBM, &[2])],
            ),
            aware(
                "a",
                spec(F),
                vec![chained(report_masks(HBM, &[1, 2, 3], &[F, F, F]), 77)],
            ),
        ],
        &[1, 2, 3, 4],
        0,
        expect(&[("a", 3), ("w", 1)], 3, 4),
    );
}
