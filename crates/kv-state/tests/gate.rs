//! The sequence gate through the writer and a state directory: a duplicate is acknowledged and
//! not applied twice, and a server started on an older copy of its state directory (which lost
//! batches it had acknowledged) clears the worker at the bridge's next batch instead of
//! claiming what the worker has since dropped, and replays to the same state.

use std::path::{Path, PathBuf};

use kv_indexer_proto::v1 as pb;
use kv_state::cell::{self, IndexCell};
use kv_state::error::ChangeError;
use kv_state::open::open;
use kv_state::settings::Settings;
use kv_state::writer::Writer;

const REPORT: i32 = pb::ExternalKvActionType::ActionReport as i32;
const REVOKE: i32 = pb::ExternalKvActionType::ActionRevoke as i32;
const INCARNATION: u64 = 7;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kv-state-gate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn settings(dir: &Path) -> Settings {
    Settings {
        dir: Some(dir.to_path_buf()),
        snapshot_interval: None,
        ..Settings::default()
    }
}

/// Batch `batch` of the bridge: one action of `kind` on `hashes`.
fn batch(batch: u64, kind: i32, hashes: &[i64]) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: "w".into(),
        seq: batch,
        actions: vec![pb::ExternalKvAction {
            r#type: kind,
            tier: pb::TierType::TierHbm as i32,
            hashes: hashes.to_vec(),
            ..Default::default()
        }],
        worker_address: "http://w".into(),
        bridge_incarnation: Some(INCARNATION),
        bridge_batch: Some(batch),
        ..Default::default()
    }
}

/// How many of `hashes` the index says the worker holds.
fn held(cell: &IndexCell, hashes: &[i64]) -> usize {
    let index = cell.read();
    index
        .match_kv(hashes)
        .unwrap()
        .iter()
        .flat_map(|node| node.hashes_by_tier.iter().map(|tier| tier.hashes.len()))
        .sum()
}

async fn start(dir: &Path) -> (IndexCell, Writer) {
    let cell = cell::empty();
    let opened = open(&cell, &settings(dir)).unwrap();
    (cell, opened.writer)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        if entry.file_name() != "LOCK" && entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

#[tokio::test]
async fn a_retried_batch_is_acknowledged_and_not_applied_twice() {
    let dir = temp_dir("duplicate");
    let (cell, writer) = start(&dir).await;
    writer.apply(batch(1, REPORT, &[1, 2])).await.unwrap();
    writer.apply(batch(2, REVOKE, &[1])).await.unwrap();
    // A retry of batch 1 (its answer was lost): acknowledged, and block 1 stays revoked.
    writer.apply(batch(1, REPORT, &[1, 2])).await.unwrap();
    assert_eq!(held(&cell, &[1, 2]), 1);
    writer.apply(batch(3, REPORT, &[3])).await.unwrap();
    assert_eq!(held(&cell, &[1, 2, 3]), 2);
    writer.stop().await.unwrap();
}

#[tokio::test]
async fn an_older_state_directory_clears_the_worker_at_its_next_batch_and_replays_alike() {
    let dir = temp_dir("rolled-back");
    let older = temp_dir("rolled-back-copy");
    let (_, writer) = start(&dir).await;
    writer.apply(batch(1, REPORT, &[1, 2, 3, 4])).await.unwrap();
    writer.stop().await.unwrap();
    copy_dir(&dir, &older);
    // Acknowledged after the copy: the older directory never learns of them.
    let (_, writer) = start(&dir).await;
    writer.apply(batch(2, REVOKE, &[1, 2])).await.unwrap();
    writer.apply(batch(3, REPORT, &[5, 6])).await.unwrap();
    writer.stop().await.unwrap();

    // The server comes back on the older copy: it claims 1 and 2, which the worker dropped.
    let (cell, writer) = start(&older).await;
    assert_eq!(held(&cell, &[1, 2, 3, 4, 5, 6]), 4);
    let answer = writer.apply(batch(4, REPORT, &[7])).await;
    assert!(
        matches!(
            answer,
            Err(ChangeError::Gap {
                expected: 2,
                got: 4,
                ..
            })
        ),
        "{answer:?}"
    );
    assert_eq!(
        held(&cell, &[1, 2, 3, 4, 5, 6, 7]),
        0,
        "nothing over-claimed"
    );
    // The bridge re-syncs: its next batches apply on the cleared worker.
    writer.apply(batch(5, REPORT, &[3, 4, 5, 6])).await.unwrap();
    assert_eq!(held(&cell, &[1, 2, 3, 4, 5, 6]), 4);
    let digest = kv_state::digest::digest(cell.read().export());
    writer.stop().await.unwrap();

    // Replaying the log (the gap included) gives the same state.
    let (cell, writer) = start(&older).await;
    assert_eq!(kv_state::digest::digest(cell.read().export()), digest);
    writer.stop().await.unwrap();
}
