//! The state's errors: why it could not be loaded or kept ([`StateError`]), and why one change
//! or read was refused ([`ChangeError`]). The server maps both to gRPC codes in its one place.

use std::path::PathBuf;
use std::sync::Arc;

use kv_index::ValidationError;

use crate::dir::DirError;
use crate::log::StateFileError;
use crate::record::RecordError;
use crate::stream::StreamError;

/// Why the state could not be loaded or kept.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Log(#[from] StateFileError),
    #[error("{path:?}: record {position} does not decode")]
    Record {
        path: PathBuf,
        position: u64,
        #[source]
        source: RecordError,
    },
    #[error("{path:?}: record {position} does not apply")]
    Invalid {
        path: PathBuf,
        position: u64,
        #[source]
        source: ChangeError,
    },
    #[error(transparent)]
    Dir(#[from] DirError),
    #[error("starting a state thread")]
    Thread(#[source] std::io::Error),
    #[error(transparent)]
    Fleet(Arc<StreamError>),
}

impl StateError {
    /// Whether a write found the state directory's disk full ([`StateFileError::is_disk_full`]).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StateError::Log(error) if error.is_disk_full())
    }

    /// Whether the files themselves are bad (the operator may choose to start empty).
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            StateError::Log(
                StateFileError::Corrupt { .. }
                    | StateFileError::NewerVersion { .. }
                    | StateFileError::Gap { .. }
            ) | StateError::Record { .. }
                | StateError::Invalid { .. }
        )
    }
}

/// Why a change (an apply, a hit-counting match) or a read of the state was refused. Each
/// leaves the index as it was.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error(
        "worker {worker_id}: this bridge's incarnation {incarnation} is older than {newest}, which another bridge for the worker sent: this bridge is fenced"
    )]
    Fenced {
        worker_id: String,
        incarnation: u64,
        newest: u64,
    },
    #[error(
        "worker {worker_id}: batch {got} of bridge incarnation {incarnation} arrived where {expected} was expected: the index lost acknowledged batches of this worker (a rolled-back log or state directory) and cleared the worker; re-sync it"
    )]
    Gap {
        worker_id: String,
        incarnation: u64,
        expected: u64,
        got: u64,
    },
    #[error("worker {worker_id}: bad bridge batch number ({why})")]
    BadBatch {
        worker_id: String,
        why: &'static str,
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
    SharedLog(#[source] Arc<StreamError>),
    #[error("the shared log lost this change before it was applied (Redis lost data); retry")]
    LogReset,
    #[error(
        "this replica appended the change to the shared log but did not read it back within {waited_s} s (Redis may have lost it in a failover); retry"
    )]
    Unanswered { waited_s: u64 },
    #[error("the server is stopping")]
    WriterGone,
    #[error("the log cannot be written; changes are refused until the server restarts")]
    LogUnwritable(#[source] Arc<StateError>),
    #[error(
        "the disk of the state directory (KV_INDEXER_STATE_DIR) is full: changes are refused until a write succeeds (each one retries); queries are answered"
    )]
    DiskFull(#[source] Arc<StateError>),
}
