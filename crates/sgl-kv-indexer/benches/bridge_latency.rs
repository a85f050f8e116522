//! Event-to-visible latency and end-to-end throughput of the bridge on loopback: a ZMQ PUB →
//! `bridge::run` → the server, all in this process, measured from publish until
//! `MatchExternalKv` shows the block.
//!
//! `cargo bench -p sgl-kv-indexer --bench bridge_latency [-- SAMPLES BURST_BATCHES HASHES_PER_BATCH]`

use std::time::{Duration, Instant};

use kv_bridge::stats::Stats;
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use kv_testkit::worker::{batch, stored};
use kv_testkit::{BridgeFlags, FakeWorker, TestIndexer};

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

    let server = TestIndexer::start().await;
    let mut publisher = FakeWorker::start().await;
    let bridge = BridgeFlags::new("w", "http://w", &server.url(), &publisher.endpoint()).start();
    publisher.wait_subscribed(&bridge.stats).await;
    let mut client = server.client();
    let stats = &bridge.stats;

    let mut seq = 0u64;
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        let hash = i as i64 + 1;
        let payload = batch(vec![stored(&[hash], "GPU")]);
        let start = Instant::now();
        publisher.publish(seq, &payload).await;
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
        publisher
            .publish(seq, &batch(vec![stored(&hashes, "GPU")]))
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
    bridge.stop().await;
}
