//! Golden vectors from the real publisher (`crates/kv-testkit/fixtures/`, see the README there): every batch
//! decodes to exactly the events the publisher serialised, and every captured ZMQ message parses.

use crate::common::{rows, unhex};
use kv_events::{
    Event, ReplayFrame, SkipReason, decode_batch, map_events, parse_live, parse_replay,
    replay_request, split,
};
use kv_index::{ActionKind, MAX_ACTIONS_PER_APPLY, MAX_HASHES_PER_REQUEST, Tier};
use serde::Deserialize;
use serde_json::Value;

fn tier(medium: &str) -> Tier {
    match medium {
        "GPU" => Tier::Hbm,
        "CPU_PINNED" => Tier::Dram,
        "DISK" => Tier::Ssd,
        other => panic!("fixture medium {other:?} has no tier"),
    }
}

fn i64s(value: &Value) -> Vec<i64> {
    Vec::<i64>::deserialize(value).unwrap()
}

fn opt_i64(expected: &Value, key: &str) -> Option<i64> {
    expected
        .get(key)
        .filter(|v| !v.is_null())
        .map(|v| v.as_i64().unwrap())
}

fn opt_str(expected: &Value, key: &str) -> Option<String> {
    expected
        .get(key)
        .filter(|v| !v.is_null())
        .map(|v| v.as_str().unwrap().to_owned())
}

/// Compares every field the fixture states; a field it does not state must be empty.
fn check_event(at: &str, expected: &Value, actual: &Event) {
    match (expected["type"].as_str().unwrap(), actual) {
        ("BlockStored", Event::BlockStored(stored)) => {
            assert_eq!(
                stored.block_hashes,
                i64s(&expected["block_hashes"]),
                "{at}: block_hashes"
            );
            assert_eq!(
                stored.parent_block_hash,
                opt_i64(expected, "parent_block_hash"),
                "{at}: parent"
            );
            let block_size = opt_i64(expected, "block_size").unwrap_or(0);
            assert_eq!(i64::from(stored.block_size), block_size, "{at}: block_size");
            assert_eq!(
                stored.tier,
                tier(expected["medium"].as_str().unwrap()),
                "{at}: tier"
            );
            assert_eq!(
                stored.lora_id,
                opt_i64(expected, "lora_id"),
                "{at}: lora_id"
            );
            assert_eq!(
                stored.cache_salt,
                opt_str(expected, "cache_salt"),
                "{at}: cache_salt"
            );
            assert_eq!(
                stored.session_id,
                opt_str(expected, "session_id"),
                "{at}: session_id"
            );
            assert_eq!(
                stored.lora_name,
                opt_str(expected, "lora_name"),
                "{at}: lora_name"
            );
            if let Some(n) = expected.get("n_token_ids") {
                assert_eq!(
                    stored.n_token_ids as u64,
                    n.as_u64().unwrap(),
                    "{at}: n_token_ids"
                );
            }
            match expected.get("component_mask").and_then(Value::as_u64) {
                // The fixture writes 0 for an event without component_types: a legacy event.
                None | Some(0) => assert_eq!(stored.component_mask, None, "{at}: component_mask"),
                Some(mask) => {
                    assert_eq!(
                        stored.component_mask,
                        Some(mask as u32),
                        "{at}: component_mask"
                    );
                }
            }
        }
        (
            "BlockRemoved",
            Event::BlockRemoved {
                block_hashes,
                tier: actual_tier,
            },
        ) => {
            assert_eq!(
                *block_hashes,
                i64s(&expected["block_hashes"]),
                "{at}: block_hashes"
            );
            assert_eq!(
                *actual_tier,
                tier(expected["medium"].as_str().unwrap()),
                "{at}: tier"
            );
        }
        ("AllBlocksCleared", Event::AllBlocksCleared) => {}
        (kind, actual) => panic!("{at}: expected {kind}, decoded {actual:?}"),
    }
}

fn check_release(file: &str, version: &str) {
    let rows = rows(file);
    assert!(!rows.is_empty());
    for (line, row) in rows.iter().enumerate() {
        let at = format!("{file}:{} (seq {})", line + 1, row["seq"]);
        assert_eq!(row["sglang"], version, "{at}");
        let batch = decode_batch(&unhex(row["payload_hex"].as_str().unwrap()))
            .unwrap_or_else(|error| panic!("{at}: {error}"));
        assert_eq!(batch.ts, row["ts"].as_f64().unwrap(), "{at}: ts");
        assert_eq!(
            batch.attn_dp_rank,
            opt_i64(row, "attn_dp_rank"),
            "{at}: attn_dp_rank"
        );
        assert_eq!(batch.skipped, Vec::<SkipReason>::new(), "{at}: skipped");
        let expected = row["events"].as_array().unwrap();
        assert_eq!(batch.events.len(), expected.len(), "{at}: event count");
        for (i, (expected, actual)) in expected.iter().zip(&batch.events).enumerate() {
            check_event(&format!("{at} event {i}"), expected, actual);
        }
    }
}

#[test]
fn decodes_every_map_era_batch_of_0_5_23() {
    check_release("sglang-events-0.5.23.jsonl", "0.5.23");
}

#[test]
fn decodes_every_array_era_batch_of_0_5_18() {
    check_release("sglang-events-0.5.18.jsonl", "0.5.18");
}

#[test]
fn decodes_component_types_in_both_eras() {
    let rows = rows("sglang-events-component-types.jsonl");
    for era in ["map", "array"] {
        assert!(
            rows.iter().any(|row| row["era"] == era),
            "no {era} era rows"
        );
    }
    for (line, row) in rows.iter().enumerate() {
        let at = format!(
            "sglang-events-component-types.jsonl:{} ({})",
            line + 1,
            row["era"]
        );
        let batch = decode_batch(&unhex(row["payload_hex"].as_str().unwrap()))
            .unwrap_or_else(|error| panic!("{at}: {error}"));
        assert_eq!(batch.skipped, Vec::<SkipReason>::new(), "{at}: skipped");
        assert_eq!(batch.events.len(), 1, "{at}: event count");
        check_event(&at, &row["expect"], &batch.events[0]);
    }
}

/// The payloads of the capture, by seq, as the 0.5.23 rows have them.
fn release_payloads() -> Vec<(u64, Vec<u8>)> {
    rows("sglang-events-0.5.23.jsonl")
        .iter()
        .map(|row| {
            (
                row["seq"].as_u64().unwrap(),
                unhex(row["payload_hex"].as_str().unwrap()),
            )
        })
        .collect()
}

fn frames(row: &Value) -> Vec<Vec<u8>> {
    row["frames_hex"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| unhex(f.as_str().unwrap()))
        .collect()
}

#[test]
fn parses_every_captured_zmq_message() {
    let payloads = release_payloads();
    let payload_of = |seq: u64| &payloads.iter().find(|(s, _)| *s == seq).unwrap().1;
    let rows = rows("zmq-frames-0.5.23.jsonl");
    let (mut live, mut replayed, mut ends, mut requests) = (Vec::new(), Vec::new(), 0, 0);
    for (line, row) in rows.iter().enumerate() {
        let at = format!("zmq-frames-0.5.23.jsonl:{}", line + 1);
        let frames = frames(row);
        match row["kind"].as_str().unwrap() {
            "live" => {
                let message = parse_live(&frames).unwrap_or_else(|error| panic!("{at}: {error}"));
                assert_eq!(message.topic, Some(&b"kv-events"[..]), "{at}");
                assert_eq!(
                    message.payload,
                    &payload_of(message.seq)[..],
                    "{at}: payload"
                );
                decode_batch(message.payload).unwrap_or_else(|error| panic!("{at}: {error}"));
                live.push(message.seq);
            }
            "replay_request" => {
                assert_eq!(replay_request(2), frames, "{at}");
                requests += 1;
            }
            "replay_reply" => match parse_replay(&frames).unwrap_or_else(|e| panic!("{at}: {e}")) {
                ReplayFrame::Batch {
                    topic,
                    seq,
                    payload,
                } => {
                    assert_eq!(ends, 0, "{at}: a batch after the end marker");
                    assert_eq!(topic, b"kv-events", "{at}");
                    assert_eq!(payload, &payload_of(seq)[..], "{at}: payload");
                    decode_batch(payload).unwrap_or_else(|error| panic!("{at}: {error}"));
                    replayed.push(seq);
                }
                ReplayFrame::End => ends += 1,
            },
            other => panic!("{at}: unknown kind {other}"),
        }
    }
    assert_eq!(live, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(requests, 1);
    assert_eq!(replayed, vec![2, 3, 4, 5], "replay from seq 2, in order");
    assert_eq!(ends, 1);
}

/// Mapping and splitting the real batches loses no hash and respects the apply limits.
#[test]
fn maps_and_splits_every_release_batch() {
    for file in ["sglang-events-0.5.23.jsonl", "sglang-events-0.5.18.jsonl"] {
        for row in rows(file) {
            let batch = decode_batch(&unhex(row["payload_hex"].as_str().unwrap())).unwrap();
            let clear_tiers = [Tier::Hbm, Tier::Dram];
            let actions = map_events(&batch.events, &clear_tiers);
            let count = |kind: ActionKind| {
                actions
                    .iter()
                    .filter(|a| a.kind == kind)
                    .map(|a| a.hashes.len())
                    .sum::<usize>()
            };
            let (mut stored, mut removed, mut clears) = (0, 0, 0);
            for event in &batch.events {
                match event {
                    Event::BlockStored(s) => stored += s.block_hashes.len(),
                    Event::BlockRemoved { block_hashes, .. } => removed += block_hashes.len(),
                    Event::AllBlocksCleared => clears += 1,
                }
            }
            assert_eq!(count(ActionKind::Report), stored);
            assert_eq!(count(ActionKind::Revoke), removed);
            let clear_actions = actions
                .iter()
                .filter(|a| a.kind == ActionKind::ClearAllAtTier);
            assert_eq!(clear_actions.count(), clears * clear_tiers.len());
            for action in &actions {
                // Releases have no component_types: side arrays stay empty.
                assert!(action.component_masks.is_empty() && action.block_sizes.is_empty());
            }
            let groups = split(actions.clone());
            assert_eq!(groups.concat(), actions, "small actions are not cut");
            for group in &groups {
                assert!(group.len() <= MAX_ACTIONS_PER_APPLY);
                assert!(
                    group.iter().map(|a| a.hashes.len()).sum::<usize>() <= MAX_HASHES_PER_REQUEST
                );
            }
        }
    }
}
