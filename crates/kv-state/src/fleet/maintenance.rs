//! A replica's upkeep, run by its applier about every second: it checks that the log still
//! explains the index (the epoch, the tail), measures the lag, takes or gives up the fleet's
//! maintenance lease, and under it expires silent workers (an `ExpireUnseen` record, so every
//! replica expires alike); it starts snapshot builds (published by the lease holder, which
//! trims the stream below them) and writes the last local snapshot at shutdown.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::{info, warn};

use super::applier::{Applier, Restart};
use super::build::{Build, write_local};
use crate::config::sweep_interval;
use crate::error::StateError;
use crate::meta::due_for_expiry;
use crate::record::{Change, Record};
use crate::snapshot;

impl Applier {
    /// Checks that the log still explains the index, measures the lag, holds the lease and
    /// runs what the lease holder runs.
    pub(super) fn upkeep(&mut self) -> Result<(), Restart> {
        let stream = self.stream.as_mut().expect("connected");
        let epoch = stream.current_epoch()?;
        if epoch != self.epoch {
            return Err(Restart::Rebootstrap(format!(
                "the stream's epoch is {epoch:?}, not {:?}: Redis lost the log",
                self.epoch
            )));
        }
        let bounds = stream.bounds()?;
        let tail = bounds.map_or(0, |(_, last)| last + 1);
        // Entries after this replica's position trimmed away (it was cut off across a
        // publication): found here, before a snapshot is built on a base the stream no longer
        // follows, rather than by the next read.
        if let Some((first, _)) = bounds
            && first > self.next
        {
            return Err(Restart::Rebootstrap(format!(
                "the stream starts at position {first}, after this replica's {}: entries were trimmed before this replica applied them",
                self.next
            )));
        }
        if tail < self.next {
            self.note_rollback(tail);
            return Err(Restart::Rebootstrap(format!(
                "the stream ends at position {tail}, before this replica's {}: Redis lost entries",
                self.next
            )));
        }
        self.freshness
            .behind
            .store(tail - self.next, Ordering::Relaxed);
        // The lag in time is the server's to export (its health watch, every 100 ms).
        crate::observe::fleet_lag_entries(tail - self.next);
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
        self.clear_lost()?;
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
        let every = sweep_interval(ttl);
        // A grace of one TTL after this replica became ready: after the whole fleet was
        // down, bridges get the time to send again before their workers look silent.
        let at = self.clock.now();
        let since = |then: Instant| at.saturating_duration_since(then);
        if since(self.last_sweep) < every || since(self.ready_since) < ttl {
            return Ok(());
        }
        self.last_sweep = at;
        let now = self.clock.now_ms();
        let expired = due_for_expiry(&self.meta, ttl, now, at, &mut self.expiry_guard);
        if expired.is_empty() {
            return Ok(());
        }
        self.append_expiry(now, expired)
    }

    /// Appends the clear of `workers` unless seen after the time each comes with (an
    /// `ExpireUnseen` record, decided in log order on every replica alike).
    fn append_expiry(&mut self, now: u64, workers: Vec<(String, u64)>) -> Result<(), Restart> {
        let record = Record {
            time_ms: now,
            change: Change::ExpireUnseen(workers),
        };
        self.expiries += 1;
        let origin = format!("{}:x{}", self.replica, self.expiries);
        let epoch = self.epoch.as_deref().expect("bootstrapped");
        let stream = self.stream.as_mut().expect("connected");
        stream.append(epoch, &[(origin, record.encode())])?;
        Ok(())
    }

    /// Once caught up again after a rolled-back log: clears the workers it lost entries of.
    /// Every replica that found the rollback appends its clear; the record's condition makes
    /// all but the first a no-op for a worker whose bridge has applied since (a re-sync), so
    /// no replica has to be the one (a lease holder may itself be the one that was lost).
    fn clear_lost(&mut self) -> Result<(), Restart> {
        let Some(rollback) = &self.rollback else {
            return Ok(());
        };
        let lost = rollback.lost_workers(&self.meta);
        let entries = rollback.entries_lost();
        if !lost.is_empty() {
            self.append_expiry(self.clock.now_ms(), lost.clone())?;
        }
        crate::observe::fleet_entries_lost(entries);
        let names: Vec<&str> = lost.iter().map(|(id, _)| id.as_str()).collect();
        warn!(
            entries_lost = entries,
            workers = ?names,
            "the shared log lost entries this replica had applied: cleared their workers through the log, their bridges re-sync"
        );
        self.rollback = None;
        Ok(())
    }

    /// Waits for a snapshot being built and removes its file: begun before the log stopped
    /// explaining the index, it may hold entries of the lost history (it reads the stream as
    /// it is now from a base of the old one), and the bootstrap that follows must not load it.
    pub(super) fn discard_build(&mut self) {
        let Some(building) = self.building.take() else {
            return;
        };
        if let Ok(Ok(stale)) = building.join() {
            self.remove_local_snapshot(stale.position);
        }
    }

    /// Removes this replica's local snapshot at `position` of the epoch it follows, if any.
    fn remove_local_snapshot(&self, position: u64) {
        if let Some(dir) = self.epoch.as_deref().and_then(|e| self.snapshot_dir(e)) {
            let _ = std::fs::remove_file(snapshot::path(&dir, position));
        }
    }

    /// Starts a background snapshot when one is due, and takes a finished one.
    fn maybe_snapshot(&mut self) {
        if let Some(building) = self.building.take() {
            if !building.is_finished() {
                self.building = Some(building);
                return;
            }
            match building.join() {
                Ok(Ok(base)) => self.base = Some(base),
                Ok(Err(error)) => crate::observe::snapshot_failed(Some(&error)),
                Err(_) => crate::observe::snapshot_failed(None),
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
            dir: self.epoch.as_deref().and_then(|e| self.snapshot_dir(e)),
            publish: self.lease,
        };
        let spawned = snapshot::spawn_builder(move || job.build());
        match spawned {
            Ok(handle) => self.building = Some(handle),
            Err(error) => warn!(%error, "cannot start the snapshot thread"),
        }
    }

    /// At shutdown: a local snapshot of the index as applied (nothing changes it any more).
    pub(super) fn final_snapshot(&mut self) -> Result<(), StateError> {
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
        let bytes = snapshot::to_bytes(self.next, &self.index.published(), &self.meta);
        write_local(&dir, &self.next, &bytes)
    }
}
