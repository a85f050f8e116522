//! Shared by the state's integration tests: the state opened over an index cell of its own
//! ([`State`]), answering queries as a reader does (the index under its read lock, after the
//! replica's freshness check), and the REPORTs and REVOKEs the tests send.

#![allow(dead_code)] // each test binary uses its own part

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kv_index::{IndexStats, NodeMatch, PrefixAnswer};
use kv_indexer_proto::v1 as pb;
use kv_state::cell::IndexCell;
use kv_state::config::{FleetConfig, StateConfig};
use kv_state::error::{ChangeError, StateError};
use kv_state::fleet::Freshness;
use kv_state::stream::StreamConfig;
use kv_state::writer::Writer;
use kv_testkit::indexer::{HBM, REPORT, REVOKE, action, apply_request};
use kv_testkit::wait;

/// One server's or replica's state: its index cell, the writer every change goes through and,
/// for a replica, its freshness.
pub struct State {
    pub cell: IndexCell,
    pub writer: Writer,
    pub freshness: Option<Arc<Freshness>>,
}

impl State {
    /// Opens a state directory that snapshots only when asked ([`dir_settings`]).
    pub async fn open_dir(dir: &Path) -> State {
        State::open(dir_settings(dir)).await.unwrap()
    }

    /// Opens the state `settings` name over a new cell (on the blocking pool: recovery blocks).
    pub async fn open(settings: StateConfig) -> Result<State, StateError> {
        let cell = kv_state::cell::empty();
        let opening = cell.clone();
        let opened = tokio::task::spawn_blocking(move || kv_state::open::open(&opening, &settings))
            .await
            .expect("opening the state did not panic")?;
        Ok(State {
            cell,
            writer: opened.writer,
            freshness: opened.freshness,
        })
    }

    /// Applies what is queued, writes the final snapshot and stops (a replica: its applier
    /// too); the state directory is unlocked when this returns.
    pub async fn stop(self) {
        self.writer.stop().await.expect("the state stopped cleanly");
    }

    pub async fn apply(
        &self,
        request: pb::ApplyExternalKvBatchRequest,
    ) -> Result<IndexStats, ChangeError> {
        self.writer.apply(request).await
    }

    /// Whether queries may be answered now (a single server: always, once open).
    pub fn check(&self) -> Result<(), ChangeError> {
        self.freshness.as_ref().map_or(Ok(()), |f| f.check())
    }

    /// `MatchExternalKvPrefix` without a ceiling: refused unless fresh, then answered from
    /// the index under its read lock.
    pub fn prefix(&self, hashes: &[i64]) -> Result<PrefixAnswer, ChangeError> {
        self.check()?;
        Ok(self.cell.read().match_prefix(hashes, 0)?)
    }

    /// `MatchExternalKv` with `count_as_hit`: refused unless fresh, then logged and counted by
    /// the writer.
    pub async fn count_hits(&self, hashes: &[i64]) -> Result<Vec<NodeMatch>, ChangeError> {
        self.check()?;
        self.writer.count_hits(hashes.to_vec()).await
    }

    /// Every answer a router can get for `hashes` (prefix, exact, hit counts), and the digest,
    /// all from one read of the index.
    pub fn answers(&self, hashes: &[i64]) -> String {
        let index = self.cell.read();
        let answers = [
            format!("{:?}", index.match_prefix(hashes, 0)),
            format!("{:?}", index.match_kv(hashes)),
            format!("{:?}", index.hit_counts(hashes)),
        ];
        format!("{answers:?}\n{}", kv_state::digest::digest(index.export()))
    }

    pub fn digest(&self) -> String {
        kv_state::digest::digest(self.export())
    }

    /// How many of `hashes` the index says some worker holds, over every tier.
    pub fn held(&self, hashes: &[i64]) -> usize {
        let matches = self.cell.read().match_kv(hashes).unwrap();
        matches
            .iter()
            .flat_map(|node| node.hashes_by_tier.iter().map(|tier| tier.hashes.len()))
            .sum()
    }

    pub fn stats(&self) -> IndexStats {
        self.cell.read().stats()
    }

    pub fn export(&self) -> kv_index::Export {
        self.cell.read().export()
    }
}

/// A REPORT of `hashes` at HBM by `worker`.
pub fn report(worker: &str, hashes: &[i64]) -> pb::ApplyExternalKvBatchRequest {
    apply_request(worker, vec![action(REPORT, HBM, hashes)])
}

/// A REVOKE of `hashes` at HBM by `worker`.
pub fn revoke(worker: &str, hashes: &[i64]) -> pb::ApplyExternalKvBatchRequest {
    apply_request(worker, vec![action(REVOKE, HBM, hashes)])
}

/// `request` as batch `number` of a bridge of incarnation 7 (the sequence gate's numbering).
pub fn numbered(
    mut request: pb::ApplyExternalKvBatchRequest,
    number: u64,
) -> pb::ApplyExternalKvBatchRequest {
    request.bridge_incarnation = Some(7);
    request.bridge_batch = Some(number);
    request
}

/// Applies as a bridge does: retried while Redis is unreachable (its connection is gone
/// after the restart), answered with the first other outcome.
pub async fn apply_retrying(
    state: &State,
    request: pb::ApplyExternalKvBatchRequest,
) -> Result<(), ChangeError> {
    wait::until_ok("an answer other than UNAVAILABLE", || async {
        match state.apply(request.clone()).await {
            Err(
                error @ (ChangeError::SharedLog(_)
                | ChangeError::NotReady
                | ChangeError::LogReset
                | ChangeError::Unanswered { .. }),
            ) => Err(error),
            answer => Ok(answer.map(|_| ())),
        }
    })
    .await
}

/// A state directory, snapshots only when asked for.
pub fn dir_settings(dir: &Path) -> StateConfig {
    StateConfig {
        dir: Some(dir.to_path_buf()),
        snapshot_interval: None,
        ..Default::default()
    }
}

/// Asserts that `answer` is the sequence gate's ABORTED for batch `got` where `expected` was
/// due.
pub fn assert_gap(answer: &Result<(), ChangeError>, expected: u64, got: u64) {
    let gap = matches!(answer, Err(ChangeError::Gap { expected: e, got: g, .. }) if *e == expected && *g == got);
    assert!(gap, "not a gap at {expected} (got {got}): {answer:?}");
}

/// A replica on `stream` without a state directory or worker expiry, stale after 1 s, and
/// snapshots every `snapshot_every` (none: never).
pub fn replica_settings(stream: StreamConfig, snapshot_every: Option<Duration>) -> StateConfig {
    StateConfig {
        worker_ttl: None,
        snapshot_interval: snapshot_every,
        fleet: Some(FleetConfig {
            stream,
            max_lag: Duration::from_millis(1000),
        }),
        ..StateConfig::default()
    }
}

/// Opens `settings` and waits until the replica serves.
pub async fn serving(settings: StateConfig) -> State {
    let state = State::open(settings).await.unwrap();
    wait::until_ok("the replica serves", || async { state.check() }).await;
    state
}
