//! The `KVIndexer` gRPC service on a shared [`Index`].
//!
//! Admission: a prefix query takes its permit when its request head arrives (the accept loop
//! calls [`Shared::admit`] and hands the permit over in an [`Admission`] extension), and holds
//! it until its answer is made. So the bound covers the whole stay in the server, queueing for
//! a CPU included: under CPU overload the surplus is refused at once instead of piling up in
//! the runtime, and applies, which take no permit, keep their latency.
//!
//! Locking: one `parking_lot::RwLock` around the index. Applies take the write lock (one apply
//! is atomic); queries take the read lock (one query sees one state). Nothing that may wait
//! long runs on the async worker threads:
//! - applies, hit-counting matches and long prefix scans run on the blocking pool;
//! - short queries run inline with `read_recursive`, which does not queue behind a waiting
//!   writer, so a long scan holding the read lock with an apply waiting behind it does not
//!   stall them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kv_index::{Index, IndexStats, validate_lookup, validate_prefix};
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_server::KvIndexer;
use parking_lot::RwLock;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::config::Config;
use crate::deadline::{Arrival, deadline};
use crate::error::ServerError;
use crate::observe;
use kv_common::DoublingLog;
use kv_indexer_proto::convert;

/// Prefix queries longer than this run on the blocking pool instead of an async worker.
const INLINE_PREFIX_HASHES: usize = 4096;

/// State shared by every connection.
#[derive(Debug)]
pub struct Shared {
    index: RwLock<Index>,
    admission: Arc<Semaphore>,
    limit: usize,
    shed: DoublingLog,
    rejected: DoublingLog,
    prefix_scans: AtomicU64,
}

impl Shared {
    pub fn new(config: &Config) -> Shared {
        Shared {
            index: RwLock::new(Index::new()),
            admission: Arc::new(Semaphore::new(config.prefix_query_max_inflight)),
            limit: config.prefix_query_max_inflight,
            shed: DoublingLog::default(),
            rejected: DoublingLog::default(),
            prefix_scans: AtomicU64::new(0),
        }
    }

    /// Sizes of the index now.
    pub fn index_stats(&self) -> IndexStats {
        self.index.read_recursive().stats()
    }

    /// Holds the index's write lock until the guard is dropped: queries and applies wait, while
    /// admission and deadline checks go on. For maintenance (a consistent snapshot) and for
    /// tests that need queries held in flight.
    pub fn lock_index(&self) -> parking_lot::RwLockWriteGuard<'_, Index> {
        self.index.write()
    }

    /// Prefix queries executing now.
    pub fn prefix_queries_in_flight(&self) -> usize {
        self.limit - self.admission.available_permits()
    }

    /// Prefix scans that touched the index since start.
    pub fn prefix_scans(&self) -> u64 {
        self.prefix_scans.load(Ordering::Relaxed)
    }

    /// Prefix queries shed because their deadline was spent, and rejected by admission.
    pub fn shed_and_rejected(&self) -> (u64, u64) {
        (self.shed.total(), self.rejected.total())
    }

    /// Takes an admission permit, or rejects at once (never queues).
    pub fn admit(&self) -> Result<Admission, ServerError> {
        self.try_admit().map(|permit| Admission(Arc::new(permit)))
    }

    fn try_admit(&self) -> Result<OwnedSemaphorePermit, ServerError> {
        self.admission.clone().try_acquire_owned().map_err(|_| {
            if let Some(total) = self.rejected.record() {
                warn!(
                    total,
                    limit = self.limit,
                    "rejecting prefix queries over the in-flight bound"
                );
            }
            observe::rejection("admission");
            ServerError::Overloaded { limit: self.limit }
        })
    }

    /// Counts (and now and then logs) a prefix query shed for its deadline.
    pub fn record_shed(&self) {
        if let Some(total) = self.shed.record() {
            info!(total, "shedding prefix queries whose deadline is spent");
        }
        observe::rejection("deadline");
    }

    /// Fails when the client's budget is already spent.
    fn check_deadline(&self, deadline: Option<Instant>) -> Result<(), ServerError> {
        let Some(deadline) = deadline else {
            return Ok(());
        };
        let now = Instant::now();
        if now < deadline {
            return Ok(());
        }
        self.record_shed();
        Err(ServerError::DeadlineSpent {
            late_by_us: (now - deadline).as_micros(),
        })
    }

    fn prefix_scan(
        &self,
        request: &pb::MatchExternalKvPrefixRequest,
        index: &Index,
    ) -> Result<pb::MatchExternalKvPrefixResponse, ServerError> {
        self.prefix_scans.fetch_add(1, Ordering::Relaxed);
        let answer = index.match_prefix(&request.hashes, request.max_blocks)?;
        Ok(convert::prefix_response(answer))
    }
}

/// A prefix query's admission permit, taken when its request arrived; released when dropped.
#[derive(Debug, Clone)]
pub struct Admission(#[allow(dead_code)] Arc<OwnedSemaphorePermit>);

/// The gRPC service; cheap to clone.
#[derive(Debug, Clone)]
pub struct IndexerService {
    shared: Arc<Shared>,
}

impl IndexerService {
    pub fn new(shared: Arc<Shared>) -> IndexerService {
        IndexerService { shared }
    }

    async fn apply(
        &self,
        request: pb::ApplyExternalKvBatchRequest,
    ) -> Result<pb::ApplyExternalKvBatchResponse, ServerError> {
        let batch = convert::apply_request(request).validate()?;
        let shared = self.shared.clone();
        let stats = tokio::task::spawn_blocking(move || {
            let mut index = shared.index.write();
            index.apply(&batch);
            index.stats()
        })
        .await
        .map_err(ServerError::Task)?;
        observe::index_size(stats);
        Ok(pb::ApplyExternalKvBatchResponse {})
    }

    async fn match_prefix(
        &self,
        mut request: Request<pb::MatchExternalKvPrefixRequest>,
    ) -> Result<pb::MatchExternalKvPrefixResponse, ServerError> {
        let admitted = request.extensions_mut().remove::<Admission>();
        let deadline = deadline(request.metadata(), arrival(&request));
        let shared = &self.shared;
        // Admitted on arrival by the accept loop; called any other way, admitted here.
        let permit = match admitted {
            Some(permit) => permit,
            None => shared.admit()?,
        };
        shared.check_deadline(deadline)?;
        let request = request.into_inner();
        validate_prefix(&request.hashes)?;
        if request.hashes.len() <= INLINE_PREFIX_HASHES {
            let index = shared.index.read_recursive();
            shared.check_deadline(deadline)?;
            let response = shared.prefix_scan(&request, &index);
            drop(permit);
            return response;
        }
        let shared = shared.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            shared.check_deadline(deadline)?;
            let index = shared.index.read();
            shared.prefix_scan(&request, &index)
        })
        .await
        .map_err(ServerError::Task)?
    }

    async fn match_kv(
        &self,
        request: pb::MatchExternalKvRequest,
    ) -> Result<pb::MatchExternalKvResponse, ServerError> {
        validate_lookup(&request.hashes)?;
        if !request.count_as_hit {
            let matches = self
                .shared
                .index
                .read_recursive()
                .match_kv(&request.hashes)?;
            return Ok(convert::match_response(matches));
        }
        let shared = self.shared.clone();
        let matches = tokio::task::spawn_blocking(move || {
            let mut index = shared.index.write();
            let matches = index.match_kv(&request.hashes)?;
            index.count_hits(&request.hashes);
            Ok::<_, ServerError>(matches)
        })
        .await
        .map_err(ServerError::Task)??;
        Ok(convert::match_response(matches))
    }

    fn hit_counts(
        &self,
        request: pb::GetExternalKvHitCountsRequest,
    ) -> Result<pb::GetExternalKvHitCountsResponse, ServerError> {
        let entries = self
            .shared
            .index
            .read_recursive()
            .hit_counts(&request.hashes)?;
        Ok(convert::hit_counts_response(entries))
    }
}

/// When the request's head arrived (stamped by the accept loop; now when called otherwise): the
/// start of its deadline and of its latency in the metrics.
fn arrival<T>(request: &Request<T>) -> Instant {
    request
        .extensions()
        .get::<Arrival>()
        .map_or_else(Instant::now, |a| a.0)
}

/// Records the outcome of one RPC (latency from its arrival) and turns it into tonic's result.
fn finish<T>(
    rpc: &'static str,
    start: Instant,
    result: Result<T, ServerError>,
) -> Result<Response<T>, Status> {
    let code = match &result {
        Ok(_) => tonic::Code::Ok,
        Err(error) => error.code(),
    };
    observe::request(rpc, code, start.elapsed());
    result.map(Response::new).map_err(Status::from)
}

#[tonic::async_trait]
impl KvIndexer for IndexerService {
    async fn apply_external_kv_batch(
        &self,
        request: Request<pb::ApplyExternalKvBatchRequest>,
    ) -> Result<Response<pb::ApplyExternalKvBatchResponse>, Status> {
        let start = arrival(&request);
        let result = self.apply(request.into_inner()).await;
        finish("ApplyExternalKvBatch", start, result)
    }

    async fn match_external_kv(
        &self,
        request: Request<pb::MatchExternalKvRequest>,
    ) -> Result<Response<pb::MatchExternalKvResponse>, Status> {
        let start = arrival(&request);
        let result = self.match_kv(request.into_inner()).await;
        finish("MatchExternalKv", start, result)
    }

    async fn match_external_kv_prefix(
        &self,
        request: Request<pb::MatchExternalKvPrefixRequest>,
    ) -> Result<Response<pb::MatchExternalKvPrefixResponse>, Status> {
        let start = arrival(&request);
        let result = self.match_prefix(request).await;
        finish("MatchExternalKvPrefix", start, result)
    }

    async fn get_external_kv_hit_counts(
        &self,
        request: Request<pb::GetExternalKvHitCountsRequest>,
    ) -> Result<Response<pb::GetExternalKvHitCountsResponse>, Status> {
        let start = arrival(&request);
        let result = self.hit_counts(request.into_inner());
        finish("GetExternalKvHitCounts", start, result)
    }
}
