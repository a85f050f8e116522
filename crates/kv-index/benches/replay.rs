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
//! The trace, the page hashes, the fleet, the ingest feed and the counting allocator are in
//! `plan/`, which `bench/peer/` (the same plan against Dynamo's index) shares.
//!
//! Usage: `cargo bench -p kv-index --bench replay [-- WORKERS [SPLITS [HINTS]]]`, where each is
//! a comma-separated list (`-- 128 32`, `-- 16,1000 1 on`); HINTS are `off` and/or `on`. The
//! environment variables `REPLAY_WORKERS`, `REPLAY_SPLITS`, `REPLAY_HINTS`, `REPLAY_REQUESTS`
//! (use only the first N requests) and `REPLAY_TRACE` (another trace file) do the same. Default:
//! workers 16,128,1000 × splits 1,32 × hints off,on. `REPLAY_PROFILE_PASSES=N` runs N untimed
//! query passes before the timed one, for a profiler.

// The workspace denies unsafe code; the only unsafe here is the `GlobalAlloc` impl in `plan`,
// which wraps `System` to count live heap bytes and cannot be written without `unsafe`.
#![allow(unsafe_code)] // a counting allocator needs GlobalAlloc

mod plan;

use std::hint::black_box;
use std::time::{Duration, Instant};

use kv_index::{Index, PrefixHits};
use plan::{
    CountingAlloc, OneThread, Replay, action, live_bytes, per_second, percentile_us, splitmix64,
    timed_apply,
};

/// The benchmark is single-threaded, so the allocator counts with a plain load and store.
#[global_allocator]
static ALLOCATOR: CountingAlloc<OneThread> = CountingAlloc::new();

const DEFAULT_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/benches/data/conversation_trace.jsonl"
);
const DEFAULT_WORKERS: [usize; 3] = [16, 128, 1000];
const DEFAULT_SPLITS: [u32; 2] = [1, 32];

const CLEAR_ALL_AT_TIER: i32 = 3;

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

fn run(trace: &[Vec<u64>], workers: usize, split: u32, hints: bool) -> Row {
    let mut replay = Replay::new(trace, workers, split, hints);
    let requests = replay.pages.len();

    // Pass 1: ingest, measuring the live bytes the index adds. Everything the loop allocates
    // besides the index (answers, apply requests) is freed before the second reading.
    let build_start = Instant::now();
    let before = live_bytes();
    let mut index = Index::new();
    let pass1 = replay.ingest(&mut index);
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
            black_box(index.match_prefix_hits(black_box(replay.pages.request(r)), 0))
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
        let hashes = replay.pages.request(r);
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

    // REVOKE every placement, per worker, in applies of at most 16,384 hashes.
    let (revoked, revoke_time) = replay.revoke_all(&mut index);
    assert_eq!(revoked, stats.placements);
    assert_eq!(index.stats().placements, 0, "REVOKE left placements behind");
    assert_eq!(index.stats().blocks, 0, "REVOKE left blocks behind");
    drop(index);

    // CLEAR_ALL_AT_TIER per worker, on a second index built the same way.
    let mut index = Index::new();
    replay.ingest(&mut index);
    assert_eq!(index.stats(), stats, "the rebuild is identical");
    let mut clear_time = Duration::ZERO;
    for worker in 0..workers {
        let request = replay
            .fleet
            .apply_request(worker, action(CLEAR_ALL_AT_TIER, Vec::new(), Vec::new()));
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
        p50_us: percentile_us(&latencies_ns, 50.0),
        p99_us: percentile_us(&latencies_ns, 99.0),
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

fn main() {
    let settings = plan::Settings::from_env();
    let workers = settings.workers(&DEFAULT_WORKERS);
    let splits = settings.splits(&DEFAULT_SPLITS);
    let hint_modes = settings.hints(&[false, true]);
    let trace = settings.trace(DEFAULT_TRACE);
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
