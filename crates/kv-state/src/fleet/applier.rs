//! The applier: reads the shared stream (`XREAD BLOCK` from its position: no consumer group,
//! every replica needs every entry) and applies every entry in order, fencing in log order so
//! that every replica decides alike, and answers the jobs this replica appended. Before it
//! applies what a read brought (and once a second when idle) it reads the last entry applied
//! again, to notice a log that lost entries and refilled their positions; the blocking read
//! itself starts past it, so that an idle replica waits in Redis. Its bootstrap and its upkeep are `bootstrap` and `maintenance`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use super::build::Base;
use super::freshness::Freshness;
use super::rollback::Rollback;
use super::waiters::{ANSWER_BOUND, Outcome, Waiters};
use crate::apply::apply_record;
use crate::cell::{Changing, IndexWriter};
use crate::clock::{Clock, now_ms};
use crate::dir::StateDir;
use crate::error::{ChangeError, StateError};
use crate::meta::{ExpiryGuard, Meta};
use crate::record::Record;
use crate::stream::{Entry, READ_BLOCK, Stream, StreamConfig, StreamError};

/// Entries one read takes at most.
const READ_COUNT: usize = 1024;
/// The longest wait between attempts to reach Redis: a Redis back from a restart is
/// found within this.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How often the applier checks the log's identity and the lease.
const UPKEEP: Duration = Duration::from_secs(1);

/// The thread that applies the stream.
pub(super) struct Applier {
    pub(super) config: StreamConfig,
    pub(super) replica: String,
    pub(super) index: IndexWriter,
    pub(super) meta: Meta,
    /// The next position to apply.
    pub(super) next: u64,
    /// Ready once `next` reaches this (the tail as of the bootstrap); none: not bootstrapped.
    pub(super) ready_at: Option<u64>,
    /// The origin of the entry last applied (at `next - 1`), checked before each new entry.
    pub(super) last_origin: Option<String>,
    /// When this replica last became ready.
    pub(super) ready_since: Instant,
    /// Expiry records this replica appended (their origins are `<replica>:x<n>`).
    pub(super) expiries: u64,
    pub(super) epoch: Option<String>,
    pub(super) stream: Option<Stream>,
    pub(super) waiters: Waiters,
    pub(super) freshness: Arc<Freshness>,
    pub(super) dir: Option<StateDir>,
    pub(super) worker_ttl: Option<Duration>,
    /// What worker TTLs, the sweep's schedule and its grace are measured on.
    pub(super) clock: Clock,
    pub(super) snapshot_interval: Option<Duration>,
    pub(super) base: Option<Base>,
    /// A snapshot being built, of the history the replica follows (a bootstrap waits for it
    /// and removes its file first: [`Applier::discard_build`]).
    pub(super) building: Option<JoinHandle<Result<Base, StateError>>>,
    pub(super) last_snapshot: Instant,
    pub(super) last_upkeep: Option<Instant>,
    /// When the entry last applied was last read again (none: at the next read).
    pub(super) last_overlap_check: Option<Instant>,
    pub(super) last_sweep: Instant,
    pub(super) lease: bool,
    pub(super) expiry_guard: ExpiryGuard,
    /// Entries that did not decode or apply (every replica skips the same ones).
    pub(super) skipped: u64,
    /// The applier's loops that refused unanswered changes: logged at the 1st, 2nd, 4th, ….
    pub(super) unanswered_log: kv_common::DoublingLog,
    /// What it knew when it last found the log rolled back, until its workers are cleared.
    pub(super) rollback: Option<Rollback>,
    pub(super) stop: Arc<AtomicBool>,
}

/// Why the applier starts over.
pub(super) enum Restart {
    /// Redis failed; retry from the same position.
    Redis(StreamError),
    /// The log no longer explains the index: bootstrap again.
    Rebootstrap(String),
}

impl From<StreamError> for Restart {
    fn from(error: StreamError) -> Restart {
        Restart::Redis(error)
    }
}

impl Applier {
    pub(super) fn run(mut self) -> Applier {
        let mut backoff = Duration::from_millis(50);
        // Since when Redis has been unreachable, and how many attempts have failed.
        let mut outage: Option<(Instant, u64)> = None;
        while !self.stop.load(Ordering::Acquire) {
            let unanswered = self.waiters.expire(ANSWER_BOUND);
            if unanswered > 0 {
                crate::observe::event_log_changes_unanswered(unanswered);
                if let Some(times) = self.unanswered_log.record() {
                    warn!(
                        changes = unanswered,
                        times,
                        bound_s = ANSWER_BOUND.as_secs(),
                        "changes this replica appended were not read back from the shared log in time (lost by Redis?): refused (UNAVAILABLE), the callers retry"
                    );
                }
            }
            match self.step() {
                Ok(()) => {
                    backoff = Duration::from_millis(50);
                    if let Some((since, attempts)) = outage.take() {
                        info!(
                            outage_ms = since.elapsed().as_millis() as u64,
                            attempts, "the shared log is reachable again"
                        );
                    }
                }
                Err(Restart::Redis(error)) => {
                    self.stream = None;
                    self.lease = false;
                    let (_, attempts) = outage.get_or_insert((Instant::now(), 0));
                    *attempts += 1;
                    // Retried every 250 ms at most: logged at the 1st, 2nd, 4th, … failure.
                    if attempts.is_power_of_two() {
                        let answering = if self.freshness.check().is_ok() {
                            "answering from memory until the lag passes KV_INDEXER_MAX_LAG_MS, then refusing queries"
                        } else {
                            "refusing queries (not caught up, or past the lag bound)"
                        };
                        warn!(error = %kv_common::error_chain(&error), lag_ms = self.freshness.lag_ms(), attempts = *attempts, "the shared log is unreachable: {answering} until it returns");
                    }
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
                    // Before the epoch is forgotten: the build's file is under it.
                    self.discard_build();
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    crate::observe::fleet_rebootstraps();
                    self.freshness.ready.store(false, Ordering::Release);
                    self.ready_at = None;
                    self.epoch = None;
                    self.waiters.follow(None);
                    self.base = None;
                    self.waiters.refuse_all(|| ChangeError::LogReset);
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
            self.last_overlap_check = None;
        }
        if self.ready_at.is_none() {
            self.bootstrap()?;
        }
        if self.last_upkeep.is_none_or(|at| at.elapsed() >= UPKEEP) {
            self.upkeep()?;
            self.last_upkeep = Some(Instant::now());
        }
        let stream = self.stream.as_mut().expect("connected above");
        // Blocks in Redis until an entry past the last one applied exists (an idle
        // replica costs one read per READ_BLOCK). The entry last applied is checked apart.
        let entries = stream.read_from(self.next, READ_COUNT, Some(READ_BLOCK))?;
        let read_at = now_ms();
        self.waiters.answer_meta_asks(&self.meta);
        // Before applying anything new, and once an upkeep when idle: the last entry applied
        // must still be there, with the same origin, or the log lost it (a failover without
        // persistence) and others refilled the position.
        if !entries.is_empty()
            || self
                .last_overlap_check
                .is_none_or(|at| at.elapsed() >= UPKEEP)
        {
            self.check_last_applied()?;
        }
        let count = entries.len();
        let mut entries = entries;
        // The entries in order from `next`; a jump means entries were trimmed before this
        // replica applied them.
        let jump = (0..count).find(|&i| entries[i].position != self.next + i as u64);
        let after_jump = jump.map(|i| entries.split_off(i));
        self.apply_all(entries);
        if let Some(first) = after_jump.as_ref().and_then(|rest| rest.first()) {
            return Err(Restart::Rebootstrap(format!(
                "the stream jumps from position {} to {}: entries were trimmed before this replica applied them",
                self.next, first.position
            )));
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
            self.ready_since = self.clock.now();
            let stats = self.index.published().stats();
            info!(
                position = self.next,
                placements = stats.placements,
                workers = stats.workers,
                "caught up with the shared log: serving"
            );
        }
        Ok(())
    }

    /// Reads the entry at `next - 1` again: a rollback when another replica's entry took its
    /// place (one the log lost entirely is the upkeep's, which compares the stream's tail).
    fn check_last_applied(&mut self) -> Result<(), Restart> {
        self.last_overlap_check = Some(Instant::now());
        let (Some(origin), Some(last)) = (&self.last_origin, self.next.checked_sub(1)) else {
            return Ok(());
        };
        let stream = self.stream.as_mut().expect("connected");
        let seen = stream.read_from(last, 1, None)?;
        match seen.first() {
            Some(entry) if entry.position == last && entry.origin != *origin => {
                let now = entry.origin.clone();
                let was = origin.clone();
                self.note_rollback(last);
                Err(Restart::Rebootstrap(format!(
                    "the entry at position {last} is now {now}'s, not {was}'s: Redis lost entries and others took their places"
                )))
            }
            _ => Ok(()),
        }
    }

    /// Applies the entries read, in order, to this replica's copy of the index, publishes them
    /// together, then answers the jobs this replica appended among them (an answered apply is
    /// in its index). A panic inside aborts, see [`crate::cell::AbortOnPanic`].
    fn apply_all(&mut self, entries: Vec<Entry>) {
        let mut entries = entries.into_iter().peekable();
        while entries.peek().is_some() {
            self.apply_some(&mut entries);
        }
    }

    /// Applies entries from `entries` for a slice ([`crate::cell::IndexWriter::slice`], at least
    /// one), publishes them and answers them.
    fn apply_some(&mut self, entries: &mut impl Iterator<Item = Entry>) {
        let mut answers = Vec::new();
        let mut skipped = Vec::new();
        let mut retired = Vec::new();
        let mut index = self.index.change();
        for entry in entries.by_ref() {
            let waiter = entry
                .origin
                .strip_prefix(self.replica.as_str())
                .and_then(|rest| rest.strip_prefix(':'))
                .and_then(|number| number.parse::<u64>().ok());
            let (outcome, skip, replaced) = apply_entry(&mut index, &mut self.meta, &entry);
            answers.extend(waiter.map(|number| (number, outcome)));
            self.next = entry.position + 1;
            self.last_origin = Some(entry.origin.clone());
            skipped.extend(skip.map(|why| (entry, why)));
            retired.extend(replaced);
            if index.slice_spent() {
                break;
            }
        }
        let stats = index.stats();
        self.index.publish();
        crate::observe::index_size(stats, crate::meta::live_workers(&self.meta));
        for (entry, why) in skipped {
            self.skip(&entry, &why);
        }
        for (number, outcome) in answers {
            self.waiters.applied(number, outcome);
        }
        // A replaced block table is let go after the answers (the other copy frees it when it
        // catches up: freeing a large one takes a while).
        drop(retired);
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

    /// Notes what this replica knew before the log lost entries from `lost_from` on (the
    /// first finding counts, until its workers are cleared), and drops its local snapshots:
    /// they may hold entries of the lost history (the epoch is the same), so the bootstrap
    /// that follows must not load one (the published snapshot came back with the log).
    pub(super) fn note_rollback(&mut self, lost_from: u64) {
        if self.rollback.is_none() {
            self.rollback = Some(Rollback::new(&self.meta, self.next, lost_from));
        }
        if let Some(dir) = self
            .epoch
            .as_deref()
            .and_then(|epoch| self.snapshot_dir(epoch))
            && let Err(error) = std::fs::remove_dir_all(&dir)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            warn!(%error, dir = %dir.display(), "cannot drop the local snapshots of a rolled-back log");
        }
    }
}

/// Applies one entry to the replica's copy: what its job is answered, why it is skipped (if
/// it is: every replica skips it alike), and the block table it replaced, if any.
fn apply_entry(
    index: &mut Changing<'_>,
    meta: &mut Meta,
    entry: &Entry,
) -> (Outcome, Option<String>, Option<kv_index::SpareTable>) {
    let record = match Record::decode(&entry.record) {
        Ok(record) => record,
        Err(error) => {
            return (
                Outcome::Lost,
                Some(format!("does not decode: {error}")),
                None,
            );
        }
    };
    let replaced = index.make_room(record.reported_blocks());
    let applied = apply_record(index, meta, &record);
    let skip = match &applied {
        Ok(applied) => {
            applied.note_live();
            None
        }
        // Fenced alike on every replica: a zombie bridge, not a bad entry.
        Err(ChangeError::Fenced { .. }) => None,
        Err(error) => Some(error.to_string()),
    };
    (Outcome::Applied(applied), skip, replaced)
}
