//! kv-index side by side with Dynamo's default router index (`dynamo-kv-router` 1.6.1,
//! `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`), on the plan of kv-index's replay
//! benchmark, shared through `crates/kv-index/benches/plan/`: the Mooncake conversation trace
//! over W workers, each 512-token block split into k pages.
//!
//! Per configuration (workers × split), in one process, each index is built twice from the
//! same plan: once for memory (live heap bytes counted by a global allocator) and once timed
//! (nothing counted, so no index pays for counting in timed code).
//! 1. kv-index: the ingest of `replay.rs` (query, then REPORT what the request's worker lacks;
//!    the applies timed), then every request's `match_prefix_hits`, each timed (workers by
//!    handle, what the server encodes its answer from; the peer answers numeric worker ids);
//! 2. the peer: the same REPORTs as stored events. The memory build waits for the write
//!    threads every `MEMORY_WINDOW` events (so queues stay short) and counts allocations on
//!    every thread; the timed build enqueues every event, then waits for the barrier;
//! 3. the peer's `find_matches` for every request, each timed;
//! 4. the answer check: per query, both indexes' workers and matched lengths;
//! 5. removal: kv-index's REVOKE of every placement (the applies timed), then the same pages as
//!    the peer's removed events (enqueued, then the barrier).
//!
//! Usage: `cargo run --release --manifest-path bench/peer/Cargo.toml -- [WORKERS [SPLITS
//! [HINTS]]]`, comma-separated lists as for `replay.rs` (same `REPLAY_*` variables); HINTS (for
//! kv-index's REPORTs; the peer always gets parent hashes) default to `on`. `PEER_THREADS` sets
//! the peer's write threads (default: `KvRouterConfig::default().router_event_threads`).
//!
//! With `--combined` (anywhere on the line): the combined run of [`combined`] instead, one
//! applying and one querying thread on each side, `PEER_COMBINED_RUNS` (3) interleaved runs per
//! configuration (default splits 8 and 32), the peer with `PEER_COMBINED_THREADS` (1) write
//! threads, kv-index arranged as `PEER_COMBINED_CELL` says (`left-right`, the server's cell, by
//! default; `rwlock`, `rwlock-fair`).

mod combined;
mod compare;
mod counter;
mod peer;
#[path = "../../../crates/kv-index/benches/plan/mod.rs"]
mod plan;

use std::hint::black_box;
use std::time::{Duration, Instant};

use dynamo_kv_router::KvRouterConfig;
use kv_index::Index;

use compare::{Check, Workers};
use counter::Mode;
use peer::Peer;
use plan::{CountingAlloc, Replay, live_bytes, per_second, percentile_us};

#[global_allocator]
static ALLOCATOR: CountingAlloc<counter::Phased> = CountingAlloc::new();

const DEFAULT_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../crates/kv-index/benches/data/conversation_trace.jsonl"
);
const DEFAULT_WORKERS: [usize; 2] = [128, 1000];
const DEFAULT_SPLITS: [u32; 3] = [1, 8, 32];
/// Events between barriers in the peer's memory build.
const MEMORY_WINDOW: usize = 64;

/// One index's figures in one configuration.
struct Side {
    p50_us: f64,
    p99_us: f64,
    ingest_mps: f64,
    bytes_per_placement: f64,
    /// What the server holds: two copies of the index, one block table (the peer: its one).
    cell_bytes_per_placement: f64,
    removal_mps: f64,
}

struct Row {
    workers: usize,
    split: u32,
    hints: bool,
    requests: usize,
    placements: usize,
    peer_events: usize,
    /// kv-index's time in applies, of which its first apply of each worker, and the peer's
    /// wall time from the first enqueue to the barrier.
    ours_ingest: Duration,
    ours_first_applies: Duration,
    peer_ingest: Duration,
    ours: Side,
    peer: Side,
    check: Check,
    elapsed: Duration,
    /// Of which the main thread waited for a CPU (when the kernel tells).
    cpu_wait: Option<Duration>,
}

/// How long the main thread has waited for a CPU while runnable (Linux schedstat), to show
/// how much other work on the machine (or the peer's own threads) disturbed a run.
fn cpu_wait() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Sorted per-query nanoseconds.
fn sorted(mut ns: Vec<u64>) -> Vec<u64> {
    ns.sort_unstable();
    ns
}

fn run(trace: &[Vec<u64>], workers: usize, split: u32, hints: bool, threads: usize) -> Row {
    let started = Instant::now();
    let wait_before = cpu_wait();
    let mut replay = Replay::new(trace, workers, split, hints);
    let requests = replay.pages.len();

    // kv-index's memory build: only the main thread allocates. Everything the ingest
    // allocates besides the index (answers, apply requests) is freed before the second reading.
    counter::set(Mode::OneThread);
    let before = live_bytes();
    let mut index = Index::new();
    replay.ingest(&mut index);
    let ours_bytes = live_bytes().wrapping_sub(before);
    // The server's cell holds two copies sharing this one table.
    let table_bytes = index.table_memory().len();
    drop(index);

    // Timed phases count nothing, on either side.
    counter::set(Mode::Off);
    let mut index = Index::new();
    let ingest = replay.ingest(&mut index);
    let pages = &replay.pages;
    let placements = index.stats().placements;
    assert_eq!(
        placements, ingest.reported,
        "every report is a new placement"
    );
    let mut ours_ns = Vec::with_capacity(requests);
    for r in 0..requests {
        let hashes = pages.request(r);
        let start = Instant::now();
        let answer = index.match_prefix_hits(black_box(hashes), 0);
        let elapsed = start.elapsed();
        black_box(answer).expect("valid query");
        ours_ns.push(elapsed.as_nanos() as u64);
    }
    let ours_ns = sorted(ours_ns);

    // The peer's memory build: its write threads allocate too.
    counter::set(Mode::Shared);
    let before = live_bytes();
    let peer = Peer::new(threads, replay.page_tokens);
    let events = peer::stored_events(&replay);
    let peer_events = events.len();
    peer.apply(events, Some(MEMORY_WINDOW));
    let peer_bytes = live_bytes().wrapping_sub(before);
    assert_eq!(peer.placements(), placements, "the peer stored every page");
    drop(peer);

    // The peer's timed build and queries.
    counter::set(Mode::Off);
    let peer = Peer::new(threads, replay.page_tokens);
    let peer_ingest = peer.apply(peer::stored_events(&replay), None);
    assert_eq!(peer.placements(), placements, "the peer stored every page");
    let local = peer::local_hashes(pages);
    let mut peer_ns = Vec::with_capacity(requests);
    for r in 0..requests {
        let sequence = &local[pages.offsets[r]..pages.offsets[r + 1]];
        let start = Instant::now();
        let scores = peer.find_matches(black_box(sequence));
        let elapsed = start.elapsed();
        black_box(scores);
        peer_ns.push(elapsed.as_nanos() as u64);
    }
    let peer_ns = sorted(peer_ns);

    // The check, on kv-index's answer with its workers' strings.
    let names = Workers::new(&replay.fleet.ids);
    let mut check = Check::default();
    for r in 0..requests {
        let ours = index
            .match_prefix(pages.request(r), 0)
            .expect("valid query");
        let theirs = peer.find_matches(&local[pages.offsets[r]..pages.offsets[r + 1]]);
        check.record(r, names.ours(&ours), names.peer(&theirs));
    }
    drop(local);

    // Removal: kv-index's REVOKE (the peer's threads are idle), then the peer's removed events.
    let (revoked, revoke_time) = replay.revoke_all(&mut index);
    assert_eq!(revoked, placements);
    assert_eq!(index.stats().placements, 0, "REVOKE left placements behind");
    drop(index);
    let peer_removal = peer.apply(peer::removed_events(&replay), None);
    assert_eq!(peer.placements(), 0, "removal left placements in the peer");
    drop(peer);

    Row {
        workers,
        split,
        hints,
        requests,
        placements,
        peer_events,
        ours_ingest: ingest.elapsed,
        ours_first_applies: ingest.first_applies,
        peer_ingest,
        ours: Side {
            p50_us: percentile_us(&ours_ns, 50.0),
            p99_us: percentile_us(&ours_ns, 99.0),
            ingest_mps: per_second(ingest.reported, ingest.elapsed) / 1e6,
            bytes_per_placement: ours_bytes as f64 / placements as f64,
            cell_bytes_per_placement: (2 * ours_bytes - table_bytes) as f64 / placements as f64,
            removal_mps: per_second(revoked, revoke_time) / 1e6,
        },
        peer: Side {
            p50_us: percentile_us(&peer_ns, 50.0),
            p99_us: percentile_us(&peer_ns, 99.0),
            ingest_mps: per_second(placements, peer_ingest) / 1e6,
            bytes_per_placement: peer_bytes as f64 / placements as f64,
            cell_bytes_per_placement: peer_bytes as f64 / placements as f64,
            removal_mps: per_second(placements, peer_removal) / 1e6,
        },
        check,
        elapsed: started.elapsed(),
        cpu_wait: cpu_wait()
            .zip(wait_before)
            .map(|(after, before)| after - before),
    }
}

/// Prints one configuration's table; the last column is how many times better kv-index is
/// (peer / ours for latency and bytes, ours / peer for throughput).
fn print_row(row: &Row, threads: usize) {
    let hints = if row.hints { "on" } else { "off" };
    println!(
        "{} workers, split {} ({}-token pages): {} requests, {} placements; kv-index hints {hints}, \
         peer {threads} write threads, {} stored events",
        row.workers,
        row.split,
        plan::TRACE_BLOCK_TOKENS / row.split,
        row.requests,
        row.placements,
        row.peer_events
    );
    println!(
        "{:<24} {:>10} {:>10} {:>10}",
        "", "kv-index", "peer", "ours ×"
    );
    let lines: [(&str, f64, f64, bool); 6] = [
        ("query p50 µs", row.ours.p50_us, row.peer.p50_us, false),
        ("query p99 µs", row.ours.p99_us, row.peer.p99_us, false),
        (
            "ingest M blocks/s",
            row.ours.ingest_mps,
            row.peer.ingest_mps,
            true,
        ),
        (
            "bytes/placement",
            row.ours.bytes_per_placement,
            row.peer.bytes_per_placement,
            false,
        ),
        (
            "bytes/placement, cell",
            row.ours.cell_bytes_per_placement,
            row.peer.cell_bytes_per_placement,
            false,
        ),
        (
            "removal M blocks/s",
            row.ours.removal_mps,
            row.peer.removal_mps,
            true,
        ),
    ];
    for (name, ours, peer, higher_is_better) in lines {
        let ratio = if higher_is_better {
            ours / peer
        } else {
            peer / ours
        };
        println!("{name:<24} {ours:>10.2} {peer:>10.2} {ratio:>10.2}");
    }
    println!(
        "run: {:.1} s, of which the main thread waited {} for a CPU",
        row.elapsed.as_secs_f64(),
        waited(row)
    );
    println!(
        "ingest: kv-index {:.1} ms in applies (first apply of each worker {:.1} ms), peer {:.1} ms to the barrier",
        row.ours_ingest.as_secs_f64() * 1e3,
        row.ours_first_applies.as_secs_f64() * 1e3,
        row.peer_ingest.as_secs_f64() * 1e3
    );
    let check = &row.check;
    println!(
        "answers: {} queries compared, {:.1} workers credited per answer, {} mismatched ({} worker entries differ)",
        check.queries,
        check.credited as f64 / check.queries as f64,
        check.mismatched,
        check.worker_differences
    );
    if let Some((r, ours, peer)) = &check.first {
        let show = |m: &compare::Matches| format!("{:?}", &m[..m.len().min(8)]);
        println!(
            "  first: request {r}: kv-index {} workers {}, peer {} workers {}",
            ours.len(),
            show(ours),
            peer.len(),
            show(peer)
        );
    }
    println!();
}

fn waited(row: &Row) -> String {
    row.cpu_wait
        .map_or("n/a".to_owned(), |wait| format!("{} ms", wait.as_millis()))
}

/// A positive number from `var`, or `default`.
fn env_count(var: &str, default: usize) -> usize {
    let value = std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map_or(default, |v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{var}: a number"))
        });
    assert!(value > 0, "{var} must be positive");
    value
}

/// The combined runs: per configuration, `runs` of each side, interleaved (ours first in even
/// runs, the peer first in odd ones); every run printed, then the medians.
fn run_combined(settings: &plan::Settings, trace: &[Vec<u64>]) {
    let runs = env_count("PEER_COMBINED_RUNS", 3);
    let threads = env_count("PEER_COMBINED_THREADS", 1);
    let arrangement = combined::Arrangement::from_env();
    counter::set(Mode::Off);
    println!(
        "combined: 1 applying + 1 querying thread; kv-index arranged as {arrangement:?}; peer \
         ThreadPoolIndexer<ConcurrentRadixTreeCompressed> with {threads} write thread(s); \
         {runs} interleaved runs each"
    );
    let row = |side: &str, run: usize, c: &combined::Combined| {
        println!(
            "{side:<8} run {run}: {:>8.2} M pages/s applied, {:>9.0} queries/s, {:>9.0} ops/s, \
             query p50 {:>8.2} µs p99 {:>9.2} µs max {:>10.2} µs ({} queries, {:.0} ms)",
            c.pages_per_second() / 1e6,
            c.queries_per_second(),
            c.ops_per_second(),
            c.p50_us,
            c.p99_us,
            c.max_us,
            c.queries,
            c.wall.as_secs_f64() * 1e3
        );
        if let Some((catch_up, rest)) = c.catch_up {
            println!(
                "{side:<8} run {run}: applier {:.0} ms catching up (readers' wait and the other \
                 copy's replay), {:.0} ms the rest ({:.0} ms of it rebuilding the block table): \
                 catch-up / rest {:.2}",
                catch_up.as_secs_f64() * 1e3,
                rest.as_secs_f64() * 1e3,
                c.rebuilding.as_secs_f64() * 1e3,
                catch_up.as_secs_f64() / rest.as_secs_f64()
            );
        }
    };
    for &split in &settings.splits(&[8, 32]) {
        for &workers in &settings.workers(&DEFAULT_WORKERS) {
            let mut replay = Replay::new(trace, workers, split, true);
            replay.ingest(&mut Index::new());
            let applies = combined::applies(&replay);
            let events = peer::stored_events(&replay);
            println!(
                "{workers} workers, split {split}: {} applies, {} stored events",
                applies.len(),
                events.len()
            );
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for run in 0..runs {
                let mut one_each = |first_ours: bool| {
                    if first_ours {
                        ours.push(combined::ours(&replay.pages, &applies, arrangement));
                        row("kv-index", run, ours.last().unwrap());
                    } else {
                        theirs.push(combined::theirs(&replay, events.clone(), threads));
                        row("peer", run, theirs.last().unwrap());
                    }
                };
                one_each(run % 2 == 0);
                one_each(run % 2 == 1);
            }
            let median = |side: &[combined::Combined], f: fn(&combined::Combined) -> f64| {
                let mut values: Vec<f64> = side.iter().map(f).collect();
                values.sort_by(f64::total_cmp);
                values[values.len() / 2]
            };
            let lines: [(&str, fn(&combined::Combined) -> f64, bool); 6] = [
                ("combined ops/s", combined::Combined::ops_per_second, true),
                (
                    "pages applied/s",
                    combined::Combined::pages_per_second,
                    true,
                ),
                ("queries/s", combined::Combined::queries_per_second, true),
                ("query p50 µs", |c| c.p50_us, false),
                ("query p99 µs", |c| c.p99_us, false),
                ("query max µs", |c| c.max_us, false),
            ];
            println!(
                "{:<18} {:>14} {:>14} {:>8}",
                "median", "kv-index", "peer", "ours ×"
            );
            for (name, f, higher_is_better) in lines {
                let (a, b) = (median(&ours, f), median(&theirs, f));
                let ratio = if higher_is_better { a / b } else { b / a };
                println!("{name:<18} {a:>14.2} {b:>14.2} {ratio:>8.2}");
            }
            println!();
        }
    }
}

fn main() {
    let settings = plan::Settings::from_env();
    if std::env::args().any(|arg| arg == "--combined") {
        let trace = settings.trace(DEFAULT_TRACE);
        run_combined(&settings, &trace);
        return;
    }
    let workers = settings.workers(&DEFAULT_WORKERS);
    let splits = settings.splits(&DEFAULT_SPLITS);
    let hint_modes = settings.hints(&[true]);
    let threads = std::env::var("PEER_THREADS")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map(|v| v.trim().parse::<usize>().expect("PEER_THREADS: a number"))
        .unwrap_or(KvRouterConfig::default().router_event_threads as usize);
    assert!(threads > 0, "PEER_THREADS must be positive");
    let trace = settings.trace(DEFAULT_TRACE);
    println!(
        "peer: dynamo-kv-router 1.6.1 ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, {threads} write threads"
    );
    println!();

    let mut rows = Vec::new();
    for &split in &splits {
        for &w in &workers {
            for &hints in &hint_modes {
                eprintln!("running {w} workers × split {split} ...");
                let row = run(&trace, w, split, hints, threads);
                eprintln!(
                    "  done in {:.1} s, {} waiting for a CPU",
                    row.elapsed.as_secs_f64(),
                    waited(&row)
                );
                print_row(&row, threads);
                rows.push(row);
            }
        }
    }

    println!(
        "summary (ours / peer; × = how many times better kv-index is; cpu wait: the main thread's \
         time runnable but not running: other work on the machine, or the peer's write threads \
         on the same core)"
    );
    println!(
        "{:>7} {:>5} {:>5} {:>11} {:>15} {:>6} {:>15} {:>6} {:>13} {:>6} {:>13} {:>6} {:>13} {:>6} {:>10} {:>8}",
        "workers",
        "split",
        "hints",
        "placements",
        "q p50 µs",
        "×",
        "q p99 µs",
        "×",
        "ingest M/s",
        "×",
        "B/place",
        "×",
        "removal M/s",
        "×",
        "mismatch",
        "cpu wait"
    );
    for r in &rows {
        let pair = |a: f64, b: f64| format!("{a:.1} / {b:.1}");
        println!(
            "{:>7} {:>5} {:>5} {:>11} {:>15} {:>6.2} {:>15} {:>6.2} {:>13} {:>6.2} {:>13} {:>6.2} {:>13} {:>6.2} {:>10} {:>8}",
            r.workers,
            r.split,
            if r.hints { "on" } else { "off" },
            r.placements,
            pair(r.ours.p50_us, r.peer.p50_us),
            r.peer.p50_us / r.ours.p50_us,
            pair(r.ours.p99_us, r.peer.p99_us),
            r.peer.p99_us / r.ours.p99_us,
            pair(r.ours.ingest_mps, r.peer.ingest_mps),
            r.ours.ingest_mps / r.peer.ingest_mps,
            pair(r.ours.bytes_per_placement, r.peer.bytes_per_placement),
            r.peer.bytes_per_placement / r.ours.bytes_per_placement,
            pair(r.ours.removal_mps, r.peer.removal_mps),
            r.ours.removal_mps / r.peer.removal_mps,
            format!("{}/{}", r.check.mismatched, r.check.queries),
            waited(r),
        );
    }
}
