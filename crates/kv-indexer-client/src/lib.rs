//! The router side of the KV Indexer: what a router needs to ask the Indexer where a prompt's
//! KV cache lives, with the semantics of `docs/router-contract.md`.
//!
//! - `hashing`, `vllm_hashing`, `block_hasher`, `tokenize`, `tokenizer`, `chat` (feature
//!   `chat`): the prompt's side (SGLang's and vLLM's block hashing, tokenizers, chat
//!   templates), the `kv-prompt` crate's, re-exported here for the router's convenience; the
//!   simulated worker uses `kv-prompt` itself, without the gRPC client.
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
pub mod client;
pub mod endpoint;
pub mod outcome;
pub mod security;

#[cfg(feature = "chat")]
pub use kv_prompt::chat;
pub use kv_prompt::{BlockHasher, HashConfig, block_hashes, simple_tokenize};
pub use kv_prompt::{block_hasher, hashing, tokenize, tokenizer, vllm_hashing};

pub use admin::{ServerState, WorkerState};
pub use client::{ClientConfig, ClientError, IndexerClient, MAX_PREFIX_HASHES, ServingStatus};
pub use endpoint::{Endpoint, EndpointError};
pub use outcome::{
    HitCount, NodeMatch, PrefixMatch, PrefixOutcome, QueryError, Tier, TierPlacements,
};
pub use security::{ClientSecurity, Credentials, SecurityError};
pub use tonic::{Code, Status};
