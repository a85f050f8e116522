//! The replay plan: the Mooncake conversation trace spread over W workers, each 512-token trace
//! block split into k pages, and what the benchmarks do with it. Shared by `benches/replay.rs`
//! (`mod plan;`) and the side-by-side benchmark against Dynamo's index in `bench/peer/`
//! (`#[path = ...] mod plan;`), so both replay exactly the same requests, workers and pages.
//!
//! - the trace ([`load_trace`]) and the benchmarks' settings ([`Settings`]);
//! - [`Pages`]: every request's chained page hashes;
//! - [`Fleet`]: the workers, the seeded assignment of requests to them, and their applies;
//! - [`Replay`]: one configuration (workers × split × hints) and its ingest feed: query, then
//!   REPORT the pages the request's worker lacks, in the chunks of [`reports`]; and the REVOKE
//!   of every placement;
//! - a counting global allocator ([`CountingAlloc`]) for live heap bytes;
//! - the figures both print ([`percentile_us`], [`per_second`]).
//!
//! Page hashes model SGLang's chained hashes: page j of a request's i-th trace block is
//! `mix(hash of the previous page in the request, trace id, j)`, so a page hash identifies its
//! whole prefix, and equal trace prefixes give equal pages.

use std::alloc::{GlobalAlloc, Layout, System};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kv_index::{ActionRequest, ApplyRequest, Index, MAX_HASHES_PER_REQUEST, Tier};
use serde::Deserialize;

pub const TRACE_BLOCK_TOKENS: u32 = 512;
pub const SEED: u64 = 42;

pub const REPORT: i32 = 1;
pub const REVOKE: i32 = 2;
pub const HBM: i32 = Tier::Hbm as i32;

/// The bytes currently allocated through [`CountingAlloc`] (as requested, without malloc
/// overhead).
pub static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

pub fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// How [`CountingAlloc`] updates [`LIVE_BYTES`].
pub trait Counter {
    fn count(add: usize, sub: usize);
}

/// A plain load and store, for a benchmark in which one thread allocates: exact there and
/// free; a locked read-modify-write would add ~20 cycles to every allocation of the timed code
/// (256 of them per 128-worker prefix answer).
pub struct OneThread;

impl Counter for OneThread {
    #[inline]
    fn count(add: usize, sub: usize) {
        let live = LIVE_BYTES.load(Ordering::Relaxed);
        LIVE_BYTES.store(live.wrapping_add(add).wrapping_sub(sub), Ordering::Relaxed);
    }
}

/// `System`, counting live bytes with `C`. Install it with
/// `#[global_allocator] static ALLOCATOR: CountingAlloc<OneThread> = CountingAlloc::new();`.
pub struct CountingAlloc<C>(PhantomData<fn() -> C>);

impl<C> CountingAlloc<C> {
    pub const fn new() -> Self {
        CountingAlloc(PhantomData)
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and only
// updates a counter, so `System`'s guarantees carry over.
unsafe impl<C: Counter> GlobalAlloc for CountingAlloc<C> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            C::count(layout.size(), 0);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            C::count(layout.size(), 0);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) };
        C::count(0, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            C::count(new_size, layout.size());
        }
        new
    }
}

#[derive(Deserialize)]
struct TraceLine {
    hash_ids: Vec<u64>,
}

/// Each non-empty request's trace block ids, the first `limit` lines only when given.
pub fn load_trace(path: &str, limit: Option<usize>) -> Vec<Vec<u64>> {
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

/// What to run: positional arguments (`WORKERS [SPLITS [...]]`, comma-separated lists) first,
/// then the `REPLAY_*` environment variables.
pub struct Settings {
    args: Vec<String>,
}

impl Settings {
    /// `cargo bench` passes `--bench`; every flag is ignored, positional arguments select.
    pub fn from_env() -> Settings {
        Settings {
            args: std::env::args()
                .skip(1)
                .filter(|a| !a.starts_with('-'))
                .collect(),
        }
    }

    /// Positional argument `position`, else the environment variable `var` (when not blank).
    pub fn get(&self, position: usize, var: &str) -> Option<String> {
        self.args.get(position).cloned().or_else(|| env(var))
    }

    /// Argument 0 or `REPLAY_WORKERS`.
    pub fn workers(&self, default: &[usize]) -> Vec<usize> {
        let workers = match self.get(0, "REPLAY_WORKERS") {
            Some(list) => parse_list(&list, "workers"),
            None => default.to_vec(),
        };
        assert!(workers.iter().all(|&w| w > 0), "workers must be positive");
        workers
    }

    /// Argument 1 or `REPLAY_SPLITS`; each must divide a trace block.
    pub fn splits(&self, default: &[u32]) -> Vec<u32> {
        let splits = match self.get(1, "REPLAY_SPLITS") {
            Some(list) => parse_list(&list, "splits"),
            None => default.to_vec(),
        };
        for &split in &splits {
            assert!(
                split > 0 && TRACE_BLOCK_TOKENS.is_multiple_of(split),
                "split {split} must divide {TRACE_BLOCK_TOKENS}"
            );
        }
        splits
    }

    /// Argument 2 or `REPLAY_HINTS`: `off` and/or `on`.
    pub fn hints(&self, default: &[bool]) -> Vec<bool> {
        match self.get(2, "REPLAY_HINTS") {
            Some(list) => list
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| match s.trim() {
                    "off" => false,
                    "on" => true,
                    other => panic!("hints: {other:?} is neither off nor on"),
                })
                .collect(),
            None => default.to_vec(),
        }
    }

    /// The trace at `REPLAY_TRACE` (else `default_path`), its first `REPLAY_REQUESTS` lines
    /// when set; prints what was loaded.
    pub fn trace(&self, default_path: &str) -> Vec<Vec<u64>> {
        let limit =
            env("REPLAY_REQUESTS").map(|v| v.parse::<usize>().expect("REPLAY_REQUESTS: a number"));
        let path = env("REPLAY_TRACE").unwrap_or_else(|| default_path.to_owned());
        let trace = load_trace(&path, limit);
        let trace_blocks: usize = trace.iter().map(Vec::len).sum();
        println!(
            "trace {path}: {} requests, {trace_blocks} blocks of {TRACE_BLOCK_TOKENS} tokens; worker PRNG seed {SEED}",
            trace.len()
        );
        trace
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
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

pub fn splitmix64(x: u64) -> u64 {
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
pub struct Pages {
    pub hashes: Vec<i64>,
    /// Request r's pages are `hashes[offsets[r]..offsets[r + 1]]`.
    pub offsets: Vec<usize>,
}

impl Pages {
    pub fn new(trace: &[Vec<u64>], split: u32) -> Pages {
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

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn request(&self, r: usize) -> &[i64] {
        &self.hashes[self.offsets[r]..self.offsets[r + 1]]
    }
}

/// The simulated fleet and its assignment of requests.
pub struct Fleet {
    pub ids: Vec<String>,
    pub addresses: Vec<String>,
    /// The worker of each request.
    pub assignment: Vec<usize>,
    /// The requests of each worker, in trace order.
    pub requests_of: Vec<Vec<usize>>,
    seq: Vec<u64>,
}

impl Fleet {
    pub fn new(workers: usize, requests: usize) -> Fleet {
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

    pub fn apply_request(&mut self, worker: usize, action: ActionRequest) -> ApplyRequest {
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

pub fn action(action_type: i32, hashes: Vec<i64>, block_sizes: Vec<u32>) -> ActionRequest {
    ActionRequest {
        action_type,
        tier: HBM,
        hashes,
        component_masks: Vec::new(),
        block_sizes,
        parent_block_hash: None,
    }
}

/// The REPORTs of a request whose worker already holds its first `held` pages: each chunk of
/// at most `MAX_HASHES_PER_REQUEST` pages with the position of its first page.
pub fn reports(hashes: &[i64], held: usize) -> impl Iterator<Item = (usize, &[i64])> {
    hashes[held..]
        .chunks(MAX_HASHES_PER_REQUEST)
        .enumerate()
        .map(move |(i, chunk)| (held + i * MAX_HASHES_PER_REQUEST, chunk))
}

/// Validates (untimed) and applies (timed) one request; returns the apply time.
pub fn timed_apply(index: &mut Index, request: ApplyRequest) -> Duration {
    let valid = request
        .validate()
        .expect("the benchmark builds valid applies");
    let start = Instant::now();
    index.apply(&valid);
    let elapsed = start.elapsed();
    drop(valid);
    elapsed
}

/// What an ingest pass measured.
pub struct Ingest {
    pub reported: usize,
    /// Time in all applies.
    pub elapsed: Duration,
    /// Of which: the first apply of each worker (the index registers the worker there).
    pub first_applies: Duration,
}

/// One configuration of the plan: the pages of a split, the fleet, whether REPORTs carry
/// hints, and where the last ingest reported each request from.
pub struct Replay {
    pub pages: Pages,
    pub fleet: Fleet,
    pub page_tokens: u32,
    pub hints: bool,
    /// The position from which request r was reported (filled by [`Replay::ingest`]).
    pub reported_from: Vec<usize>,
}

impl Replay {
    pub fn new(trace: &[Vec<u64>], workers: usize, split: u32, hints: bool) -> Replay {
        let pages = Pages::new(trace, split);
        let requests = pages.len();
        Replay {
            pages,
            fleet: Fleet::new(workers, requests),
            page_tokens: TRACE_BLOCK_TOKENS / split,
            hints,
            reported_from: vec![0; requests],
        }
    }

    /// Query then report what each request's worker lacks; only the applies are timed. With
    /// hints on, each REPORT carries `parent_block_hash` (the page before its first, when there
    /// is one), as a bridge does from SGLang's `BlockStored.parent_block_hash`.
    pub fn ingest(&mut self, index: &mut Index) -> Ingest {
        let Replay {
            pages,
            fleet,
            page_tokens,
            hints,
            reported_from,
        } = self;
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
            for (start, chunk) in reports(hashes, held) {
                let mut report = action(REPORT, chunk.to_vec(), vec![*page_tokens; chunk.len()]);
                if *hints && start > 0 {
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

    /// Every page `worker` was given by the last ingest, in report order.
    pub fn owned(&self, worker: usize) -> Vec<i64> {
        self.fleet.requests_of[worker]
            .iter()
            .flat_map(|&r| {
                self.pages.request(r)[self.reported_from[r]..]
                    .iter()
                    .copied()
            })
            .collect()
    }

    /// REVOKE every placement of the last ingest, per worker, in applies of at most
    /// `MAX_HASHES_PER_REQUEST` hashes; returns the placements revoked and the apply time.
    pub fn revoke_all(&mut self, index: &mut Index) -> (usize, Duration) {
        let mut revoke_time = Duration::ZERO;
        let mut revoked = 0;
        for worker in 0..self.fleet.ids.len() {
            let owned = self.owned(worker);
            for hashes in owned.chunks(MAX_HASHES_PER_REQUEST) {
                revoked += hashes.len();
                let revoke = action(REVOKE, hashes.to_vec(), Vec::new());
                let request = self.fleet.apply_request(worker, revoke);
                revoke_time += timed_apply(index, request);
            }
        }
        (revoked, revoke_time)
    }
}

/// The `p`-th percentile (nearest rank) of sorted nanoseconds, in µs.
pub fn percentile_us(sorted_ns: &[u64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted_ns.len() as f64).ceil() as usize;
    sorted_ns[rank.clamp(1, sorted_ns.len()) - 1] as f64 / 1e3
}

pub fn per_second(count: usize, time: Duration) -> f64 {
    count as f64 / time.as_secs_f64()
}
