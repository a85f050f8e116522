//! The durable state end to end, in-process over gRPC: a restarted server answers exactly
//! what it answered before (after a clean stop and from a crash image of its directory),
//! readiness, fencing, worker expiry and its guard, every corruption case, the directory lock,
//! and a property test: any applies, snapshots at random points, crashes at random points →
//! the recovered index equals an index given exactly the acknowledged applies.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kv_index::Index;
use kv_indexer_proto::convert;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::service::Shared;
use kv_server::{Config, boot, server};
use kv_state::error::StateError;
use kv_state::settings::SyncPolicy;
use proptest::prelude::*;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

const HBM: i32 = pb::TierType::TierHbm as i32;
const DRAM: i32 = pb::TierType::TierDram as i32;
const REPORT: i32 = pb::ExternalKvActionType::ActionReport as i32;
const REVOKE: i32 = pb::ExternalKvActionType::ActionRevoke as i32;
const CLEAR: i32 = pb::ExternalKvActionType::ActionClearAllAtTier as i32;

/// A fresh, empty directory under the system's temp dir.
fn temp_dir(name: &str) -> PathBuf {
    kv_testkit::temp_dir("kv-durable", name)
}

/// What a crash leaves: the directory's files as they are now (every acknowledged record was
/// written before its answer, so it is in them), without the lock.
fn crash_image(dir: &Path, name: &str) -> PathBuf {
    let image = temp_dir(name);
    std::fs::create_dir_all(&image).unwrap();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.file_name() != "LOCK" && entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), image.join(entry.file_name())).unwrap();
        }
    }
    image
}

fn config(dir: &Path) -> Config {
    Config {
        state: kv_state::settings::Settings {
            dir: Some(dir.to_path_buf()),
            snapshot_interval: None,
            ..Default::default()
        },
        ..Config::default()
    }
}

/// A server with a state directory on `127.0.0.1:0`.
struct Durable {
    shared: Arc<Shared>,
    client: KvIndexerClient<Channel>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), kv_server::error::StartError>>,
}

impl Durable {
    async fn start(config: Config) -> Result<Durable, StateError> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::new(&config).unwrap());
        let stop = CancellationToken::new();
        let task = tokio::spawn(server::run(
            listener,
            shared.clone(),
            stop.clone().cancelled_owned(),
        ));
        if let Err(error) = boot::boot(&shared, &config).await {
            stop.cancel();
            return Err(error);
        }
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Ok(Durable {
            shared,
            client: KvIndexerClient::new(channel),
            stop,
            task,
        })
    }

    /// A snapshot, written when this returns; its position.
    async fn snapshot(&self) -> u64 {
        let writer = self.shared.writer().unwrap();
        writer.snapshot_and_wait().await.unwrap()
    }

    /// A liveness sweep, queued to the writer (a later snapshot waits for it).
    fn sweep(&self) {
        self.shared.writer().unwrap().sweep();
    }

    /// SIGTERM's path: drain, final snapshot.
    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
        self.shared.writer().unwrap().stop().await.unwrap();
    }

    async fn apply(&mut self, request: pb::ApplyExternalKvBatchRequest) -> Result<(), Code> {
        self.client
            .apply_external_kv_batch(request)
            .await
            .map(|_| ())
            .map_err(|status| status.code())
    }

    /// Every answer a router can get for `hashes`, and the digest.
    async fn answers(&mut self, hashes: &[i64]) -> String {
        let (hashes, client) = (hashes.to_vec(), &mut self.client);
        let prefix = pb::MatchExternalKvPrefixRequest {
            hashes: hashes.clone(),
            max_blocks: 0,
            max_matches: None,
        };
        let prefix = client.match_external_kv_prefix(prefix).await;
        let exact = pb::MatchExternalKvRequest {
            hashes: hashes.clone(),
            count_as_hit: false,
        };
        let exact = client.match_external_kv(exact).await;
        let hits = pb::GetExternalKvHitCountsRequest { hashes };
        let hits = client.get_external_kv_hit_counts(hits).await;
        let answers = [
            prefix.map(|r| format!("{:?}", r.into_inner())),
            exact.map(|r| format!("{:?}", r.into_inner())),
            hits.map(|r| format!("{:?}", r.into_inner())),
        ];
        format!("{answers:?}\n{}", self.shared.digest())
    }
}

fn apply(worker: &str, actions: Vec<pb::ExternalKvAction>) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_address: format!("http://{worker}:30000"),
        worker_id: worker.into(),
        actions,
        ..Default::default()
    }
}

fn action(kind: i32, tier: i32, hashes: &[i64]) -> pb::ExternalKvAction {
    pb::ExternalKvAction {
        r#type: kind,
        tier,
        hashes: hashes.to_vec(),
        block_sizes: if kind == REPORT {
            hashes.iter().map(|h| 16 + (*h as u32 % 3)).collect()
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}

/// Some history: reports on two tiers, a revoke in the middle of a chain, a clear, hits.
async fn some_history(server: &mut Durable) {
    let chain: Vec<i64> = (0..64).collect();
    server
        .apply(apply("w-a", vec![action(REPORT, HBM, &chain)]))
        .await
        .unwrap();
    server
        .apply(apply(
            "w-b",
            vec![
                action(REPORT, HBM, &chain[..40]),
                action(REPORT, DRAM, &chain[40..]),
            ],
        ))
        .await
        .unwrap();
    server
        .apply(apply("w-a", vec![action(REVOKE, HBM, &chain[20..30])]))
        .await
        .unwrap();
    server
        .apply(apply(
            "w-c",
            vec![action(REPORT, DRAM, &[7, 8, 9]), action(CLEAR, DRAM, &[])],
        ))
        .await
        .unwrap();
    server
        .client
        .match_external_kv(pb::MatchExternalKvRequest {
            hashes: vec![1, 2, 3, 50],
            count_as_hit: true,
        })
        .await
        .unwrap();
}

const QUERY: [i64; 8] = [0, 1, 2, 3, 25, 45, 50, 63];

#[tokio::test]
async fn a_restart_answers_exactly_what_the_server_answered_before() {
    let dir = temp_dir("restart");
    let mut server = Durable::start(config(&dir)).await.unwrap();
    some_history(&mut server).await;
    let before = server.answers(&QUERY).await;
    // A crash: the files as they are, no final snapshot.
    let image = crash_image(&dir, "restart-crash");
    server.stop().await;
    let mut restarted = Durable::start(config(&dir)).await.unwrap();
    assert_eq!(
        restarted.answers(&QUERY).await,
        before,
        "after a clean stop"
    );
    assert!(restarted.shared.index_stats().placements > 0);
    restarted.stop().await;
    let mut crashed = Durable::start(config(&image)).await.unwrap();
    assert_eq!(crashed.answers(&QUERY).await, before, "after a crash");
    crashed.stop().await;
}

#[tokio::test]
async fn a_snapshot_then_more_applies_then_a_crash_recovers_both() {
    for sync in [SyncPolicy::Always, SyncPolicy::Batch, SyncPolicy::Off] {
        let dir = temp_dir("snapshot");
        let mut config = config(&dir);
        config.state.sync = sync;
        let mut server = Durable::start(config.clone()).await.unwrap();
        some_history(&mut server).await;
        let position = server.snapshot().await;
        assert!(position > 0);
        server
            .apply(apply("w-d", vec![action(REPORT, HBM, &[0, 1, 2])]))
            .await
            .unwrap();
        let before = server.answers(&QUERY).await;
        let image = crash_image(&dir, "snapshot-crash");
        let snapshots = std::fs::read_dir(&image)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".snap"))
            .count();
        assert_eq!(snapshots, 1, "older snapshots are deleted");
        server.stop().await;
        let mut crashed = Durable::start(state_config(&image, sync)).await.unwrap();
        assert_eq!(crashed.answers(&QUERY).await, before, "sync {sync:?}");
        crashed.stop().await;
    }
}

fn state_config(dir: &Path, sync: SyncPolicy) -> Config {
    let mut config = config(dir);
    config.state.sync = sync;
    config
}

#[tokio::test]
async fn answers_unavailable_and_not_serving_until_the_state_is_loaded() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = config(&temp_dir("ready"));
    let shared = Arc::new(Shared::new(&config).unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(server::run(
        listener,
        shared.clone(),
        stop.clone().cancelled_owned(),
    ));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = |health: tonic_health::pb::HealthCheckResponse| health.status;
    let check = tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    };
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(
        status(health.check(check.clone()).await.unwrap().into_inner()),
        not_serving
    );
    let mut client = KvIndexerClient::new(channel);
    let query = client
        .match_external_kv_prefix(pb::MatchExternalKvPrefixRequest {
            hashes: vec![1],
            max_blocks: 0,
            max_matches: None,
        })
        .await
        .unwrap_err();
    assert_eq!(query.code(), Code::Unavailable, "{query:?}");
    let applied = client
        .apply_external_kv_batch(apply("w", vec![action(REPORT, HBM, &[1])]))
        .await
        .unwrap_err();
    assert_eq!(applied.code(), Code::Unavailable);
    boot::boot(&shared, &config).await.unwrap();
    assert_eq!(
        status(health.check(check).await.unwrap().into_inner()),
        serving
    );
    client
        .apply_external_kv_batch(apply("w", vec![action(REPORT, HBM, &[1])]))
        .await
        .unwrap();
    stop.cancel();
}

#[tokio::test]
async fn an_older_bridge_incarnation_is_fenced_and_changes_nothing_even_after_a_restart() {
    let dir = temp_dir("fence");
    let mut server = Durable::start(config(&dir)).await.unwrap();
    let with = |incarnation: Option<u64>, hashes: &[i64]| {
        let mut request = apply("w", vec![action(REPORT, HBM, hashes)]);
        request.bridge_incarnation = incarnation;
        request
    };
    server.apply(with(Some(5), &[1])).await.unwrap();
    assert_eq!(
        server.apply(with(Some(3), &[2])).await,
        Err(Code::FailedPrecondition)
    );
    assert_eq!(
        server.shared.index_stats().placements,
        1,
        "a fenced apply changes nothing"
    );
    server.apply(with(None, &[3])).await.unwrap();
    server.apply(with(Some(5), &[4])).await.unwrap();
    server.apply(with(Some(6), &[5])).await.unwrap();
    assert_eq!(
        server.apply(with(Some(5), &[6])).await,
        Err(Code::FailedPrecondition)
    );
    server.stop().await;
    let mut restarted = Durable::start(config(&dir)).await.unwrap();
    assert_eq!(
        restarted.apply(with(Some(5), &[7])).await,
        Err(Code::FailedPrecondition)
    );
    assert_eq!(restarted.shared.index_stats().placements, 4);
    restarted.stop().await;
}

#[tokio::test]
async fn a_silent_worker_expires_unless_every_worker_does() {
    let dir = temp_dir("ttl");
    let mut config = config(&dir);
    config.state.worker_ttl = Some(Duration::from_millis(1000));
    let mut server = Durable::start(config.clone()).await.unwrap();
    server
        .apply(apply("alive", vec![action(REPORT, HBM, &[1, 2])]))
        .await
        .unwrap();
    server
        .apply(apply("dead", vec![action(REPORT, HBM, &[2, 3])]))
        .await
        .unwrap();
    // Waiting out the TTL is the behaviour under test.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    server.apply(apply("alive", Vec::new())).await.unwrap();
    server.sweep();
    kv_testkit::wait::until("the dead worker's placements purged", || {
        let placements = server.shared.index_stats().placements;
        async move { (placements == 2).then_some(()) }
    })
    .await;
    // Now both go silent: expiring every live worker at once is refused.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    server.sweep();
    server.snapshot().await;
    assert_eq!(
        server.shared.index_stats().placements,
        2,
        "mass expiry refused"
    );
    server.stop().await;
    // After a restart every worker has a fresh TTL: nothing expires at once.
    let restarted = Durable::start(config).await.unwrap();
    restarted.sweep();
    restarted.snapshot().await;
    assert_eq!(restarted.shared.index_stats().placements, 2);
    restarted.stop().await;
}

/// Starts on `dir` and expects start-up to fail with an error naming `needles`.
async fn refused(dir: &Path, needles: &[&str]) {
    let error = Durable::start(config(dir))
        .await
        .err()
        .expect("start-up must fail");
    let text = kv_common::error_chain(&error);
    for needle in needles {
        assert!(text.contains(needle), "{text:?} lacks {needle:?}");
    }
}

/// A directory with history, a snapshot and a log after it, and the files' paths.
async fn state_with_snapshot(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = temp_dir(name);
    let mut server = Durable::start(config(&dir)).await.unwrap();
    some_history(&mut server).await;
    server.snapshot().await;
    server
        .apply(apply("w-e", vec![action(REPORT, HBM, &[1, 2, 3])]))
        .await
        .unwrap();
    server
        .apply(apply("w-e", vec![action(REPORT, HBM, &[4, 5, 6])]))
        .await
        .unwrap();
    let image = crash_image(&dir, name);
    server.stop().await;
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
    refused(&dir, &[&name, "checksum does not match"]).await;
    // A snapshot of a newer format.
    let (dir, snap, _) = state_with_snapshot("new-snap").await;
    let mut bytes = std::fs::read(&snap).unwrap();
    bytes[8..12].copy_from_slice(&9u32.to_le_bytes());
    std::fs::write(&snap, bytes).unwrap();
    refused(&dir, &["format version 9 is newer"]).await;
    // A flipped byte in the first of the log's two records after the snapshot.
    let (dir, _, seg) = state_with_snapshot("bad-record").await;
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[20 + 12 + 2] ^= 0x01;
    std::fs::write(&seg, bytes).unwrap();
    let name = seg.file_name().unwrap().to_string_lossy().to_string();
    refused(&dir, &[&name, "at byte 20", "checksum"]).await;
    // A truncated tail: the last record is cut with a WARN, the rest recovers.
    let (dir, _, seg) = state_with_snapshot("torn").await;
    let len = std::fs::metadata(&seg).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(len - 5)
        .unwrap();
    let server = Durable::start(config(&dir)).await.unwrap();
    let held = server.shared.export();
    let w_e = held.workers.iter().find(|w| w.id == "w-e").unwrap();
    let hashes: Vec<i64> = w_e.held[0].iter().map(|h| h.hash).collect();
    assert_eq!(
        hashes,
        [1, 2, 3],
        "the torn second apply is gone, the first stays"
    );
    server.stop().await;
}

#[tokio::test]
async fn the_discard_setting_moves_a_corrupt_state_aside_and_starts_empty() {
    let (dir, snap, _) = state_with_snapshot("discard").await;
    let mut bytes = std::fs::read(&snap).unwrap();
    bytes[40] ^= 0xff;
    std::fs::write(&snap, bytes).unwrap();
    let mut config = config(&dir);
    config.state.discard_corrupt = true;
    let server = Durable::start(config).await.unwrap();
    assert_eq!(server.shared.index_stats().placements, 0);
    let aside: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert!(std::fs::read_dir(aside[0].path()).unwrap().count() >= 2);
    server.stop().await;
}

#[tokio::test]
async fn a_second_server_on_the_same_directory_is_refused() {
    let dir = temp_dir("lock");
    let server = Durable::start(config(&dir)).await.unwrap();
    refused(&dir, &["held by another live kv-indexer-server"]).await;
    server.stop().await;
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

/// Runs `steps` on a durable server and, beside it, on a plain index given exactly the
/// acknowledged changes; after every crash (recovery from a crash image of the directory) and
/// at the end, the two must hold the same.
async fn recovered_equals_acknowledged(steps: Vec<Step>) {
    let mut dir = temp_dir("prop");
    let mut server = Durable::start(config(&dir)).await.unwrap();
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
                if server.apply(request).await.is_ok() {
                    reference.apply(&valid);
                }
            }
            Step::CountHits(hashes) => {
                let answer = server
                    .client
                    .match_external_kv(pb::MatchExternalKvRequest {
                        hashes: hashes.clone(),
                        count_as_hit: true,
                    })
                    .await;
                if answer.is_ok() {
                    reference.count_hits(&hashes);
                }
            }
            Step::Snapshot => {
                server.snapshot().await;
            }
            Step::Crash => {
                let image = crash_image(&dir, "prop-crash");
                server.stop().await;
                dir = image;
                server = Durable::start(config(&dir)).await.unwrap();
                assert_eq!(
                    server.shared.export().canonical(),
                    reference.export().canonical(),
                    "after a crash"
                );
            }
        }
    }
    assert_eq!(
        server.shared.digest(),
        kv_state::digest::digest(reference.export())
    );
    server.stop().await;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn recovery_gives_exactly_the_acknowledged_changes(steps in proptest::collection::vec(step(), 1..40)) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(recovered_equals_acknowledged(steps));
    }
}
