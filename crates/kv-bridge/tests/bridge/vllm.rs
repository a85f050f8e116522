//! A vLLM worker's events end to end on loopback: the frames vLLM 0.33.0's own
//! `ZmqEventPublisher` sent (`kv-testkit/fixtures/vllm-events-0.33.0.json`), published on a real
//! ZMQ PUB, followed by `kv-indexer-bridge --engine vllm` into the real server; after every
//! message the index holds exactly what the events say, no placement missing and none extra.
//! `scripts/vllm/live_e2e.py` does the same with the publisher itself running.

use std::collections::BTreeSet;

use kv_bridge::stats::Stats;
use kv_testkit::fixtures::{hex_frames, vllm_events, vllm_hash};
use kv_testkit::indexer::{Held, apply_events};
use kv_testkit::{BridgeFlags, FakeWorker, TestIndexer, wait};
use serde_json::Value;

const WORKER: &str = "vllm-0";

fn tier(medium: &Value) -> i32 {
    match medium.as_str() {
        None | Some("GPU") => 1,
        Some("CPU") => 2,
        Some("STORAGE") => 3,
        Some(other) => panic!("unexpected medium {other}"),
    }
}

fn hashes(event: &Value) -> Vec<i64> {
    event["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(vllm_hash)
        .collect()
}

/// What the worker holds after one batch of a one-group model, from the events msgspec decoded
/// (not from our decoder).
fn apply(held: &mut Held, events: &[Value]) {
    apply_events(held, events, tier, hashes);
}

fn hybrid(case: &Value) -> bool {
    case["decoded_wire"][1]
        .as_array()
        .unwrap()
        .iter()
        .any(|event| event["group_idx"].as_i64().unwrap_or(0) != 0)
}

/// `case`'s frames as sent, but numbered `seq`: the payload and topic are the publisher's bytes.
fn frames_as(case: &Value, seq: u64) -> Vec<Vec<u8>> {
    let mut frames = hex_frames(&case["frames_hex"]);
    frames[1] = seq.to_be_bytes().to_vec();
    frames
}

#[tokio::test]
async fn applies_every_frame_of_the_real_vllm_publisher() {
    let capture = vllm_events();
    // The first publisher's messages (topic ""); the second publisher, with its own seq and
    // topic, is another worker. The one batch of a hybrid model's second KV-cache group goes
    // last (renumbered), as it ends what the index may say about this worker.
    let rank_0 = capture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|case| case["publisher"]["data_parallel_rank"] == 0);
    let (hybrids, mut cases): (Vec<&Value>, Vec<&Value>) = rank_0.partition(|case| hybrid(case));
    assert_eq!(hybrids.len(), 1, "the capture has one hybrid-group batch");
    cases.extend(&hybrids);
    let universe: BTreeSet<i64> = cases
        .iter()
        .flat_map(|case| case["decoded_wire"][1].as_array().unwrap())
        .filter(|event| event.get("block_hashes").is_some())
        .flat_map(hashes)
        .collect();
    let server = TestIndexer::start().await;
    let mut worker = FakeWorker::start().await;
    let bridge = BridgeFlags::new(
        WORKER,
        "http://127.0.0.1:8000",
        &server.url(),
        &worker.endpoint(),
    )
    .topic("")
    .flag("--engine", "vllm")
    .start();
    worker.wait_subscribed(&bridge.stats).await;
    let mut held = Held::new();
    let (last, one_group) = cases.split_last().unwrap();
    for (seq, case) in one_group.iter().enumerate() {
        worker.send(frames_as(case, seq as u64)).await;
        apply(&mut held, case["decoded_wire"][1].as_array().unwrap());
        server.wait_for_held(WORKER, &held, &universe).await;
    }
    assert!(
        held.values().flatten().count() > 0,
        "the one-group batches end holding blocks"
    );
    // The hybrid batch clears the worker, and the worker's later batches are ignored.
    let seq = one_group.len() as u64;
    worker.send(frames_as(last, seq)).await;
    server.wait_for_held(WORKER, &Held::new(), &universe).await;
    let stats = &bridge.stats;
    wait::until("the bridge to see the hybrid batch", || async {
        (Stats::get(&stats.clears) == 2).then_some(())
    })
    .await;
    worker.send(frames_as(one_group[0], seq + 1)).await;
    wait::until("the next batch to be skipped", || async {
        (Stats::get(&stats.batches_skipped) == 1).then_some(())
    })
    .await;
    assert_eq!(server.held(WORKER, &universe).await, Held::new());
    assert_eq!(Stats::get(&stats.gaps), 0);
    assert_eq!(Stats::get(&stats.batches), cases.len() as u64);
    assert_eq!(
        Stats::get(&stats.events_skipped),
        1,
        "the hybrid-group event"
    );
    assert_eq!(
        Stats::get(&stats.clears),
        2,
        "start-up, then the hybrid model"
    );
    bridge.stop().await;
}

#[test]
fn refuses_cache_components_for_vllm() {
    let argv = [
        "kv-indexer-bridge",
        "--worker-id",
        "w",
        "--engine",
        "vllm",
        "--cache-components",
        "full,swa",
        "--swa-window-tokens",
        "4096",
    ];
    let args = <kv_bridge::config::Args as clap::Parser>::try_parse_from(argv).unwrap();
    let error = kv_bridge::config::BridgeConfig::from_args(args)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("KV_INDEXER_CACHE_COMPONENTS") && error.contains("vLLM"),
        "{error}"
    );
    let bad = <kv_bridge::config::Args as clap::Parser>::try_parse_from([
        "kv-indexer-bridge",
        "--worker-id",
        "w",
        "--engine",
        "trt",
    ]);
    let error = bad.unwrap_err().to_string();
    assert!(error.contains("unknown engine \"trt\""), "{error}");
}
