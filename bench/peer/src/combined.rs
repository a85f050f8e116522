//! The combined run: one thread applies the second half of a configuration's stored pages while
//! another answers the trace's prefix queries, round after round, until the applies are done.
//!
//! - kv-index as the server arranges it (`PEER_COMBINED_CELL=left-right`, the default): the
//!   server's own `kv_state::cell`, two copies; the applier changes the unpublished one and
//!   publishes every slice of applying (`IndexWriter::slice`: 100 µs, longer while readers
//!   keep it waiting, as the server's writer does while applies are queued), the querier takes
//!   the published copy for each `match_prefix_hits`. As the server was before 2026-12-03
//!   (`rwlock`): the index behind a `parking_lot::RwLock`, the applier taking the write lock for
//!   each apply, the querier a read lock per query; `rwlock-fair` hands the lock to a waiting
//!   querier at each unlock (a measured alternative the server never used);
//! - the peer with `PEER_COMBINED_THREADS` write threads (default 1): the applier enqueues its
//!   stored events and waits for the barrier, the querier calls `find_matches` inline, as
//!   Dynamo's router does.
//!
//! Both start from the first half applied untimed. Each query is timed with its lock wait;
//! "combined ops/s" is (pages applied + queries answered) / wall time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::RouterEvent;
use kv_index::{Index, ValidApply};
use kv_state::cell::{self, IndexChange, IndexWriter};
use parking_lot::{RwLock, RwLockWriteGuard};

use crate::peer::{self, Peer};
use crate::plan::{Fleet, Pages, REPORT, Replay, action, per_second, percentile_us, reports};

/// What one side measured in one run.
pub struct Combined {
    pub wall: Duration,
    pub pages: usize,
    pub queries: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// The left-right cell's applier: its time in `IndexWriter::change` (the wait for the
    /// other copy's readers and its catch-up), and the rest of its applying.
    pub catch_up: Option<(Duration, Duration)>,
    /// Of the rest, the block table's rebuilds (`Changing::make_room`).
    pub rebuilding: Duration,
}

impl Combined {
    fn new(wall: Duration, pages: usize, mut ns: Vec<u64>) -> Combined {
        ns.sort_unstable();
        Combined {
            wall,
            pages,
            queries: ns.len(),
            p50_us: percentile_us(&ns, 50.0),
            p99_us: percentile_us(&ns, 99.0),
            max_us: percentile_us(&ns, 100.0),
            catch_up: None,
            rebuilding: Duration::ZERO,
        }
    }

    pub fn pages_per_second(&self) -> f64 {
        per_second(self.pages, self.wall)
    }

    pub fn queries_per_second(&self) -> f64 {
        per_second(self.queries, self.wall)
    }

    pub fn ops_per_second(&self) -> f64 {
        per_second(self.pages + self.queries, self.wall)
    }
}

/// kv-index's applies of the last ingest of `replay` (the REPORTs it made, validated), each
/// with its page count, in ingest order: what the peer's stored events carry.
pub fn applies(replay: &Replay) -> Vec<(ValidApply, usize)> {
    let requests = replay.pages.len();
    let mut fleet = Fleet::new(replay.fleet.ids.len(), requests);
    let mut applies = Vec::new();
    for (r, &held) in replay.reported_from.iter().enumerate() {
        let hashes = replay.pages.request(r);
        for (start, chunk) in reports(hashes, held) {
            let mut report = action(
                REPORT,
                chunk.to_vec(),
                vec![replay.page_tokens; chunk.len()],
            );
            if replay.hints && start > 0 {
                report.parent_block_hash = Some(hashes[start - 1]);
            }
            let request = fleet.apply_request(replay.fleet.assignment[r], report);
            let valid = request
                .validate()
                .expect("the benchmark builds valid applies");
            applies.push((valid, chunk.len()));
        }
    }
    applies
}

/// Runs `query` on every request in turn, round after round, until `done`; each timed.
fn answer_until(
    pages: &Pages,
    start: &Barrier,
    done: &AtomicBool,
    mut query: impl FnMut(usize),
) -> Vec<u64> {
    let mut ns = Vec::new();
    start.wait();
    for r in (0..pages.len()).cycle() {
        if done.load(Ordering::Relaxed) {
            break;
        }
        let began = Instant::now();
        query(r);
        ns.push(began.elapsed().as_nanos() as u64);
    }
    ns
}

/// How kv-index's applier and querier share the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrangement {
    /// The server's cell: two copies, readers never wait (`kv_state::cell`).
    LeftRight,
    /// One copy behind a `parking_lot::RwLock`, dropped plainly (the server before 2026-12-03).
    RwLock,
    /// The same, unlocked fairly (`unlock_fair`).
    RwLockFair,
}

impl Arrangement {
    /// `PEER_COMBINED_CELL`: `left-right` (default), `rwlock` or `rwlock-fair`.
    pub fn from_env() -> Arrangement {
        match std::env::var("PEER_COMBINED_CELL")
            .as_deref()
            .map(str::trim)
        {
            Err(_) | Ok("left-right") => Arrangement::LeftRight,
            Ok("rwlock") => Arrangement::RwLock,
            Ok("rwlock-fair") => Arrangement::RwLockFair,
            Ok(other) => panic!("PEER_COMBINED_CELL={other}: left-right, rwlock or rwlock-fair"),
        }
    }
}

/// kv-index: the first half of `applies` untimed, then the second half against the querier.
pub fn ours(pages: &Pages, applies: &[(ValidApply, usize)], arrangement: Arrangement) -> Combined {
    if arrangement == Arrangement::LeftRight {
        return ours_left_right(pages, applies);
    }
    let (before, timed) = applies.split_at(applies.len() / 2);
    let index = Arc::new(RwLock::new(Index::new()));
    for (valid, _) in before {
        index.write().apply(valid);
    }
    let query = |r| index.read().match_prefix_hits(pages.request(r), 0);
    let (wall, ns) = race(pages, query, || {
        for (valid, _) in timed {
            let mut writer = index.write();
            writer.apply(valid);
            if arrangement == Arrangement::RwLockFair {
                RwLockWriteGuard::unlock_fair(writer);
            }
        }
    });
    let all: usize = applies.iter().map(|(_, n)| n).sum();
    assert_eq!(index.read().stats().placements, all, "every page placed");
    Combined::new(wall, timed.iter().map(|(_, n)| n).sum(), ns)
}

/// [`ours`] on the server's cell: each apply made on the writer's copy (its table grown there
/// first), published every slice of applying ([`IndexWriter::slice`]), as the server's writer
/// does when applies are always queued.
fn ours_left_right(pages: &Pages, applies: &[(ValidApply, usize)]) -> Combined {
    let (before, timed) = applies.split_at(applies.len() / 2);
    let mut first = Index::new();
    for (valid, _) in before {
        first.apply(valid);
    }
    let cell = cell::empty();
    let mut writer = IndexWriter::new(cell.clone());
    writer.replace(first);
    let query = |r| cell.read().match_prefix_hits(pages.request(r), 0);
    let mut catching_up = Duration::ZERO;
    let mut rebuilding = Duration::ZERO;
    let (wall, ns) = race(pages, query, || {
        let mut slice = Instant::now();
        for (valid, _) in timed {
            let before = Instant::now();
            let mut index = writer.change();
            catching_up += before.elapsed();
            let before = Instant::now();
            let retired = index.make_room(valid.reported_blocks());
            rebuilding += before.elapsed();
            index.apply(valid);
            // As the server's writer with applies always queued: a publication per slice.
            if slice.elapsed() >= writer.slice() {
                writer.publish();
                slice = Instant::now();
            }
            drop(retired);
        }
        writer.publish();
    });
    let all: usize = applies.iter().map(|(_, n)| n).sum();
    assert_eq!(cell.read().stats().placements, all, "every page placed");
    assert!(writer.copies_equal(), "the two copies differ");
    let mut combined = Combined::new(wall, timed.iter().map(|(_, n)| n).sum(), ns);
    combined.catch_up = Some((catching_up, wall.saturating_sub(catching_up)));
    combined.rebuilding = rebuilding;
    combined
}

/// Runs `apply` on this thread while another answers every request in turn with `query`
/// until it returns: `apply`'s wall time, and each query's.
fn race<T, E: std::fmt::Debug>(
    pages: &Pages,
    query: impl Fn(usize) -> Result<T, E> + Sync,
    apply: impl FnOnce(),
) -> (Duration, Vec<u64>) {
    let start = Barrier::new(2);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let querier = scope.spawn(|| {
            answer_until(pages, &start, &done, |r| {
                std::hint::black_box(query(r)).expect("valid query");
            })
        });
        start.wait();
        let began = Instant::now();
        apply();
        let wall = began.elapsed();
        done.store(true, Ordering::Relaxed);
        (wall, querier.join().expect("the querier ran"))
    })
}

/// The peer: the same pages as stored events, the second half against the querier.
pub fn theirs(replay: &Replay, events: Vec<RouterEvent>, threads: usize) -> Combined {
    let mut events = events;
    let all: usize = events.iter().map(peer::stored_pages).sum();
    let timed = events.split_off(events.len() / 2);
    let pages_timed = timed.iter().map(peer::stored_pages).sum();
    let peer = Peer::new(threads, replay.page_tokens);
    peer.apply(events, None);
    let local = peer::local_hashes(&replay.pages);
    let offsets = &replay.pages.offsets;
    let start = Barrier::new(2);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let querier = scope.spawn(|| {
            answer_until(&replay.pages, &start, &done, |r| {
                let sequence = &local[offsets[r]..offsets[r + 1]];
                std::hint::black_box(peer.find_matches(sequence));
            })
        });
        start.wait();
        let wall = peer.apply(timed, None);
        done.store(true, Ordering::Relaxed);
        let ns = querier.join().expect("the querier ran");
        assert_eq!(peer.placements(), all, "the peer stored every page");
        Combined::new(wall, pages_timed, ns)
    })
}
