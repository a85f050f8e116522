//! The server started as its binary starts it (`kv_server::serve`: its state recovered from the
//! config's state directory or shared log, its periodic jobs running), on `127.0.0.1:0`, with
//! a gRPC client: for the tests of what a client sees of a durable server or a fleet replica.

use std::sync::Arc;

use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::serve::{self, Serving};
use kv_server::service::Shared;
use kv_server::{Config, server};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

use crate::indexer::prefix_request;
use crate::wait;

/// A booted server; [`BootedServer::stop`] drains it and writes its final snapshot.
pub struct BootedServer {
    pub shared: Arc<Shared>,
    pub client: KvIndexerClient<Channel>,
    stop: CancellationToken,
    serving: Serving,
}

/// A server that listens but has not loaded its state: NOT_SERVING and UNAVAILABLE until
/// `boot::boot` runs on its `shared` (as the binary is while it recovers).
pub struct Listening {
    pub addr: std::net::SocketAddr,
    pub shared: Arc<Shared>,
    pub stop: CancellationToken,
    pub task: JoinHandle<Result<(), kv_server::error::StartError>>,
}

impl Listening {
    pub async fn start(config: &Config) -> Listening {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::new(config).unwrap());
        let stop = CancellationToken::new();
        let task = tokio::spawn(server::run(
            listener,
            shared.clone(),
            stop.clone().cancelled_owned(),
        ));
        Listening {
            addr,
            shared,
            stop,
            task,
        }
    }
}

impl BootedServer {
    /// Starts the server's life as the binary runs it (`kv_server::serve`), and waits until
    /// its state is recovered (its writer installed).
    pub async fn start(config: Config) -> BootedServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared::new(&config).unwrap());
        let serving = serve::start(shared, listener, None, &config, stop.clone()).unwrap();
        let shared = serving.shared.clone();
        wait::until("the server to recover its state", || {
            let recovered = shared.writer().is_ok();
            async move { recovered.then_some(()) }
        })
        .await;
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        BootedServer {
            shared,
            client: KvIndexerClient::new(channel),
            stop,
            serving,
        }
    }

    /// Started, and (a replica) caught up with its shared log.
    pub async fn serving(config: Config) -> BootedServer {
        let server = BootedServer::start(config).await;
        let shared = server.shared.clone();
        wait::until("the server answers queries", move || {
            let ok = shared.check_fresh().is_ok();
            async move { ok.then_some(()) }
        })
        .await;
        server
    }

    /// SIGTERM's path: drain, final snapshot.
    pub async fn stop(self) {
        self.stop.cancel();
        self.serving.wait().await.unwrap();
    }

    /// `ApplyExternalKvBatch`, answered with its code on failure.
    pub async fn apply(&mut self, request: pb::ApplyExternalKvBatchRequest) -> Result<(), Code> {
        self.client
            .apply_external_kv_batch(request)
            .await
            .map(|_| ())
            .map_err(|status| status.code())
    }

    /// `MatchExternalKvPrefix` without a ceiling, answered with its code on failure.
    pub async fn prefix(
        &mut self,
        hashes: &[i64],
    ) -> Result<pb::MatchExternalKvPrefixResponse, Code> {
        self.client
            .match_external_kv_prefix(prefix_request(hashes.to_vec()))
            .await
            .map(|r| r.into_inner())
            .map_err(|status| status.code())
    }
}
