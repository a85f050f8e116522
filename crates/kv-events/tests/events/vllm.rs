//! vLLM 0.33.0's events as its own `ZmqEventPublisher` sent them
//! (`kv-testkit/fixtures/vllm-events-0.33.0.json`): every message parses, every batch decodes to
//! what msgspec decoded from the same bytes, both hash forms meet, and a hybrid model's second
//! group is refused.

use kv_events::{
    Engine, Event, ReplayFrame, SkipReason, decode_batch, decode_engine_batch, parse_live,
    parse_replay, replay_request,
};
use kv_index::Tier;
use kv_testkit::fixtures::{hex_frames, vllm_case, vllm_events, vllm_hash};
use serde_json::Value;

fn tier(medium: &Value) -> Tier {
    match medium.as_str() {
        None | Some("GPU") => Tier::Hbm,
        Some("CPU") => Tier::Dram,
        Some("STORAGE") => Tier::Ssd,
        Some(other) => panic!("fixture medium {other:?} has no tier"),
    }
}

fn hashes(value: &Value) -> Vec<i64> {
    value.as_array().unwrap().iter().map(vllm_hash).collect()
}

/// The event msgspec decoded, as ours must read it (None for one that must be skipped).
fn expected(event: &Value) -> Option<Event> {
    if event["group_idx"].as_i64().unwrap_or(0) != 0 {
        return None;
    }
    Some(match event["type"].as_str().unwrap() {
        "BlockStored" => Event::BlockStored(kv_events::BlockStored {
            block_hashes: hashes(&event["block_hashes"]),
            parent_block_hash: (!event["parent_block_hash"].is_null())
                .then(|| vllm_hash(&event["parent_block_hash"])),
            block_size: event["block_size"].as_u64().unwrap() as u32,
            tier: tier(&event["medium"]),
            component_mask: None,
            lora_id: event["lora_id"].as_i64(),
            cache_salt: None,
            session_id: event["session_id"].as_str().map(str::to_owned),
            lora_name: event["lora_name"].as_str().map(str::to_owned),
            n_token_ids: event["token_ids"].as_array().unwrap().len(),
        }),
        "BlockRemoved" => Event::BlockRemoved {
            block_hashes: hashes(&event["block_hashes"]),
            tier: tier(&event["medium"]),
        },
        "AllBlocksCleared" => Event::AllBlocksCleared,
        other => panic!("unexpected event type {other}"),
    })
}

#[test]
fn every_captured_batch_decodes_to_what_msgspec_read() {
    let capture = vllm_events();
    let cases = capture["cases"].as_array().unwrap();
    assert!(cases.len() >= 15, "{} cases", cases.len());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let frames = hex_frames(&case["frames_hex"]);
        let live = parse_live(&frames).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(live.seq, case["seq"].as_u64().unwrap(), "{name}: seq");
        let topic = case["publisher"]["topic"].as_str().unwrap().as_bytes();
        assert_eq!(live.topic, Some(topic), "{name}: topic");
        let batch = decode_engine_batch(Engine::Vllm, live.payload)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let typed = &case["decoded_typed"];
        assert_eq!(batch.ts, typed[0].as_f64().unwrap(), "{name}: ts");
        assert_eq!(batch.attn_dp_rank, typed[2].as_i64(), "{name}: rank");
        // The schema-less decode: msgspec's typed one writes digests as base64 text.
        let wanted: Vec<Option<Event>> = case["decoded_wire"][1]
            .as_array()
            .unwrap()
            .iter()
            .map(expected)
            .collect();
        let kept: Vec<Event> = wanted.iter().flatten().cloned().collect();
        assert_eq!(batch.events, kept, "{name}: events");
        let refused = wanted.iter().filter(|event| event.is_none()).count();
        assert_eq!(
            batch.skipped.len(),
            refused,
            "{name}: skipped {:?}",
            batch.skipped
        );
        assert_eq!(batch.hides_removal, refused > 0, "{name}: hides_removal");
    }
}

#[test]
fn both_hash_forms_of_one_block_are_one_hash() {
    let capture = vllm_events();
    let real = &capture["real_block_hashes"];
    for (hex, int) in real["hashes_hex"]
        .as_array()
        .unwrap()
        .iter()
        .zip(real["hashes_int"].as_array().unwrap())
    {
        let digest = kv_testkit::fixtures::unhex(hex.as_str().unwrap());
        assert_eq!(
            kv_events::vllm_digest_hash(&digest),
            Some(int.as_u64().unwrap() as i64)
        );
    }
    let case = |name: &str| {
        let frames = hex_frames(&vllm_case(&capture, name)["frames_hex"]);
        decode_engine_batch(Engine::Vllm, parse_live(&frames).unwrap().payload)
            .unwrap()
            .events
    };
    let (Event::BlockStored(ints), Event::BlockStored(digests)) = (
        &case("stored_int_parent_set")[0],
        &case("stored_bytes_parent_set")[0],
    ) else {
        panic!("stores expected");
    };
    assert_eq!(ints.parent_block_hash, digests.parent_block_hash);
    assert_eq!(ints.block_hashes[0], digests.block_hashes[0]);
    let Event::BlockStored(big) = &case("stored_int_hash_above_2_63")[0] else {
        panic!()
    };
    assert!(
        big.block_hashes[0] < 0,
        "a hash >= 2^63 keeps its bits as a negative i64"
    );
}

#[test]
fn the_replay_exchange_parses() {
    let capture = vllm_events();
    let replay = &capture["replay"];
    let start = replay["start_seq"].as_u64().unwrap();
    assert_eq!(
        replay_request(start),
        hex_frames(&replay["request_frames_hex"])
    );
    let replies = replay["reply_messages_hex"].as_array().unwrap();
    let mut seqs = Vec::new();
    for (i, reply) in replies.iter().enumerate() {
        let frames = hex_frames(reply);
        match parse_replay(&frames).unwrap() {
            ReplayFrame::Batch { seq, payload, .. } => {
                decode_engine_batch(Engine::Vllm, payload).unwrap();
                seqs.push(seq);
            }
            ReplayFrame::End => assert_eq!(i, replies.len() - 1, "the end marker is last"),
        }
    }
    let expected: Vec<u64> = (start..start + seqs.len() as u64).collect();
    assert_eq!(seqs, expected);
    assert!(!seqs.is_empty());
}

#[test]
fn engines_stay_apart() {
    let capture = vllm_events();
    let frames = hex_frames(&vllm_case(&capture, "stored_medium_cpu")["frames_hex"]);
    let payload = parse_live(&frames).unwrap().payload;
    // SGLang has no medium "CPU", and a vLLM digest is not an SGLang hash.
    let sglang = decode_batch(payload).unwrap();
    assert_eq!(
        sglang.skipped,
        vec![SkipReason::UnknownMedium("CPU".into())]
    );
    let frames = hex_frames(&vllm_case(&capture, "stored_bytes_parent_none")["frames_hex"]);
    let sglang = decode_batch(parse_live(&frames).unwrap().payload).unwrap();
    assert!(
        matches!(sglang.skipped[..], [SkipReason::Malformed(_)]),
        "{:?}",
        sglang.skipped
    );
    assert!(
        decode_engine_batch(Engine::Vllm, parse_live(&frames).unwrap().payload)
            .unwrap()
            .skipped
            .is_empty()
    );
}
