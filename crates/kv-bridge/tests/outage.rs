//! The bridge says when what it depends on comes back, and how long it was away: the publisher
//! (not listening when the bridge starts) and the Indexer (answering UNAVAILABLE at first).
//! The bridge's log lines are captured by a subscriber of this test's thread: a binary of its
//! own, since other tests' threads in one process disturb that capture.

use std::fmt::{Debug, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use clap::Parser;
use kv_bridge::config::{Args, BridgeConfig};
use kv_bridge::stats::Stats;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_server::{KvIndexer, KvIndexerServer};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::field::{Field, Visit};
use tracing::{Event, Metadata, Subscriber, span};
use zeromq::{PubSocket, Socket};

/// Every event logged on this thread, as `LEVEL message key=value…`.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<String>>>);

impl Logs {
    /// The first line holding every one of `needles`.
    fn find(&self, needles: &[&str]) -> Option<String> {
        let lines = self.0.lock();
        lines
            .iter()
            .find(|line| needles.iter().all(|needle| line.contains(needle)))
            .cloned()
    }
}

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl Subscriber for Logs {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut line = Line(event.metadata().level().to_string());
        event.record(&mut line);
        self.0.lock().push(line.0);
    }
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

/// An Indexer that answers UNAVAILABLE to the first `failures` applies, then OK.
struct Flaky {
    failures: u32,
    applies: AtomicU32,
}

#[tonic::async_trait]
impl KvIndexer for Flaky {
    async fn apply_external_kv_batch(
        &self,
        _: Request<pb::ApplyExternalKvBatchRequest>,
    ) -> Result<Response<pb::ApplyExternalKvBatchResponse>, Status> {
        if self.applies.fetch_add(1, Ordering::Relaxed) < self.failures {
            return Err(Status::unavailable("starting"));
        }
        Ok(Response::new(Default::default()))
    }
    async fn match_external_kv(
        &self,
        _: Request<pb::MatchExternalKvRequest>,
    ) -> Result<Response<pb::MatchExternalKvResponse>, Status> {
        Err(Status::unimplemented("a bridge never asks"))
    }
    async fn match_external_kv_prefix(
        &self,
        _: Request<pb::MatchExternalKvPrefixRequest>,
    ) -> Result<Response<pb::MatchExternalKvPrefixResponse>, Status> {
        Err(Status::unimplemented("a bridge never asks"))
    }
    async fn get_external_kv_hit_counts(
        &self,
        _: Request<pb::GetExternalKvHitCountsRequest>,
    ) -> Result<Response<pb::GetExternalKvHitCountsResponse>, Status> {
        Err(Status::unimplemented("a bridge never asks"))
    }

    async fn predict_external_kv(
        &self,
        _: Request<pb::PredictExternalKvRequest>,
    ) -> Result<Response<pb::PredictExternalKvResponse>, Status> {
        Err(Status::unimplemented("a bridge never predicts"))
    }
}

/// A socket on a loopback port that refuses connections until a listener opens beside it
/// (`SO_REUSEPORT`), so "the publisher is not there yet" is a fact, not a race.
fn reusable() -> TcpSocket {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_reuseport(true).unwrap();
    socket
}

#[tokio::test]
async fn says_when_the_publisher_and_the_indexer_are_back_and_how_long_they_were_away() {
    let logs = Logs::default();
    let _default = tracing::subscriber::set_default(logs.clone());

    let indexer = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let indexer_addr = indexer.local_addr().unwrap();
    let flaky = Flaky {
        failures: 2,
        applies: AtomicU32::new(0),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvIndexerServer::new(flaky))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(indexer)),
    );
    let holder = reusable();
    holder.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let publisher_addr: SocketAddr = holder.local_addr().unwrap();

    let argv = [
        "kv-indexer-bridge",
        "--worker-id",
        "w",
        "--worker-address",
        "http://w:30000",
        "--endpoint",
        &format!("http://{indexer_addr}"),
        "--event-endpoint",
        &format!("tcp://{publisher_addr}"),
    ];
    let config = BridgeConfig::from_args(Args::try_parse_from(argv).unwrap()).unwrap();
    let stats = Arc::new(Stats::default());
    let stop = CancellationToken::new();
    let bridge = tokio::spawn(kv_bridge::run(config, stats.clone(), stop.clone()));

    until_true(|| Stats::get(&stats.connect_failures) > 0).await;
    let listener = reusable();
    listener.bind(publisher_addr).unwrap();
    let mut publisher = PubSocket::new();
    publisher
        .bind_listener(listener.listen(16).unwrap().into_std().unwrap())
        .await
        .unwrap();
    until(&logs, &["INFO", "the publisher is back", "away_ms="]).await;

    // Subscribed, the bridge clears the worker; the clear is delivered on the third attempt.
    let indexer_back = until(&logs, &["INFO", "the indexer is back", "away_ms="]).await;
    assert_eq!(Stats::get(&stats.rpcs_failed), 2, "{indexer_back}");

    stop.cancel();
    bridge.await.unwrap().unwrap();
    drop(holder);
}

/// Waits for a log line holding `needles`.
async fn until(logs: &Logs, needles: &[&str]) -> String {
    for _ in 0..2_000 {
        if let Some(line) = logs.find(needles) {
            return line;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no log line with {needles:?} in {:#?}", logs.0.lock());
}

/// Waits for `condition`.
async fn until_true(condition: impl Fn() -> bool) {
    for _ in 0..2_000 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out");
}
