//! The operator's calls to our `KVIndexerAdmin` service (`kv-indexer-ctl state`, `workers`,
//! `drop`): not the router's path, so no admission bound and no load spreading. The state is
//! asked of every replica; the workers and a drop of the first that answers, in the listed
//! order (a drop goes through the shared log, so any replica's is every replica's).

use std::future::Future;

use kv_indexer_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::client::IndexerClient;
use crate::endpoint::Endpoint;
use crate::outcome::{PrefixOutcome, QueryError};
use crate::security::AdminClient;

pub use pb::{GetIndexerStateResponse as ServerState, WorkerState};

impl IndexerClient {
    /// Every replica's state, in order, each within the query timeout; `digest`: with the
    /// index digest (reads the whole index: slow on a large one).
    pub async fn states(&self, digest: bool) -> Vec<(&Endpoint, Result<ServerState, QueryError>)> {
        let mut answers = Vec::with_capacity(self.replicas.len());
        for replica in &self.replicas {
            let mut admin = replica.admin.clone();
            let request = self.timed_request(pb::GetIndexerStateRequest { digest });
            let answer = self.within_timeout(admin.get_indexer_state(request)).await;
            answers.push((&replica.endpoint, answer.map_err(Into::into)));
        }
        answers
    }

    /// Every worker the index knows, in worker-id order, from the first replica that answers.
    pub async fn workers(&self) -> Result<Vec<WorkerState>, QueryError> {
        let response = self
            .first_answer(
                |mut admin, request| async move { admin.list_workers(request).await },
                pb::ListWorkersRequest {},
            )
            .await?;
        Ok(response.workers)
    }

    /// Drops `worker`'s placements through the log (needs the write token); the placements
    /// it held.
    pub async fn drop_worker(&self, worker: &str) -> Result<u64, QueryError> {
        let message = pb::DropWorkerRequest {
            worker_id: worker.to_owned(),
        };
        let response = self
            .first_answer(
                |mut admin, request| async move { admin.drop_worker(request).await },
                message,
            )
            .await?;
        Ok(response.placements_dropped)
    }

    /// `rpc` of `message` to each replica in the listed order until one answers; a replica
    /// that is unreachable, late or overloaded passes the call on (as a query fails over),
    /// any other answer is final.
    async fn first_answer<M, T, F, Fut>(&self, rpc: F, message: M) -> Result<T, QueryError>
    where
        M: Clone,
        F: Fn(AdminClient, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let mut last = Status::unavailable("no replica");
        for replica in &self.replicas {
            let call = rpc(replica.admin.clone(), self.timed_request(message.clone()));
            match self.within_timeout(call).await {
                Ok(answer) => return Ok(answer),
                Err(status) if PrefixOutcome::from_status(&status).fails_over() => last = status,
                Err(status) => return Err(status.into()),
            }
        }
        Err(last.into())
    }
}
