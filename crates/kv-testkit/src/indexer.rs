//! The real Indexer server in this process, on a listener bound to `127.0.0.1:0`.

use std::net::SocketAddr;
use std::sync::Arc;

use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, Shared, server};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub const HBM: i32 = pb::TierType::TierHbm as i32;
pub const DRAM: i32 = pb::TierType::TierDram as i32;
pub const SSD: i32 = pb::TierType::TierSsd as i32;
pub const REPORT: i32 = pb::ExternalKvActionType::ActionReport as i32;
pub const REVOKE: i32 = pb::ExternalKvActionType::ActionRevoke as i32;
pub const CLEAR: i32 = pb::ExternalKvActionType::ActionClearAllAtTier as i32;

/// A server on `127.0.0.1:0`, stopped when dropped.
pub struct TestIndexer {
    pub shared: Arc<Shared>,
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl TestIndexer {
    /// Starts with the default configuration.
    pub async fn start() -> TestIndexer {
        TestIndexer::with_config(Config::default()).await
    }

    pub async fn with_config(config: Config) -> TestIndexer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding 127.0.0.1:0");
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let shared = server::shared(&config);
        let stop = CancellationToken::new();
        tokio::spawn(server::run(
            listener,
            shared.clone(),
            stop.clone().cancelled_owned(),
        ));
        TestIndexer { shared, addr, stop }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A connected raw gRPC client (the listener is bound, so connecting cannot race it).
    pub async fn client(&self) -> KvIndexerClient<Channel> {
        let channel = Channel::from_shared(self.url())
            .expect("a valid URL")
            .connect()
            .await
            .expect("connecting to the test indexer");
        KvIndexerClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(usize::MAX)
    }

    /// REPORTs `hashes` for `worker` at `tier` (16,384 per apply), with `address` as the
    /// worker's address.
    pub async fn report(&self, worker: &str, address: &str, tier: i32, hashes: &[i64]) {
        let mut client = self.client().await;
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
                    worker_address: address.into(),
                    cache_spec: None,
                    bridge_incarnation: None,
                })
                .await
                .expect("the test indexer accepts a plain REPORT");
        }
    }

    /// Stops the server (also done on drop).
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for TestIndexer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
