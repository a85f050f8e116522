//! Assembles and runs the gRPC server: the `KVIndexer` service with its transport limits,
//! `grpc.health.v1`, and server reflection.
//!
//! Connections are served with hyper directly rather than `tonic::transport::Server`, because
//! tonic's server enforces `grpc-timeout` itself and answers CANCELLED, where the contract wants
//! DEADLINE_EXCEEDED from our own check (`deadline`). The accept loop stamps each request's
//! arrival for that check.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1::kv_indexer_server::KvIndexerServer;
use tokio::net::TcpListener;
use tonic::service::Routes;
use tower::ServiceExt;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::deadline::Arrival;
use crate::service::{IndexerService, Shared};

/// HTTP/2 streams allowed at once on one connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 64;

/// Serves the Indexer on an already-bound listener until `shutdown` resolves, then drains the
/// open connections. `shared` lets the caller (tests, the binary) observe the index.
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let addr = listener
        .local_addr()
        .context("reading the listen address")?;
    let routes = routes(shared).await?;
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2.max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let graceful = GracefulShutdown::new();

    info!(%addr, "kv-indexer-server listening");
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
        let service = tower::service_fn(move |mut request: http::Request<Incoming>| {
            request.extensions_mut().insert(Arrival(Instant::now()));
            routes.clone().oneshot(request)
        });
        let connection =
            http2.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                debug!(%error, %peer, "connection ended with an error");
            }
        });
    }
    info!("kv-indexer-server draining connections");
    graceful.shutdown().await;
    info!("kv-indexer-server stopped");
    Ok(())
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
