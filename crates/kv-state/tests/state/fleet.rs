//! Replicas on a shared Redis stream through the state's own API (no gRPC), against a real
//! `redis-server`: they converge to one index, an answered apply is already in the answering
//! replica's index, a restarted or new replica catches up (from its own snapshot, or a
//! published one after the stream was trimmed), a lost log (`FLUSHALL`) makes every replica
//! start over, a Redis outage refuses applies but keeps answering queries until the lag
//! bound, an idle fleet costs Redis a few commands a second, worker expiry is decided
//! once, an operator's drop reaches every replica, and a property test: applies sent to random replicas leave every replica equal to one
//! index given the same applies in the order they were answered.

use std::path::PathBuf;
use std::time::Duration;

use kv_index::Index;
use kv_indexer_proto::convert;
use kv_indexer_proto::v1 as pb;
use kv_state::clock::Clock;
use kv_state::config::{FleetConfig, StateConfig};
use kv_state::error::ChangeError;
use kv_state::stream::StreamConfig;
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;
use proptest::prelude::*;

use crate::common::{State, report, revoke};

/// What a test sets of a replica's settings.
struct ReplicaSettings {
    state_dir: Option<PathBuf>,
    snapshot_every: Option<Duration>,
    worker_ttl: Option<Duration>,
    clock: Clock,
    max_lag: Duration,
}

impl Default for ReplicaSettings {
    fn default() -> ReplicaSettings {
        ReplicaSettings {
            state_dir: None,
            snapshot_every: None,
            worker_ttl: None,
            clock: Clock::default(),
            max_lag: Duration::from_millis(1000),
        }
    }
}

fn settings(redis: &RedisServer, replica: ReplicaSettings) -> StateConfig {
    StateConfig {
        dir: replica.state_dir,
        snapshot_interval: replica.snapshot_every,
        fleet: Some(FleetConfig {
            stream: StreamConfig::new(&redis.url(), "test:events", None).unwrap(),
            max_lag: replica.max_lag,
        }),
        worker_ttl: replica.worker_ttl,
        clock: replica.clock,
        ..Default::default()
    }
}

/// A replica started and caught up.
async fn serving(redis: &RedisServer, replica: ReplicaSettings) -> State {
    let state = State::open(settings(redis, replica)).await.unwrap();
    assert!(state.freshness.is_some(), "a replica has a freshness");
    wait_fresh(&state).await;
    state
}

async fn wait_fresh(state: &State) {
    wait::until_ok("the replica answers queries", || {
        let fresh = state.check();
        async move { fresh }
    })
    .await;
}

/// Waits until every replica's digest is `expected`.
async fn converge(replicas: &[&State], expected: &str) {
    for (i, replica) in replicas.iter().enumerate() {
        wait::until(&format!("replica {i} converges"), || {
            let equal = replica.digest() == expected;
            async move { equal.then_some(()) }
        })
        .await;
    }
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
    let a = serving(&redis, ReplicaSettings::default()).await;
    let b = serving(&redis, ReplicaSettings::default()).await;
    let chain: Vec<i64> = (1..=32).collect();
    let mut sent = Vec::new();
    for i in 0..3 {
        let replica = if i == 1 { &b } else { &a };
        let request = report(&format!("w{i}"), &chain[..8 * (i + 1)]);
        replica.apply(request.clone()).await.unwrap();
        sent.push(request);
        // Read-your-writes: the answering replica holds it already.
        let answer = replica.prefix(&chain).unwrap();
        assert!(
            answer
                .matches
                .iter()
                .any(|m| m.worker_id == format!("w{i}")),
            "{answer:?}"
        );
    }
    converge(&[&a, &b], &reference(&sent)).await;
    // A revoke through the other replica reaches both.
    let revoke = revoke("w0", &chain[..4]);
    b.apply(revoke.clone()).await.unwrap();
    sent.push(revoke);
    converge(&[&a, &b], &reference(&sent)).await;
    a.stop().await;
    b.stop().await;
}

/// The commands Redis has answered since its statistics were last reset
/// (`INFO commandstats`: `cmdstat_<name>:calls=<n>,…` per command).
fn redis_calls(redis: &RedisServer) -> Vec<(String, u64)> {
    let info = match redis.command(&["INFO", "commandstats"]) {
        redis::Value::BulkString(bytes) => String::from_utf8(bytes).unwrap(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("INFO answered {other:?}"),
    };
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// An idle fleet waits in Redis: two replicas at the stream's head, with no traffic,
/// cost Redis a few commands a second each (a blocking read per 100 ms, the upkeep once
/// a second), not a read answered at once in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_fleet_costs_redis_a_few_commands_a_second_per_replica() {
    let Some(redis) = RedisServer::start(true) else {
        return;
    };
    let a = serving(&redis, ReplicaSettings::default()).await;
    let b = serving(&redis, ReplicaSettings::default()).await;
    let sent: Vec<_> = (0..4)
        .map(|i| report(&format!("w{i}"), &[i, i + 1]))
        .collect();
    for (i, request) in sent.iter().enumerate() {
        let replica = if i % 2 == 0 { &a } else { &b };
        replica.apply(request.clone()).await.unwrap();
    }
    converge(&[&a, &b], &reference(&sent)).await;
    redis.command(&["CONFIG", "RESETSTAT"]);
    let idle = Duration::from_secs(3);
    let start = std::time::Instant::now();
    tokio::time::sleep(idle).await;
    let calls = redis_calls(&redis);
    let seconds = start.elapsed().as_secs_f64();
    let total: u64 = calls.iter().map(|(_, n)| n).sum();
    let per_replica_per_second = total as f64 / seconds / 2.0;
    eprintln!(
        "idle for {seconds:.1} s: {per_replica_per_second:.1} commands/s per replica: {calls:?}"
    );
    assert!(
        per_replica_per_second <= 20.0,
        "an idle replica costs Redis {per_replica_per_second:.1} commands/s (at most 20): {calls:?}"
    );
    // Still live: an apply after the idle interval reaches both.
    let late = report("w-late", &[99]);
    b.apply(late.clone()).await.unwrap();
    let mut all = sent.clone();
    all.push(late);
    converge(&[&a, &b], &reference(&all)).await;
    a.stop().await;
    b.stop().await;
}

/// The local snapshots under `dir` (a replica keeps them in `fleet-<epoch>/`).
fn local_snapshots(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("fleet-"))
        .map(|e| kv_state::snapshot::list(&e.path()).map_or(0, |s| s.len()))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_catches_up_from_its_snapshot_and_the_stream() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let dir = kv_testkit::temp_dir("kv-state-fleet", "restart");
    let with_dir = || ReplicaSettings {
        state_dir: Some(dir.clone()),
        snapshot_every: Some(Duration::from_millis(200)),
        ..ReplicaSettings::default()
    };
    let a = serving(&redis, with_dir()).await;
    let b = serving(&redis, ReplicaSettings::default()).await;
    let mut sent = Vec::new();
    for i in 0..20 {
        let request = report(&format!("w{}", i % 3), &[i, i + 100]);
        a.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    // A periodic snapshot is written, then A stops (its final snapshot).
    wait::until("a local snapshot in the state directory", || {
        let written = local_snapshots(&dir) > 0;
        async move { written.then_some(()) }
    })
    .await;
    a.stop().await;
    assert!(local_snapshots(&dir) > 0, "no local snapshot in {dir:?}");
    // While A is down, B takes more applies.
    for i in 20..30 {
        let request = report("w9", &[i]);
        b.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    let a = serving(&redis, with_dir()).await;
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
    let publishing = ReplicaSettings {
        snapshot_every: Some(Duration::from_millis(100)),
        ..ReplicaSettings::default()
    };
    // Applies first, by a replica that publishes nothing; then the publisher, whose first
    // snapshot covers all of them.
    let quiet = serving(&redis, ReplicaSettings::default()).await;
    let mut sent = Vec::new();
    let url = redis.url();
    for i in 0..50 {
        let request = report(&format!("w{}", i % 4), &[i * 7, i * 7 + 1]);
        quiet.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    quiet.stop().await;
    let a = serving(&redis, publishing).await;
    // The first publication trims nothing: a replica cut off while it was built still finds
    // the entries after its position.
    wait::until("a snapshot of everything is published", || {
        let published = published_position(&url);
        async move { published.is_some_and(|p| p >= 50).then_some(()) }
    })
    .await;
    assert_eq!(
        first_position(&url),
        Some(0),
        "trimmed below the new snapshot"
    );
    for i in 50..60 {
        let request = report(&format!("w{}", i % 4), &[i * 7, i * 7 + 1]);
        a.apply(request.clone()).await.unwrap();
        sent.push(request);
    }
    // The next one trims below the one it replaces (approximately: whole nodes).
    wait::until("the stream is trimmed below the replaced snapshot", || {
        let first = first_position(&url);
        async move { first.is_some_and(|f| f > 0).then_some(()) }
    })
    .await;
    assert!(first_position(&url).is_some_and(|f| f < 50));
    let c = serving(&redis, ReplicaSettings::default()).await;
    assert_eq!(c.digest(), reference(&sent));
    a.stop().await;
    c.stop().await;
}

/// The position of the published snapshot.
fn published_position(url: &str) -> Option<u64> {
    let mut connection = redis::Client::open(url).ok()?.get_connection().ok()?;
    redis::cmd("HGET")
        .arg("test:events:snapshot")
        .arg("position")
        .query(&mut connection)
        .ok()?
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
    let a = serving(&redis, ReplicaSettings::default()).await;
    let b = serving(&redis, ReplicaSettings::default()).await;
    let before = report("w-old", &[1, 2, 3]);
    a.apply(before.clone()).await.unwrap();
    converge(&[&a, &b], &reference(&[before])).await;
    redis.command(&["FLUSHALL"]);
    // Both notice (epoch gone) and start over from the (empty) new log.
    converge(&[&a, &b], &reference(&[])).await;
    wait_fresh(&a).await;
    let after = report("w-new", &[9]);
    wait::until_ok("an apply after the flush", || a.apply(after.clone())).await;
    converge(&[&a, &b], &reference(&[after])).await;
    a.stop().await;
    b.stop().await;
}

/// An append names the history it is for: a Redis that lost the log (another epoch, or none,
/// such as a primary restarted empty) refuses it and holds nothing of it, instead of taking
/// entries no replica will read.
#[test]
fn an_append_to_another_history_is_refused_and_leaves_nothing() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let config = StreamConfig::new(&redis.url(), "test:events", None).unwrap();
    let mut stream = config.connect().unwrap();
    let entry = |n: u64| (format!("r:{n}"), vec![n as u8; 3]);
    let refused = |stream: &mut kv_state::stream::Stream, epoch: &str| {
        let error = stream.append(epoch, &[entry(9)]).unwrap_err();
        let message = kv_common::error_chain(&error);
        assert!(message.contains("history"), "{message}");
    };
    // No epoch yet: nothing to append to.
    refused(&mut stream, "e1");
    assert_eq!(stream.epoch("e1").unwrap(), "e1");
    assert_eq!(
        stream.append("e1", &[entry(1), entry(2)]).unwrap(),
        vec![0, 1]
    );
    refused(&mut stream, "e2");
    redis.command(&["DEL", "test:events:epoch"]);
    refused(&mut stream, "e1");
    assert_eq!(
        stream.bounds().unwrap(),
        Some((0, 1)),
        "nothing refused was appended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_lost_and_refilled_by_others_make_a_replica_start_over() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let a = serving(&redis, ReplicaSettings::default()).await;
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
async fn a_redis_outage_refuses_applies_answers_queries_until_the_lag_bound_then_resumes() {
    let Some(mut redis) = RedisServer::start(true) else {
        return;
    };
    let max_lag = ReplicaSettings {
        max_lag: Duration::from_millis(1500),
        ..ReplicaSettings::default()
    };
    let a = serving(&redis, max_lag).await;
    // Every write in the append-only file before it is answered: the first apply survives
    // the kill below.
    redis.command(&["CONFIG", "SET", "appendfsync", "always"]);
    let first = report("w1", &[1, 2]);
    a.apply(first.clone()).await.unwrap();
    redis.kill();
    let refused = a.apply(report("w2", &[3])).await;
    assert!(
        matches!(refused, Err(ChangeError::SharedLog(_))),
        "{refused:?}"
    );
    let answer = a.prefix(&[1, 2]).expect("answered from memory");
    assert_eq!(answer.matches.len(), 1);
    wait::until_ok("queries refused as stale past the lag bound", || {
        let answer = a.prefix(&[1]);
        let stale = matches!(
            answer,
            Err(ChangeError::Stale { lag_ms, max_ms: 1500 }) if lag_ms > 1500
        );
        async move { if stale { Ok(()) } else { Err(answer) } }
    })
    .await;
    redis.restart();
    wait_fresh(&a).await;
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
    let clock = Clock::default();
    let ttl = || ReplicaSettings {
        worker_ttl: Some(Duration::from_millis(1500)),
        clock: clock.clone(),
        ..ReplicaSettings::default()
    };
    let a = serving(&redis, ttl()).await;
    let b = serving(&redis, ttl()).await;
    a.apply(report("w-dead", &[1, 2])).await.unwrap();
    // w-live keeps sending (as a bridge's heartbeat would); w-dead goes silent.
    for i in 0..3 {
        a.apply(report("w-live", &[100 + i])).await.unwrap();
        clock.advance(Duration::from_millis(1000));
    }
    a.apply(report("w-live", &[103])).await.unwrap();
    wait::until("w-dead is expired", || {
        let expired = a
            .export()
            .workers
            .iter()
            .any(|w| w.id == "w-dead" && w.held.iter().all(|tier| tier.is_empty()));
        async move { expired.then_some(()) }
    })
    .await;
    let live = a.export();
    let live = live.workers.iter().find(|w| w.id == "w-live").unwrap();
    assert!(
        live.held.iter().any(|tier| !tier.is_empty()),
        "w-live kept its placements"
    );
    converge(&[&b], &a.digest()).await;
    a.stop().await;
    b.stop().await;
}

/// An operator's drop through one replica is an entry of the log: every replica drops the
/// worker, and each one's meta says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_through_one_replica_reaches_every_replica() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let a = serving(&redis, ReplicaSettings::default()).await;
    let b = serving(&redis, ReplicaSettings::default()).await;
    let sent = [report("gone", &[1, 2, 3]), report("kept", &[1, 2])];
    for request in &sent {
        a.apply(request.clone()).await.unwrap();
    }
    assert_eq!(b.writer.drop_worker("gone".into()).await.unwrap(), 3);
    assert_eq!(
        b.held(&[1, 2, 3]),
        2,
        "read-your-writes: b has applied its drop"
    );
    wait::until("a applies the drop", || {
        let held = a.held(&[1, 2, 3]);
        async move { (held == 2).then_some(()) }
    })
    .await;
    converge(&[&b], &a.digest()).await;
    for replica in [&a, &b] {
        let meta = replica.writer.workers().await.unwrap();
        assert!(meta["gone"].expired && !meta["kept"].expired, "{meta:?}");
    }
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
                replicas.push(serving(&redis, ReplicaSettings::default()).await);
            }
            let mut sent = Vec::new();
            for (to, worker, hashes, is_revoke) in applies {
                let worker = format!("w{worker}");
                let request = match is_revoke {
                    false => report(&worker, &hashes),
                    true => revoke(&worker, &hashes),
                };
                replicas[to].apply(request.clone()).await.unwrap();
                sent.push(request);
            }
            let expected = reference(&sent);
            let all: Vec<&State> = replicas.iter().collect();
            converge(&all, &expected).await;
            for replica in replicas {
                replica.stop().await;
            }
        });
    }
}
