//! SGLang's block hashes, computed from token ids exactly as the engine publishes them.
//!
//! Per page of `block_size` units, in order: SHA-256 over the previous page's 32-byte digest
//! (absent for the first page, or the cache-salt seed), then every token as u32 little-endian;
//! a page holding any token above `u32::MAX` is fed as one `0xFF` byte and every token as u64
//! little-endian. The published hash is the digest's first 8 bytes as a big-endian i64. In
//! bigram mode (speculative engines) N tokens make N−1 units, unit j feeding `t[j]` then
//! `t[j+1]`. A partial last page is hashed too (it can never match a stored block).

use sha2::{Digest, Sha256};

/// How a worker's engine hashes its pages (learned from its `/server_info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashConfig {
    /// Units per page: `page_size × dcp_size`.
    pub block_size: usize,
    /// Whether units are token bigrams (EAGLE / EAGLE3 / FROZEN_KV_MTP engines).
    pub bigram: bool,
}

/// The first page's prior for a salted request.
fn salt_seed(salt: &str) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"sglang-cache-salt-v1\0");
    hasher.update(salt.as_bytes());
    hasher.finalize().into()
}

/// The block hashes of `tokens`: `ceil(units / block_size)` of them, the last possibly partial.
/// A `block_size` of 0 yields no hashes.
pub fn block_hashes(tokens: &[u64], config: HashConfig, cache_salt: Option<&str>) -> Vec<i64> {
    let mut hashes = Vec::new();
    hash_into(tokens, config, cache_salt, &mut hashes);
    hashes
}

/// [`block_hashes`] into a reused vector (cleared first).
pub fn hash_into(
    tokens: &[u64],
    config: HashConfig,
    cache_salt: Option<&str>,
    hashes: &mut Vec<i64>,
) {
    hashes.clear();
    if config.block_size == 0 {
        return;
    }
    let units = if config.bigram {
        tokens.len().saturating_sub(1)
    } else {
        tokens.len()
    };
    hashes.reserve(units.div_ceil(config.block_size));
    let mut prior: Option<[u8; 32]> = cache_salt.map(salt_seed);
    let mut start = 0;
    while start < units {
        let end = (start + config.block_size).min(units);
        // The tokens a page of units reads: in bigram mode unit j reads t[j] and t[j+1].
        let page_tokens = if config.bigram {
            &tokens[start..=end]
        } else {
            &tokens[start..end]
        };
        let wide = page_tokens.iter().any(|&t| t > u64::from(u32::MAX));
        let mut hasher = Sha256::new();
        if let Some(prior) = &prior {
            hasher.update(prior);
        }
        if wide {
            hasher.update([0xFF]);
        }
        let mut feed = |token: u64| {
            if wide {
                hasher.update(token.to_le_bytes());
            } else {
                hasher.update((token as u32).to_le_bytes());
            }
        };
        for unit in start..end {
            feed(tokens[unit]);
            if config.bigram {
                feed(tokens[unit + 1]);
            }
        }
        let digest: [u8; 32] = hasher.finalize().into();
        hashes.push(i64::from_be_bytes(digest[..8].try_into().expect("8 bytes")));
        prior = Some(digest);
        start = end;
    }
}
