//! The bounded queue between the event stream and the sender.
//!
//! While the Indexer is unreachable, batches wait here and are delivered in order when it
//! returns. When the queue is full it is dropped whole and replaced by one `Clear`: the index
//! then under-claims until new events arrive, and never claims blocks the worker has dropped.

use std::collections::VecDeque;

use kv_events::Action;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// What the sender must deliver, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// One event batch, as the RPCs it splits into.
    Batch { seq: u64, rpcs: Vec<Vec<Action>> },
    /// Revoke everything the worker holds at its clear tiers: events were lost.
    Clear { reason: ClearReason },
}

/// Why the worker is cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    /// Start-up: the index may hold what the worker dropped while nothing followed it.
    Startup,
    /// The subscriber lost its publisher: it may have restarted, or messages were lost.
    Reconnect,
    /// A gap that replay could not fill.
    Gap,
    /// The publisher restarted (its sequence went backwards).
    Restart,
    /// The queue overflowed while the Indexer was away.
    Overflow,
    /// The Indexer lost batches it had acknowledged (a rolled-back log or state directory)
    /// and cleared the worker (it answered ABORTED).
    IndexLost,
    /// An event that may have removed blocks could not be read (or came from a hybrid vLLM
    /// model's second KV-cache group, which is not indexed).
    Unreadable,
}

impl ClearReason {
    pub const ALL: [ClearReason; 7] = [
        ClearReason::Startup,
        ClearReason::Reconnect,
        ClearReason::Gap,
        ClearReason::Restart,
        ClearReason::Overflow,
        ClearReason::IndexLost,
        ClearReason::Unreadable,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ClearReason::Startup => "startup",
            ClearReason::Reconnect => "reconnect",
            ClearReason::Gap => "gap",
            ClearReason::Restart => "restart",
            ClearReason::Overflow => "overflow",
            ClearReason::IndexLost => "index_lost",
            ClearReason::Unreadable => "unreadable_event",
        }
    }
}

#[derive(Debug)]
pub struct Outbox {
    queue: Mutex<VecDeque<Item>>,
    capacity: usize,
    ready: Notify,
}

impl Outbox {
    pub fn new(capacity: usize) -> Outbox {
        Outbox {
            queue: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
            ready: Notify::new(),
        }
    }

    /// Queues an item; returns the number of items dropped by an overflow (0 if none).
    pub fn push(&self, item: Item) -> usize {
        let dropped = {
            let mut queue = self.queue.lock();
            let dropped = if queue.len() >= self.capacity {
                let dropped = queue.len();
                queue.clear();
                queue.push_back(Item::Clear {
                    reason: ClearReason::Overflow,
                });
                dropped
            } else {
                0
            };
            queue.push_back(item);
            dropped
        };
        self.ready.notify_one();
        dropped
    }

    /// Takes the oldest item, waiting for one.
    pub async fn pop(&self) -> Item {
        loop {
            let notified = self.ready.notified();
            if let Some(item) = self.queue.lock().pop_front() {
                return item;
            }
            notified.await;
        }
    }

    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seq: u64) -> Item {
        Item::Batch {
            seq,
            rpcs: Vec::new(),
        }
    }

    #[tokio::test]
    async fn delivers_in_order() {
        let outbox = Outbox::new(10);
        for seq in 0..5 {
            assert_eq!(outbox.push(batch(seq)), 0);
        }
        for seq in 0..5 {
            assert_eq!(outbox.pop().await, batch(seq));
        }
        assert!(outbox.is_empty());
    }

    #[tokio::test]
    async fn an_overflow_drops_the_queue_and_clears_first() {
        let outbox = Outbox::new(3);
        for seq in 0..3 {
            outbox.push(batch(seq));
        }
        assert_eq!(outbox.push(batch(3)), 3);
        assert_eq!(
            outbox.pop().await,
            Item::Clear {
                reason: ClearReason::Overflow
            }
        );
        assert_eq!(outbox.pop().await, batch(3));
        assert!(outbox.is_empty());
    }

    #[tokio::test]
    async fn pop_waits_for_a_push() {
        let outbox = std::sync::Arc::new(Outbox::new(3));
        let popper = tokio::spawn({
            let outbox = outbox.clone();
            async move { outbox.pop().await }
        });
        tokio::task::yield_now().await;
        outbox.push(batch(9));
        assert_eq!(popper.await.unwrap(), batch(9));
    }
}
