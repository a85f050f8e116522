//! The bridge's loop: follows the worker's stream, checks its sequence, fetches what was lost
//! from the replay endpoint (or clears the worker), and hands the applies to the sender.

use std::collections::VecDeque;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use kv_events::SkipReason;
use kv_events::frames::parse_live;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use zeromq::{SocketEvent, SocketRecv};

use crate::config::BridgeConfig;
use crate::error::BridgeError;
use crate::outbox::{ClearReason, Item, Outbox};
use crate::replay::Replayed;
use crate::sender::Sender;
use crate::sequence::{SeqCheck, SeqTracker};
use crate::stats::{self, Stats};
use crate::subscriber::{Monitor, Subscription};
use crate::{batch, replay, subscriber};

/// Replayed batches remembered to tell a duplicate live batch from a publisher restart.
const REMEMBERED_REPLAYS: usize = 100_000;

/// A stream quiet this long after a message is checked once against the replay endpoint for
/// batches published after the last one seen: a lost *last* batch shows no gap until the next
/// message, and meanwhile the index would keep the blocks it removed.
pub const QUIET_PROBE_AFTER: Duration = Duration::from_secs(1);

/// Runs the bridge until `stop` is cancelled or a permanent error. Logs the configuration's
/// warnings and registers the metrics first ([`stats::register`]).
pub async fn run(
    config: BridgeConfig,
    stats: Arc<Stats>,
    stop: CancellationToken,
) -> Result<(), BridgeError> {
    for warning in config.warnings() {
        warn!("{warning}");
    }
    stats::register(config.queue_batches);
    let outbox = Arc::new(Outbox::new(config.queue_batches));
    let resync = Arc::new(Notify::new());
    let sender = Sender::new(&config, outbox.clone(), stats.clone(), resync.clone())?;
    let sender_stop = stop.child_token();
    let mut sender_task = tokio::spawn(sender.run(sender_stop.clone()));
    let mut stream = Stream {
        config,
        outbox,
        stats,
        tracker: SeqTracker::default(),
        replayed: VecDeque::new(),
        resync,
        hybrid: false,
    };
    tokio::select! {
        joined = &mut sender_task => return joined.map_err(BridgeError::Task)?,
        () = stream.run(&stop) => {}
    }
    sender_stop.cancel();
    sender_task.await.map_err(BridgeError::Task)?
}

struct Stream {
    config: BridgeConfig,
    outbox: Arc<Outbox>,
    stats: Arc<Stats>,
    tracker: SeqTracker,
    /// `(seq, payload hash)` of recently replayed batches.
    replayed: VecDeque<(u64, u64)>,
    /// Notified by the sender when the Indexer lost acknowledged batches of this worker.
    resync: Arc<Notify>,
    /// The worker runs a hybrid model (vLLM events of a second KV-cache group were seen): it
    /// was cleared and its batches are ignored from then on.
    hybrid: bool,
}

/// The next monitor event; pending forever once the monitor is closed.
async fn next_event(monitor: &mut Option<Monitor>) -> Option<SocketEvent> {
    match monitor {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

/// How following one connection ended.
enum Followed {
    Stopped,
    Disconnected,
}

fn payload_hash(payload: &[u8]) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(payload)
}

impl Stream {
    /// Follows the publisher until stopped. Each connection starts with a resync (clear, then
    /// replay from 0 when possible). When the publisher disconnects, the socket is dropped with
    /// whatever it still queued and a new one resyncs: a restarted worker may have published
    /// under the same sequence numbers, or published nothing the old socket could see, so
    /// nothing from before the disconnect can be trusted to describe it. A publisher that is
    /// away is waited for (see [`subscriber`]), however long.
    async fn run(&mut self, stop: &CancellationToken) {
        let mut reason = ClearReason::Startup;
        let mut away_since = None;
        loop {
            let Some(subscription) =
                subscriber::connect(&self.config, &self.stats, away_since, stop).await
            else {
                return;
            };
            self.tracker = SeqTracker::default();
            self.replayed.clear();
            self.resync(reason).await;
            match self.follow(subscription, stop).await {
                Followed::Stopped => return,
                Followed::Disconnected => {
                    reason = ClearReason::Reconnect;
                    away_since = Some(Instant::now());
                }
            }
        }
    }

    /// Handles live messages until the publisher disconnects or `stop` is cancelled.
    async fn follow(
        &mut self,
        mut subscription: Subscription,
        stop: &CancellationToken,
    ) -> Followed {
        let mut failures = 0u32;
        let resync = self.resync.clone();
        // Armed by each message, fired once per quiet spell.
        let quiet = tokio::time::sleep(QUIET_PROBE_AFTER);
        tokio::pin!(quiet);
        let mut probed = true;
        loop {
            tokio::select! {
                biased;
                () = stop.cancelled() => return Followed::Stopped,
                () = resync.notified() => self.resync(ClearReason::IndexLost).await,
                () = &mut quiet, if !probed => {
                    probed = true;
                    self.probe_quiet().await;
                }
                event = next_event(&mut subscription.monitor) => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        self.stats.reconnect();
                        warn!("the publisher disconnected: resubscribing and resynchronising");
                        return Followed::Disconnected;
                    }
                    Some(_) => {}
                    None => subscription.monitor = None,
                },
                message = subscription.socket.recv() => match message {
                    Ok(message) => {
                        failures = 0;
                        self.live(message.into_vec()).await;
                        probed = false;
                        quiet.as_mut().reset(tokio::time::Instant::now() + QUIET_PROBE_AFTER);
                    }
                    Err(error) => {
                        // Fails when a peer goes away; the monitor's Disconnected ends the connection.
                        failures = failures.saturating_add(1);
                        debug!(%error, "subscriber receive failed");
                        tokio::time::sleep(Duration::from_millis(u64::from(failures.min(100)))).await;
                    }
                },
            }
        }
    }

    /// Makes the index describe this worker from scratch: clear its tiers, then replay the
    /// publisher's buffer from seq 0 when there is a replay endpoint (the index under-claims
    /// until the replayed batches are applied, or until new events arrive).
    async fn resync(&mut self, reason: ClearReason) {
        info!(
            reason = reason.label(),
            replay = self.config.replay_endpoint.is_some(),
            "clearing the worker before following the stream"
        );
        self.clear(reason);
        if self.config.replay_endpoint.is_some() {
            self.recover(0, u64::MAX, None).await;
        }
    }

    async fn live(&mut self, frames: Vec<Bytes>) {
        let message = match parse_live(&frames) {
            Ok(message) => message,
            Err(error) => {
                if let Some(total) = self.stats.batch_skipped(stats::BATCH_SKIP_FRAMES) {
                    warn!(%error, total, "skipping a malformed message");
                }
                return;
            }
        };
        if let Some(topic) = message.topic
            && !self.config.event_topic.is_empty()
            && topic != self.config.event_topic.as_bytes()
        {
            if let Some(total) = self.stats.batch_skipped(stats::BATCH_SKIP_TOPIC) {
                warn!(total, "skipping a message for another topic");
            }
            return;
        }
        let (seq, payload) = (message.seq, message.payload);
        match self.tracker.check(seq) {
            SeqCheck::InOrder => {}
            SeqCheck::Gap { expected, got } => {
                self.stats.gap();
                warn!(expected, got, lost = got - expected, "sequence gap");
                self.recover(expected, got, Some(ClearReason::Gap)).await;
            }
            SeqCheck::Backwards { expected, got } => {
                if self.replayed.contains(&(seq, payload_hash(payload))) {
                    debug!(seq, "dropping a live batch already replayed");
                    self.tracker.advance_to(expected - 1);
                    return;
                }
                warn!(
                    expected,
                    got, "sequence went backwards: the publisher restarted"
                );
                self.replayed.clear();
                self.clear(ClearReason::Restart);
                if got > 0 && self.config.replay_endpoint.is_some() {
                    self.recover(0, got, None).await;
                }
            }
        }
        self.process(seq, payload);
    }

    /// Replays batches `from..until` when a replay endpoint is set. When the replay is off,
    /// fails, or starts later than asked, events were lost: the worker is cleared for `on_loss`
    /// (`None` when the caller has just cleared it).
    async fn recover(&mut self, from: u64, until: u64, on_loss: Option<ClearReason>) {
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            if let Some(reason) = on_loss {
                self.clear(reason);
            }
            return;
        };
        match replay::fetch(&endpoint, from, self.config.replay_timeout).await {
            Ok(batches) => {
                let first = batches.first().map(|(seq, _)| *seq);
                // An empty buffer loses nothing only for a replay of everything (at start); after
                // a restart seen at seq `until` > 0, batches before it were published and lost.
                let outcome = Replayed::of(from, first, until == u64::MAX);
                self.stats.replay(outcome);
                match (outcome, on_loss) {
                    (Replayed::Ok, _) => {
                        info!(
                            from,
                            batches = batches.len(),
                            "replayed the publisher's buffer"
                        );
                    }
                    // The worker was just cleared: the index lacks what the publisher no
                    // longer holds until it is stored again, as expected after a clear.
                    (_, None) => info!(
                        asked = from,
                        first = ?first,
                        batches = batches.len(),
                        "replayed the publisher's buffer, which starts later: older blocks are indexed once stored again"
                    ),
                    (_, Some(reason)) => {
                        warn!(asked = from, first = ?first, "replay starts later than asked: events were lost");
                        self.clear(reason);
                    }
                }
                self.take_replayed(batches, until);
            }
            Err(error) => {
                self.stats.replay(Replayed::Failed);
                warn!(%error, from, "replay failed: events were lost");
                if let Some(reason) = on_loss {
                    self.clear(reason);
                }
            }
        }
    }

    /// After a quiet spell: asks the replay endpoint for what was published after the last
    /// batch seen. Nothing is the usual answer; batches are ones the live path lost, applied
    /// now; a buffer that starts later than asked lost events, and the worker is cleared.
    async fn probe_quiet(&mut self) {
        let (Some(endpoint), Some(from)) =
            (self.config.replay_endpoint.clone(), self.tracker.expected())
        else {
            return;
        };
        match replay::fetch(&endpoint, from, self.config.replay_timeout).await {
            Ok(batches) if batches.is_empty() => {
                debug!(from, "the stream is quiet and nothing was published since");
            }
            Ok(batches) => {
                self.stats.gap();
                let first = batches.first().map(|(seq, _)| *seq);
                let outcome = Replayed::of(from, first, false);
                self.stats.replay(outcome);
                if outcome == Replayed::Ok {
                    warn!(
                        from,
                        batches = batches.len(),
                        "the stream's last batches before a quiet spell were lost: replayed them"
                    );
                } else {
                    warn!(asked = from, first = ?first, "the stream's last batches before a quiet spell were lost, and the replay starts later: clearing the worker");
                    self.clear(ClearReason::Gap);
                }
                self.take_replayed(batches, u64::MAX);
            }
            Err(error) => {
                self.stats.replay(Replayed::Failed);
                warn!(%error, from, "the stream is quiet and the replay endpoint did not answer: a batch lost just before would show only at the next message");
            }
        }
    }

    /// Applies replayed `batches` before seq `until` (all, when `u64::MAX`, which also moves
    /// the sequence on past them), remembering them to drop their live copies.
    fn take_replayed(&mut self, batches: Vec<(u64, Bytes)>, until: u64) {
        for (seq, payload) in batches.into_iter().filter(|(seq, _)| *seq < until) {
            if self.replayed.len() == REMEMBERED_REPLAYS {
                self.replayed.pop_front();
            }
            self.replayed.push_back((seq, payload_hash(&payload)));
            if until == u64::MAX {
                self.tracker.advance_to(seq);
            }
            self.process(seq, &payload);
        }
    }

    fn clear(&mut self, reason: ClearReason) {
        self.stats.clear(reason.label());
        self.enqueue(Item::Clear { reason });
    }

    fn process(&mut self, seq: u64, payload: &[u8]) {
        if self.hybrid {
            self.stats.batch_skipped(stats::BATCH_SKIP_HYBRID);
            return;
        }
        let mapped = match batch::map(self.config.engine, payload, &self.config.clear_tiers) {
            Ok(mapped) => mapped,
            Err(error) => {
                // Its removals are lost with it: the worker's placements can no longer be
                // trusted (an under-claim until new events, never an over-claim).
                if let Some(total) = self.stats.batch_skipped(stats::BATCH_SKIP_MSGPACK) {
                    warn!(%error, seq, total, "skipping a malformed batch: clearing the worker");
                }
                self.clear(ClearReason::Unreadable);
                return;
            }
        };
        for skipped in &mapped.skipped {
            if let Some(total) = self.stats.event_skipped(skipped.reason()) {
                warn!(error = %skipped, seq, total, "skipping an event the index cannot use");
            }
        }
        self.stats.batch(mapped.events);
        if !mapped.rpcs.is_empty() {
            self.enqueue(Item::Batch {
                seq,
                rpcs: mapped.rpcs,
            });
        }
        if mapped
            .skipped
            .iter()
            .any(|r| matches!(r, SkipReason::HybridGroup(_)))
        {
            error!(
                seq,
                "the worker runs a hybrid model (more than one vLLM KV-cache group), which the Indexer does not index: clearing it and ignoring its events until this bridge restarts"
            );
            self.hybrid = true;
        }
        // After the batch: a store it holds may follow the unreadable removal, and clearing
        // first would let that store stand for a block the worker dropped.
        if mapped.hides_removal {
            warn!(
                seq,
                "an unreadable event may have removed blocks: clearing the worker"
            );
            self.clear(ClearReason::Unreadable);
        }
    }

    fn enqueue(&mut self, item: Item) {
        let dropped = self.outbox.push(item);
        if dropped > 0 {
            self.stats.clear(ClearReason::Overflow.label());
            warn!(
                dropped,
                capacity = self.config.queue_batches,
                "queue overflowed while the indexer was away: dropped it, the worker will be cleared"
            );
        }
        self.stats.set_queue_depth(self.outbox.len());
    }
}
