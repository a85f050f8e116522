//! ZMQ multipart framing: live messages, replay replies and the end marker, the replay request.

use kv_events::frames::{FrameError, LiveMessage, REPLAY_END_SEQ, ReplayFrame};
use kv_events::{parse_live, parse_replay, replay_request};

const SEQ_7: [u8; 8] = [0, 0, 0, 0, 0, 0, 0, 7];
const END: [u8; 8] = [0xff; 8];

type Case<'a, T> = (&'a str, &'a [&'a [u8]], Result<T, FrameError>);

fn check_live(cases: &[Case<'_, LiveMessage<'_>>]) {
    for (name, frames, want) in cases {
        assert_eq!(&parse_live(frames), want, "{name}");
    }
}

fn check_replay(cases: &[Case<'_, ReplayFrame<'_>>]) {
    for (name, frames, want) in cases {
        assert_eq!(&parse_replay(frames), want, "{name}");
    }
}

#[test]
fn parses_live_messages() {
    let live = |topic, seq, payload| {
        Ok(LiveMessage {
            topic,
            seq,
            payload,
        })
    };
    check_live(&[
        (
            "three frames",
            &[b"kv-events", &SEQ_7, b"\x93"],
            live(Some(&b"kv-events"[..]), 7, &b"\x93"[..]),
        ),
        (
            "empty topic",
            &[b"", &SEQ_7, b"p"],
            live(Some(&b""[..]), 7, &b"p"[..]),
        ),
        ("two frames", &[&SEQ_7, b"p"], live(None, 7, &b"p"[..])),
        (
            "big-endian seq",
            &[b"t", &[1, 2, 3, 4, 5, 6, 7, 8], b""],
            live(Some(&b"t"[..]), 0x0102_0304_0506_0708, &b""[..]),
        ),
        (
            "largest seq",
            &[b"t", &END, b"p"],
            live(Some(&b"t"[..]), u64::MAX, &b"p"[..]),
        ),
        (
            "no frames",
            &[],
            Err(FrameError::LiveFrameCount { found: 0 }),
        ),
        (
            "one frame",
            &[b"p"],
            Err(FrameError::LiveFrameCount { found: 1 }),
        ),
        (
            "four frames",
            &[b"", b"t", &SEQ_7, b"p"],
            Err(FrameError::LiveFrameCount { found: 4 }),
        ),
        (
            "seq of 4 bytes",
            &[b"t", &[0, 0, 0, 7], b"p"],
            Err(FrameError::SeqLength { len: 4 }),
        ),
        (
            "seq of 9 bytes",
            &[b"t", &[0; 9], b"p"],
            Err(FrameError::SeqLength { len: 9 }),
        ),
        (
            "empty seq, two frames",
            &[b"", b"p"],
            Err(FrameError::SeqLength { len: 0 }),
        ),
    ]);
}

#[test]
fn parses_replay_replies_and_the_end_marker() {
    let batch = |topic, seq, payload| {
        Ok(ReplayFrame::Batch {
            topic,
            seq,
            payload,
        })
    };
    check_replay(&[
        (
            "a batch",
            &[b"", b"kv-events", &SEQ_7, b"\x93"],
            batch(&b"kv-events"[..], 7, &b"\x93"[..]),
        ),
        (
            "a batch with empty topic",
            &[b"", b"", &SEQ_7, b"p"],
            batch(&b""[..], 7, &b"p"[..]),
        ),
        (
            "the end marker",
            &[b"", b"", &END, b""],
            Ok(ReplayFrame::End),
        ),
        (
            "an end marker with a topic",
            &[b"", b"kv-events", &END, b""],
            Ok(ReplayFrame::End),
        ),
        (
            "an end marker with a payload",
            &[b"", b"", &END, b"xy"],
            Err(FrameError::EndMarkerPayload { len: 2 }),
        ),
        (
            "no delimiter",
            &[b"kv-events", &SEQ_7, b"p"],
            Err(FrameError::ReplayFrameCount { found: 3 }),
        ),
        (
            "a non-empty delimiter",
            &[b"x", b"t", &SEQ_7, b"p"],
            Err(FrameError::MissingDelimiter),
        ),
        (
            "five frames",
            &[b"", b"", b"t", &SEQ_7, b"p"],
            Err(FrameError::ReplayFrameCount { found: 5 }),
        ),
        (
            "short seq",
            &[b"", b"t", &[7], b"p"],
            Err(FrameError::SeqLength { len: 1 }),
        ),
    ]);
    assert_eq!(REPLAY_END_SEQ, u64::MAX);
}

#[test]
fn accepts_owned_frames() {
    let frames: Vec<Vec<u8>> = vec![b"t".to_vec(), SEQ_7.to_vec(), b"p".to_vec()];
    assert_eq!(parse_live(&frames).unwrap().seq, 7);
    let frames: Vec<Vec<u8>> = vec![vec![], b"t".to_vec(), SEQ_7.to_vec(), b"p".to_vec()];
    assert!(matches!(
        parse_replay(&frames),
        Ok(ReplayFrame::Batch { seq: 7, .. })
    ));
}

#[test]
fn builds_replay_requests() {
    assert_eq!(replay_request(0), vec![vec![], vec![0; 8]]);
    assert_eq!(replay_request(7), vec![Vec::new(), SEQ_7.to_vec()]);
    assert_eq!(replay_request(u64::MAX), vec![Vec::new(), END.to_vec()]);
    // A request is itself the seq frame a reply would carry.
    let request = replay_request(0x0102_0304_0506_0708);
    let reply = [&b""[..], b"t", &request[1], b"p"];
    assert!(matches!(
        parse_replay(&reply),
        Ok(ReplayFrame::Batch {
            seq: 0x0102_0304_0506_0708,
            ..
        })
    ));
}

#[test]
fn labels_every_frame_error() {
    let errors = [
        (FrameError::LiveFrameCount { found: 1 }, "frame_count"),
        (FrameError::ReplayFrameCount { found: 1 }, "frame_count"),
        (FrameError::SeqLength { len: 1 }, "seq_length"),
        (FrameError::MissingDelimiter, "missing_delimiter"),
        (
            FrameError::EndMarkerPayload { len: 1 },
            "end_marker_payload",
        ),
    ];
    for (error, label) in errors {
        assert_eq!(error.reason(), label, "{error}");
    }
}
