//! The `KVIndexer` gRPC service on a shared [`Index`].
//!
//! Admission: a prefix query takes its permit when its request head arrives (the accept loop
//! calls [`Shared::admit`] and hands the permit over in an [`Admission`] extension), and holds
//! it until its answer is made. So the bound covers the whole stay in the server, queueing for
//! a CPU included: under CPU overload the surplus is refused at once instead of piling up in
//! the runtime, and applies, which take no permit, keep their latency.
//!
//! Prefix scans run on the query threads (`crate::pool`), below the runtime's priority, so that
//! under CPU overload the runtime still reads and refuses the surplus as it arrives.
//!
//! Reading: two copies of the index (`kv_state::cell`). A query takes the published copy (a
//! pointer copy) and scans it; the one writer thread (`kv_state::writer`, or a replica's
//! applier) changes the other copy and publishes it whole. So a query never waits for an
//! apply, and sees the state after a whole number of applies, in order; an answered apply is
//! in every query that starts after its answer.
//! - applies and hit-counting matches are sent to the writer thread, which logs them and
//!   applies them in log order; prefix scans run on the query threads;
//! - the other queries read inline (`try_read`), and go to the blocking pool only while a test
//!   holds the cell (`Shared::lock_index`).
//! - A panic inside an apply (a bug) aborts the process before a half-applied copy can be
//!   published (see `kv_state::cell::AbortOnPanic`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_index::{Index, IndexStats, PrefixHits, validate_lookup, validate_prefix};
use kv_indexer_proto::v1 as pb;
use kv_indexer_proto::v1::kv_indexer_server::KvIndexer;
use tonic::{Request, Response, Status};
use tracing::warn;

use kv_indexer_proto::convert;
use kv_indexer_proto::prefix_wire::{self, EncodedPrefixResponse, PrefixMatchRef};
use kv_indexer_proto::v1::kv_indexer_server::KvIndexerServer;
use kv_state::cell::{self, IndexCell};
use kv_state::clock::Clock;
use kv_state::error::ChangeError;
use kv_state::fleet::Freshness;
use kv_state::writer::Writer;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::access::Access;
pub use crate::admission::Admission;
use crate::admission::QueryGate;
use crate::config::{Config, ConnectionLimits};
use crate::deadline::{Arrival, deadline};
use crate::error::{ServerError, StartError};
use crate::observe;
use crate::pool::QueryPool;
use crate::predict::Predictions;

/// State shared by every connection.
pub struct Shared {
    index: IndexCell,
    /// Set once the index is loaded: until then every RPC but health answers UNAVAILABLE.
    writer: std::sync::OnceLock<Writer>,
    health: Health,
    /// The prefix queries' admission bound, and what it refused.
    queries: QueryGate,
    listeners: ListenerConfig,
    /// A fleet replica's freshness (none: a single server).
    fleet: std::sync::OnceLock<Arc<Freshness>>,
    /// Where prefix scans run.
    pool: QueryPool,
    /// Routers' predicted placements (memory only: `crate::predict`).
    predictions: Predictions,
    /// What predictions' TTLs run on (the state's clock).
    clock: Clock,
}

/// The health every listener serves, published in order.
struct Health {
    reporter: HealthReporter,
    /// Serializes updates, so that the last one written is the current state's.
    update: tokio::sync::Mutex<()>,
}

/// What the listeners take from the configuration.
struct ListenerConfig {
    access: Access,
    connection_limits: ConnectionLimits,
    drain_timeout: Duration,
}

/// Block-worker pairs of predictions held at most (about 100 bytes each).
pub const PREDICTIONS_MAX_ENTRIES: usize = 1_000_000;
/// The longest a prediction lives, whatever its request asks.
pub const PREDICTIONS_MAX_TTL: Duration = Duration::from_secs(10);

impl Shared {
    /// The shared state of a server with `config`, its query threads started.
    pub fn new(config: &Config) -> Result<Shared, StartError> {
        let pool = QueryPool::start(config.query_threads, config.prefix_query_max_inflight)
            .map_err(StartError::QueryThreads)?;
        Ok(Shared {
            listeners: ListenerConfig {
                access: config.access.clone(),
                connection_limits: config.connections,
                drain_timeout: config.drain_timeout,
            },
            index: cell::empty(),
            writer: std::sync::OnceLock::new(),
            health: Health {
                reporter: HealthReporter::new(),
                update: tokio::sync::Mutex::new(()),
            },
            queries: QueryGate::new(config.prefix_query_max_inflight),
            fleet: std::sync::OnceLock::new(),
            pool,
            predictions: Predictions::new(PREDICTIONS_MAX_ENTRIES, PREDICTIONS_MAX_TTL),
            clock: config.state.clock.clone(),
        })
    }

    /// The index cell, for the writer thread.
    pub fn index_cell(&self) -> IndexCell {
        self.index.clone()
    }

    /// Installs the writer that changes the index from now on (the state opened over
    /// [`Shared::index_cell`]): the server is ready. Called once.
    pub fn install(&self, writer: Writer) {
        if self.writer.set(writer).is_err() {
            warn!("the index was installed twice; keeping the first writer");
        }
    }

    /// Marks this server as a replica on a shared log, with its freshness.
    pub fn install_fleet(&self, freshness: Arc<Freshness>) {
        let _ = self.fleet.set(freshness);
    }

    /// A replica's freshness (none: a single server).
    pub fn freshness(&self) -> Option<&Arc<Freshness>> {
        self.fleet.get()
    }

    /// Whether the index is loaded (a replica: caught up once) and changes are accepted.
    pub fn is_ready(&self) -> bool {
        self.writer.get().is_some() && self.fleet.get().is_none_or(|f| f.is_ready())
    }

    /// Whether queries may be answered now: ready, and a replica no further behind the
    /// shared log than its bound.
    pub fn check_fresh(&self) -> Result<(), ServerError> {
        self.writer()?;
        match self.fleet.get() {
            Some(freshness) => Ok(freshness.check()?),
            None => Ok(()),
        }
    }

    /// The writer, once ready.
    pub fn writer(&self) -> Result<&Writer, ServerError> {
        self.writer.get().ok_or(ChangeError::NotReady.into())
    }

    /// The health reporter every listener serves (`grpc.health.v1`).
    pub fn health(&self) -> &HealthReporter {
        &self.health.reporter
    }

    /// Why applies are refused now because the state directory cannot be written (its disk
    /// is full, or a write failed for good); none while it takes them (or there is none).
    pub fn unwritable(&self) -> Option<String> {
        let state = self.writer.get()?.write_state();
        state
            .refusal()
            .map(|refusal| kv_common::error_chain(&refusal))
    }

    /// Whether health says SERVING: queries may be answered ([`Shared::check_fresh`]) and the
    /// state takes applies. A server whose disk is full still answers queries, from an index
    /// that stops following its workers, so health says NOT_SERVING (as etcd's health does
    /// under its NOSPACE alarm): its operator and orchestrator see it, while routers, whose
    /// client does not consult health, keep their answers. A replica writes its changes to the
    /// shared log, not its disk, so it never is.
    pub fn is_serving(&self) -> bool {
        self.check_fresh().is_ok() && self.unwritable().is_none()
    }

    /// Publishes SERVING or NOT_SERVING (overall and for the `KVIndexer` service) as
    /// [`Shared::is_serving`] now says.
    pub async fn publish_health(&self) {
        let _serialized = self.health.update.lock().await;
        let status = if self.is_serving() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        observe::serving(status == ServingStatus::Serving);
        self.health.reporter.set_service_status("", status).await;
        self.health
            .reporter
            .set_service_status(
                <KvIndexerServer<IndexerService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
    }

    /// A SHA-256 of everything the index holds, in a canonical order (hex): two indexes that
    /// answer every query alike have the same digest, whatever their layout.
    pub fn digest(&self) -> String {
        kv_state::digest::digest(self.export())
    }

    /// Who may connect and call: the configured TLS and tokens.
    pub fn access(&self) -> &Access {
        &self.listeners.access
    }

    /// What the listen address lets its clients hold at once.
    pub fn connection_limits(&self) -> ConnectionLimits {
        self.listeners.connection_limits
    }

    /// How long a shutdown waits for open connections.
    pub fn drain_timeout(&self) -> Duration {
        self.listeners.drain_timeout
    }

    /// Sizes of the index now (waits for the read lock: not for async worker threads).
    pub fn index_stats(&self) -> IndexStats {
        self.index.read().stats()
    }

    /// Everything the index holds (waits for the read lock: not for async worker threads).
    pub fn export(&self) -> kv_index::Export {
        self.index.read().export()
    }

    /// Runs `query` on the index under the read lock: inline when the lock is free at once,
    /// else on the blocking pool, so that an async worker thread never waits for a writer.
    async fn read<T, F>(self: &Arc<Self>, query: F) -> Result<T, ServerError>
    where
        T: Send + 'static,
        F: FnOnce(&Shared, &Index) -> T + Send + 'static,
    {
        if let Some(index) = self.index.try_read() {
            return Ok(query(self, &index));
        }
        let shared = self.clone();
        tokio::task::spawn_blocking(move || query(&shared, &shared.index.read()))
            .await
            .map_err(ServerError::Task)
    }

    /// Keeps queries (and the next publication of applies) waiting until the guard is dropped,
    /// while admission and deadline checks go on: for tests that need queries held in flight.
    /// Nothing else ever holds it.
    pub fn lock_index(&self) -> parking_lot::RwLockWriteGuard<'_, Arc<Index>> {
        self.index.hold()
    }

    /// Prefix queries executing now.
    pub fn prefix_queries_in_flight(&self) -> usize {
        self.queries.in_flight()
    }

    /// Prefix scans that touched the index since start.
    pub fn prefix_scans(&self) -> u64 {
        self.queries.scans()
    }

    /// Prefix queries shed because their deadline was spent, and rejected by admission.
    pub fn shed_and_rejected(&self) -> (u64, u64) {
        self.queries.shed_and_rejected()
    }

    /// Takes an admission permit, or rejects at once (never queues).
    pub fn admit(&self) -> Result<Admission, ServerError> {
        self.queries.admit()
    }

    /// Counts (and now and then logs) a prefix query shed for its deadline.
    pub fn record_shed(&self) {
        self.queries.record_shed();
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

    /// The scan itself, under the read lock: the answer by worker handle, cut to the request's
    /// `max_matches`.
    fn prefix_scan(
        &self,
        request: &pb::MatchExternalKvPrefixRequest,
        index: &Index,
    ) -> Result<PrefixHits, ServerError> {
        self.queries.count_scan();
        let mut hits = index.match_prefix_hits(&request.hashes, request.max_blocks)?;
        if let Some(limit) = request.max_matches.filter(|&limit| limit > 0) {
            hits.matches.truncate(limit as usize);
        }
        Ok(hits)
    }
}

impl Shared {
    /// The predictions that extend the confirmed answer `hits` (within the request's
    /// `max_blocks` and `max_matches`).
    fn predicted(
        &self,
        request: &pb::MatchExternalKvPrefixRequest,
        hits: &PrefixHits,
        index: &Index,
    ) -> Vec<pb::ExternalKvPrefixMatch> {
        let limit = match request.max_blocks {
            0 => request.hashes.len(),
            n => request.hashes.len().min(n as usize),
        };
        let confirmed = hits
            .matches
            .iter()
            .map(|hit| (index.worker_address(hit.worker), hit.matched_prefix_blocks));
        let mut predicted: Vec<pb::ExternalKvPrefixMatch> = self
            .predictions
            .extend(&request.hashes[..limit], confirmed, self.clock.now())
            .into_iter()
            .map(|(worker, blocks)| pb::ExternalKvPrefixMatch {
                worker_address: worker,
                matched_prefix_blocks: blocks,
                worker_id: String::new(),
            })
            .collect();
        if let Some(max) = request.max_matches.filter(|&max| max > 0) {
            predicted.truncate(max as usize);
        }
        predicted
    }
}

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
        // A replica still catching up would hold the apply until it reached it: refuse, so
        // the bridge goes to a replica that serves.
        if !self.shared.is_ready() {
            return Err(ChangeError::NotReady.into());
        }
        // The worker's own events for a block replace the predictions of it.
        let predicted = (!self.shared.predictions.is_empty()).then(|| {
            let hashes: Vec<i64> = request
                .actions
                .iter()
                .flat_map(|action| action.hashes.iter().copied())
                .collect();
            (request.worker_address.clone(), hashes)
        });
        self.shared.writer()?.apply(request).await?;
        if let Some((worker, hashes)) = predicted {
            self.shared.predictions.forget(&worker, hashes);
        }
        Ok(pb::ApplyExternalKvBatchResponse {})
    }

    /// Records a router's prediction (memory only; `crate::predict`).
    async fn predict(
        &self,
        request: pb::PredictExternalKvRequest,
    ) -> Result<pb::PredictExternalKvResponse, ServerError> {
        self.shared.writer()?;
        if request.worker_address.is_empty() {
            return Err(ServerError::BadField("worker_address is empty"));
        }
        if request.ttl_ms == 0 {
            return Err(ServerError::BadField("ttl_ms must be at least 1"));
        }
        validate_lookup(&request.hashes)?;
        let recorded = self.shared.predictions.predict(
            &request.worker_address,
            &request.hashes,
            Duration::from_millis(u64::from(request.ttl_ms)),
            self.shared.clock.now(),
        );
        observe::predictions(recorded, self.shared.predictions.len());
        Ok(pb::PredictExternalKvResponse {
            recorded: recorded as u32,
        })
    }

    /// `MatchExternalKvPrefix` with the response the server sends: encoded straight from the
    /// index's worker strings, under the read lock (see `prefix_route`).
    pub(crate) async fn match_prefix_encoded(
        &self,
        request: Request<pb::MatchExternalKvPrefixRequest>,
    ) -> Result<EncodedPrefixResponse, ServerError> {
        self.match_prefix(request, |hits, index, predicted| {
            let matches = hits.matches.iter().map(|hit| PrefixMatchRef {
                worker_address: index.worker_address(hit.worker),
                matched_prefix_blocks: hit.matched_prefix_blocks,
                worker_id: index.worker_id(hit.worker),
            });
            prefix_wire::prefix_response(matches, hits.best_prefix_blocks, hits.blocks_read)
                .with_predicted(&predicted)
        })
        .await
    }

    /// `MatchExternalKvPrefix` as the generated message (the generic path).
    async fn match_prefix_message(
        &self,
        request: Request<pb::MatchExternalKvPrefixRequest>,
    ) -> Result<pb::MatchExternalKvPrefixResponse, ServerError> {
        self.match_prefix(request, |hits, index, predicted| {
            let mut response = convert::prefix_response(index.prefix_answer(&hits));
            response.predicted = predicted;
            response
        })
        .await
    }

    /// Admission, freshness, deadline and validation, then the scan, whose answer `respond`
    /// turns into the response while the read lock is still held (with the predictions that
    /// extend it, when the request asks for them).
    async fn match_prefix<R, F>(
        &self,
        mut request: Request<pb::MatchExternalKvPrefixRequest>,
        respond: F,
    ) -> Result<R, ServerError>
    where
        R: Send + 'static,
        F: FnOnce(PrefixHits, &Index, Vec<pb::ExternalKvPrefixMatch>) -> R + Send + 'static,
    {
        let admitted = request.extensions_mut().remove::<Admission>();
        let deadline = deadline(request.metadata(), arrival(&request));
        let shared = &self.shared;
        // Admitted on arrival by the accept loop; called any other way, admitted here.
        let permit = match admitted {
            Some(permit) => permit,
            None => shared.admit()?,
        };
        shared.check_fresh()?;
        shared.check_deadline(deadline)?;
        let request = request.into_inner();
        validate_prefix(&request.hashes)?;
        let scanner = shared.clone();
        // The permit goes with the job: held until its scan ends, or dropped with it unrun.
        let scan = move || {
            let _permit = permit;
            scanner.check_deadline(deadline)?;
            let index = scanner.index.read();
            let hits = scanner.prefix_scan(&request, &index)?;
            let predicted = if request.include_predictions == Some(true) {
                scanner.predicted(&request, &hits, &index)
            } else {
                Vec::new()
            };
            Ok(respond(hits, &index, predicted))
        };
        shared.pool.run(scan).await?
    }

    async fn match_kv(
        &self,
        request: pb::MatchExternalKvRequest,
    ) -> Result<pb::MatchExternalKvResponse, ServerError> {
        let writer = self.shared.writer()?;
        self.shared.check_fresh()?;
        validate_lookup(&request.hashes)?;
        let matches = if request.count_as_hit {
            writer.count_hits(request.hashes).await?
        } else {
            self.shared
                .read(move |_, index| index.match_kv(&request.hashes))
                .await??
        };
        Ok(convert::match_response(matches))
    }

    async fn hit_counts(
        &self,
        request: pb::GetExternalKvHitCountsRequest,
    ) -> Result<pb::GetExternalKvHitCountsResponse, ServerError> {
        self.shared.check_fresh()?;
        let entries = self
            .shared
            .read(move |_, index| index.hit_counts(&request.hashes))
            .await??;
        Ok(convert::hit_counts_response(entries))
    }
}

/// When the request's head arrived (stamped by the accept loop; now when called otherwise): the
/// start of its deadline and of its latency in the metrics.
pub(crate) fn arrival<T>(request: &Request<T>) -> Instant {
    request
        .extensions()
        .get::<Arrival>()
        .map_or_else(Instant::now, |a| a.0)
}

/// Records the outcome of one RPC (latency from its arrival) and turns it into tonic's result.
pub(crate) fn finish<T>(
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
        let result = self.match_prefix_message(request).await;
        finish("MatchExternalKvPrefix", start, result)
    }

    async fn get_external_kv_hit_counts(
        &self,
        request: Request<pb::GetExternalKvHitCountsRequest>,
    ) -> Result<Response<pb::GetExternalKvHitCountsResponse>, Status> {
        let start = arrival(&request);
        let result = self.hit_counts(request.into_inner()).await;
        finish("GetExternalKvHitCounts", start, result)
    }

    async fn predict_external_kv(
        &self,
        request: Request<pb::PredictExternalKvRequest>,
    ) -> Result<Response<pb::PredictExternalKvResponse>, Status> {
        let start = arrival(&request);
        let result = self.predict(request.into_inner()).await;
        finish("PredictExternalKv", start, result)
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("ready", &self.is_ready())
            .field("limit", &self.queries.limit())
            .field("access", &self.listeners.access)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    #[allow(clippy::await_holding_lock)] // holding the write lock over the await is the case
    async fn a_query_goes_to_the_blocking_pool_while_the_cell_is_held() {
        let shared = Arc::new(Shared::new(&Config::default()).unwrap());
        let held = shared.lock_index();
        let query = tokio::spawn({
            let shared = shared.clone();
            async move { shared.read(|_, index| index.stats().workers).await }
        });
        // The runtime thread is not blocked: this task runs while the lock is held.
        tokio::task::yield_now().await;
        assert!(!query.is_finished());
        drop(held);
        assert_eq!(query.await.unwrap().unwrap(), 0);
    }
}
