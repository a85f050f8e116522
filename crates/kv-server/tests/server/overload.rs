//! Shedding load before it costs, over real sockets on loopback: a connection beyond the
//! bound is closed before any HTTP/2, a stream beyond a connection's limit is reset before its
//! head reaches the gate, a query over the admission bound is refused on its head without its
//! body, and applies on the apply address pass while the query address is full.

use kv_indexer_client::client::transport_is_unavailable;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::config::ConnectionLimits;
use kv_server::{Config, server};
use kv_testkit::h2::{self, RawConnection};
use kv_testkit::indexer::{HBM, prefix_request as prefix, report_request as report};
use kv_testkit::{Port, TestIndexer, wait};
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

/// A client on a connection of its own, made at its first call.
fn own_connection(url: String) -> KvIndexerClient<Channel> {
    KvIndexerClient::new(Channel::from_shared(url).unwrap().connect_lazy())
}

fn bounded(max_connections: Option<usize>, max_concurrent_streams: u32, inflight: usize) -> Config {
    Config {
        prefix_query_max_inflight: inflight,
        connections: ConnectionLimits {
            max_connections,
            max_concurrent_streams,
        },
        ..Config::default()
    }
}

/// Waits until the gate has admitted `count` prefix queries.
async fn admitted(server: &TestIndexer, count: usize) {
    wait::until(
        &format!("{count} prefix queries to be admitted"),
        || async { (server.shared.prefix_queries_in_flight() == count).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn a_connection_beyond_the_bound_is_closed_before_any_http2() {
    let server = TestIndexer::with_config(bounded(Some(1), 64, 32)).await;
    let mut first = own_connection(server.url());
    first
        .apply_external_kv_batch(report("a", vec![1, 2]))
        .await
        .unwrap();

    // The router's client sees an unreachable replica and tries the next one.
    let mut second = own_connection(server.url());
    let refused = second
        .match_external_kv_prefix(prefix(vec![1, 2]))
        .await
        .unwrap_err();
    let status = transport_is_unavailable(refused);
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // Nothing of it reached the gate.
    assert_eq!(server.shared.shed_and_rejected(), (0, 0));
    assert_eq!(server.shared.prefix_scans(), 0);

    let answer = first
        .match_external_kv_prefix(prefix(vec![1, 2]))
        .await
        .expect("the connection within the bound is served")
        .into_inner();
    assert_eq!(answer.best_prefix_blocks, 2);

    // The bound is on connections at once: once the first is gone, another is served.
    drop(first);
    let answer = wait::until_ok("a connection to be served again", || {
        let mut second = second.clone();
        async move { second.match_external_kv_prefix(prefix(vec![1, 2])).await }
    })
    .await;
    assert_eq!(answer.into_inner().best_prefix_blocks, 2);
}

#[tokio::test]
async fn a_stream_beyond_the_connection_limit_is_refused_before_the_gate() {
    let server = TestIndexer::with_config(bounded(None, 1, 32)).await;
    server.report("a", "http://a:30000", HBM, &[1, 2]).await;
    let body = prefix(vec![1, 2]).encode_to_vec();

    let mut raw = RawConnection::open(server.addr).await;
    // Stream 1 is admitted and waits for its body.
    raw.send_head(1, h2::PREFIX_PATH).await;
    admitted(&server, 1).await;
    // Stream 3 is one too many for this connection, whatever its body.
    raw.send_head(3, h2::PREFIX_PATH).await;
    raw.send_body(3, &body).await;
    let reset = raw.wait_for(h2::RST_STREAM, 3).await;
    assert_eq!(h2::reset_code(&reset), h2::REFUSED_STREAM);
    assert_eq!(server.shared.prefix_queries_in_flight(), 1);
    assert_eq!(server.shared.shed_and_rejected(), (0, 0));

    // The admitted stream is answered once its body comes.
    raw.send_body(1, &body).await;
    raw.wait_for(h2::DATA, 1).await;
    assert_eq!(server.shared.prefix_scans(), 1);
}

#[tokio::test]
async fn a_query_over_the_bound_is_refused_on_its_head_without_its_body() {
    let server = TestIndexer::with_config(bounded(None, 64, 1)).await;
    // Holds the one permit: its body never comes either.
    let _holder = h2::stalled_prefix_query(server.addr, None).await;
    admitted(&server, 1).await;

    let refused = h2::stalled_prefix_query(server.addr, None).await;
    let response = refused
        .await
        .unwrap()
        .expect("answered although its body never came");
    assert_eq!(
        response.headers().get("grpc-status").unwrap(),
        &(Code::ResourceExhausted as i32).to_string()
    );
    assert_eq!(server.shared.shed_and_rejected(), (0, 1));
    assert_eq!(server.shared.prefix_scans(), 0);
}

#[tokio::test]
async fn applies_on_the_apply_address_pass_while_the_query_address_is_full() {
    let server = TestIndexer::with_config(bounded(Some(1), 64, 1)).await;
    let apply_port = Port::reserve();
    let stop = CancellationToken::new();
    let thread =
        server::serve_on_own_thread(apply_port.listen_std(), server.shared.clone(), stop.clone())
            .unwrap();
    // The query address's one connection and its one permit are taken.
    let _holder = h2::stalled_prefix_query(server.addr, None).await;
    admitted(&server, 1).await;
    let status = own_connection(server.url())
        .match_external_kv_prefix(prefix(vec![1]))
        .await
        .unwrap_err();
    assert_eq!(transport_is_unavailable(status).code(), Code::Unavailable);

    // Bridges, each on a connection of its own: the apply address has no bound.
    for worker in 0..4 {
        own_connection(apply_port.url())
            .apply_external_kv_batch(report(&format!("w{worker}"), vec![worker]))
            .await
            .expect("an apply is never refused");
    }
    assert_eq!(server.shared.index_stats().placements, 4);
    // A query there shares the admission bound: refused on its head.
    let status = own_connection(apply_port.url())
        .match_external_kv_prefix(prefix(vec![1]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);

    stop.cancel();
    tokio::task::spawn_blocking(move || thread.join().unwrap())
        .await
        .unwrap()
        .unwrap();
}
