//! The real Indexer server in this process, on a [`Port`] of its own: shut down, it refuses
//! connections; restarted, it serves on the same address with an empty index.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;

use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, Shared, server};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::port::Port;
use crate::wait;

pub const HBM: i32 = pb::TierType::TierHbm as i32;
pub const DRAM: i32 = pb::TierType::TierDram as i32;
pub const SSD: i32 = pb::TierType::TierSsd as i32;
pub const REPORT: i32 = pb::ExternalKvActionType::ActionReport as i32;
pub const REVOKE: i32 = pb::ExternalKvActionType::ActionRevoke as i32;
pub const CLEAR: i32 = pb::ExternalKvActionType::ActionClearAllAtTier as i32;

/// A REPORT of `hashes` at HBM by `worker`, whose address is `http://<worker>:30000`.
pub fn report_request(worker: &str, hashes: Vec<i64>) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: worker.into(),
        seq: 1,
        actions: vec![pb::ExternalKvAction {
            r#type: REPORT,
            tier: HBM,
            hashes,
            ..Default::default()
        }],
        worker_address: format!("http://{worker}:30000"),
        ..Default::default()
    }
}

/// An apply of `actions` by `worker`, whose address is `http://<worker>:30000`.
pub fn apply_request(
    worker: &str,
    actions: Vec<pb::ExternalKvAction>,
) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_address: format!("http://{worker}:30000"),
        worker_id: worker.into(),
        actions,
        ..Default::default()
    }
}

/// An action of `kind` at `tier` on `hashes`; a REPORT's blocks hold 16 to 18 tokens.
pub fn action(kind: i32, tier: i32, hashes: &[i64]) -> pb::ExternalKvAction {
    pb::ExternalKvAction {
        r#type: kind,
        tier,
        hashes: hashes.to_vec(),
        block_sizes: if kind == REPORT {
            hashes.iter().map(|h| 16 + (*h as u32 % 3)).collect()
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}

/// A prefix query for `hashes`, without a ceiling.
pub fn prefix_request(hashes: Vec<i64>) -> pb::MatchExternalKvPrefixRequest {
    pb::MatchExternalKvPrefixRequest {
        hashes,
        max_blocks: 0,
        max_matches: None,
        include_predictions: None,
    }
}

/// What a worker holds, by tier number.
pub type Held = BTreeMap<i32, BTreeSet<i64>>;

/// `held` after `events`, decoded events as a fixture writes them (`type`, `block_hashes`,
/// `medium`): what a test expects of the index, computed without the bridge's decoder.
/// `tier` names a medium's tier, `hashes` reads an event's block hashes; tiers left empty are
/// dropped.
pub fn apply_events<'a>(
    held: &mut Held,
    events: impl IntoIterator<Item = &'a serde_json::Value>,
    tier: impl Fn(&serde_json::Value) -> i32,
    hashes: impl Fn(&serde_json::Value) -> Vec<i64>,
) {
    for event in events {
        match event["type"].as_str().expect("an event type") {
            "BlockStored" => held
                .entry(tier(&event["medium"]))
                .or_default()
                .extend(hashes(event)),
            "BlockRemoved" => {
                let set = held.entry(tier(&event["medium"])).or_default();
                for hash in hashes(event) {
                    set.remove(&hash);
                }
            }
            "AllBlocksCleared" => held.clear(),
            other => panic!("unexpected event {other}"),
        }
    }
    held.retain(|_, set| !set.is_empty());
}

/// A server on `127.0.0.1`, stopped when dropped.
pub struct TestIndexer {
    pub shared: Arc<Shared>,
    pub addr: SocketAddr,
    port: Port,
    config: Config,
    channel: Channel,
    stop: CancellationToken,
    task: Option<JoinHandle<Result<(), kv_server::error::StartError>>>,
}

impl TestIndexer {
    /// Starts with the default configuration.
    pub async fn start() -> TestIndexer {
        TestIndexer::with_config(Config::default()).await
    }

    pub async fn with_config(config: Config) -> TestIndexer {
        let port = Port::reserve();
        let port_url = port.url();
        let mut indexer = TestIndexer {
            shared: server::shared(&config),
            addr: port.addr(),
            port,
            config,
            channel: lazy(port_url),
            stop: CancellationToken::new(),
            task: None,
        };
        indexer.serve();
        indexer
    }

    /// Serves `self.shared` on the port.
    fn serve(&mut self) {
        self.stop = CancellationToken::new();
        self.channel = lazy(self.port.url());
        self.task = Some(tokio::spawn(server::run(
            self.port.listen(),
            self.shared.clone(),
            self.stop.clone().cancelled_owned(),
        )));
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The server's channel: one HTTP/2 connection, made at its first call (the listener is
    /// open, so connecting cannot race it) and again after a restart.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// A raw gRPC client on [`channel`](Self::channel), without the 4 MiB default limits.
    pub fn client(&self) -> KvIndexerClient<Channel> {
        KvIndexerClient::new(self.channel())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(usize::MAX)
    }

    /// REPORTs `hashes` for `worker` at `tier` (16,384 per apply), with `address` as the
    /// worker's address.
    pub async fn report(&self, worker: &str, address: &str, tier: i32, hashes: &[i64]) {
        let mut client = self.client();
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
                    bridge_batch: None,
                })
                .await
                .expect("the test indexer accepts a plain REPORT");
        }
    }

    /// What the index says `worker` holds among `hashes`, by tier (`MatchExternalKv`, no hits
    /// counted); tiers with nothing are left out.
    pub async fn held(&self, worker: &str, hashes: &BTreeSet<i64>) -> Held {
        let mut client = self.client();
        let hashes: Vec<i64> = hashes.iter().copied().collect();
        let mut held = Held::new();
        for chunk in hashes.chunks(16_384) {
            let answer = client
                .match_external_kv(pb::MatchExternalKvRequest {
                    hashes: chunk.to_vec(),
                    count_as_hit: false,
                })
                .await
                .expect("the test indexer answers MatchExternalKv")
                .into_inner();
            for node in answer.matches.into_iter().filter(|m| m.worker_id == worker) {
                for tier in node.hashes_by_tier {
                    held.entry(tier.tier).or_default().extend(tier.hashes);
                }
            }
        }
        held.retain(|_, set| !set.is_empty());
        held
    }

    /// Waits until the index shows exactly `expected` for `worker` among `universe`.
    pub async fn wait_for_held(&self, worker: &str, expected: &Held, universe: &BTreeSet<i64>) {
        let what = format!("the index to hold {expected:?} for {worker}");
        wait::until_ok(&what, || async move {
            let held = self.held(worker, universe).await;
            if &held == expected { Ok(()) } else { Err(held) }
        })
        .await;
    }

    /// Waits until the index knows exactly `workers` workers.
    pub async fn wait_for_workers(&self, workers: usize) {
        wait::until(&format!("the index to know {workers} workers"), || async {
            (self.shared.index_stats().workers == workers).then_some(())
        })
        .await;
    }

    /// Holds the index's write lock on a thread of its own until [`IndexHold::release`], so
    /// that admitted queries stay in flight.
    pub fn hold(&self) -> IndexHold {
        let (locked, wait_locked) = std::sync::mpsc::channel();
        let (release, wait_release) = std::sync::mpsc::channel::<()>();
        let shared = self.shared.clone();
        let holder = std::thread::spawn(move || {
            let _index = shared.lock_index();
            locked.send(()).expect("the test waits for the lock");
            let _ = wait_release.recv();
        });
        wait_locked.recv().expect("the holder takes the lock");
        IndexHold { release, holder }
    }

    /// Stops the server (also done on drop).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Stops the server and waits until it has drained (its run ended without an error) and
    /// its state is stopped (a state directory: snapshotted and unlocked). The port stays
    /// reserved: connections are refused until [`restart`](Self::restart).
    pub async fn shut_down(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.await
                .expect("the server task did not panic")
                .expect("the server stopped cleanly");
            if let Ok(writer) = self.shared.writer() {
                writer.stop().await.expect("the state stopped cleanly");
            }
        }
    }

    /// A new server on the same address (shut down first if running), with the state its
    /// configuration names: an empty index, or what its state directory holds.
    pub async fn restart(&mut self) {
        self.shut_down().await;
        self.shared = server::shared(&self.config);
        self.serve();
    }

    /// [`restart`](Self::restart) with `config` from now on (another state directory, say).
    pub async fn restart_with(&mut self, config: Config) {
        self.shut_down().await;
        self.config = config;
        self.shared = server::shared(&self.config);
        self.serve();
    }
}

/// A gRPC server with the health service and without KVIndexer, on a port of its own: every
/// Indexer RPC is answered UNIMPLEMENTED, as by a server of another kind. It serves until the
/// test's runtime ends.
pub fn without_kv_indexer() -> Port {
    let port = Port::reserve();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
                port.listen(),
            )),
    );
    port
}

/// The index's write lock, held on a thread of its own (see [`TestIndexer::hold`]).
pub struct IndexHold {
    release: std::sync::mpsc::Sender<()>,
    holder: std::thread::JoinHandle<()>,
}

impl IndexHold {
    /// Lets the index go and waits until the holder has.
    pub fn release(self) {
        self.release
            .send(())
            .expect("the holder waits for the release");
        self.holder.join().expect("the holder did not panic");
    }
}

fn lazy(url: String) -> Channel {
    Channel::from_shared(url)
        .expect("a valid URL")
        .connect_lazy()
}

impl Drop for TestIndexer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
