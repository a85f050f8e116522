//! The engine's scheduling loop: the single owner of the [`Cache`] and the [`Publisher`].
//!
//! Requests reach it as commands on a bounded channel. One step takes every command waiting
//! (up to [`MAX_STEP_COMMANDS`]), applies them to the cache in order, publishes their events
//! as one batch, and only then answers: so the order of the published events is the order of
//! the cache's changes, and whatever a caller learns from an answer is already published.

use std::collections::{BTreeMap, BTreeSet};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::cache::{Cache, CacheError, CacheStats, CachedPrefix, Lease};
use crate::events::{Event, Medium};
use crate::publisher::Publisher;

/// Commands applied in one step at most.
pub const MAX_STEP_COMMANDS: usize = 256;

/// Commands waiting for the loop.
const QUEUE: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the scheduler has stopped")]
pub struct Stopped;

#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    #[error(transparent)]
    Busy(#[from] CacheError),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// A request's place in the cache while it runs.
#[derive(Debug)]
pub struct Admitted {
    pub lease: Lease,
    /// Prompt pages found in the cache (device or host).
    pub cached_pages: usize,
}

/// The cache as the scheduler sees it after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub held: BTreeMap<Medium, BTreeSet<i64>>,
    pub stats: CacheStats,
}

enum Command {
    Admit {
        hashes: Vec<i64>,
        tokens: Vec<u64>,
        reply: oneshot::Sender<Admitted>,
    },
    Release(Lease),
    Flush(oneshot::Sender<Result<(), CacheError>>),
    Snapshot(oneshot::Sender<Snapshot>),
    Prefix {
        hashes: Vec<i64>,
        reply: oneshot::Sender<CachedPrefix>,
    },
}

/// Sends commands to the loop; cheap to clone.
#[derive(Debug, Clone)]
pub struct SchedulerHandle {
    commands: mpsc::Sender<Command>,
}

impl SchedulerHandle {
    /// Starts a request on the prompt pages `hashes` (`tokens` holding at least their tokens).
    pub async fn admit(&self, hashes: Vec<i64>, tokens: Vec<u64>) -> Result<Admitted, Stopped> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Admit {
            hashes,
            tokens,
            reply,
        })
        .await?;
        answer.await.map_err(|_| Stopped)
    }

    /// Ends a request.
    pub async fn release(&self, lease: Lease) -> Result<(), Stopped> {
        self.send(Command::Release(lease)).await
    }

    /// Clears the cache (and publishes `AllBlocksCleared`), unless requests are running.
    pub async fn flush(&self) -> Result<(), FlushError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Flush(reply)).await?;
        Ok(answer.await.map_err(|_| Stopped)??)
    }

    /// What the cache holds per tier, as published so far.
    pub async fn snapshot(&self) -> Result<Snapshot, Stopped> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Snapshot(reply)).await?;
        answer.await.map_err(|_| Stopped)
    }

    /// How much of the chained `hashes` the cache holds now, per tier (nothing changes).
    pub async fn prefix(&self, hashes: Vec<i64>) -> Result<CachedPrefix, Stopped> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Prefix { hashes, reply }).await?;
        answer.await.map_err(|_| Stopped)
    }

    async fn send(&self, command: Command) -> Result<(), Stopped> {
        self.commands.send(command).await.map_err(|_| Stopped)
    }
}

/// An answer held back until the step's batch is published.
enum Answer {
    Admitted(oneshot::Sender<Admitted>, Admitted),
    Flushed(
        oneshot::Sender<Result<(), CacheError>>,
        Result<(), CacheError>,
    ),
    Snapshot(oneshot::Sender<Snapshot>),
}

pub struct Scheduler {
    cache: Cache,
    publisher: Publisher,
    commands: mpsc::Receiver<Command>,
}

impl Scheduler {
    pub fn new(cache: Cache, publisher: Publisher) -> (Scheduler, SchedulerHandle) {
        let (sender, commands) = mpsc::channel(QUEUE);
        let scheduler = Scheduler {
            cache,
            publisher,
            commands,
        };
        (scheduler, SchedulerHandle { commands: sender })
    }

    /// Runs steps until `stop` is cancelled or every handle is gone.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut events = Vec::new();
        let mut answers = Vec::new();
        loop {
            let first = tokio::select! {
                () = stop.cancelled() => return,
                command = self.commands.recv() => match command {
                    Some(command) => command,
                    None => return,
                },
            };
            self.apply(first, &mut events, &mut answers);
            for _ in 1..MAX_STEP_COMMANDS {
                let Ok(command) = self.commands.try_recv() else {
                    break;
                };
                self.apply(command, &mut events, &mut answers);
            }
            if let Err(error) = self.publisher.publish(&events).await {
                warn!(%error, events = events.len(), "publishing a batch failed");
            }
            events.clear();
            for answer in answers.drain(..) {
                self.answer(answer);
            }
        }
    }

    fn apply(&mut self, command: Command, events: &mut Vec<Event>, answers: &mut Vec<Answer>) {
        match command {
            Command::Admit {
                hashes,
                tokens,
                reply,
            } => {
                let admission = self.cache.admit(&hashes, &tokens);
                let admitted = Admitted {
                    cached_pages: admission.cached_pages(),
                    lease: admission.lease,
                };
                events.extend(admission.events);
                answers.push(Answer::Admitted(reply, admitted));
            }
            Command::Release(lease) => self.cache.release(lease),
            Command::Flush(reply) => {
                let result = self.cache.flush().map(|cleared| events.extend(cleared));
                answers.push(Answer::Flushed(reply, result));
            }
            Command::Snapshot(reply) => answers.push(Answer::Snapshot(reply)),
            Command::Prefix { hashes, reply } => {
                let _ = reply.send(self.cache.prefix(&hashes));
            }
        }
    }

    fn answer(&mut self, answer: Answer) {
        match answer {
            Answer::Admitted(reply, admitted) => {
                // A request that went away before its answer must not pin its pages forever.
                if let Err(admitted) = reply.send(admitted) {
                    self.cache.release(admitted.lease);
                }
            }
            Answer::Flushed(reply, result) => {
                let _ = reply.send(result);
            }
            // Read after the step: the state the published batches describe.
            Answer::Snapshot(reply) => {
                let _ = reply.send(Snapshot {
                    held: self.cache.held(),
                    stats: self.cache.stats(),
                });
            }
        }
    }
}
