//! The appender: takes the service's jobs (the same `Writer` handle as a single server) and
//! appends each group to the shared stream in one round trip (a script that checks the
//! stream's epoch is the one the applier follows, or while it bootstraps the stream's current
//! one, then `XADD`s). It never touches the index: each job waits for the applier to reach its
//! entry. A Redis that cannot be reached, a stream without an epoch (no replica has joined
//! it), or another epoch answers UNAVAILABLE; the bridges queue and retry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use tokio::sync::mpsc;
use tracing::{error, warn};

use super::applier::Applier;
use super::waiters::{Waiter, Waiters};
use crate::clock::Clock;
use crate::error::{ChangeError, StateError};
use crate::record::Record;
use crate::stream::{Stream, StreamConfig, StreamError};
use crate::writer::{Job, next_group};

/// The thread that appends accepted changes to the stream.
pub(super) struct Appender {
    pub(super) config: StreamConfig,
    pub(super) replica: String,
    pub(super) stream: Option<Stream>,
    pub(super) next_number: u64,
    pub(super) waiters: Waiters,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) applier: Option<JoinHandle<Applier>>,
    /// The time each record carries.
    pub(super) clock: Clock,
}

impl Appender {
    pub(super) fn run(mut self, mut queue: mpsc::Receiver<Job>) {
        while let Some(group) = next_group(&mut queue) {
            let mut entries = Vec::with_capacity(group.len());
            for job in group {
                match job {
                    Job::Apply(apply) => {
                        let bytes = apply.bytes.expect("a logged apply has its bytes");
                        entries.push(self.wait_for(bytes, Waiter::Apply(apply.reply)));
                    }
                    Job::Record { change, reply } => {
                        let record = Record {
                            time_ms: self.clock.now_ms(),
                            change,
                        };
                        entries.push(self.wait_for(record.encode(), Waiter::Record(reply)));
                    }
                    // The applier holds the meta: it answers at its next read.
                    Job::Workers(reply) => self.waiters.ask_meta(reply),
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
        let confirmed = !self.config.waits_for_replicas();
        self.waiters.register(number, waiter, confirmed);
        (number, format!("{}:{number}", self.replica), record)
    }

    /// Appends a group in one round trip; on failure its jobs are answered UNAVAILABLE.
    fn append(&mut self, entries: Vec<(u64, String, Vec<u8>)>) {
        if entries.is_empty() {
            return;
        }
        let (numbers, records): (Vec<u64>, Vec<(String, Vec<u8>)>) =
            entries.into_iter().map(|(n, o, r)| (n, (o, r))).unzip();
        match self.append_to_history(&records) {
            Ok(true) => {
                if self.config.waits_for_replicas() {
                    self.waiters.confirm(&numbers);
                }
            }
            // No history yet: no replica has joined this log (the applier sets its epoch).
            Ok(false) => self.waiters.refuse(&numbers, || ChangeError::NotReady),
            Err(error) => {
                warn!(error = %kv_common::error_chain(&error), changes = numbers.len(), "cannot append to the shared log: refusing the changes (UNAVAILABLE)");
                crate::observe::event_log_append_failed();
                let error = Arc::new(error);
                self.waiters
                    .refuse(&numbers, || ChangeError::SharedLog(error.clone()));
            }
        }
    }

    /// Appends `records` to the history the applier follows (entries appended to another, in
    /// a Redis that lost the log, would never be read back), or while it bootstraps to the
    /// stream's current one; false when the stream has none yet.
    fn append_to_history(&mut self, records: &[(String, Vec<u8>)]) -> Result<bool, StreamError> {
        let mut stream = match self.stream.take() {
            Some(stream) => stream,
            None => self.config.connect()?,
        };
        let epoch = match self.waiters.followed() {
            Some(epoch) => epoch,
            None => match stream.current_epoch()? {
                Some(epoch) => epoch,
                None => {
                    self.stream = Some(stream);
                    return Ok(false);
                }
            },
        };
        stream.append(&epoch, records)?;
        self.stream = Some(stream);
        Ok(true)
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
