//! The writer: one thread that turns accepted changes into log records and applies them to the
//! index in log order.
//!
//! Jobs come over a bounded channel. The writer takes what is queued as one group: it checks
//! each apply against the worker's newest bridge incarnation (fencing), encodes the accepted
//! ones, appends the whole group with one write, makes it as durable as the sync policy says,
//! then applies each record to the index (the write lock per record, so queries interleave)
//! and answers. With no state directory the same path runs without a log.
//!
//! Sync policies (`KV_INDEXER_LOG_SYNC`): `always` answers after an fdatasync that covers the
//! record (the records that arrived meanwhile share it); `batch` answers after the write (the
//! record survives a crash of the process) and a syncer thread runs fdatasync within
//! [`crate::durable::BATCH_SYNC_BOUND`] of it (a machine crash loses at most that much); `off` never syncs
//! between snapshots.

use std::sync::Arc;
use std::time::Duration;

use kv_index::{IndexStats, NodeMatch, ValidApply};
use kv_indexer_proto::convert;
use kv_indexer_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};

use crate::apply::Applied;
use crate::cell::IndexWriter;
use crate::clock::Clock;
use crate::durable::{Durable, WriteState};
use crate::error::{ChangeError, StateError};
use crate::meta::{Gate, Meta};
use crate::record::{Change, Record};
use thread::Thread;

mod thread;

/// Jobs queued for the writer before senders wait.
const QUEUE: usize = 4096;
/// Jobs taken as one group at most.
const GROUP: usize = 512;

/// What the server sends the writer.
pub(crate) enum Job {
    Apply(PendingApply),
    /// A change other than an apply (a hit count, a drop), answered with what applying it did.
    Record {
        change: Change,
        reply: oneshot::Sender<Result<Applied, ChangeError>>,
    },
    /// The workers' meta as the index has it now.
    Workers(oneshot::Sender<Meta>),
    Sweep,
    Snapshot,
    /// A snapshot, answered when it is written (for tests and tools).
    SnapshotWait(oneshot::Sender<Result<u64, StateError>>),
    Stop(oneshot::Sender<Result<(), StateError>>),
}

/// The handle the service sends changes through; cheap to clone.
#[derive(Clone, Debug)]
pub struct Writer {
    jobs: mpsc::Sender<Job>,
    /// Whether changes are logged (a state directory).
    logged: bool,
    /// Whether the state directory takes changes (always, without one).
    status: tokio::sync::watch::Receiver<WriteState>,
    /// The time each apply's record carries.
    clock: Clock,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Job::Apply { .. } => "Apply",
            Job::Record { .. } => "Record",
            Job::Workers(_) => "Workers",
            Job::Sweep => "Sweep",
            Job::Snapshot => "Snapshot",
            Job::SnapshotWait(_) => "SnapshotWait",
            Job::Stop(_) => "Stop",
        })
    }
}

impl Writer {
    /// Starts the writer thread over `index`; `durable` is the state directory and
    /// its log (none: in memory), `meta` the workers' fencing and liveness state, `worker_ttl`
    /// the silence after which a worker is expired, by `clock`.
    pub fn start(
        index: IndexWriter,
        durable: Option<Durable>,
        meta: Meta,
        worker_ttl: Option<Duration>,
        clock: Clock,
    ) -> std::io::Result<Writer> {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let logged = durable.is_some();
        let status = match &durable {
            Some(durable) => durable.status.subscribe(),
            None => tokio::sync::watch::channel(WriteState::Writable).1,
        };
        let thread = Thread::new(index, meta, durable, worker_ttl, clock.clone());
        std::thread::Builder::new()
            .name("kv-indexer-writer".into())
            .spawn(move || thread.run(queue))?;
        Ok(Writer {
            jobs,
            logged,
            status,
            clock,
        })
    }

    /// A writer whose jobs `run` takes from the queue on a thread of its own (a fleet's
    /// appender); changes are logged, with their time by `clock`.
    pub(crate) fn start_with(
        name: &str,
        clock: Clock,
        run: impl FnOnce(mpsc::Receiver<Job>) + Send + 'static,
    ) -> std::io::Result<Writer> {
        let (jobs, queue) = mpsc::channel(QUEUE);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(queue))?;
        let status = tokio::sync::watch::channel(WriteState::Writable).1;
        Ok(Writer {
            jobs,
            logged: true,
            status,
            clock,
        })
    }

    /// Whether the state directory takes changes now.
    pub fn write_state(&self) -> WriteState {
        self.status.borrow().clone()
    }

    /// Waits until a write or a sync of the state failed for good ([`WriteState::Failed`]):
    /// the server should stop, so that a restart recovers from the log. Never, without one.
    pub async fn failed(&self) -> Arc<StateError> {
        let mut status = self.status.clone();
        loop {
            if let WriteState::Failed(error) = &*status.borrow_and_update() {
                return error.clone();
            }
            if status.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Validates, logs and applies an apply; answers once it is in the index. The record is
    /// encoded here, on the caller's thread, from the request as it came.
    pub async fn apply(
        &self,
        request: pb::ApplyExternalKvBatchRequest,
    ) -> Result<IndexStats, ChangeError> {
        let time_ms = self.clock.now_ms();
        let (incarnation, batch) = (request.bridge_incarnation, request.bridge_batch);
        let bytes = self.logged.then(|| Record::encode_apply(time_ms, &request));
        let valid = convert::apply_request(request).validate()?;
        let (reply, answer) = oneshot::channel();
        self.send(Job::Apply(PendingApply {
            bytes,
            incarnation,
            batch,
            gate: Gate::Next,
            time_ms,
            valid,
            reply,
        }))
        .await?;
        answer.await.map_err(|_| ChangeError::WriterGone)?
    }

    /// Logs and counts a hit-counting match, answering the match.
    pub async fn count_hits(&self, hashes: Vec<i64>) -> Result<Vec<NodeMatch>, ChangeError> {
        match self.record(Change::CountHits(hashes)).await? {
            Applied::CountHits(matches) => Ok(matches),
            _ => Ok(Vec::new()),
        }
    }

    /// Logs and applies the drop of `worker`'s placements (an operator's, like a TTL expiry:
    /// every replica and every replay agrees); answers the placements it held then.
    pub async fn drop_worker(&self, worker: String) -> Result<usize, ChangeError> {
        match self.record(Change::Expire(vec![worker])).await? {
            Applied::Expire { placements } => Ok(placements),
            _ => Ok(0),
        }
    }

    /// The workers' fencing and liveness meta, as of the index answered from now (a replica's
    /// at its next read of the log, within [`crate::stream::READ_BLOCK`]).
    pub async fn workers(&self) -> Result<Meta, ChangeError> {
        let (reply, answer) = oneshot::channel();
        self.send(Job::Workers(reply)).await?;
        answer.await.map_err(|_| ChangeError::WriterGone)
    }

    async fn record(&self, change: Change) -> Result<Applied, ChangeError> {
        let (reply, answer) = oneshot::channel();
        self.send(Job::Record { change, reply }).await?;
        answer.await.map_err(|_| ChangeError::WriterGone)?
    }

    /// Asks for a liveness sweep (dropped when the writer is busy: the next tick retries).
    pub fn sweep(&self) {
        let _ = self.jobs.try_send(Job::Sweep);
    }

    /// Asks for a snapshot in the background (dropped when the writer is busy).
    pub fn snapshot(&self) {
        let _ = self.jobs.try_send(Job::Snapshot);
    }

    /// Snapshots now (built in the background like a periodic one) and answers with its
    /// position once written: the state a crash from now on recovers from.
    pub async fn snapshot_and_wait(&self) -> Result<u64, ChangeError> {
        let (reply, done) = oneshot::channel();
        self.send(Job::SnapshotWait(reply)).await?;
        done.await
            .map_err(|_| ChangeError::WriterGone)?
            .map_err(|error| ChangeError::LogUnwritable(Arc::new(error)))
    }

    /// Applies what is queued, writes the final snapshot and stops the writer.
    pub async fn stop(&self) -> Result<(), StateError> {
        let (reply, done) = oneshot::channel();
        if self.jobs.send(Job::Stop(reply)).await.is_err() {
            return Ok(());
        }
        done.await.unwrap_or(Ok(()))
    }

    async fn send(&self, job: Job) -> Result<(), ChangeError> {
        self.jobs
            .send(job)
            .await
            .map_err(|_| ChangeError::WriterGone)
    }
}

/// Waits for a job and takes it with what is queued behind it (at most [`GROUP`]); none once
/// every sender is gone.
pub(crate) fn next_group(queue: &mut mpsc::Receiver<Job>) -> Option<Vec<Job>> {
    let mut group = vec![queue.blocking_recv()?];
    while group.len() < GROUP {
        match queue.try_recv() {
            Ok(job) => group.push(job),
            Err(_) => break,
        }
    }
    Some(group)
}

/// An apply on its way to the log: validated, with its record encoded by the caller.
pub(crate) struct PendingApply {
    /// The record's bytes (none without a log).
    pub(crate) bytes: Option<Vec<u8>>,
    pub(crate) valid: ValidApply,
    pub(crate) incarnation: Option<u64>,
    /// Its bridge batch number (the `bridge_batch` extension), when sent.
    pub(crate) batch: Option<u64>,
    /// What the sequence gate made of it, when the writer accepted it.
    pub(crate) gate: Gate,
    pub(crate) time_ms: u64,
    pub(crate) reply: oneshot::Sender<Result<IndexStats, ChangeError>>,
}
