//! Every golden vector captured from SGLang's block hashing.

use kv_prompt::hashing::{HashConfig, block_hashes};
use serde_json::Value;

#[test]
fn reproduces_every_golden_vector() {
    let text = include_str!("../fixtures/block-hashes.jsonl");
    let mut checked = 0;
    for (line, row) in text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .enumerate()
    {
        let tokens: Vec<u64> = serde_json::from_value(row["token_ids"].clone()).unwrap();
        let config = HashConfig {
            block_size: row["block_size"].as_u64().unwrap() as usize,
            bigram: row["bigram"].as_bool().unwrap(),
        };
        let salt = row.get("cache_salt").and_then(Value::as_str);
        let expected: Vec<i64> = serde_json::from_value(row["hashes"].clone()).unwrap();
        assert_eq!(
            block_hashes(&tokens, config, salt),
            expected,
            "row {line}: {config:?} salt {salt:?} tokens {tokens:?}"
        );
        checked += 1;
    }
    assert_eq!(checked, 68);
}

#[test]
fn a_zero_block_size_yields_nothing() {
    assert!(
        block_hashes(
            &[1, 2, 3],
            HashConfig {
                block_size: 0,
                bigram: false
            },
            None
        )
        .is_empty()
    );
}

#[test]
fn a_chain_prefix_has_the_same_hashes() {
    let config = HashConfig {
        block_size: 4,
        bigram: false,
    };
    let long = block_hashes(&(0..40).collect::<Vec<u64>>(), config, None);
    let short = block_hashes(&(0..16).collect::<Vec<u64>>(), config, None);
    assert_eq!(&long[..4], &short[..]);
    let salted = block_hashes(&(0..16).collect::<Vec<u64>>(), config, Some("tenant"));
    assert!(salted.iter().zip(&short).all(|(a, b)| a != b));
}
