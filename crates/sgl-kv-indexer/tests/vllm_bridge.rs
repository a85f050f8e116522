//! A vLLM worker's events end to end on loopback: the frames vLLM 0.33.0's own
//! `ZmqEventPublisher` sent (`kv-testkit/fixtures/vllm-events-0.33.0.json`), published on a real
//! ZMQ PUB, followed by `kv-indexer-bridge --engine vllm` into the real server; after every
//! message the index holds exactly what the events say, no placement missing and none extra.
//! `scripts/vllm/live_e2e.py` does the same with the publisher itself running.

use std::collections::BTreeSet;

use kv_bridge::stats::Stats;
use kv_testkit::fixtures::{hex_frames, vllm_events, vllm_hash};
use kv_testkit::indexer::Held;
use kv_testkit::{BridgeFlags, FakeWorker, TestIndexer};
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

/// What the worker holds after one batch, from the events msgspec decoded (not from our
/// decoder): a hybrid model's second group is not indexed and clears the worker after its batch.
fn apply(held: &mut Held, events: &[Value]) {
    let mut refused = false;
    for event in events {
        if event["group_idx"].as_i64().unwrap_or(0) != 0 {
            refused = true;
            continue;
        }
        match event["type"].as_str().unwrap() {
            "BlockStored" => held
                .entry(tier(&event["medium"]))
                .or_default()
                .extend(hashes(event)),
            "BlockRemoved" => {
                let set = held.entry(tier(&event["medium"])).or_default();
                for hash in hashes(event) {
                    set.remove(&hash);
                }
            }
            "AllBlocksCleared" => held.clear(),
            other => panic!("unexpected event {other}"),
        }
    }
    if refused {
        held.clear();
    }
    held.retain(|_, set| !set.is_empty());
}

#[tokio::test]
async fn applies_every_frame_of_the_real_vllm_publisher() {
    let capture = vllm_events();
    // The first publisher's messages (topic "", seq from 0); the second publisher, with its
    // own seq and topic, is another worker.
    let cases: Vec<&Value> = capture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|case| case["publisher"]["data_parallel_rank"] == 0)
        .collect();
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
    let mut refused = 0;
    for case in &cases {
        worker.send(hex_frames(&case["frames_hex"])).await;
        let events = case["decoded_wire"][1].as_array().unwrap();
        refused += events
            .iter()
            .filter(|e| e["group_idx"].as_i64().unwrap_or(0) != 0)
            .count();
        apply(&mut held, events);
        server.wait_for_held(WORKER, &held, &universe).await;
    }
    assert!(
        held.values().flatten().count() > 0,
        "the capture ends holding blocks"
    );
    assert_eq!(refused, 1, "the capture has one hybrid-group event");
    let stats = &bridge.stats;
    assert_eq!(Stats::get(&stats.gaps), 0);
    assert_eq!(Stats::get(&stats.batches), cases.len() as u64);
    assert_eq!(Stats::get(&stats.events_skipped), refused as u64);
    assert_eq!(
        Stats::get(&stats.clears),
        2,
        "start-up, then the hybrid group"
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
