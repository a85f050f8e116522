//! The `KVIndexerAdmin` gRPC service (ours, beside `KVIndexer`): an operator's view of one
//! server (`kv-indexer-ctl state`, `workers`) and the one change an operator makes (`drop`).
//! The reads need the read token, the drop the write token (`crate::access`).
//!
//! [`StateReport`] is also what `GET /state` on the admin address prints, as JSON.

use std::sync::Arc;

use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_admin_server::KvIndexerAdmin;
use serde::Serialize;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::error::ServerError;
use crate::service::{Shared, arrival, finish};

/// One server's readiness, sizes and (a replica) place in the shared log.
#[derive(Debug, Clone, Serialize)]
pub struct StateReport {
    pub ready: bool,
    pub serving: bool,
    pub blocks: usize,
    pub placements: usize,
    pub workers: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// A replica's place in the shared log (its keys printed at the top level).
    #[serde(flatten)]
    pub replica: Option<ReplicaReport>,
    /// Why applies are refused (the state directory's disk is full), when they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub applies_refused: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct ReplicaReport {
    pub position: u64,
    pub lag_ms: u64,
    pub lag_entries: u64,
    pub fresh: bool,
}

impl StateReport {
    /// The state of `shared` now; `digest`: with the index digest, which reads the whole
    /// index (seconds at 100 M placements, while the writer waits for the copy it holds).
    pub fn of(shared: &Shared, digest: bool) -> StateReport {
        let stats = shared.index_stats();
        StateReport {
            ready: shared.is_ready(),
            serving: shared.is_serving(),
            blocks: stats.blocks,
            placements: stats.placements,
            workers: stats.workers,
            digest: digest.then(|| shared.digest()),
            replica: shared.freshness().map(|f| ReplicaReport {
                position: f.position(),
                lag_ms: f.lag_ms(),
                lag_entries: f.behind(),
                fresh: shared.check_fresh().is_ok(),
            }),
            applies_refused: shared.unwritable(),
        }
    }

    /// The report as `GET /state` prints it: one line of JSON.
    pub fn to_json_line(&self) -> String {
        let mut line = serde_json::to_string(self)
            .unwrap_or_else(|error| format!("{{\"error\":{:?}}}", error.to_string()));
        line.push('\n');
        line
    }
}

impl From<StateReport> for pb::GetIndexerStateResponse {
    fn from(report: StateReport) -> Self {
        pb::GetIndexerStateResponse {
            ready: report.ready,
            serving: report.serving,
            blocks: report.blocks as u64,
            placements: report.placements as u64,
            workers: report.workers as u64,
            digest: report.digest.unwrap_or_default(),
            applies_refused: report.applies_refused.unwrap_or_default(),
            replica: report.replica.map(|r| pb::ReplicaState {
                position: r.position,
                lag_ms: r.lag_ms,
                lag_entries: r.lag_entries,
                fresh: r.fresh,
            }),
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }
}

/// The admin service; cheap to clone.
#[derive(Debug, Clone)]
pub struct AdminService {
    shared: Arc<Shared>,
}

impl AdminService {
    pub fn new(shared: Arc<Shared>) -> AdminService {
        AdminService { shared }
    }

    async fn state(&self, digest: bool) -> Result<pb::GetIndexerStateResponse, ServerError> {
        let shared = self.shared.clone();
        let report = tokio::task::spawn_blocking(move || StateReport::of(&shared, digest))
            .await
            .map_err(ServerError::Task)?;
        Ok(report.into())
    }

    /// Every worker of the index, with the meta the writer keeps beside it.
    async fn workers(&self) -> Result<pb::ListWorkersResponse, ServerError> {
        let meta = self.shared.writer()?.workers().await?;
        let summaries = self.shared.index_cell().read().worker_summaries();
        let workers = summaries
            .into_iter()
            .map(|summary| {
                let known = meta.get(&summary.id).copied().unwrap_or_default();
                let [hbm, dram, ssd] = summary.placements.map(|n| n as u64);
                pb::WorkerState {
                    worker_id: summary.id,
                    worker_address: summary.address,
                    hbm_placements: hbm,
                    dram_placements: dram,
                    ssd_placements: ssd,
                    last_apply_ms: known.last_seen_ms,
                    expired: known.expired,
                    bridge_incarnation: known.incarnation,
                    bridge_batch: known.batch,
                }
            })
            .collect();
        Ok(pb::ListWorkersResponse { workers })
    }

    /// Drops a worker's placements through the log (NOT_FOUND for one the index lacks).
    async fn drop_worker(&self, worker: String) -> Result<pb::DropWorkerResponse, ServerError> {
        let writer = self.shared.writer()?;
        if worker.is_empty() {
            return Err(ServerError::BadField("worker_id is empty"));
        }
        if !self.shared.is_ready() {
            return Err(kv_state::error::ChangeError::NotReady.into());
        }
        let known = self
            .shared
            .index_cell()
            .read()
            .worker_placements(&worker)
            .is_some();
        if !known {
            return Err(ServerError::UnknownWorker(worker));
        }
        let dropped = writer.drop_worker(worker.clone()).await?;
        info!(
            worker,
            placements = dropped,
            "dropped a worker's placements on an operator's request"
        );
        Ok(pb::DropWorkerResponse {
            placements_dropped: dropped as u64,
        })
    }
}

#[tonic::async_trait]
impl KvIndexerAdmin for AdminService {
    async fn get_indexer_state(
        &self,
        request: Request<pb::GetIndexerStateRequest>,
    ) -> Result<Response<pb::GetIndexerStateResponse>, Status> {
        let start = arrival(&request);
        let result = self.state(request.into_inner().digest).await;
        finish("GetIndexerState", start, result)
    }

    async fn list_workers(
        &self,
        request: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let start = arrival(&request);
        let result = self.workers().await;
        finish("ListWorkers", start, result)
    }

    async fn drop_worker(
        &self,
        request: Request<pb::DropWorkerRequest>,
    ) -> Result<Response<pb::DropWorkerResponse>, Status> {
        let start = arrival(&request);
        let result = self.drop_worker(request.into_inner().worker_id).await;
        finish("DropWorker", start, result)
    }
}
