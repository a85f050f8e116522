//! A fleet of replicas on one shared log (`KV_INDEXER_EVENT_LOG`): every replica appends the
//! changes it accepts to the stream ([`super::stream`]) and applies the whole stream in order,
//! so every replica holds the same index.
//!
//! Two threads per replica:
//! - the **appender** takes the service's jobs (the same [`Writer`] handle as a single server)
//!   and appends each group with one pipelined `XADD` round trip. It does not touch the index:
//!   each job waits, under its own number, until the applier reaches its entry, and is answered
//!   with what applying it did (read-your-writes: an answered apply is in this replica's index).
//!   An engine that cannot be reached answers UNAVAILABLE; the bridges queue and retry.
//! - the **applier** reads the stream (`XREAD BLOCK` from its position: no consumer group,
//!   every replica needs every entry) and applies every entry in order, fencing in log order
//!   so all replicas decide alike. It also runs the replica's upkeep: it checks that the log
//!   still explains its index (the epoch, the tail, no gap in the positions; otherwise it
//!   bootstraps again), measures its lag, takes the fleet's maintenance lease, and under it
//!   expires silent workers (an `ExpireUnseen` record, so every replica expires alike) and
//!   publishes snapshots.
//!
//! Start-up: the replica loads its newest local snapshot when the stream still holds every
//! entry after it, else the snapshot another replica published, else starts empty at position
//! 0 (only when the stream still starts there); it is NOT_SERVING until it has applied the
//! stream's tail as of its start. A snapshot is built in the background from the previous one
//! and the stream's entries (never from the live index), written to the state directory (when
//! there is one) and, by the lease holder, published; the stream is trimmed only below a
//! published snapshot.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_index::{Index, IndexStats, NodeMatch};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

use super::dir::StateDir;
use super::record::{Change, Record};
use super::stream::{Entry, READ_BLOCK, Stream, StreamConfig, StreamError};
use super::writer::{Job, Writer, next_group, now_ms};
use super::{Applied, Meta, StateError, apply_record, snapshot};
use crate::config::FleetConfig;
use crate::error::ServerError;
use crate::service::{AbortOnPanic, IndexCell};

/// Entries one read takes at most.
const READ_COUNT: usize = 1024;
/// The longest wait between attempts to reach the engine: a Redis back from a restart is
/// found within this.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How often the applier checks the log's identity and the lease.
const UPKEEP: Duration = Duration::from_secs(1);

/// How current this replica's index is; read by every query.
#[derive(Debug)]
pub struct Freshness {
    /// Caught up with the stream's tail as of the last (re)start.
    ready: AtomicBool,
    /// When this replica last knew it had applied the whole stream (ms since the epoch).
    caught_up_at_ms: AtomicU64,
    /// Entries in the stream not yet applied, at the last check.
    behind: AtomicU64,
    /// The next position to apply.
    position: AtomicU64,
    max_lag_ms: u64,
}

impl Freshness {
    fn new(max_lag: Duration) -> Freshness {
        Freshness {
            ready: AtomicBool::new(false),
            caught_up_at_ms: AtomicU64::new(now_ms()),
            behind: AtomicU64::new(0),
            position: AtomicU64::new(0),
            max_lag_ms: max_lag.as_millis() as u64,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Milliseconds since this replica last knew it had applied the whole stream (a blocked
    /// read counts as caught up for [`READ_BLOCK`]).
    pub fn lag_ms(&self) -> u64 {
        let since = now_ms().saturating_sub(self.caught_up_at_ms.load(Ordering::Acquire));
        since.saturating_sub(READ_BLOCK.as_millis() as u64)
    }

    pub fn behind(&self) -> u64 {
        self.behind.load(Ordering::Relaxed)
    }

    pub fn position(&self) -> u64 {
        self.position.load(Ordering::Relaxed)
    }

    /// Whether queries may be answered: ready and no further behind than the bound.
    pub fn check(&self) -> Result<(), ServerError> {
        if !self.is_ready() {
            return Err(ServerError::NotReady);
        }
        let lag_ms = self.lag_ms();
        if lag_ms > self.max_lag_ms {
            return Err(ServerError::Stale {
                lag_ms,
                max_ms: self.max_lag_ms,
            });
        }
        Ok(())
    }

    fn caught_up(&self, at_ms: u64) {
        self.caught_up_at_ms.store(at_ms, Ordering::Release);
        self.behind.store(0, Ordering::Relaxed);
    }
}

/// A job waiting for its entry to be applied.
enum Waiter {
    Apply(oneshot::Sender<Result<IndexStats, ServerError>>),
    Hits(oneshot::Sender<Result<Vec<NodeMatch>, ServerError>>),
}

impl Waiter {
    fn answer(self, result: Result<Applied, ServerError>, stats: IndexStats) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(result.map(|_| stats));
            }
            Waiter::Hits(reply) => {
                let _ = reply.send(result.map(|applied| match applied {
                    Applied::CountHits(matches) => matches,
                    _ => Vec::new(),
                }));
            }
        }
    }

    fn refuse(self, error: ServerError) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(Err(error));
            }
            Waiter::Hits(reply) => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

/// The jobs waiting for their entries, by this replica's number for them.
type Waiters = Arc<Mutex<HashMap<u64, Waiter>>>;

/// What boot hands over: the running replica.
pub struct Started {
    pub writer: Writer,
    pub freshness: Arc<Freshness>,
}

/// Starts a replica on the shared log: the applier bootstraps in the background (the replica
/// is NOT_SERVING until it has caught up) and the appender accepts changes at once.
pub fn start(
    index: IndexCell,
    fleet: &FleetConfig,
    dir: Option<StateDir>,
    worker_ttl: Option<Duration>,
    snapshot_interval: Option<Duration>,
) -> Result<Started, StateError> {
    let replica = format!("{:016x}", rand::random::<u64>());
    let freshness = Arc::new(Freshness::new(fleet.max_lag));
    let waiters: Waiters = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    info!(
        replica,
        log = fleet.stream.url(),
        key = fleet.stream.key,
        "joining the shared log"
    );
    if snapshot_interval.is_none() {
        warn!(
            "KV_INDEXER_SNAPSHOT_INTERVAL_S is 0: this replica never publishes a snapshot, so under its lease the stream is never trimmed and grows in the engine's memory"
        );
    }
    let applier = Applier {
        config: fleet.stream.clone(),
        replica: replica.clone(),
        index: index.clone(),
        meta: Meta::new(),
        next: 0,
        ready_at: None,
        last_origin: None,
        generation: 0,
        ready_since: Instant::now(),
        expiries: 0,
        epoch: None,
        stream: None,
        waiters: waiters.clone(),
        freshness: freshness.clone(),
        dir,
        worker_ttl,
        snapshot_interval,
        base: None,
        building: None,
        last_snapshot: Instant::now(),
        last_upkeep: None,
        last_sweep: Instant::now(),
        lease: false,
        guard_trips: 0,
        skipped: 0,
        stop: stop.clone(),
    };
    let applier = std::thread::Builder::new()
        .name("kv-indexer-applier".into())
        .spawn(move || applier.run())
        .map_err(StateError::Thread)?;
    let appender = Appender {
        config: fleet.stream.clone(),
        replica,
        stream: None,
        next_number: 1,
        waiters,
        stop,
        applier: Some(applier),
    };
    let writer = Writer::start_with("kv-indexer-appender", move |queue| appender.run(queue))
        .map_err(StateError::Thread)?;
    Ok(Started { writer, freshness })
}

/// The thread that appends accepted changes to the stream.
struct Appender {
    config: StreamConfig,
    replica: String,
    stream: Option<Stream>,
    next_number: u64,
    waiters: Waiters,
    stop: Arc<AtomicBool>,
    applier: Option<JoinHandle<Applier>>,
}

impl Appender {
    fn run(mut self, mut queue: mpsc::Receiver<Job>) {
        while let Some(group) = next_group(&mut queue) {
            let mut entries = Vec::with_capacity(group.len());
            for job in group {
                match job {
                    Job::Apply(apply) => {
                        let bytes = apply.bytes.expect("a logged apply has its bytes");
                        entries.push(self.wait_for(bytes, Waiter::Apply(apply.reply)));
                    }
                    Job::CountHits { hashes, reply } => {
                        let record = Record {
                            time_ms: now_ms(),
                            change: Change::CountHits(hashes),
                        };
                        entries.push(self.wait_for(record.encode(), Waiter::Hits(reply)));
                    }
                    // The applier sweeps and snapshots on its own clock.
                    Job::Sweep | Job::Snapshot => {}
                    // No snapshot on demand: the applier builds them on its own schedule.
                    Job::SnapshotWait(reply) => {
                        let _ = reply.send(Err(StateError::Fleet(Arc::new(
                            StreamError::Unexpected {
                                url: self.config.url().to_owned(),
                                what: "a replica builds snapshots on its own schedule (KV_INDEXER_SNAPSHOT_INTERVAL_S), not on demand".into(),
                            },
                        ))));
                    }
                    Job::Stop(reply) => {
                        self.append(std::mem::take(&mut entries));
                        let _ = reply.send(self.finish());
                        return;
                    }
                }
            }
            self.append(entries);
        }
        if let Err(error) = self.finish() {
            error!(error = %kv_common::error_chain(&error), "the final snapshot failed");
        }
    }

    /// Registers `waiter` under a new number; the entry to append for it.
    fn wait_for(&mut self, record: Vec<u8>, waiter: Waiter) -> (u64, String, Vec<u8>) {
        let number = self.next_number;
        self.next_number += 1;
        self.waiters.lock().insert(number, waiter);
        (number, format!("{}:{number}", self.replica), record)
    }

    /// Appends a group in one round trip; on failure its jobs are answered UNAVAILABLE.
    fn append(&mut self, entries: Vec<(u64, String, Vec<u8>)>) {
        if entries.is_empty() {
            return;
        }
        let (numbers, records): (Vec<u64>, Vec<(String, Vec<u8>)>) =
            entries.into_iter().map(|(n, o, r)| (n, (o, r))).unzip();
        let appended = match self.stream.take() {
            Some(stream) => Ok(stream),
            None => self.config.connect(),
        }
        .and_then(|mut stream| {
            let positions = stream.append(&records)?;
            Ok((stream, positions))
        });
        match appended {
            Ok((stream, _)) => self.stream = Some(stream),
            Err(error) => {
                warn!(error = %kv_common::error_chain(&error), changes = numbers.len(), "cannot append to the shared log: refusing the changes (UNAVAILABLE)");
                crate::observe::event_log_append_failed();
                let error = Arc::new(error);
                let mut waiters = self.waiters.lock();
                for number in numbers {
                    if let Some(waiter) = waiters.remove(&number) {
                        waiter.refuse(ServerError::EventLog(error.clone()));
                    }
                }
            }
        }
    }

    /// Stops the applier and writes a last local snapshot of what it applied.
    fn finish(&mut self) -> Result<(), StateError> {
        self.stop.store(true, Ordering::Release);
        let Some(applier) = self.applier.take() else {
            return Ok(());
        };
        let mut applier = applier.join().map_err(|_| {
            StateError::Thread(std::io::Error::other("the applier thread panicked"))
        })?;
        applier.final_snapshot()
    }
}

/// A snapshot the applier holds as the base of the next one.
#[derive(Clone)]
struct Base {
    position: u64,
    bytes: Arc<Vec<u8>>,
}

/// The thread that applies the stream.
struct Applier {
    config: StreamConfig,
    replica: String,
    index: IndexCell,
    meta: Meta,
    /// The next position to apply.
    next: u64,
    /// Ready once `next` reaches this (the tail as of the bootstrap); none: not bootstrapped.
    ready_at: Option<u64>,
    /// The origin of the entry last applied (at `next - 1`), checked on every read.
    last_origin: Option<String>,
    /// Bumped at every bootstrap: a snapshot built before one is thrown away.
    generation: u64,
    /// When this replica last became ready.
    ready_since: Instant,
    /// Expiry records this replica appended (their origins are `<replica>:x<n>`).
    expiries: u64,
    epoch: Option<String>,
    stream: Option<Stream>,
    waiters: Waiters,
    freshness: Arc<Freshness>,
    dir: Option<StateDir>,
    worker_ttl: Option<Duration>,
    snapshot_interval: Option<Duration>,
    base: Option<Base>,
    building: Option<JoinHandle<Result<(u64, Base), StateError>>>,
    last_snapshot: Instant,
    last_upkeep: Option<Instant>,
    last_sweep: Instant,
    lease: bool,
    guard_trips: u64,
    /// Entries that did not decode or apply (every replica skips the same ones).
    skipped: u64,
    stop: Arc<AtomicBool>,
}

/// Why the applier starts over.
enum Restart {
    /// The engine failed; retry from the same position.
    Engine(StreamError),
    /// The log no longer explains the index: bootstrap again.
    Rebootstrap(String),
}

impl From<StreamError> for Restart {
    fn from(error: StreamError) -> Restart {
        Restart::Engine(error)
    }
}

impl Applier {
    fn run(mut self) -> Applier {
        let mut backoff = Duration::from_millis(50);
        while !self.stop.load(Ordering::Acquire) {
            match self.step() {
                Ok(()) => backoff = Duration::from_millis(50),
                Err(Restart::Engine(error)) => {
                    self.stream = None;
                    self.lease = false;
                    warn!(error = %kv_common::error_chain(&error), lag_ms = self.freshness.lag_ms(), "the shared log is unreachable: answering from memory until it returns");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(Restart::Rebootstrap(why)) => {
                    error!(
                        reason = why,
                        position = self.next,
                        retry_in_ms = backoff.as_millis() as u64,
                        "the shared log no longer explains this replica's index: bootstrapping again"
                    );
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    crate::observe::fleet_rebootstraps();
                    self.freshness.ready.store(false, Ordering::Release);
                    self.ready_at = None;
                    self.epoch = None;
                    self.base = None;
                    let pending: Vec<Waiter> =
                        self.waiters.lock().drain().map(|(_, w)| w).collect();
                    for waiter in pending {
                        waiter.refuse(ServerError::LogReset);
                    }
                }
            }
        }
        self
    }

    /// One read and what follows it.
    fn step(&mut self) -> Result<(), Restart> {
        if self.stream.is_none() {
            self.stream = Some(self.config.connect()?);
            // A reconnect may find another history: check at once.
            self.last_upkeep = None;
        }
        if self.ready_at.is_none() {
            self.bootstrap()?;
        }
        if self.last_upkeep.is_none_or(|at| at.elapsed() >= UPKEEP) {
            self.upkeep()?;
            self.last_upkeep = Some(Instant::now());
        }
        let stream = self.stream.as_mut().expect("connected above");
        // One entry of overlap: the last one applied must still be there, with the same
        // origin, or the log lost it (a failover without persistence) and others refilled
        // the position.
        let overlap = self.last_origin.is_some() && self.next > 0;
        let from = self.next - u64::from(overlap);
        let mut entries = stream.read_from(from, READ_COUNT, Some(READ_BLOCK))?;
        let read_at = now_ms();
        if overlap && entries.first().is_some_and(|e| e.position == from) {
            let seen = entries.remove(0);
            if Some(&seen.origin) != self.last_origin.as_ref() {
                return Err(Restart::Rebootstrap(format!(
                    "the entry at position {from} is now {}'s, not {}'s: the engine lost entries and others took their places",
                    seen.origin,
                    self.last_origin.as_deref().unwrap_or("?")
                )));
            }
        }
        let count = entries.len() + usize::from(overlap);
        for entry in entries {
            if entry.position != self.next {
                return Err(Restart::Rebootstrap(format!(
                    "the stream jumps from position {} to {}: entries were trimmed before this replica applied them",
                    self.next, entry.position
                )));
            }
            self.apply(entry);
        }
        self.freshness.position.store(self.next, Ordering::Relaxed);
        if count < READ_COUNT {
            self.freshness.caught_up(read_at);
        }
        if let Some(ready_at) = self.ready_at
            && self.next >= ready_at
            && !self.freshness.is_ready()
        {
            self.freshness.caught_up(read_at);
            self.freshness.ready.store(true, Ordering::Release);
            self.ready_since = Instant::now();
            let stats = self.index.read().stats();
            info!(
                position = self.next,
                placements = stats.placements,
                workers = stats.workers,
                "caught up with the shared log: serving"
            );
        }
        Ok(())
    }

    /// Applies one entry and answers its job, if this replica accepted it.
    fn apply(&mut self, entry: Entry) {
        let result = Record::decode(&entry.record)
            .map_err(|error| format!("does not decode: {error}"))
            .map(|record| {
                let mut index = self.index.write();
                let abort = AbortOnPanic("applying a shared-log entry");
                let applied = apply_record(&mut index, &mut self.meta, &record);
                drop(abort);
                let stats = index.stats();
                (applied, stats)
            });
        self.next = entry.position + 1;
        self.last_origin = Some(entry.origin.clone());
        let waiter = entry
            .origin
            .strip_prefix(self.replica.as_str())
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|number| number.parse::<u64>().ok())
            .and_then(|number| self.waiters.lock().remove(&number));
        match result {
            Ok((applied, stats)) => {
                crate::observe::index_size(stats);
                if let Err(error) = &applied
                    && !matches!(error, ServerError::Fenced { .. })
                {
                    self.skip(&entry, &error.to_string());
                }
                if let Some(waiter) = waiter {
                    waiter.answer(applied, stats);
                }
            }
            Err(why) => {
                self.skip(&entry, &why);
                if let Some(waiter) = waiter {
                    waiter.refuse(ServerError::LogReset);
                }
            }
        }
    }

    fn skip(&mut self, entry: &Entry, why: &str) {
        self.skipped += 1;
        crate::observe::fleet_entry_skipped();
        error!(
            position = entry.position,
            origin = entry.origin,
            reason = why,
            skipped = self.skipped,
            "skipping a shared-log entry that does not apply (every replica skips it alike)"
        );
    }

    /// Loads the newest usable snapshot and sets the position to replay from.
    fn bootstrap(&mut self) -> Result<(), Restart> {
        let mut stream = self.stream.take().expect("connected");
        let loaded = self.load_base(&mut stream);
        self.stream = Some(stream);
        loaded
    }

    fn load_base(&mut self, stream: &mut Stream) -> Result<(), Restart> {
        let epoch = stream.epoch(&format!("{:016x}", rand::random::<u64>()))?;
        let bounds = stream.bounds()?;
        // A base at position p is usable when the stream holds every entry from p on.
        let usable = |position: u64| match bounds {
            None => position == 0,
            Some((first, last)) => first <= position && position <= last + 1,
        };
        let local = self.local_snapshot(&epoch).filter(|b| usable(b.position));
        let published = match stream.published()? {
            Some(p) if p.epoch == epoch && usable(p.position) => Some(p),
            _ => None,
        };
        let base = match (local, published) {
            (Some(local), Some(p)) if local.position >= p.position => Some(local),
            (_, Some(p)) => match stream.fetch(&p)? {
                Some(bytes) => Some(Base {
                    position: p.position,
                    bytes: Arc::new(bytes),
                }),
                // Replaced while we read it: the next step tries again.
                None => return Err(Restart::Engine(stream_gone(&self.config))),
            },
            (local, None) => local,
        };
        if base.is_none() && !usable(0) {
            return Err(Restart::Rebootstrap(format!(
                "the stream starts at position {} and no snapshot of epoch {epoch} covers what came before",
                bounds.map_or(0, |b| b.0)
            )));
        }
        let started = Instant::now();
        let (index, meta, position) = match &base {
            None => (Index::new(), Meta::new(), 0),
            Some(base) => {
                let contents = snapshot::from_bytes(
                    std::path::Path::new(&format!("{}:snapshot", self.config.key)),
                    &base.bytes,
                )
                .map_err(|error| {
                    Restart::Rebootstrap(format!("the snapshot does not load: {error}"))
                })?;
                (
                    Index::import(&contents.export),
                    contents.meta,
                    contents.position,
                )
            }
        };
        let stats = index.stats();
        // The old index is dropped after the lock is released. No fresh TTLs here (unlike a
        // single server): the workers' last-seen times come from the log and must stay equal
        // on every replica, since expiry records are applied against them.
        let old = std::mem::replace(&mut *self.index.write(), index);
        drop(old);
        self.meta = meta;
        self.next = position;
        self.last_origin = None;
        self.generation += 1;
        self.ready_at = Some(bounds.map_or(0, |(_, last)| last + 1));
        self.epoch = Some(epoch.clone());
        self.base = base;
        self.last_snapshot = Instant::now();
        info!(
            epoch,
            snapshot_position = position,
            placements = stats.placements,
            tail = bounds.map_or(0, |(_, last)| last + 1),
            took_ms = started.elapsed().as_millis() as u64,
            "loaded the base of the shared log; replaying the stream after it"
        );
        Ok(())
    }

    /// This replica's newest snapshot of `epoch` in its state directory.
    fn local_snapshot(&self, epoch: &str) -> Option<Base> {
        let dir = self.snapshot_dir(epoch)?;
        let (position, path) = snapshot::list(&dir).ok()?.pop()?;
        match std::fs::read(&path) {
            Ok(bytes) => Some(Base {
                position,
                bytes: Arc::new(bytes),
            }),
            Err(error) => {
                warn!(%error, path = %path.display(), "cannot read the local snapshot");
                None
            }
        }
    }

    /// Where this replica keeps its snapshots of `epoch`: `fleet-<epoch>/` in the state
    /// directory (another epoch's snapshots never load).
    fn snapshot_dir(&self, epoch: &str) -> Option<PathBuf> {
        Some(self.dir.as_ref()?.path().join(format!("fleet-{epoch}")))
    }

    /// Checks that the log still explains the index, measures the lag, holds the lease and
    /// runs what the lease holder runs.
    fn upkeep(&mut self) -> Result<(), Restart> {
        let stream = self.stream.as_mut().expect("connected");
        let epoch = stream.current_epoch()?;
        if epoch != self.epoch {
            return Err(Restart::Rebootstrap(format!(
                "the stream's epoch is {epoch:?}, not {:?}: the engine lost the log",
                self.epoch
            )));
        }
        let bounds = stream.bounds()?;
        let tail = bounds.map_or(0, |(_, last)| last + 1);
        if tail < self.next {
            return Err(Restart::Rebootstrap(format!(
                "the stream ends at position {tail}, before this replica's {}: the engine lost entries",
                self.next
            )));
        }
        self.freshness
            .behind
            .store(tail - self.next, Ordering::Relaxed);
        crate::observe::fleet_lag(self.freshness.lag_ms(), tail - self.next);
        // Only a replica that serves holds the lease: one still catching up would stall the
        // fleet's expiry, snapshots and trimming.
        let ready = self.freshness.check().is_ok();
        let held = match ready {
            true => stream.hold_lease(&self.replica)?,
            false => {
                if self.lease {
                    stream.release_lease(&self.replica)?;
                }
                false
            }
        };
        if held != self.lease {
            info!(
                replica = self.replica,
                held, "the fleet's maintenance lease changed hands"
            );
            self.lease = held;
        }
        if !self.freshness.is_ready() {
            return Ok(());
        }
        if self.lease {
            self.sweep()?;
        }
        self.maybe_snapshot();
        Ok(())
    }

    /// Under the lease: appends the expiry of the workers whose TTL ran out.
    fn sweep(&mut self) -> Result<(), Restart> {
        let Some(ttl) = self.worker_ttl else {
            return Ok(());
        };
        let every = (ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
        // A grace of one TTL after this replica became ready: after the whole fleet was
        // down, bridges get the time to send again before their workers look silent.
        if self.last_sweep.elapsed() < every || self.ready_since.elapsed() < ttl {
            return Ok(());
        }
        self.last_sweep = Instant::now();
        let now = now_ms();
        let expired = super::due_for_expiry(&self.meta, ttl, now, &mut self.guard_trips);
        if expired.is_empty() {
            return Ok(());
        }
        let record = Record {
            time_ms: now,
            change: Change::ExpireUnseen(expired),
        };
        self.expiries += 1;
        let origin = format!("{}:x{}", self.replica, self.expiries);
        let stream = self.stream.as_mut().expect("connected");
        stream.append(&[(origin, record.encode())])?;
        Ok(())
    }

    /// Starts a background snapshot when one is due, and takes a finished one.
    fn maybe_snapshot(&mut self) {
        if let Some(building) = self.building.take() {
            if !building.is_finished() {
                self.building = Some(building);
                return;
            }
            match building.join() {
                Ok(Ok((generation, base))) if generation == self.generation => {
                    self.base = Some(base)
                }
                // Built on a history this replica has since dropped.
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    warn!(error = %kv_common::error_chain(&error), "building a snapshot failed")
                }
                Err(_) => warn!("the snapshot thread panicked"),
            }
        }
        let Some(interval) = self.snapshot_interval else {
            return;
        };
        let from = self.base.as_ref().map_or(0, |b| b.position);
        let keeps = self.dir.is_some() || self.lease;
        if !keeps || self.last_snapshot.elapsed() < interval || self.next == from {
            return;
        }
        self.last_snapshot = Instant::now();
        let job = Build {
            config: self.config.clone(),
            replica: self.replica.clone(),
            epoch: self.epoch.clone().expect("bootstrapped"),
            base: self.base.clone(),
            to: self.next,
            generation: self.generation,
            dir: self.epoch.as_deref().and_then(|e| self.snapshot_dir(e)),
            publish: self.lease,
        };
        let spawned = std::thread::Builder::new()
            .name("kv-indexer-snapshot".into())
            .spawn(move || {
                if let Err(error) = thread_priority::ThreadPriority::Min.set_for_current() {
                    warn!(?error, "cannot lower the snapshot thread's priority");
                }
                job.run()
            });
        match spawned {
            Ok(handle) => self.building = Some(handle),
            Err(error) => warn!(%error, "cannot start the snapshot thread"),
        }
    }

    /// At shutdown: a local snapshot of the index as applied (nothing changes it any more).
    fn final_snapshot(&mut self) -> Result<(), StateError> {
        if let Some(building) = self.building.take() {
            let _ = building.join();
        }
        let (Some(epoch), Some(_)) = (self.epoch.clone(), self.ready_at) else {
            return Ok(());
        };
        let Some(dir) = self.snapshot_dir(&epoch) else {
            return Ok(());
        };
        if self.base.as_ref().is_some_and(|b| b.position == self.next) {
            return Ok(());
        }
        let contents = snapshot::Contents {
            position: self.next,
            export: self.index.read().export(),
            meta: self.meta.clone(),
        };
        write_local(&dir, &contents.position, &snapshot::to_bytes(&contents))
    }
}

fn stream_gone(config: &StreamConfig) -> StreamError {
    StreamError::Unexpected {
        url: config.url().to_owned(),
        what: "the published snapshot was replaced while it was read".into(),
    }
}

/// Writes a local snapshot and deletes the older ones beside it.
fn write_local(dir: &std::path::Path, position: &u64, bytes: &[u8]) -> Result<(), StateError> {
    std::fs::create_dir_all(dir).map_err(|source| {
        StateError::Log(super::log::LogError::Io {
            op: "creating",
            path: dir.to_path_buf(),
            source,
        })
    })?;
    snapshot::write_bytes(dir, *position, bytes)?;
    for (older, path) in snapshot::list(dir)? {
        if older < *position {
            let _ = std::fs::remove_file(path);
        }
    }
    // Snapshots of other epochs will never load again.
    if let Some(parent) = dir.parent() {
        for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().starts_with("fleet-") && entry.path() != dir {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    Ok(())
}

/// A snapshot to build in the background: `base` plus the stream's entries up to `to`.
struct Build {
    config: StreamConfig,
    replica: String,
    epoch: String,
    base: Option<Base>,
    to: u64,
    /// The applier's generation when it was asked for.
    generation: u64,
    dir: Option<PathBuf>,
    publish: bool,
}

impl Build {
    /// The snapshot to build on: this replica's last one, or, when the stream was trimmed past
    /// it (another replica published a newer one), the published one.
    fn base_for(&self, stream: &mut Stream) -> Result<Option<Base>, StreamError> {
        let from = self.base.as_ref().map_or(0, |b| b.position);
        let first = match stream.bounds()? {
            Some((first, _)) if first > from => first,
            _ => return Ok(self.base.clone()),
        };
        let published = stream
            .published()?
            .filter(|p| p.epoch == self.epoch && p.position >= first && p.position <= self.to);
        let bytes = match &published {
            Some(p) => stream.fetch(p)?,
            None => None,
        };
        match (published, bytes) {
            (Some(p), Some(bytes)) => Ok(Some(Base {
                position: p.position,
                bytes: Arc::new(bytes),
            })),
            _ => Err(StreamError::Unexpected {
                url: self.config.url().to_owned(),
                what: format!(
                    "the stream starts at position {first}, after this replica's snapshot at {from}, and no published snapshot fits"
                ),
            }),
        }
    }

    /// `base` with the stream's entries up to `to` applied; none when an entry was trimmed
    /// away meanwhile.
    fn replay(
        &self,
        stream: &mut Stream,
        base: Option<&Base>,
        origin: &std::path::Path,
    ) -> Result<Option<(Index, Meta)>, StateError> {
        let (mut index, mut meta, from) = match base {
            None => (Index::new(), Meta::new(), 0),
            Some(base) => {
                let contents = snapshot::from_bytes(origin, &base.bytes)?;
                (
                    Index::import(&contents.export),
                    contents.meta,
                    contents.position,
                )
            }
        };
        let mut next = from;
        let mut gap = false;
        stream
            .range(from, self.to, |entry| {
                if entry.position != next {
                    gap = true;
                    return;
                }
                next += 1;
                // The same steps as the applier's, so the snapshot holds what replicas hold.
                if let Ok(record) = Record::decode(&entry.record) {
                    let _ = apply_record(&mut index, &mut meta, &record);
                }
            })
            .map_err(|error| StateError::Fleet(Arc::new(error)))?;
        if gap {
            return Ok(None);
        }
        if next != self.to {
            return Err(StateError::Fleet(Arc::new(StreamError::Unexpected {
                url: self.config.url().to_owned(),
                what: format!("the stream ends before position {}", self.to),
            })));
        }
        Ok(Some((index, meta)))
    }

    fn run(self) -> Result<(u64, Base), StateError> {
        let started = Instant::now();
        let origin = PathBuf::from(format!("{}:snapshot", self.config.key));
        let engine = |error: StreamError| StateError::Fleet(Arc::new(error));
        let mut stream = self.config.connect().map_err(engine)?;
        // Twice: the lease holder may trim the stream past our base while we read it; the
        // second try builds on the snapshot it published.
        let mut built = None;
        for _ in 0..2 {
            let base = self.base_for(&mut stream).map_err(engine)?;
            if let Some(state) = self.replay(&mut stream, base.as_ref(), &origin)? {
                built = Some(state);
                break;
            }
        }
        let Some((index, meta)) = built else {
            return Err(StateError::Fleet(Arc::new(StreamError::Unexpected {
                url: self.config.url().to_owned(),
                what: format!("the stream was trimmed under the snapshot at {}", self.to),
            })));
        };
        let contents = snapshot::Contents {
            position: self.to,
            export: index.export(),
            meta,
        };
        drop(index);
        let bytes = snapshot::to_bytes(&contents);
        if let Some(dir) = &self.dir {
            write_local(dir, &self.to, &bytes)?;
        }
        let published = self.publish
            && stream
                .publish(&self.replica, &self.epoch, self.to, &bytes)
                .map_err(engine)?;
        crate::observe::snapshot_written(bytes.len() as u64, started.elapsed());
        info!(
            position = self.to,
            bytes = bytes.len(),
            published,
            took_ms = started.elapsed().as_millis() as u64,
            "snapshot of the shared log built"
        );
        Ok((
            self.generation,
            Base {
                position: self.to,
                bytes: Arc::new(bytes),
            },
        ))
    }
}
