//! A single server's durable state through its own API (the cell, the writer, no gRPC): a
//! reopened state answers exactly what it answered before (after a clean stop and from a crash
//! image of its directory), fencing, worker expiry and its guard, every corruption case, the
//! directory lock, an operator's drop, and a property test: any applies, snapshots at random points, crashes at
//! random points → the recovered index equals an index given exactly the acknowledged applies.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kv_index::Index;
use kv_indexer_proto::convert;
use kv_state::clock::Clock;
use kv_state::config::{SnapshotMethod, StateConfig, SyncPolicy};
use kv_state::dir::DirError;
use kv_state::error::{ChangeError, StateError};
use kv_testkit::indexer::{CLEAR, DRAM, HBM, REPORT, REVOKE, action, apply_request as apply};
use proptest::prelude::*;

use crate::common::{State, dir_settings, report};

/// Where this file's directories go (`kv_testkit::temp_dir`, `kv_testkit::crash_image`).
const PREFIX: &str = "kv-state-durable";

/// A snapshot, written when this returns; its position.
async fn snapshot(state: &State) -> u64 {
    state.writer.snapshot_and_wait().await.unwrap()
}

/// Some history: reports on two tiers, a revoke in the middle of a chain, a clear, hits.
async fn some_history(state: &State) {
    let chain: Vec<i64> = (0..64).collect();
    let applies = [
        apply("w-a", vec![action(REPORT, HBM, &chain)]),
        apply(
            "w-b",
            vec![
                action(REPORT, HBM, &chain[..40]),
                action(REPORT, DRAM, &chain[40..]),
            ],
        ),
        apply("w-a", vec![action(REVOKE, HBM, &chain[20..30])]),
        apply(
            "w-c",
            vec![action(REPORT, DRAM, &[7, 8, 9]), action(CLEAR, DRAM, &[])],
        ),
    ];
    for request in applies {
        state.apply(request).await.unwrap();
    }
    state.count_hits(&[1, 2, 3, 50]).await.unwrap();
}

const QUERY: [i64; 8] = [0, 1, 2, 3, 25, 45, 50, 63];

#[tokio::test]
async fn a_reopened_state_answers_exactly_what_it_answered_before() {
    let dir = kv_testkit::temp_dir(PREFIX, "restart");
    let state = State::open_dir(&dir).await;
    some_history(&state).await;
    let before = state.answers(&QUERY);
    // A crash: the files as they are, no final snapshot.
    let image = kv_testkit::crash_image(&dir, PREFIX, "restart-crash");
    state.stop().await;
    let reopened = State::open_dir(&dir).await;
    assert_eq!(reopened.answers(&QUERY), before, "after a clean stop");
    assert!(reopened.stats().placements > 0);
    reopened.stop().await;
    let crashed = State::open_dir(&image).await;
    assert_eq!(crashed.answers(&QUERY), before, "after a crash");
    crashed.stop().await;
}

/// An operator's drop is logged: a crash image recovers the worker dropped, and the meta
/// beside it says expired.
#[tokio::test]
async fn a_dropped_worker_stays_dropped_after_a_crash() {
    let dir = kv_testkit::temp_dir(PREFIX, "drop");
    let state = State::open_dir(&dir).await;
    state.apply(report("gone", &[1, 2, 3])).await.unwrap();
    state.apply(report("kept", &[1, 2])).await.unwrap();
    assert_eq!(state.writer.drop_worker("gone".into()).await.unwrap(), 3);
    let image = kv_testkit::crash_image(&dir, PREFIX, "drop-crash");
    state.stop().await;
    let crashed = State::open_dir(&image).await;
    assert_eq!(crashed.held(&[1, 2, 3]), 2, "only kept's placements");
    let meta = crashed.writer.workers().await.unwrap();
    assert!(meta["gone"].expired && !meta["kept"].expired, "{meta:?}");
    crashed.stop().await;
}

#[tokio::test]
async fn a_snapshot_then_more_applies_then_a_crash_recovers_both() {
    let cases = [
        (SyncPolicy::Always, SnapshotMethod::Fork),
        (SyncPolicy::Batch, SnapshotMethod::Fork),
        (SyncPolicy::Off, SnapshotMethod::Fork),
        (SyncPolicy::Batch, SnapshotMethod::ForkShared),
        (SyncPolicy::Batch, SnapshotMethod::Rebuild),
    ];
    for (sync, snapshot_method) in cases {
        let dir = kv_testkit::temp_dir(PREFIX, "snapshot");
        let with_sync = |dir: &Path| StateConfig {
            sync,
            snapshot_method,
            ..dir_settings(dir)
        };
        let state = State::open(with_sync(&dir)).await.unwrap();
        some_history(&state).await;
        let position = snapshot(&state).await;
        assert!(position > 0);
        state.apply(report("w-d", &[0, 1, 2])).await.unwrap();
        let before = state.answers(&QUERY);
        let image = kv_testkit::crash_image(&dir, PREFIX, "snapshot-crash");
        let snapshots = kv_state::snapshot::list(&image).unwrap().len();
        assert_eq!(snapshots, 1, "older snapshots are deleted");
        let segments = kv_state::log::segments(&image).unwrap();
        assert!(
            segments[0].first >= position,
            "the log below the snapshot is deleted"
        );
        state.stop().await;
        // The shutdown snapshot covers everything: one snapshot, and no segment below it.
        let (last, _) = kv_state::snapshot::list(&dir).unwrap().pop().unwrap();
        assert_eq!(kv_state::snapshot::list(&dir).unwrap().len(), 1);
        let segments = kv_state::log::segments(&dir).unwrap();
        assert!(
            segments.iter().all(|s| s.first >= last),
            "{segments:?} below {last}"
        );
        let crashed = State::open(with_sync(&image)).await.unwrap();
        assert_eq!(
            crashed.answers(&QUERY),
            before,
            "sync {sync:?}, {snapshot_method:?}"
        );
        crashed.stop().await;
    }
}

/// Whether `result` is the refusal of a bridge at `incarnation` after `newest` was seen.
fn fenced<T>(result: &Result<T, ChangeError>, incarnation: u64, newest: u64) -> bool {
    matches!(
        result,
        Err(ChangeError::Fenced { worker_id, incarnation: i, newest: n })
            if worker_id == "w" && *i == incarnation && *n == newest
    )
}

#[tokio::test]
async fn an_older_bridge_incarnation_is_fenced_and_changes_nothing_even_after_a_restart() {
    let dir = kv_testkit::temp_dir(PREFIX, "fence");
    let state = State::open_dir(&dir).await;
    let with = |incarnation: Option<u64>, hashes: &[i64]| {
        let mut request = report("w", hashes);
        request.bridge_incarnation = incarnation;
        request
    };
    state.apply(with(Some(5), &[1])).await.unwrap();
    let refused = state.apply(with(Some(3), &[2])).await;
    assert!(fenced(&refused, 3, 5), "{refused:?}");
    assert_eq!(
        state.stats().placements,
        1,
        "a fenced apply changes nothing"
    );
    state.apply(with(None, &[3])).await.unwrap();
    state.apply(with(Some(5), &[4])).await.unwrap();
    state.apply(with(Some(6), &[5])).await.unwrap();
    let refused = state.apply(with(Some(5), &[6])).await;
    assert!(fenced(&refused, 5, 6), "{refused:?}");
    state.stop().await;
    let reopened = State::open_dir(&dir).await;
    let refused = reopened.apply(with(Some(5), &[7])).await;
    assert!(fenced(&refused, 5, 6), "after a restart: {refused:?}");
    assert_eq!(reopened.stats().placements, 4);
    reopened.stop().await;
}

#[tokio::test]
async fn a_silent_worker_expires_unless_every_worker_does() {
    let dir = kv_testkit::temp_dir(PREFIX, "ttl");
    let clock = Clock::default();
    let ttl = StateConfig {
        worker_ttl: Some(Duration::from_millis(1000)),
        clock: clock.clone(),
        ..dir_settings(&dir)
    };
    let state = State::open(ttl.clone()).await.unwrap();
    state.apply(report("alive", &[1, 2])).await.unwrap();
    state.apply(report("dead", &[2, 3])).await.unwrap();
    clock.advance(Duration::from_millis(1300));
    state.apply(apply("alive", Vec::new())).await.unwrap();
    state.writer.sweep();
    kv_testkit::wait::until("the dead worker's placements purged", || {
        let placements = state.stats().placements;
        async move { (placements == 2).then_some(()) }
    })
    .await;
    // Now both go silent: expiring every live worker at once is refused.
    clock.advance(Duration::from_millis(1300));
    state.writer.sweep();
    // The snapshot is queued behind the sweep: answered, the sweep has run.
    snapshot(&state).await;
    assert_eq!(state.stats().placements, 2, "mass expiry refused");
    state.stop().await;
    // After a restart every worker has a fresh TTL: nothing expires at once.
    clock.advance(Duration::from_millis(1300));
    let reopened = State::open(ttl).await.unwrap();
    reopened.writer.sweep();
    snapshot(&reopened).await;
    assert_eq!(reopened.stats().placements, 2);
    reopened.stop().await;
}

/// Opens `dir` and expects it to fail with an error naming `needles`; the error.
async fn refused(dir: &Path, needles: &[&str]) -> StateError {
    let error = State::open(dir_settings(dir))
        .await
        .err()
        .expect("opening must fail");
    let text = kv_common::error_chain(&error);
    for needle in needles {
        assert!(text.contains(needle), "{text:?} lacks {needle:?}");
    }
    error
}

/// Opens `dir` and expects it to fail as corrupt, with an error naming `needles`.
async fn corrupt(dir: &Path, needles: &[&str]) {
    let error = refused(dir, needles).await;
    assert!(error.is_corruption(), "not corruption: {error:?}");
}

/// A directory with history, a snapshot and a log after it, and the files' paths.
async fn state_with_snapshot(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = kv_testkit::temp_dir(PREFIX, name);
    let state = State::open_dir(&dir).await;
    some_history(&state).await;
    snapshot(&state).await;
    state.apply(report("w-e", &[1, 2, 3])).await.unwrap();
    state.apply(report("w-e", &[4, 5, 6])).await.unwrap();
    let image = kv_testkit::crash_image(&dir, PREFIX, name);
    state.stop().await;
    let file = |suffix: &str| {
        let mut found: Vec<PathBuf> = std::fs::read_dir(&image)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .collect();
        found.sort();
        found.pop().unwrap()
    };
    let (snap, seg) = (file(".snap"), file(".seg"));
    (image, snap, seg)
}

#[tokio::test]
async fn corruption_stops_start_up_naming_the_file_and_a_torn_tail_is_cut() {
    // A flipped byte in the snapshot.
    let (dir, snap, _) = state_with_snapshot("bad-snap").await;
    let mut bytes = std::fs::read(&snap).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&snap, bytes).unwrap();
    let name = snap.file_name().unwrap().to_string_lossy().to_string();
    corrupt(&dir, &[&name, "checksum does not match"]).await;
    // A snapshot of a newer format.
    let (dir, snap, _) = state_with_snapshot("new-snap").await;
    let mut bytes = std::fs::read(&snap).unwrap();
    bytes[8..12].copy_from_slice(&9u32.to_le_bytes());
    std::fs::write(&snap, bytes).unwrap();
    corrupt(&dir, &["format version 9 is newer"]).await;
    // A flipped byte in the first of the log's two records after the snapshot.
    let (dir, _, seg) = state_with_snapshot("bad-record").await;
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[20 + 12 + 2] ^= 0x01;
    std::fs::write(&seg, bytes).unwrap();
    let name = seg.file_name().unwrap().to_string_lossy().to_string();
    corrupt(&dir, &[&name, "at byte 20", "checksum"]).await;
    // A truncated tail: the last record is cut with a WARN, the rest recovers.
    let (dir, _, seg) = state_with_snapshot("torn").await;
    let len = std::fs::metadata(&seg).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(len - 5)
        .unwrap();
    let state = State::open_dir(&dir).await;
    let held = state.export();
    let w_e = held.workers.iter().find(|w| w.id == "w-e").unwrap();
    let hashes: Vec<i64> = w_e.held[0].iter().map(|h| h.hash).collect();
    assert_eq!(
        hashes,
        [1, 2, 3],
        "the torn second apply is gone, the first stays"
    );
    state.stop().await;
}

#[tokio::test]
async fn the_discard_setting_moves_a_corrupt_state_aside_and_starts_empty() {
    let (dir, snap, _) = state_with_snapshot("discard").await;
    let mut bytes = std::fs::read(&snap).unwrap();
    bytes[40] ^= 0xff;
    std::fs::write(&snap, bytes).unwrap();
    let state = State::open(StateConfig {
        discard_corrupt: true,
        ..dir_settings(&dir)
    })
    .await
    .unwrap();
    assert_eq!(state.stats().placements, 0);
    let aside: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert!(std::fs::read_dir(aside[0].path()).unwrap().count() >= 2);
    state.stop().await;
}

#[tokio::test]
async fn a_second_state_on_the_same_directory_is_refused() {
    let dir = kv_testkit::temp_dir(PREFIX, "lock");
    let state = State::open_dir(&dir).await;
    let error = refused(&dir, &["held by another live kv-indexer-server"]).await;
    assert!(
        matches!(error, StateError::Dir(DirError::Locked { .. })),
        "{error:?}"
    );
    assert!(!error.is_corruption(), "a held lock is not corruption");
    state.stop().await;
    // Stopped, the directory is free again.
    State::open_dir(&dir).await.stop().await;
}

/// One step of the property test.
#[derive(Debug, Clone)]
enum Step {
    Apply {
        worker: u8,
        tier: i32,
        kind: i32,
        start: i64,
        len: u8,
    },
    CountHits(Vec<i64>),
    Snapshot,
    Crash,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u8..3, prop_oneof![Just(HBM), Just(DRAM)], prop_oneof![3 => Just(REPORT), 2 => Just(REVOKE), 1 => Just(CLEAR)], 0i64..40, 1u8..12)
            .prop_map(|(worker, tier, kind, start, len)| Step::Apply { worker, tier, kind, start, len }),
        1 => proptest::collection::vec(0i64..50, 1..5).prop_map(Step::CountHits),
        1 => Just(Step::Snapshot),
        1 => Just(Step::Crash),
    ]
}

/// Runs `steps` on a durable state and, beside it, on a plain index given exactly the
/// acknowledged changes; after every crash (recovery from a crash image of the directory) and
/// at the end, the two must hold the same.
async fn recovered_equals_acknowledged(steps: Vec<Step>) {
    let mut dir = kv_testkit::temp_dir(PREFIX, "prop");
    let mut state = State::open_dir(&dir).await;
    let mut reference = Index::new();
    for step in steps {
        match step {
            Step::Apply {
                worker,
                tier,
                kind,
                start,
                len,
            } => {
                let hashes: Vec<i64> = (start..start + i64::from(len)).collect();
                let request = apply(&format!("w{worker}"), vec![action(kind, tier, &hashes)]);
                let valid = convert::apply_request(request.clone()).validate().unwrap();
                if state.apply(request).await.is_ok() {
                    reference.apply(&valid);
                }
            }
            Step::CountHits(hashes) => {
                if state.count_hits(&hashes).await.is_ok() {
                    reference.count_hits(&hashes);
                }
            }
            Step::Snapshot => {
                snapshot(&state).await;
            }
            Step::Crash => {
                let image = kv_testkit::crash_image(&dir, PREFIX, "prop-crash");
                state.stop().await;
                dir = image;
                state = State::open_dir(&dir).await;
                assert_eq!(
                    state.export().canonical(),
                    reference.export().canonical(),
                    "after a crash"
                );
            }
        }
    }
    assert_eq!(state.digest(), kv_state::digest::digest(reference.export()));
    state.stop().await;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn recovery_gives_exactly_the_acknowledged_changes(steps in proptest::collection::vec(step(), 1..40)) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(recovered_equals_acknowledged(steps));
    }
}
