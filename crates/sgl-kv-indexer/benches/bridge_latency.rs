//! Event-to-visible latency and end-to-end throughput of the bridge on loopback: a ZMQ PUB →
//! `bridge::run` → the server, all in this process, measured from publish until
//! `MatchExternalKv` shows the block.
//!
//! `cargo bench -p sgl-kv-indexer --bench bridge_latency [-- SAMPLES BURST_BATCHES HASHES_PER_BATCH]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_bridge as bridge;
use kv_bridge::config::{Args, BridgeConfig};
use kv_bridge::stats::Stats;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_server::{Config, server};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

fn batch(hashes: &[i64]) -> Vec<u8> {
    let event = json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": null,
                       "token_ids": [], "block_size": 16, "lora_id": null, "medium": "GPU"});
    rmp_serde::to_vec(&json!([1750000000.0, [event], null])).unwrap()
}

async fn publish(socket: &mut PubSocket, frames: Vec<Vec<u8>>) {
    let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    socket
        .send(ZmqMessage::try_from(frames).unwrap())
        .await
        .unwrap();
}

async fn visible(client: &mut KvIndexerClient<tonic::transport::Channel>, hash: i64) -> bool {
    let answer = client
        .match_external_kv(pb::MatchExternalKvRequest {
            hashes: vec![hash],
            count_as_hit: false,
        })
        .await
        .unwrap()
        .into_inner();
    !answer.matches.is_empty()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let samples = args.first().copied().unwrap_or(2_000);
    let burst = args.get(1).copied().unwrap_or(20_000);
    let per_batch = args.get(2).copied().unwrap_or(64);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(server::run(
        listener,
        server::shared(&Config::default()),
        stop.clone().cancelled_owned(),
    ));

    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let argv = [
        "kv-indexer-bridge",
        "--worker-id",
        "w",
        "--worker-address",
        "http://w",
        "--endpoint",
        &format!("http://{addr}"),
        "--event-endpoint",
        &endpoint,
        "--event-topic",
        "kv-events",
    ];
    let config =
        BridgeConfig::from_args(<Args as clap::Parser>::try_parse_from(argv).unwrap()).unwrap();
    let stats = Arc::new(Stats::default());
    tokio::spawn(bridge::run(config, stats.clone(), stop.clone()));
    while Stats::get(&stats.frames_malformed) == 0 {
        publish(&mut publisher, vec![b"kv-events".to_vec()]).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = KvIndexerClient::new(channel);

    let mut seq = 0u64;
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        let hash = i as i64 + 1;
        let payload = batch(&[hash]);
        let start = Instant::now();
        publish(
            &mut publisher,
            vec![b"kv-events".to_vec(), seq.to_be_bytes().to_vec(), payload],
        )
        .await;
        seq += 1;
        while !visible(&mut client, hash).await {}
        latencies.push(start.elapsed().as_micros() as u64);
    }
    latencies.sort_unstable();
    println!(
        "event-to-visible latency over {samples} single-block batches (includes one MatchExternalKv poll round trip): p50 {} µs, p99 {} µs, max {} µs",
        percentile(&latencies, 50.0),
        percentile(&latencies, 99.0),
        latencies.last().unwrap()
    );

    let base = 1i64 << 40;
    let start = Instant::now();
    for b in 0..burst {
        let hashes: Vec<i64> = (0..per_batch as i64)
            .map(|j| base + (b * per_batch) as i64 + j)
            .collect();
        publish(
            &mut publisher,
            vec![
                b"kv-events".to_vec(),
                seq.to_be_bytes().to_vec(),
                batch(&hashes),
            ],
        )
        .await;
        seq += 1;
    }
    let last = base + (burst * per_batch) as i64 - 1;
    while !visible(&mut client, last).await {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "burst: {burst} batches × {per_batch} hashes published and visible in {elapsed:.2} s: {:.0} batches/s, {:.2} M hashes/s end to end; gaps {} (PUB drops above its buffer)",
        burst as f64 / elapsed,
        (burst * per_batch) as f64 / elapsed / 1e6,
        Stats::get(&stats.gaps)
    );
    stop.cancel();
}
