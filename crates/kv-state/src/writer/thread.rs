//! The writer's thread: takes the queued jobs as groups, fences and logs them, applies them to
//! the index in log order, answers, and runs the sweeps and snapshots it is sent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_index::IndexStats;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use super::{Job, PendingApply, next_group};
use crate::apply::{Applied, apply_admitted, apply_record};
use crate::cell::{Changing, IndexWriter};
use crate::clock::Clock;
use crate::config::SnapshotMethod;
use crate::durable::{Building, Durable, WriteState, build_snapshot, prune, write_snapshot};
use crate::error::{ChangeError, StateError};
use crate::meta::{ExpiryGuard, Gate, Meta, WorkerMeta, admit, due_for_expiry};
use crate::record::{Change, Record};
use crate::snapshot::TableImage;

/// A change accepted for the log, waiting for the group's append.
enum Accepted {
    Apply(PendingApply),
    /// A batch applied before: not logged again, answered (with the sizes then) once what was
    /// accepted before it is published, or refused with its group.
    Duplicate(oneshot::Sender<Result<IndexStats, ChangeError>>),
    Other {
        record: Record,
        reply: Option<oneshot::Sender<Result<Applied, ChangeError>>>,
    },
}

pub(super) struct Thread {
    index: IndexWriter,
    meta: Meta,
    durable: Option<Durable>,
    /// A worker with no apply for this long is expired (`None`: never).
    worker_ttl: Option<Duration>,
    /// What the sweep and the records' times read.
    clock: Clock,
    expiry_guard: ExpiryGuard,
    /// Each worker's meta as it was before an apply admitted since the last commit, in order:
    /// restored when the group is refused, so that a bridge's retry of a refused batch is
    /// judged as it was the first time (not taken for a duplicate).
    admitted: Vec<(String, Option<WorkerMeta>)>,
}

impl Thread {
    pub(super) fn new(
        index: IndexWriter,
        meta: Meta,
        durable: Option<Durable>,
        worker_ttl: Option<Duration>,
        clock: Clock,
    ) -> Thread {
        Thread {
            index,
            meta,
            durable,
            worker_ttl,
            clock,
            expiry_guard: ExpiryGuard::default(),
            admitted: Vec::new(),
        }
    }

    pub(super) fn run(mut self, mut queue: mpsc::Receiver<Job>) {
        while let Some(group) = next_group(&mut queue) {
            if !self.run_group(group) {
                return;
            }
        }
        if let Err(error) = self.finish() {
            error!(error = %kv_common::error_chain(&error), "the final snapshot failed");
        }
    }

    /// Runs one group; false once stopped.
    fn run_group(&mut self, group: Vec<Job>) -> bool {
        let mut accepted = Vec::new();
        for job in group {
            match job {
                Job::Apply(apply) => accepted.extend(self.accept_apply(apply)),
                Job::Record { change, reply } => accepted.push(Accepted::Other {
                    record: Record {
                        time_ms: self.clock.now_ms(),
                        change,
                    },
                    reply: Some(reply),
                }),
                Job::Workers(reply) => {
                    self.commit(std::mem::take(&mut accepted));
                    let _ = reply.send(self.meta.clone());
                }
                Job::Sweep => {
                    self.commit(std::mem::take(&mut accepted));
                    self.sweep();
                }
                Job::Snapshot => {
                    self.commit(std::mem::take(&mut accepted));
                    self.start_snapshot();
                }
                Job::SnapshotWait(reply) => {
                    self.commit(std::mem::take(&mut accepted));
                    let _ = reply.send(self.snapshot_and_wait());
                }
                Job::Stop(reply) => {
                    self.commit(std::mem::take(&mut accepted));
                    let finished = self.finish();
                    // Unlock the state directory before answering: whoever waited for the
                    // stop may start the next server on it at once.
                    self.durable = None;
                    let _ = reply.send(finished);
                    return false;
                }
            }
        }
        self.commit(accepted);
        true
    }

    /// Fences an apply; an accepted one raises the worker's incarnation at once, so that an
    /// older bridge's apply later in the same group is fenced too.
    fn accept_apply(&mut self, mut apply: PendingApply) -> Option<Accepted> {
        let worker = apply.valid.worker_id();
        let before = self.meta.get(worker).copied();
        self.admitted.push((worker.to_owned(), before));
        match admit(&mut self.meta, worker, apply.incarnation, apply.batch) {
            Err(error) => {
                let _ = apply.reply.send(Err(error));
                None
            }
            // Applied before: never logged twice, answered in order with the group (an earlier
            // copy of it may be in this very group, not yet published).
            Ok(Gate::Duplicate) => Some(Accepted::Duplicate(apply.reply)),
            Ok(gate) => {
                apply.gate = gate;
                Some(Accepted::Apply(apply))
            }
        }
    }

    /// Appends the accepted changes as one group, then applies and answers each in order.
    fn commit(&mut self, accepted: Vec<Accepted>) {
        let admitted = std::mem::take(&mut self.admitted);
        if accepted.is_empty() {
            return;
        }
        let mut accepted = accepted;
        if let Err(refused) = self.append(&mut accepted) {
            for (worker, before) in admitted.into_iter().rev() {
                match before {
                    Some(before) => self.meta.insert(worker, before),
                    None => self.meta.remove(&worker),
                };
            }
            for change in accepted {
                change.refuse(refused.refusal().expect("a refusal"));
            }
            return;
        }
        self.apply_all(accepted);
    }

    /// Appends the group to the log; why not, when the log cannot be written. A full disk is
    /// retried by the next group (the failed one was cut from the log); any other failure
    /// refuses every later change.
    fn append(&mut self, accepted: &mut [Accepted]) -> Result<(), WriteState> {
        let Some(durable) = &mut self.durable else {
            return Ok(());
        };
        let was = durable.status.borrow().clone();
        if let WriteState::Failed(_) = was {
            return Err(was);
        }
        let mut records: Vec<Vec<u8>> = Vec::with_capacity(accepted.len());
        for change in accepted.iter_mut() {
            records.push(match change {
                Accepted::Apply(apply) => apply.bytes.take().expect("a logged apply has its bytes"),
                Accepted::Other { record, .. } => record.encode(),
                Accepted::Duplicate(_) => continue,
            });
        }
        if records.is_empty() {
            return Ok(());
        }
        let now = match durable.append(&records) {
            Ok(()) => WriteState::Writable,
            Err(error) if error.is_disk_full() => WriteState::DiskFull(Arc::new(error)),
            Err(error) => WriteState::Failed(Arc::new(error)),
        };
        note_write_state(&was, &now, durable.dir.path());
        durable.status.send_replace(now.clone());
        match now {
            WriteState::Writable => Ok(()),
            refused => Err(refused),
        }
    }

    /// Applies logged changes, in order, to the writer's copy of the index, publishes them
    /// together, then answers each (so an answered change is seen by every later query). A
    /// panic inside aborts, see [`crate::cell::AbortOnPanic`].
    fn apply_all(&mut self, changes: Vec<Accepted>) {
        let mut changes = changes.into_iter().peekable();
        while changes.peek().is_some() {
            self.apply_some(&mut changes);
        }
    }

    /// Applies changes from `changes` for a slice ([`crate::cell::IndexWriter::slice`], at least
    /// one), publishes them and answers them: a long group is seen, and answered, in slices.
    fn apply_some(&mut self, changes: &mut impl Iterator<Item = Accepted>) {
        let mut answers = Vec::new();
        let mut retired = Vec::new();
        let mut index = self.index.change();
        for change in changes.by_ref() {
            if let Accepted::Apply(apply) = &change {
                retired.extend(index.make_room(apply.valid.reported_blocks()));
            }
            answers.push(apply_change(&mut index, &mut self.meta, change));
            if index.slice_spent() {
                break;
            }
        }
        let stats = index.stats();
        self.index.publish();
        crate::observe::index_size(stats, crate::meta::live_workers(&self.meta));
        for answer in answers {
            answer.send();
        }
        // A replaced block table is let go after the answers (the other copy frees it when it
        // catches up: freeing a large one takes a while).
        drop(retired);
    }

    /// Expires the workers whose TTL ran out, unless that would be every live worker.
    fn sweep(&mut self) {
        let Some(ttl) = self.worker_ttl else {
            return;
        };
        let now = self.clock.now_ms();
        let expired: Vec<String> = due_for_expiry(
            &self.meta,
            ttl,
            now,
            self.clock.now(),
            &mut self.expiry_guard,
        )
        .into_iter()
        .map(|(worker, _)| worker)
        .collect();
        if expired.is_empty() {
            return;
        }
        self.commit(vec![Accepted::Other {
            record: Record {
                time_ms: now,
                change: Change::Expire(expired),
            },
            reply: None,
        }]);
    }

    /// Rotates the log and writes a snapshot at the rotation point in the background: the live
    /// index as a forked child sees it ([`crate::fork`]), or, when no child can be made, one
    /// built from the previous snapshot and the closed segments.
    fn start_snapshot(&mut self) {
        let Some(durable) = &mut self.durable else {
            return;
        };
        if let Some(building) = durable.building.take() {
            if !building.thread.is_finished() {
                if let Some(child) = &building.child {
                    child.stop_if_hung(crate::durable::SNAPSHOT_WATCHDOG);
                }
                durable.building = Some(building);
                return;
            }
            durable.note_built(building);
        }
        let writable = matches!(*durable.status.borrow(), WriteState::Writable);
        if durable.log.end() == durable.snapshot_position || !writable {
            return;
        }
        if let Err(error) = durable.rotate() {
            let reason = kv_common::error_chain(&error);
            if error.is_disk_full() {
                // Retried at the next snapshot; the log goes on in its segment meanwhile.
                warn!(%reason, "cannot rotate the log for a snapshot: the disk is full");
            } else {
                error!(%reason, "cannot rotate the log for a snapshot: refusing changes and stopping");
                durable
                    .status
                    .send_replace(WriteState::Failed(Arc::new(error)));
            }
            return;
        }
        let (dir, from, to) = (
            durable.dir.path().to_path_buf(),
            durable.snapshot_position,
            durable.log.end(),
        );
        // Every record up to `to` is applied: the writer commits a group before this.
        let image = match durable.method {
            SnapshotMethod::Fork => Some(TableImage::Fresh),
            SnapshotMethod::ForkShared => Some(TableImage::Own),
            SnapshotMethod::Rebuild => None,
        };
        let child = image.and_then(|image| {
            let spare = self.index.spare_table_memory();
            crate::fork::spawn(&dir, to, &self.index.published(), spare, &self.meta, image)
                .inspect_err(|error| {
                    warn!(%error, "cannot fork the snapshot process: building it from the log")
                })
                .ok()
        });
        let stopper = child.as_ref().map(crate::fork::Child::stopper);
        let spawned = match child {
            // The snapshot thread, not the writer, deletes what the snapshot covers.
            Some(child) => crate::snapshot::spawn_builder(move || {
                let built = child.wait()?;
                prune(&dir, to);
                Ok(built)
            }),
            None => crate::snapshot::spawn_builder(move || build_snapshot(&dir, from, to)),
        };
        match spawned {
            Ok(thread) => {
                durable.building = Some(Building {
                    thread,
                    child: stopper,
                })
            }
            Err(error) => {
                // A child with no waiter: stopped, and reaped by nobody until exit (rare).
                stopper.inspect(crate::fork::Stopper::stop);
                warn!(%error, "cannot start the snapshot thread");
            }
        }
    }

    fn snapshot_and_wait(&mut self) -> Result<u64, StateError> {
        self.start_snapshot();
        let Some(durable) = &mut self.durable else {
            return Ok(0);
        };
        if let Some(building) = durable.building.take() {
            let built = building.thread.join().map_err(|_| {
                StateError::Thread(std::io::Error::other("the snapshot thread panicked"))
            })??;
            durable.retire(&built);
        }
        Ok(durable.snapshot_position)
    }

    /// At shutdown: stops or waits for a snapshot in progress, then snapshots the live state
    /// (nothing changes it any more) and trims the log below it.
    fn finish(&mut self) -> Result<(), StateError> {
        let Some(durable) = &mut self.durable else {
            return Ok(());
        };
        durable.stop_building();
        if let WriteState::Failed(error) = &*durable.status.borrow() {
            // What the failed write or sync left is for recovery from the log to judge.
            let reason = kv_common::error_chain(error.as_ref());
            warn!(%reason, "no final snapshot: the state could not be written");
            return Ok(());
        }
        durable.log.sync()?;
        let position = durable.log.end();
        if position == durable.snapshot_position {
            return Ok(());
        }
        let start = Instant::now();
        let built = write_snapshot(
            durable.dir.path(),
            position,
            &self.index.published(),
            &self.meta,
            start,
        )?;
        durable.rotate()?;
        durable.retire(&built);
        crate::durable::prune(durable.dir.path(), position);
        Ok(())
    }
}

/// Logs and exports a change of the state directory's [`WriteState`].
fn note_write_state(was: &WriteState, now: &WriteState, dir: &std::path::Path) {
    let dir = dir.display();
    match (was, now) {
        (WriteState::DiskFull(_), WriteState::Writable) => {
            tracing::info!(%dir, "the state directory takes writes again: applies resumed");
        }
        (WriteState::Writable, WriteState::DiskFull(error)) => {
            let reason = kv_common::error_chain(error.as_ref());
            error!(%dir, %reason, "the state directory's disk is full: refusing applies (each new one retries the write), answering queries");
        }
        (_, WriteState::Failed(error)) => {
            let reason = kv_common::error_chain(error.as_ref());
            error!(%dir, %reason, "the log cannot be written: refusing changes and stopping, so that a restart recovers from the log");
        }
        _ => {}
    }
    crate::observe::state_unwritable(!matches!(now, WriteState::Writable));
}

/// A change applied, with its caller's answer.
enum Answer {
    Apply(
        oneshot::Sender<Result<IndexStats, ChangeError>>,
        Result<IndexStats, ChangeError>,
    ),
    Other(
        Option<oneshot::Sender<Result<Applied, ChangeError>>>,
        Result<Applied, ChangeError>,
    ),
}

impl Answer {
    fn send(self) {
        match self {
            Answer::Apply(reply, result) => {
                let _ = reply.send(result);
            }
            Answer::Other(Some(reply), result) => {
                let _ = reply.send(result);
            }
            Answer::Other(None, _) => {}
        }
    }
}

/// Applies one logged change to `index` and `meta`; its answer is sent once it is published.
fn apply_change(index: &mut Changing<'_>, meta: &mut Meta, change: Accepted) -> Answer {
    match change {
        Accepted::Apply(PendingApply {
            valid,
            gate,
            time_ms,
            reply,
            ..
        }) => {
            let applied = apply_admitted(index, meta, &valid, gate, time_ms);
            if let Ok(applied) = &applied {
                applied.note_live();
            }
            Answer::Apply(reply, applied.and_then(Applied::answer))
        }
        Accepted::Duplicate(reply) => Answer::Apply(reply, Ok(index.stats())),
        Accepted::Other { record, reply } => {
            Answer::Other(reply, apply_record(index, meta, &record))
        }
    }
}

impl Accepted {
    fn refuse(self, error: ChangeError) {
        match self {
            Accepted::Apply(apply) => {
                let _ = apply.reply.send(Err(error));
            }
            Accepted::Duplicate(reply) => {
                let _ = reply.send(Err(error));
            }
            Accepted::Other {
                reply: Some(reply), ..
            } => {
                let _ = reply.send(Err(error));
            }
            Accepted::Other { reply: None, .. } => {}
        }
    }
}
