//! The jobs a replica accepted, each waiting under its own number until the applier reaches
//! its entry and answers it with what applying it did (read-your-writes).

use std::collections::HashMap;
use std::sync::Arc;

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

/// A job, and what its entry did once applied if it may not be answered yet.
struct Slot {
    waiter: Waiter,
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
/// Beside them wait the asks for the workers' meta, which the applier holds.
#[derive(Clone, Default)]
pub(super) struct Waiters {
    slots: Arc<Mutex<HashMap<u64, Slot>>>,
    meta_asks: Arc<Mutex<Vec<oneshot::Sender<Meta>>>>,
}

impl Waiters {
    /// Registers `waiter` under `number`; `confirmed`: no confirmation to wait for.
    pub(super) fn register(&self, number: u64, waiter: Waiter, confirmed: bool) {
        let slot = Slot {
            waiter,
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
        let pending: Vec<Slot> = self.slots.lock().drain().map(|(_, slot)| slot).collect();
        for slot in pending {
            slot.waiter.refuse(error());
        }
    }
}
