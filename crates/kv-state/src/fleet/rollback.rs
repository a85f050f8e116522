//! A rolled-back shared log: Redis came back without entries this replica had applied (a
//! failover to a lagging Redis replica, a restore from an older save). What the replica knew
//! before tells which workers those entries were for: their placements may describe a past
//! the worker has left, so they are cleared through the log (`maintenance`), and their
//! bridges re-sync at their next numbered apply (the sequence gate).

use crate::meta::Meta;

/// What the replica knew when it found the log rolled back.
#[derive(Debug)]
pub(super) struct Rollback {
    /// The workers' meta it had reached.
    meta: Meta,
    /// The position it had reached, and the first one the log no longer agrees with.
    next: u64,
    lost_from: u64,
}

impl Rollback {
    pub(super) fn new(meta: &Meta, next: u64, lost_from: u64) -> Rollback {
        Rollback {
            meta: meta.clone(),
            next,
            lost_from,
        }
    }

    /// Entries this replica had applied that the log lost (at least).
    pub(super) fn entries_lost(&self) -> u64 {
        self.next.saturating_sub(self.lost_from)
    }

    /// The workers whose newest applied entry the log lost, judged against `now` (the meta the
    /// log gives once replayed again): its last-seen time or its bridge batch went backwards.
    /// Each comes with its last-seen time in `now`, the condition of an `ExpireUnseen` record:
    /// a worker whose bridge has applied since is kept, so that every replica may append the
    /// same clear and only the first does anything.
    pub(super) fn lost_workers(&self, now: &Meta) -> Vec<(String, u64)> {
        let mut lost: Vec<(String, u64)> = self
            .meta
            .iter()
            .filter(|(_, before)| !before.expired)
            .filter_map(|(id, before)| {
                let after = now.get(id).filter(|after| !after.expired)?;
                let went_back = after.last_seen_ms < before.last_seen_ms
                    || (after.incarnation, after.batch) < (before.incarnation, before.batch);
                went_back.then(|| (id.clone(), after.last_seen_ms))
            })
            .collect();
        lost.sort();
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::WorkerMeta;

    fn meta(workers: &[(&str, u64, u64, u64)]) -> Meta {
        workers
            .iter()
            .map(|&(id, incarnation, batch, last_seen_ms)| {
                let meta = WorkerMeta {
                    incarnation,
                    batch,
                    last_seen_ms,
                    expired: false,
                };
                (id.to_owned(), meta)
            })
            .collect()
    }

    #[test]
    fn the_workers_whose_newest_entries_were_lost_are_named() {
        let before = meta(&[
            ("a", 7, 9, 900),
            ("b", 7, 4, 400),
            ("c", 0, 0, 800),
            ("d", 1, 1, 5),
        ]);
        // a lost batches 5-9, b lost nothing, c (unnumbered) lost its last apply, d is gone
        // from the log entirely (it holds nothing there: nothing to clear).
        let now = meta(&[("a", 7, 4, 400), ("b", 7, 4, 400), ("c", 0, 0, 600)]);
        let rollback = Rollback::new(&before, 120, 100);
        assert_eq!(
            rollback.lost_workers(&now),
            vec![("a".to_owned(), 400), ("c".to_owned(), 600)]
        );
        assert_eq!(rollback.entries_lost(), 20);
    }
}
