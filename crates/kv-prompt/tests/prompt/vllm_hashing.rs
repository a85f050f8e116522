//! Every reproducible golden vector made by the real vLLM 0.33.0 wheel's hashing functions
//! (`tests/fixtures/vllm-hash-vectors.json`; how they were made: `scripts/vllm/README.md`).

use kv_prompt::vllm_hashing::{ExtraKeys, VllmHashAlgo, VllmHasher, event_hash, event_hash_of};
use serde_json::Value;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn reproduces_every_sha256_and_sha256_cbor_vector_of_the_real_wheel() {
    let fixture: Value =
        serde_json::from_str(include_str!("../fixtures/vllm-hash-vectors.json")).unwrap();
    let mut checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let Ok(algo) = case["algo"].as_str().unwrap().parse::<VllmHashAlgo>() else {
            continue; // xxhash: not reproducible outside the process without a seed
        };
        if !case["mm_features"].as_array().unwrap().is_empty() {
            continue; // multimodal keys are not reproduced
        }
        let block_size = case["block_size"].as_u64().unwrap() as usize;
        let hasher = VllmHasher::new(algo, block_size, case["seed"].as_str()).unwrap();
        assert_eq!(
            hex(&hasher.none_hash()),
            case["none_hash_hex"].as_str().unwrap(),
            "{name}: NONE_HASH"
        );
        let tokens: Vec<u64> = serde_json::from_value(case["token_ids"].clone()).unwrap();
        let lora = case["lora_name"]
            .as_str()
            .map(|n| (n, case["lora_path"].as_str().unwrap()));
        let extra = ExtraKeys {
            lora,
            cache_salt: case["cache_salt"].as_str(),
        };
        let digests: Vec<String> = hasher
            .block_digests(&tokens, extra)
            .iter()
            .map(|d| hex(d))
            .collect();
        let expected: Vec<String> =
            serde_json::from_value(case["block_hashes_hex"].clone()).unwrap();
        assert_eq!(digests, expected, "{name}");
        // The event's int form (a u64) is the Indexer's i64 by `as`, and the same as the
        // digest's.
        let ints: Vec<u64> = serde_json::from_value(case["block_hashes_int"].clone()).unwrap();
        let as_i64: Vec<i64> = ints.iter().map(|&n| n as i64).collect();
        assert_eq!(hasher.block_hashes(&tokens, extra), as_i64, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 60);
}

#[test]
fn the_int_and_raw_forms_of_an_event_hash_map_to_one_value() {
    let digest: [u8; 32] = std::array::from_fn(|i| i as u8 + 0xe0);
    let tail = u64::from_be_bytes(digest[24..].try_into().unwrap());
    assert!(tail > i64::MAX as u64, "a hash above 2^63 as vLLM sends it");
    assert_eq!(event_hash(&digest), tail as i64);
    assert_eq!(event_hash_of(&digest), Some(tail as i64));
    assert_eq!(event_hash_of(&digest[..7]), None);
}

#[test]
fn refuses_an_unreproducible_algorithm_and_a_bad_block_size_naming_them() {
    let error = "xxhash".parse::<VllmHashAlgo>().unwrap_err();
    assert!(
        error.contains("xxhash") && error.contains("PYTHONHASHSEED"),
        "{error}"
    );
    let error = VllmHasher::new(VllmHashAlgo::Sha256, 0, None).unwrap_err();
    assert!(error.to_string().contains("block size 0"), "{error}");
}
