//! The publisher on loopback: live frames as the bridge parses them (`kv_events::frames`),
//! deliberate loss, and the replay ROUTER's conversation with a DEALER.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_events::frames::{ReplayFrame, parse_live, parse_replay, replay_request};
use kv_indexer_sim::events::{BlockStored, Event, Medium};
use kv_indexer_sim::publisher::{
    DropPolicy, Publisher, PublisherConfig, PublisherStats, ReplayServer,
};
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const TOPIC: &str = "kv-events";

fn loopback() -> (std::net::TcpListener, String) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    (listener, endpoint)
}

fn stored(hash: i64) -> Vec<Event> {
    vec![Event::BlockStored(BlockStored::new(
        vec![hash],
        None,
        vec![1, 2],
        2,
        Medium::Gpu,
    ))]
}

/// The hashes a payload stores (decoded by the bridge's decoder).
fn hashes(payload: &[u8]) -> Vec<i64> {
    kv_events::decode_batch(payload)
        .unwrap()
        .events
        .into_iter()
        .flat_map(|event| match event {
            kv_events::Event::BlockStored(stored) => stored.block_hashes,
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

async fn publisher(drop: DropPolicy, buffer: usize) -> (Publisher, String) {
    let (listener, endpoint) = loopback();
    let config = PublisherConfig {
        topic: TOPIC.into(),
        replay_buffer_steps: buffer,
        drop,
        ..PublisherConfig::default()
    };
    (Publisher::bind(listener, config).await.unwrap(), endpoint)
}

async fn subscriber(endpoint: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.subscribe(TOPIC).await.unwrap();
    sub.connect(endpoint).await.unwrap();
    sub
}

/// The frames of the message `recv` gives, which must come within 20 s.
async fn frames_within_20_s<E: std::fmt::Debug>(
    what: &str,
    recv: impl std::future::Future<Output = Result<ZmqMessage, E>>,
) -> Vec<Bytes> {
    tokio::time::timeout(Duration::from_secs(20), recv)
        .await
        .unwrap_or_else(|_| panic!("{what} within 20 s"))
        .unwrap()
        .into_vec()
}

/// `(topic, seq, payload)` of the next live message that is not a late probe.
async fn next(sub: &mut SubSocket) -> (Vec<u8>, u64, Vec<u8>) {
    loop {
        let frames = frames_within_20_s("a live message", sub.recv()).await;
        let live = parse_live(&frames).unwrap();
        if hashes(live.payload) != [-1] {
            return (
                live.topic.unwrap().to_vec(),
                live.seq,
                live.payload.to_vec(),
            );
        }
    }
}

/// Publishes probe batches (hash -1) until the subscriber receives one: from then on its
/// subscription is live. Returns the last seq published.
async fn probe(publisher: &mut Publisher, sub: &mut SubSocket) -> u64 {
    let start = Instant::now();
    loop {
        let last = publisher.publish(&stored(-1)).await.unwrap().unwrap();
        if let Ok(message) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            message.unwrap();
            return last;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never subscribed"
        );
    }
}

async fn dealer(endpoint: &str) -> DealerSocket {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    dealer
}

async fn send(dealer: &mut DealerSocket, frames: Vec<Vec<u8>>) {
    let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    dealer
        .send(ZmqMessage::try_from(frames).unwrap())
        .await
        .unwrap();
}

/// Every reply up to the end marker: `(seq, topic, payload)`.
async fn replies(dealer: &mut DealerSocket) -> Vec<(u64, Vec<u8>, Vec<u8>)> {
    let mut batches = Vec::new();
    loop {
        let frames = frames_within_20_s("a replay reply", dealer.recv()).await;
        match parse_replay(&frames).unwrap() {
            ReplayFrame::End => return batches,
            ReplayFrame::Batch {
                topic,
                seq,
                payload,
            } => batches.push((seq, topic.to_vec(), payload.to_vec())),
        }
    }
}

async fn replay(dealer: &mut DealerSocket, start: u64) -> Vec<u64> {
    send(dealer, replay_request(start)).await;
    replies(dealer)
        .await
        .into_iter()
        .map(|(seq, ..)| seq)
        .collect()
}

async fn replay_server(publisher: &Publisher) -> (String, CancellationToken) {
    let (listener, endpoint) = loopback();
    let server = ReplayServer::bind(listener, publisher.replay_buffer(), publisher.topic())
        .await
        .unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(server.run(stop.clone()));
    (endpoint, stop)
}

#[tokio::test]
async fn sends_topic_seq_and_payload_with_seq_from_zero() {
    let (mut publisher, endpoint) = publisher(DropPolicy::default(), 100).await;
    assert_eq!(
        publisher.publish(&[]).await.unwrap(),
        None,
        "no empty batch"
    );
    let (replay_endpoint, stop) = replay_server(&publisher).await;
    let mut sub = subscriber(&endpoint).await;
    let first = probe(&mut publisher, &mut sub).await;
    for hash in 1..=3 {
        let seq = publisher.publish(&stored(hash)).await.unwrap().unwrap();
        assert_eq!(seq, first + hash as u64);
        let (topic, live_seq, payload) = next(&mut sub).await;
        assert_eq!(topic, TOPIC.as_bytes());
        assert_eq!(live_seq, seq);
        assert_eq!(hashes(&payload), [hash]);
    }
    // The empty batch took no seq: the first message was seq 0.
    let mut dealer = dealer(&replay_endpoint).await;
    let all = replay(&mut dealer, 0).await;
    assert_eq!(all, (0..=first + 3).collect::<Vec<_>>());
    let stats = publisher.stats();
    assert_eq!(PublisherStats::get(&stats.batches), first + 4);
    stop.cancel();
}

#[test]
fn periodic_losses_stop_at_drop_until() {
    let policy = DropPolicy {
        every: 7,
        seqs: BTreeSet::new(),
        every_until: Some(14),
    };
    let lost: Vec<u64> = (0..30).filter(|&seq| policy.drops(seq)).collect();
    assert_eq!(lost, [6, 13]);
}

#[tokio::test]
async fn lost_messages_are_missing_live_but_replayable() {
    // Every second message is lost: seqs 1, 3, 5, ...
    let policy = DropPolicy {
        every: 2,
        seqs: BTreeSet::new(),
        every_until: None,
    };
    let (mut publisher, endpoint) = publisher(policy, 100).await;
    let (replay_endpoint, stop) = replay_server(&publisher).await;
    let mut sub = subscriber(&endpoint).await;
    let first = probe(&mut publisher, &mut sub).await;
    for hash in 1..=4 {
        publisher.publish(&stored(hash)).await.unwrap();
    }
    let mut live = Vec::new();
    for _ in 0..2 {
        let (_, seq, payload) = next(&mut sub).await;
        live.push((seq, hashes(&payload)));
    }
    // Of seqs first+1..=first+4, the even two arrive.
    let want: Vec<(u64, Vec<i64>)> = (1..=4)
        .map(|h| (first + h as u64, vec![h]))
        .filter(|(seq, _)| seq % 2 == 0)
        .collect();
    assert_eq!(live, want);
    assert!(PublisherStats::get(&publisher.stats().dropped) >= 2);

    let mut dealer = dealer(&replay_endpoint).await;
    send(&mut dealer, replay_request(first + 1)).await;
    let replayed: Vec<(u64, Vec<i64>)> = replies(&mut dealer)
        .await
        .into_iter()
        .map(|(seq, topic, payload)| {
            assert_eq!(topic, TOPIC.as_bytes());
            (seq, hashes(&payload))
        })
        .collect();
    let want: Vec<(u64, Vec<i64>)> = (1..=4).map(|h| (first + h as u64, vec![h])).collect();
    assert_eq!(replayed, want);
    stop.cancel();
}

#[tokio::test]
async fn replay_starts_later_when_the_buffer_evicted_the_start() {
    let (mut publisher, _endpoint) = publisher(DropPolicy::default(), 3).await;
    for hash in 0..5 {
        publisher.publish(&stored(hash)).await.unwrap();
    }
    let (replay_endpoint, stop) = replay_server(&publisher).await;
    let mut dealer = dealer(&replay_endpoint).await;
    assert_eq!(replay(&mut dealer, 0).await, [2, 3, 4]);
    assert_eq!(replay(&mut dealer, 3).await, [3, 4]);
    assert_eq!(replay(&mut dealer, 9).await, Vec::<u64>::new());
    stop.cancel();
}

#[tokio::test]
async fn malformed_replay_requests_get_no_answer() {
    let (mut publisher, _endpoint) = publisher(DropPolicy::default(), 10).await;
    publisher.publish(&stored(7)).await.unwrap();
    let (replay_endpoint, stop) = replay_server(&publisher).await;
    let mut dealer = dealer(&replay_endpoint).await;
    // A 3-byte seq, a non-empty delimiter, a missing delimiter, an extra frame.
    send(&mut dealer, vec![vec![], vec![0, 0, 0]]).await;
    send(
        &mut dealer,
        vec![b"x".to_vec(), 0u64.to_be_bytes().to_vec()],
    )
    .await;
    send(&mut dealer, vec![0u64.to_be_bytes().to_vec()]).await;
    send(
        &mut dealer,
        vec![vec![], 0u64.to_be_bytes().to_vec(), vec![]],
    )
    .await;
    // The first answer the dealer gets is the one to the valid request that follows.
    send(&mut dealer, replay_request(0)).await;
    let answer = replies(&mut dealer).await;
    assert_eq!(answer.len(), 1);
    assert_eq!(hashes(&answer[0].2), [7]);
    stop.cancel();
}
