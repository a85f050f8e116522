//! The replay ROUTER of SGLang's publisher: a DEALER sends `["", start_seq (8 bytes BE)]` and
//! gets `["", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, in order,
//! then the end marker `["", "", ff×8, ""]`. When `start_seq` has left the buffer the replies
//! silently start later. A malformed request gets no answer.

use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use super::{PublisherError, ReplayBuffer, bound};

pub struct ReplayServer {
    socket: RouterSocket,
    buffer: ReplayBuffer,
    topic: Bytes,
}

impl ReplayServer {
    /// A ROUTER on an already-bound listener, answering from `buffer`.
    pub async fn bind(
        listener: std::net::TcpListener,
        buffer: ReplayBuffer,
        topic: &[u8],
    ) -> Result<ReplayServer, PublisherError> {
        Ok(ReplayServer {
            socket: bound(listener).await?,
            buffer,
            topic: Bytes::copy_from_slice(topic),
        })
    }

    /// Answers requests until `stop` is cancelled.
    pub async fn run(mut self, stop: CancellationToken) {
        loop {
            let request = tokio::select! {
                () = stop.cancelled() => return,
                request = self.socket.recv() => request,
            };
            let frames = match request {
                Ok(message) => message.into_vec(),
                // A peer going away surfaces here; the socket goes on.
                Err(error) => {
                    debug!(%error, "replay receive failed");
                    continue;
                }
            };
            let [identity, delimiter, start] = frames.as_slice() else {
                debug!(frames = frames.len(), "ignoring a malformed replay request");
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
                debug!(
                    len = start.len(),
                    "ignoring a replay request with a bad seq"
                );
                continue;
            };
            if !delimiter.is_empty() {
                debug!("ignoring a replay request without an empty delimiter");
                continue;
            }
            let start = u64::from_be_bytes(start);
            if let Err(error) = self.answer(identity, start).await {
                warn!(%error, start, "replay reply failed");
            }
        }
    }

    async fn answer(&mut self, identity: &Bytes, start: u64) -> Result<(), zeromq::ZmqError> {
        for (seq, payload) in self.buffer.since(start) {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            self.socket.send(message(frames)).await?;
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ];
        self.socket.send(message(end)).await
    }
}

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("a non-empty frame list is a valid message")
}
