//! Replicas on a shared Redis stream, in-process over gRPC against a real `redis-server`:
//! they converge to one index, an answered apply is already in the answering replica's index,
//! a restarted or new replica catches up (from its own snapshot, or a published one after the
//! stream was trimmed), a lost log (`FLUSHALL`) makes every replica start over, an engine
//! outage refuses applies but keeps answering queries until the lag bound, worker expiry is
//! decided once, and a property test: applies sent to random replicas leave every replica
//! equal to one index given the same applies in the order they were answered.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kv_index::Index;
use kv_indexer_proto::convert;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::service::Shared;
use kv_server::{Config, boot, server};
use kv_state::settings::FleetSettings;
use kv_state::stream::StreamConfig;
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;
use proptest::prelude::*;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

const HBM: i32 = pb::TierType::TierHbm as i32;
const REPORT: i32 = pb::ExternalKvActionType::ActionReport as i32;
const REVOKE: i32 = pb::ExternalKvActionType::ActionRevoke as i32;

fn temp_dir(name: &str) -> PathBuf {
    kv_testkit::temp_dir("kv-fleet", name)
}

struct Settings {
    state_dir: Option<PathBuf>,
    snapshot_every: Option<Duration>,
    worker_ttl: Option<Duration>,
    max_lag: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            state_dir: None,
            snapshot_every: None,
            worker_ttl: None,
            max_lag: Duration::from_millis(1000),
        }
    }
}

fn config(redis: &RedisServer, settings: Settings) -> Config {
    Config {
        state: kv_state::settings::Settings {
            dir: settings.state_dir,
            snapshot_interval: settings.snapshot_every,
            fleet: Some(FleetSettings {
                stream: StreamConfig::new(&redis.url(), "test:events", None).unwrap(),
                max_lag: settings.max_lag,
            }),
            worker_ttl: settings.worker_ttl,
            ..Default::default()
        },
        ..Config::default()
    }
}

/// One replica: a server on `127.0.0.1:0` joined to the shared log.
struct Replica {
    shared: Arc<Shared>,
    client: KvIndexerClient<Channel>,
    stop: CancellationToken,
}

impl Replica {
    async fn start(config: Config) -> Replica {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::new(&config).unwrap());
        let stop = CancellationToken::new();
        tokio::spawn(server::run(
            listener,
            shared.clone(),
            stop.clone().cancelled_owned(),
        ));
        boot::boot(&shared, &config).await.unwrap();
        boot::spawn_maintenance(shared.clone(), &config, stop.clone());
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Replica {
            shared,
            client: KvIndexerClient::new(channel),
            stop,
        }
    }

    /// Started and caught up.
    async fn serving(config: Config) -> Replica {
        let replica = Replica::start(config).await;
        replica.wait_fresh().await;
        replica
    }

    async fn wait_fresh(&self) {
        let shared = self.shared.clone();
        wait::until("the replica answers queries", move || {
            let ok = shared.check_fresh().is_ok();
            async move { ok.then_some(()) }
        })
        .await;
    }

    async fn stop(self) {
        self.stop.cancel();
        self.shared.writer().unwrap().stop().await.unwrap();
    }

    async fn apply(&mut self, request: pb::ApplyExternalKvBatchRequest) -> Result<(), Code> {
        self.client
            .apply_external_kv_batch(request)
            .await
            .map(|_| ())
            .map_err(|status| status.code())
    }

    async fn prefix(&mut self, hashes: &[i64]) -> Result<pb::MatchExternalKvPrefixResponse, Code> {
        let request = pb::MatchExternalKvPrefixRequest {
            hashes: hashes.to_vec(),
            max_blocks: 0,
            max_matches: None,
        };
        self.client
            .match_external_kv_prefix(request)
            .await
            .map(|r| r.into_inner())
            .map_err(|status| status.code())
    }

    fn digest(&self) -> String {
        self.shared.digest()
    }
}

/// Waits until every replica's digest is `expected`.
async fn converge(replicas: &[&Replica], expected: &str) {
    for (i, replica) in replicas.iter().enumerate() {
        let shared = replica.shared.clone();
        let expected = expected.to_owned();
        wait::until(&format!("replica {i} converges"), move || {
            let equal = shared.digest() == expected;
            async move { equal.then_some(()) }
        })
        .await;
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

fn report(worker: &str, hashes: &[i64]) -> pb::ApplyExternalKvBatchRequest {
    apply(
        worker,
        vec![pb::ExternalKvAction {
            r#type: REPORT,
            tier: HBM,
            hashes: hashes.to_vec(),
            block_sizes: vec![16; hashes.len()],
            ..Default::default()
        }],
    )
}

/// A stream entry as XRANGE answers it: its id and its fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// The digest of one index given `applies` in order.
fn reference(applies: &[pb::ApplyExternalKvBatchRequest]) -> String {
    let mut index = Index::new();
    for request in applies {
        let valid = convert::apply_request(request.clone()).validate().unwrap();
        index.apply(&valid);
    }
    kv_state::digest::digest(index.export())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_and_an_answered_apply_is_already_in_the_answering_replica() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let mut a = Replica::serving(config(&redis, Settings::default())).await;
    let mut b = Replica::serving(config(&redis, Settings::default())).await;
    let chain: Vec<i64> = (1..=32).collect();
    let mut sent = Vec::new();
    for i in 0..3 {
        let replica = if i == 1 { &mut b } else { &mut a };
        let request = report(&format!("w{i}"), &chain[..8 * (i + 1)]);
        replica.apply(request.clone()).await.unwrap();
        sent.push(request);
        // Read-your-writes: the answering replica holds it already.
        let answer = replica.prefix(&chain).await.unwrap();
        assert!(
            answer
                .matches
                .iter()
                .any(|m| m.worker_id == format!("w{i}")),
            "{answer:?}"
        );
    }
    let expected = reference(&sent);
    converge(&[&a, &b], &expected).await;
    // A revoke through the other replica reaches both.
    let revoke = apply(
        "w0",
        vec![pb::ExternalKvAction {
            r#type: REVOKE,
            tier: HBM,
            hashes: chain[..4].to_vec(),
            ..Default::default()
        }],
    );
    b.apply(revoke.clone()).await.unwrap();
    sent.push(revoke);
    converge(&[&a, &b], &reference(&sent)).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_catches_up_from_its_snapshot_and_the_stream() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let dir = temp_dir("restart");
    let with_dir = || Settings {
        state_dir: Some(dir.clone()),
        snapshot_every: Some(Duration::from_millis(200)),
        ..Settings::default()
    };
    let mut a = Replica::serving(config(&redis, with_dir())).await;
    let mut b = Replica::serving(config(&redis, Settings::default())).await;
    let mut sent = Vec::new();
    for i in 0..20 {
        let request = report(&format!("w{}", i % 3), &[i, i + 100]);
        a.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    // Give a snapshot time to be written, then stop A (its final snapshot).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    a.stop().await;
    let snapshots: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("fleet-"))
        .flat_map(|e| std::fs::read_dir(e.path()).unwrap().flatten())
        .collect();
    assert!(!snapshots.is_empty(), "no local snapshot in {dir:?}");
    // While A is down, B takes more applies.
    for i in 20..30 {
        let request = report("w9", &[i]);
        b.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    let a = Replica::serving(config(&redis, with_dir())).await;
    let expected = reference(&sent);
    assert_eq!(a.digest(), expected, "caught up as soon as it serves");
    converge(&[&b], &expected).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_replica_bootstraps_from_the_published_snapshot_once_the_stream_is_trimmed() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let publishing = || Settings {
        snapshot_every: Some(Duration::from_millis(100)),
        ..Settings::default()
    };
    let mut a = Replica::serving(config(&redis, publishing())).await;
    let mut sent = Vec::new();
    for i in 0..50 {
        let request = report(&format!("w{}", i % 4), &[i * 7, i * 7 + 1]);
        a.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    // Wait until a snapshot covering everything is published and the stream trimmed.
    let url = redis.url();
    wait::until("the stream is trimmed below a published snapshot", || {
        let first = first_position(&url);
        async move { first.is_some_and(|f| f >= 40).then_some(()) }
    })
    .await;
    let c = Replica::serving(config(&redis, Settings::default())).await;
    assert_eq!(c.digest(), reference(&sent));
    let first = first_position(&url).unwrap();
    assert!(first > 0, "the stream was trimmed (first entry {first})");
    a.stop().await;
    c.stop().await;
}

/// The position of the stream's first entry.
fn first_position(url: &str) -> Option<u64> {
    let mut connection = redis::Client::open(url).ok()?.get_connection().ok()?;
    let reply: Vec<(String, redis::Value)> = redis::cmd("XRANGE")
        .arg("test:events")
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query(&mut connection)
        .ok()?;
    let id = &reply.first()?.0;
    id.strip_prefix("0-")?.parse::<u64>().ok()?.checked_sub(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_log_makes_every_replica_start_over_instead_of_serving_what_it_no_longer_explains() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let mut a = Replica::serving(config(&redis, Settings::default())).await;
    let b = Replica::serving(config(&redis, Settings::default())).await;
    let before = report("w-old", &[1, 2, 3]);
    a.apply(before.clone()).await.unwrap();
    converge(&[&a, &b], &reference(&[before])).await;
    redis.command(&["FLUSHALL"]);
    // Both notice (epoch gone) and start over from the (empty) new log.
    converge(&[&a, &b], &reference(&[])).await;
    a.wait_fresh().await;
    let after = report("w-new", &[9]);
    wait::until_ok("an apply after the flush", || {
        let (request, client) = (after.clone(), a.client.clone());
        async move {
            let mut client = client;
            client.apply_external_kv_batch(request).await
        }
    })
    .await;
    converge(&[&a, &b], &reference(&[after])).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_lost_and_refilled_by_others_make_a_replica_start_over() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let mut a = Replica::serving(config(&redis, Settings::default())).await;
    let sent: Vec<_> = (0..3).map(|i| report(&format!("w{i}"), &[i])).collect();
    for request in &sent {
        a.apply(request.clone()).await.unwrap();
    }
    converge(&[&a], &reference(&sent)).await;
    // A failover without persistence: the stream comes back without its last entry (the
    // epoch survives), and another replica's apply takes that position.
    let mut connection = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let kept: Vec<StreamEntry> = redis::cmd("XRANGE")
        .arg("test:events")
        .arg("-")
        .arg("+")
        .query(&mut connection)
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg("test:events")
        .query(&mut connection)
        .unwrap();
    for (id, fields) in &kept[..2] {
        let mut add = redis::cmd("XADD");
        add.arg("test:events").arg(id);
        for (field, value) in fields {
            add.arg(field).arg(value);
        }
        let _: String = add.query(&mut connection).unwrap();
    }
    let other = report("w-other", &[42]);
    let record = kv_state::record::Record {
        time_ms: 1,
        change: kv_state::record::Change::Apply(other.clone()),
    };
    let _: String = redis::cmd("XADD")
        .arg("test:events")
        .arg("0-3")
        .arg("r")
        .arg("someone-else:1")
        .arg("d")
        .arg(record.encode())
        .query(&mut connection)
        .unwrap();
    // A notices its last entry changed hands and rebuilds from the log as it now is.
    let expected = reference(&[sent[0].clone(), sent[1].clone(), other]);
    converge(&[&a], &expected).await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_outage_refuses_applies_answers_queries_until_the_lag_bound_then_resumes() {
    let Some(mut redis) = RedisServer::start(true) else {
        return;
    };
    let settings = || Settings {
        max_lag: Duration::from_millis(1500),
        ..Settings::default()
    };
    let mut a = Replica::serving(config(&redis, settings())).await;
    let first = report("w1", &[1, 2]);
    a.apply(first.clone()).await.unwrap();
    // AOF is written every second: let it cover the first apply.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    redis.kill();
    assert_eq!(a.apply(report("w2", &[3])).await, Err(Code::Unavailable));
    let answer = a.prefix(&[1, 2]).await.expect("answered from memory");
    assert_eq!(answer.matches.len(), 1);
    wait::until("queries answer UNAVAILABLE past the lag bound", || {
        let mut client = a.client.clone();
        async move {
            let request = pb::MatchExternalKvPrefixRequest {
                hashes: vec![1],
                max_blocks: 0,
                max_matches: None,
            };
            client
                .match_external_kv_prefix(request)
                .await
                .is_err_and(|s| s.code() == Code::Unavailable)
                .then_some(())
        }
    })
    .await;
    redis.restart();
    a.wait_fresh().await;
    let second = report("w3", &[4]);
    a.apply(second.clone()).await.unwrap();
    assert_eq!(a.digest(), reference(&[first, second]));
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_expiry_is_decided_once_through_the_log() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let ttl = || Settings {
        worker_ttl: Some(Duration::from_millis(1500)),
        ..Settings::default()
    };
    let mut a = Replica::serving(config(&redis, ttl())).await;
    let b = Replica::serving(config(&redis, ttl())).await;
    a.apply(report("w-dead", &[1, 2])).await.unwrap();
    // w-live keeps sending (as a bridge's heartbeat would); w-dead goes silent.
    for i in 0..12 {
        a.apply(report("w-live", &[100 + i])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let shared = a.shared.clone();
    wait::until("w-dead is expired", move || {
        let matches = shared
            .export()
            .workers
            .iter()
            .any(|w| w.id == "w-dead" && w.held.iter().all(|tier| tier.is_empty()));
        async move { matches.then_some(()) }
    })
    .await;
    let digest = a.digest();
    converge(&[&b], &digest).await;
    a.stop().await;
    b.stop().await;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    /// Applies sent to random replicas, each answered before the next is sent: every replica
    /// ends equal to one index given the same applies in that order.
    #[test]
    fn replicas_equal_one_index_given_the_answered_applies_in_order(
        applies in prop::collection::vec(
            (0usize..3, 0usize..4, prop::collection::vec(0i64..64, 1..12), any::<bool>()),
            1..40,
        )
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let Some(redis) = RedisServer::start(false) else {
                return;
            };
            let mut replicas = Vec::new();
            for _ in 0..3 {
                replicas.push(Replica::serving(config(&redis, Settings::default())).await);
            }
            let mut sent = Vec::new();
            for (to, worker, hashes, revoke) in applies {
                let request = match revoke {
                    false => report(&format!("w{worker}"), &hashes),
                    true => apply(
                        &format!("w{worker}"),
                        vec![pb::ExternalKvAction {
                            r#type: REVOKE,
                            tier: HBM,
                            hashes,
                            ..Default::default()
                        }],
                    ),
                };
                replicas[to].apply(request.clone()).await.unwrap();
                sent.push(request);
            }
            let expected = reference(&sent);
            let all: Vec<&Replica> = replicas.iter().collect();
            converge(&all, &expected).await;
            for replica in replicas {
                replica.stop().await;
            }
        });
    }
}
