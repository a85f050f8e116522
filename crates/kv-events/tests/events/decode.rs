//! Table-driven decoding tests on hand-built msgpack: every integer width, both eras with extra
//! and missing trailing elements, media, unknown events, malformed events and batches.

use crate::common::{Mp, arr, batch, ints, map, plain_stored, s, stored_arr, stored_map};
use kv_events::{DecodedBatch, Engine, Event, SkipReason, decode_batch, decode_engine_batch};
use kv_index::Tier;

/// What a payload must decode to: its events and skip reasons, or the batch error's label.
enum Want {
    Batch(Vec<Event>, Vec<SkipReason>),
    Rejected(&'static str),
}

fn check(name: &str, payload: &[u8], want: Want) {
    let got = decode_batch(payload);
    match (want, got) {
        (
            Want::Batch(events, skipped),
            Ok(DecodedBatch {
                events: got_events,
                skipped: got_skipped,
                ..
            }),
        ) => {
            assert_eq!(got_events, events, "{name}: events");
            assert_eq!(got_skipped, skipped, "{name}: skipped");
        }
        (Want::Rejected(reason), Err(error)) => {
            assert_eq!(error.reason(), reason, "{name}: {error}")
        }
        (Want::Batch(..), Err(error)) => panic!("{name}: rejected: {error} ({error:?})"),
        (Want::Rejected(reason), Ok(batch)) => panic!("{name}: expected {reason}, got {batch:?}"),
    }
}

fn ok(events: Vec<Event>) -> Want {
    Want::Batch(events, Vec::new())
}

/// The event `stored_map` / `stored_arr` describe.
fn stored(hashes: &[i64], parent: Option<i64>, tier: Tier) -> Event {
    plain_stored(hashes, parent, tier, 2, 4)
}

/// Of `events` only the good store of hash 2 decodes; the rest are skipped, for `skipped`.
fn check_kept_2(name: &str, events: Vec<Mp>, skipped: Vec<SkipReason>) {
    let kept = vec![stored(&[2], None, Tier::Hbm)];
    check(name, &batch(events).encode(), Want::Batch(kept, skipped));
}

fn removed(hashes: &[i64], tier: Tier) -> Event {
    Event::BlockRemoved {
        block_hashes: hashes.to_vec(),
        tier,
    }
}

fn one_map(entries: Vec<(&'static str, Mp)>) -> Vec<u8> {
    batch(vec![map(entries)]).encode()
}

fn one_arr(items: Vec<Mp>) -> Vec<u8> {
    batch(vec![Mp::Arr(items)]).encode()
}

fn with(
    mut entries: Vec<(&'static str, Mp)>,
    key: &'static str,
    value: Mp,
) -> Vec<(&'static str, Mp)> {
    match entries.iter_mut().find(|(k, _)| *k == key) {
        Some(entry) => entry.1 = value,
        None => entries.push((key, value)),
    }
    entries
}

fn without(mut entries: Vec<(&'static str, Mp)>, key: &str) -> Vec<(&'static str, Mp)> {
    entries.retain(|(k, _)| *k != key);
    entries
}

/// Each width SGLang (msgspec) or another encoder might pick, and the i64 it stands for.
fn widths() -> Vec<(&'static str, Mp, i64)> {
    vec![
        ("positive fixint", Mp::PosFix(0x7f), 127),
        ("positive fixint zero", Mp::PosFix(0), 0),
        ("uint8", Mp::U8(0xff), 255),
        ("uint16", Mp::U16(0xffff), 65_535),
        ("uint32", Mp::U32(0xffff_ffff), 4_294_967_295),
        ("uint64 small", Mp::U64(7), 7),
        ("uint64 i64::MAX", Mp::U64(i64::MAX as u64), i64::MAX),
        (
            "uint64 above i64::MAX",
            Mp::U64(0x8000_0000_0000_0000),
            i64::MIN,
        ),
        ("uint64 u64::MAX", Mp::U64(u64::MAX), -1),
        (
            "uint64 hash",
            Mp::U64(0xa70f_142c_376d_16f3),
            0xa70f_142c_376d_16f3_u64 as i64,
        ),
        ("negative fixint", Mp::NegFix(-32), -32),
        ("int8", Mp::I8(-128), -128),
        ("int8 positive", Mp::I8(100), 100),
        ("int16", Mp::I16(-32_768), -32_768),
        ("int32", Mp::I32(i32::MIN), i64::from(i32::MIN)),
        ("int64", Mp::I64(i64::MIN), i64::MIN),
        ("int64 positive", Mp::I64(i64::MAX), i64::MAX),
    ]
}

#[test]
fn reads_every_int_width_as_an_i64_hash() {
    for (name, value, want) in widths() {
        let hashes = arr([value.clone(), Mp::Int(1)]);
        check(
            &format!("map era, {name}"),
            &one_map(stored_map(hashes.clone(), value.clone(), "GPU")),
            ok(vec![stored(&[want, 1], Some(want), Tier::Hbm)]),
        );
        check(
            &format!("array era, {name}"),
            &one_arr(stored_arr(hashes.clone(), value.clone(), "GPU")),
            ok(vec![stored(&[want, 1], Some(want), Tier::Hbm)]),
        );
        check(
            &format!("removed, {name}"),
            &one_arr(vec![s("BlockRemoved"), hashes, s("DISK")]),
            ok(vec![removed(&[want, 1], Tier::Ssd)]),
        );
    }
    // All widths in one list.
    let all = widths();
    let want: Vec<i64> = all.iter().map(|(_, _, v)| *v).collect();
    check(
        "every width in one list",
        &one_map(stored_map(
            arr(all.into_iter().map(|(_, v, _)| v)),
            Mp::Nil,
            "CPU_PINNED",
        )),
        ok(vec![stored(&want, None, Tier::Dram)]),
    );
}

#[test]
fn reads_every_int_width_in_small_fields() {
    for (name, value, want) in widths() {
        let entries = with(
            stored_map(ints(&[5]), Mp::Nil, "GPU"),
            "lora_id",
            value.clone(),
        );
        let mut event = stored(&[5], None, Tier::Hbm);
        let Event::BlockStored(inner) = &mut event else {
            unreachable!()
        };
        inner.lora_id = Some(want);
        check(
            &format!("lora_id {name}"),
            &one_map(entries),
            ok(vec![event]),
        );

        let entries = with(
            stored_map(ints(&[5]), Mp::Nil, "GPU"),
            "block_size",
            value.clone(),
        );
        let want_size = u32::try_from(want);
        let wanted = match want_size {
            Ok(size) => {
                let mut event = stored(&[5], None, Tier::Hbm);
                let Event::BlockStored(inner) = &mut event else {
                    unreachable!()
                };
                inner.block_size = size;
                ok(vec![event])
            }
            Err(_) => Want::Batch(
                vec![],
                vec![SkipReason::Malformed("block_size is out of range")],
            ),
        };
        check(&format!("block_size {name}"), &one_map(entries), wanted);

        let payload = arr([Mp::F64(0.0), arr([]), value.clone()]).encode();
        let got = decode_batch(&payload).unwrap();
        assert_eq!(got.attn_dp_rank, Some(want), "attn_dp_rank {name}");
    }
}

#[test]
fn reads_the_batch_header() {
    let cases: Vec<(&str, Mp, f64, Option<i64>)> = vec![
        (
            "float64 ts, rank 0",
            arr([Mp::F64(1_750_000_000.25), arr([]), Mp::Int(0)]),
            1_750_000_000.25,
            Some(0),
        ),
        (
            "float32 ts",
            arr([Mp::F32(2.5), arr([]), Mp::Int(3)]),
            2.5,
            Some(3),
        ),
        (
            "integer ts",
            arr([Mp::U32(1_750_000_000), arr([]), Mp::Int(1)]),
            1_750_000_000.0,
            Some(1),
        ),
        ("nil rank", arr([Mp::F64(1.0), arr([]), Mp::Nil]), 1.0, None),
        (
            "no rank (2 elements)",
            arr([Mp::F64(1.0), arr([])]),
            1.0,
            None,
        ),
        (
            "extra trailing elements",
            arr([
                Mp::F64(1.0),
                arr([]),
                Mp::Int(2),
                s("x"),
                map([("k", ints(&[1]))]),
            ]),
            1.0,
            Some(2),
        ),
    ];
    for (name, value, ts, rank) in cases {
        let got = decode_batch(&value.encode()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((got.ts, got.attn_dp_rank), (ts, rank), "{name}");
        assert!(got.events.is_empty() && got.skipped.is_empty(), "{name}");
    }
}

#[test]
fn accepts_extra_trailing_fields_in_both_eras() {
    let mut long_store = stored_arr(ints(&[1, 2]), Mp::Nil, "GPU");
    long_store.extend([
        Mp::Nil,
        s("future"),
        map([("x", Mp::Int(1))]),
        arr([arr([])]),
    ]);
    check(
        "array-era store with 11 elements",
        &one_arr(long_store),
        ok(vec![stored(&[1, 2], None, Tier::Hbm)]),
    );
    check(
        "array-era remove with extras",
        &one_arr(vec![
            s("BlockRemoved"),
            ints(&[3]),
            s("GPU"),
            Mp::Int(9),
            s("x"),
        ]),
        ok(vec![removed(&[3], Tier::Hbm)]),
    );
    check(
        "array-era clear with extras",
        &one_arr(vec![s("AllBlocksCleared"), s("GPU"), ints(&[1])]),
        ok(vec![Event::AllBlocksCleared]),
    );
    check(
        "map-era clear with a medium",
        &one_map(vec![("type", s("AllBlocksCleared")), ("medium", s("GPU"))]),
        ok(vec![Event::AllBlocksCleared]),
    );
}

#[test]
fn ignores_unknown_map_keys() {
    let base = || stored_map(ints(&[1, 2]), Mp::Int(0), "GPU");
    let want = || ok(vec![stored(&[1, 2], Some(0), Tier::Hbm)]);
    check(
        "unknown scalar key",
        &one_map(with(base(), "priority", Mp::Int(3))),
        want(),
    );
    check(
        "unknown nested key",
        &one_map(with(
            base(),
            "extra",
            map([("a", arr([map([("b", Mp::Bin(vec![1]))])]))]),
        )),
        want(),
    );
    check(
        "unknown ext value",
        &one_map(with(base(), "ext", Mp::Ext(5, vec![1, 2, 3, 4]))),
        want(),
    );
    // Keys in another order, "type" last.
    let mut reversed = base();
    reversed.reverse();
    check("type last", &one_map(reversed), want());
    // A key that is not a string, and one that is not UTF-8.
    let mut entries: Vec<(Mp, Mp)> = base().into_iter().map(|(k, v)| (s(k), v)).collect();
    entries.insert(0, (Mp::Int(7), s("seven")));
    entries.insert(2, (Mp::Raw(vec![0xa2, 0xff, 0xfe]), ints(&[1])));
    entries.push((arr([]), Mp::Nil));
    check(
        "non-string keys",
        &batch(vec![Mp::Map(entries)]).encode(),
        want(),
    );
    // Fields of another event type are ignored too.
    check(
        "store fields on a remove",
        &one_map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[4])),
            ("medium", s("CPU_PINNED")),
            ("parent_block_hash", s("not even an int")),
            ("component_types", arr([s("swa")])),
        ]),
        ok(vec![removed(&[4], Tier::Dram)]),
    );
}

#[test]
fn treats_missing_and_nil_trailing_elements_as_absent() {
    // Without token_ids and block_size the store has neither.
    let legacy = |hashes: &[i64], tier| plain_stored(hashes, None, tier, 0, 0);
    let missing_medium = || Want::Batch(vec![], vec![SkipReason::MissingMedium]);
    let nils = vec![
        s("BlockStored"),
        ints(&[1]),
        Mp::Nil,
        Mp::Nil,
        Mp::Nil,
        Mp::Nil,
        s("GPU"),
        Mp::Nil,
    ];
    let mut short = stored_arr(ints(&[1]), Mp::Nil, "GPU");
    short.truncate(6);
    let required = vec![("type", s("BlockStored")), ("block_hashes", ints(&[1]))];
    let optional_nils = [
        ("cache_salt", Mp::Nil),
        ("session_id", Mp::Nil),
        ("lora_name", Mp::Nil),
        ("component_types", Mp::Nil),
    ];
    let cases: Vec<(&str, Vec<u8>, Want)> = vec![
        (
            "array era, every optional nil",
            one_arr(nils),
            ok(vec![legacy(&[1], Tier::Hbm)]),
        ),
        (
            "map era, only the required keys",
            one_map(with(required.clone(), "medium", s("DISK"))),
            ok(vec![legacy(&[1], Tier::Ssd)]),
        ),
        (
            "map era, optional keys nil",
            one_map([with(required, "medium", s("GPU")), optional_nils.to_vec()].concat()),
            ok(vec![legacy(&[1], Tier::Hbm)]),
        ),
        (
            "array era, store without medium",
            one_arr(short),
            missing_medium(),
        ),
        (
            "array era, store with hashes only",
            one_arr(vec![s("BlockStored"), ints(&[1])]),
            missing_medium(),
        ),
        (
            "array era, remove without medium",
            one_arr(vec![s("BlockRemoved"), ints(&[1])]),
            missing_medium(),
        ),
        (
            "array era, tag only",
            one_arr(vec![s("BlockStored")]),
            Want::Batch(
                vec![],
                vec![SkipReason::Malformed("event has no block_hashes")],
            ),
        ),
        (
            "array era, clear alone",
            one_arr(vec![s("AllBlocksCleared")]),
            ok(vec![Event::AllBlocksCleared]),
        ),
        (
            "empty hash list is an event",
            one_map(stored_map(ints(&[]), Mp::Nil, "GPU")),
            ok(vec![stored(&[], None, Tier::Hbm)]),
        ),
    ];
    for (name, payload, want) in cases {
        check(name, &payload, want);
    }
}

#[test]
fn reads_optional_strings_and_component_types() {
    let mut entries = stored_map(ints(&[9]), Mp::Nil, "GPU");
    entries.extend([
        ("cache_salt", s("salt")),
        ("session_id", s("sess")),
        ("lora_name", s("adapter")),
    ]);
    let entries = with(entries, "lora_id", Mp::Int(4));
    let Event::BlockStored(mut want) = stored(&[9], None, Tier::Hbm) else {
        unreachable!()
    };
    want.cache_salt = Some("salt".into());
    want.session_id = Some("sess".into());
    want.lora_name = Some("adapter".into());
    want.lora_id = Some(4);
    check(
        "optional strings",
        &one_map(entries),
        ok(vec![Event::BlockStored(want)]),
    );

    let labels: Vec<(&str, Mp, Option<u32>)> = vec![
        ("full", arr([s("full")]), Some(1)),
        ("full swa", arr([s("full"), s("swa")]), Some(3)),
        ("mamba", arr([s("mamba")]), Some(4)),
        ("all three", arr([s("mamba"), s("swa"), s("full")]), Some(7)),
        ("repeated", arr([s("swa"), s("swa")]), Some(2)),
        ("empty list", arr([]), Some(0)),
        ("unknown label", arr([s("FULL"), s("cross")]), Some(0)),
        (
            "non-string labels",
            arr([Mp::Int(1), s("swa"), Mp::Nil]),
            Some(2),
        ),
        ("nil", Mp::Nil, None),
    ];
    for (name, value, mask) in labels {
        let mut want = stored(&[9], None, Tier::Hbm);
        let Event::BlockStored(inner) = &mut want else {
            unreachable!()
        };
        inner.component_mask = mask;
        let entries = with(
            stored_map(ints(&[9]), Mp::Nil, "GPU"),
            "component_types",
            value.clone(),
        );
        check(
            &format!("map era, {name}"),
            &one_map(entries),
            ok(vec![want.clone()]),
        );
        let mut items = stored_arr(ints(&[9]), Mp::Nil, "GPU");
        items.push(value);
        check(
            &format!("array era, {name}"),
            &one_arr(items),
            ok(vec![want]),
        );
    }
}

#[test]
fn maps_media_to_tiers_and_skips_the_rest() {
    let media: Vec<(&str, Result<Tier, SkipReason>)> = vec![
        ("GPU", Ok(Tier::Hbm)),
        ("CPU_PINNED", Ok(Tier::Dram)),
        ("DISK", Ok(Tier::Ssd)),
        ("EXTERNAL", Err(SkipReason::ExternalMedium)),
        ("NVME", Err(SkipReason::UnknownMedium("NVME".into()))),
        ("gpu", Err(SkipReason::UnknownMedium("gpu".into()))),
        ("", Err(SkipReason::UnknownMedium(String::new()))),
    ];
    for (medium, tier) in media {
        // The skipped event sits between two good ones, which stay.
        let events = vec![
            map(stored_map(ints(&[1]), Mp::Nil, "GPU")),
            map(stored_map(ints(&[2]), Mp::Int(1), medium)),
            Mp::Arr(vec![s("BlockRemoved"), ints(&[3]), s(medium)]),
            Mp::Arr(stored_arr(ints(&[4]), Mp::Nil, "DISK")),
        ];
        let want = match tier {
            Ok(tier) => ok(vec![
                stored(&[1], None, Tier::Hbm),
                stored(&[2], Some(1), tier),
                removed(&[3], tier),
                stored(&[4], None, Tier::Ssd),
            ]),
            Err(reason) => Want::Batch(
                vec![stored(&[1], None, Tier::Hbm), stored(&[4], None, Tier::Ssd)],
                vec![reason.clone(), reason],
            ),
        };
        check(&format!("medium {medium:?}"), &batch(events).encode(), want);
    }
    let events = vec![
        map(without(stored_map(ints(&[1]), Mp::Nil, "GPU"), "medium")),
        map(stored_map(ints(&[2]), Mp::Nil, "GPU")),
        map(with(
            stored_map(ints(&[3]), Mp::Nil, "GPU"),
            "medium",
            Mp::Nil,
        )),
        map(with(
            stored_map(ints(&[4]), Mp::Nil, "GPU"),
            "medium",
            Mp::Int(1),
        )),
        map(with(
            stored_map(ints(&[5]), Mp::Nil, "GPU"),
            "medium",
            Mp::Bin(b"GPU".to_vec()),
        )),
        map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[6])),
        ]),
    ];
    check_kept_2(
        "missing, nil and non-string media",
        events,
        vec![
            SkipReason::MissingMedium,
            SkipReason::MissingMedium,
            SkipReason::Malformed("medium is not a string"),
            SkipReason::Malformed("medium is not a string"),
            SkipReason::MissingMedium,
        ],
    );
}

#[test]
fn skips_unknown_event_types() {
    let events = vec![
        map(vec![
            ("type", s("BlockPinned")),
            ("block_hashes", ints(&[1])),
            ("medium", s("GPU")),
        ]),
        Mp::Arr(vec![s("KvCacheResized"), Mp::Int(4), map([("a", Mp::Nil)])]),
        map(stored_map(ints(&[2]), Mp::Nil, "GPU")),
        Mp::Arr(vec![s("")]),
    ];
    check_kept_2(
        "unknown types around a good event",
        events,
        vec![
            SkipReason::UnknownEventType("BlockPinned".into()),
            SkipReason::UnknownEventType("KvCacheResized".into()),
            SkipReason::UnknownEventType(String::new()),
        ],
    );
}

#[test]
fn skips_malformed_events_and_keeps_the_rest() {
    let good = || map(stored_map(ints(&[100]), Mp::Nil, "GPU"));
    let store = |key: &'static str, value: Mp| {
        map(with(stored_map(ints(&[1]), Mp::Nil, "GPU"), key, value))
    };
    let cases: Vec<(&str, Mp, &'static str)> = vec![
        (
            "an integer event",
            Mp::Int(5),
            "event is neither an array nor a map",
        ),
        (
            "a string event",
            s("BlockStored"),
            "event is neither an array nor a map",
        ),
        (
            "a nil event",
            Mp::Nil,
            "event is neither an array nor a map",
        ),
        (
            "an ext event",
            Mp::Ext(1, vec![0; 8]),
            "event is neither an array nor a map",
        ),
        ("an empty array", arr([]), "event has no type"),
        (
            "a map without type",
            map([("block_hashes", ints(&[1])), ("medium", s("GPU"))]),
            "event has no type",
        ),
        (
            "an integer tag",
            Mp::Arr(vec![Mp::Int(1), ints(&[1]), s("GPU")]),
            "event type is not a string",
        ),
        ("a nil type", map([("type", Mp::Nil)]), "event has no type"),
        (
            "hashes with a string",
            store("block_hashes", arr([Mp::Int(1), s("2")])),
            "block_hashes is not an array of integers",
        ),
        (
            "hashes with nil",
            store("block_hashes", arr([Mp::Nil])),
            "block_hashes is not an array of integers",
        ),
        (
            "hashes with a float",
            store("block_hashes", arr([Mp::F64(1.0)])),
            "block_hashes is not an array of integers",
        ),
        (
            "hashes with a nested list",
            store("block_hashes", arr([ints(&[1])])),
            "block_hashes is not an array of integers",
        ),
        (
            "hashes as a map",
            store("block_hashes", map([("a", Mp::Int(1))])),
            "block_hashes is not an array of integers",
        ),
        (
            "hashes as an integer",
            store("block_hashes", Mp::Int(1)),
            "block_hashes is not an array of integers",
        ),
        (
            "hashes nil",
            store("block_hashes", Mp::Nil),
            "event has no block_hashes",
        ),
        (
            "parent as a string",
            store("parent_block_hash", s("1")),
            "parent_block_hash is not an integer",
        ),
        (
            "parent as a bool",
            store("parent_block_hash", Mp::Bool(true)),
            "parent_block_hash is not an integer",
        ),
        (
            "negative block_size",
            store("block_size", Mp::Int(-1)),
            "block_size is out of range",
        ),
        (
            "block_size over u32",
            store("block_size", Mp::U64(1 << 32)),
            "block_size is out of range",
        ),
        (
            "float block_size",
            store("block_size", Mp::F64(16.0)),
            "block_size is not an integer",
        ),
        (
            "token_ids as a string",
            store("token_ids", s("abc")),
            "token_ids is not an array",
        ),
        (
            "lora_id as a string",
            store("lora_id", s("x")),
            "lora_id is not an integer",
        ),
        (
            "cache_salt as an integer",
            store("cache_salt", Mp::Int(1)),
            "cache_salt is not a string",
        ),
        (
            "session_id as bytes",
            store("session_id", Mp::Bin(vec![1])),
            "session_id is not a string",
        ),
        (
            "lora_name as a list",
            store("lora_name", arr([])),
            "lora_name is not a string",
        ),
        (
            "component_types as a string",
            store("component_types", s("full")),
            "component_types is not an array",
        ),
        (
            "array era, hashes as a string",
            Mp::Arr(vec![s("BlockRemoved"), s("1,2"), s("GPU")]),
            "block_hashes is not an array of integers",
        ),
    ];
    for (name, event, reason) in cases {
        check(
            name,
            &batch(vec![good(), event, good()]).encode(),
            Want::Batch(
                vec![
                    stored(&[100], None, Tier::Hbm),
                    stored(&[100], None, Tier::Hbm),
                ],
                vec![SkipReason::Malformed(reason)],
            ),
        );
    }
}

#[test]
fn rejects_malformed_batches() {
    let real = batch(vec![map(stored_map(ints(&[1, 2, 3]), Mp::Nil, "GPU"))]).encode();
    let mut trailing = real.clone();
    trailing.push(0xc0);
    let cases: Vec<(&str, Vec<u8>, &'static str)> = vec![
        ("empty payload", vec![], "bad_msgpack"),
        (
            "a map",
            map([("ts", Mp::F64(1.0))]).encode(),
            "not_an_array",
        ),
        ("an integer", Mp::Int(3).encode(), "not_an_array"),
        ("a string", s("batch").encode(), "not_an_array"),
        ("nil", Mp::Nil.encode(), "not_an_array"),
        ("an empty array", arr([]).encode(), "too_short"),
        ("one element", arr([Mp::F64(1.0)]).encode(), "too_short"),
        (
            "string ts",
            arr([s("now"), arr([])]).encode(),
            "bad_timestamp",
        ),
        ("nil ts", arr([Mp::Nil, arr([])]).encode(), "bad_timestamp"),
        (
            "events as a map",
            arr([Mp::F64(1.0), map([])]).encode(),
            "events_not_an_array",
        ),
        (
            "events nil",
            arr([Mp::F64(1.0), Mp::Nil]).encode(),
            "events_not_an_array",
        ),
        (
            "string rank",
            arr([Mp::F64(1.0), arr([]), s("0")]).encode(),
            "bad_rank",
        ),
        ("reserved marker", vec![0xc1], "bad_msgpack"),
        (
            "garbage",
            b"\x93\xcb\x41\xda\xc1\xc1".to_vec(),
            "bad_msgpack",
        ),
        (
            "not msgpack at all",
            b"{\"ts\": 1}".to_vec(),
            "not_an_array",
        ),
        ("a byte after the batch", trailing, "trailing_bytes"),
        (
            "two batches",
            [real.clone(), real.clone()].concat(),
            "trailing_bytes",
        ),
        (
            "array32 claiming 4 billion elements",
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],
            "bad_msgpack",
        ),
        (
            "events claiming 4 billion elements",
            vec![
                0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
            ],
            "bad_msgpack",
        ),
        (
            "block_hashes claiming 4 billion elements",
            one_map(stored_map(
                Mp::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xff]),
                Mp::Nil,
                "GPU",
            )),
            "bad_msgpack",
        ),
        (
            "a str32 claiming 4 GiB",
            vec![
                0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff,
            ],
            "bad_msgpack",
        ),
        (
            "nesting deeper than the limit",
            [
                vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0],
                vec![0x91; 100_000],
            ]
            .concat(),
            "bad_msgpack",
        ),
    ];
    for (name, payload, reason) in cases {
        check(name, &payload, Want::Rejected(reason));
    }
    // Every strict prefix of a real batch is truncated msgpack.
    for len in 0..real.len() {
        check(
            &format!("truncated to {len} bytes"),
            &real[..len],
            Want::Rejected("bad_msgpack"),
        );
    }
}

#[test]
fn labels_every_skip_reason() {
    let reasons = [
        (SkipReason::UnknownMedium("X".into()), "unknown_medium"),
        (SkipReason::MissingMedium, "missing_medium"),
        (SkipReason::ExternalMedium, "external_medium"),
        (
            SkipReason::UnknownEventType("X".into()),
            "unknown_event_type",
        ),
        (SkipReason::Malformed("x"), "malformed"),
        (SkipReason::HybridGroup(1), "hybrid_group"),
        (SkipReason::SpecKind("mamba".into()), "spec_kind"),
    ];
    for (reason, label) in reasons {
        assert_eq!(reason.reason(), label);
    }
}

/// What one vLLM map event decodes to, and whether the batch then hides a removal.
fn vllm(entries: Vec<(&'static str, Mp)>) -> (Result<Event, SkipReason>, bool) {
    let batch = decode_engine_batch(Engine::Vllm, &one_map(entries)).unwrap();
    let hides = batch.hides_removal;
    match (batch.events.as_slice(), batch.skipped.as_slice()) {
        ([event], []) => (Ok(event.clone()), hides),
        ([], [reason]) => (Err(reason.clone()), hides),
        other => panic!("one event expected: {other:?}"),
    }
}

fn vllm_removed(medium: Mp) -> Vec<(&'static str, Mp)> {
    vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", ints(&[2])),
        ("medium", medium),
    ]
}

#[test]
fn vllm_media_groups_and_kinds() {
    let store = |medium: Mp| with(stored_map(ints(&[2]), Mp::Nil, "GPU"), "medium", medium);
    let tier_of = |medium: Mp| match vllm(store(medium)).0 {
        Ok(Event::BlockStored(stored)) => Ok(stored.tier),
        Ok(other) => panic!("{other:?}"),
        Err(reason) => Err(reason),
    };
    assert_eq!(tier_of(s("GPU")), Ok(Tier::Hbm));
    assert_eq!(tier_of(s("CPU")), Ok(Tier::Dram));
    assert_eq!(tier_of(s("STORAGE")), Ok(Tier::Ssd));
    assert_eq!(
        tier_of(Mp::Nil),
        Ok(Tier::Hbm),
        "vLLM's optional medium is the GPU pool"
    );
    // Exact names: vLLM's connectors' "cpu" stores are never removed, so never indexed.
    for unknown in ["cpu", "Gpu"] {
        assert_eq!(
            tier_of(s(unknown)),
            Err(SkipReason::UnknownMedium(unknown.into()))
        );
    }
    for sglang_only in ["CPU_PINNED", "DISK", "EXTERNAL"] {
        assert_eq!(
            tier_of(s(sglang_only)),
            Err(SkipReason::UnknownMedium(sglang_only.into()))
        );
    }
    // Group 0 and full or MLA attention are indexed; anything else is refused, and a hybrid
    // model's group hides what its removals mean.
    let grouped = |group: i64, kind: Option<&str>| {
        let mut entries = with(store(s("GPU")), "group_idx", Mp::Int(group));
        if let Some(kind) = kind {
            entries.push(("kv_cache_spec_kind", s(kind)));
        }
        vllm(entries)
    };
    assert!(grouped(0, None).0.is_ok());
    assert!(grouped(0, Some("full_attention")).0.is_ok());
    assert!(grouped(0, Some("mla_attention")).0.is_ok());
    assert_eq!(grouped(1, None), (Err(SkipReason::HybridGroup(1)), true));
    assert_eq!(
        grouped(0, Some("sliding_window")),
        (Err(SkipReason::SpecKind("sliding_window".into())), false)
    );
    // A digest shorter than 8 bytes is no hash.
    let short = vllm(with(
        store(s("GPU")),
        "block_hashes",
        arr([Mp::Bin(vec![1; 7])]),
    ));
    assert!(
        matches!(short, (Err(SkipReason::Malformed(_)), false)),
        "{short:?}"
    );
    let digest = vllm(with(
        store(s("GPU")),
        "block_hashes",
        arr([Mp::Bin((1..=32).collect())]),
    ));
    let Ok(Event::BlockStored(stored)) = digest.0 else {
        panic!("{digest:?}")
    };
    assert_eq!(
        stored.block_hashes,
        vec![i64::from_be_bytes([25, 26, 27, 28, 29, 30, 31, 32])]
    );
}

#[test]
fn a_skipped_event_that_may_be_a_removal_hides_one() {
    let removal = |medium: Mp| vllm(vllm_removed(medium));
    assert!(!removal(s("GPU")).1);
    assert_eq!(
        removal(s("TAPE")),
        (Err(SkipReason::UnknownMedium("TAPE".into())), true)
    );
    assert!(matches!(
        removal(Mp::Int(3)),
        (Err(SkipReason::Malformed(_)), true)
    ));
    let bad_hashes = with(vllm_removed(s("GPU")), "block_hashes", s("x"));
    assert!(matches!(
        vllm(bad_hashes),
        (Err(SkipReason::Malformed(_)), true)
    ));
    let no_type = without(vllm_removed(s("GPU")), "type");
    assert!(matches!(
        vllm(no_type),
        (Err(SkipReason::Malformed(_)), true)
    ));
    // A type this version does not know is a newer engine's addition, not a removal; a bad
    // store is not one either.
    let newer = with(vllm_removed(s("GPU")), "type", s("BlockPinned"));
    assert_eq!(
        vllm(newer),
        (
            Err(SkipReason::UnknownEventType("BlockPinned".into())),
            false
        )
    );
    let bad_store = with(stored_map(ints(&[2]), Mp::Nil, "GPU"), "block_size", s("x"));
    assert!(matches!(
        vllm(bad_store),
        (Err(SkipReason::Malformed(_)), false)
    ));
    // SGLang follows the same rule.
    let sglang = decode_batch(&one_map(vllm_removed(s("TAPE")))).unwrap();
    assert!(sglang.hides_removal);
    // Blocks of a kind never indexed: their removal hides nothing.
    let mut swa = vllm_removed(s("CPU"));
    swa.push(("kv_cache_spec_kind", s("sliding_window")));
    assert_eq!(
        vllm(swa),
        (Err(SkipReason::SpecKind("sliding_window".into())), false)
    );
    let external = decode_batch(&one_map(vllm_removed(s("EXTERNAL")))).unwrap();
    assert!(!external.hides_removal, "EXTERNAL is never indexed");
}
