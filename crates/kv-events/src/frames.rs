//! ZMQ multipart messages of the SGLang publisher: live messages off the PUB socket, and the
//! replay conversation with its ROUTER through a DEALER.

/// The sequence number of the replay end marker (`ff` × 8).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// A live message: `[topic, seq, payload]`, or `[seq, payload]` (then `topic` is `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// The topic frame as sent (empty when the publisher's topic is "").
    pub topic: Option<&'a [u8]>,
    /// Per publisher process, from 0, one per non-empty batch.
    pub seq: u64,
    pub payload: &'a [u8],
}

/// One reply to a replay request, as a DEALER receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayFrame<'a> {
    /// `["", topic, seq, payload]`: one buffered batch.
    Batch {
        topic: &'a [u8],
        seq: u64,
        payload: &'a [u8],
    },
    /// `["", "", ff ff ff ff ff ff ff ff, ""]`: no more batches.
    End,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("live message has {found} frames, expected 2 or 3")]
    LiveFrameCount { found: usize },
    #[error("replay reply has {found} frames, expected 4")]
    ReplayFrameCount { found: usize },
    #[error("sequence frame has {len} bytes, expected 8")]
    SeqLength { len: usize },
    #[error("replay reply does not start with an empty delimiter frame")]
    MissingDelimiter,
    #[error("replay end marker carries a {len}-byte payload")]
    EndMarkerPayload { len: usize },
}

impl FrameError {
    /// A short stable label, for a metric.
    pub fn reason(&self) -> &'static str {
        match self {
            FrameError::LiveFrameCount { .. } | FrameError::ReplayFrameCount { .. } => {
                "frame_count"
            }
            FrameError::SeqLength { .. } => "seq_length",
            FrameError::MissingDelimiter => "missing_delimiter",
            FrameError::EndMarkerPayload { .. } => "end_marker_payload",
        }
    }
}

/// Parses a message received on the SUB socket.
pub fn parse_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<LiveMessage<'_>, FrameError> {
    match frames {
        [topic, seq, payload] => Ok(LiveMessage {
            topic: Some(topic.as_ref()),
            seq: seq_number(seq.as_ref())?,
            payload: payload.as_ref(),
        }),
        [seq, payload] => Ok(LiveMessage {
            topic: None,
            seq: seq_number(seq.as_ref())?,
            payload: payload.as_ref(),
        }),
        _ => Err(FrameError::LiveFrameCount {
            found: frames.len(),
        }),
    }
}

/// Parses a message received on the replay DEALER socket.
pub fn parse_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayFrame<'_>, FrameError> {
    let [delimiter, topic, seq, payload] = frames else {
        return Err(FrameError::ReplayFrameCount {
            found: frames.len(),
        });
    };
    if !delimiter.as_ref().is_empty() {
        return Err(FrameError::MissingDelimiter);
    }
    let seq = seq_number(seq.as_ref())?;
    let payload = payload.as_ref();
    if seq == REPLAY_END_SEQ {
        return if payload.is_empty() {
            Ok(ReplayFrame::End)
        } else {
            Err(FrameError::EndMarkerPayload { len: payload.len() })
        };
    }
    Ok(ReplayFrame::Batch {
        topic: topic.as_ref(),
        seq,
        payload,
    })
}

/// The frames a DEALER sends to ask for every buffered batch from `start_seq` on:
/// `["", start_seq as 8 bytes big-endian]`.
pub fn replay_request(start_seq: u64) -> Vec<Vec<u8>> {
    vec![Vec::new(), start_seq.to_be_bytes().to_vec()]
}

fn seq_number(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}
