//! The jobs a replica accepted, each waiting under its own number until the applier reaches
//! its entry and answers it with what applying it did (read-your-writes), or until
//! [`ANSWER_BOUND`] passes; and the epoch of the history the applier follows, which the
//! appender's appends must match (none while it bootstraps).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_index::IndexStats;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::apply::Applied;
use crate::error::ChangeError;
use crate::meta::Meta;

/// A job waiting for its entry to be applied.
pub(super) enum Waiter {
    Apply(oneshot::Sender<Result<IndexStats, ChangeError>>),
    /// Another change (a hit count, a drop): answered with what applying it did.
    Record(oneshot::Sender<Result<Applied, ChangeError>>),
}

impl Waiter {
    pub(super) fn answer(self, result: Result<Applied, ChangeError>) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(result.and_then(Applied::answer));
            }
            Waiter::Record(reply) => {
                let _ = reply.send(result);
            }
        }
    }

    pub(super) fn refuse(self, error: ChangeError) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(Err(error));
            }
            Waiter::Record(reply) => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

/// What applying a job's entry did, or that it was lost (it did not decode).
pub(super) enum Outcome {
    Applied(Result<Applied, ChangeError>),
    Lost,
}

/// How long a job waits for the applier to read its entry back before it is refused
/// (UNAVAILABLE, so the caller retries; for a bridge's numbered apply the sequence gate makes
/// the retry a duplicate if the entry is applied after all; a retried hit count or drop is
/// applied again, as after any deadline the caller gave up on). An entry can be lost after
/// its append was answered: written to a primary that then failed before its replicas held
/// it (without `KV_INDEXER_EVENT_LOG_MIN_REPLICAS`), it is never read. Longer than the
/// bridge's own call deadline (10 s), so that in a deployment this only frees what callers
/// gave up on.
pub(super) const ANSWER_BOUND: Duration = Duration::from_secs(15);

/// A job, and what its entry did once applied if it may not be answered yet.
struct Slot {
    waiter: Waiter,
    /// When it was registered.
    since: Instant,
    /// The append is as durable as asked (`KV_INDEXER_EVENT_LOG_MIN_REPLICAS`): answer when
    /// applied.
    confirmed: bool,
    outcome: Option<Outcome>,
}

impl Slot {
    fn answer(self, outcome: Outcome) {
        match outcome {
            Outcome::Applied(result) => self.waiter.answer(result),
            Outcome::Lost => self.waiter.refuse(ChangeError::LogReset),
        }
    }
}

/// The jobs waiting for their entries, by this replica's number for them. A job is answered
/// once its entry is applied and its append confirmed (with `MIN_REPLICAS` the applier may
/// read an entry before its Redis replicas hold it: the answer then waits for the appender).
///
/// Beside them wait the asks for the workers' meta, which the applier holds, and the epoch it
/// follows.
#[derive(Clone, Default)]
pub(super) struct Waiters {
    /// In number order, which is the order of registration.
    slots: Arc<Mutex<BTreeMap<u64, Slot>>>,
    meta_asks: Arc<Mutex<Vec<oneshot::Sender<Meta>>>>,
    epoch: Arc<Mutex<Option<String>>>,
}

impl Waiters {
    /// Registers `waiter` under `number`; `confirmed`: no confirmation to wait for.
    pub(super) fn register(&self, number: u64, waiter: Waiter, confirmed: bool) {
        let slot = Slot {
            waiter,
            since: Instant::now(),
            confirmed,
            outcome: None,
        };
        self.slots.lock().insert(number, slot);
    }

    /// The applier applied `number`'s entry: answers it, or keeps the outcome until confirmed.
    pub(super) fn applied(&self, number: u64, outcome: Outcome) {
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(&number) else {
            return;
        };
        if slot.confirmed {
            let slot = slots.remove(&number).expect("found above");
            slot.answer(outcome);
        } else {
            slot.outcome = Some(outcome);
        }
    }

    /// The appender's appends of `numbers` are as durable as asked: answers those applied.
    pub(super) fn confirm(&self, numbers: &[u64]) {
        let mut slots = self.slots.lock();
        for number in numbers {
            let Some(slot) = slots.get_mut(number) else {
                continue;
            };
            match slot.outcome.take() {
                Some(outcome) => slots.remove(number).expect("found above").answer(outcome),
                None => slot.confirmed = true,
            }
        }
    }

    /// Refuses the jobs `numbers` (applied or not: the caller retries, the gate sees a
    /// duplicate).
    pub(super) fn refuse(&self, numbers: &[u64], error: impl Fn() -> ChangeError) {
        let mut slots = self.slots.lock();
        for number in numbers {
            if let Some(slot) = slots.remove(number) {
                slot.waiter.refuse(error());
            }
        }
    }

    /// Refuses the jobs waiting longer than `bound` ([`ChangeError::Unanswered`]); how many.
    pub(super) fn expire(&self, bound: Duration) -> usize {
        let mut expired = Vec::new();
        {
            let mut slots = self.slots.lock();
            while let Some(entry) = slots.first_entry() {
                if entry.get().since.elapsed() < bound {
                    break;
                }
                expired.push(entry.remove());
            }
        }
        let waited_s = bound.as_secs();
        let count = expired.len();
        for slot in expired {
            slot.waiter.refuse(ChangeError::Unanswered { waited_s });
        }
        count
    }

    /// The applier follows the history `epoch` now (none: it is bootstrapping).
    pub(super) fn follow(&self, epoch: Option<String>) {
        *self.epoch.lock() = epoch;
    }

    /// The epoch of the history the applier follows (none: it is bootstrapping).
    pub(super) fn followed(&self) -> Option<String> {
        self.epoch.lock().clone()
    }

    /// Asks the applier for the workers' meta (answered at its next read of the log).
    pub(super) fn ask_meta(&self, reply: oneshot::Sender<Meta>) {
        self.meta_asks.lock().push(reply);
    }

    /// Answers every ask for the meta with `meta`.
    pub(super) fn answer_meta_asks(&self, meta: &Meta) {
        let asks = std::mem::take(&mut *self.meta_asks.lock());
        for reply in asks {
            let _ = reply.send(meta.clone());
        }
    }

    /// Refuses every waiting job.
    pub(super) fn refuse_all(&self, error: impl Fn() -> ChangeError) {
        let pending = std::mem::take(&mut *self.slots.lock());
        for slot in pending.into_values() {
            slot.waiter.refuse(error());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(waiters: &Waiters, number: u64) -> oneshot::Receiver<Result<Applied, ChangeError>> {
        let (reply, answer) = oneshot::channel();
        waiters.register(number, Waiter::Record(reply), true);
        answer
    }

    #[test]
    fn a_job_waits_until_applied_or_refused_past_the_bound() {
        let waiters = Waiters::default();
        let mut first = waiting(&waiters, 1);
        let mut second = waiting(&waiters, 2);
        assert_eq!(waiters.expire(Duration::from_secs(60)), 0);
        assert!(first.try_recv().is_err(), "still waiting");
        std::thread::sleep(Duration::from_millis(60));
        let mut third = waiting(&waiters, 3);
        // The two older than the bound are refused, the newer one still waits.
        assert_eq!(waiters.expire(Duration::from_millis(30)), 2);
        for answer in [&mut first, &mut second] {
            assert!(matches!(
                answer.try_recv(),
                Ok(Err(ChangeError::Unanswered { .. }))
            ));
        }
        assert!(third.try_recv().is_err(), "still waiting");
        waiters.applied(3, Outcome::Lost);
        assert!(matches!(third.try_recv(), Ok(Err(ChangeError::LogReset))));
        assert_eq!(waiters.expire(Duration::ZERO), 0, "nothing left");
    }
}
