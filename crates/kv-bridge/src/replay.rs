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
