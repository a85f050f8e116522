//! Replicas on a shared Redis stream behind the gRPC face, in-process against a real
//! `redis-server`: they converge to one index over gRPC, and an engine outage is what a client
//! sees as UNAVAILABLE, for applies at once and for queries once the replica is staler than its
//! bound. What the fleet itself does (catching up, bootstrapping from a published snapshot, a
//! lost log, expiry, the convergence property test) is tested through the state's own API in
//! `kv-state`'s tests.

use std::sync::Arc;
use std::time::Duration;

use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::service::Shared;
use kv_server::{Config, boot, server};
use kv_state::settings::FleetSettings;
use kv_state::stream::StreamConfig;
use kv_testkit::TestIndexer;
use kv_testkit::indexer::{HBM, REPORT, REVOKE, action, apply_request, prefix_request};
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

/// A replica's configuration: the shared log on `redis`, queries refused past `max_lag`.
fn config(redis: &RedisServer, max_lag: Duration) -> Config {
    Config {
        state: kv_state::settings::Settings {
            fleet: Some(FleetSettings {
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
        self.client
            .match_external_kv_prefix(prefix_request(hashes.to_vec()))
            .await
            .map(|r| r.into_inner())
            .map_err(|status| status.code())
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
    let mut a = Replica::serving(config(&redis, MAX_LAG)).await;
    let mut b = Replica::serving(config(&redis, MAX_LAG)).await;
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
async fn an_engine_outage_is_unavailable_to_applies_at_once_and_to_queries_past_the_lag_bound() {
    let Some(mut redis) = RedisServer::start(false) else {
        return;
    };
    let mut a = Replica::serving(config(&redis, Duration::from_millis(1500))).await;
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
