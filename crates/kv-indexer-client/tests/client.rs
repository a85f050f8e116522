//! The client against the real server on loopback: answers, every failure outcome the router
//! contract names, replica fail-over, the local admission bound and long-prompt truncation.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kv_indexer_client::{
    ClientConfig, ClientError, Code, Endpoint, HitCount, IndexerClient, MAX_PREFIX_HASHES,
    NodeMatch, PrefixMatch, PrefixOutcome, Tier, TierPlacements,
};
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, Shared, server};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const HBM: i32 = pb::TierType::TierHbm as i32;
const DRAM: i32 = pb::TierType::TierDram as i32;
const REPORT: i32 = pb::ExternalKvActionType::ActionReport as i32;

/// A server on `127.0.0.1:0`, stopped when dropped.
struct TestServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: CancellationToken,
}

impl TestServer {
    async fn start(config: Config) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = server::shared(&config);
        let stop = CancellationToken::new();
        tokio::spawn(server::run(
            listener,
            shared.clone(),
            stop.clone().cancelled_owned(),
        ));
        TestServer { shared, addr, stop }
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint::parse(&format!("http://{}", self.addr)).unwrap()
    }

    /// REPORTs `hashes` for `worker` at `tier`, 16,384 per apply.
    async fn report(&self, worker: &str, tier: i32, hashes: &[i64]) {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = KvIndexerClient::new(channel);
        for chunk in hashes.chunks(16_384) {
            client
                .apply_external_kv_batch(pb::ApplyExternalKvBatchRequest {
                    worker_id: worker.into(),
                    seq: 1,
                    actions: vec![pb::ExternalKvAction {
                        r#type: REPORT,
                        tier,
                        hashes: chunk.to_vec(),
                        ..Default::default()
                    }],
                    worker_address: address(worker),
                    cache_spec: None,
                    bridge_incarnation: None,
                })
                .await
                .unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn address(worker: &str) -> String {
    format!("http://{worker}:30000")
}

/// A client with a deadline no test machine misses, unless `tune` changes it.
fn client(endpoints: Vec<Endpoint>, tune: impl FnOnce(&mut ClientConfig)) -> IndexerClient {
    let mut config = ClientConfig::new(endpoints);
    config.query_timeout = Duration::from_secs(30);
    tune(&mut config);
    IndexerClient::new(config).unwrap()
}

/// An address nothing listens on: bound, read, released.
async fn dead_endpoint() -> Endpoint {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    Endpoint::parse(&format!("http://{addr}")).unwrap()
}

fn matched(worker: &str, blocks: u32) -> PrefixMatch {
    PrefixMatch {
        worker_address: address(worker),
        worker_id: worker.into(),
        matched_prefix_blocks: blocks,
    }
}

#[tokio::test]
async fn matches_after_an_apply() {
    let server = TestServer::start(Config::default()).await;
    server.report("a", HBM, &[1, 2, 3]).await;
    server.report("b", DRAM, &[1, 2]).await;
    let client = client(vec![server.endpoint()], |_| {});
    assert_eq!(
        client.longest_prefix(&[1, 2, 3, 4]).await,
        PrefixOutcome::Matched {
            matches: vec![matched("a", 3), matched("b", 2)],
            best_prefix_blocks: 3,
            query_blocks: 4,
            blocks_read: 4,
        }
    );
    assert_eq!(client.queries_in_flight(), 0);
}

#[tokio::test]
async fn reports_no_match_when_no_worker_holds_the_first_block() {
    let server = TestServer::start(Config::default()).await;
    server.report("a", HBM, &[1, 2, 3]).await;
    let client = client(vec![server.endpoint()], |_| {});
    assert_eq!(
        client.longest_prefix(&[9, 1, 2]).await,
        PrefixOutcome::NoMatch
    );
    assert_eq!(client.longest_prefix(&[]).await, PrefixOutcome::NoMatch);
}

#[tokio::test]
async fn reports_a_stopped_server_as_unreachable() {
    let client = client(vec![dead_endpoint().await], |_| {});
    assert_eq!(
        client.longest_prefix(&[1, 2]).await,
        PrefixOutcome::Unreachable
    );
    let error = client.hit_counts(&[1]).await.unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
}

#[tokio::test]
async fn fails_over_to_the_next_replica_when_the_first_is_unreachable() {
    let server = TestServer::start(Config::default()).await;
    server.report("a", HBM, &[1, 2]).await;
    let missing_socket = Endpoint::parse("unix:/nonexistent/kv-indexer.sock").unwrap();
    let client = client(
        vec![dead_endpoint().await, missing_socket, server.endpoint()],
        |_| {},
    );
    for _ in 0..3 {
        assert_eq!(
            client.longest_prefix(&[1, 2, 3]).await,
            PrefixOutcome::Matched {
                matches: vec![matched("a", 2)],
                best_prefix_blocks: 2,
                query_blocks: 3,
                blocks_read: 3,
            }
        );
    }
}

#[tokio::test]
async fn dials_unix_sockets() {
    let server = TestServer::start(Config::default()).await;
    server.report("a", HBM, &[1, 2]).await;
    let path = socket_path("dials_unix_sockets");
    let listener = UnixListener::bind(&path).unwrap();
    // The server listens on TCP only: relay each socket connection to it.
    let addr = server.addr;
    let relay = tokio::spawn(async move {
        loop {
            let (mut unix, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut tcp = TcpStream::connect(addr).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut unix, &mut tcp).await;
            });
        }
    });
    let endpoint = Endpoint::parse(&format!("unix:{}", path.display())).unwrap();
    let client = client(vec![endpoint], |_| {});
    let outcome = client.longest_prefix(&[1, 2]).await;
    relay.abort();
    let _ = std::fs::remove_file(&path);
    assert_eq!(
        outcome,
        PrefixOutcome::Matched {
            matches: vec![matched("a", 2)],
            best_prefix_blocks: 2,
            query_blocks: 2,
            blocks_read: 2,
        }
    );
}

fn socket_path(test: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "kv-indexer-client-{}-{test}.sock",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&path);
    path
}

/// Keeps one prefix query in flight on `server` (whose bound should be 1) until `finish`: the
/// index is held locked, so the admitted query waits on the blocking pool.
struct Saturation {
    release: std::sync::mpsc::Sender<()>,
    lock_holder: std::thread::JoinHandle<()>,
    query: tokio::task::JoinHandle<PrefixOutcome>,
}

impl Saturation {
    async fn start(server: &TestServer) -> Saturation {
        // Long enough to run on the server's blocking pool rather than inline.
        let hashes: Vec<i64> = (1_000..6_000).collect();
        server.report("a", HBM, &hashes).await;
        let (locked, wait_locked) = std::sync::mpsc::channel();
        let (release, wait_release) = std::sync::mpsc::channel::<()>();
        let shared = server.shared.clone();
        let lock_holder = std::thread::spawn(move || {
            let _index = shared.lock_index();
            locked.send(()).unwrap();
            let _ = wait_release.recv();
        });
        wait_locked.recv().unwrap();
        let client = client(vec![server.endpoint()], |config| {
            config.query_timeout = Duration::from_secs(60);
        });
        let query = tokio::spawn(async move { client.longest_prefix(&hashes).await });
        let start = std::time::Instant::now();
        while server.shared.prefix_queries_in_flight() < 1 {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the holding query was never admitted"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Saturation {
            release,
            lock_holder,
            query,
        }
    }

    async fn finish(self) {
        self.release.send(()).unwrap();
        self.lock_holder.join().unwrap();
        let outcome = self.query.await.unwrap();
        assert!(
            matches!(outcome, PrefixOutcome::Matched { .. }),
            "{outcome:?}"
        );
    }
}

#[tokio::test]
async fn reports_a_saturated_server_as_overloaded() {
    let server = TestServer::start(Config {
        prefix_query_max_inflight: 1,
        ..Config::default()
    })
    .await;
    let saturation = Saturation::start(&server).await;
    let client = client(vec![server.endpoint()], |_| {});
    let outcome = client.longest_prefix(&[0, 1]).await;
    saturation.finish().await;
    assert_eq!(outcome, PrefixOutcome::Overloaded);
    assert!(server.shared.shed_and_rejected().1 >= 1);
}

#[tokio::test]
async fn fails_over_when_the_first_replica_is_overloaded() {
    let busy = TestServer::start(Config {
        prefix_query_max_inflight: 1,
        ..Config::default()
    })
    .await;
    let spare = TestServer::start(Config::default()).await;
    spare.report("b", HBM, &[0, 1]).await;
    let saturation = Saturation::start(&busy).await;
    let client = client(vec![busy.endpoint(), spare.endpoint()], |_| {});
    // While the busy replica is full, only the spare (worker b) can answer.
    let outcome = client.longest_prefix(&[0, 1]).await;
    saturation.finish().await;
    assert_eq!(
        outcome,
        PrefixOutcome::Matched {
            matches: vec![matched("b", 2)],
            best_prefix_blocks: 2,
            query_blocks: 2,
            blocks_read: 2,
        }
    );
}

#[tokio::test]
async fn reports_a_spent_deadline_as_timeout() {
    let server = TestServer::start(Config::default()).await;
    server.report("a", HBM, &[1, 2]).await;
    let client = client(vec![server.endpoint()], |config| {
        config.query_timeout = Duration::from_micros(1);
    });
    assert_eq!(client.longest_prefix(&[1, 2]).await, PrefixOutcome::Timeout);
    // Whichever timer fires first: ours (DEADLINE_EXCEEDED) or tonic's (CANCELLED).
    let error = client.match_exact(&[1], false).await.unwrap_err();
    assert!(
        matches!(error.code, Code::DeadlineExceeded | Code::Cancelled),
        "{error}"
    );
    assert_eq!(client.queries_in_flight(), 0);
}

#[tokio::test]
async fn rejects_a_query_over_the_local_bound_without_contacting_the_server() {
    // A listener that never answers: a query sent to it stays in flight until its deadline.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = Endpoint::parse(&format!("http://{}", silent.local_addr().unwrap())).unwrap();
    let client = Arc::new(client(vec![endpoint], |config| {
        config.max_inflight = 1;
    }));
    let held = {
        let client = client.clone();
        tokio::spawn(async move { client.longest_prefix(&[1, 2]).await })
    };
    for _ in 0..10_000 {
        if client.queries_in_flight() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        client.queries_in_flight(),
        1,
        "the first query never started"
    );
    // Had this query reached the silent server, it would have waited for its 30 s deadline.
    assert_eq!(client.longest_prefix(&[1]).await, PrefixOutcome::Overloaded);
    let error = client.hit_counts(&[1]).await.unwrap_err();
    assert_eq!(error.code, Code::ResourceExhausted, "{error}");
    held.abort();
    drop(silent);
}

#[tokio::test]
async fn sends_only_the_leading_hashes_of_a_prompt_too_long_for_one_message() {
    let server = TestServer::start(Config::default()).await;
    let prompt: Vec<i64> = (0..1_100_000).collect();
    // The worker holds the whole prompt: only what was sent can match.
    server.report("a", HBM, &prompt).await;
    let client = client(vec![server.endpoint()], |_| {});
    let PrefixOutcome::Matched {
        matches,
        best_prefix_blocks,
        query_blocks,
        ..
    } = client.longest_prefix(&prompt).await
    else {
        panic!("a long prompt must be answered");
    };
    assert_eq!(MAX_PREFIX_HASHES, 1_048_574);
    assert_eq!(best_prefix_blocks, 1_048_574);
    assert_eq!(matches, [matched("a", 1_048_574)]);
    assert_eq!(query_blocks, 1_100_000);
}

#[tokio::test]
async fn looks_up_exact_placements_and_hit_counts() {
    let server = TestServer::start(Config::default()).await;
    server.report("a", HBM, &[1, 2, 3]).await;
    server.report("b", DRAM, &[1]).await;
    let client = client(vec![server.endpoint()], |_| {});
    // Legacy reports: no component masks, unknown token counts (0), aligned with the hashes.
    let placements = |tier, hashes: Vec<i64>| TierPlacements {
        tier,
        component_masks: vec![0; hashes.len()],
        block_sizes: vec![0; hashes.len()],
        hashes,
    };
    assert_eq!(
        client.match_exact(&[3, 1], true).await.unwrap(),
        [
            NodeMatch {
                worker_id: "a".into(),
                address: address("a"),
                tiers: vec![placements(Tier::Hbm, vec![3, 1])],
            },
            NodeMatch {
                worker_id: "b".into(),
                address: address("b"),
                tiers: vec![placements(Tier::Dram, vec![1])],
            },
        ]
    );
    assert_eq!(
        client.hit_counts(&[1, 2, 3]).await.unwrap(),
        [
            HitCount {
                hash: 1,
                hit_count_total: 1
            },
            HitCount {
                hash: 3,
                hit_count_total: 1
            },
        ]
    );
    let error = client.match_exact(&[], false).await.unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument, "{error}");
}

#[tokio::test]
async fn refuses_a_config_it_cannot_run_with() {
    let endpoint = Endpoint::parse("http://127.0.0.1:1").unwrap();
    let check = |tune: fn(&mut ClientConfig), want: &str| {
        let mut config = ClientConfig::new(vec![endpoint.clone()]);
        tune(&mut config);
        let error = IndexerClient::new(config).expect_err(want);
        assert!(error.to_string().contains(want), "{error} lacks {want:?}");
    };
    check(|c| c.endpoints.clear(), "no Indexer endpoint");
    check(|c| c.max_inflight = 0, "max_inflight");
    check(|c| c.query_timeout = Duration::ZERO, "query_timeout");
    assert!(matches!(
        IndexerClient::new(ClientConfig::new(vec![])),
        Err(ClientError::Endpoint(_))
    ));
}
