//! How fast one simulated worker can publish KV events: `cargo bench -p kv-indexer-sim --bench
//! publish`. Three figures, each over a fixed wall-clock window on loopback, with one ZMQ SUB
//! reading everything (as a bridge would):
//!
//! 1. encoding: msgpack batches per second, no socket;
//! 2. publisher: batches through `Publisher::publish` on the PUB socket;
//! 3. worker: requests driven straight into the scheduler (no HTTP), the cache storing,
//!    evicting to a host tier and dropping pages, one batch per scheduling step.
//!
//! Prints batches/s, events/s, hashes/s, bytes/s and how many messages the subscriber got.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_indexer_sim::events::{BlockRemoved, BlockStored, Encoder, Encoding, Event, Medium};
use kv_indexer_sim::publisher::{Publisher, PublisherConfig, PublisherStats};
use kv_indexer_sim::{Config, Listeners, Worker};
use kv_prompt::hashing::{HashConfig, block_hashes};
use zeromq::{Socket, SocketRecv, SubSocket};

const WINDOW: Duration = Duration::from_secs(3);
const PAGE: usize = 16;

/// A batch like a busy step's: stores of 4-page chains, their evictions to the host, removals.
fn sample_batch(seed: i64) -> Vec<Event> {
    let mut events = Vec::new();
    for i in 0..4 {
        let hashes: Vec<i64> = (0..4)
            .map(|j| (seed * 64 + i * 4 + j).wrapping_mul(0x9e37_79b9_7f4a_7c15_u64 as i64))
            .collect();
        let tokens: Vec<u64> = (0..(4 * PAGE) as u64).map(|t| 1000 + t * 37).collect();
        events.push(Event::BlockStored(BlockStored::new(
            hashes.clone(),
            Some(seed),
            tokens.clone(),
            PAGE as u32,
            Medium::Gpu,
        )));
        events.push(Event::BlockRemoved(BlockRemoved {
            block_hashes: hashes.clone(),
            medium: Medium::Gpu,
        }));
        events.push(Event::BlockStored(BlockStored::new(
            hashes,
            Some(seed),
            tokens,
            PAGE as u32,
            Medium::CpuPinned,
        )));
    }
    events
}

fn hashes_in(events: &[Event]) -> usize {
    events
        .iter()
        .map(|e| match e {
            Event::BlockStored(s) => s.block_hashes.len(),
            Event::BlockRemoved(r) => r.block_hashes.len(),
            Event::AllBlocksCleared => 0,
        })
        .sum()
}

fn report(name: &str, elapsed: Duration, batches: u64, events: u64, hashes: u64, bytes: u64) {
    let secs = elapsed.as_secs_f64();
    println!(
        "{name:<12} {:>9.0} batches/s {:>11.0} events/s {:>11.0} hashes/s {:>8.1} MB/s",
        batches as f64 / secs,
        events as f64 / secs,
        hashes as f64 / secs,
        bytes as f64 / secs / 1e6,
    );
}

fn encoding() {
    let batches: Vec<Vec<Event>> = (0..64).map(sample_batch).collect();
    let per_batch = batches[0].len() as u64;
    let hashes = hashes_in(&batches[0]) as u64;
    for encoding in [Encoding::Map, Encoding::Array] {
        let encoder = Encoder::new(encoding);
        let mut out = Vec::new();
        let (mut count, mut bytes) = (0u64, 0u64);
        let start = Instant::now();
        while start.elapsed() < WINDOW {
            for batch in &batches {
                out.clear();
                encoder.batch_into(1.0, batch, Some(0), &mut out);
                bytes += out.len() as u64;
                count += 1;
            }
        }
        let name = format!("encode-{encoding:?}").to_lowercase();
        report(
            &name,
            start.elapsed(),
            count,
            count * per_batch,
            count * hashes,
            bytes,
        );
    }
}

/// A SUB that counts what it receives, until dropped.
async fn counting_subscriber(endpoint: String, received: Arc<AtomicU64>) {
    let mut sub = SubSocket::new();
    sub.subscribe("kv-events").await.unwrap();
    sub.connect(&endpoint).await.unwrap();
    while sub.recv().await.is_ok() {
        received.fetch_add(1, Ordering::Relaxed);
    }
}

async fn publisher() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let mut publisher = Publisher::bind(listener, PublisherConfig::default())
        .await
        .unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let sub = tokio::spawn(counting_subscriber(endpoint, received.clone()));
    // Until the subscription is live.
    while received.load(Ordering::Relaxed) == 0 {
        publisher.publish(&[Event::AllBlocksCleared]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let batches: Vec<Vec<Event>> = (0..64).map(sample_batch).collect();
    let hashes = hashes_in(&batches[0]) as u64;
    let stats = publisher.stats();
    let (batches_before, events_before, bytes_before) = (
        PublisherStats::get(&stats.batches),
        PublisherStats::get(&stats.events),
        PublisherStats::get(&stats.bytes),
    );
    let received_before = received.load(Ordering::Relaxed);
    let start = Instant::now();
    while start.elapsed() < WINDOW {
        for batch in &batches {
            publisher.publish(batch).await.unwrap();
        }
        // Let the socket's writer tasks run, as a scheduler step would between batches.
        tokio::task::yield_now().await;
    }
    let elapsed = start.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let count = PublisherStats::get(&stats.batches) - batches_before;
    report(
        "publisher",
        elapsed,
        count,
        PublisherStats::get(&stats.events) - events_before,
        count * hashes,
        PublisherStats::get(&stats.bytes) - bytes_before,
    );
    let got = received.load(Ordering::Relaxed) - received_before;
    println!(
        "             subscriber received {got} of {count} messages ({:.1}%)",
        100.0 * got as f64 / count as f64
    );
    sub.abort();
}

async fn worker() {
    let mut config = Config::default();
    config.cache.page_size = PAGE;
    config.cache.capacity_tokens = 4096 * PAGE;
    config.cache.host_capacity_tokens = 4096 * PAGE;
    let listeners = Listeners::bind(&config).await.unwrap();
    let worker = Worker::start(&config, listeners).await.unwrap();
    let scheduler = worker.scheduler();
    let stats = worker.publisher_stats();
    let received = Arc::new(AtomicU64::new(0));
    let sub = tokio::spawn(counting_subscriber(
        worker.endpoints().kv_events_url(),
        received.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Prompts of 4 to 64 pages: a shared system prompt of 4 pages, then their own pages.
    let hash = HashConfig {
        block_size: PAGE,
        bigram: false,
    };
    let prompts: Arc<Vec<(Vec<i64>, Vec<u64>)>> = Arc::new(
        (0..20_000u64)
            .map(|i| {
                let own = PAGE as u64 * (i % 16 + 1);
                let tokens: Vec<u64> = (0..4 * PAGE as u64)
                    .chain((0..own).map(|t| 100_000 + i * 1_000 + t))
                    .collect();
                (block_hashes(&tokens, hash, None), tokens)
            })
            .collect(),
    );
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut clients = Vec::new();
    // 64 requests in flight, each admitted and released back to back.
    for _ in 0..64 {
        let (scheduler, prompts, next) = (scheduler.clone(), prompts.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            while start.elapsed() < WINDOW {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize % prompts.len();
                let (hashes, tokens) = prompts[i].clone();
                let admitted = scheduler.admit(hashes, tokens).await.unwrap();
                scheduler.release(admitted.lease).await.unwrap();
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    let elapsed = start.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batches = PublisherStats::get(&stats.batches);
    let snapshot = scheduler.snapshot().await.unwrap().stats;
    let hashes = snapshot.stored
        + 2 * snapshot.device_evictions
        + snapshot.host_evictions
        + 2 * snapshot.host_hits;
    report(
        "worker",
        elapsed,
        batches,
        PublisherStats::get(&stats.events),
        hashes,
        PublisherStats::get(&stats.bytes),
    );
    println!(
        "             {} requests; pages stored {}, device evictions {}, host evictions {}, host hits {}",
        next.load(Ordering::Relaxed),
        snapshot.stored,
        snapshot.device_evictions,
        snapshot.host_evictions,
        snapshot.host_hits
    );
    let got = received.load(Ordering::Relaxed);
    println!(
        "             subscriber received {got} of {batches} messages ({:.1}%)",
        100.0 * got as f64 / batches as f64
    );
    sub.abort();
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "kv-indexer-sim publish benchmark ({}-token pages, {} s windows, {} cores)",
        PAGE,
        WINDOW.as_secs(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    encoding();
    runtime.block_on(publisher());
    runtime.block_on(worker());
}
