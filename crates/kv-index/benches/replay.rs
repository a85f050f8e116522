//! Trace replay: the Mooncake conversation trace (`benches/data/`) spread over W workers, with
//! each 512-token trace block split into k pages.
//!
//! For every configuration (workers × split × chain hints off/on):
//! 1. ingest: for each request, ask `match_prefix` for the longest prefix, then REPORT (HBM,
//!    legacy: no masks) the pages the request's worker lacks; only the applies are timed. With
//!    hints on, each REPORT carries `parent_block_hash` (the page before its first, when there is
//!    one), as a bridge does from SGLang's `BlockStored.parent_block_hash`;
//! 2. steady state: every request's `match_prefix_hits` again, each one timed (workers by
//!    handle, as the server encodes its answer from; the digest reads their strings untimed);
//! 3. memory: live heap bytes of the built index (a counting global allocator) per placement;
//! 4. REVOKE of every placement, per worker, in applies of at most 16,384 hashes;
//! 5. CLEAR_ALL_AT_TIER (HBM) per worker, on a second identical index.
//!
//! Hints may change how the index stores chains, never an answer: the steady-state answers of
//! both hint modes are digested and must be identical (the run fails otherwise).
//!
//! Page hashes model SGLang's chained hashes: page j of a request's i-th trace block is
//! `mix(hash of the previous page in the request, trace id, j)`, so a page hash identifies its
//! whole prefix, and equal trace prefixes give equal pages.
//!
//! Usage: `cargo bench -p kv-index --bench replay [-- WORKERS [SPLITS [HINTS]]]`, where each is
//! a comma-separated list (`-- 128 32`, `-- 16,1000 1 on`); HINTS are `off` and/or `on`. The
//! environment variables `REPLAY_WORKERS`, `REPLAY_SPLITS`, `REPLAY_HINTS`, `REPLAY_REQUESTS`
//! (use only the first N requests) and `REPLAY_TRACE` (another trace file) do the same. Default:
//! workers 16,128,1000 × splits 1,32 × hints off,on. `REPLAY_PROFILE_PASSES=N` runs N untimed
//! query passes before the timed one, for a profiler.

// The workspace denies unsafe code; the only unsafe here is the `GlobalAlloc` impl below, which
// wraps `System` to count live heap bytes and cannot be written without `unsafe`.
#![allow(unsafe_code)] // a counting allocator needs GlobalAlloc

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kv_index::{ActionRequest, ApplyRequest, Index, MAX_HASHES_PER_REQUEST, PrefixHits, Tier};
use serde::Deserialize;

/// `System`, counting the bytes currently allocated (as requested, without malloc overhead).
///
/// The benchmark is single-threaded, so the counter is updated with a plain load and store,
/// which is exact here and costs nothing; a locked read-modify-write would add ~20 cycles to
/// every allocation of the timed code (256 of them per 128-worker prefix answer).
struct CountingAlloc;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

fn count(add: usize, sub: usize) {
    let live = LIVE_BYTES.load(Ordering::Relaxed);
    LIVE_BYTES.store(live.wrapping_add(add).wrapping_sub(sub), Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and only
// updates a counter, so `System`'s guarantees carry over.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count(layout.size(), 0);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            count(layout.size(), 0);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) };
        count(0, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count(new_size, layout.size());
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

const DEFAULT_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/benches/data/conversation_trace.jsonl"
);
const TRACE_BLOCK_TOKENS: u32 = 512;
const DEFAULT_WORKERS: [usize; 3] = [16, 128, 1000];
const DEFAULT_SPLITS: [u32; 2] = [1, 32];
const SEED: u64 = 42;

const REPORT: i32 = 1;
const REVOKE: i32 = 2;
const CLEAR_ALL_AT_TIER: i32 = 3;
const HBM: i32 = Tier::Hbm as i32;

#[derive(Deserialize)]
struct TraceLine {
    hash_ids: Vec<u64>,
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The chained hash of a page: its parent page's hash, the trace block id and the page's
/// position in that block.
fn page_hash(parent: u64, trace_id: u64, page: u32) -> u64 {
    let content = splitmix64(
        trace_id
            .wrapping_mul(0x1_0000)
            .wrapping_add(u64::from(page)),
    );
    splitmix64(parent.rotate_left(23) ^ content)
}

/// A small seeded PRNG (splitmix64 stream).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

/// All requests' page hashes, flattened.
struct Pages {
    hashes: Vec<i64>,
    /// Request r's pages are `hashes[offsets[r]..offsets[r + 1]]`.
    offsets: Vec<usize>,
}

impl Pages {
    fn new(trace: &[Vec<u64>], split: u32) -> Pages {
        let total: usize = trace.iter().map(|ids| ids.len() * split as usize).sum();
        let mut hashes = Vec::with_capacity(total);
        let mut offsets = Vec::with_capacity(trace.len() + 1);
        offsets.push(0);
        for ids in trace {
            let mut parent = 0u64;
            for &id in ids {
                for page in 0..split {
                    parent = page_hash(parent, id, page);
                    hashes.push(parent as i64);
                }
            }
            offsets.push(hashes.len());
        }
        Pages { hashes, offsets }
    }

    fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    fn request(&self, r: usize) -> &[i64] {
        &self.hashes[self.offsets[r]..self.offsets[r + 1]]
    }
}

/// The simulated fleet and its assignment of requests.
struct Fleet {
    ids: Vec<String>,
    addresses: Vec<String>,
    /// The worker of each request.
    assignment: Vec<usize>,
    /// The requests of each worker, in trace order.
    requests_of: Vec<Vec<usize>>,
    seq: Vec<u64>,
}

impl Fleet {
    fn new(workers: usize, requests: usize) -> Fleet {
        let mut rng = Rng(SEED);
        let assignment: Vec<usize> = (0..requests).map(|_| rng.below(workers)).collect();
        let mut requests_of = vec![Vec::new(); workers];
        for (r, &w) in assignment.iter().enumerate() {
            requests_of[w].push(r);
        }
        Fleet {
            ids: (0..workers).map(|w| format!("worker-{w:04}")).collect(),
            addresses: (0..workers)
                .map(|w| format!("10.0.{}.{}:30000", w / 250, w % 250 + 1))
                .collect(),
            assignment,
            requests_of,
            seq: vec![0; workers],
        }
    }

    fn apply_request(&mut self, worker: usize, action: ActionRequest) -> ApplyRequest {
        self.seq[worker] += 1;
        ApplyRequest {
            worker_id: self.ids[worker].clone(),
            seq: self.seq[worker],
            worker_address: self.addresses[worker].clone(),
            cache_spec: None,
            actions: vec![action],
        }
    }
}

fn action(action_type: i32, hashes: Vec<i64>, block_sizes: Vec<u32>) -> ActionRequest {
    ActionRequest {
        action_type,
        tier: HBM,
        hashes,
        component_masks: Vec::new(),
        block_sizes,
        parent_block_hash: None,
    }
}

/// A digest of a prefix answer (its strings as `match_prefix` would give them), to compare runs.
fn digest(state: u64, index: &Index, answer: &PrefixHits) -> u64 {
    let mut state = splitmix64(state ^ u64::from(answer.blocks_read));
    state = splitmix64(state ^ u64::from(answer.best_prefix_blocks));
    for m in &answer.matches {
        let (id, address) = (index.worker_id(m.worker), index.worker_address(m.worker));
        for byte in id.bytes().chain(address.bytes()) {
            state = splitmix64(state ^ u64::from(byte));
        }
        state = splitmix64(state ^ u64::from(m.matched_prefix_blocks));
    }
    state
}

/// Validates (untimed) and applies (timed) one request; returns the apply time.
fn timed_apply(index: &mut Index, request: ApplyRequest) -> Duration {
    let valid = request
        .validate()
        .expect("the benchmark builds valid applies");
    let start = Instant::now();
    index.apply(&valid);
    let elapsed = start.elapsed();
    drop(valid);
    elapsed
}

/// What pass 1 measured.
struct Ingest {
    reported: usize,
    /// Time in all applies.
    elapsed: Duration,
    /// Of which: the first apply of each worker (the index registers the worker there).
    first_applies: Duration,
}

/// Pass 1: query then report what each request's worker lacks. Fills `reported_from[r]` with
/// the position from which request r was reported.
/// What an ingest pass reports: the pages, their token count, and whether REPORTs carry hints.
struct Feed<'a> {
    pages: &'a Pages,
    page_tokens: u32,
    hints: bool,
}

fn ingest(
    index: &mut Index,
    feed: &Feed<'_>,
    fleet: &mut Fleet,
    reported_from: &mut [usize],
) -> Ingest {
    let Feed {
        pages,
        page_tokens,
        hints,
    } = *feed;
    let mut reported = 0;
    let mut elapsed = Duration::ZERO;
    let mut first_applies = Duration::ZERO;
    let mut seen = vec![false; fleet.ids.len()];
    for (r, from) in reported_from.iter_mut().enumerate() {
        let worker = fleet.assignment[r];
        let hashes = pages.request(r);
        let answer = index.match_prefix(hashes, 0).expect("valid query");
        let held = answer
            .matches
            .iter()
            .find(|m| m.worker_id == fleet.ids[worker])
            .map_or(0, |m| m.matched_prefix_blocks as usize);
        drop(answer);
        *from = held;
        for (i, chunk) in hashes[held..].chunks(MAX_HASHES_PER_REQUEST).enumerate() {
            let mut report = action(REPORT, chunk.to_vec(), vec![page_tokens; chunk.len()]);
            let start = held + i * MAX_HASHES_PER_REQUEST;
            if hints && start > 0 {
                report.parent_block_hash = Some(hashes[start - 1]);
            }
            let first = !std::mem::replace(&mut seen[worker], true);
            let request = fleet.apply_request(worker, report);
            let time = timed_apply(index, request);
            elapsed += time;
            if first {
                first_applies += time;
            }
            reported += chunk.len();
        }
    }
    Ingest {
        reported,
        elapsed,
        first_applies,
    }
}

struct Row {
    workers: usize,
    split: u32,
    hints: bool,
    /// Digest of every steady-state answer.
    answers: u64,
    requests: usize,
    placements: usize,
    blocks: usize,
    ingest_mps: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    mean_blocks_read: f64,
    bytes_per_placement: f64,
    revoke_mps: f64,
    clear_mps: f64,
    // Extra figures for the notes below the table.
    mean_query_pages: f64,
    mean_matches: f64,
    mean_ns_per_block_read: f64,
    ingest_ms: f64,
    first_applies_ms: f64,
    build_time: Duration,
}

impl Row {
    /// The first three columns of both tables: which run a row is.
    fn key(&self) -> String {
        let hints = if self.hints { "on" } else { "off" };
        format!("{:>7} {:>5} {:>5}", self.workers, self.split, hints)
    }
}

fn per_second(count: usize, time: Duration) -> f64 {
    count as f64 / time.as_secs_f64()
}

fn run(trace: &[Vec<u64>], workers: usize, split: u32, hints: bool) -> Row {
    let page_tokens = TRACE_BLOCK_TOKENS / split;
    let pages = Pages::new(trace, split);
    let requests = pages.len();
    let mut fleet = Fleet::new(workers, requests);
    let mut reported_from = vec![0usize; requests];
    let feed = Feed {
        pages: &pages,
        page_tokens,
        hints,
    };

    // Pass 1: ingest, measuring the live bytes the index adds. Everything the loop allocates
    // besides the index (answers, apply requests) is freed before the second reading.
    let build_start = Instant::now();
    let before = live_bytes();
    let mut index = Index::new();
    let pass1 = ingest(&mut index, &feed, &mut fleet, &mut reported_from);
    let index_bytes = live_bytes().saturating_sub(before);
    let build_time = build_start.elapsed();
    let stats = index.stats();
    assert_eq!(
        stats.placements, pass1.reported,
        "every reported page is a new placement"
    );

    // Untimed query passes first when asked (`REPLAY_PROFILE_PASSES`), so that a profiler
    // attached to the run sees mostly the query path.
    for _ in 0..profile_passes() {
        for r in 0..requests {
            black_box(index.match_prefix_hits(black_box(pages.request(r)), 0))
                .expect("valid query");
        }
    }

    // Pass 2: steady-state queries, each timed.
    let mut latencies_ns: Vec<u64> = Vec::with_capacity(requests);
    let mut blocks_read = 0u64;
    let mut matches = 0u64;
    let mut query_pages = 0u64;
    let mut answers = 0u64;
    for r in 0..requests {
        let hashes = pages.request(r);
        let start = Instant::now();
        let answer = index.match_prefix_hits(black_box(hashes), 0);
        let elapsed = start.elapsed();
        let answer = black_box(answer).expect("valid query");
        latencies_ns.push(elapsed.as_nanos() as u64);
        answers = digest(answers, &index, &answer);
        blocks_read += u64::from(answer.blocks_read);
        matches += answer.matches.len() as u64;
        query_pages += hashes.len() as u64;
    }
    let total_query_ns: u64 = latencies_ns.iter().sum();
    latencies_ns.sort_unstable();
    let percentile = |p: f64| {
        let rank = ((p / 100.0) * latencies_ns.len() as f64).ceil() as usize;
        latencies_ns[rank.clamp(1, latencies_ns.len()) - 1] as f64 / 1e3
    };

    // REVOKE every placement, per worker, in applies of at most 16,384 hashes.
    let mut revoke_time = Duration::ZERO;
    let mut revoked = 0;
    for worker in 0..workers {
        let owned: Vec<i64> = fleet.requests_of[worker]
            .iter()
            .flat_map(|&r| pages.request(r)[reported_from[r]..].iter().copied())
            .collect();
        for hashes in owned.chunks(MAX_HASHES_PER_REQUEST) {
            revoked += hashes.len();
            let request = fleet.apply_request(worker, action(REVOKE, hashes.to_vec(), Vec::new()));
            revoke_time += timed_apply(&mut index, request);
        }
    }
    assert_eq!(revoked, stats.placements);
    assert_eq!(index.stats().placements, 0, "REVOKE left placements behind");
    assert_eq!(index.stats().blocks, 0, "REVOKE left blocks behind");
    drop(index);

    // CLEAR_ALL_AT_TIER per worker, on a second index built the same way.
    let mut index = Index::new();
    ingest(&mut index, &feed, &mut fleet, &mut reported_from);
    assert_eq!(index.stats(), stats, "the rebuild is identical");
    let mut clear_time = Duration::ZERO;
    for worker in 0..workers {
        let request =
            fleet.apply_request(worker, action(CLEAR_ALL_AT_TIER, Vec::new(), Vec::new()));
        clear_time += timed_apply(&mut index, request);
    }
    assert_eq!(index.stats().placements, 0, "CLEAR left placements behind");
    assert_eq!(index.stats().blocks, 0, "CLEAR left blocks behind");

    Row {
        workers,
        split,
        hints,
        answers,
        requests,
        placements: stats.placements,
        blocks: stats.blocks,
        ingest_mps: per_second(pass1.reported, pass1.elapsed) / 1e6,
        ingest_ms: pass1.elapsed.as_secs_f64() * 1e3,
        first_applies_ms: pass1.first_applies.as_secs_f64() * 1e3,
        p50_us: percentile(50.0),
        p99_us: percentile(99.0),
        max_us: *latencies_ns.last().expect("some requests") as f64 / 1e3,
        mean_blocks_read: blocks_read as f64 / requests as f64,
        bytes_per_placement: index_bytes as f64 / stats.placements as f64,
        revoke_mps: per_second(revoked, revoke_time) / 1e6,
        clear_mps: per_second(stats.placements, clear_time) / 1e6,
        mean_query_pages: query_pages as f64 / requests as f64,
        mean_matches: matches as f64 / requests as f64,
        mean_ns_per_block_read: total_query_ns as f64 / blocks_read as f64,
        build_time,
    }
}

/// `REPLAY_PROFILE_PASSES`: untimed steady-state query passes before the timed one.
fn profile_passes() -> usize {
    std::env::var("REPLAY_PROFILE_PASSES").map_or(0, |v| {
        v.parse()
            .expect("REPLAY_PROFILE_PASSES: a number of passes")
    })
}

fn parse_list<T: std::str::FromStr>(text: &str, what: &str) -> Vec<T> {
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{what}: {s:?} is not a number"))
        })
        .collect()
}

fn load_trace(path: &str, limit: Option<usize>) -> Vec<Vec<u64>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .take(limit.unwrap_or(usize::MAX))
        .map(|line| {
            serde_json::from_str::<TraceLine>(line)
                .unwrap_or_else(|e| panic!("{path}: bad line {line:?}: {e}"))
                .hash_ids
        })
        .filter(|ids| !ids.is_empty())
        .collect()
}

fn main() {
    // `cargo bench` passes `--bench`; every flag is ignored, positional arguments select.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let workers: Vec<usize> = match args.first().cloned().or_else(|| env("REPLAY_WORKERS")) {
        Some(list) => parse_list(&list, "workers"),
        None => DEFAULT_WORKERS.to_vec(),
    };
    let splits: Vec<u32> = match args.get(1).cloned().or_else(|| env("REPLAY_SPLITS")) {
        Some(list) => parse_list(&list, "splits"),
        None => DEFAULT_SPLITS.to_vec(),
    };
    let hint_modes: Vec<bool> = match args.get(2).cloned().or_else(|| env("REPLAY_HINTS")) {
        Some(list) => list
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| match s.trim() {
                "off" => false,
                "on" => true,
                other => panic!("hints: {other:?} is neither off nor on"),
            })
            .collect(),
        None => vec![false, true],
    };
    for &split in &splits {
        assert!(
            split > 0 && TRACE_BLOCK_TOKENS.is_multiple_of(split),
            "split {split} must divide {TRACE_BLOCK_TOKENS}"
        );
    }
    assert!(workers.iter().all(|&w| w > 0), "workers must be positive");
    let limit =
        env("REPLAY_REQUESTS").map(|v| v.parse::<usize>().expect("REPLAY_REQUESTS: a number"));
    let path = env("REPLAY_TRACE").unwrap_or_else(|| DEFAULT_TRACE.to_owned());
    let trace = load_trace(&path, limit);
    let trace_blocks: usize = trace.iter().map(Vec::len).sum();
    println!(
        "trace {path}: {} requests, {trace_blocks} blocks of {TRACE_BLOCK_TOKENS} tokens; worker PRNG seed {SEED}",
        trace.len()
    );
    println!();

    let header = format!(
        "{:>7} {:>5} {:>5} {:>8} {:>11} {:>10} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9}",
        "workers",
        "split",
        "hints",
        "requests",
        "placements",
        "blocks",
        "ingest",
        "q p50",
        "q p99",
        "q max",
        "mean read",
        "B/place",
        "revoke",
        "clear"
    );
    let units = format!(
        "{:>7} {:>5} {:>5} {:>8} {:>11} {:>10} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9}",
        "",
        "",
        "",
        "",
        "",
        "",
        "M blk/s",
        "µs",
        "µs",
        "µs",
        "blocks",
        "bytes",
        "M blk/s",
        "M blk/s"
    );
    let mut rows = Vec::new();
    for &split in &splits {
        for &w in &workers {
            for &hints in &hint_modes {
                let mode = if hints { "on" } else { "off" };
                eprintln!("running {w} workers × split {split}, hints {mode} ...");
                let row = run(&trace, w, split, hints);
                eprintln!(
                    "  done: {} placements, {} blocks, build {:.1} s",
                    row.placements,
                    row.blocks,
                    row.build_time.as_secs_f64()
                );
                if let Some(other) = rows
                    .iter()
                    .find(|r: &&Row| r.workers == w && r.split == split)
                {
                    assert_eq!(
                        (other.answers, other.placements, other.blocks),
                        (row.answers, row.placements, row.blocks),
                        "chain hints changed an answer ({w} workers, split {split})"
                    );
                }
                rows.push(row);
            }
        }
    }
    println!("{header}");
    println!("{units}");
    for r in &rows {
        println!(
            "{} {:>8} {:>11} {:>10} {:>9.2} {:>8.1} {:>8.1} {:>8.1} {:>10.1} {:>9.1} {:>9.2} {:>9.2}",
            r.key(),
            r.requests,
            r.placements,
            r.blocks,
            r.ingest_mps,
            r.p50_us,
            r.p99_us,
            r.max_us,
            r.mean_blocks_read,
            r.bytes_per_placement,
            r.revoke_mps,
            r.clear_mps
        );
    }
    if hint_modes.len() > 1 {
        println!();
        println!("steady-state answers identical with and without chain hints (digests checked)");
    }
    println!();
    println!("detail: steady-state queries (hashes per query, workers per answer, time per block");
    println!("read) and ingest apply time, of which the first apply of each worker");
    println!(
        "{:>7} {:>5} {:>5} {:>12} {:>12} {:>14} {:>10} {:>15}",
        "workers",
        "split",
        "hints",
        "mean hashes",
        "mean matches",
        "ns/block read",
        "ingest ms",
        "first applies ms"
    );
    for r in &rows {
        println!(
            "{} {:>12.1} {:>12.2} {:>14.1} {:>10.1} {:>15.1}",
            r.key(),
            r.mean_query_pages,
            r.mean_matches,
            r.mean_ns_per_block_read,
            r.ingest_ms,
            r.first_applies_ms
        );
    }
}
