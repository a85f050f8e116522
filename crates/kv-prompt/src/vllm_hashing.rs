//! vLLM's prefix-cache block hashes (`vllm/v1/core/kv_cache_utils.py`, vLLM 0.33), computed from
//! token ids exactly as the engine does, for the two algorithms that can be reproduced outside
//! Python: `sha256` (SHA-256 over `pickle.dumps(..., protocol=5)`, as CPython's C pickler writes
//! it) and `sha256_cbor` (SHA-256 over canonical CBOR; llm-d requires it).
//!
//! Block i (full blocks only: a partial tail has no hash) hashes the tuple
//! `(parent, tuple(block_tokens), extra_keys)`, where `parent` is block i−1's 32-byte digest
//! (block 0: `NONE_HASH`, the hash of the seed string: `PYTHONHASHSEED` when set, else
//! `"vllm-none-hash"`), and `extra_keys` is `None` or a tuple of, in order, `("lora", name,
//! path)` on every block of a LoRA request and `("cache_salt", salt)` on block 0. Multimodal
//! and prompt-embedding keys are not reproduced (the pickle of two multimodal items in one block
//! depends on Python object identity).
//!
//! Events carry a hash as the digest's last 8 bytes read as a big-endian u64 (vLLM's
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, its default) or as the whole digest; both map to
//! the Indexer's signed 64-bit field by one rule, [`event_hash`]: those 8 bytes as a
//! big-endian i64 (the u64's two's complement). The bridge applies the same rule.
//!
//! `xxhash` and `xxhash_cbor` are left out: without `PYTHONHASHSEED` their `NONE_HASH` comes from
//! `os.urandom`, so no one outside the process can reproduce them.

use sha2::{Digest, Sha256};

/// The seed of `NONE_HASH` when `PYTHONHASHSEED` is not set (sha256 and sha256_cbor).
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// Block sizes hashed (a block's pickle then fits one 64 KiB frame, as CPython writes it).
pub const MAX_BLOCK_SIZE: usize = 4096;

/// `--prefix-caching-hash-algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmHashAlgo {
    /// `sha256`, vLLM's default: SHA-256 over the pickle.
    Sha256,
    /// `sha256_cbor`: SHA-256 over canonical CBOR.
    Sha256Cbor,
}

impl VllmHashAlgo {
    /// vLLM's name for it.
    pub fn name(self) -> &'static str {
        match self {
            VllmHashAlgo::Sha256 => "sha256",
            VllmHashAlgo::Sha256Cbor => "sha256_cbor",
        }
    }
}

impl std::str::FromStr for VllmHashAlgo {
    type Err = String;

    fn from_str(name: &str) -> Result<VllmHashAlgo, String> {
        match name {
            "sha256" => Ok(VllmHashAlgo::Sha256),
            "sha256_cbor" => Ok(VllmHashAlgo::Sha256Cbor),
            other => Err(format!(
                "{other:?} is not a reproducible vLLM hash algorithm (sha256, sha256_cbor; \
                 xxhash's seed is random per process unless PYTHONHASHSEED is set)"
            )),
        }
    }
}

/// What a request adds to its blocks' hashes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtraKeys<'a> {
    /// A LoRA adapter: its name and its path (both hashed; events carry the name only).
    pub lora: Option<(&'a str, &'a str)>,
    /// `cache_salt`, on the first block only.
    pub cache_salt: Option<&'a str>,
}

/// A value of the hashed tuples.
enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
    Str(&'a str),
    None,
    Tuple(Vec<Value<'a>>),
}

/// How a worker's vLLM engine hashes its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmHasher {
    algo: VllmHashAlgo,
    block_size: usize,
    none_hash: [u8; 32],
}

/// Why a hasher cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("vLLM block size {0}: must be 1 to {MAX_BLOCK_SIZE}")]
pub struct BadBlockSize(pub usize);

impl VllmHasher {
    /// `seed`: the engine's `PYTHONHASHSEED` (`None`: unset).
    pub fn new(
        algo: VllmHashAlgo,
        block_size: usize,
        seed: Option<&str>,
    ) -> Result<VllmHasher, BadBlockSize> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(BadBlockSize(block_size));
        }
        let none_hash = digest(algo, &Value::Str(seed.unwrap_or(DEFAULT_SEED)));
        Ok(VllmHasher {
            algo,
            block_size,
            none_hash,
        })
    }

    /// Tokens per block (vLLM's `--block-size`).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn algo(&self) -> VllmHashAlgo {
        self.algo
    }

    /// `NONE_HASH`: block 0's parent.
    pub fn none_hash(&self) -> [u8; 32] {
        self.none_hash
    }

    /// The digests of the full blocks of `tokens`.
    pub fn block_digests(&self, tokens: &[u64], extra: ExtraKeys<'_>) -> Vec<[u8; 32]> {
        let mut parent = self.none_hash;
        tokens
            .chunks_exact(self.block_size)
            .enumerate()
            .map(|(i, block)| {
                let mut keys = Vec::new();
                if let Some((name, path)) = extra.lora {
                    keys.push(Value::Tuple(vec![
                        Value::Str("lora"),
                        Value::Str(name),
                        Value::Str(path),
                    ]));
                }
                if let (0, Some(salt)) = (i, extra.cache_salt) {
                    keys.push(Value::Tuple(vec![
                        Value::Str("cache_salt"),
                        Value::Str(salt),
                    ]));
                }
                let tuple = Value::Tuple(vec![
                    Value::Bytes(&parent),
                    Value::Tuple(block.iter().map(|&t| Value::Int(t)).collect()),
                    if keys.is_empty() {
                        Value::None
                    } else {
                        Value::Tuple(keys)
                    },
                ]);
                parent = digest(self.algo, &tuple);
                parent
            })
            .collect()
    }

    /// The full blocks' hashes as the Indexer keeps them ([`event_hash`]).
    pub fn block_hashes(&self, tokens: &[u64], extra: ExtraKeys<'_>) -> Vec<i64> {
        self.block_digests(tokens, extra)
            .iter()
            .map(event_hash)
            .collect()
    }
}

/// A vLLM block hash as the Indexer keeps it: the last 8 bytes of the digest (or of the event's
/// raw hash bytes) as a big-endian i64. An event's int form (those bytes as a u64) maps to the
/// same value by `as i64`. `None` when fewer than 8 bytes.
pub fn event_hash_of(bytes: &[u8]) -> Option<i64> {
    let tail: [u8; 8] = bytes.get(bytes.len().checked_sub(8)?..)?.try_into().ok()?;
    Some(i64::from_be_bytes(tail))
}

/// [`event_hash_of`] a 32-byte digest.
pub fn event_hash(digest: &[u8; 32]) -> i64 {
    event_hash_of(digest).expect("32 bytes")
}

fn digest(algo: VllmHashAlgo, value: &Value<'_>) -> [u8; 32] {
    let bytes = match algo {
        VllmHashAlgo::Sha256 => pickle(value),
        VllmHashAlgo::Sha256Cbor => {
            let mut out = Vec::new();
            cbor(value, &mut out);
            out
        }
    };
    Sha256::digest(&bytes).into()
}

/// `pickle.dumps(value, protocol=5)` as CPython's C pickler writes it: PROTO, one FRAME (the
/// payload stays under its 64 KiB target), the opcodes, STOP. Bytes, strings and non-empty
/// tuples are memoized (each is written once, so no memo is ever read back).
fn pickle(value: &Value<'_>) -> Vec<u8> {
    let mut body = Vec::new();
    pickle_value(value, &mut body);
    body.push(b'.'); // STOP
    let mut out = Vec::with_capacity(body.len() + 11);
    out.extend([0x80, 5]); // PROTO 5
    out.push(0x95); // FRAME
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(body);
    out
}

const MEMOIZE: u8 = 0x94;

fn pickle_value(value: &Value<'_>, out: &mut Vec<u8>) {
    match value {
        Value::None => out.push(b'N'),
        Value::Int(n) => pickle_int(*n, out),
        Value::Bytes(bytes) => {
            match u8::try_from(bytes.len()) {
                Ok(len) => out.extend([b'C', len]), // SHORT_BINBYTES
                Err(_) => {
                    out.push(b'B'); // BINBYTES
                    out.extend((bytes.len() as u32).to_le_bytes());
                }
            }
            out.extend(*bytes);
            out.push(MEMOIZE);
        }
        Value::Str(text) => {
            match u8::try_from(text.len()) {
                Ok(len) => out.extend([0x8c, len]), // SHORT_BINUNICODE
                Err(_) => {
                    out.push(b'X'); // BINUNICODE
                    out.extend((text.len() as u32).to_le_bytes());
                }
            }
            out.extend(text.as_bytes());
            out.push(MEMOIZE);
        }
        Value::Tuple(items) if items.is_empty() => out.push(b')'), // EMPTY_TUPLE
        Value::Tuple(items) => {
            let short = items.len() <= 3;
            if !short {
                out.push(b'('); // MARK
            }
            for item in items {
                pickle_value(item, out);
            }
            out.push(match items.len() {
                1 => 0x85, // TUPLE1
                2 => 0x86, // TUPLE2
                3 => 0x87, // TUPLE3
                _ => b't', // TUPLE
            });
            out.push(MEMOIZE);
        }
    }
}

/// A non-negative int: BININT1, BININT2, BININT (a signed 32-bit), else LONG1 (little-endian
/// two's complement, with a sign byte when the top bit is set).
fn pickle_int(n: u64, out: &mut Vec<u8>) {
    if let Ok(small) = u8::try_from(n) {
        out.extend([b'K', small]);
    } else if let Ok(mid) = u16::try_from(n) {
        out.push(b'M');
        out.extend(mid.to_le_bytes());
    } else if n <= i32::MAX as u64 {
        out.push(b'J');
        out.extend((n as u32).to_le_bytes());
    } else {
        let bytes = n.to_le_bytes();
        let mut len = 8 - (n.leading_zeros() / 8) as usize;
        let mut long: Vec<u8> = bytes[..len].to_vec();
        if long[len - 1] & 0x80 != 0 {
            long.push(0);
            len += 1;
        }
        out.extend([0x8a, len as u8]); // LONG1
        out.extend(long);
    }
}

/// Canonical CBOR (`cbor2.dumps(value, canonical=True)`): definite lengths, shortest heads,
/// tuples as arrays, `None` as null.
fn cbor(value: &Value<'_>, out: &mut Vec<u8>) {
    match value {
        Value::None => out.push(0xf6),
        Value::Int(n) => cbor_head(0, *n, out),
        Value::Bytes(bytes) => {
            cbor_head(2, bytes.len() as u64, out);
            out.extend(*bytes);
        }
        Value::Str(text) => {
            cbor_head(3, text.len() as u64, out);
            out.extend(text.as_bytes());
        }
        Value::Tuple(items) => {
            cbor_head(4, items.len() as u64, out);
            for item in items {
                cbor(item, out);
            }
        }
    }
}

fn cbor_head(major: u8, n: u64, out: &mut Vec<u8>) {
    let major = major << 5;
    if n < 24 {
        out.push(major | n as u8);
    } else if let Ok(n) = u8::try_from(n) {
        out.extend([major | 24, n]);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(major | 25);
        out.extend(n.to_be_bytes());
    } else if let Ok(n) = u32::try_from(n) {
        out.push(major | 26);
        out.extend(n.to_be_bytes());
    } else {
        out.push(major | 27);
        out.extend(n.to_be_bytes());
    }
}
