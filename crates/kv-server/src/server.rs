//! Assembles and runs the gRPC server: the `KVIndexer` service with its transport limits,
//! `grpc.health.v1`, and server reflection.
//!
//! Connections are served with hyper directly rather than `tonic::transport::Server`, because
//! tonic's server enforces `grpc-timeout` itself and answers CANCELLED, where the contract wants
//! DEADLINE_EXCEEDED from our own check (`deadline`). The accept loop stamps each request's
//! arrival for that check, checks the caller's token (`access`) before a body is read, and
//! admits prefix queries as their head arrives (see `service`).
//! With TLS, each connection's handshake runs in that connection's task, bounded by
//! [`TLS_HANDSHAKE_TIMEOUT`], so a slow or hostile client cannot stall the accept loop.
//!
//! Limits (`ConnectionLimits`): the listen address serves at most `max_connections` at once
//! and closes a new one beyond at once, before any HTTP/2 (no stream, no body is read); every
//! connection may open at most `max_concurrent_streams` streams (h2 resets a stream beyond with
//! REFUSED_STREAM, before its head reaches the gate). The apply address has no connection bound:
//! applies are never refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kv_common::DoublingLog;
use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1::kv_indexer_admin_server::KvIndexerAdminServer;
use kv_indexer_proto::v1::kv_indexer_server::KvIndexerServer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tonic::Status;
use tonic::service::Routes;
use tower::ServiceExt;
use tracing::{debug, info, warn};

use crate::access::{self, PREFIX_PATH};
use crate::admin::AdminService;
use crate::config::{Config, ConnectionLimits};
use crate::deadline::Arrival;
use crate::error::StartError;
use crate::observe;
use crate::service::{IndexerService, Shared};

/// The longest an admitted prefix query may stay, from its head's arrival to its answer, when
/// its `grpc-timeout` asks for no less: generous for the largest query (8 MiB, a scan of a
/// million blocks), short enough that a slow upload cannot keep a permit.
pub const PREFIX_QUERY_MAX_TIME: Duration = Duration::from_secs(10);
/// How long a client may take over the TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the Indexer on an already-bound listener with the access settings and connection
/// limits of the `Config` that made `shared` (TLS, tokens: the server cannot be started without
/// the configured ones) until `shutdown` resolves, then drains the open connections for at most
/// the configured drain timeout. `shared` lets the caller (tests, the binary) observe the index.
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    let limits = shared.connection_limits();
    serve(listener, shared, limits, shutdown).await
}

/// [`run`] with these `limits`.
async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    let addr = listener.local_addr().map_err(StartError::LocalAddr)?;
    let routes = routes(shared.clone()).await?;
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2.max_concurrent_streams(limits.max_concurrent_streams);
    let connections = limits.max_connections.map(ConnectionBound::new);
    let graceful = GracefulShutdown::new();
    let access = shared.access().clone();
    let gate = Arc::new(Gate::new(shared.clone()));
    let handshakes_failed = Arc::new(DoublingLog::default());

    info!(
        %addr,
        tls = access.tls.is_some(),
        mutual_tls = access.mutual_tls,
        max_connections = limits.max_connections,
        max_concurrent_streams = limits.max_concurrent_streams,
        "kv-indexer-server listening"
    );
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: keep serving the open connections.
                    warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let held = match &connections {
            None => None,
            Some(bound) => match bound.admit(peer) {
                Some(held) => Some(held),
                // Closed before any HTTP/2: nothing of it is read.
                None => continue,
            },
        };
        if let Err(error) = stream.set_nodelay(true) {
            debug!(%error, %peer, "cannot set TCP_NODELAY");
        }
        let service =
            TowerToHyperService::new(connection_service(gate.clone(), routes.clone(), peer));
        let connection = Connection {
            http2: http2.clone(),
            watcher: graceful.watcher(),
            peer,
        };
        let tls = access.tls.clone();
        let handshakes_failed = handshakes_failed.clone();
        tokio::spawn(async move {
            let _held = held;
            match tls {
                None => connection.serve(stream, service).await,
                Some(tls) => {
                    connection
                        .serve_tls(tls, stream, service, &handshakes_failed)
                        .await
                }
            }
        });
    }
    drain(graceful, shared.drain_timeout()).await;
    Ok(())
}

/// The bound on connections served at once.
struct ConnectionBound {
    served: Arc<tokio::sync::Semaphore>,
    limit: usize,
    refused: DoublingLog,
}

impl ConnectionBound {
    fn new(limit: usize) -> ConnectionBound {
        ConnectionBound {
            served: Arc::new(tokio::sync::Semaphore::new(limit)),
            limit,
            refused: DoublingLog::default(),
        }
    }

    /// A place for the connection from `peer`, held while it is served; none when all are
    /// taken (the caller closes it).
    fn admit(&self, peer: SocketAddr) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let held = self.served.clone().try_acquire_owned().ok();
        if held.is_none() {
            observe::connection_refused();
            if let Some(total) = self.refused.record() {
                warn!(total, limit = self.limit, %peer, "closing connections over the bound (KV_INDEXER_MAX_CONNECTIONS)");
            }
        }
        held
    }
}

/// Waits for the open connections to finish their calls, at most `timeout`; the rest are
/// dropped with the runtime.
async fn drain(graceful: GracefulShutdown, timeout: Duration) {
    info!(?timeout, "kv-indexer-server draining connections");
    match tokio::time::timeout(timeout, graceful.shutdown()).await {
        Ok(()) => info!("kv-indexer-server stopped"),
        Err(_) => warn!(
            ?timeout,
            "kv-indexer-server stopped with connections still open after the drain timeout (KV_INDEXER_DRAIN_TIMEOUT_S)"
        ),
    }
}

/// What the accept loop does with every request head before it is routed, in order: stamp its
/// arrival, check the caller's token (before the body is read), admit a prefix query (a permit
/// held until its answer), and bound an admitted query's stay.
pub struct Gate {
    shared: Arc<Shared>,
    refused: DoublingLog,
}

/// A request that passed the gate: route it, within `stay` when it has one.
#[derive(Debug)]
pub struct Passed {
    pub arrival: Instant,
    pub stay: Option<Duration>,
}

/// A request the gate refused: answer `status` without routing it.
#[derive(Debug)]
pub struct Refused {
    pub arrival: Instant,
    pub status: Status,
}

impl Gate {
    pub fn new(shared: Arc<Shared>) -> Gate {
        Gate {
            shared,
            refused: DoublingLog::default(),
        }
    }

    /// Checks one request head; a passed request carries its [`Arrival`] (and a prefix query
    /// its admission) in its extensions.
    pub fn check<B>(
        &self,
        request: &mut http::Request<B>,
        peer: SocketAddr,
    ) -> Result<Passed, Refused> {
        let arrival = Instant::now();
        let refuse = |status| Refused { arrival, status };
        let path = request.uri().path();
        let prefix_query = path == PREFIX_PATH;
        if let Err(status) = self.shared.access().tokens.check(path, request.headers()) {
            if let Some(total) = self.refused.record() {
                warn!(total, %peer, message = status.message(), "refused a call without the right token");
            }
            return Err(refuse(status));
        }
        // An admitted query's whole stay, body upload included, is bounded, so that a client
        // cannot hold a permit by sending its body slowly.
        let stay = prefix_query.then(|| admitted_budget(request.headers()));
        if prefix_query {
            let admitted = self.shared.admit().map_err(|e| refuse(e.into()))?;
            request.extensions_mut().insert(admitted);
        }
        request.extensions_mut().insert(Arrival(arrival));
        Ok(Passed { arrival, stay })
    }

    /// The answer to an admitted query that outstayed its bound.
    fn outstayed(&self, passed: &Passed, stay: Duration) -> Status {
        self.shared.record_shed();
        let status = Status::deadline_exceeded(format!(
            "no answer within {stay:?} of the request's arrival (its deadline, at most {PREFIX_QUERY_MAX_TIME:?})"
        ));
        observe::request(
            access::method_label(PREFIX_PATH),
            status.code(),
            passed.arrival.elapsed(),
        );
        status
    }
}

/// The per-connection service: the gate, then the routes.
fn connection_service(
    gate: Arc<Gate>,
    routes: Routes,
    peer: SocketAddr,
) -> impl tower::Service<
    http::Request<Incoming>,
    Response = http::Response<tonic::body::Body>,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<http::Response<tonic::body::Body>, std::convert::Infallible>>
             + Send,
> + Clone
+ Send {
    tower::service_fn(move |mut request: http::Request<Incoming>| {
        let checked = gate.check(&mut request, peer);
        let routes = routes.clone();
        let gate = gate.clone();
        async move {
            let passed = match checked {
                Ok(passed) => passed,
                Err(refused) => {
                    let rpc = access::method_label(request.uri().path());
                    observe::request(rpc, refused.status.code(), refused.arrival.elapsed());
                    return Ok(refused.status.into_http());
                }
            };
            let rpc = access::method_label(request.uri().path());
            let Some(stay) = passed.stay else {
                let answer = routes.oneshot(request).await;
                return answer.map(|response| undecodable(rpc, &passed, response));
            };
            match tokio::time::timeout(stay, routes.oneshot(request)).await {
                Ok(answer) => answer.map(|response| undecodable(rpc, &passed, response)),
                Err(_) => Ok(gate.outstayed(&passed, stay).into_http()),
            }
        }
    })
}

/// `response`, unless it is tonic's answer to a request it could not decode (a client built
/// from another version of the protocol, or not a client of it), which never reaches the
/// service and so would be neither counted nor told from a server fault: INTERNAL becomes
/// INVALID_ARGUMENT, with the decoder's message, counted under the method (`unknown` for a
/// path no method has, which tonic answers UNIMPLEMENTED).
fn undecodable(
    rpc: &'static str,
    passed: &Passed,
    mut response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let status = response.headers().get("grpc-status").map(|v| v.as_bytes());
    let code = match status {
        Some(b"13") if grpc_message(&response).contains("failed to decode") => {
            response
                .headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static("3"));
            tonic::Code::InvalidArgument
        }
        Some(b"12") if rpc == "unknown" => tonic::Code::Unimplemented,
        _ => return response,
    };
    observe::request(rpc, code, passed.arrival.elapsed());
    response
}

/// The `grpc-message` of a trailers-only answer, percent-decoded as far as it is text.
fn grpc_message(response: &http::Response<tonic::body::Body>) -> String {
    let raw = response
        .headers()
        .get("grpc-message")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    raw.replace("%20", " ")
}

/// One accepted connection and what serves it.
struct Connection {
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    peer: SocketAddr,
}

impl Connection {
    /// Completes the TLS handshake within [`TLS_HANDSHAKE_TIMEOUT`], then serves.
    async fn serve_tls<S>(
        self,
        tls: TlsAcceptor,
        stream: TcpStream,
        service: S,
        handshakes_failed: &DoublingLog,
    ) where
        S: HttpService,
        S::Future: Send + 'static,
    {
        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
            Ok(Ok(stream)) => self.serve(stream, service).await,
            failed => {
                observe::tls_handshake_failed();
                let error = match failed {
                    Ok(Err(error)) => error.to_string(),
                    _ => format!("no handshake within {TLS_HANDSHAKE_TIMEOUT:?}"),
                };
                if let Some(total) = handshakes_failed.record() {
                    warn!(total, peer = %self.peer, %error, "TLS handshake failed");
                }
            }
        }
    }

    /// Serves the connection (plain or TLS) until it ends or the server drains.
    async fn serve<IO, S>(self, io: IO, service: S)
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        S: HttpService,
        S::Future: Send + 'static,
    {
        let connection = self
            .watcher
            .watch(self.http2.serve_connection(TokioIo::new(io), service));
        if let Err(error) = connection.await {
            debug!(%error, peer = %self.peer, "connection ended with an error");
        }
    }
}

/// The hyper service every connection is served with.
trait HttpService:
    hyper::service::Service<
        http::Request<Incoming>,
        Response = http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    > + Send
    + 'static
{
}

impl<S> HttpService for S where
    S: hyper::service::Service<
            http::Request<Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Send
        + 'static
{
}

/// How long an admitted prefix query may stay: its `grpc-timeout`, at most
/// [`PREFIX_QUERY_MAX_TIME`].
fn admitted_budget(headers: &http::HeaderMap) -> Duration {
    headers
        .get("grpc-timeout")
        .and_then(|value| value.to_str().ok())
        .and_then(crate::deadline::parse_grpc_timeout)
        .map_or(PREFIX_QUERY_MAX_TIME, |timeout| {
            timeout.min(PREFIX_QUERY_MAX_TIME)
        })
}

/// Serves `listener` on a thread of its own (a single-threaded runtime) until `stop` is
/// cancelled: the bridges' address, so that the OS schedules their applies next to the
/// query-serving threads rather than behind their queues. It has no bound on connections.
pub fn serve_on_own_thread(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<Result<(), StartError>>> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("kv-indexer-apply".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener).map_err(StartError::Register)?;
                let limits = ConnectionLimits {
                    max_connections: None,
                    ..shared.connection_limits()
                };
                serve(listener, shared, limits, stop.cancelled_owned()).await
            })
        })
}

/// The gRPC services: the Indexer, its admin service, health (SERVING from the start) and reflection.
async fn routes(shared: Arc<Shared>) -> Result<Routes, StartError> {
    shared.publish_health().await;
    let health_service = tonic_health::pb::health_server::HealthServer::new(
        tonic_health::server::HealthService::from_health_reporter(shared.health().clone()),
    );
    let admin = KvIndexerAdminServer::new(AdminService::new(shared.clone()));
    let service = IndexerService::new(shared);
    let indexer = KvIndexerServer::new(service.clone())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kv_indexer_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let mut routes = Routes::builder();
    routes
        .add_service(indexer)
        .add_service(admin)
        .add_service(health_service)
        .add_service(reflection().build_v1().map_err(StartError::Reflection)?)
        .add_service(
            reflection()
                .build_v1alpha()
                .map_err(StartError::Reflection)?,
        );
    Ok(crate::prefix_route::add(routes.routes(), service))
}

/// Shared state for a server with `config`, its state opened at once on this thread (memory,
/// or a state directory recovered before this returns) and its writer started: for tests and
/// tools. A shared log is not: a replica is ready only once caught up ([`crate::boot`]).
pub fn shared(config: &Config) -> Arc<Shared> {
    assert!(
        config.state.fleet.is_none(),
        "server::shared opens one server, not a replica"
    );
    let shared = Arc::new(Shared::new(config).expect("starting the query threads"));
    let opened = kv_state::open::open(&shared.index_cell(), &config.state)
        .expect("opening the server's state");
    shared.install(opened.writer);
    shared
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{Access, Tokens};
    use crate::service::Admission;
    use kv_indexer_proto::v1 as pb;
    use kv_indexer_proto::v1::kv_indexer_server::KvIndexer;
    use tonic::Request;

    const APPLY: &str = "/kv_indexer.v1.KVIndexer/ApplyExternalKvBatch";
    const PEER: &str = "127.0.0.1:9";

    fn gate(limit: usize, tokens: Tokens) -> Gate {
        let config = Config {
            prefix_query_max_inflight: limit,
            access: Access {
                tokens,
                ..Access::default()
            },
            ..Config::default()
        };
        Gate::new(shared(&config))
    }

    fn request(path: &str, headers: &[(&str, &str)]) -> http::Request<()> {
        let mut builder = http::Request::builder().uri(path);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap()
    }

    fn check(gate: &Gate, request: &mut http::Request<()>) -> Result<Passed, Refused> {
        gate.check(request, PEER.parse().unwrap())
    }

    #[test]
    fn stamps_the_arrival_of_every_passed_request() {
        let gate = gate(1, Tokens::default());
        let mut apply = request(APPLY, &[]);
        let passed = check(&gate, &mut apply).unwrap();
        assert_eq!(
            apply.extensions().get::<Arrival>().unwrap().0,
            passed.arrival
        );
        assert_eq!(passed.stay, None);
        assert!(apply.extensions().get::<Admission>().is_none());
    }

    #[test]
    fn admits_prefix_queries_up_to_the_bound_and_refuses_the_next() {
        let gate = gate(2, Tokens::default());
        let mut first = request(PREFIX_PATH, &[]);
        let mut second = request(PREFIX_PATH, &[]);
        check(&gate, &mut first).unwrap();
        check(&gate, &mut second).unwrap();
        assert!(first.extensions().get::<Admission>().is_some());
        assert_eq!(gate.shared.prefix_queries_in_flight(), 2);
        let refused = check(&gate, &mut request(PREFIX_PATH, &[])).unwrap_err();
        assert_eq!(refused.status.code(), tonic::Code::ResourceExhausted);
        // Applies take no permit, so the bound never refuses them.
        check(&gate, &mut request(APPLY, &[])).unwrap();
        drop(first);
        assert_eq!(gate.shared.prefix_queries_in_flight(), 1);
        check(&gate, &mut request(PREFIX_PATH, &[])).unwrap();
    }

    #[test]
    fn refuses_a_wrong_token_before_admission() {
        let gate = gate(1, Tokens::new(None, Some("r")).unwrap());
        let refused = check(&gate, &mut request(PREFIX_PATH, &[])).unwrap_err();
        assert_eq!(refused.status.code(), tonic::Code::Unauthenticated);
        assert_eq!(gate.shared.prefix_queries_in_flight(), 0);
        let mut with_token = request(PREFIX_PATH, &[("authorization", "Bearer r")]);
        check(&gate, &mut with_token).unwrap();
        assert_eq!(gate.shared.prefix_queries_in_flight(), 1);
    }

    #[test]
    fn bounds_an_admitted_query_by_its_deadline_at_most_the_maximum() {
        let gate = gate(8, Tokens::default());
        let stay = |headers: &[(&str, &str)]| {
            check(&gate, &mut request(PREFIX_PATH, headers))
                .unwrap()
                .stay
        };
        assert_eq!(stay(&[]), Some(PREFIX_QUERY_MAX_TIME));
        assert_eq!(
            stay(&[("grpc-timeout", "250m")]),
            Some(Duration::from_millis(250))
        );
        assert_eq!(stay(&[("grpc-timeout", "1H")]), Some(PREFIX_QUERY_MAX_TIME));
        assert_eq!(
            stay(&[("grpc-timeout", "bogus")]),
            Some(PREFIX_QUERY_MAX_TIME)
        );
    }

    #[tokio::test]
    async fn an_outstayed_query_is_answered_deadline_exceeded_and_counted() {
        let gate = gate(1, Tokens::default());
        let passed = check(&gate, &mut request(PREFIX_PATH, &[])).unwrap();
        let status = gate.outstayed(&passed, Duration::from_millis(5));
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert_eq!(gate.shared.shed_and_rejected().0, 1);
    }

    #[tokio::test]
    #[allow(clippy::await_holding_lock)] // holding the write lock over the await is the case
    async fn a_prefix_scan_waits_for_the_index_on_a_query_thread() {
        let shared = shared(&Config {
            query_threads: 1,
            ..Config::default()
        });
        let service = IndexerService::new(shared.clone());
        let held = shared.lock_index();
        let query = tokio::spawn(async move {
            let request = Request::new(pb::MatchExternalKvPrefixRequest {
                hashes: vec![1],
                max_blocks: 0,
                max_matches: None,
                include_predictions: None,
            });
            service.match_external_kv_prefix(request).await
        });
        // The test runtime has one thread: this runs again only if the scan waits elsewhere.
        tokio::task::yield_now().await;
        assert_eq!(shared.prefix_queries_in_flight(), 1);
        assert!(!query.is_finished());
        drop(held);
        let answer = query.await.unwrap().unwrap().into_inner();
        assert_eq!(answer.best_prefix_blocks, 0);
        assert_eq!(shared.prefix_scans(), 1);
    }
}
