//! The KV event publisher, as SGLang's `ZmqEventPublisher`: one message per non-empty batch on
//! a ZMQ PUB, frames `[topic, seq as 8 bytes big-endian, payload]` with `seq` from 0 per
//! process; every batch also goes to a bounded buffer that the optional replay ROUTER
//! ([`replay`]) answers from.
//!
//! A [`DropPolicy`] loses chosen messages on the live path only (they stay in the replay
//! buffer), as a PUB above its high-water mark does, for fault tests.

pub mod replay;

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::events::{Encoder, Event};

pub use replay::ReplayServer;

#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error("cannot bind the ZMQ socket")]
    Bind(#[source] zeromq::ZmqError),
    #[error("cannot send on the ZMQ socket")]
    Send(#[source] zeromq::ZmqError),
}

/// Which live messages to lose.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DropPolicy {
    /// These sequence numbers.
    pub seqs: BTreeSet<u64>,
    /// Every n-th message (seqs n−1, 2n−1, …); 0 drops none.
    pub every: u64,
    /// `every` only below this seq (none: throughout).
    pub every_until: Option<u64>,
}

impl DropPolicy {
    /// Whether the live message `seq` is lost.
    pub fn drops(&self, seq: u64) -> bool {
        let periodic = self.every > 0
            && (seq + 1).is_multiple_of(self.every)
            && self.every_until.is_none_or(|until| seq < until);
        self.seqs.contains(&seq) || periodic
    }
}

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// The topic frame ("" sends an empty frame).
    pub topic: String,
    pub encoder: Encoder,
    /// The batch's third element (SGLang writes its attention-DP rank; 0 with one rank).
    pub attn_dp_rank: Option<i64>,
    /// Batches kept for replay (SGLang's `buffer_steps`, default 10,000); 0 keeps none.
    pub replay_buffer_steps: usize,
    pub drop: DropPolicy,
}

impl Default for PublisherConfig {
    fn default() -> PublisherConfig {
        PublisherConfig {
            topic: "kv-events".into(),
            encoder: Encoder::default(),
            attn_dp_rank: Some(0),
            replay_buffer_steps: 10_000,
            drop: DropPolicy::default(),
        }
    }
}

/// The last batches published, `(seq, payload)` in order, shared with the replay server.
#[derive(Debug, Clone)]
pub struct ReplayBuffer {
    batches: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    capacity: usize,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> ReplayBuffer {
        ReplayBuffer {
            batches: Arc::new(Mutex::new(VecDeque::with_capacity(capacity.min(1 << 16)))),
            capacity,
        }
    }

    fn push(&self, seq: u64, payload: Bytes) {
        if self.capacity == 0 {
            return;
        }
        let mut batches = self.batches.lock();
        if batches.len() == self.capacity {
            batches.pop_front();
        }
        batches.push_back((seq, payload));
    }

    /// Every buffered batch with `seq >= start`, in order.
    pub fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        let batches = self.batches.lock();
        let first = batches.partition_point(|(seq, _)| *seq < start);
        batches.range(first..).cloned().collect()
    }
}

/// Counters, readable while the publisher runs.
#[derive(Debug, Default)]
pub struct PublisherStats {
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub bytes: AtomicU64,
    /// Live messages lost on purpose ([`DropPolicy`]).
    pub dropped: AtomicU64,
    pub send_errors: AtomicU64,
}

impl PublisherStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A ZMQ socket of kind `S` (PUB, ROUTER) on an already-bound listener.
async fn bound<S: Socket>(listener: std::net::TcpListener) -> Result<S, PublisherError> {
    let mut socket = S::new();
    socket
        .bind_listener(listener)
        .await
        .map_err(PublisherError::Bind)?;
    Ok(socket)
}

pub struct Publisher {
    socket: PubSocket,
    topic: Bytes,
    encoder: Encoder,
    attn_dp_rank: Option<i64>,
    drop: DropPolicy,
    next_seq: u64,
    buffer: ReplayBuffer,
    stats: Arc<PublisherStats>,
    /// Reused for every payload.
    scratch: Vec<u8>,
}

impl Publisher {
    /// A PUB on an already-bound listener (SGLang binds `tcp://*:port`; subscribers connect).
    pub async fn bind(
        listener: std::net::TcpListener,
        config: PublisherConfig,
    ) -> Result<Publisher, PublisherError> {
        Ok(Publisher {
            socket: bound(listener).await?,
            topic: Bytes::from(config.topic),
            encoder: config.encoder,
            attn_dp_rank: config.attn_dp_rank,
            drop: config.drop,
            next_seq: 0,
            buffer: ReplayBuffer::new(config.replay_buffer_steps),
            stats: Arc::default(),
            scratch: Vec::new(),
        })
    }

    /// The buffer a [`ReplayServer`] answers from.
    pub fn replay_buffer(&self) -> ReplayBuffer {
        self.buffer.clone()
    }

    pub fn stats(&self) -> Arc<PublisherStats> {
        self.stats.clone()
    }

    pub fn topic(&self) -> &[u8] {
        &self.topic
    }

    /// Publishes one batch stamped now; an empty batch is not sent and takes no seq. Returns
    /// the seq used. A send error loses the message (it is still buffered for replay) and is
    /// returned; the next batch takes the next seq all the same.
    pub async fn publish(&mut self, events: &[Event]) -> Result<Option<u64>, PublisherError> {
        if events.is_empty() {
            return Ok(None);
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.scratch.clear();
        self.encoder
            .batch_into(ts, events, self.attn_dp_rank, &mut self.scratch);
        let payload = Bytes::copy_from_slice(&self.scratch);
        self.stats
            .events
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        self.publish_payload(payload).await.map(Some)
    }

    /// Publishes an already-encoded payload under the next seq.
    pub async fn publish_payload(&mut self, payload: Bytes) -> Result<u64, PublisherError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer.push(seq, payload.clone());
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        if self.drop.drops(seq) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(seq);
        }
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames are a valid message");
        if let Err(error) = self.socket.send(message).await {
            self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
            return Err(PublisherError::Send(error));
        }
        Ok(seq)
    }
}
