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

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1::kv_indexer_server::KvIndexerServer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tonic::Status;
use tonic::service::Routes;
use tower::ServiceExt;
use tracing::{debug, info, warn};

use crate::access::{self, Access, PREFIX_PATH};
use crate::config::Config;
use crate::deadline::Arrival;
use crate::service::{IndexerService, Shared};

/// HTTP/2 streams allowed at once on one connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 64;
/// The longest an admitted prefix query may stay, from its head's arrival to its answer, when
/// its `grpc-timeout` asks for no less: generous for the largest query (8 MiB, a scan of a
/// million blocks), short enough that a slow upload cannot keep a permit.
pub const PREFIX_QUERY_MAX_TIME: Duration = Duration::from_secs(10);
/// How long a client may take over the TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the Indexer in plain HTTP/2 without tokens; see [`serve`].
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    serve(listener, shared, Access::default(), shutdown).await
}

/// Serves the Indexer on an already-bound listener with `access` (TLS, tokens) until
/// `shutdown` resolves, then drains the open connections. `shared` lets the caller (tests,
/// the binary) observe the index.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    access: Access,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let addr = listener
        .local_addr()
        .context("reading the listen address")?;
    let routes = routes(shared.clone()).await?;
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2.max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let graceful = GracefulShutdown::new();
    let tokens = Arc::new(access.tokens);
    let refused = Arc::new(kv_common::DoublingLog::default());
    let handshakes_failed = Arc::new(kv_common::DoublingLog::default());

    info!(%addr, tls = access.tls.is_some(), mutual_tls = access.mutual_tls, "kv-indexer-server listening");
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: keep serving the open connections.
                    warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        if let Err(error) = stream.set_nodelay(true) {
            debug!(%error, %peer, "cannot set TCP_NODELAY");
        }
        let routes = routes.clone();
        let tokens = tokens.clone();
        let refused = refused.clone();
        let shared = shared.clone();
        let service = tower::service_fn(move |mut request: http::Request<Incoming>| {
            let arrival = Instant::now();
            let path = request.uri().path();
            // An admitted query's whole stay, body upload included, is bounded, so that a
            // client cannot hold a permit by sending its body slowly.
            let bound = (path == PREFIX_PATH).then(|| admitted_budget(request.headers()));
            let checked = match tokens.check(path, request.headers()) {
                Err(status) => {
                    if let Some(total) = refused.record() {
                        warn!(total, %peer, message = status.message(), "refused a call without the right token");
                    }
                    Err(status)
                }
                Ok(()) if path == PREFIX_PATH => shared
                    .admit()
                    .map(|admitted| {
                        request.extensions_mut().insert(admitted);
                    })
                    .map_err(Status::from),
                Ok(()) => Ok(()),
            };
            let routes = routes.clone();
            let shared = shared.clone();
            async move {
                if let Err(status) = checked {
                    let rpc = access::method_label(request.uri().path());
                    crate::observe::request(rpc, status.code(), arrival.elapsed());
                    return Ok(status.into_http());
                }
                request.extensions_mut().insert(Arrival(arrival));
                let Some(bound) = bound else {
                    return routes.oneshot(request).await;
                };
                match tokio::time::timeout(bound, routes.oneshot(request)).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        shared.record_shed();
                        let status = Status::deadline_exceeded(format!(
                            "no answer within {bound:?} of the request's arrival (its deadline, at most {PREFIX_QUERY_MAX_TIME:?})"
                        ));
                        crate::observe::request(
                            access::method_label(PREFIX_PATH),
                            status.code(),
                            arrival.elapsed(),
                        );
                        Ok(status.into_http())
                    }
                }
            }
        });
        let service = TowerToHyperService::new(service);
        let watcher = graceful.watcher();
        let http2 = http2.clone();
        let tls = access.tls.clone();
        let handshakes_failed = handshakes_failed.clone();
        tokio::spawn(async move {
            let Some(tls) = tls else {
                return serve_connection(&http2, watcher, stream, service, peer).await;
            };
            match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                Ok(Ok(stream)) => serve_connection(&http2, watcher, stream, service, peer).await,
                failed => {
                    crate::observe::tls_handshake_failed();
                    let error = match failed {
                        Ok(Err(error)) => error.to_string(),
                        _ => format!("no handshake within {TLS_HANDSHAKE_TIMEOUT:?}"),
                    };
                    if let Some(total) = handshakes_failed.record() {
                        warn!(total, %peer, %error, "TLS handshake failed");
                    }
                }
            }
        });
    }
    info!("kv-indexer-server draining connections");
    graceful.shutdown().await;
    info!("kv-indexer-server stopped");
    Ok(())
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
/// query-serving threads rather than behind their queues.
pub fn serve_on_own_thread(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    access: Access,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<anyhow::Result<()>>> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("kv-indexer-apply".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener =
                    TcpListener::from_std(listener).context("registering the apply listener")?;
                serve(listener, shared, access, stop.cancelled_owned()).await
            })
        })
}

/// Serves one accepted connection (plain or TLS) until it ends or the server drains.
async fn serve_connection<IO, S>(
    http2: &hyper::server::conn::http2::Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    io: IO,
    service: S,
    peer: std::net::SocketAddr,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming> + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as hyper::body::Body>::Data: Send,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let connection = watcher.watch(http2.serve_connection(TokioIo::new(io), service));
    if let Err(error) = connection.await {
        debug!(%error, %peer, "connection ended with an error");
    }
}

/// The gRPC services: the Indexer, health (SERVING from the start) and reflection.
async fn routes(shared: Arc<Shared>) -> anyhow::Result<Routes> {
    let indexer = KvIndexerServer::new(IndexerService::new(shared))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<KvIndexerServer<IndexerService>>()
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kv_indexer_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let mut routes = Routes::builder();
    routes
        .add_service(indexer)
        .add_service(health_service)
        .add_service(reflection().build_v1().context("building reflection v1")?)
        .add_service(
            reflection()
                .build_v1alpha()
                .context("building reflection v1alpha")?,
        );
    Ok(routes.routes())
}

/// Shared state for a server with `config`.
pub fn shared(config: &Config) -> Arc<Shared> {
    Arc::new(Shared::new(config))
}
