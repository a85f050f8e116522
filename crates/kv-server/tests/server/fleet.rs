//! Replicas on a shared Redis stream behind the gRPC face, in-process against a real
//! `redis-server`: they converge to one index over gRPC, and a Redis outage is what a client
//! sees as UNAVAILABLE, for applies at once and for queries once the replica is staler than its
//! bound. What the fleet itself does (catching up, bootstrapping from a published snapshot, a
//! lost log, expiry, the convergence property test) is tested through the state's own API in
//! `kv-state`'s tests.

use std::time::Duration;

use kv_indexer_proto::v1 as pb;
use kv_server::Config;
use kv_state::config::FleetConfig;
use kv_state::stream::StreamConfig;
use kv_testkit::TestIndexer;
use kv_testkit::booted::BootedServer;
use kv_testkit::indexer::{HBM, REPORT, REVOKE, action, apply_request, prefix_request};
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;
use tonic::Code;

/// A replica's configuration: the shared log on `redis`, queries refused past `max_lag`.
fn config(redis: &RedisServer, max_lag: Duration) -> Config {
    Config {
        state: kv_state::config::StateConfig {
            fleet: Some(FleetConfig {
                stream: StreamConfig::new(&redis.url(), "test:events", None).unwrap(),
                max_lag,
            }),
            worker_ttl: None,
            ..Default::default()
        },
        ..Config::default()
    }
}

const MAX_LAG: Duration = Duration::from_millis(1000);

/// Waits until every replica's digest is `expected`.
async fn converge(replicas: &[&BootedServer], expected: &str) {
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

/// A REPORT of `hashes` at HBM by `worker`.
fn report(worker: &str, hashes: &[i64]) -> pb::ApplyExternalKvBatchRequest {
    apply_request(worker, vec![action(REPORT, HBM, hashes)])
}

/// The digest of one in-memory server given `applies` in order over gRPC: what every replica
/// must hold.
async fn reference(applies: &[pb::ApplyExternalKvBatchRequest]) -> String {
    let single = TestIndexer::start().await;
    let mut client = single.client();
    for request in applies {
        client
            .apply_external_kv_batch(request.clone())
            .await
            .unwrap();
    }
    single.shared.digest()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_and_an_answered_apply_is_already_in_the_answering_replica() {
    let Some(redis) = RedisServer::start(false) else {
        return;
    };
    let mut a = BootedServer::serving(config(&redis, MAX_LAG)).await;
    let mut b = BootedServer::serving(config(&redis, MAX_LAG)).await;
    let chain: Vec<i64> = (1..=32).collect();
    let mut sent = Vec::new();
    for i in 0..3 {
        let replica = if i == 1 { &mut b } else { &mut a };
        let request = report(&format!("w{i}"), &chain[..8 * (i + 1)]);
        replica.apply(request.clone()).await.unwrap();
        sent.push(request);
        // Read-your-writes: the answering replica holds it already, its whole prefix.
        let answer = replica.prefix(&chain).await.unwrap();
        let worker = format!("w{i}");
        let held = answer.matches.iter().find(|m| m.worker_id == worker);
        let blocks = held.map(|m| m.matched_prefix_blocks as usize);
        assert_eq!(blocks, Some(8 * (i + 1)), "{answer:?}");
    }
    let expected = reference(&sent).await;
    converge(&[&a, &b], &expected).await;
    // A revoke through the other replica reaches both.
    let revoke = apply_request("w0", vec![action(REVOKE, HBM, &chain[..4])]);
    b.apply(revoke.clone()).await.unwrap();
    sent.push(revoke);
    converge(&[&a, &b], &reference(&sent).await).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_is_unavailable_to_applies_at_once_and_to_queries_past_the_lag_bound() {
    let Some(mut redis) = RedisServer::start(false) else {
        return;
    };
    let mut a = BootedServer::serving(config(&redis, Duration::from_millis(1500))).await;
    a.apply(report("w1", &[1, 2])).await.unwrap();
    redis.kill();
    assert_eq!(a.apply(report("w2", &[3])).await, Err(Code::Unavailable));
    let answer = a.prefix(&[1, 2]).await.expect("answered from memory");
    assert_eq!(answer.matches.len(), 1);
    wait::until_ok("queries answered UNAVAILABLE as stale", || {
        let mut client = a.client.clone();
        async move {
            match client
                .match_external_kv_prefix(prefix_request(vec![1]))
                .await
            {
                Err(status)
                    if status.code() == Code::Unavailable
                        && status.message().contains("behind the shared log") =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    a.stop().await;
}
