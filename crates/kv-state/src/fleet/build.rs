//! A replica's snapshot, built in the background from the previous one and the stream's entries
//! (never from the live index), written to the state directory and, by the lease holder,
//! published; the stream is trimmed only below a published snapshot.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kv_index::Index;
use tracing::info;

use crate::apply::apply_record;
use crate::error::StateError;
use crate::log::StateFileError;
use crate::meta::Meta;
use crate::record::Record;
use crate::snapshot;
use crate::stream::{Stream, StreamConfig, StreamError};

/// A snapshot the applier holds as the base of the next one.
#[derive(Clone)]
pub(super) struct Base {
    pub(super) position: u64,
    pub(super) bytes: Arc<Vec<u8>>,
}

/// Writes a local snapshot and deletes the older ones beside it.
pub(super) fn write_local(
    dir: &std::path::Path,
    position: &u64,
    bytes: &[u8],
) -> Result<(), StateError> {
    std::fs::create_dir_all(dir).map_err(|source| {
        StateError::Log(StateFileError::Io {
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
pub(super) struct Build {
    pub(super) config: StreamConfig,
    pub(super) replica: String,
    pub(super) epoch: String,
    pub(super) base: Option<Base>,
    pub(super) to: u64,
    pub(super) dir: Option<PathBuf>,
    pub(super) publish: bool,
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
                (contents.index, contents.meta, contents.position)
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

    /// Builds it.
    pub(super) fn build(self) -> Result<Base, StateError> {
        let started = Instant::now();
        let origin = PathBuf::from(format!("{}:snapshot", self.config.key));
        let fleet_error = |error: StreamError| StateError::Fleet(Arc::new(error));
        let mut stream = self.config.connect().map_err(fleet_error)?;
        // Twice: the lease holder may trim the stream past our base while we read it; the
        // second try builds on the snapshot it published.
        let mut built = None;
        for _ in 0..2 {
            let base = self.base_for(&mut stream).map_err(fleet_error)?;
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
        let bytes = snapshot::to_bytes(self.to, &index, &meta);
        drop(index);
        if let Some(dir) = &self.dir {
            write_local(dir, &self.to, &bytes)?;
        }
        let published = self.publish
            && stream
                .publish(&self.replica, &self.epoch, self.to, &bytes)
                .map_err(fleet_error)?;
        crate::observe::snapshot_written(bytes.len() as u64, started.elapsed());
        info!(
            position = self.to,
            bytes = bytes.len(),
            published,
            took_ms = started.elapsed().as_millis() as u64,
            "snapshot of the shared log built"
        );
        Ok(Base {
            position: self.to,
            bytes: Arc::new(bytes),
        })
    }
}
