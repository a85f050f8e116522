//! The router side of the KV Indexer.
//!
//! - [`hashing`]: SGLang's block hashes from token ids (SHA-256 chain, bigrams, salts).

pub mod hashing;

pub use hashing::{HashConfig, block_hashes};
