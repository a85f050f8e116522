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

/// The capture of vLLM 0.33.0's publisher (`fixtures/vllm-events-0.33.0.json`).
pub fn vllm_events() -> Value {
    let path = path("vllm-events-0.33.0.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
    serde_json::from_str(&text).expect("the vLLM capture is JSON")
}

/// The captured case `name` of the vLLM capture.
pub fn vllm_case<'a>(capture: &'a Value, name: &str) -> &'a Value {
    capture["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|case| case["name"] == name)
        .unwrap_or_else(|| panic!("no case {name} in the vLLM capture"))
}

/// The frames of a captured message (`frames_hex`, or one reply of `reply_messages_hex`).
pub fn hex_frames(frames: &Value) -> Vec<Vec<u8>> {
    frames
        .as_array()
        .expect("an array of hex frames")
        .iter()
        .map(|frame| unhex(frame.as_str().expect("a hex frame")))
        .collect()
}

/// A vLLM block hash as the capture wrote it (an unsigned int, or `{"$bytes": hex}` for a
/// raw digest) in the index's signed field: the same bits, the digest's last 8 bytes.
pub fn vllm_hash(value: &Value) -> i64 {
    if let Some(hex) = value.get("$bytes").and_then(Value::as_str) {
        let digest = unhex(hex);
        let tail: [u8; 8] = digest[digest.len() - 8..].try_into().unwrap();
        return i64::from_be_bytes(tail);
    }
    value
        .as_u64()
        .unwrap_or_else(|| panic!("{value} is not an unsigned hash")) as i64
}
