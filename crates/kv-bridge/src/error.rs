//! Why the bridge stopped: a misconfiguration or a permanent answer, never an outage.

/// Why the bridge stopped: a misconfiguration or a permanent answer, never an outage.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error("KV_INDEXER_ENDPOINT (--endpoint) cannot be used")]
    Endpoint(#[source] kv_indexer_client::security::SecurityError),
    #[error(
        "the indexer refused the bridge's token ({message}): set KV_INDEXER_TOKEN (--indexer-token) to the server's KV_INDEXER_WRITE_TOKEN; not retrying"
    )]
    Unauthenticated { message: String },
    #[error(
        "the indexer rejected a batch with {code:?} ({message}): a bug or a misconfiguration, not retrying"
    )]
    Permanent { code: tonic::Code, message: String },
    #[error("the sender task failed")]
    Task(#[source] tokio::task::JoinError),
}
