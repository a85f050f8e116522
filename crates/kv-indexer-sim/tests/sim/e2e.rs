//! The simulated worker end to end with the real bridge and the real Indexer, in-process on
//! loopback: HTTP `/generate` (or vLLM's `/v1/completions` with `--engine vllm`) → cache → KV
//! events on ZMQ → `bridge::run` → the server. After
//! each step, and once the stream is quiet, the index's view of the worker (`MatchExternalKv`
//! over every hash the prompts can make) is exactly the simulated cache's own view, per tier.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_bridge::stats::Stats;
use kv_indexer_sim::events::{Encoding, Medium};
use kv_indexer_sim::publisher::PublisherStats;
use kv_indexer_sim::scheduler::SchedulerHandle;
use kv_indexer_sim::{Config, Endpoints, Listeners, Worker};
use kv_prompt::BlockHasher;
use kv_prompt::vllm_hashing::{VllmHashAlgo, VllmHasher};
use kv_testkit::indexer::Held as View;
use kv_testkit::wait::{self, PATIENCE};
use kv_testkit::{BridgeFlags, RunningBridge, TestIndexer};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WORKER: &str = "worker-0";
const PAGE: usize = 4;

/// A bridge following `worker` (live and replay) for [`WORKER`] into `server`.
fn bridge(server: &TestIndexer, worker: &RunningWorker) -> RunningBridge {
    let endpoints = &worker.endpoints;
    BridgeFlags::new(
        WORKER,
        &endpoints.http_url(),
        &server.url(),
        &endpoints.kv_events_url(),
    )
    .replay(endpoints.replay_url())
    .flag("--engine", worker.hasher.engine())
    .start()
}

/// A worker serving HTTP on loopback until stopped.
struct RunningWorker {
    endpoints: Endpoints,
    hasher: BlockHasher,
    scheduler: SchedulerHandle,
    publisher: Arc<PublisherStats>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), kv_indexer_sim::worker::WorkerError>>,
}

impl RunningWorker {
    async fn start(config: Config) -> RunningWorker {
        let listeners = Listeners::bind(&config).await.unwrap();
        let worker = Worker::start(&config, listeners).await.unwrap();
        let stop = CancellationToken::new();
        RunningWorker {
            endpoints: worker.endpoints(),
            hasher: config.hash(),
            scheduler: worker.scheduler(),
            publisher: worker.publisher_stats(),
            task: tokio::spawn(worker.serve(stop.clone().cancelled_owned())),
            stop,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }

    /// One HTTP/1.1 request on a fresh connection: `(status, body)`.
    async fn call(&self, path: &str, body: &Value) -> (u16, Vec<u8>) {
        let mut stream = TcpStream::connect(self.endpoints.http).await.unwrap();
        let body = body.to_string();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.endpoints.http,
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let split = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("an HTTP response");
        let head = String::from_utf8_lossy(&response[..split]);
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, response[split + 4..].to_vec())
    }

    /// `/generate` of `prompt` with one token out (vLLM: `/v1/completions`); returns its
    /// `cached_tokens`.
    async fn generate(&self, prompt: &[u64]) -> u64 {
        if let BlockHasher::Vllm(_) = self.hasher {
            let body = json!({"prompt": prompt, "max_tokens": 1});
            let (status, answer) = self.call("/v1/completions", &body).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
            let answer: Value = serde_json::from_slice(&answer).unwrap();
            return answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
        }
        let body = json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}});
        let (status, answer) = self.call("/generate", &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        answer["meta_info"]["cached_tokens"].as_u64().unwrap()
    }

    /// Drops the whole cache: SGLang's `/flush_cache`, vLLM's `/reset_prefix_cache`.
    async fn flush(&self) {
        let path = match self.hasher {
            BlockHasher::Vllm(_) => "/reset_prefix_cache",
            BlockHasher::Sglang(_) => "/flush_cache",
        };
        let (status, _) = self.call(path, &json!({})).await;
        assert_eq!(status, 200);
    }

    /// Every hash the prompts can make: their whole pages.
    fn universe(&self, prompts: &[Vec<u64>]) -> BTreeSet<i64> {
        prompts
            .iter()
            .flat_map(|p| self.hasher.block_hashes(&p[..p.len() / PAGE * PAGE], None))
            .collect()
    }

    /// The cache's own view, with the index's tier numbers.
    async fn view(&self) -> View {
        let snapshot = self.scheduler.snapshot().await.unwrap();
        snapshot
            .held
            .into_iter()
            .map(|(medium, hashes)| {
                let tier = match medium {
                    Medium::Gpu => 1,
                    Medium::CpuPinned => 2,
                };
                (tier, hashes)
            })
            .collect()
    }
}

/// Waits until the index shows exactly the cache's view (polling, with a deadline).
async fn converge(
    step: &str,
    server: &TestIndexer,
    worker: &RunningWorker,
    universe: &BTreeSet<i64>,
) -> View {
    let expected = worker.view().await;
    for hashes in expected.values() {
        assert!(
            hashes.is_subset(universe),
            "{step}: the cache holds unknown hashes"
        );
    }
    let what = format!("{step}: the index to match the cache {expected:?}");
    wait::until_ok(&what, || async {
        let held = server.held(WORKER, universe).await;
        if held == expected { Ok(()) } else { Err(held) }
    })
    .await;
    expected
}

/// Makes sure the bridge's subscription is live before a test counts on the live stream:
/// warm-up prompts (each a new batch; a live one after missed ones makes the bridge replay
/// the gap) until the index shows them, then a flush to start the test from nothing.
async fn sync(server: &TestIndexer, worker: &RunningWorker) {
    let start = Instant::now();
    let mut warmups = Vec::new();
    'warm: loop {
        let prompt: Vec<u64> = (0..PAGE as u64)
            .map(|t| 900_000 + 100 * warmups.len() as u64 + t)
            .collect();
        worker.generate(&prompt).await;
        warmups.push(prompt);
        let universe = worker.universe(&warmups);
        let attempt = Instant::now();
        while attempt.elapsed() < Duration::from_millis(500) {
            if server.held(WORKER, &universe).await == worker.view().await {
                break 'warm;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the bridge never followed the worker"
        );
    }
    worker.flush().await;
    let view = converge("warm-up flush", server, worker, &worker.universe(&warmups)).await;
    assert!(view.is_empty());
}

fn prompt(prefix: &[u64], rest: std::ops::Range<u64>) -> Vec<u64> {
    prefix.iter().copied().chain(rest).collect()
}

fn config() -> Config {
    let mut config = Config::default();
    config.cache.page_size = PAGE;
    config.cache.capacity_tokens = 16 * PAGE;
    config.cache.host_capacity_tokens = 8 * PAGE;
    config.replay_addr = Some("127.0.0.1:0".parse().unwrap());
    config
}

/// `config()` as a vLLM worker: vLLM's hashes, events and API.
fn vllm(config: Config) -> Config {
    config.vllm(VllmHasher::new(VllmHashAlgo::Sha256, PAGE, None).unwrap())
}

#[tokio::test]
async fn the_index_follows_the_simulated_cache_through_evictions_host_moves_and_a_flush() {
    follows_the_cache(config()).await;
}

#[tokio::test]
async fn the_index_follows_a_simulated_vllm_worker_as_closely() {
    follows_the_cache(vllm(config())).await;
}

async fn follows_the_cache(config: Config) {
    let mut server = TestIndexer::start().await;
    let worker = RunningWorker::start(config).await;
    let bridge = bridge(&server, &worker);
    server.wait_for_workers(1).await;
    sync(&server, &worker).await;
    let gaps = Stats::get(&bridge.stats.gaps);

    let shared: Vec<u64> = (0..12).collect();
    let branches = [
        prompt(&shared, 100..108),
        prompt(&shared, 200..208),
        prompt(&shared, 300..304),
    ];
    let others: Vec<Vec<u64>> = (1..=4)
        .map(|k| (k * 1000..k * 1000 + 20).collect())
        .collect();
    let late = vec![(5000..5010).collect::<Vec<u64>>()];
    let all: Vec<Vec<u64>> = [&branches[..], &others, &late].concat();
    let universe = worker.universe(&all);

    // 1. Prompts sharing a 3-page prefix: the later ones hit it.
    assert_eq!(worker.generate(&branches[0]).await, 0);
    assert_eq!(worker.generate(&branches[1]).await, 12);
    assert_eq!(worker.generate(&branches[2]).await, 12);
    let view = converge("shared prefixes", &server, &worker, &universe).await;
    assert_eq!(view.len(), 1, "all on the device: {view:?}");
    assert_eq!(view[&1].len(), 8);

    // 2. Twenty new pages overflow the 16-page device: old pages move to the 8-page host,
    // which evicts in turn.
    for other in &others {
        assert_eq!(worker.generate(other).await, 0);
    }
    let view = converge("overflow", &server, &worker, &universe).await;
    let stats = worker.scheduler.snapshot().await.unwrap().stats;
    assert!(view.contains_key(&2), "nothing on the host: {view:?}");
    assert!(
        stats.device_evictions > 0 && stats.host_evictions > 0,
        "{stats:?}"
    );

    // 3. A prompt whose pages are on the host: a hit, reloaded to the device.
    let on_host = all
        .iter()
        .find(|p| {
            let first = worker.hasher.block_hashes(&p[..PAGE], None)[0];
            view[&2].contains(&first)
        })
        .expect("a prompt starting on the host")
        .clone();
    assert!(worker.generate(&on_host).await > 0, "a host hit is a hit");
    let after = worker.scheduler.snapshot().await.unwrap().stats;
    assert!(after.host_hits > stats.host_hits, "{after:?}");
    converge("host hit", &server, &worker, &universe).await;

    // 4. Flush: the index forgets everything.
    worker.flush().await;
    let view = converge("flush", &server, &worker, &universe).await;
    assert!(view.is_empty());

    // 5. And follows again afterwards.
    assert_eq!(worker.generate(&late[0]).await, 0);
    converge("after the flush", &server, &worker, &universe).await;

    assert_eq!(Stats::get(&bridge.stats.gaps), gaps, "no message was lost");
    assert!(PublisherStats::get(&worker.publisher.batches) >= 8);
    bridge.stop().await;
    worker.stop().await;
    server.shut_down().await;
}

#[tokio::test]
async fn lost_messages_are_healed_from_the_replay_buffer() {
    // Array-era events.
    let mut config = config();
    config.publisher.encoder.encoding = Encoding::Array;
    heals_lost_messages(config).await;
}

#[tokio::test]
async fn lost_vllm_messages_are_healed_from_the_replay_buffer() {
    heals_lost_messages(vllm(config())).await;
}

/// Messages 1, 2 and 4 lost on the live path.
async fn heals_lost_messages(mut config: Config) {
    let mut server = TestIndexer::start().await;
    config.publisher.drop.seqs = [1, 2, 4].into();
    let worker = RunningWorker::start(config).await;
    let bridge = bridge(&server, &worker);
    server.wait_for_workers(1).await;

    // Eight prompts, each a new batch (seqs 0..=7), evicting to the host as they go. (No
    // warm-up here: the bridge heals from the replay buffer whatever the live stream lost.)
    let prompts: Vec<Vec<u64>> = (1..=8).map(|k| (k * 100..k * 100 + 12).collect()).collect();
    let universe = worker.universe(&prompts);
    for prompt in &prompts {
        assert_eq!(worker.generate(prompt).await, 0);
    }
    converge("after lost messages", &server, &worker, &universe).await;
    assert_eq!(PublisherStats::get(&worker.publisher.dropped), 3);
    assert!(Stats::get(&bridge.stats.gaps) >= 1, "the bridge saw a gap");
    bridge.stop().await;
    worker.stop().await;
    server.shut_down().await;
}
