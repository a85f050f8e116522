//! Every error the service answers with, and the one place that maps them to gRPC status
//! codes; and what can stop the server from starting or serving.

use kv_index::{ErrorClass, ValidationError};
use tonic::{Code, Status};

use kv_state::error::ChangeError;

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
    /// Refused by the state beneath (fencing, readiness, freshness, the log).
    #[error(transparent)]
    State(#[from] ChangeError),
    /// A request field out of its range (the field is named).
    #[error("{0}")]
    BadField(&'static str),
    /// A worker id the index does not know (`DropWorker`).
    #[error("no worker {0:?} in the index (kv-indexer-ctl workers lists them)")]
    UnknownWorker(String),
}

impl ServerError {
    pub fn code(&self) -> Code {
        match self {
            ServerError::Invalid(error) => validation_code(error),
            ServerError::Overloaded { .. } => Code::ResourceExhausted,
            ServerError::DeadlineSpent { .. } => Code::DeadlineExceeded,
            ServerError::Task(_) | ServerError::Scan(PoolError::Panicked) => Code::Internal,
            ServerError::Scan(PoolError::Full) => Code::ResourceExhausted,
            ServerError::Scan(PoolError::Stopped) => Code::Unavailable,
            ServerError::State(error) => state_code(error),
            ServerError::BadField(_) => Code::InvalidArgument,
            ServerError::UnknownWorker(_) => Code::NotFound,
        }
    }
}

fn validation_code(error: &ValidationError) -> Code {
    match error.class() {
        ErrorClass::InvalidArgument => Code::InvalidArgument,
        ErrorClass::ResourceExhausted => Code::ResourceExhausted,
    }
}

/// A refusal of the state: a fenced bridge must stop (FAILED_PRECONDITION); a bridge whose
/// acknowledged batches were lost re-syncs (ABORTED, gRPC's code for a failed sequencer
/// check); everything else passes (a replica catching up or stale, a log that cannot be
/// written, a stop) and the caller retries or tries another replica (UNAVAILABLE).
fn state_code(error: &ChangeError) -> Code {
    match error {
        ChangeError::Invalid(error) => validation_code(error),
        ChangeError::BadBatch { .. } => Code::InvalidArgument,
        ChangeError::Fenced { .. } => Code::FailedPrecondition,
        ChangeError::Gap { .. } => Code::Aborted,
        ChangeError::NotReady
        | ChangeError::Stale { .. }
        | ChangeError::SharedLog(_)
        | ChangeError::LogReset
        | ChangeError::Unanswered { .. }
        | ChangeError::WriterGone
        | ChangeError::LogUnwritable(_)
        | ChangeError::DiskFull(_) => Code::Unavailable,
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
