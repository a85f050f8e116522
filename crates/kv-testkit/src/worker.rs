//! The fake SGLang worker: a ZMQ PUB (bound as SGLang binds `tcp://*:port`) and, optionally, a
//! replay ROUTER answering from a buffer as SGLang's does, each on a [`Port`] kept for the
//! test's life so that a restarted worker comes back on the same address. With the SGLang
//! batch builders and the captured live frames it publishes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kv_bridge::stats::Stats;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::fixtures::{rows, unhex};
use crate::port::Port;
use crate::wait;

/// The topic SGLang publishes on by default.
pub const TOPIC: &str = "kv-events";

/// The batches the replay ROUTER answers from: `(seq, payload)`.
pub type ReplayBuffer = Arc<parking_lot::Mutex<Vec<(u64, Vec<u8>)>>>;

/// A PUB, and a replay ROUTER if asked for; the ROUTER stops when this is dropped.
pub struct FakeWorker {
    port: Port,
    socket: Option<PubSocket>,
    replay: Option<Replay>,
}

struct Replay {
    port: Port,
    buffer: ReplayBuffer,
    task: JoinHandle<()>,
}

impl FakeWorker {
    /// A PUB only.
    pub async fn start() -> FakeWorker {
        let port = Port::reserve();
        let socket = Some(bind(&port).await);
        FakeWorker {
            port,
            socket,
            replay: None,
        }
    }

    /// A PUB and a replay ROUTER answering from an empty buffer.
    pub async fn with_replay() -> FakeWorker {
        let mut worker = FakeWorker::start().await;
        let port = Port::reserve();
        let buffer = ReplayBuffer::default();
        let task = replay_router(port.listen_std(), buffer.clone());
        worker.replay = Some(Replay { port, buffer, task });
        worker
    }

    /// A PUB that has not bound yet: subscribers connecting before [`FakeWorker::bind`] are
    /// refused and must retry.
    pub fn unbound() -> FakeWorker {
        FakeWorker {
            port: Port::reserve(),
            socket: None,
            replay: None,
        }
    }

    /// Binds the PUB of an [`unbound`](FakeWorker::unbound) worker.
    pub async fn bind(&mut self) {
        assert!(self.socket.is_none(), "the PUB is already bound");
        self.socket = Some(bind(&self.port).await);
    }

    /// The worker process dies and stays away: its PUB goes, with every connection; the port
    /// stays reserved (connections are refused) until [`FakeWorker::bind`] brings it back.
    pub fn go_away(&mut self) {
        self.socket = None;
    }

    /// The PUB's port (to put another listener on it while the worker is away).
    pub fn port(&self) -> &Port {
        &self.port
    }

    /// The PUB's `tcp://` endpoint.
    pub fn endpoint(&self) -> String {
        self.port.tcp()
    }

    /// The replay ROUTER's `tcp://` endpoint, if there is one.
    pub fn replay_endpoint(&self) -> Option<String> {
        self.replay.as_ref().map(|replay| replay.port.tcp())
    }

    /// The replay buffer (panics without a replay ROUTER).
    pub fn buffer(&self) -> &ReplayBuffer {
        &self.replay.as_ref().expect("a worker with replay").buffer
    }

    /// The worker process restarts: its PUB goes away, with every connection, and a new one
    /// binds on the same port (bound before the old one closes, so a subscriber that
    /// reconnects is never refused). The replay buffer is left to the test.
    pub async fn restart(&mut self) {
        let socket = bind(&self.port).await;
        drop(self.socket.replace(socket));
    }

    /// Sends one multipart message.
    pub async fn send(&mut self, frames: Vec<Vec<u8>>) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        self.socket
            .as_mut()
            .expect("a bound PUB")
            .send(ZmqMessage::try_from(frames).expect("at least one frame"))
            .await
            .expect("the PUB sends");
    }

    /// Publishes `payload` as live message `seq`: topic, 8-byte big-endian seq, payload.
    pub async fn publish(&mut self, seq: u64, payload: &[u8]) {
        self.send(vec![
            TOPIC.as_bytes().to_vec(),
            seq.to_be_bytes().to_vec(),
            payload.to_vec(),
        ])
        .await;
    }

    /// Sends one-frame probes (skipped by a bridge as malformed, its seq untouched) until the
    /// bridge counts one: from then on its subscription is live.
    pub async fn wait_subscribed(&mut self, stats: &Stats) {
        let before = Stats::get(&stats.frames_malformed);
        let deadline = tokio::time::Instant::now() + wait::PATIENCE;
        while Stats::get(&stats.frames_malformed) == before {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the bridge never subscribed within {:?}",
                wait::PATIENCE
            );
            self.send(vec![TOPIC.as_bytes().to_vec()]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        if let Some(replay) = &self.replay {
            replay.task.abort();
        }
    }
}

async fn bind(port: &Port) -> PubSocket {
    let mut socket = PubSocket::new();
    socket
        .bind_listener(port.listen_std())
        .await
        .expect("the PUB binds its listener");
    socket
}

/// A replay ROUTER answering from `buffer` as SGLang's does: every batch with seq ≥ start, then
/// the end marker. Malformed requests get no answer, as upstream.
fn replay_router(listener: std::net::TcpListener, buffer: ReplayBuffer) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut router = RouterSocket::new();
        router
            .bind_listener(listener)
            .await
            .expect("the ROUTER binds its listener");
        loop {
            let Ok(request) = router.recv().await else {
                continue;
            };
            let frames = request.into_vec();
            if frames.len() != 3 || !frames[1].is_empty() || frames[2].len() != 8 {
                continue;
            }
            let identity = frames[0].clone();
            let start = u64::from_be_bytes(frames[2][..].try_into().expect("8 bytes"));
            let replies: Vec<(u64, Vec<u8>)> = buffer
                .lock()
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect();
            let end = (u64::MAX, Vec::new());
            for (seq, payload) in replies.into_iter().chain([end]) {
                let topic = if seq == u64::MAX {
                    Bytes::new()
                } else {
                    Bytes::from(TOPIC)
                };
                let reply = vec![
                    identity.clone(),
                    Bytes::new(),
                    topic,
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ];
                router
                    .send(ZmqMessage::try_from(reply).expect("five frames"))
                    .await
                    .expect("the ROUTER sends");
            }
        }
    })
}

/// A map-era batch of `events`, encoded as SGLang 0.5.23 does.
pub fn batch(events: Vec<Value>) -> Vec<u8> {
    rmp_serde::to_vec(&json!([1750000000.0, events, null])).expect("JSON encodes to msgpack")
}

/// A `BlockStored` event for `hashes` on `medium` (`GPU`, `CPU_PINNED`, `DISK`).
pub fn stored(hashes: &[i64], medium: &str) -> Value {
    json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": null, "token_ids": [],
           "block_size": 16, "lora_id": null, "medium": medium})
}

/// A `BlockRemoved` event for `hashes` on `medium`.
pub fn removed(hashes: &[i64], medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
}

/// One live message captured off SGLang's PUB: its seq, payload, and the events it must
/// decode to.
pub struct Captured {
    pub seq: u64,
    pub payload: Vec<u8>,
    pub events: Vec<Value>,
}

/// The live messages of `zmq-frames-0.5.23.jsonl`, each with its expected events from
/// `sglang-events-0.5.23.jsonl` (matched by payload).
pub fn captured() -> Vec<Captured> {
    let expected: BTreeMap<String, Vec<Value>> = rows("sglang-events-0.5.23.jsonl")
        .into_iter()
        .map(|row| {
            (
                row["payload_hex"]
                    .as_str()
                    .expect("payload_hex")
                    .to_string(),
                row["events"].as_array().expect("events").clone(),
            )
        })
        .collect();
    rows("zmq-frames-0.5.23.jsonl")
        .into_iter()
        .filter(|row| row["kind"] == "live")
        .map(|row| {
            let frames: Vec<&str> = row["frames_hex"]
                .as_array()
                .expect("frames_hex")
                .iter()
                .map(|f| f.as_str().expect("hex"))
                .collect();
            assert_eq!(frames.len(), 3);
            let seq = u64::from_be_bytes(unhex(frames[1]).try_into().expect("an 8-byte seq"));
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
