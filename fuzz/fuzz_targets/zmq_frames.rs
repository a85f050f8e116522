//! The ZMQ frame parsers (live SUB messages and replay DEALER replies), from any multipart
//! message (length-prefixed frames): parsing never panics, an accepted message keeps its frames
//! as they were, and every accepted payload goes on through the decoder.
#![no_main]

use kv_events::frames::REPLAY_END_SEQ;
use kv_events::{ReplayFrame, decode_batch, parse_live, parse_replay};
use libfuzzer_sys::fuzz_target;
use sgl_kv_indexer_fuzz::frames;

fuzz_target!(|data: &[u8]| {
    let frames = frames(data);
    if let Ok(live) = parse_live(&frames) {
        let n = frames.len();
        assert!(matches!(n, 2 | 3));
        assert_eq!(frames[n - 2], live.seq.to_be_bytes());
        assert_eq!(live.payload, frames[n - 1]);
        assert_eq!(live.topic.is_some(), n == 3);
        let _ = decode_batch(live.payload);
    }
    match parse_replay(&frames) {
        Ok(ReplayFrame::End) => {
            assert!(frames[0].is_empty() && frames[3].is_empty());
            assert_eq!(frames[2], REPLAY_END_SEQ.to_be_bytes());
        }
        Ok(ReplayFrame::Batch { seq, payload, .. }) => {
            assert!(frames[0].is_empty());
            assert_ne!(seq, REPLAY_END_SEQ);
            let _ = decode_batch(payload);
        }
        Err(_) => {}
    }
});
