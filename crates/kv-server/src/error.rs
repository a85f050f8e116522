//! Every error the service answers with, and the one place that maps them to gRPC status
//! codes; and what can stop the server from starting or serving.

use kv_index::{ErrorClass, ValidationError};
use tonic::{Code, Status};

use crate::pool::PoolError;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("too many prefix queries in flight (limit {limit}); retry later")]
    Overloaded { limit: usize },
    #[error("deadline already spent before the query started ({late_by_us} µs late)")]
    DeadlineSpent { late_by_us: u128 },
    #[error("query task failed")]
    Task(#[source] tokio::task::JoinError),
    #[error("the prefix scan did not run")]
    Scan(#[from] PoolError),
    #[error(
        "worker {worker_id}: this bridge's incarnation {incarnation} is older than {newest}, which another bridge for the worker sent: this bridge is fenced"
    )]
    Fenced {
        worker_id: String,
        incarnation: u64,
        newest: u64,
    },
    #[error(
        "the index is still being recovered (from KV_INDEXER_STATE_DIR or the shared log); retry shortly"
    )]
    NotReady,
    #[error(
        "this replica is {lag_ms} ms behind the shared log (KV_INDEXER_MAX_LAG_MS {max_ms}); try another replica"
    )]
    Stale { lag_ms: u64, max_ms: u64 },
    #[error("the shared log cannot be written; retry")]
    EventLog(#[source] std::sync::Arc<crate::state::stream::StreamError>),
    #[error("the shared log lost this change before it was applied (the engine lost data); retry")]
    LogReset,
    #[error("the server is stopping")]
    WriterGone,
    #[error("the log cannot be written; changes are refused until the server restarts")]
    LogUnwritable(#[source] std::sync::Arc<crate::state::StateError>),
}

impl ServerError {
    pub fn code(&self) -> Code {
        match self {
            ServerError::Invalid(error) => match error.class() {
                ErrorClass::InvalidArgument => Code::InvalidArgument,
                ErrorClass::ResourceExhausted => Code::ResourceExhausted,
            },
            ServerError::Overloaded { .. } => Code::ResourceExhausted,
            ServerError::DeadlineSpent { .. } => Code::DeadlineExceeded,
            ServerError::Task(_) | ServerError::Scan(PoolError::Panicked) => Code::Internal,
            ServerError::Scan(PoolError::Full) => Code::ResourceExhausted,
            ServerError::Fenced { .. } => Code::FailedPrecondition,
            ServerError::NotReady
            | ServerError::Scan(PoolError::Stopped)
            | ServerError::WriterGone
            | ServerError::LogUnwritable(_)
            | ServerError::Stale { .. }
            | ServerError::EventLog(_)
            | ServerError::LogReset => Code::Unavailable,
        }
    }
}

impl From<ServerError> for Status {
    fn from(error: ServerError) -> Status {
        Status::new(error.code(), error.to_string())
    }
}

/// Why the server could not start serving a listener.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading the listen address")]
    LocalAddr(#[source] std::io::Error),
    #[error("building server reflection")]
    Reflection(#[source] tonic_reflection::server::Error),
    #[error("registering the apply listener with the runtime")]
    Register(#[source] std::io::Error),
    #[error("starting the query threads (KV_INDEXER_QUERY_THREADS)")]
    QueryThreads(#[source] std::io::Error),
}
