//! The jobs a replica accepted, each waiting under its own number until the applier reaches
//! its entry and answers it with what applying it did (read-your-writes).

use std::collections::HashMap;
use std::sync::Arc;

use kv_index::{IndexStats, NodeMatch};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::apply::Applied;
use crate::error::ChangeError;

/// A job waiting for its entry to be applied.
pub(super) enum Waiter {
    Apply(oneshot::Sender<Result<IndexStats, ChangeError>>),
    Hits(oneshot::Sender<Result<Vec<NodeMatch>, ChangeError>>),
}

impl Waiter {
    pub(super) fn answer(self, result: Result<Applied, ChangeError>) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(result.and_then(Applied::answer));
            }
            Waiter::Hits(reply) => {
                let _ = reply.send(result.map(|applied| match applied {
                    Applied::CountHits(matches) => matches,
                    _ => Vec::new(),
                }));
            }
        }
    }

    pub(super) fn refuse(self, error: ChangeError) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(Err(error));
            }
            Waiter::Hits(reply) => {
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
#[derive(Clone, Default)]
pub(super) struct Waiters(Arc<Mutex<HashMap<u64, Slot>>>);

impl Waiters {
    /// Registers `waiter` under `number`; `confirmed`: no confirmation to wait for.
    pub(super) fn register(&self, number: u64, waiter: Waiter, confirmed: bool) {
        let slot = Slot {
            waiter,
            confirmed,
            outcome: None,
        };
        self.0.lock().insert(number, slot);
    }

    /// The applier applied `number`'s entry: answers it, or keeps the outcome until confirmed.
    pub(super) fn applied(&self, number: u64, outcome: Outcome) {
        let mut slots = self.0.lock();
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
        let mut slots = self.0.lock();
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
        let mut slots = self.0.lock();
        for number in numbers {
            if let Some(slot) = slots.remove(number) {
                slot.waiter.refuse(error());
            }
        }
    }

    /// Refuses every waiting job.
    pub(super) fn refuse_all(&self, error: impl Fn() -> ChangeError) {
        let pending: Vec<Slot> = self.0.lock().drain().map(|(_, slot)| slot).collect();
        for slot in pending {
            slot.waiter.refuse(error());
        }
    }
}
