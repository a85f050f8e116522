//! A prompt as an inference engine caches it, for the router and the simulated worker alike:
//! pure, beneath both `kv-indexer-client` (which re-exports it) and `kv-indexer-sim`.
//!
//! - [`tokenize`]: a deterministic word tokenizer for tools and simulations;
//! - [`tokenizer`]: prompt text to token ids as SGLang encodes it (a Hugging Face
//!   `tokenizer.json` with feature `hf`, else the word tokenizer);
//! - [`chat`] (feature `chat`): chat messages to prompt text through the model's chat
//!   template, as SGLang renders it;
//! - [`hashing`]: SGLang's block hashes from token ids (SHA-256 chain, bigrams, salts);
//! - [`vllm_hashing`]: vLLM's block hashes (sha256 over its pickle, sha256_cbor), and the one
//!   rule mapping a vLLM event hash to the Indexer's i64;
//! - [`block_hasher`]: [`BlockHasher`], one worker group's hashing, whichever engine.

pub mod block_hasher;
#[cfg(feature = "chat")]
pub mod chat;
pub mod hashing;
pub mod tokenize;
pub mod tokenizer;
pub mod vllm_hashing;

pub use block_hasher::BlockHasher;
pub use hashing::{HashConfig, block_hashes};
pub use tokenize::simple_tokenize;
