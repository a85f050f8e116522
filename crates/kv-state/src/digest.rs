//! The index's digest: equal for two indexes that answer every query alike, whatever their
//! layout (replicas compare it; `GET /state` shows it).

use sha2::{Digest, Sha256};

/// A SHA-256 (hex) of `export` in canonical order: equal for indexes that hold the same.
pub fn digest(export: kv_index::Export) -> String {
    let export = export.canonical();
    let mut hasher = Sha256::new();
    let mut put = |bytes: &[u8]| hasher.update(bytes);
    put(&(export.workers.len() as u64).to_le_bytes());
    for worker in &export.workers {
        for text in [&worker.id, &worker.address] {
            put(&(text.len() as u64).to_le_bytes());
            put(text.as_bytes());
        }
        put(format!("{:?}", worker.spec).as_bytes());
        for held in &worker.held {
            put(&(held.len() as u64).to_le_bytes());
            for block in held {
                put(&block.hash.to_le_bytes());
                put(&block.mask.to_le_bytes());
                put(&block.tokens.to_le_bytes());
            }
        }
    }
    for (hash, count) in &export.hits {
        put(&hash.to_le_bytes());
        put(&count.to_le_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
