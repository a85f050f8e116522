//! The bridge end to end on loopback: a real ZMQ PUB (and replay ROUTER) sending the frames
//! captured from SGLang → `bridge::run` → the real server → `MatchExternalKv`.

use std::collections::BTreeSet;
use std::time::Duration;

use kv_bridge::BridgeError;
use kv_bridge::stats::Stats;
use kv_testkit::indexer::{Held, apply_events};
use kv_testkit::worker::{Captured, TOPIC, batch, captured, removed, stored};
use kv_testkit::{BridgeFlags, FakeWorker, RunningBridge, TestIndexer, wait};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WORKER: &str = "worker-0";

/// What the worker holds after `events`, by tier name, computed from the fixture's expected
/// events (not by the bridge's decoder).
fn simulate<'a>(events: impl IntoIterator<Item = &'a Value>) -> Held {
    let tier = |medium: &Value| match medium.as_str() {
        Some("GPU") => 1,
        Some("CPU_PINNED") => 2,
        Some("DISK") => 3,
        other => panic!("unexpected medium {other:?}"),
    };
    let hashes = |event: &Value| -> Vec<i64> {
        serde_json::from_value(event["block_hashes"].clone()).unwrap()
    };
    let mut held = Held::new();
    apply_events(&mut held, events, tier, hashes);
    held
}

fn all_hashes(events: &[&Value]) -> BTreeSet<i64> {
    events
        .iter()
        .filter_map(|e| e["block_hashes"].as_array())
        .flatten()
        .map(|h| h.as_i64().unwrap())
        .collect()
}

/// One batch that stores `hashes` at GPU.
fn gpu(hashes: &[i64]) -> Vec<u8> {
    batch(vec![stored(hashes, "GPU")])
}

/// `pairs` as a view: `(tier, hashes)`.
fn held(pairs: &[(i32, &[i64])]) -> Held {
    pairs
        .iter()
        .map(|(tier, hashes)| (*tier, hashes.iter().copied().collect()))
        .collect()
}

/// The bridge's flags for `worker` against `server`, with 200 ms heartbeats.
fn flags(server: &str, worker: &FakeWorker) -> BridgeFlags {
    BridgeFlags::new(WORKER, "http://127.0.0.1:30000", server, &worker.endpoint())
        .replay(worker.replay_endpoint())
        .flag("--heartbeat-ms", "200")
}

/// A server, a fake worker, and a bridge following it, already subscribed.
struct Setup {
    server: TestIndexer,
    worker: FakeWorker,
    bridge: RunningBridge,
}

impl Setup {
    async fn start(worker: FakeWorker, tune: impl FnOnce(BridgeFlags) -> BridgeFlags) -> Setup {
        Setup::on(TestIndexer::start().await, worker, tune).await
    }

    /// The bridge of `worker` against `server`.
    async fn on(
        server: TestIndexer,
        worker: FakeWorker,
        tune: impl FnOnce(BridgeFlags) -> BridgeFlags,
    ) -> Setup {
        let mut worker = worker;
        let bridge = tune(flags(&server.url(), &worker)).start();
        worker.wait_subscribed(&bridge.stats).await;
        Setup {
            server,
            worker,
            bridge,
        }
    }

    async fn plain() -> Setup {
        Setup::start(FakeWorker::start().await, |flags| flags).await
    }

    async fn with_replay() -> Setup {
        Setup::start(FakeWorker::with_replay().await, |flags| flags).await
    }

    /// Waits until the index shows exactly `expected` for the worker among `universe`.
    async fn wait_for(&self, expected: &Held, universe: &BTreeSet<i64>) {
        self.server.wait_for_held(WORKER, expected, universe).await;
    }

    /// Restarts the worker process and waits until the bridge is subscribed to the new one.
    async fn restart_worker(&mut self) {
        self.worker.restart().await;
        self.worker.wait_subscribed(&self.bridge.stats).await;
    }

    /// Publishes `hashes` at GPU as batch `seq` and waits until the index holds just those.
    async fn publish_and_wait(&mut self, seq: u64, hashes: &[i64], universe: &BTreeSet<i64>) {
        self.worker.publish(seq, &gpu(hashes)).await;
        self.wait_for(&held(&[(1, hashes)]), universe).await;
    }

    async fn stop(self) {
        self.bridge.stop().await;
    }

    /// Publishes a batch and keeps it in the replay buffer, as SGLang's publisher does.
    async fn publish_buffered(&mut self, seq: u64, payload: Vec<u8>) {
        self.worker.buffer().lock().push((seq, payload.clone()));
        self.worker.publish(seq, &payload).await;
    }

    /// Waits until the index shows what every message of `captured` leaves the worker holding.
    async fn wait_for_all(&self, captured: &[Captured]) {
        let events: Vec<&Value> = captured.iter().flat_map(|c| &c.events).collect();
        self.wait_for(&simulate(events.iter().copied()), &all_hashes(&events))
            .await;
    }

    /// Checks that the bridge cleared the worker exactly `clears` times (`why`), then stops it.
    async fn stop_after_clears(self, clears: u64, why: &str) {
        assert_eq!(Stats::get(&self.bridge.stats.clears), clears, "{why}");
        self.stop().await;
    }
}

#[tokio::test]
async fn applies_the_captured_real_frames_from_a_late_publisher() {
    let server = TestIndexer::start().await;
    let mut worker = FakeWorker::unbound();
    // The bridge starts first and finds nothing listening: it must keep trying. The pause is
    // the behaviour under test (a publisher that comes up later), not a readiness wait.
    let bridge = flags(&server.url(), &worker).start();
    tokio::time::sleep(Duration::from_millis(100)).await;
    worker.bind().await;
    worker.wait_subscribed(&bridge.stats).await;
    let setup = Setup {
        server,
        worker,
        bridge,
    };
    check_captured_arrive(setup).await;
}

/// Publishes every captured live message and checks that the index ends as the events say,
/// with no gap and only the start-up clear.
async fn check_captured_arrive(mut setup: Setup) {
    let captured = captured();
    for batch in &captured {
        setup.worker.publish(batch.seq, &batch.payload).await;
    }
    setup.wait_for_all(&captured).await;
    let stats = &setup.bridge.stats;
    assert_eq!(Stats::get(&stats.gaps), 0);
    assert_eq!(Stats::get(&stats.batches), captured.len() as u64);
    setup.stop_after_clears(1, "only the start-up clear").await;
}

/// A batch lost on the live path shows as a gap only when the next one arrives; when it was
/// the last before a quiet spell, the bridge asks the replay router once the stream has been
/// quiet for a while, and applies it (here a removal, which the index would otherwise keep).
#[tokio::test]
async fn heals_a_lost_last_batch_once_the_stream_goes_quiet() {
    let mut setup = Setup::with_replay().await;
    let universe = BTreeSet::from([1, 2]);
    setup.publish_buffered(0, gpu(&[1, 2])).await;
    setup.wait_for(&held(&[(1, &[1, 2])]), &universe).await;
    // Batch 1 reaches the replay buffer but not the subscriber, and nothing follows it.
    let lost = batch(vec![removed(&[2], "GPU")]);
    setup.worker.buffer().lock().push((1, lost));
    setup.wait_for(&held(&[(1, &[1])]), &universe).await;
    let stats = &setup.bridge.stats;
    assert_eq!(Stats::get(&stats.gaps), 1);
    assert_eq!(Stats::get(&stats.replays_failed), 0);
    // The live path's next batch continues after the replayed one: no second gap.
    setup.publish_buffered(2, gpu(&[3])).await;
    let universe = BTreeSet::from([1, 2, 3]);
    setup.wait_for(&held(&[(1, &[1, 3])]), &universe).await;
    assert_eq!(Stats::get(&setup.bridge.stats.gaps), 1);
    setup.stop_after_clears(1, "only the start-up clear").await;
}

#[tokio::test]
async fn heals_a_gap_exactly_from_the_replay_router() {
    let mut setup = Setup::with_replay().await;
    let captured = captured();
    for batch in &captured {
        setup
            .worker
            .buffer()
            .lock()
            .push((batch.seq, batch.payload.clone()));
        // Batches 2, 3 and 4 are lost on the live path (as above the PUB's high-water mark).
        if !(2..=4).contains(&batch.seq) {
            setup.worker.publish(batch.seq, &batch.payload).await;
        }
    }
    setup.wait_for_all(&captured).await;
    let stats = &setup.bridge.stats;
    assert_eq!(Stats::get(&stats.gaps), 1);
    assert_eq!(
        Stats::get(&stats.replays_failed),
        0,
        "the start-up replay of an empty buffer lost nothing"
    );
    setup.stop_after_clears(1, "the gap needed no clear").await;
}

#[tokio::test]
async fn clears_the_worker_when_the_replay_was_evicted() {
    let mut setup = Setup::with_replay().await;
    let captured = captured();
    for batch in &captured[..2] {
        setup.worker.publish(batch.seq, &batch.payload).await;
    }
    let early: Vec<&Value> = captured[..2].iter().flat_map(|c| &c.events).collect();
    setup
        .wait_for(&simulate(early.iter().copied()), &all_hashes(&early))
        .await;

    // Batch 2 is lost live and already evicted from the replay buffer.
    for batch in &captured[2..] {
        if batch.seq > 2 {
            setup
                .worker
                .buffer()
                .lock()
                .push((batch.seq, batch.payload.clone()));
        }
        if batch.seq > 4 {
            setup.worker.publish(batch.seq, &batch.payload).await;
        }
    }
    // The index restarts from nothing at the gap: batches 3..5 only.
    let late: Vec<&Value> = captured[3..].iter().flat_map(|c| &c.events).collect();
    let everything: Vec<&Value> = captured.iter().flat_map(|c| &c.events).collect();
    setup
        .wait_for(&simulate(late.iter().copied()), &all_hashes(&everything))
        .await;
    assert_eq!(Stats::get(&setup.bridge.stats.gaps), 1);
    setup
        .stop_after_clears(2, "start-up, then the evicted gap")
        .await;
}

#[tokio::test]
async fn clears_the_worker_when_the_publisher_restarts() {
    let mut setup = Setup::plain().await;
    let first = [gpu(&[1, 2, 3]), batch(vec![stored(&[4, 5], "CPU_PINNED")])];
    for (seq, payload) in first.iter().enumerate() {
        setup.worker.publish(seq as u64, payload).await;
    }
    let universe: BTreeSet<i64> = (1..=9).collect();
    setup
        .wait_for(&held(&[(1, &[1, 2, 3]), (2, &[4, 5])]), &universe)
        .await;

    // The worker process restarts: a new PUB on the same port, sequence from 0 again, and
    // without the blocks it held before.
    setup.restart_worker().await;
    setup.publish_and_wait(0, &[7, 8], &universe).await;
    setup
        .stop_after_clears(2, "start-up, then the restart")
        .await;
}

/// A worker restarts and, before the bridge is back, publishes past its old sequence number:
/// the first batch the bridge sees looks like a gap, and replay would answer it from the new
/// process. Only the reconnect tells the truth: the old blocks must go.
#[tokio::test]
async fn a_worker_restart_that_looks_like_a_gap_still_clears_the_worker() {
    let mut setup = Setup::with_replay().await;
    for (seq, hashes) in [(0u64, [1i64, 2]), (1, [3, 4])] {
        let payload = gpu(&hashes);
        setup.worker.buffer().lock().push((seq, payload.clone()));
        setup.worker.publish(seq, &payload).await;
    }
    let universe: BTreeSet<i64> = (1..=20).collect();
    setup
        .wait_for(&held(&[(1, &[1, 2, 3, 4])]), &universe)
        .await;

    // The new process: an empty cache, sequence from 0, already at seq 5 when it is seen.
    let new_batches: Vec<(u64, Vec<u8>)> = (0..6u64)
        .map(|seq| (seq, gpu(&[10 + seq as i64])))
        .collect();
    *setup.worker.buffer().lock() = new_batches[..5].to_vec();
    setup.restart_worker().await;
    setup.worker.buffer().lock().push(new_batches[5].clone());
    setup.worker.publish(5, &new_batches[5].1).await;
    setup
        .wait_for(&[(1, (10..=15).collect())].into(), &universe)
        .await;
    assert!(Stats::get(&setup.bridge.stats.reconnects) >= 1);
    setup.stop().await;
}

/// A worker restarts and publishes nothing the bridge can see live: the reconnect alone must
/// clear it (and replay what the new process has).
#[tokio::test]
async fn a_quiet_worker_restart_clears_the_worker() {
    let mut setup = Setup::with_replay().await;
    let old = gpu(&[1, 2, 3]);
    setup.worker.buffer().lock().push((0, old.clone()));
    setup.worker.publish(0, &old).await;
    let universe: BTreeSet<i64> = (1..=20).collect();
    setup.wait_for(&held(&[(1, &[1, 2, 3])]), &universe).await;

    *setup.worker.buffer().lock() = vec![(0, gpu(&[7]))];
    setup.restart_worker().await;
    setup.wait_for(&held(&[(1, &[7])]), &universe).await;
    setup.stop().await;
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
    let mut setup = Setup::plain().await;
    let universe: BTreeSet<i64> = (1..=9).collect();
    setup.publish_and_wait(0, &[1, 2, 3], &universe).await;

    setup.worker.go_away();
    // The worker comes back on its own address: that is the scenario, so its port is listened
    // on again (first by a peer that hangs up on every handshake).
    let hang_up = HangUp::start(setup.worker.port().listen_std());
    let stats = setup.bridge.stats.clone();
    let failures = Stats::get(&stats.connect_failures);
    kv_testkit::wait::until(
        "the bridge's connects to fail while the worker is away",
        || {
            let failed = Stats::get(&stats.connect_failures) >= failures + 3;
            std::future::ready(failed.then_some(()))
        },
    )
    .await;
    assert!(
        !setup.bridge.task.is_finished(),
        "the bridge gave up on an absent publisher"
    );

    drop(hang_up.stop().await);
    setup.worker.bind().await;
    setup.worker.wait_subscribed(&stats).await;
    setup.publish_and_wait(0, &[7, 8], &universe).await;
    assert!(Stats::get(&stats.reconnects) >= 1);
    assert!(!setup.bridge.task.is_finished());
    setup
        .stop_after_clears(2, "start-up, then the resync once the worker was back")
        .await;
}

#[tokio::test]
async fn delivers_every_queued_batch_in_order_after_a_server_restart() {
    let mut setup = Setup::plain().await;
    let universe: BTreeSet<i64> = (1..=100).collect();
    setup.publish_and_wait(0, &[1], &universe).await;

    setup.server.shut_down().await;
    // While the server is down, a stream whose end state depends on its order.
    let mut events = Vec::new();
    for seq in 1..60u64 {
        let hash = seq as i64 + 1;
        let event = match seq % 3 {
            0 => removed(&[hash - 1], "GPU"),
            _ => stored(&[hash], "GPU"),
        };
        events.push(event.clone());
        setup.worker.publish(seq, &batch(vec![event])).await;
    }
    setup.server.restart().await;
    // The restarted index starts empty and must receive batches 1..59, in order.
    setup.wait_for(&simulate(&events), &universe).await;
    setup
        .stop_after_clears(1, "nothing was dropped: only the start-up clear")
        .await;
}

/// The server comes back on an older copy of its state directory: it claims blocks the worker
/// has since dropped and lacks ones it stored, and the bridge was told those batches were
/// applied. The bridge's next numbered apply shows the gap: the server clears the worker and
/// answers ABORTED, the bridge re-syncs from the publisher's buffer, and the index ends equal
/// to the worker's cache.
#[tokio::test]
async fn a_server_on_an_older_state_directory_makes_the_bridge_re_sync() {
    let dir = kv_testkit::temp_dir("kv-bridge-resync", "state");
    let config = |dir: &std::path::Path| kv_server::Config {
        state: kv_state::config::StateConfig {
            dir: Some(dir.to_path_buf()),
            snapshot_interval: None,
            ..Default::default()
        },
        ..kv_server::Config::default()
    };
    let server = TestIndexer::with_config(config(&dir)).await;
    let mut setup = Setup::on(server, FakeWorker::with_replay().await, |flags| flags).await;
    let universe: BTreeSet<i64> = (1..=10).collect();
    let mut events = vec![stored(&[1, 2, 3, 4], "GPU")];
    setup.publish_buffered(0, batch(events.clone())).await;
    setup.wait_for(&simulate(&events), &universe).await;
    // What a restore from an older volume snapshot would bring back.
    setup.server.shut_down().await;
    let older = kv_testkit::crash_image(&dir, "kv-bridge-resync", "older");
    setup.server.restart().await;
    for (seq, event) in [(1, removed(&[1, 2], "GPU")), (2, stored(&[5], "GPU"))] {
        events.push(event.clone());
        setup.publish_buffered(seq, batch(vec![event])).await;
    }
    let now = simulate(&events);
    setup.wait_for(&now, &universe).await;

    setup.server.restart_with(config(&older)).await;
    // The heartbeats (every 200 ms) are numbered too: the first one after the restart shows
    // the gap, and the re-sync replays the publisher's buffer onto the cleared worker.
    setup.wait_for(&now, &universe).await;
    assert!(
        Stats::get(&setup.bridge.stats.clears) >= 2,
        "the start-up clear and the re-sync"
    );
    setup.stop().await;
}

#[tokio::test]
async fn with_a_list_of_replicas_a_bridge_fails_over_to_the_next() {
    let dead = kv_testkit::Port::reserve();
    let server = TestIndexer::start().await;
    let mut worker = FakeWorker::start().await;
    // The first replica refuses every connection: batches must reach the second.
    let endpoints = format!("{},{}", dead.url(), server.url());
    let bridge = flags(&endpoints, &worker).start();
    worker.wait_subscribed(&bridge.stats).await;
    worker.publish(0, &gpu(&[5, 6])).await;
    let universe: BTreeSet<i64> = (1..=10).collect();
    server
        .wait_for_held(WORKER, &held(&[(1, &[5, 6])]), &universe)
        .await;
    bridge.stop().await;
}

#[tokio::test]
async fn an_overflowing_queue_is_dropped_and_the_worker_cleared_first() {
    let worker = FakeWorker::start().await;
    let mut setup = Setup::start(worker, |flags| flags.flag("--queue-batches", "4")).await;
    let universe: BTreeSet<i64> = (1..=40).collect();
    setup.publish_and_wait(0, &[1, 2], &universe).await;

    setup.server.shut_down().await;
    // Batch 1 revokes block 1 and is lost in the overflow: the index must not keep claiming it.
    setup
        .worker
        .publish(1, &batch(vec![removed(&[1], "GPU")]))
        .await;
    for seq in 2..12u64 {
        setup.worker.publish(seq, &gpu(&[seq as i64 + 10])).await;
    }
    setup.server.restart().await;
    // What survives is what came after the last overflow: the queue held at most 4 items.
    let gpu = wait::until_ok("the queued batches to arrive", || async {
        let held = setup.server.held(WORKER, &universe).await;
        match held.get(&1) {
            Some(gpu) if gpu.contains(&21) => Ok(gpu.clone()),
            _ => Err(held),
        }
    })
    .await;
    assert!(
        !gpu.contains(&1) && !gpu.contains(&2),
        "blocks from before the overflow are still claimed: {gpu:?}"
    );
    assert!(
        gpu.len() <= 4,
        "more batches than the queue holds survived: {gpu:?}"
    );
    assert!(gpu.iter().all(|h| (12..=21).contains(h)), "{gpu:?}");
    assert!(
        Stats::get(&setup.bridge.stats.clears) >= 2,
        "start-up and overflow clears"
    );
    setup.stop().await;
}

#[tokio::test]
async fn heartbeats_register_the_worker_on_a_restarted_server() {
    let mut server = TestIndexer::start().await;
    let worker = FakeWorker::start().await;
    let bridge = flags(&server.url(), &worker).start();
    server.wait_for_workers(1).await;
    server.restart().await;
    // No event arrives, yet the new server learns the worker (address and spec) from heartbeats.
    server.wait_for_workers(1).await;
    bridge.stop().await;
}

#[tokio::test]
async fn skips_and_counts_malformed_frames_and_batches_and_keeps_going() {
    let mut setup = Setup::plain().await;
    let stats = setup.bridge.stats.clone();
    let frames_before = Stats::get(&stats.frames_malformed);
    let worker = &mut setup.worker;

    // Four frames; a seq of 3 bytes; a payload that is not msgpack; an unknown medium.
    worker
        .send(vec![TOPIC.into(), vec![0; 8], vec![0x90], vec![1]])
        .await;
    worker.send(vec![TOPIC.into(), vec![0; 3], gpu(&[9])]).await;
    worker.publish(0, &[0xc1, 0xff, 0x00]).await;
    worker
        .publish(
            1,
            &batch(vec![stored(&[5], "EXTERNAL"), stored(&[6], "GPU")]),
        )
        .await;
    // A message for another topic that shares the prefix is not ours.
    worker
        .send(vec![
            b"kv-events-other".to_vec(),
            2u64.to_be_bytes().to_vec(),
            gpu(&[7]),
        ])
        .await;
    worker.publish(2, &batch(vec![stored(&[8], "DISK")])).await;

    let universe: BTreeSet<i64> = (1..=9).collect();
    setup
        .wait_for(&held(&[(1, &[6]), (3, &[8])]), &universe)
        .await;
    assert_eq!(Stats::get(&stats.frames_malformed) - frames_before, 2);
    assert_eq!(Stats::get(&stats.events_skipped), 1);
    assert!(
        Stats::get(&stats.batches_skipped) >= frames_before + 4,
        "frames, msgpack and topic skips are counted"
    );
    assert_eq!(Stats::get(&stats.gaps), 0);
    setup.stop().await;
}

#[tokio::test]
async fn carries_a_multi_megabyte_batch() {
    let mut setup = Setup::plain().await;
    // 300,000 u64 hashes (9 bytes each in msgpack): a 2.7 MB frame, 19 RPCs.
    let hashes: Vec<i64> = (0..300_000).map(|i| i64::MAX - i).collect();
    let payload = gpu(&hashes);
    assert!(payload.len() > 2_000_000);
    setup.worker.publish(0, &payload).await;
    let universe: BTreeSet<i64> = hashes.iter().copied().collect();
    setup
        .wait_for(&[(1, universe.clone())].into(), &universe)
        .await;
    setup.stop().await;
}

#[tokio::test]
async fn stops_with_an_error_on_a_permanent_status() {
    // A gRPC server without the KVIndexer service answers UNIMPLEMENTED: a misconfiguration.
    let port = kv_testkit::indexer::without_kv_indexer();
    let mut worker = FakeWorker::start().await;
    let bridge = flags(&port.url(), &worker).start();
    // The start-up clear is the first RPC; it is rejected.
    let result = tokio::time::timeout(wait::PATIENCE, bridge.task)
        .await
        .unwrap()
        .unwrap();
    match result {
        Err(BridgeError::Permanent { code, .. }) => assert_eq!(code, tonic::Code::Unimplemented),
        other => panic!("expected a permanent error, got {other:?}"),
    }
    worker.send(vec![TOPIC.into()]).await;
}
