//! Untrusted bytes never panic: arbitrary payloads, mutated real payloads and arbitrary frames.
//! (A `cargo fuzz` target would call the same entry points.)

use crate::common::{rows, unhex};
use kv_events::{decode_batch, map_events, parse_live, parse_replay, split};
use kv_index::Tier;
use proptest::prelude::*;
use std::sync::OnceLock;

fn real_payloads() -> &'static [Vec<u8>] {
    static PAYLOADS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    PAYLOADS.get_or_init(|| {
        let mut payloads = Vec::new();
        for file in [
            "sglang-events-0.5.18.jsonl",
            "sglang-events-component-types.jsonl",
        ] {
            for row in rows(file) {
                payloads.push(unhex(row["payload_hex"].as_str().unwrap()));
            }
        }
        // Small ones first: mutations of big payloads mostly hit token ids.
        payloads.sort_by_key(Vec::len);
        payloads.truncate(64);
        payloads
    })
}

/// Decodes, and if that works, maps and splits too: none of it may panic.
fn exercise(payload: &[u8]) {
    if let Ok(batch) = decode_batch(payload) {
        for reason in &batch.skipped {
            let _ = reason.reason();
        }
        let _ = split(map_events(&batch.events, &Tier::ALL));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn decode_never_panics_on_arbitrary_bytes(payload in proptest::collection::vec(any::<u8>(), 0..256)) {
        exercise(&payload);
    }

    /// Starting with a batch header gets the bytes past the first checks.
    #[test]
    fn decode_never_panics_after_a_valid_header(tail in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut payload = vec![0x93, 0xcb, 0x41, 0xda, 0x13, 0xb8, 0x60, 0, 0, 0, 0xdc, 0, 3];
        payload.extend(tail);
        exercise(&payload);
    }

    #[test]
    fn decode_never_panics_on_mutated_real_payloads(
        pick in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let payloads = real_payloads();
        let mut payload = payloads[pick.index(payloads.len())].clone();
        for (at, byte) in edits {
            let at = at.index(payload.len());
            payload[at] = byte;
        }
        if truncate {
            payload.truncate(cut.index(payload.len() + 1));
        }
        exercise(&payload);
    }

    #[test]
    fn frame_parsers_never_panic(frames in proptest::collection::vec(
        proptest::collection::vec(any::<u8>(), 0..12), 0..6)) {
        let _ = parse_live(&frames);
        let _ = parse_replay(&frames);
    }
}
