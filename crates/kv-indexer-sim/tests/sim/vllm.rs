//! The simulator as a vLLM worker (`--engine vllm`): its payloads are byte for byte what vLLM
//! 0.33.0's own publisher sent for the same events (`kv-testkit/fixtures/vllm-events-0.33.0.json`),
//! its hashes are vLLM's, and it serves vLLM's API shape, not SGLang's.

use kv_indexer_sim::events::{BlockRemoved, BlockStored, Encoder, Encoding, Event, Medium};
use kv_indexer_sim::{Config, Listeners, Worker};
use kv_prompt::BlockHasher;
use kv_prompt::vllm_hashing::{VllmHashAlgo, VllmHasher};
use kv_testkit::fixtures::{hex_frames, vllm_events, vllm_hash};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn medium(value: &Value) -> Medium {
    match value.as_str() {
        Some("GPU") => Medium::Gpu,
        Some("CPU") => Medium::CpuPinned,
        other => panic!("not simulated: {other:?}"),
    }
}

/// The captured event as the simulator's, if the simulator can emit it (GPU block pool shape:
/// `group_idx` 0, no LoRA, no optional fields).
fn simulated(event: &Value) -> Option<Event> {
    let plain = event["group_idx"] == 0
        && event["lora_id"].is_null()
        && ["extra_keys", "kv_cache_spec_kind", "locality", "session_id"]
            .iter()
            .all(|key| event.get(key).is_none());
    let hashes = |v: &Value| v.as_array().unwrap().iter().map(vllm_hash).collect();
    match event["type"].as_str().unwrap() {
        "AllBlocksCleared" => Some(Event::AllBlocksCleared),
        "BlockStored" if plain && event["medium"] == "GPU" => {
            Some(Event::BlockStored(BlockStored::new(
                hashes(&event["block_hashes"]),
                (!event["parent_block_hash"].is_null())
                    .then(|| vllm_hash(&event["parent_block_hash"])),
                event["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap())
                    .collect(),
                event["block_size"].as_u64().unwrap() as u32,
                medium(&event["medium"]),
            )))
        }
        "BlockRemoved" if plain && event["medium"] == "GPU" => {
            Some(Event::BlockRemoved(BlockRemoved {
                block_hashes: hashes(&event["block_hashes"]),
                medium: medium(&event["medium"]),
            }))
        }
        _ => None,
    }
}

/// A test worker (`Config::default()`) as vLLM with 16-token blocks.
fn vllm_config() -> Config {
    Config::default().vllm(VllmHasher::new(VllmHashAlgo::Sha256, 16, None).unwrap())
}

#[test]
fn encodes_vllm_batches_exactly_as_its_publisher() {
    let capture = vllm_events();
    let encoder = Encoder::new(Encoding::Vllm);
    let mut compared = 0;
    for case in capture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let wire = &case["decoded_wire"];
        let Some(events) = wire[1]
            .as_array()
            .unwrap()
            .iter()
            .map(simulated)
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        // Only the int form: the simulator keeps hashes as the Indexer does.
        if wire[1].to_string().contains("$bytes") {
            continue;
        }
        let payload = encoder.batch(wire[0].as_f64().unwrap(), &events, wire[2].as_i64());
        let captured = &hex_frames(&case["frames_hex"])[2];
        assert_eq!(
            &payload, captured,
            "{name}: the simulator's bytes differ from vLLM's"
        );
        compared += 1;
    }
    assert!(compared >= 8, "only {compared} cases compared");
}

#[test]
fn the_hashes_are_vllms() {
    let capture = vllm_events();
    let real = &capture["real_block_hashes"];
    let tokens: Vec<u64> = real["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let config = vllm_config();
    let BlockHasher::Vllm(hasher) = config.hash() else {
        panic!("a vLLM hasher")
    };
    let expected: Vec<i64> = real["hashes_int"]
        .as_array()
        .unwrap()
        .iter()
        .map(vllm_hash)
        .collect();
    assert_eq!(config.hash().block_hashes(&tokens, None), expected);
    assert_eq!(hasher.block_size(), 16);
}

#[test]
fn flags_choose_the_engine_and_refuse_sglang_only_settings() {
    let parse = |args: &[&str]| {
        let argv = [&["kv-indexer-sim"][..], args].concat();
        let args = <kv_indexer_sim::config::Args as clap::Parser>::try_parse_from(argv).unwrap();
        Config::from_args(args)
    };
    let config = parse(&[
        "--engine",
        "vllm",
        "--vllm-hash-algo",
        "sha256_cbor",
        "--vllm-hash-seed",
        "0",
    ])
    .unwrap();
    assert_eq!(config.engine(), "vllm");
    assert_eq!(config.publisher.encoder.encoding, Encoding::Vllm);
    let expected = VllmHasher::new(VllmHashAlgo::Sha256Cbor, 16, Some("0")).unwrap();
    assert_eq!(config.hash(), BlockHasher::Vllm(expected));
    for (args, flag) in [
        (
            &["--engine", "vllm", "--speculative-algorithm", "EAGLE"][..],
            "speculative-algorithm",
        ),
        (
            &["--engine", "vllm", "--component-types", "full,swa"][..],
            "component-types",
        ),
        (&["--engine", "vllm", "--encoding", "array"][..], "encoding"),
        (
            &[
                "--engine",
                "vllm",
                "--page-size",
                "8192",
                "--capacity-tokens",
                "65536",
            ][..],
            "page-size",
        ),
    ] {
        let error = parse(args).unwrap_err();
        assert_eq!(error.flag, flag, "{args:?}: {error}");
    }
}

#[tokio::test]
async fn serves_vllms_api_not_sglangs() {
    let config = vllm_config();
    let listeners = Listeners::bind(&config).await.unwrap();
    let worker = Worker::start(&config, listeners).await.unwrap();
    let url = worker.endpoints().http_url();
    let stop = CancellationToken::new();
    let task = tokio::spawn(worker.serve(stop.clone().cancelled_owned()));
    let http = reqwest::Client::new();
    let send = |request: reqwest::RequestBuilder| async move {
        let response = request.send().await.unwrap();
        (response.status(), response.text().await.unwrap())
    };
    let prompt: Vec<u64> = (1..=40).collect();
    let mut cached = Vec::new();
    for _ in 0..2 {
        let body = json!({"model": "kv-indexer-sim", "prompt": prompt, "max_tokens": 1});
        let request = http
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .body(body.to_string());
        let answer: Value = serde_json::from_str(&send(request).await.1).unwrap();
        let details = &answer["usage"]["prompt_tokens_details"];
        cached.push(details["cached_tokens"].as_u64().unwrap());
    }
    assert_eq!(
        cached,
        [0, 32],
        "two full 16-token blocks hit the second time"
    );
    let models = send(http.get(format!("{url}/v1/models"))).await.1;
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    let metrics = send(http.get(format!("{url}/metrics"))).await.1;
    assert!(
        metrics
            .contains("vllm:num_requests_running{engine=\"0\",model_name=\"kv-indexer-sim\"} 0.0"),
        "{metrics}"
    );
    assert!(metrics.contains("vllm:num_requests_waiting{"), "{metrics}");
    assert!(
        metrics.contains("block_size=\"16\"")
            && metrics.contains("prefix_caching_hash_algo=\"sha256\""),
        "{metrics}"
    );
    for sglang_only in ["/server_info", "/get_load"] {
        let status = send(http.get(format!("{url}{sglang_only}"))).await.0;
        assert_eq!(status, 404, "{sglang_only}");
    }
    let reset = send(http.post(format!("{url}/reset_prefix_cache"))).await.0;
    assert_eq!(reset, 200);
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[test]
fn a_removal_of_several_blocks_is_one_vllm_event_per_block() {
    let removed = Event::BlockRemoved(BlockRemoved {
        block_hashes: vec![7, -8],
        medium: Medium::CpuPinned,
    });
    let payload = Encoder::new(Encoding::Vllm).batch(1.0, &[removed], Some(0));
    let batch = kv_events::decode_engine_batch(kv_events::Engine::Vllm, &payload).unwrap();
    let one = |hash| kv_events::Event::BlockRemoved {
        block_hashes: vec![hash],
        tier: kv_index::Tier::Dram,
    };
    assert_eq!(batch.events, vec![one(7), one(-8)]);
}
