//! The durable state behind the gRPC face, in-process: a restarted server answers its clients
//! exactly what it answered before (after a clean stop and from a crash image of its
//! directory), health says NOT_SERVING and every RPC UNAVAILABLE until the state is loaded, and
//! a fenced bridge is answered FAILED_PRECONDITION. What the state itself does (snapshots,
//! fencing, expiry, corruption, the lock, the crash property test) is tested through its own
//! API in `kv-state`'s tests.

use std::path::Path;

use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, boot};
use kv_testkit::booted::{BootedServer, Listening};
use kv_testkit::indexer::prefix_request;
use kv_testkit::indexer::{CLEAR, DRAM, HBM, REPORT, REVOKE, action, apply_request as apply};
use tonic::Code;
use tonic::transport::Channel;

/// Where this file's directories go (`kv_testkit::temp_dir`, `kv_testkit::crash_image`).
const PREFIX: &str = "kv-durable";

fn config(dir: &Path) -> Config {
    Config {
        state: kv_state::config::StateConfig {
            dir: Some(dir.to_path_buf()),
            snapshot_interval: None,
            ..Default::default()
        },
        ..Config::default()
    }
}

/// Every answer a router can get for `hashes`, and the digest.
async fn answers(server: &mut BootedServer, hashes: &[i64]) -> String {
    let (hashes, client) = (hashes.to_vec(), &mut server.client);
    let prefix = prefix_request(hashes.clone());
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
    format!("{answers:?}\n{}", server.shared.digest())
}

/// Some history: reports on two tiers, a revoke in the middle of a chain, a clear, hits.
async fn some_history(server: &mut BootedServer) {
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
    let dir = kv_testkit::temp_dir(PREFIX, "restart");
    let mut server = BootedServer::start(config(&dir)).await;
    some_history(&mut server).await;
    let before = answers(&mut server, &QUERY).await;
    // A crash: the files as they are, no final snapshot.
    let image = kv_testkit::crash_image(&dir, PREFIX, "restart-crash");
    server.stop().await;
    let mut restarted = BootedServer::start(config(&dir)).await;
    assert_eq!(
        answers(&mut restarted, &QUERY).await,
        before,
        "after a clean stop"
    );
    assert!(restarted.shared.index_stats().placements > 0);
    restarted.stop().await;
    let mut crashed = BootedServer::start(config(&image)).await;
    assert_eq!(answers(&mut crashed, &QUERY).await, before, "after a crash");
    crashed.stop().await;
}

#[tokio::test]
async fn answers_unavailable_and_not_serving_until_the_state_is_loaded() {
    let config = config(&kv_testkit::temp_dir(PREFIX, "ready"));
    let Listening {
        addr, shared, stop, ..
    } = Listening::start(&config).await;
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
            include_predictions: None,
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
async fn an_older_bridge_incarnation_is_answered_failed_precondition() {
    let mut server = BootedServer::start(config(&kv_testkit::temp_dir(PREFIX, "fence"))).await;
    let with = |incarnation: u64, hashes: &[i64]| {
        let mut request = apply("w", vec![action(REPORT, HBM, hashes)]);
        request.bridge_incarnation = Some(incarnation);
        request
    };
    server.apply(with(5, &[1])).await.unwrap();
    assert_eq!(
        server.apply(with(3, &[2])).await,
        Err(Code::FailedPrecondition)
    );
    assert_eq!(server.shared.index_stats().placements, 1);
    server.stop().await;
}
