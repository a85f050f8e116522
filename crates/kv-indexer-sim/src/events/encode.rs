//! The msgpack payload of one batch, byte for byte as SGLang's `msgspec` encoder writes it:
//! `[ts: float64, events, attn_dp_rank]`, events in the map era (`{"type": "BlockStored", ...}`,
//! SGLang 0.5.20 and later, optional keys omitted) or the array era (`["BlockStored", ...]`, up
//! to 0.5.18).
//!
//! Integers take their most compact msgpack form, non-negative ones unsigned and negative ones
//! signed, as msgspec writes them (`rmp::encode::write_sint` does the same).
//!
//! [`Encoding::Vllm`] writes vLLM 0.33's `KVEventBatch` instead (`scripts/vllm/FACTS.md`): map
//! events keyed in the struct's order with `group_idx` 0, as its GPU block pool emits them,
//! media `GPU`/`CPU`, and block hashes as vLLM's unsigned ints (the bits of our i64).

use rmp::encode;

use super::{BlockRemoved, BlockStored, Event};

/// How events are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// `{"type": "BlockStored", "block_hashes": [...], ...}` (SGLang 0.5.20 and later).
    #[default]
    Map,
    /// `["BlockStored", block_hashes, ...]` (SGLang up to 0.5.18).
    Array,
    /// vLLM 0.33: `{"type": "BlockStored", ..., "lora_name": nil, "group_idx": 0}`.
    Vllm,
}

/// Encodes batches. With `component_types` labels set, every `BlockStored` carries them, as
/// an engine built with `--enable-kv-events-component-types` does (key `"component_types"`
/// after the others, or the 8th array element).
#[derive(Debug, Clone, Default)]
pub struct Encoder {
    pub encoding: Encoding,
    pub component_types: Vec<String>,
}

/// Writing into a `Vec<u8>` never fails; rmp's signatures are generic over fallible writers.
fn ok<T, E: std::fmt::Debug>(result: Result<T, E>) -> T {
    result.expect("writing msgpack into a Vec<u8> cannot fail")
}

impl Encoder {
    pub fn new(encoding: Encoding) -> Encoder {
        Encoder {
            encoding,
            component_types: Vec::new(),
        }
    }

    /// The payload of one batch.
    pub fn batch(&self, ts: f64, events: &[Event], attn_dp_rank: Option<i64>) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + events.len() * 64);
        self.batch_into(ts, events, attn_dp_rank, &mut out);
        out
    }

    /// [`Encoder::batch`] appended to `out`.
    pub fn batch_into(
        &self,
        ts: f64,
        events: &[Event],
        attn_dp_rank: Option<i64>,
        out: &mut Vec<u8>,
    ) {
        ok(encode::write_array_len(out, 3));
        ok(encode::write_f64(out, ts));
        // vLLM's block pool writes one `BlockRemoved` per evicted block.
        let count = match self.encoding {
            Encoding::Vllm => events.iter().map(vllm_event_count).sum(),
            Encoding::Map | Encoding::Array => events.len(),
        };
        ok(encode::write_array_len(out, len32(count)));
        for event in events {
            match self.encoding {
                Encoding::Map => self.map_event(event, out),
                Encoding::Array => self.array_event(event, out),
                Encoding::Vllm => vllm_event(event, out),
            }
        }
        write_opt_int(out, attn_dp_rank);
    }

    fn map_event(&self, event: &Event, out: &mut Vec<u8>) {
        match event {
            Event::BlockStored(stored) => {
                let optional = [&stored.cache_salt, &stored.session_id, &stored.lora_name];
                let len = 7
                    + optional.iter().filter(|v| v.is_some()).count()
                    + usize::from(!self.component_types.is_empty());
                ok(encode::write_map_len(out, len32(len)));
                key(out, "type", |out| write_str(out, "BlockStored"));
                key(out, "block_hashes", |out| {
                    write_hashes(out, &stored.block_hashes)
                });
                key(out, "parent_block_hash", |out| {
                    write_opt_int(out, stored.parent_block_hash);
                });
                key(out, "token_ids", |out| write_tokens(out, &stored.token_ids));
                key(out, "block_size", |out| {
                    ok(encode::write_uint(out, u64::from(stored.block_size)));
                });
                key(out, "lora_id", |out| write_opt_int(out, stored.lora_id));
                key(out, "medium", |out| write_str(out, stored.medium.as_str()));
                for (name, value) in ["cache_salt", "session_id", "lora_name"]
                    .into_iter()
                    .zip(optional)
                {
                    if let Some(value) = value {
                        key(out, name, |out| write_str(out, value));
                    }
                }
                if !self.component_types.is_empty() {
                    key(out, "component_types", |out| self.write_labels(out));
                }
            }
            Event::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
            }) => {
                ok(encode::write_map_len(out, 3));
                key(out, "type", |out| write_str(out, "BlockRemoved"));
                key(out, "block_hashes", |out| write_hashes(out, block_hashes));
                key(out, "medium", |out| write_str(out, medium.as_str()));
            }
            Event::AllBlocksCleared => {
                ok(encode::write_map_len(out, 1));
                key(out, "type", |out| write_str(out, "AllBlocksCleared"));
            }
        }
    }

    /// The array era has no place for `cache_salt`, `session_id` or `lora_name`: they are not
    /// written.
    fn array_event(&self, event: &Event, out: &mut Vec<u8>) {
        match event {
            Event::BlockStored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                ..
            }) => {
                let labels = !self.component_types.is_empty();
                ok(encode::write_array_len(out, 7 + u32::from(labels)));
                write_str(out, "BlockStored");
                write_hashes(out, block_hashes);
                write_opt_int(out, *parent_block_hash);
                write_tokens(out, token_ids);
                ok(encode::write_uint(out, u64::from(*block_size)));
                write_opt_int(out, *lora_id);
                write_str(out, medium.as_str());
                if labels {
                    self.write_labels(out);
                }
            }
            Event::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
            }) => {
                ok(encode::write_array_len(out, 3));
                write_str(out, "BlockRemoved");
                write_hashes(out, block_hashes);
                write_str(out, medium.as_str());
            }
            Event::AllBlocksCleared => {
                ok(encode::write_array_len(out, 1));
                write_str(out, "AllBlocksCleared");
            }
        }
    }

    fn write_labels(&self, out: &mut Vec<u8>) {
        ok(encode::write_array_len(
            out,
            len32(self.component_types.len()),
        ));
        for label in &self.component_types {
            write_str(out, label);
        }
    }
}

/// One event as vLLM's `BlockPool` has msgspec write it: every required field (nil when
/// None), the defaulted ones omitted but `group_idx`, which the pool always sets.
fn vllm_event(event: &Event, out: &mut Vec<u8>) {
    match event {
        Event::BlockStored(stored) => {
            // msgspec sizes a struct's map header by its field count, not by the fields
            // written: `BlockStored` has 16 with the tag, so even 9 keys get a map16 header.
            out.push(0xde);
            out.extend_from_slice(&9u16.to_be_bytes());
            key(out, "type", |out| write_str(out, "BlockStored"));
            key(out, "block_hashes", |out| {
                write_vllm_hashes(out, &stored.block_hashes);
            });
            key(out, "parent_block_hash", |out| {
                match stored.parent_block_hash {
                    Some(hash) => {
                        ok(encode::write_uint(out, hash as u64));
                    }
                    None => ok(encode::write_nil(out)),
                }
            });
            key(out, "token_ids", |out| write_tokens(out, &stored.token_ids));
            key(out, "block_size", |out| {
                ok(encode::write_uint(out, u64::from(stored.block_size)));
            });
            key(out, "lora_id", |out| write_opt_int(out, stored.lora_id));
            key(out, "medium", |out| {
                write_str(out, stored.medium.vllm_str())
            });
            key(out, "lora_name", |out| match &stored.lora_name {
                Some(name) => write_str(out, name),
                None => ok(encode::write_nil(out)),
            });
            key(out, "group_idx", |out| {
                ok(encode::write_uint(out, 0));
            });
        }
        Event::BlockRemoved(BlockRemoved {
            block_hashes,
            medium,
        }) => {
            for hash in block_hashes {
                ok(encode::write_map_len(out, 4));
                key(out, "type", |out| write_str(out, "BlockRemoved"));
                key(out, "block_hashes", |out| {
                    write_vllm_hashes(out, std::slice::from_ref(hash));
                });
                key(out, "medium", |out| write_str(out, medium.vllm_str()));
                key(out, "group_idx", |out| {
                    ok(encode::write_uint(out, 0));
                });
            }
        }
        Event::AllBlocksCleared => {
            ok(encode::write_map_len(out, 1));
            key(out, "type", |out| write_str(out, "AllBlocksCleared"));
        }
    }
}

/// How many events `event` is on vLLM's wire: a removal per block.
fn vllm_event_count(event: &Event) -> usize {
    match event {
        Event::BlockRemoved(removed) => removed.block_hashes.len(),
        Event::BlockStored(_) | Event::AllBlocksCleared => 1,
    }
}

/// vLLM's int hashes are unsigned (the digest's last 8 bytes), so ours go out as their bits.
fn write_vllm_hashes(out: &mut Vec<u8>, hashes: &[i64]) {
    ok(encode::write_array_len(out, len32(hashes.len())));
    for &hash in hashes {
        ok(encode::write_uint(out, hash as u64));
    }
}

fn len32(len: usize) -> u32 {
    u32::try_from(len).expect("a msgpack container holds at most 2^32 - 1 elements")
}

fn key(out: &mut Vec<u8>, name: &str, value: impl FnOnce(&mut Vec<u8>)) {
    write_str(out, name);
    value(out);
}

fn write_str(out: &mut Vec<u8>, value: &str) {
    ok(encode::write_str(out, value));
}

fn write_opt_int(out: &mut Vec<u8>, value: Option<i64>) {
    match value {
        Some(value) => {
            ok(encode::write_sint(out, value));
        }
        None => ok(encode::write_nil(out)),
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[i64]) {
    ok(encode::write_array_len(out, len32(hashes.len())));
    for &hash in hashes {
        ok(encode::write_sint(out, hash));
    }
}

fn write_tokens(out: &mut Vec<u8>, tokens: &[u64]) {
    ok(encode::write_array_len(out, len32(tokens.len())));
    for &token in tokens {
        ok(encode::write_uint(out, token));
    }
}
