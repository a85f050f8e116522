//! The router side of the KV Indexer: what a router needs to ask the Indexer where a prompt's
//! KV cache lives, with the semantics of `docs/router-contract.md`.
//!
//! - [`hashing`]: SGLang's block hashes from token ids (SHA-256 chain, bigrams, salts).
//! - [`vllm_hashing`]: vLLM's block hashes (sha256 over its pickle, sha256_cbor), and the one
//!   rule mapping a vLLM event hash to the Indexer's i64.
//! - [`block_hasher`]: [`BlockHasher`], one worker group's hashing, whichever engine.
//! - [`tokenize`]: a deterministic word tokenizer for tools and simulations.
//! - [`tokenizer`]: prompt text to token ids as SGLang encodes it (a Hugging Face
//!   `tokenizer.json` with feature `hf`, else the word tokenizer), shared by the router and the
//!   simulated worker.
//! - [`chat`] (feature `chat`): chat messages to prompt text through the model's chat
//!   template, as SGLang renders it.
//! - [`endpoint`]: the endpoint list (`http://`, `https://`, `unix:`; replicas in order),
//!   rejected at start-up when it can never be dialed.
//! - [`client`]: [`IndexerClient`], lazily connected, with the local admission bound, the
//!   deadline (sent and enforced), replica fail-over and long-prompt truncation.
//! - [`admin`]: the operator's calls to our admin service (each server's state, the workers,
//!   dropping one), on the same client.
//! - [`security`]: TLS roots, client identity (mutual TLS) and the bearer token, shared by
//!   every client of the Indexer.
//! - [`outcome`]: [`PrefixOutcome`] and the lookup answers; the one place that turns wire
//!   answers and status codes into them.

pub mod admin;
pub mod block_hasher;
#[cfg(feature = "chat")]
pub mod chat;
pub mod client;
pub mod endpoint;
pub mod hashing;
pub mod outcome;
pub mod security;
pub mod tokenize;
pub mod tokenizer;
pub mod vllm_hashing;

pub use admin::{ServerState, WorkerState};
pub use block_hasher::BlockHasher;
pub use client::{ClientConfig, ClientError, IndexerClient, MAX_PREFIX_HASHES, ServingStatus};
pub use endpoint::{Endpoint, EndpointError};
pub use hashing::{HashConfig, block_hashes};
pub use outcome::{
    HitCount, NodeMatch, PrefixMatch, PrefixOutcome, QueryError, Tier, TierPlacements,
};
pub use security::{ClientSecurity, Credentials, SecurityError};
pub use tokenize::simple_tokenize;
pub use tonic::{Code, Status};
