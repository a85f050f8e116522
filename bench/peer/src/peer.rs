//! The peer: Dynamo's default router index, `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`
//! with `KvRouterConfig::default().router_event_threads` write threads, as its standalone
//! indexer builds it (`services/indexer/backend.rs`, `create_indexer_with_policy`, without the
//! Prometheus counters of the `metrics` feature).
//!
//! The plan's REPORTs become stored events (block hash and tokens hash both the page hash,
//! `parent_hash` the page before the first, when there is one) and its REVOKEs removed events,
//! chunked exactly like the plan's applies. Events go through `enqueue_event`, which is what
//! `KvIndexerInterface::apply_event` does for this indexer; timings run until `flush_and_wait`
//! returns, the FIFO barrier after which every queued event is applied. Queries call the
//! backend's `find_matches` inline, as `ThreadPoolIndexer::find_matches` does, minus the
//! owned `Vec` and the async frame.

use std::time::{Duration, Instant};

use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use kv_index::MAX_HASHES_PER_REQUEST;

use crate::plan::{Pages, Replay, reports};

pub struct Peer {
    indexer: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    /// Drives the async barriers (`flush_and_wait`, `shard_sizes`) on the main thread.
    runtime: tokio::runtime::Runtime,
}

impl Peer {
    pub fn new(threads: usize, page_tokens: u32) -> Peer {
        Peer {
            indexer: ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                threads,
                page_tokens,
            ),
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a current-thread runtime"),
        }
    }

    /// Enqueues every event, waiting for the write threads after each `window` events when
    /// given; returns the time until the last event is applied.
    pub fn apply(&self, events: Vec<RouterEvent>, window: Option<usize>) -> Duration {
        let window = window.unwrap_or(usize::MAX);
        let start = Instant::now();
        for (i, event) in events.into_iter().enumerate() {
            self.indexer
                .enqueue_event(event)
                .expect("the write threads are running");
            if (i + 1) % window == 0 {
                self.flush();
            }
        }
        self.flush();
        start.elapsed()
    }

    fn flush(&self) {
        self.runtime
            .block_on(self.indexer.flush_and_wait())
            .expect("the write threads are running");
    }

    pub fn find_matches(&self, sequence: &[LocalBlockHash]) -> OverlapScores {
        self.indexer.backend().find_matches(sequence, false)
    }

    /// `(worker, block)` entries in the write threads' lookups.
    pub fn placements(&self) -> usize {
        self.runtime
            .block_on(self.indexer.shard_sizes())
            .iter()
            .map(|shard| shard.block_count)
            .sum()
    }
}

/// The worker id of fleet worker `w`.
pub fn worker_id(w: usize) -> u64 {
    w as u64
}

fn event(worker: usize, event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent::new(
        worker_id(worker),
        KvCacheEvent {
            event_id,
            data,
            dp_rank: 0,
        },
    )
}

fn block_hash(page: i64) -> ExternalSequenceBlockHash {
    ExternalSequenceBlockHash(page as u64)
}

/// A query's pages as Dynamo's tokens hashes.
pub fn local_hashes(pages: &Pages) -> Vec<LocalBlockHash> {
    pages
        .hashes
        .iter()
        .map(|&page| LocalBlockHash(page as u64))
        .collect()
}

/// The stored events of the plan's last ingest.
pub fn stored_events(replay: &Replay) -> Vec<RouterEvent> {
    let mut events = Vec::new();
    for (r, &held) in replay.reported_from.iter().enumerate() {
        let hashes = replay.pages.request(r);
        for (start, chunk) in reports(hashes, held) {
            let blocks = chunk
                .iter()
                .map(|&page| KvCacheStoredBlockData {
                    block_hash: block_hash(page),
                    tokens_hash: LocalBlockHash(page as u64),
                    mm_extra_info: None,
                })
                .collect();
            let data = KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: (start > 0).then(|| block_hash(hashes[start - 1])),
                start_position: None,
                blocks,
            });
            events.push(event(replay.fleet.assignment[r], events.len() as u64, data));
        }
    }
    events
}

/// The pages a stored event carries (0 for any other event).
pub fn stored_pages(event: &RouterEvent) -> usize {
    match &event.event.data {
        KvCacheEventData::Stored(store) => store.blocks.len(),
        _ => 0,
    }
}

/// The removed events of the plan's REVOKE of every placement.
pub fn removed_events(replay: &Replay) -> Vec<RouterEvent> {
    let mut events = Vec::new();
    for worker in 0..replay.fleet.ids.len() {
        let owned = replay.owned(worker);
        for chunk in owned.chunks(MAX_HASHES_PER_REQUEST) {
            let data = KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: chunk.iter().map(|&page| block_hash(page)).collect(),
            });
            events.push(event(worker, events.len() as u64, data));
        }
    }
    events
}
