//! The server over real sockets on loopback: every RPC, status codes of the validation rules,
//! the 8 MiB boundary, admission, deadline shedding, atomicity under concurrency, health and
//! reflection.

use std::time::Duration;

use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, server};
use kv_testkit::indexer::{CLEAR, DRAM, HBM, IndexHold, REPORT, REVOKE, prefix_request as prefix};
use kv_testkit::{Port, TestIndexer, h2, wait};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Request};

/// A client over a bare HTTP/2 connection: unlike tonic's `Channel`, it does not enforce
/// `grpc-timeout` itself, so the test sees what the server answers.
async fn raw_client(addr: std::net::SocketAddr) -> KvIndexerClient<RawService> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let service: RawService = tower::util::BoxCloneService::new(tower::service_fn(
        move |request: http::Request<tonic::body::Body>| {
            let mut sender = sender.clone();
            async move { sender.send_request(request).await }
        },
    ));
    KvIndexerClient::with_origin(service, format!("http://{addr}").parse().unwrap())
}

type RawService = tower::util::BoxCloneService<
    http::Request<tonic::body::Body>,
    http::Response<hyper::body::Incoming>,
    hyper::Error,
>;

fn action(kind: i32, tier: i32, hashes: Vec<i64>) -> pb::ExternalKvAction {
    pb::ExternalKvAction {
        r#type: kind,
        tier,
        hashes,
        ..Default::default()
    }
}

fn apply(worker: &str, actions: Vec<pb::ExternalKvAction>) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: worker.into(),
        seq: 1,
        actions,
        worker_address: format!("http://{worker}:30000"),
        ..Default::default()
    }
}

#[tokio::test]
async fn answers_every_rpc() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    client
        .apply_external_kv_batch(apply("a", vec![action(REPORT, HBM, vec![1, 2, 3])]))
        .await
        .unwrap();
    client
        .apply_external_kv_batch(apply("b", vec![action(REPORT, DRAM, vec![1, 2])]))
        .await
        .unwrap();

    let answer = client
        .match_external_kv_prefix(prefix(vec![1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.best_prefix_blocks, 3);
    let got: Vec<(String, u32, String)> = answer
        .matches
        .into_iter()
        .map(|m| (m.worker_address, m.matched_prefix_blocks, m.worker_id))
        .collect();
    assert_eq!(
        got,
        [
            ("http://a:30000".to_string(), 3, "a".to_string()),
            ("http://b:30000".to_string(), 2, "b".to_string())
        ]
    );
    assert_eq!(answer.blocks_read, 4);

    let matched = client
        .match_external_kv(pb::MatchExternalKvRequest {
            hashes: vec![3, 1],
            count_as_hit: true,
        })
        .await
        .unwrap()
        .into_inner();
    let workers: Vec<&str> = matched
        .matches
        .iter()
        .map(|m| m.worker_id.as_str())
        .collect();
    assert_eq!(workers, ["a", "b"]);
    assert_eq!(matched.matches[0].hashes_by_tier[0].hashes, [3, 1]);
    assert_eq!(matched.matches[0].hashes_by_tier[0].tier, HBM);
    assert_eq!(matched.matches[1].hashes_by_tier[0].hashes, [1]);
    assert_eq!(matched.matches[1].hashes_by_tier[0].tier, DRAM);

    let hits = client
        .get_external_kv_hit_counts(pb::GetExternalKvHitCountsRequest {
            hashes: vec![1, 2, 3],
        })
        .await
        .unwrap()
        .into_inner();
    let hits: Vec<(i64, u64)> = hits
        .entries
        .iter()
        .map(|e| (e.hash, e.hit_count_total))
        .collect();
    assert_eq!(hits, [(1, 1), (3, 1)]);
}

/// Sends one request of each kind that breaks a rule; each must get `code` and change nothing.
async fn check_rejected(
    client: &mut KvIndexerClient<Channel>,
    server: &TestIndexer,
    request: Rejected,
    code: Code,
) {
    let before = server.shared.index_stats();
    let status = match request {
        Rejected::Apply(request) => client.apply_external_kv_batch(request).await.map(|_| ()),
        Rejected::Match(request) => client.match_external_kv(request).await.map(|_| ()),
        Rejected::Prefix(request) => client.match_external_kv_prefix(request).await.map(|_| ()),
        Rejected::Hits(request) => client.get_external_kv_hit_counts(request).await.map(|_| ()),
    }
    .expect_err("the request must be rejected");
    assert_eq!(status.code(), code, "{}", status.message());
    assert!(!status.message().is_empty());
    assert_eq!(
        server.shared.index_stats(),
        before,
        "a rejected request changed the index"
    );
}

enum Rejected {
    Apply(pb::ApplyExternalKvBatchRequest),
    Match(pb::MatchExternalKvRequest),
    Prefix(pb::MatchExternalKvPrefixRequest),
    Hits(pb::GetExternalKvHitCountsRequest),
}

#[tokio::test]
async fn maps_each_validation_rule_to_its_code_and_changes_nothing() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    client
        .apply_external_kv_batch(apply("a", vec![action(REPORT, HBM, vec![1, 2])]))
        .await
        .unwrap();
    // Every rejected apply starts with a valid action, so a half-applied batch would show.
    let valid = || action(REPORT, HBM, vec![10, 11]);
    let with = |bad: pb::ExternalKvAction| apply("new-worker", vec![valid(), bad]);
    let cases = vec![
        (
            Rejected::Apply(pb::ApplyExternalKvBatchRequest {
                worker_id: String::new(),
                ..apply("x", vec![valid()])
            }),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(apply(
                "new-worker",
                (0..257).map(|i| action(REPORT, HBM, vec![i])).collect(),
            )),
            Code::ResourceExhausted,
        ),
        (
            Rejected::Apply(apply(
                "new-worker",
                vec![action(REPORT, HBM, (0..16_385).collect())],
            )),
            Code::ResourceExhausted,
        ),
        (
            Rejected::Apply(with(action(REPORT, 0, vec![5]))),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(action(REPORT, 9, vec![5]))),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(action(0, HBM, vec![5]))),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(action(17, HBM, vec![5]))),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(action(REPORT, HBM, vec![]))),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(action(REVOKE, HBM, vec![]))),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(pb::ExternalKvAction {
                component_masks: vec![1],
                ..action(REPORT, HBM, vec![5, 6])
            })),
            Code::InvalidArgument,
        ),
        (
            Rejected::Apply(with(pb::ExternalKvAction {
                block_sizes: vec![16; 3],
                ..action(REPORT, HBM, vec![5, 6])
            })),
            Code::InvalidArgument,
        ),
        (
            Rejected::Match(pb::MatchExternalKvRequest {
                hashes: vec![],
                count_as_hit: true,
            }),
            Code::InvalidArgument,
        ),
        (
            Rejected::Match(pb::MatchExternalKvRequest {
                hashes: vec![1; 16_385],
                count_as_hit: true,
            }),
            Code::ResourceExhausted,
        ),
        (
            Rejected::Hits(pb::GetExternalKvHitCountsRequest { hashes: vec![] }),
            Code::InvalidArgument,
        ),
        (
            Rejected::Hits(pb::GetExternalKvHitCountsRequest {
                hashes: vec![1; 16_385],
            }),
            Code::ResourceExhausted,
        ),
        (Rejected::Prefix(prefix(vec![])), Code::InvalidArgument),
    ];
    for (request, code) in cases {
        check_rejected(&mut client, &server, request, code).await;
    }
    // Nothing above counted a hit either.
    let hits = client
        .get_external_kv_hit_counts(pb::GetExternalKvHitCountsRequest { hashes: vec![1, 2] })
        .await
        .unwrap()
        .into_inner();
    assert!(hits.entries.is_empty());
    // A clear with no hashes is valid.
    client
        .apply_external_kv_batch(apply("a", vec![action(CLEAR, HBM, vec![])]))
        .await
        .unwrap();
    assert_eq!(server.shared.index_stats().placements, 0);
}

/// The largest prefix request that fits in 8 MiB: `(8 MiB − 16) / 8` hashes, as the router sends.
const MAX_PREFIX_HASHES: usize = (MAX_MESSAGE_BYTES - 16) / 8;

#[tokio::test]
async fn accepts_messages_up_to_8_mib_and_rejects_larger_ones_with_out_of_range() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    client
        .apply_external_kv_batch(apply("a", vec![action(REPORT, HBM, (0..100).collect())]))
        .await
        .unwrap();
    let under: Vec<i64> = (0..MAX_PREFIX_HASHES as i64).collect();
    let answer = client
        .match_external_kv_prefix(prefix(under))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.best_prefix_blocks, 100);

    // 1 + 4 bytes of field header, so this many hashes is just over the limit.
    let over: Vec<i64> = (0..(MAX_MESSAGE_BYTES / 8) as i64).collect();
    let status = client
        .match_external_kv_prefix(prefix(over))
        .await
        .expect_err("over 8 MiB must be rejected");
    assert_eq!(status.code(), Code::OutOfRange, "{}", status.message());
}

/// A prefix request whose scan takes long: every block is held, so no candidate settles early.
async fn long_scan_setup(client: &mut KvIndexerClient<Channel>, blocks: i64) -> Vec<i64> {
    for start in (0..blocks).step_by(16_384) {
        let end = (start + 16_384).min(blocks);
        client
            .apply_external_kv_batch(apply(
                "a",
                vec![action(REPORT, HBM, (start..end).collect())],
            ))
            .await
            .unwrap();
    }
    (0..blocks).collect()
}

/// A prefix query running in a task of its own.
type PrefixQuery = tokio::task::JoinHandle<
    Result<tonic::Response<pb::MatchExternalKvPrefixResponse>, tonic::Status>,
>;

/// `count` prefix queries of `hashes` at once, each on a client of its own.
fn spawn_prefix_queries(server: &TestIndexer, count: usize, hashes: &[i64]) -> Vec<PrefixQuery> {
    (0..count)
        .map(|_| {
            let mut client = server.client();
            let request = prefix(hashes.to_vec());
            tokio::spawn(async move { client.match_external_kv_prefix(request).await })
        })
        .collect()
}

/// A server admitting 2 prefix queries, with `count` long ones sent while its index is held.
struct Flood {
    server: TestIndexer,
    client: KvIndexerClient<Channel>,
    hashes: Vec<i64>,
    held: IndexHold,
    queries: Vec<PrefixQuery>,
}

async fn flood(count: usize) -> Flood {
    let server = TestIndexer::with_config(Config {
        prefix_query_max_inflight: 2,
        ..Config::default()
    })
    .await;
    let mut client = server.client();
    // Long enough to run on the blocking pool, where an admitted query waits for the index.
    let hashes = long_scan_setup(&mut client, 5_000).await;
    // Hold the index so that admitted queries stay in flight.
    let held = server.hold();
    let queries = spawn_prefix_queries(&server, count, &hashes);
    Flood {
        server,
        client,
        hashes,
        held,
        queries,
    }
}

#[tokio::test]
async fn rejects_the_query_over_the_inflight_bound_at_once() {
    let Flood {
        server,
        mut client,
        hashes,
        held,
        queries: admitted,
    } = flood(2).await;
    wait::until("the two queries to be admitted", || async {
        (server.shared.prefix_queries_in_flight() == 2).then_some(())
    })
    .await;
    let third = tokio::time::timeout(
        Duration::from_secs(10),
        client.match_external_kv_prefix(prefix(hashes.clone())),
    )
    .await
    .expect("the query over the bound was queued instead of rejected at once");
    held.release();

    let status = third.expect_err("the query over the bound must be rejected");
    assert_eq!(
        status.code(),
        Code::ResourceExhausted,
        "{}",
        status.message()
    );
    assert_eq!(server.shared.shed_and_rejected().1, 1);
    for query in admitted {
        let answer = query.await.unwrap().unwrap().into_inner();
        assert_eq!(answer.best_prefix_blocks, 5_000);
    }
}

fn with_timeout<T>(message: T, grpc_timeout: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("grpc-timeout", grpc_timeout.parse().unwrap());
    request
}

#[tokio::test]
async fn honours_a_spent_client_deadline_without_touching_the_index() {
    let server = TestIndexer::start().await;
    let mut client = raw_client(server.addr).await;
    client
        .apply_external_kv_batch(apply("a", vec![action(REPORT, HBM, vec![1, 2])]))
        .await
        .unwrap();
    let scans = server.shared.prefix_scans();
    let status = client
        .match_external_kv_prefix(with_timeout(prefix(vec![1, 2]), "1n"))
        .await
        .expect_err("a spent deadline must be shed");
    assert_eq!(
        status.code(),
        Code::DeadlineExceeded,
        "{}",
        status.message()
    );
    assert_eq!(
        server.shared.prefix_scans(),
        scans,
        "a shed query touched the index"
    );
    assert_eq!(server.shared.shed_and_rejected().0, 1);

    // A generous deadline is served.
    let answer = client
        .match_external_kv_prefix(with_timeout(prefix(vec![1, 2]), "10S"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.best_prefix_blocks, 2);
    assert_eq!(server.shared.prefix_scans(), scans + 1);
}

#[tokio::test]
async fn keeps_applying_while_queries_are_shed() {
    let server = TestIndexer::start().await;
    let mut client = raw_client(server.addr).await;
    for round in 0..50i64 {
        let status = client
            .match_external_kv_prefix(with_timeout(prefix(vec![round]), "1n"))
            .await
            .expect_err("shed");
        assert_eq!(status.code(), Code::DeadlineExceeded);
        // Applies carry the same spent budget and are still applied: they are never shed.
        client
            .apply_external_kv_batch(with_timeout(
                apply("a", vec![action(REPORT, HBM, vec![round])]),
                "10S",
            ))
            .await
            .unwrap();
    }
    assert_eq!(server.shared.index_stats().placements, 50);
    assert_eq!(server.shared.shed_and_rejected().0, 50);
}

/// A flood of long queries against an admission bound of 2 while applies arrive: the two
/// admitted queries are answered, every other one is refused while the index is still busy
/// (never queued), and every apply is applied.
#[tokio::test]
async fn a_query_flood_refuses_the_surplus_and_never_an_apply() {
    let Flood {
        server,
        held,
        queries,
        ..
    } = flood(40).await;
    let mut applies = Vec::new();
    for round in 0..10i64 {
        let mut client = server.client();
        applies.push(tokio::spawn(async move {
            client
                .apply_external_kv_batch(apply(
                    "b",
                    vec![action(REPORT, HBM, vec![1_000_000 + round])],
                ))
                .await
        }));
    }
    // While the index is held, 2 queries wait inside and all 38 others are already refused.
    wait::until("all 38 surplus queries to be refused", || async {
        (server.shared.shed_and_rejected().1 == 38).then_some(())
    })
    .await;
    assert_eq!(server.shared.prefix_queries_in_flight(), 2);
    held.release();

    let (mut answered, mut refused) = (0, 0);
    for query in queries {
        match query.await.unwrap() {
            Ok(answer) => {
                assert_eq!(answer.into_inner().best_prefix_blocks, 5_000);
                answered += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                refused += 1;
            }
        }
    }
    assert_eq!((answered, refused), (2, 38));
    for apply in applies {
        apply
            .await
            .unwrap()
            .expect("an apply must never be refused");
    }
    assert_eq!(server.shared.index_stats().placements, 5_010);
}

#[tokio::test]
async fn concurrent_queries_never_see_a_half_applied_batch() {
    let server = TestIndexer::start().await;
    let blocks: Vec<i64> = (0..2_000).collect();
    let (first, second) = blocks.split_at(1_000);
    let report = apply(
        "a",
        vec![
            action(REPORT, HBM, first.to_vec()),
            action(REPORT, DRAM, second.to_vec()),
        ],
    );
    let revoke = apply(
        "a",
        vec![
            action(REVOKE, HBM, first.to_vec()),
            action(CLEAR, DRAM, vec![]),
        ],
    );
    let writer = {
        let mut client = server.client();
        tokio::spawn(async move {
            for _ in 0..200 {
                client
                    .apply_external_kv_batch(report.clone())
                    .await
                    .unwrap();
                client
                    .apply_external_kv_batch(revoke.clone())
                    .await
                    .unwrap();
            }
        })
    };
    let mut readers = Vec::new();
    for _ in 0..2 {
        let mut client = server.client();
        let blocks = blocks.clone();
        readers.push(tokio::spawn(async move {
            let mut seen = [0u32; 2];
            for _ in 0..400 {
                let answer = client
                    .match_external_kv_prefix(prefix(blocks.clone()))
                    .await
                    .unwrap()
                    .into_inner();
                match answer.best_prefix_blocks {
                    0 => seen[0] += 1,
                    2_000 => seen[1] += 1,
                    half => panic!("saw a half-applied batch: prefix {half}"),
                }
            }
            seen
        }));
    }
    writer.await.unwrap();
    for reader in readers {
        reader.await.unwrap();
    }
}

#[tokio::test]
async fn answers_health_and_reflection() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let server = TestIndexer::start().await;
    let mut health = HealthClient::new(server.channel());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "kv_indexer.v1.KVIndexer".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.status, ServingStatus::Serving as i32);

    let mut reflection = ServerReflectionClient::new(server.channel());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = tokio::time::timeout(Duration::from_secs(10), responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"kv_indexer.v1.KVIndexer".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );
}

/// The bridges' listener (`KV_INDEXER_APPLY_LISTEN_ADDR`) on its own thread shares the index
/// with the main one, and stops with its token.
#[tokio::test]
async fn a_second_listener_on_its_own_thread_serves_the_same_index() {
    let server = TestIndexer::start().await;
    let port = Port::reserve();
    let listener = port.listen_std();
    let stop = CancellationToken::new();
    let thread =
        server::serve_on_own_thread(listener, server.shared.clone(), stop.clone()).unwrap();
    let channel = Channel::from_shared(port.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    KvIndexerClient::new(channel)
        .apply_external_kv_batch(apply("a", vec![action(REPORT, HBM, vec![7, 8])]))
        .await
        .unwrap();
    let answer = server
        .client()
        .match_external_kv_prefix(prefix(vec![7, 8]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.best_prefix_blocks, 2);
    stop.cancel();
    tokio::task::spawn_blocking(move || thread.join().unwrap())
        .await
        .unwrap()
        .unwrap();
}

/// A prefix query is admitted when its head arrives, so a client that never sends the body
/// would keep the permit: the server answers DEADLINE_EXCEEDED at the query's deadline and
/// the permit is free again.
#[tokio::test]
async fn a_query_whose_body_never_comes_loses_its_permit_at_its_deadline() {
    let server = TestIndexer::with_config(Config {
        prefix_query_max_inflight: 1,
        ..Config::default()
    })
    .await;
    let stalled = h2::stalled_prefix_query(server.addr, Some("300m")).await;
    wait::until("the stalled query to be admitted", || async {
        (server.shared.prefix_queries_in_flight() == 1).then_some(())
    })
    .await;
    // Meanwhile the one permit is taken.
    let status = server
        .client()
        .match_external_kv_prefix(prefix(vec![1]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);

    let response = tokio::time::timeout(Duration::from_secs(10), stalled)
        .await
        .expect("the server must answer at the deadline")
        .unwrap()
        .unwrap();
    assert_eq!(
        response.headers().get("grpc-status").unwrap(),
        &(Code::DeadlineExceeded as i32).to_string()
    );
    assert_eq!(server.shared.prefix_queries_in_flight(), 0);
    let answer = server
        .client()
        .match_external_kv_prefix(prefix(vec![1]))
        .await
        .expect("the permit is free again");
    assert_eq!(answer.into_inner().best_prefix_blocks, 0);
}

/// The prefix answer goes out through the server's own encoder; the router decodes it with
/// prost. It must decode to exactly what the generic path (the index's answer, converted to the
/// generated message) gives, for large answers (ordered by rank buckets) and small ones
/// (sorted), and `max_matches` must cut it to its best entries.
#[tokio::test]
async fn the_encoded_prefix_answer_is_the_generic_one() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    let mut index = kv_index::Index::new();
    let workers = 300;
    for i in 0..workers {
        // Registered out of id order, with addresses of every encoded length class.
        let id = format!("w{:03}", (i * 7919) % workers);
        let mut request = apply(&id, vec![action(REPORT, HBM, (1..=1 + i % 5).collect())]);
        if i % 50 == 0 {
            request.worker_address = format!("http://{}:1", "h".repeat(200 + i as usize));
        }
        if i % 3 == 0 {
            // Some also hold a branch of their own, so that a query along it names few.
            request.actions.push(action(REPORT, DRAM, vec![1, 100 + i]));
        }
        client
            .apply_external_kv_batch(request.clone())
            .await
            .unwrap();
        let valid = kv_indexer_proto::convert::apply_request(request)
            .validate()
            .unwrap();
        index.apply(&valid);
    }
    for (query, max_blocks) in [
        (vec![1, 2, 3, 4, 5, 6], 0),
        (vec![1, 2, 3], 2),
        (vec![1, 103, 7], 0),
        (vec![9], 0),
    ] {
        let expected = kv_indexer_proto::convert::prefix_response(
            index.match_prefix(&query, max_blocks).unwrap(),
        );
        let mut request = prefix(query.clone());
        request.max_blocks = max_blocks;
        let answer = client
            .match_external_kv_prefix(request.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer, expected, "query {query:?}");

        request.max_matches = Some(7);
        let cut = client
            .match_external_kv_prefix(request)
            .await
            .unwrap()
            .into_inner();
        let mut expected_cut = expected.clone();
        expected_cut.matches.truncate(7);
        assert_eq!(cut, expected_cut, "query {query:?} cut to 7");
    }
}
