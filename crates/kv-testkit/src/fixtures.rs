//! The golden vectors captured from the real SGLang publisher (`fixtures/`, provenance in the
//! README there), for every crate's tests and benchmarks.

use std::path::PathBuf;

use serde_json::Value;

/// The path of a fixture file.
pub fn path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// The rows of a JSONL fixture.
pub fn rows(name: &str) -> Vec<Value> {
    let path = path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).expect("a fixture row is JSON"))
        .collect()
}

/// Bytes from lowercase or uppercase hex.
pub fn unhex(hex: &str) -> Vec<u8> {
    assert!(hex.len().is_multiple_of(2), "odd hex length");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digits"))
        .collect()
}

/// The msgpack payloads of an `sglang-events-*` fixture, in order.
pub fn payloads(name: &str) -> Vec<Vec<u8>> {
    rows(name)
        .iter()
        .map(|row| unhex(row["payload_hex"].as_str().expect("payload_hex")))
        .collect()
}
