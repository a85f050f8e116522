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
    pub(super) fn answer(self, result: Result<Applied, ChangeError>, stats: IndexStats) {
        match self {
            Waiter::Apply(reply) => {
                let _ = reply.send(result.and_then(Applied::answer).map(|_| stats));
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

/// The jobs waiting for their entries, by this replica's number for them.
pub(super) type Waiters = Arc<Mutex<HashMap<u64, Waiter>>>;
