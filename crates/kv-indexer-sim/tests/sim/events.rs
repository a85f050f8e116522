//! The simulator's payloads against the real publisher's: every captured SGLang batch,
//! rebuilt as the simulator's events and encoded, gives the captured bytes exactly (same keys,
//! same order, same integer widths), and what the simulator encodes decodes with the bridge's
//! decoder (`kv_events::decode_batch`) to the events it meant.

use kv_index::Tier;
use kv_indexer_sim::events::{BlockRemoved, BlockStored, Encoder, Encoding, Event, Medium};
use serde_json::Value;

use kv_testkit::fixtures::{rows as fixture, unhex};

/// A msgpack integer as SGLang's i64 (uints above i64::MAX are reinterpreted).
fn int(value: &Value) -> i64 {
    value
        .as_i64()
        .or_else(|| value.as_u64().map(|u| u as i64))
        .unwrap_or_else(|| panic!("not an integer: {value}"))
}

fn opt_int(value: Option<&Value>) -> Option<i64> {
    value.filter(|v| !v.is_null()).map(int)
}

fn opt_str(value: Option<&Value>) -> Option<String> {
    value
        .filter(|v| !v.is_null())
        .map(|v| v.as_str().unwrap().to_string())
}

fn medium(value: &Value) -> Medium {
    match value.as_str() {
        Some("GPU") => Medium::Gpu,
        Some("CPU_PINNED") => Medium::CpuPinned,
        other => panic!("unexpected medium {other:?}"),
    }
}

fn ints(value: &Value) -> Vec<i64> {
    value.as_array().unwrap().iter().map(int).collect()
}

fn tokens(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn labels(value: Option<&Value>) -> Vec<String> {
    value
        .filter(|v| !v.is_null())
        .map(|v| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// One captured event as the simulator's [`Event`], with its `component_types` labels.
fn rebuild(event: &Value) -> (Event, Vec<String>) {
    match event {
        Value::Object(map) => match map["type"].as_str().unwrap() {
            "BlockStored" => (
                Event::BlockStored(BlockStored {
                    block_hashes: ints(&map["block_hashes"]),
                    parent_block_hash: opt_int(map.get("parent_block_hash")),
                    token_ids: tokens(&map["token_ids"]),
                    block_size: int(&map["block_size"]) as u32,
                    lora_id: opt_int(map.get("lora_id")),
                    medium: medium(&map["medium"]),
                    cache_salt: opt_str(map.get("cache_salt")),
                    session_id: opt_str(map.get("session_id")),
                    lora_name: opt_str(map.get("lora_name")),
                }),
                labels(map.get("component_types")),
            ),
            "BlockRemoved" => (
                Event::BlockRemoved(BlockRemoved {
                    block_hashes: ints(&map["block_hashes"]),
                    medium: medium(&map["medium"]),
                }),
                Vec::new(),
            ),
            "AllBlocksCleared" => (Event::AllBlocksCleared, Vec::new()),
            other => panic!("unexpected event {other}"),
        },
        Value::Array(items) => match items[0].as_str().unwrap() {
            "BlockStored" => (
                Event::BlockStored(BlockStored::new(
                    ints(&items[1]),
                    opt_int(items.get(2)),
                    tokens(&items[3]),
                    int(&items[4]) as u32,
                    medium(&items[6]),
                )),
                labels(items.get(7)),
            ),
            "BlockRemoved" => (
                Event::BlockRemoved(BlockRemoved {
                    block_hashes: ints(&items[1]),
                    medium: medium(&items[2]),
                }),
                Vec::new(),
            ),
            "AllBlocksCleared" => (Event::AllBlocksCleared, Vec::new()),
            other => panic!("unexpected event {other}"),
        },
        other => panic!("unexpected event shape {other}"),
    }
}

/// Re-encodes every payload of a fixture file from its decoded content and compares bytes.
fn check_byte_exact(name: &str, encoding_of: impl Fn(&Value) -> Encoding) -> usize {
    let rows = fixture(name);
    for row in &rows {
        let payload = unhex(row["payload_hex"].as_str().unwrap());
        let batch: Value = rmp_serde::from_slice(&payload).unwrap();
        let batch = batch.as_array().unwrap();
        let ts = batch[0].as_f64().unwrap();
        let rank = opt_int(batch.get(2));
        let mut component_types = None;
        let events: Vec<Event> = batch[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|event| {
                let (event, labels) = rebuild(event);
                if matches!(event, Event::BlockStored(_)) {
                    let first = component_types.get_or_insert_with(|| labels.clone());
                    assert_eq!(first, &labels, "one label set per batch in {name}");
                }
                event
            })
            .collect();
        let encoder = Encoder {
            encoding: encoding_of(row),
            component_types: component_types.unwrap_or_default(),
        };
        let ours = encoder.batch(ts, &events, rank);
        assert_eq!(
            hex(&ours),
            hex(&payload),
            "{name} row {row}: the simulator's bytes differ"
        );
    }
    rows.len()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn map_era_payloads_are_byte_identical_to_sglang_0_5_23() {
    let rows = check_byte_exact("sglang-events-0.5.23.jsonl", |_| Encoding::Map);
    assert!(rows >= 100, "{rows} rows");
}

#[test]
fn array_era_payloads_are_byte_identical_to_sglang_0_5_18() {
    let rows = check_byte_exact("sglang-events-0.5.18.jsonl", |_| Encoding::Array);
    assert!(rows >= 100, "{rows} rows");
}

#[test]
fn component_types_payloads_are_byte_identical_in_both_eras() {
    let rows = check_byte_exact(
        "sglang-events-component-types.jsonl",
        |row| match row["era"].as_str().unwrap() {
            "map" => Encoding::Map,
            "array" => Encoding::Array,
            other => panic!("era {other}"),
        },
    );
    assert!(rows >= 8, "{rows} rows");
}

/// The keys of one map-era event, in the order the bytes hold them.
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Keys, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some((key, _)) = map.next_entry::<String, serde::de::IgnoredAny>()? {
                    keys.push(key);
                }
                Ok(Keys(keys))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

fn event_keys(payload: &[u8]) -> Vec<Vec<String>> {
    let (_ts, events, _rank): (f64, Vec<Keys>, Option<i64>) =
        rmp_serde::from_slice(payload).unwrap();
    events.into_iter().map(|keys| keys.0).collect()
}

#[test]
fn a_simulated_stored_event_has_the_keys_of_a_real_one_in_order() {
    // A real legacy BlockStored of 0.5.23, as captured: seq 0's first event.
    let real = unhex(
        fixture("sglang-events-0.5.23.jsonl")[0]["payload_hex"]
            .as_str()
            .unwrap(),
    );
    let real_keys = event_keys(&real);
    let ours = Encoder::new(Encoding::Map).batch(
        1.0,
        &[
            Event::BlockStored(BlockStored::new(
                vec![1, -2],
                None,
                (0..32).collect(),
                16,
                Medium::Gpu,
            )),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![3],
                medium: Medium::CpuPinned,
            }),
            Event::AllBlocksCleared,
        ],
        Some(0),
    );
    let our_keys = event_keys(&ours);
    assert_eq!(our_keys[0], real_keys[0]);
    assert_eq!(
        our_keys[0],
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium"
        ]
    );
    assert_eq!(our_keys[1], ["type", "block_hashes", "medium"]);
    assert_eq!(our_keys[2], ["type"]);
}

fn tier(medium: Medium) -> Tier {
    match medium {
        Medium::Gpu => Tier::Hbm,
        Medium::CpuPinned => Tier::Dram,
    }
}

/// What the bridge's decoder must make of one of our events.
fn expected(event: &Event, mask: Option<u32>) -> kv_events::Event {
    match event {
        Event::BlockStored(stored) => kv_events::Event::BlockStored(kv_events::BlockStored {
            block_hashes: stored.block_hashes.clone(),
            parent_block_hash: stored.parent_block_hash,
            block_size: stored.block_size,
            tier: tier(stored.medium),
            component_mask: mask,
            lora_id: stored.lora_id,
            cache_salt: None,
            session_id: None,
            lora_name: None,
            n_token_ids: stored.token_ids.len(),
        }),
        Event::BlockRemoved(removed) => kv_events::Event::BlockRemoved {
            block_hashes: removed.block_hashes.clone(),
            tier: tier(removed.medium),
        },
        Event::AllBlocksCleared => kv_events::Event::AllBlocksCleared,
    }
}

fn check_decodes(encoder: &Encoder, mask: Option<u32>) {
    let events = vec![
        Event::BlockStored(BlockStored::new(
            vec![i64::MIN, -1, 0, 1, i64::MAX],
            Some(-77),
            (0..80).map(|t| t * 40_000).collect(),
            16,
            Medium::Gpu,
        )),
        Event::BlockStored(BlockStored::new(
            vec![5],
            None,
            vec![u64::MAX; 16],
            16,
            Medium::CpuPinned,
        )),
        Event::BlockRemoved(BlockRemoved {
            block_hashes: vec![1, i64::MAX],
            medium: Medium::Gpu,
        }),
        Event::AllBlocksCleared,
    ];
    let payload = encoder.batch(1_750_000_000.25, &events, Some(0));
    let decoded = kv_events::decode_batch(&payload).unwrap();
    assert_eq!(decoded.ts, 1_750_000_000.25);
    assert_eq!(decoded.attn_dp_rank, Some(0));
    assert!(decoded.skipped.is_empty(), "{:?}", decoded.skipped);
    let want: Vec<kv_events::Event> = events.iter().map(|e| expected(e, mask)).collect();
    assert_eq!(decoded.events, want);
    // An empty batch and a nil rank decode too.
    let empty = kv_events::decode_batch(&encoder.batch(0.5, &[], None)).unwrap();
    assert!(empty.events.is_empty());
    assert_eq!(empty.attn_dp_rank, None);
}

#[test]
fn map_and_array_payloads_decode_to_the_events_meant() {
    check_decodes(&Encoder::new(Encoding::Map), None);
    check_decodes(&Encoder::new(Encoding::Array), None);
}

#[test]
fn component_type_labels_decode_to_their_mask() {
    for encoding in [Encoding::Map, Encoding::Array] {
        for (labels, mask) in [
            (&["full"][..], 1),
            (&["full", "swa"], 3),
            (&["full", "mamba"], 5),
        ] {
            let encoder = Encoder {
                encoding,
                component_types: labels.iter().map(|l| l.to_string()).collect(),
            };
            check_decodes(&encoder, Some(mask));
        }
    }
}
