//! The client against the real server on loopback: answers, every failure outcome the router
//! contract names, replica fail-over, the local admission bound and long-prompt truncation.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kv_indexer_client::{
    ClientConfig, ClientError, Code, Endpoint, HitCount, IndexerClient, MAX_PREFIX_HASHES,
    NodeMatch, PrefixMatch, PrefixOutcome, Tier, TierPlacements,
};
use kv_server::Config;
use kv_testkit::indexer::{DRAM, HBM, IndexHold};
use kv_testkit::{Port, TestIndexer, wait};
use tokio::net::{TcpListener, TcpStream, UnixListener};

/// The client's endpoint for `server`.
fn endpoint(server: &TestIndexer) -> Endpoint {
    Endpoint::parse(&server.url()).unwrap()
}

/// REPORTs `hashes` for `worker` (at [`address`]) at `tier`.
async fn report(server: &TestIndexer, worker: &str, tier: i32, hashes: &[i64]) {
    server.report(worker, &address(worker), tier, hashes).await;
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

/// An endpoint that refuses connections while `port` lives (it is reserved, never listened on).
fn dead_endpoint(port: &Port) -> Endpoint {
    Endpoint::parse(&port.url()).unwrap()
}

fn matched(worker: &str, blocks: u32) -> PrefixMatch {
    PrefixMatch {
        worker_address: address(worker),
        worker_id: worker.into(),
        matched_prefix_blocks: blocks,
    }
}

/// The outcome of an answered query.
fn answer(
    matches: Vec<PrefixMatch>,
    best_prefix_blocks: u32,
    query_blocks: usize,
    blocks_read: u32,
) -> PrefixOutcome {
    PrefixOutcome::Matched {
        matches,
        best_prefix_blocks,
        query_blocks,
        blocks_read,
    }
}

/// A server that admits one prefix query at a time.
async fn one_permit_server() -> TestIndexer {
    TestIndexer::with_config(Config {
        prefix_query_max_inflight: 1,
        ..Config::default()
    })
    .await
}

#[tokio::test]
async fn matches_after_an_apply() {
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2, 3]).await;
    report(&server, "b", DRAM, &[1, 2]).await;
    let client = client(vec![endpoint(&server)], |_| {});
    assert_eq!(
        client.longest_prefix(&[1, 2, 3, 4]).await,
        answer(vec![matched("a", 3), matched("b", 2)], 3, 4, 4)
    );
    assert_eq!(client.queries_in_flight(), 0);
}

#[tokio::test]
async fn reports_no_match_when_no_worker_holds_the_first_block() {
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2, 3]).await;
    let client = client(vec![endpoint(&server)], |_| {});
    assert_eq!(
        client.longest_prefix(&[9, 1, 2]).await,
        PrefixOutcome::NoMatch
    );
    assert_eq!(client.longest_prefix(&[]).await, PrefixOutcome::NoMatch);
}

#[tokio::test]
async fn reports_a_stopped_server_as_unreachable() {
    let dead = Port::reserve();
    let client = client(vec![dead_endpoint(&dead)], |_| {});
    assert_eq!(
        client.longest_prefix(&[1, 2]).await,
        PrefixOutcome::Unreachable
    );
    let error = client.hit_counts(&[1]).await.unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
}

#[tokio::test]
async fn fails_over_to_the_next_replica_when_the_first_is_unreachable() {
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2]).await;
    let missing_socket = Endpoint::parse("unix:/nonexistent/kv-indexer.sock").unwrap();
    let dead = Port::reserve();
    let client = client(
        vec![dead_endpoint(&dead), missing_socket, endpoint(&server)],
        |_| {},
    );
    for _ in 0..3 {
        assert_eq!(
            client.longest_prefix(&[1, 2, 3]).await,
            answer(vec![matched("a", 2)], 2, 3, 3)
        );
    }
}

#[tokio::test]
async fn dials_unix_sockets() {
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2]).await;
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
    assert_eq!(outcome, answer(vec![matched("a", 2)], 2, 2, 2));
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
    held: IndexHold,
    query: tokio::task::JoinHandle<PrefixOutcome>,
}

impl Saturation {
    async fn start(server: &TestIndexer) -> Saturation {
        // Long enough to run on the server's blocking pool rather than inline.
        let hashes: Vec<i64> = (1_000..6_000).collect();
        report(server, "a", HBM, &hashes).await;
        let held = server.hold();
        let client = client(vec![endpoint(server)], |config| {
            config.query_timeout = Duration::from_secs(60);
        });
        let query = tokio::spawn(async move { client.longest_prefix(&hashes).await });
        wait::until("the holding query to be admitted", || async {
            (server.shared.prefix_queries_in_flight() >= 1).then_some(())
        })
        .await;
        Saturation { held, query }
    }

    async fn finish(self) {
        self.held.release();
        let outcome = self.query.await.unwrap();
        assert!(
            matches!(outcome, PrefixOutcome::Matched { .. }),
            "{outcome:?}"
        );
    }
}

#[tokio::test]
async fn reports_a_saturated_server_as_overloaded() {
    let server = one_permit_server().await;
    let saturation = Saturation::start(&server).await;
    let client = client(vec![endpoint(&server)], |_| {});
    let outcome = client.longest_prefix(&[0, 1]).await;
    saturation.finish().await;
    assert_eq!(outcome, PrefixOutcome::Overloaded);
    assert!(server.shared.shed_and_rejected().1 >= 1);
}

#[tokio::test]
async fn fails_over_when_the_first_replica_is_overloaded() {
    let busy = one_permit_server().await;
    let spare = TestIndexer::start().await;
    report(&spare, "b", HBM, &[0, 1]).await;
    let saturation = Saturation::start(&busy).await;
    let client = client(vec![endpoint(&busy), endpoint(&spare)], |_| {});
    // While the busy replica is full, only the spare (worker b) can answer.
    let outcome = client.longest_prefix(&[0, 1]).await;
    saturation.finish().await;
    assert_eq!(outcome, answer(vec![matched("b", 2)], 2, 2, 2));
}

#[tokio::test]
async fn reports_a_spent_deadline_as_timeout() {
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2]).await;
    let client = client(vec![endpoint(&server)], |config| {
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
    let server = TestIndexer::start().await;
    let prompt: Vec<i64> = (0..1_100_000).collect();
    // The worker holds the whole prompt: only what was sent can match.
    report(&server, "a", HBM, &prompt).await;
    let client = client(vec![endpoint(&server)], |_| {});
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
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2, 3]).await;
    report(&server, "b", DRAM, &[1]).await;
    let client = client(vec![endpoint(&server)], |_| {});
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

/// A replica that accepts connections and never answers (a killed container's address, a
/// partition): the first query spends its budget there, later ones go to the next replica
/// while it is tried last, and it is tried first again once it answers.
#[tokio::test]
async fn a_replica_that_stops_answering_is_tried_after_the_others() {
    let server = TestIndexer::start().await;
    report(&server, "a", HBM, &[1, 2]).await;
    // Bound and listening, never accepted: the kernel completes the TCP handshake, HTTP/2
    // never starts.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_endpoint =
        Endpoint::parse(&format!("http://{}", silent.local_addr().unwrap())).unwrap();
    let client = client(vec![silent_endpoint, endpoint(&server)], |config| {
        config.query_timeout = Duration::from_millis(300);
    });
    assert_eq!(
        client.longest_prefix(&[1, 2, 3]).await,
        PrefixOutcome::Timeout
    );
    for _ in 0..5 {
        assert_eq!(
            client.longest_prefix(&[1, 2, 3]).await,
            answer(vec![matched("a", 2)], 2, 3, 3),
            "the silent replica is tried after the one that answers"
        );
    }
    drop(silent);
}

/// Two healthy replicas share the queries: each answers about half (which one answered shows
/// in the worker it names), one after another and many at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_replicas_share_the_queries() {
    let first = TestIndexer::start().await;
    let second = TestIndexer::start().await;
    report(&first, "a", HBM, &[1, 2]).await;
    report(&second, "b", HBM, &[1, 2]).await;
    let client = std::sync::Arc::new(client(vec![endpoint(&first), endpoint(&second)], |_| {}));
    let by_a = |outcomes: &[PrefixOutcome]| {
        outcomes
            .iter()
            .filter(|o| **o == answer(vec![matched("a", 2)], 2, 2, 2))
            .count()
    };
    let mut one_by_one = Vec::new();
    for _ in 0..100 {
        one_by_one.push(client.longest_prefix(&[1, 2]).await);
    }
    let a = by_a(&one_by_one);
    assert!(
        (40..=60).contains(&a),
        "the first replica answered {a} of 100"
    );
    // Within both the client's and each server's bound on queries in flight.
    let at_once = futures_util::future::join_all((0..20).map(|_| {
        let client = client.clone();
        async move { client.longest_prefix(&[1, 2]).await }
    }))
    .await;
    let a = by_a(&at_once);
    assert!(
        (8..=12).contains(&a),
        "the first replica answered {a} of 20 at once"
    );
    assert!(
        at_once
            .iter()
            .all(|o| matches!(o, PrefixOutcome::Matched { .. })),
        "{at_once:?}"
    );
}
