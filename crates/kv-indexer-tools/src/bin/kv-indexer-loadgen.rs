//! `kv-indexer-loadgen`: drives a running server over real gRPC with a trace-shaped workload and
//! prints throughput, latency percentiles and rejections.
//!
//! Workload: `--workers` workers; `--prompts` prompts of `--prompt-blocks` blocks, in 8 groups
//! sharing a system prefix of a quarter of the prompt. Prompt `p` is held whole by worker
//! `p % workers` and up to a random cut by two more workers. Routers then ask for the longest
//! prefix of random prompts at `--qps` (0 = as fast as they can) with `--concurrency` queries
//! in flight, while `--ingest-ops` block-ops/s of REPORT/REVOKE churn (by other workers) go on.
//! `--background-scan-blocks` keeps one huge prefix scan running to show what it does to the
//! small queries.
//!
//! Overload: with `--concurrency` far above the server's admission bound and `--qps` above its
//! capacity, the report splits latency by outcome (answered, RESOURCE_EXHAUSTED, …), so it shows
//! how fast surplus queries are turned away and what p99 the admitted ones keep; the churn's
//! applies are counted by status code (an apply must never be refused). The query connections
//! are made at their first call, so a server that closes connections over its bound shows as
//! failed calls (UNAVAILABLE), not as a generator that cannot start.
//!
//! Comparing servers: `--json-out FILE` appends one JSON line per run (`--label`, the workload,
//! answers/s, answered latency percentiles, failed calls by code, applies/s and their latency),
//! so runs against two servers one after the other can be set side by side with
//! `scripts/compare_loadgen.py FILE`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kv_indexer_client::security::{Authorize, Grpc};
use kv_indexer_client::{
    ClientConfig, ClientSecurity, Credentials, Endpoint, IndexerClient, PrefixOutcome,
};
use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::prefix_wire::{CountedPrefixResponse, PREFIX_PATH};
use kv_indexer_proto::v1 as pb;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(name = "kv-indexer-loadgen", about)]
struct Args {
    /// The server to drive.
    #[arg(
        long,
        env = "KV_INDEXER_ENDPOINT",
        default_value = "http://[::1]:50051"
    )]
    endpoint: String,
    /// Workers reporting prompts.
    #[arg(long, default_value_t = 256)]
    workers: usize,
    /// Distinct prompts held by the workers.
    #[arg(long, default_value_t = 256)]
    prompts: usize,
    /// Blocks per prompt (the query length).
    #[arg(long, default_value_t = 32_768)]
    prompt_blocks: usize,
    /// Target prefix queries per second; 0 = as fast as the concurrency allows.
    #[arg(long, default_value_t = 64)]
    qps: u64,
    /// Prefix queries in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// gRPC connections to spread queries over.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// How long to query, in seconds.
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
    /// REPORT/REVOKE block-ops per second applied while querying (0 = none).
    #[arg(long, default_value_t = 0)]
    ingest_ops: u64,
    /// Where the applies go, the preload's and the churn's (default: --endpoint), e.g. the
    /// server's KV_INDEXER_APPLY_LISTEN_ADDR.
    #[arg(long)]
    ingest_endpoint: Option<String>,
    /// Hashes per churn apply.
    #[arg(long, default_value_t = 4096)]
    ingest_batch: usize,
    /// Keep one prefix scan of this many held blocks running throughout (0 = none).
    #[arg(long, default_value_t = 0)]
    background_scan_blocks: usize,
    /// Per-query deadline sent as grpc-timeout, in milliseconds.
    #[arg(long, default_value_t = 100)]
    timeout_ms: u64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Skip the preload: the server already holds the prompts (an earlier run with the same
    /// --seed, --workers, --prompts and --prompt-blocks reported them).
    #[arg(long)]
    no_preload: bool,
    /// Names this run in the JSON line (e.g. the server build and the phase).
    #[arg(long, default_value = "")]
    label: String,
    /// Appends the run's report as one JSON line to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Writes the prefix query of prompt 0 (held whole by worker 0 after a preload with the same
    /// --seed, --workers, --prompts and --prompt-blocks) to this file as a gRPC message (the
    /// 5-byte frame header, then the protobuf), and exits: the body for a generator that sends
    /// a file, such as h2load (`scripts/grpc_cores.py --h2load`).
    #[arg(long)]
    write_query: Option<PathBuf>,
    /// Sends the prefix queries through the router's client instead (kv-indexer-client's
    /// `IndexerClient`, its admission bound set to --concurrency) over these replicas
    /// (comma-separated), spread as a router spreads them; the preload still goes to
    /// --endpoint (replicas on one shared log all get it). --connections does not apply.
    #[arg(long)]
    router_client: Option<String>,
    /// TLS and token, as every client of the Indexer takes them.
    #[command(flatten)]
    security: ClientSecurity,
}

type Client = Grpc;

/// Connections to one address, made as every client of the Indexer makes them.
struct Connector {
    credentials: Credentials,
}

impl Connector {
    fn endpoint(&self, address: &str) -> anyhow::Result<tonic::transport::Endpoint> {
        Ok(self
            .credentials
            .endpoint(address)
            .with_context(|| format!("endpoint {address}"))?
            .tcp_nodelay(true))
    }

    async fn connect(&self, address: &str) -> anyhow::Result<Channel> {
        self.endpoint(address)?
            .connect()
            .await
            .with_context(|| format!("connecting to {address}"))
    }

    /// A channel that connects at its first call (and again after a failed one).
    fn connect_lazy(&self, address: &str) -> anyhow::Result<Channel> {
        Ok(self.endpoint(address)?.connect_lazy())
    }

    fn client(&self, channel: &Channel) -> Client {
        self.credentials.client(channel.clone())
    }

    fn prefix_client(&self, channel: &Channel) -> PrefixClient {
        PrefixClient(
            tonic::client::Grpc::new(self.credentials.authorized(channel.clone()))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
    }
}

/// Prefix queries whose answers are counted, not decoded into two strings per match
/// ([`CountedPrefixResponse`]): decoding 1,000-match answers made the generator, not the
/// server, the limit.
struct PrefixClient(tonic::client::Grpc<InterceptedService<Channel, Authorize>>);

impl PrefixClient {
    async fn query(
        &mut self,
        request: tonic::Request<pb::MatchExternalKvPrefixRequest>,
    ) -> Result<CountedPrefixResponse, tonic::Status> {
        self.0
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("channel not ready: {e}")))?;
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(PREFIX_PATH);
        let codec = tonic_prost::ProstCodec::default();
        Ok(self.0.unary(request, path, codec).await?.into_inner())
    }
}

fn report(worker: String, hashes: Vec<i64>) -> pb::ApplyExternalKvBatchRequest {
    apply(worker, pb::ExternalKvActionType::ActionReport, hashes)
}

fn apply(
    worker: String,
    kind: pb::ExternalKvActionType,
    hashes: Vec<i64>,
) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_address: format!("http://{worker}:30000"),
        worker_id: worker,
        seq: 0,
        actions: vec![pb::ExternalKvAction {
            r#type: kind as i32,
            tier: pb::TierType::TierHbm as i32,
            hashes,
            ..Default::default()
        }],
        cache_spec: None,
        bridge_incarnation: None,
        bridge_batch: None,
    }
}

/// Reports `hashes` for `worker` in applies of at most 16,384 hashes.
async fn report_all(client: &mut Client, worker: &str, hashes: &[i64]) -> anyhow::Result<()> {
    for chunk in hashes.chunks(16_384) {
        client
            .apply_external_kv_batch(report(worker.to_string(), chunk.to_vec()))
            .await
            .context("preloading")?;
    }
    Ok(())
}

/// Writes the prefix query of `prompt` to `path` as one gRPC message: the 5-byte frame header
/// (not compressed, the length big-endian), then the protobuf.
fn write_query(path: &std::path::Path, prompt: &[i64]) -> anyhow::Result<()> {
    let query = pb::MatchExternalKvPrefixRequest {
        hashes: prompt.to_vec(),
        ..Default::default()
    };
    let body = prost::Message::encode_to_vec(&query);
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    std::fs::write(path, frame).with_context(|| format!("writing {}", path.display()))
}

fn prompts(args: &Args, rng: &mut StdRng) -> Vec<Arc<Vec<i64>>> {
    let shared_len = args.prompt_blocks / 4;
    let groups: Vec<Vec<i64>> = (0..8)
        .map(|_| (0..shared_len).map(|_| rng.random()).collect())
        .collect();
    (0..args.prompts)
        .map(|p| {
            let mut hashes = groups[p % 8].clone();
            hashes.extend((shared_len..args.prompt_blocks).map(|_| rng.random::<i64>()));
            Arc::new(hashes)
        })
        .collect()
}

#[derive(Default)]
struct Tally {
    /// Latency in µs by outcome: "OK" or the status code.
    latencies_us: std::collections::BTreeMap<String, Vec<u64>>,
    best_prefix_sum: u64,
    blocks_read_sum: u64,
    matches_sum: u64,
}

impl Tally {
    fn ok(&self) -> u64 {
        self.latencies_us.get("OK").map_or(0, |l| l.len() as u64)
    }

    fn record(&mut self, result: Result<CountedPrefixResponse, tonic::Status>, latency: u64) {
        let outcome = match result {
            Ok(answer) => {
                self.best_prefix_sum += u64::from(answer.best_prefix_blocks);
                self.blocks_read_sum += u64::from(answer.blocks_read);
                self.matches_sum += u64::from(answer.matches);
                "OK".to_string()
            }
            Err(status) => format!("{:?}", status.code()),
        };
        self.latencies_us.entry(outcome).or_default().push(latency);
    }

    fn merge(&mut self, other: Tally) {
        self.best_prefix_sum += other.best_prefix_sum;
        self.blocks_read_sum += other.blocks_read_sum;
        self.matches_sum += other.matches_sum;
        for (outcome, latencies) in other.latencies_us {
            self.latencies_us
                .entry(outcome)
                .or_default()
                .extend(latencies);
        }
    }

    /// A sum over the answers, per answer.
    fn per_answer(&self, sum: u64) -> f64 {
        sum as f64 / self.ok().max(1) as f64
    }

    /// The report's query fields (latencies sorted first).
    fn summary(&mut self, elapsed: f64) -> serde_json::Map<String, serde_json::Value> {
        for latencies in self.latencies_us.values_mut() {
            latencies.sort_unstable();
        }
        let sent: usize = self.latencies_us.values().map(Vec::len).sum();
        let failed: BTreeMap<&str, usize> = self
            .latencies_us
            .iter()
            .filter(|(outcome, _)| outcome.as_str() != "OK")
            .map(|(outcome, latencies)| (outcome.as_str(), latencies.len()))
            .collect();
        let failed_total: usize = failed.values().sum();
        let refused = self
            .latencies_us
            .get("ResourceExhausted")
            .map_or(&[][..], Vec::as_slice);
        let mut fields = serde_json::Map::new();
        fields.insert("sent_per_s".into(), (sent as f64 / elapsed).into());
        fields.insert("answered".into(), self.ok().into());
        fields.insert("answered_per_s".into(), (self.ok() as f64 / elapsed).into());
        fields.insert(
            "mean_best_prefix_blocks".into(),
            self.per_answer(self.best_prefix_sum).into(),
        );
        fields.insert(
            "mean_matches".into(),
            self.per_answer(self.matches_sum).into(),
        );
        let answered = self.latencies_us.get("OK").map_or(&[][..], Vec::as_slice);
        fields.extend(latency_fields("answered", answered));
        fields.insert(
            "failed_per_s".into(),
            (failed_total as f64 / elapsed).into(),
        );
        fields.insert("failed_by_code".into(), serde_json::json!(failed));
        fields.extend(latency_fields("refused", refused));
        fields
    }

    fn print(&mut self, elapsed: f64) {
        let sent: usize = self.latencies_us.values().map(Vec::len).sum();
        let ok = self.ok();
        println!(
            "prefix queries: {sent} sent ({:.0}/s), {ok} ok ({:.0} ok/s); mean best prefix {:.0} blocks, mean blocks_read {:.0}, mean matches {:.0}",
            sent as f64 / elapsed,
            ok as f64 / elapsed,
            self.per_answer(self.best_prefix_sum),
            self.per_answer(self.blocks_read_sum),
            self.per_answer(self.matches_sum)
        );
        for (outcome, latencies) in &mut self.latencies_us {
            latencies.sort_unstable();
            println!(
                "  {outcome:>17}: {:>8} ({:5.1}%)  latency µs p50 {} p99 {} p999 {} max {}",
                latencies.len(),
                100.0 * latencies.len() as f64 / sent.max(1) as f64,
                percentile(latencies, 50.0),
                percentile(latencies, 99.0),
                percentile(latencies, 99.9),
                latencies.last().copied().unwrap_or(0)
            );
        }
    }
}

/// `<name>_p50_us` … `<name>_max_us` of sorted latencies.
fn latency_fields(name: &str, sorted: &[u64]) -> serde_json::Map<String, serde_json::Value> {
    let mut fields = serde_json::Map::new();
    for (suffix, p) in [("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9)] {
        fields.insert(format!("{name}_{suffix}_us"), percentile(sorted, p).into());
    }
    let max = sorted.last().copied().unwrap_or(0);
    fields.insert(format!("{name}_max_us"), max.into());
    fields
}

/// `<label> latency µs over <n>: p50 … p99 … max …` of sorted latencies.
fn print_latencies(label: &str, sorted: &[u64]) {
    println!(
        "{label} latency µs over {}: p50 {} p99 {} max {}",
        sorted.len(),
        percentile(sorted, 50.0),
        percentile(sorted, 99.0),
        sorted.last().copied().unwrap_or(0)
    );
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.workers > 0 && args.prompts > 0 && args.prompt_blocks > 0,
        "--workers, --prompts and --prompt-blocks must be positive"
    );
    anyhow::ensure!(
        args.concurrency > 0 && args.connections > 0,
        "--concurrency and --connections must be positive"
    );
    let mut rng = StdRng::seed_from_u64(args.seed);
    let prompts = prompts(&args, &mut rng);
    if let Some(path) = &args.write_query {
        return write_query(path, &prompts[0]);
    }
    let connector = Connector {
        credentials: args.security.load().context("TLS or token settings")?,
    };
    let channels = (0..args.connections)
        .map(|_| connector.connect_lazy(&args.endpoint))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Applies (the preload, the churn) on connections of their own, as a bridge has, to the
    // apply address when there is one: they never wait behind queries, nor take a query
    // connection.
    let apply_address = args.ingest_endpoint.as_ref().unwrap_or(&args.endpoint);
    let mut loader = connector.client(&connector.connect(apply_address).await?);
    if !args.no_preload {
        preload(&args, &prompts, &mut loader, &mut rng).await?;
    }

    let stop = Arc::new(AtomicBool::new(false));
    let churn = match args.ingest_ops {
        0 => None,
        ops => {
            let client = connector.client(&connector.connect(apply_address).await?);
            let churn = Churn {
                batch: args.ingest_batch.max(1),
                ops,
            };
            Some(tokio::spawn(churn.run(client, stop.clone())))
        }
    };
    let background = match args.background_scan_blocks {
        0 => None,
        _ => {
            let client = connector.client(&channels[channels.len() - 1]);
            Some(background_scan(&args, &mut loader, client, stop.clone()).await?)
        }
    };

    let start = Instant::now();
    let mut total = match &args.router_client {
        None => query(&args, &connector, &channels, prompts, start).await?,
        Some(replicas) => query_via_client(&args, replicas, prompts, start).await?,
    };
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    total.print(elapsed);
    let mut report = serde_json::Map::new();
    report.insert("label".into(), args.label.clone().into());
    report.insert("workload".into(), workload(&args));
    report.insert("elapsed_s".into(), elapsed.into());
    report.extend(total.summary(elapsed));
    if let Some(churn) = churn {
        let mut applies = churn.await??;
        applies.print(elapsed, args.ingest_ops);
        report.extend(applies.summary(elapsed));
    }
    if let Some(background) = background {
        let mut latencies = background.await??;
        latencies.sort_unstable();
        print_latencies("background scan", &latencies);
    }
    if let Some(path) = &args.json_out {
        append_line(path, &serde_json::Value::Object(report))?;
    }
    Ok(())
}

/// What was asked of the server, for the JSON line.
fn workload(args: &Args) -> serde_json::Value {
    serde_json::json!({
        "endpoint": args.endpoint,
        "workers": args.workers,
        "prompts": args.prompts,
        "prompt_blocks": args.prompt_blocks,
        "qps": args.qps,
        "concurrency": args.concurrency,
        "connections": args.connections,
        "duration_s": args.duration_secs,
        "timeout_ms": args.timeout_ms,
        "ingest_ops": args.ingest_ops,
        "ingest_batch": args.ingest_batch,
    })
}

fn append_line(path: &std::path::Path, line: &serde_json::Value) -> anyhow::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening --json-out {}", path.display()))?;
    writeln!(file, "{line}").with_context(|| format!("writing --json-out {}", path.display()))
}

/// Reports every prompt whole for one worker and cut at random for two more.
async fn preload(
    args: &Args,
    prompts: &[Arc<Vec<i64>>],
    loader: &mut Client,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let preload = Instant::now();
    let mut preloaded = 0usize;
    for (p, prompt) in prompts.iter().enumerate() {
        report_all(loader, &format!("worker-{}", p % args.workers), prompt).await?;
        preloaded += prompt.len();
        for _ in 0..2 {
            let holder = rng.random_range(0..args.workers);
            let cut = rng.random_range(1..=prompt.len());
            report_all(loader, &format!("worker-{holder}"), &prompt[..cut]).await?;
            preloaded += cut;
        }
    }
    let preload = preload.elapsed();
    println!(
        "preloaded {preloaded} block reports for {} workers in {:.2} s ({:.2} M blocks/s over gRPC)",
        args.workers,
        preload.as_secs_f64(),
        preloaded as f64 / preload.as_secs_f64() / 1e6
    );
    Ok(())
}

/// REPORT/REVOKE churn by workers of its own: `ops` block-ops/s in applies of `batch` hashes.
struct Churn {
    batch: usize,
    ops: u64,
}

/// What the churn's applies saw.
#[derive(Default)]
struct Applies {
    latencies_us: Vec<u64>,
    /// Refused applies by status code (an apply must never be refused).
    refused: BTreeMap<String, u64>,
    block_ops: u64,
}

impl Applies {
    fn print(&mut self, elapsed: f64, target_ops: u64) {
        self.latencies_us.sort_unstable();
        println!("applies refused, by code: {:?}", self.refused);
        println!(
            "ingest: {:.2} M block-ops/s achieved (target {:.2} M)",
            self.block_ops as f64 / elapsed / 1e6,
            target_ops as f64 / 1e6
        );
        print_latencies("apply (REPORT or REVOKE)", &self.latencies_us);
    }

    /// The report's apply fields (after `print`, which sorts).
    fn summary(&self, elapsed: f64) -> serde_json::Map<String, serde_json::Value> {
        let mut fields = serde_json::Map::new();
        let applies = self.latencies_us.len() as f64;
        fields.insert("applies_per_s".into(), (applies / elapsed).into());
        fields.insert(
            "apply_block_ops_per_s".into(),
            (self.block_ops as f64 / elapsed).into(),
        );
        fields.extend(latency_fields("apply", &self.latencies_us));
        fields.insert(
            "applies_refused_by_code".into(),
            serde_json::json!(self.refused),
        );
        fields
    }
}

impl Churn {
    async fn run(self, mut client: Client, stop: Arc<AtomicBool>) -> anyhow::Result<Applies> {
        let batch = self.batch;
        // REPORT a batch, then REVOKE it: two applies of `batch` block-ops each.
        let per_pair = Duration::from_secs_f64(2.0 * batch as f64 / self.ops as f64);
        let mut ticker = tokio::time::interval(per_pair);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut next: i64 = i64::MIN;
        let mut applies = Applies::default();
        while !stop.load(Ordering::Relaxed) {
            ticker.tick().await;
            let hashes: Vec<i64> = (next..next + batch as i64).collect();
            next += batch as i64;
            let worker = format!("churn-{}", next % 16);
            for request in [
                report(worker.clone(), hashes.clone()),
                apply(worker, pb::ExternalKvActionType::ActionRevoke, hashes),
            ] {
                let start = Instant::now();
                let result = client.apply_external_kv_batch(request).await;
                applies
                    .latencies_us
                    .push(start.elapsed().as_micros() as u64);
                match result {
                    Ok(_) => applies.block_ops += batch as u64,
                    Err(status) => {
                        *applies
                            .refused
                            .entry(format!("{:?}", status.code()))
                            .or_default() += 1;
                    }
                }
            }
        }
        Ok(applies)
    }
}

/// Reports one huge prompt and keeps a scan of it running until `stop`; the scans' latencies.
async fn background_scan(
    args: &Args,
    loader: &mut Client,
    mut client: Client,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<Vec<u64>>>> {
    let big: Vec<i64> = (0..args.background_scan_blocks as i64)
        .map(|i| i ^ 0x5bd1_e995)
        .collect();
    report_all(loader, "big-prompt-holder", &big).await?;
    Ok(tokio::spawn(async move {
        let mut latencies = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let start = Instant::now();
            let request = pb::MatchExternalKvPrefixRequest {
                hashes: big.clone(),
                max_blocks: 0,
                max_matches: None,
                include_predictions: None,
            };
            client.match_external_kv_prefix(request).await?;
            latencies.push(start.elapsed().as_micros() as u64);
        }
        Ok(latencies)
    }))
}

/// Runs `--concurrency` queriers for `--duration-secs` and merges their tallies; with `--qps`,
/// querier `q` sends its calls at slots `q`, `q + concurrency`, … of the schedule (late ones at
/// once).
async fn query(
    args: &Args,
    connector: &Connector,
    channels: &[Channel],
    prompts: Vec<Arc<Vec<i64>>>,
    start: Instant,
) -> anyhow::Result<Tally> {
    let deadline = start + Duration::from_secs(args.duration_secs);
    let mut queriers = JoinSet::new();
    let concurrency = args.concurrency;
    for q in 0..concurrency {
        let mut client = connector.prefix_client(&channels[q % channels.len()]);
        let prompts = prompts.clone();
        let (qps, timeout) = (args.qps, Duration::from_millis(args.timeout_ms));
        let mut rng = StdRng::seed_from_u64(args.seed + 1 + q as u64);
        queriers.spawn(async move {
            let mut tally = Tally::default();
            // Each querier keeps its own share of the schedule (every `concurrency`-th
            // slot), so that a connection whose calls fail fast does not draw the load away
            // from the others.
            for i in (q as u64..).step_by(concurrency) {
                if qps > 0 {
                    let due = start + Duration::from_secs_f64(i as f64 / qps as f64);
                    tokio::time::sleep_until(due.into()).await;
                }
                if Instant::now() >= deadline {
                    break;
                }
                let prompt = &prompts[rng.random_range(0..prompts.len())];
                let mut request = tonic::Request::new(pb::MatchExternalKvPrefixRequest {
                    hashes: prompt.to_vec(),
                    max_blocks: 0,
                    max_matches: None,
                    include_predictions: None,
                });
                request.set_timeout(timeout);
                let sent = Instant::now();
                let result = client.query(request).await;
                let latency = sent.elapsed().as_micros() as u64;
                tally.record(result, latency);
            }
            tally
        });
    }
    let mut total = Tally::default();
    while let Some(tally) = queriers.join_next().await {
        total.merge(tally?);
    }
    Ok(total)
}

/// [`query`] through the router's client over `replicas`: each querier waits for its answer
/// before the next, as a router's request task does.
async fn query_via_client(
    args: &Args,
    replicas: &str,
    prompts: Vec<Arc<Vec<i64>>>,
    start: Instant,
) -> anyhow::Result<Tally> {
    let endpoints = Endpoint::parse_list(replicas).context("--router-client")?;
    let mut config = ClientConfig::new(endpoints);
    config.query_timeout = Duration::from_millis(args.timeout_ms);
    config.max_inflight = args.concurrency;
    config.security = args.security.clone();
    let client = Arc::new(IndexerClient::new(config).context("--router-client")?);
    let deadline = start + Duration::from_secs(args.duration_secs);
    let mut queriers = JoinSet::new();
    for q in 0..args.concurrency {
        let (client, prompts) = (client.clone(), prompts.clone());
        let mut rng = StdRng::seed_from_u64(args.seed + 1 + q as u64);
        queriers.spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < deadline {
                let prompt = &prompts[rng.random_range(0..prompts.len())];
                let sent = Instant::now();
                let result = client.longest_prefix_or_status(prompt).await;
                let latency = sent.elapsed().as_micros() as u64;
                tally.record(result.map(counted), latency);
            }
            tally
        });
    }
    let mut total = Tally::default();
    while let Some(tally) = queriers.join_next().await {
        total.merge(tally?);
    }
    Ok(total)
}

/// An answered outcome as the counts [`Tally`] keeps.
fn counted(outcome: PrefixOutcome) -> CountedPrefixResponse {
    match outcome {
        PrefixOutcome::Matched {
            matches,
            best_prefix_blocks,
            blocks_read,
            ..
        } => CountedPrefixResponse {
            matches: matches.len() as u32,
            best_prefix_blocks,
            blocks_read,
        },
        _ => CountedPrefixResponse::default(),
    }
}
