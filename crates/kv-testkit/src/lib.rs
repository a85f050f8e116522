//! Dev-only: what the tests of every crate share, so that no test reads another crate's
//! `tests/` folder or fakes a dead endpoint with a port it bound and dropped.
//!
//! - [`indexer`]: the real server on `127.0.0.1:0` in this process, with a raw gRPC client;
//! - [`fixtures`]: the captured SGLang fixtures and their decoding helpers;
//! - [`wait`]: readiness waits on a condition, with a deadline, instead of sleeps;
//! - [`tokenizer`]: a tiny Hugging Face `tokenizer.json` that adds a BOS token.

pub mod fixtures;
pub mod indexer;
pub mod tokenizer;
pub mod wait;

pub use indexer::TestIndexer;
