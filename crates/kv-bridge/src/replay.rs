//! Asking the publisher's replay ROUTER for buffered batches, with a fresh DEALER per request
//! (a `zeromq` DEALER does not reconnect).

use std::time::Duration;

use bytes::Bytes;
use kv_events::frames::{ReplayFrame, parse_replay, replay_request};
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("connecting to the replay endpoint timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("replay socket failed")]
    Socket(#[source] zeromq::ZmqError),
    #[error("no replay reply within {0:?}")]
    ReplyTimeout(Duration),
    #[error("malformed replay reply")]
    Malformed(#[source] kv_events::frames::FrameError),
}

/// What a replay came to (the `outcome` label of `kv_bridge_replays_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replayed {
    /// Every batch asked for, or, replaying from scratch, an empty buffer: nothing was lost.
    Ok,
    /// The buffer starts later than asked: the publisher evicted what came between.
    Evicted,
    /// No answer (unreachable, timed out, malformed).
    Failed,
}

impl Replayed {
    pub const ALL: [Replayed; 3] = [Replayed::Ok, Replayed::Evicted, Replayed::Failed];

    /// What a replay asked `from` whose first batch is `first` says. `from_scratch`: the worker
    /// was just cleared and the whole buffer is asked for (at start-up, after a reconnect or a
    /// publisher restart), so an empty buffer means the publisher has published nothing since
    /// it started, not that anything was lost.
    pub fn of(from: u64, first: Option<u64>, from_scratch: bool) -> Replayed {
        match first {
            Some(first) if first == from => Replayed::Ok,
            None if from_scratch => Replayed::Ok,
            _ => Replayed::Evicted,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Replayed::Ok => "ok",
            Replayed::Evicted => "evicted",
            Replayed::Failed => "failed",
        }
    }
}

/// Every buffered batch with seq ≥ `start`, in order, up to the end marker. The first seq may
/// be later than `start` when the publisher evicted it: the caller compares.
pub async fn fetch(
    endpoint: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut dealer = DealerSocket::with_options(options);
    match tokio::time::timeout(timeout, dealer.connect(endpoint)).await {
        Err(_) => return Err(ReplayError::ConnectTimeout(timeout)),
        Ok(Err(error)) => return Err(ReplayError::Socket(error)),
        Ok(Ok(())) => {}
    }
    let frames: Vec<Bytes> = replay_request(start).into_iter().map(Bytes::from).collect();
    let request = ZmqMessage::try_from(frames).expect("a replay request has two frames");
    dealer.send(request).await.map_err(ReplayError::Socket)?;
    let mut batches = Vec::new();
    loop {
        let message = match tokio::time::timeout(timeout, dealer.recv()).await {
            Err(_) => return Err(ReplayError::ReplyTimeout(timeout)),
            Ok(Err(error)) => return Err(ReplayError::Socket(error)),
            Ok(Ok(message)) => message,
        };
        let frames = message.into_vec();
        match parse_replay(&frames).map_err(ReplayError::Malformed)? {
            ReplayFrame::End => return Ok(batches),
            ReplayFrame::Batch { seq, payload, .. } => {
                batches.push((seq, Bytes::copy_from_slice(payload)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_buffer_loses_nothing_only_when_replaying_from_scratch() {
        for (from, first, from_scratch, expected) in [
            (0, Some(0), true, Replayed::Ok),
            (0, None, true, Replayed::Ok),
            (0, Some(7), true, Replayed::Evicted),
            (5, Some(5), false, Replayed::Ok),
            (5, None, false, Replayed::Evicted),
            (5, Some(9), false, Replayed::Evicted),
        ] {
            assert_eq!(
                Replayed::of(from, first, from_scratch),
                expected,
                "from {from}, first {first:?}, from scratch {from_scratch}"
            );
        }
    }
}
