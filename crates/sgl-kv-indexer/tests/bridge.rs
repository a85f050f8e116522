//! The bridge end to end on loopback: a real ZMQ PUB (and replay ROUTER) sending the frames
//! captured from SGLang → `bridge::run` → the real server → `MatchExternalKv`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_bridge::config::{Args, BridgeConfig};
use kv_bridge::stats::Stats;
use kv_bridge::{self as bridge, BridgeError};
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, Shared, server};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const TOPIC: &str = "kv-events";
const WORKER: &str = "worker-0";

use kv_testkit::fixtures::{rows as fixture, unhex};

/// One captured live batch: its seq, payload, and the events it must decode to.
struct Captured {
    seq: u64,
    payload: Vec<u8>,
    events: Vec<Value>,
}

/// The live messages of `zmq-frames-0.5.23.jsonl`, each with its expected events from
/// `sglang-events-0.5.23.jsonl` (matched by payload).
fn captured() -> Vec<Captured> {
    let expected: BTreeMap<String, Vec<Value>> = fixture("sglang-events-0.5.23.jsonl")
        .into_iter()
        .map(|row| {
            (
                row["payload_hex"].as_str().unwrap().to_string(),
                row["events"].as_array().unwrap().clone(),
            )
        })
        .collect();
    fixture("zmq-frames-0.5.23.jsonl")
        .into_iter()
        .filter(|row| row["kind"] == "live")
        .map(|row| {
            let frames: Vec<&str> = row["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap())
                .collect();
            assert_eq!(frames.len(), 3);
            let seq = u64::from_be_bytes(unhex(frames[1]).try_into().unwrap());
            let events = expected
                .get(frames[2])
                .expect("captured payload is in the events fixture")
                .clone();
            Captured {
                seq,
                payload: unhex(frames[2]),
                events,
            }
        })
        .collect()
}

/// What the worker holds after `events`, by tier name, computed from the fixture's expected
/// events (not by the bridge's decoder).
fn simulate<'a>(events: impl IntoIterator<Item = &'a Value>) -> BTreeMap<i32, BTreeSet<i64>> {
    let tier = |medium: &Value| match medium.as_str() {
        Some("GPU") => 1,
        Some("CPU_PINNED") => 2,
        Some("DISK") => 3,
        other => panic!("unexpected medium {other:?}"),
    };
    let hashes = |event: &Value| -> Vec<i64> {
        event["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_i64().unwrap())
            .collect()
    };
    let mut held: BTreeMap<i32, BTreeSet<i64>> = BTreeMap::new();
    for event in events {
        match event["type"].as_str().unwrap() {
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
    held
}

/// A synthetic map-era batch, encoded as SGLang does.
fn batch(events: Vec<Value>) -> Vec<u8> {
    rmp_serde::to_vec(&json!([1750000000.0, events, null])).unwrap()
}

fn stored(hashes: &[i64], medium: &str) -> Value {
    json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": null, "token_ids": [],
           "block_size": 16, "lora_id": null, "medium": medium})
}

fn removed(hashes: &[i64], medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
}

struct IndexServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl IndexServer {
    async fn start(listener: TcpListener) -> IndexServer {
        let addr = listener.local_addr().unwrap();
        let shared = server::shared(&Config::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(server::run(
            listener,
            shared.clone(),
            stop.clone().cancelled_owned(),
        ));
        IndexServer {
            addr,
            shared,
            stop,
            task,
        }
    }

    async fn stop(self) -> SocketAddr {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
        self.addr
    }

    async fn client(&self) -> KvIndexerClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        KvIndexerClient::new(channel)
    }

    /// What the index says the worker holds among `hashes`, by tier.
    async fn held(&self, hashes: &BTreeSet<i64>) -> BTreeMap<i32, BTreeSet<i64>> {
        let mut client = self.client().await;
        let hashes: Vec<i64> = hashes.iter().copied().collect();
        let mut held: BTreeMap<i32, BTreeSet<i64>> = BTreeMap::new();
        for chunk in hashes.chunks(16_384) {
            let answer = client
                .match_external_kv(pb::MatchExternalKvRequest {
                    hashes: chunk.to_vec(),
                    count_as_hit: false,
                })
                .await
                .unwrap()
                .into_inner();
            for node in answer.matches.into_iter().filter(|m| m.worker_id == WORKER) {
                for tier in node.hashes_by_tier {
                    held.entry(tier.tier).or_default().extend(tier.hashes);
                }
            }
        }
        held
    }

    async fn wait_for_workers(&self, workers: usize) {
        let start = Instant::now();
        while self.shared.index_stats().workers != workers {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the index never saw {workers} workers"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the index shows exactly `expected` for the worker (or fails after 20 s).
    async fn wait_for(&self, expected: &BTreeMap<i32, BTreeSet<i64>>, universe: &BTreeSet<i64>) {
        let start = Instant::now();
        loop {
            let held = self.held(universe).await;
            if &held == expected {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "index never matched:\n held {held:?}\n want {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn all_hashes(events: &[&Value]) -> BTreeSet<i64> {
    events
        .iter()
        .filter_map(|e| e["block_hashes"].as_array())
        .flatten()
        .map(|h| h.as_i64().unwrap())
        .collect()
}

fn bridge_config(server: SocketAddr, publisher: &str, replay: Option<&str>) -> BridgeConfig {
    bridge_config_with(server, publisher, replay, &[])
}

fn bridge_config_with(
    server: SocketAddr,
    publisher: &str,
    replay: Option<&str>,
    extra: &[&str],
) -> BridgeConfig {
    let mut argv = vec![
        "kv-indexer-bridge".to_string(),
        "--worker-id".into(),
        WORKER.into(),
        "--worker-address".into(),
        "http://127.0.0.1:30000".into(),
        "--endpoint".into(),
        format!("http://{server}"),
        "--event-endpoint".into(),
        publisher.into(),
        "--event-topic".into(),
        TOPIC.into(),
        "--heartbeat-ms".into(),
        "200".into(),
    ];
    if let Some(replay) = replay {
        argv.extend(["--replay-endpoint".to_string(), replay.to_string()]);
    }
    argv.extend(extra.iter().map(|s| s.to_string()));
    BridgeConfig::from_args(<Args as clap::Parser>::try_parse_from(argv).unwrap()).unwrap()
}

struct RunningBridge {
    stats: Arc<Stats>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), BridgeError>>,
}

impl RunningBridge {
    fn start(config: BridgeConfig) -> RunningBridge {
        let stats = Arc::new(Stats::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(bridge::run(config, stats.clone(), stop.clone()));
        RunningBridge { stats, stop, task }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

/// A PUB bound on loopback, as SGLang binds `tcp://*:port`.
struct Publisher {
    socket: PubSocket,
}

impl Publisher {
    async fn bind(listener: std::net::TcpListener) -> Publisher {
        let mut socket = PubSocket::new();
        socket.bind_listener(listener).await.unwrap();
        Publisher { socket }
    }

    async fn send(&mut self, frames: Vec<Vec<u8>>) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        self.socket
            .send(ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
    }

    async fn publish(&mut self, seq: u64, payload: &[u8]) {
        self.send(vec![
            TOPIC.as_bytes().to_vec(),
            seq.to_be_bytes().to_vec(),
            payload.to_vec(),
        ])
        .await;
    }

    /// Sends one-frame probes (skipped by the bridge as malformed, seq untouched) until the
    /// bridge counts one: from then on its subscription is live.
    async fn wait_subscribed(&mut self, stats: &Stats) {
        let start = Instant::now();
        let before = Stats::get(&stats.frames_malformed);
        while Stats::get(&stats.frames_malformed) == before {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the bridge never subscribed"
            );
            self.send(vec![TOPIC.as_bytes().to_vec()]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn loopback() -> (std::net::TcpListener, String) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    (listener, endpoint)
}

/// The batches a test publisher keeps for replay: `(seq, payload)`.
type ReplayBuffer = Arc<parking_lot::Mutex<Vec<(u64, Vec<u8>)>>>;

/// A replay ROUTER answering from `buffer` as SGLang's does: every batch with seq ≥ start, then
/// the end marker.
fn replay_router(listener: std::net::TcpListener, buffer: ReplayBuffer) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut router = RouterSocket::new();
        router.bind_listener(listener).await.unwrap();
        loop {
            let Ok(request) = router.recv().await else {
                continue;
            };
            let frames = request.into_vec();
            if frames.len() != 3 || !frames[1].is_empty() || frames[2].len() != 8 {
                continue; // malformed requests get no answer, as upstream
            }
            let identity = frames[0].clone();
            let start = u64::from_be_bytes(frames[2][..].try_into().unwrap());
            let replies: Vec<(u64, Vec<u8>)> = buffer
                .lock()
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect();
            for (seq, payload) in replies {
                let reply = vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::from(TOPIC),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ];
                router
                    .send(ZmqMessage::try_from(reply).unwrap())
                    .await
                    .unwrap();
            }
            let end = vec![
                identity,
                Bytes::new(),
                Bytes::new(),
                Bytes::from(vec![0xff; 8]),
                Bytes::new(),
            ];
            router
                .send(ZmqMessage::try_from(end).unwrap())
                .await
                .unwrap();
        }
    })
}

#[tokio::test]
async fn applies_the_captured_real_frames_from_a_late_publisher() {
    let server = IndexServer::start(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let (listener, endpoint) = loopback();
    // The bridge starts first; the publisher accepts later.
    let bridge = RunningBridge::start(bridge_config(server.addr, &endpoint, None));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut publisher = Publisher::bind(listener).await;
    publisher.wait_subscribed(&bridge.stats).await;

    let captured = captured();
    for batch in &captured {
        publisher.publish(batch.seq, &batch.payload).await;
    }
    let events: Vec<&Value> = captured.iter().flat_map(|c| &c.events).collect();
    server
        .wait_for(&simulate(events.iter().copied()), &all_hashes(&events))
        .await;
    assert_eq!(Stats::get(&bridge.stats.gaps), 0);
    assert_eq!(
        Stats::get(&bridge.stats.clears),
        1,
        "only the start-up clear"
    );
    assert_eq!(Stats::get(&bridge.stats.batches), captured.len() as u64);
    bridge.stop().await;
}

/// A server, a publisher with a replay ROUTER answering from `buffer`, and a bridge following
/// both, already subscribed.
struct WithReplay {
    server: IndexServer,
    publisher: Publisher,
    pub_addr: SocketAddr,
    buffer: ReplayBuffer,
    router: JoinHandle<()>,
    bridge: RunningBridge,
}

async fn with_replay() -> WithReplay {
    let server = IndexServer::start(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let (pub_listener, pub_endpoint) = loopback();
    let pub_addr = pub_listener.local_addr().unwrap();
    let (replay_listener, replay_endpoint) = loopback();
    let buffer: ReplayBuffer = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let router = replay_router(replay_listener, buffer.clone());
    let mut publisher = Publisher::bind(pub_listener).await;
    let bridge = RunningBridge::start(bridge_config(
        server.addr,
        &pub_endpoint,
        Some(&replay_endpoint),
    ));
    publisher.wait_subscribed(&bridge.stats).await;
    WithReplay {
        server,
        publisher,
        pub_addr,
        buffer,
        router,
        bridge,
    }
}

#[tokio::test]
async fn heals_a_gap_exactly_from_the_replay_router() {
    let WithReplay {
        server,
        mut publisher,
        buffer,
        router,
        bridge,
        ..
    } = with_replay().await;

    let captured = captured();
    for batch in &captured {
        buffer.lock().push((batch.seq, batch.payload.clone()));
        // Batches 2, 3 and 4 are lost on the live path (as above the PUB's high-water mark).
        if !(2..=4).contains(&batch.seq) {
            publisher.publish(batch.seq, &batch.payload).await;
        }
    }
    let events: Vec<&Value> = captured.iter().flat_map(|c| &c.events).collect();
    server
        .wait_for(&simulate(events.iter().copied()), &all_hashes(&events))
        .await;
    assert_eq!(Stats::get(&bridge.stats.gaps), 1);
    assert_eq!(
        Stats::get(&bridge.stats.replays_failed),
        1,
        "only the start-up replay of an empty buffer"
    );
    assert_eq!(
        Stats::get(&bridge.stats.clears),
        1,
        "the gap needed no clear"
    );
    bridge.stop().await;
    router.abort();
}

#[tokio::test]
async fn clears_the_worker_when_the_replay_was_evicted() {
    let WithReplay {
        server,
        mut publisher,
        buffer,
        router,
        bridge,
        ..
    } = with_replay().await;

    let captured = captured();
    for batch in &captured[..2] {
        publisher.publish(batch.seq, &batch.payload).await;
    }
    let early: Vec<&Value> = captured[..2].iter().flat_map(|c| &c.events).collect();
    server
        .wait_for(&simulate(early.iter().copied()), &all_hashes(&early))
        .await;

    // Batch 2 is lost live and already evicted from the replay buffer.
    for batch in &captured[2..] {
        if batch.seq > 2 {
            buffer.lock().push((batch.seq, batch.payload.clone()));
        }
        if batch.seq > 4 {
            publisher.publish(batch.seq, &batch.payload).await;
        }
    }
    // The index restarts from nothing at the gap: batches 3..5 only.
    let late: Vec<&Value> = captured[3..].iter().flat_map(|c| &c.events).collect();
    let everything: Vec<&Value> = captured.iter().flat_map(|c| &c.events).collect();
    server
        .wait_for(&simulate(late.iter().copied()), &all_hashes(&everything))
        .await;
    assert_eq!(Stats::get(&bridge.stats.gaps), 1);
    assert_eq!(
        Stats::get(&bridge.stats.clears),
        2,
        "start-up, then the evicted gap"
    );
    bridge.stop().await;
    router.abort();
}

#[tokio::test]
async fn clears_the_worker_when_the_publisher_restarts() {
    let server = IndexServer::start(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let (listener, endpoint) = loopback();
    let addr = listener.local_addr().unwrap();
    let mut publisher = Publisher::bind(listener).await;
    let bridge = RunningBridge::start(bridge_config(server.addr, &endpoint, None));
    publisher.wait_subscribed(&bridge.stats).await;
    let first = [
        batch(vec![stored(&[1, 2, 3], "GPU")]),
        batch(vec![stored(&[4, 5], "CPU_PINNED")]),
    ];
    for (seq, payload) in first.iter().enumerate() {
        publisher.publish(seq as u64, payload).await;
    }
    let universe: BTreeSet<i64> = (1..=9).collect();
    let expect = |pairs: &[(i32, &[i64])]| -> BTreeMap<i32, BTreeSet<i64>> {
        pairs
            .iter()
            .map(|(tier, hashes)| (*tier, hashes.iter().copied().collect()))
            .collect()
    };
    server
        .wait_for(&expect(&[(1, &[1, 2, 3]), (2, &[4, 5])]), &universe)
        .await;

    // The worker process restarts: a new PUB on the same port, sequence from 0 again, and
    // without the blocks it held before.
    drop(publisher);
    let listener = loop {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => break listener,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let mut publisher = Publisher::bind(listener).await;
    publisher.wait_subscribed(&bridge.stats).await;
    publisher
        .publish(0, &batch(vec![stored(&[7, 8], "GPU")]))
        .await;
    server.wait_for(&expect(&[(1, &[7, 8])]), &universe).await;
    assert_eq!(
        Stats::get(&bridge.stats.clears),
        2,
        "start-up, then the restart"
    );
    bridge.stop().await;
}

/// Binds `addr` again once the previous socket has let it go.
async fn rebind(addr: SocketAddr) -> std::net::TcpListener {
    let start = Instant::now();
    loop {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => return listener,
            Err(error) => {
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "cannot rebind {addr}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// A worker restarts and, before the bridge is back, publishes past its old sequence number:
/// the first batch the bridge sees looks like a gap, and replay would answer it from the new
/// process. Only the reconnect tells the truth: the old blocks must go.
#[tokio::test]
async fn a_worker_restart_that_looks_like_a_gap_still_clears_the_worker() {
    let WithReplay {
        server,
        mut publisher,
        pub_addr,
        buffer,
        router,
        bridge,
    } = with_replay().await;
    for (seq, hashes) in [(0u64, [1i64, 2]), (1, [3, 4])] {
        let payload = batch(vec![stored(&hashes, "GPU")]);
        buffer.lock().push((seq, payload.clone()));
        publisher.publish(seq, &payload).await;
    }
    let universe: BTreeSet<i64> = (1..=20).collect();
    server
        .wait_for(&[(1, BTreeSet::from([1, 2, 3, 4]))].into(), &universe)
        .await;

    // The new process: an empty cache, sequence from 0, already at seq 5 when it is seen.
    drop(publisher);
    buffer.lock().clear();
    let new_batches: Vec<(u64, Vec<u8>)> = (0..6u64)
        .map(|seq| (seq, batch(vec![stored(&[10 + seq as i64], "GPU")])))
        .collect();
    buffer.lock().extend(new_batches.iter().take(5).cloned());
    let mut publisher = Publisher::bind(rebind(pub_addr).await).await;
    publisher.wait_subscribed(&bridge.stats).await;
    buffer.lock().push(new_batches[5].clone());
    publisher.publish(5, &new_batches[5].1).await;
    server
        .wait_for(&[(1, (10..=15).collect())].into(), &universe)
        .await;
    assert!(Stats::get(&bridge.stats.reconnects) >= 1);
    bridge.stop().await;
    router.abort();
}

/// A worker restarts and publishes nothing the bridge can see live: the reconnect alone must
/// clear it (and replay what the new process has).
#[tokio::test]
async fn a_quiet_worker_restart_clears_the_worker() {
    let WithReplay {
        server,
        mut publisher,
        pub_addr,
        buffer,
        router,
        bridge,
    } = with_replay().await;
    let old = batch(vec![stored(&[1, 2, 3], "GPU")]);
    buffer.lock().push((0, old.clone()));
    publisher.publish(0, &old).await;
    let universe: BTreeSet<i64> = (1..=20).collect();
    server
        .wait_for(&[(1, BTreeSet::from([1, 2, 3]))].into(), &universe)
        .await;

    drop(publisher);
    *buffer.lock() = vec![(0, batch(vec![stored(&[7], "GPU")]))];
    let mut publisher = Publisher::bind(rebind(pub_addr).await).await;
    publisher.wait_subscribed(&bridge.stats).await;
    server
        .wait_for(&[(1, BTreeSet::from([7]))].into(), &universe)
        .await;
    bridge.stop().await;
    router.abort();
}

/// A peer on the publisher's port that accepts every connection and hangs up at once, as a
/// worker dying while it starts: a subscriber's handshake with it fails. Stopping it gives the
/// listener back, still bound.
struct HangUp {
    stop: CancellationToken,
    task: JoinHandle<std::net::TcpListener>,
}

impl HangUp {
    fn start(listener: std::net::TcpListener) -> HangUp {
        listener.set_nonblocking(true).unwrap();
        let listener = TcpListener::from_std(listener).unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return listener.into_std().unwrap(),
                        accepted = listener.accept() => drop(accepted),
                    }
                }
            }
        });
        HangUp { stop, task }
    }

    async fn stop(self) -> std::net::TcpListener {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// The worker is away for longer than the reconnect backoff: while it is gone its port first
/// refuses, then hangs up on every handshake, so the bridge's connects fail again and again.
/// The bridge keeps trying, and when the worker is back on the same address it resyncs: the
/// old blocks are cleared and the new publisher's events are in the index.
#[tokio::test]
async fn keeps_following_through_a_publisher_outage_and_resyncs_when_it_is_back() {
    let server = IndexServer::start(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let (listener, endpoint) = loopback();
    let addr = listener.local_addr().unwrap();
    let mut publisher = Publisher::bind(listener).await;
    let bridge = RunningBridge::start(bridge_config(server.addr, &endpoint, None));
    publisher.wait_subscribed(&bridge.stats).await;
    publisher
        .publish(0, &batch(vec![stored(&[1, 2, 3], "GPU")]))
        .await;
    let universe: BTreeSet<i64> = (1..=9).collect();
    server
        .wait_for(&[(1, BTreeSet::from([1, 2, 3]))].into(), &universe)
        .await;

    drop(publisher);
    // The worker comes back on its own address: that is the scenario, so the test must bind
    // the publisher's port again (and keeps that listener from here on).
    let hang_up = HangUp::start(rebind(addr).await);
    let failures = Stats::get(&bridge.stats.connect_failures);
    kv_testkit::wait::until(
        "the bridge's connects to fail while the worker is away",
        || {
            let failed = Stats::get(&bridge.stats.connect_failures) >= failures + 3;
            std::future::ready(failed.then_some(()))
        },
    )
    .await;
    assert!(
        !bridge.task.is_finished(),
        "the bridge gave up on an absent publisher"
    );

    let mut publisher = Publisher::bind(hang_up.stop().await).await;
    publisher.wait_subscribed(&bridge.stats).await;
    publisher
        .publish(0, &batch(vec![stored(&[7, 8], "GPU")]))
        .await;
    server
        .wait_for(&[(1, BTreeSet::from([7, 8]))].into(), &universe)
        .await;
    assert!(Stats::get(&bridge.stats.reconnects) >= 1);
    assert_eq!(
        Stats::get(&bridge.stats.clears),
        2,
        "start-up, then the resync once the worker was back"
    );
    assert!(!bridge.task.is_finished());
    bridge.stop().await;
}

#[tokio::test]
async fn delivers_every_queued_batch_in_order_after_a_server_restart() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = IndexServer::start(listener).await;
    let (pub_listener, pub_endpoint) = loopback();
    let mut publisher = Publisher::bind(pub_listener).await;
    let bridge = RunningBridge::start(bridge_config(server.addr, &pub_endpoint, None));
    publisher.wait_subscribed(&bridge.stats).await;
    publisher
        .publish(0, &batch(vec![stored(&[1], "GPU")]))
        .await;
    let universe: BTreeSet<i64> = (1..=100).collect();
    server
        .wait_for(&[(1, BTreeSet::from([1]))].into(), &universe)
        .await;

    let addr = server.stop().await;
    // While the server is down, a stream whose end state depends on its order.
    let mut events = Vec::new();
    for seq in 1..60u64 {
        let hash = seq as i64 + 1;
        let event = match seq % 3 {
            0 => removed(&[hash - 1], "GPU"),
            _ => stored(&[hash], "GPU"),
        };
        events.push(event.clone());
        publisher.publish(seq, &batch(vec![event])).await;
    }
    let server = IndexServer::start(TcpListener::bind(addr).await.unwrap()).await;
    // The restarted index starts empty and must receive batches 1..59, in order.
    server.wait_for(&simulate(&events), &universe).await;
    assert_eq!(
        Stats::get(&bridge.stats.clears),
        1,
        "nothing was dropped: only the start-up clear"
    );
    bridge.stop().await;
}

#[tokio::test]
async fn an_overflowing_queue_is_dropped_and_the_worker_cleared_first() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = IndexServer::start(listener).await;
    let (pub_listener, pub_endpoint) = loopback();
    let mut publisher = Publisher::bind(pub_listener).await;
    let config = bridge_config_with(server.addr, &pub_endpoint, None, &["--queue-batches", "4"]);
    let bridge = RunningBridge::start(config);
    publisher.wait_subscribed(&bridge.stats).await;
    publisher
        .publish(0, &batch(vec![stored(&[1, 2], "GPU")]))
        .await;
    let universe: BTreeSet<i64> = (1..=40).collect();
    server
        .wait_for(&[(1, BTreeSet::from([1, 2]))].into(), &universe)
        .await;

    let addr = server.stop().await;
    // Batch 1 revokes block 1 and is lost in the overflow: the index must not keep claiming it.
    publisher
        .publish(1, &batch(vec![removed(&[1], "GPU")]))
        .await;
    for seq in 2..12u64 {
        publisher
            .publish(seq, &batch(vec![stored(&[seq as i64 + 10], "GPU")]))
            .await;
    }
    let server = IndexServer::start(TcpListener::bind(addr).await.unwrap()).await;
    // What survives is what came after the last overflow: the queue held at most 4 items.
    let start = Instant::now();
    loop {
        let held = server.held(&universe).await;
        let gpu = held.get(&1).cloned().unwrap_or_default();
        if gpu.contains(&21) {
            assert!(
                !gpu.contains(&1) && !gpu.contains(&2),
                "blocks from before the overflow are still claimed: {gpu:?}"
            );
            assert!(
                gpu.len() <= 4,
                "more batches than the queue holds survived: {gpu:?}"
            );
            assert!(gpu.iter().all(|h| (12..=21).contains(h)), "{gpu:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the queued batches never arrived: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        Stats::get(&bridge.stats.clears) >= 2,
        "start-up and overflow clears"
    );
    bridge.stop().await;
}

#[tokio::test]
async fn heartbeats_register_the_worker_on_a_restarted_server() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = IndexServer::start(listener).await;
    let (pub_listener, pub_endpoint) = loopback();
    let _publisher = Publisher::bind(pub_listener).await;
    let bridge = RunningBridge::start(bridge_config(server.addr, &pub_endpoint, None));
    server.wait_for_workers(1).await;
    let addr = server.stop().await;
    let server = IndexServer::start(TcpListener::bind(addr).await.unwrap()).await;
    // No event arrives, yet the new server learns the worker (address and spec) from heartbeats.
    server.wait_for_workers(1).await;
    bridge.stop().await;
}

#[tokio::test]
async fn skips_and_counts_malformed_frames_and_batches_and_keeps_going() {
    let server = IndexServer::start(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let (listener, endpoint) = loopback();
    let mut publisher = Publisher::bind(listener).await;
    let bridge = RunningBridge::start(bridge_config(server.addr, &endpoint, None));
    publisher.wait_subscribed(&bridge.stats).await;
    let frames_before = Stats::get(&bridge.stats.frames_malformed);

    // Four frames; a seq of 3 bytes; a payload that is not msgpack; an unknown medium.
    publisher
        .send(vec![TOPIC.into(), vec![0; 8], vec![0x90], vec![1]])
        .await;
    publisher
        .send(vec![
            TOPIC.into(),
            vec![0; 3],
            batch(vec![stored(&[9], "GPU")]),
        ])
        .await;
    publisher.publish(0, &[0xc1, 0xff, 0x00]).await;
    publisher
        .publish(
            1,
            &batch(vec![stored(&[5], "EXTERNAL"), stored(&[6], "GPU")]),
        )
        .await;
    // A message for another topic that shares the prefix is not ours.
    publisher
        .send(vec![
            b"kv-events-other".to_vec(),
            2u64.to_be_bytes().to_vec(),
            batch(vec![stored(&[7], "GPU")]),
        ])
        .await;
    publisher
        .publish(2, &batch(vec![stored(&[8], "DISK")]))
        .await;

    let universe: BTreeSet<i64> = (1..=9).collect();
    server
        .wait_for(
            &[(1, BTreeSet::from([6])), (3, BTreeSet::from([8]))].into(),
            &universe,
        )
        .await;
    assert_eq!(
        Stats::get(&bridge.stats.frames_malformed) - frames_before,
        2
    );
    assert_eq!(Stats::get(&bridge.stats.events_skipped), 1);
    assert!(
        Stats::get(&bridge.stats.batches_skipped) >= frames_before + 4,
        "frames, msgpack and topic skips are counted"
    );
    assert_eq!(Stats::get(&bridge.stats.gaps), 0);
    bridge.stop().await;
}

#[tokio::test]
async fn carries_a_multi_megabyte_batch() {
    let server = IndexServer::start(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let (listener, endpoint) = loopback();
    let mut publisher = Publisher::bind(listener).await;
    let bridge = RunningBridge::start(bridge_config(server.addr, &endpoint, None));
    publisher.wait_subscribed(&bridge.stats).await;
    // 300,000 u64 hashes (9 bytes each in msgpack): a 2.7 MB frame, 19 RPCs.
    let hashes: Vec<i64> = (0..300_000).map(|i| i64::MAX - i).collect();
    let payload = batch(vec![stored(&hashes, "GPU")]);
    assert!(payload.len() > 2_000_000);
    publisher.publish(0, &payload).await;
    let universe: BTreeSet<i64> = hashes.iter().copied().collect();
    server
        .wait_for(&[(1, universe.clone())].into(), &universe)
        .await;
    bridge.stop().await;
}

#[tokio::test]
async fn stops_with_an_error_on_a_permanent_status() {
    // A gRPC server without the KVIndexer service answers UNIMPLEMENTED: a misconfiguration.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let (listener, endpoint) = loopback();
    let mut publisher = Publisher::bind(listener).await;
    let bridge = RunningBridge::start(bridge_config(addr, &endpoint, None));
    // The start-up clear is the first RPC; it is rejected.
    let result = tokio::time::timeout(Duration::from_secs(20), bridge.task)
        .await
        .unwrap()
        .unwrap();
    match result {
        Err(BridgeError::Permanent { code, .. }) => assert_eq!(code, tonic::Code::Unimplemented),
        other => panic!("expected a permanent error, got {other:?}"),
    }
    publisher.send(vec![TOPIC.into()]).await;
}

#[test]
fn the_binary_exits_non_zero_naming_a_bad_variable() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-bridge"))
        .env("KV_INDEXER_WORKER_ID", "w")
        .env("KV_INDEXER_CACHE_COMPONENTS", "full,swa")
        .env_remove("KV_INDEXER_SWA_WINDOW_TOKENS")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("KV_INDEXER_SWA_WINDOW_TOKENS"), "{stderr}");
}
