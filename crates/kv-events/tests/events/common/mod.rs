//! Shared by the integration tests: a msgpack value builder with explicit integer widths, and
//! fixture loading.

#![allow(dead_code)] // each test binary uses its own part

use kv_events::{BlockStored, Event};
use kv_index::Tier;

/// A msgpack value, written with exactly the marker its variant names.
#[derive(Debug, Clone)]
pub enum Mp {
    Nil,
    Bool(bool),
    /// The smallest encoding (msgspec's choice for small values).
    Int(i64),
    PosFix(u8),
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
    NegFix(i8),
    I8(i8),
    I16(i16),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Str(String),
    Bin(Vec<u8>),
    Ext(i8, Vec<u8>),
    Arr(Vec<Mp>),
    Map(Vec<(Mp, Mp)>),
    /// Bytes written as they are.
    Raw(Vec<u8>),
}

impl Mp {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        use rmp::encode as e;
        match self {
            Mp::Nil => e::write_nil(out).unwrap(),
            Mp::Bool(v) => e::write_bool(out, *v).unwrap(),
            Mp::Int(v) => {
                e::write_sint(out, *v).unwrap();
            }
            Mp::PosFix(v) => e::write_pfix(out, *v).unwrap(),
            Mp::U8(v) => e::write_u8(out, *v).unwrap(),
            Mp::U16(v) => e::write_u16(out, *v).unwrap(),
            Mp::U32(v) => e::write_u32(out, *v).unwrap(),
            Mp::U64(v) => e::write_u64(out, *v).unwrap(),
            Mp::NegFix(v) => e::write_nfix(out, *v).unwrap(),
            Mp::I8(v) => e::write_i8(out, *v).unwrap(),
            Mp::I16(v) => e::write_i16(out, *v).unwrap(),
            Mp::I32(v) => e::write_i32(out, *v).unwrap(),
            Mp::I64(v) => e::write_i64(out, *v).unwrap(),
            Mp::F32(v) => e::write_f32(out, *v).unwrap(),
            Mp::F64(v) => e::write_f64(out, *v).unwrap(),
            Mp::Str(v) => e::write_str(out, v).unwrap(),
            Mp::Bin(v) => e::write_bin(out, v).unwrap(),
            Mp::Ext(ty, data) => {
                e::write_ext_meta(out, data.len() as u32, *ty).unwrap();
                out.extend_from_slice(data);
            }
            Mp::Arr(items) => {
                e::write_array_len(out, items.len() as u32).unwrap();
                for item in items {
                    item.write(out);
                }
            }
            Mp::Map(entries) => {
                e::write_map_len(out, entries.len() as u32).unwrap();
                for (key, value) in entries {
                    key.write(out);
                    value.write(out);
                }
            }
            Mp::Raw(bytes) => out.extend_from_slice(bytes),
        }
    }
}

pub fn s(value: &str) -> Mp {
    Mp::Str(value.to_owned())
}

pub fn ints(values: &[i64]) -> Mp {
    Mp::Arr(values.iter().map(|v| Mp::Int(*v)).collect())
}

pub fn arr(items: impl IntoIterator<Item = Mp>) -> Mp {
    Mp::Arr(items.into_iter().collect())
}

pub fn map<'a>(entries: impl IntoIterator<Item = (&'a str, Mp)>) -> Mp {
    Mp::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

/// `[ts, events, attn_dp_rank]` as SGLang sends it.
pub fn batch(events: Vec<Mp>) -> Mp {
    arr([Mp::F64(1.5), Mp::Arr(events), Mp::Int(0)])
}

/// A map-era `BlockStored` with the keys 0.5.23 always writes.
pub fn stored_map(hashes: Mp, parent: Mp, medium: &str) -> Vec<(&'static str, Mp)> {
    vec![
        ("type", s("BlockStored")),
        ("block_hashes", hashes),
        ("parent_block_hash", parent),
        ("token_ids", ints(&[1, 2, 3, 4])),
        ("block_size", Mp::Int(2)),
        ("lora_id", Mp::Nil),
        ("medium", s(medium)),
    ]
}

/// An array-era `BlockStored`, all seven elements.
pub fn stored_arr(hashes: Mp, parent: Mp, medium: &str) -> Vec<Mp> {
    vec![
        s("BlockStored"),
        hashes,
        parent,
        ints(&[1, 2, 3, 4]),
        Mp::Int(2),
        Mp::Nil,
        s(medium),
    ]
}

/// A `BlockStored` event with no component data, LoRA or strings: what both eras decode to and
/// what the mapping rules take.
pub fn plain_stored(
    hashes: &[i64],
    parent: Option<i64>,
    tier: Tier,
    block_size: u32,
    n_token_ids: usize,
) -> Event {
    Event::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        block_size,
        tier,
        component_mask: None,
        lora_id: None,
        cache_salt: None,
        session_id: None,
        lora_name: None,
        n_token_ids,
    })
}

#[allow(unused_imports)]
pub use kv_testkit::fixtures::{path as fixture, rows, unhex};
