//! A replica's start (and restart): it loads its newest local snapshot when the stream still
//! holds every entry after it, else the snapshot another replica published, else starts empty
//! at position 0 (only when the stream still starts there), and is NOT_SERVING until it has
//! applied the stream's tail as of its start.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kv_index::Index;
use tracing::{info, warn};

use super::applier::{Applier, Restart};
use super::build::Base;
use crate::meta::Meta;
use crate::snapshot;
use crate::stream::{Stream, StreamConfig, StreamError};

impl Applier {
    /// Loads the newest usable snapshot and sets the position to replay from.
    pub(super) fn bootstrap(&mut self) -> Result<(), Restart> {
        // A build of the history left behind was waited for and its file removed first.
        debug_assert!(
            self.building.is_none(),
            "a snapshot build outlived its history"
        );
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
                None => return Err(Restart::Redis(stream_gone(&self.config))),
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
                (contents.index, contents.meta, contents.position)
            }
        };
        let stats = index.stats();
        // Both copies replaced (the old ones dropped once their readers are done). No fresh
        // TTLs here (unlike a single server): the workers' last-seen times come from the log
        // and must stay equal on every replica, since expiry records are applied against them.
        let old = self.index.replace(index);
        drop(old);
        self.meta = meta;
        self.next = position;
        self.last_origin = None;
        self.ready_at = Some(bounds.map_or(0, |(_, last)| last + 1));
        self.epoch = Some(epoch.clone());
        self.waiters.follow(Some(epoch.clone()));
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
    pub(super) fn snapshot_dir(&self, epoch: &str) -> Option<PathBuf> {
        Some(self.dir.as_ref()?.path().join(format!("fleet-{epoch}")))
    }
}

fn stream_gone(config: &StreamConfig) -> StreamError {
    StreamError::Unexpected {
        url: config.url().to_owned(),
        what: "the published snapshot was replaced while it was read".into(),
    }
}
