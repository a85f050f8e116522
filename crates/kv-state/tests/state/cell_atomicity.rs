//! The two-copy cell on the real index, under a writer that never pauses and readers that never
//! stop: every answer is the state after a whole number of applies, in order.
//!
//! Workers `a` and `b` take turns: each of their applies clears the worker, then reports a
//! prefix of one chain whose length encodes a step counter (`64 * (1 + step % 4)` blocks). A
//! reader that saw a worker and then finds it absent saw a clear without its report (half an
//! apply); lengths from steps more than one apart are applies out of order. Between them the
//! writer grows the table with fresh blocks, revokes old ones (purges, compactions), counts
//! hits and clears a third worker, publishing every one to four applies at once.
//!
//! The broken cell publishes between an apply's two actions: the same readers must catch it,
//! which is what shows that they can. And a property test: the two copies stay equal, and the
//! published one equals one index given the published applies, whatever the publication points.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_index::{ActionKind, ActionRequest, ApplyRequest, Index, Tier, ValidApply};
use kv_state::cell::{self, IndexCell, IndexChange, IndexWriter};
use proptest::prelude::*;

const CHAIN: i64 = 256;

fn apply(worker: &str, actions: Vec<(ActionKind, Vec<i64>)>) -> ValidApply {
    ApplyRequest {
        worker_id: worker.into(),
        worker_address: format!("http://{worker}"),
        actions: actions
            .into_iter()
            .map(|(kind, hashes)| ActionRequest {
                action_type: kind as i32,
                tier: Tier::Hbm.wire(),
                hashes,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
    .validate()
    .unwrap()
}

fn chain(len: i64) -> Vec<i64> {
    (1..=len).collect()
}

/// Worker `a`'s (even `j`) or `b`'s (odd `j`) record `j`: a clear, and a report of the chain's
/// first `64 * (1 + (j / 2) % 4)` blocks; as one apply, or (broken) as two.
fn turn(j: u64) -> (&'static str, Vec<(ActionKind, Vec<i64>)>) {
    let worker = if j.is_multiple_of(2) { "a" } else { "b" };
    let len = 64 * (1 + ((j / 2) % 4) as i64);
    let actions = vec![
        (ActionKind::ClearAllAtTier, Vec::new()),
        (ActionKind::Report, chain(len)),
    ];
    (worker, actions)
}

/// The step (mod 4) a worker's prefix length encodes, or why it is not one.
fn step(len: u32) -> Result<u32, String> {
    match len {
        64 | 128 | 192 | 256 => Ok(len / 64 - 1),
        other => Err(format!("a prefix of {other} blocks, not a whole apply's")),
    }
}

/// Reads until `stop`, checking every answer; the first violation.
fn read(cell: IndexCell, stop: Arc<AtomicBool>) -> Result<u64, String> {
    let hashes = chain(CHAIN);
    let (mut seen_a, mut seen_b) = (false, false);
    let mut answers = 0;
    while !stop.load(Ordering::Relaxed) {
        let index = cell.read();
        let answer = index.match_prefix(&hashes, 0).map_err(|e| e.to_string())?;
        let len = |worker: &str| {
            answer
                .matches
                .iter()
                .find(|m| m.worker_id == worker)
                .map(|m| m.matched_prefix_blocks)
        };
        let (a, b) = (len("a"), len("b"));
        if (seen_a && a.is_none()) || (seen_b && b.is_none()) {
            return Err(format!(
                "a worker cleared without its report: a {a:?}, b {b:?}"
            ));
        }
        seen_a |= a.is_some();
        seen_b |= b.is_some();
        if let (Some(a), Some(b)) = (a, b) {
            let (sa, sb) = (step(a)?, step(b)?);
            // b's record 2s+1 is never seen without a's 2s, nor a's 2s+2 without b's 2s+1.
            if (sa + 4 - sb) % 4 > 1 {
                return Err(format!("applies out of order: a at step {sa}, b at {sb}"));
            }
            let placements = index.stats().placements;
            if placements < (a + b) as usize {
                return Err(format!(
                    "{placements} placements, fewer than a's and b's {a} + {b}"
                ));
            }
        } else if let Some(len) = a.or(b) {
            step(len)?;
        }
        answers += 1;
    }
    Ok(answers)
}

/// Runs the writer for `records` turns (or until a reader fails) beside three readers;
/// `broken` publishes between the clear and the report. The readers' first failure, else the
/// answers they checked.
fn run(broken: bool, records: u64, deadline: Duration) -> Result<u64, String> {
    let cell = cell::empty();
    let mut writer = IndexWriter::new(cell.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (cell, stop) = (cell.clone(), stop.clone());
            std::thread::spawn(move || read(cell, stop))
        })
        .collect();
    let start = Instant::now();
    let mut group = 0;
    for j in 0..records {
        if start.elapsed() > deadline || readers.iter().any(|r| r.is_finished()) {
            break;
        }
        let (worker, actions) = turn(j);
        if broken {
            let mut actions = actions.into_iter();
            writer
                .change()
                .apply(&apply(worker, vec![actions.next().unwrap()]));
            writer.publish();
            writer.change().apply(&apply(worker, actions.collect()));
        } else {
            writer.change().apply(&apply(worker, actions));
        }
        let mut index = writer.change();
        match j % 7 {
            // Fresh blocks for `c`: the table grows.
            0 | 3 => {
                let fresh: Vec<i64> = (0..512).map(|k| 1_000_000 + (j as i64) * 512 + k).collect();
                index.make_room(fresh.len());
                index.apply(&apply("c", vec![(ActionKind::Report, fresh)]));
            }
            // Older ones revoked: stale entries, purges, compactions.
            1 if j > 14 => {
                let old: Vec<i64> = (0..512)
                    .map(|k| 1_000_000 + (j as i64 - 14) * 512 + k)
                    .collect();
                index.apply(&apply("c", vec![(ActionKind::Revoke, old)]));
            }
            2 => index.count_hits(&chain(8)),
            // As an expiry does.
            5 if j.is_multiple_of(5) => {
                index.apply(&apply("c", vec![(ActionKind::ClearAllAtTier, Vec::new())]))
            }
            _ => {}
        }
        group += 1;
        if group > j % 4 {
            writer.publish();
            group = 0;
        }
    }
    writer.publish();
    stop.store(true, Ordering::Relaxed);
    let mut answers = 0;
    for reader in readers {
        answers += reader.join().unwrap()?;
    }
    assert!(writer.copies_equal(), "the two copies differ");
    cell.read().check_invariants();
    Ok(answers)
}

#[test]
fn readers_never_see_half_an_apply_or_applies_out_of_order() {
    let answers = run(false, 6_000, Duration::from_secs(4)).unwrap();
    eprintln!("{answers} answers checked");
    assert!(answers > 100, "the readers checked only {answers} answers");
}

#[test]
fn a_cell_that_publishes_mid_apply_is_caught() {
    let caught = (0..5).find_map(|_| run(true, 20_000, Duration::from_secs(4)).err());
    let why = caught.expect("publishing mid-apply went unseen");
    eprintln!("caught: {why}");
    assert!(
        why.contains("without its report") || why.contains("out of order"),
        "{why}"
    );
}

/// One generated change: `(worker, kind, first hash, blocks)`.
fn change() -> impl Strategy<Value = (u8, u8, i64, usize)> {
    (0..4u8, 0..4u8, 0..200i64, 1..40usize)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the changes and wherever the publications, both copies end equal (in layout
    /// too: the other copy replays the first one's recorded table effects), the published one
    /// is one index given the published changes, and it stays whole while the writer's copy,
    /// ahead, fills the table they share. Tables are rebuilt before a change
    /// (`make_room`) or, when it is skipped, inside it, anywhere in a slice.
    #[test]
    fn the_copies_stay_equal_and_publish_what_one_index_holds(
        steps in prop::collection::vec((change(), any::<bool>(), any::<bool>()), 1..60)
    ) {
        let cell = cell::empty();
        let mut writer = IndexWriter::new(cell.clone());
        let mut reference = Index::new();
        let mut unpublished = Vec::new();
        for ((worker, kind, first, blocks), publish, prebuilt) in steps {
            let hashes: Vec<i64> = (first..first + blocks as i64).collect();
            let worker = format!("w{worker}");
            let change = match kind {
                0 | 1 => apply(&worker, vec![(ActionKind::Report, hashes)]),
                2 => apply(&worker, vec![(ActionKind::Revoke, hashes)]),
                _ => apply(&worker, vec![(ActionKind::ClearAllAtTier, Vec::new())]),
            };
            {
                let mut index = writer.change();
                if prebuilt {
                    index.make_room(change.reported_blocks());
                }
                index.apply(&change);
                if kind == 1 {
                    index.count_hits(&[first]);
                }
            }
            unpublished.push((change, kind == 1, first));
            if publish {
                writer.publish();
                for (change, hit, first) in unpublished.drain(..) {
                    reference.apply(&change);
                    if hit {
                        reference.count_hits(&[first]);
                    }
                }
                prop_assert_eq!(cell.read().export(), reference.export());
            }
            // The published copy finds each of its live blocks through the table the writer's
            // copy has gone on filling (the two share it).
            cell.read().check_invariants();
        }
        prop_assert!(writer.copies_equal());
        cell.read().check_invariants();
    }
}

/// Read-your-writes through the single server's writer: an apply (and a retry of it, a
/// duplicate in the same group) is answered only once it is published, so a query that starts
/// after the answer sees it. Holding the cell holds the publication, and so the answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::await_holding_lock)] // holding the cell over the awaits is the case
async fn an_apply_is_answered_only_once_queries_see_it() {
    let cell = cell::empty();
    let writer = kv_state::writer::Writer::start(
        IndexWriter::new(cell.clone()),
        None,
        kv_state::meta::Meta::new(),
        None,
        Default::default(),
    )
    .unwrap();
    let request = kv_indexer_proto::v1::ApplyExternalKvBatchRequest {
        worker_id: "w".into(),
        worker_address: "http://w".into(),
        bridge_incarnation: Some(1),
        bridge_batch: Some(1),
        actions: vec![kv_indexer_proto::v1::ExternalKvAction {
            r#type: ActionKind::Report as i32,
            tier: Tier::Hbm.wire(),
            hashes: chain(16),
            ..Default::default()
        }],
        ..Default::default()
    };
    let held = cell.hold();
    let first = tokio::spawn({
        let (writer, request) = (writer.clone(), request.clone());
        async move { writer.apply(request).await }
    });
    let retry = tokio::spawn({
        let (writer, request) = (writer.clone(), request.clone());
        async move { writer.apply(request).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !first.is_finished() && !retry.is_finished(),
        "answered before it was published"
    );
    drop(held);
    assert_eq!(first.await.unwrap().unwrap().blocks, 16);
    assert_eq!(retry.await.unwrap().unwrap().blocks, 16);
    assert_eq!(cell.read().stats().blocks, 16);
    writer.stop().await.unwrap();
}
