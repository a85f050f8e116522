//! Delivers queued items to the Indexer in order, retrying transient failures with a jittered
//! backoff and stopping on permanent ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_events::{Action, clear_action};
use kv_index::Tier;
use kv_indexer_client::security::Grpc;
use kv_indexer_proto::convert::{WorkerHeader, apply_message};
use kv_indexer_proto::v1 as pb;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::{info, warn};

use super::backoff::Backoff;
use super::batch;
use super::config::BridgeConfig;
use super::error::BridgeError;
use super::outbox::{Item, Outbox};
use super::stats::Stats;

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const CALL_DEADLINE: Duration = Duration::from_secs(10);
/// The wait after the first failed call (at most; see [`Backoff`]), doubling to [`BACKOFF_MAX`].
pub const BACKOFF_START: Duration = Duration::from_millis(500);
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Status codes that mean a bug or a misconfiguration: retrying cannot help.
pub fn is_permanent(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::NotFound
            | Code::AlreadyExists
            | Code::OutOfRange
            | Code::Unauthenticated
            | Code::PermissionDenied
            | Code::Unimplemented
            | Code::DataLoss
    )
}

/// What every request of this worker carries.
#[derive(Debug, Clone)]
struct Identity {
    header: WorkerHeader,
    clear_tiers: Vec<Tier>,
}

impl Identity {
    fn request(&self, seq: u64, actions: Vec<Action>) -> pb::ApplyExternalKvBatchRequest {
        apply_message(&self.header, seq, actions)
    }

    fn clear_actions(&self) -> Vec<Action> {
        self.clear_tiers
            .iter()
            .map(|&tier| clear_action(tier))
            .collect()
    }
}

/// A new incarnation for a sender that starts now: its start time in microseconds since the
/// Unix epoch, so a bridge started later for the same worker has a larger one and fences this
/// one out. Each sender numbers its batches from 1 under its own incarnation, so a second
/// sender in one process (a bridge restarted in place) gets a larger one too, never the same.
fn incarnation() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64);
    let next = |last: u64| now.max(last + 1);
    let last = LAST
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| Some(next(last)))
        .expect("the update always succeeds");
    next(last)
}

pub struct Sender {
    /// One client per Indexer replica; `current` is the one sent to.
    clients: Vec<Grpc>,
    /// Each client's endpoint, as configured, for the logs.
    endpoints: Vec<String>,
    current: usize,
    identity: Identity,
    outbox: Arc<Outbox>,
    stats: Arc<Stats>,
    heartbeat: Option<Duration>,
    last_seq: u64,
    /// The number the next request gets (`bridge_batch`): 1, 2, 3, … in this incarnation.
    next_batch: u64,
    /// Told when the Indexer answers that it lost acknowledged batches: the stream re-syncs.
    resync: Arc<Notify>,
}

impl Sender {
    pub fn new(
        config: &BridgeConfig,
        outbox: Arc<Outbox>,
        stats: Arc<Stats>,
        resync: Arc<Notify>,
    ) -> Result<Sender, BridgeError> {
        let mut clients = Vec::with_capacity(config.endpoints.len());
        for dial in &config.endpoints {
            let endpoint = config
                .credentials
                .endpoint(dial)
                .map_err(BridgeError::Endpoint)?
                .connect_timeout(CONNECT_TIMEOUT)
                .timeout(CALL_DEADLINE)
                .tcp_nodelay(true);
            clients.push(config.credentials.client(endpoint.connect_lazy()));
        }
        Ok(Sender {
            clients,
            endpoints: config.endpoints.clone(),
            current: 0,
            identity: Identity {
                header: WorkerHeader {
                    worker_id: config.worker_id.clone(),
                    worker_address: config.worker_address.clone(),
                    cache_spec: config.cache_spec,
                    bridge_incarnation: Some(incarnation()),
                },
                clear_tiers: config.clear_tiers.clone(),
            },
            outbox,
            stats,
            heartbeat: config.heartbeat,
            last_seq: 0,
            next_batch: 1,
            resync,
        })
    }

    /// Delivers items until `stop` is cancelled, or fails on a permanent error.
    pub async fn run(mut self, stop: CancellationToken) -> Result<(), BridgeError> {
        loop {
            let heartbeat = async {
                match self.heartbeat {
                    Some(every) => tokio::time::sleep(every).await,
                    None => std::future::pending().await,
                }
            };
            let item = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                item = self.outbox.pop() => Some(item),
                () = heartbeat => None,
            };
            self.stats.set_queue_depth(self.outbox.len());
            let requests = match item {
                Some(Item::Batch { seq, rpcs }) => {
                    self.last_seq = seq;
                    batch::requests(&self.identity.header, seq, rpcs)
                }
                Some(Item::Clear { reason }) => {
                    info!(reason = reason.label(), tiers = ?self.identity.clear_tiers, "clearing the worker in the index");
                    vec![
                        self.identity
                            .request(self.last_seq, self.identity.clear_actions()),
                    ]
                }
                None => vec![self.identity.request(self.last_seq, Vec::new())],
            };
            for mut request in requests {
                // Numbered once: a retry of this request is the same batch to the Indexer.
                request.bridge_batch = Some(self.next_batch);
                self.next_batch += 1;
                if !self.deliver(request, &stop).await? {
                    return Ok(());
                }
            }
        }
    }

    /// Sends one request until it is applied; `Ok(false)` when stopped first.
    async fn deliver(
        &mut self,
        request: pb::ApplyExternalKvBatchRequest,
        stop: &CancellationToken,
    ) -> Result<bool, BridgeError> {
        let mut backoff = Backoff::new(BACKOFF_START, BACKOFF_MAX);
        // Since the first failed attempt: the Indexer is away until an attempt is answered.
        let mut away_since: Option<Instant> = None;
        loop {
            let call = self.clients[self.current].apply_external_kv_batch(request.clone());
            let result = tokio::select! {
                () = stop.cancelled() => return Ok(false),
                result = call => result,
            };
            let answered = match &result {
                Ok(_) => true,
                Err(status) => status.code() == Code::Aborted,
            };
            if answered && let Some(since) = away_since.take() {
                info!(
                    replica = self.current,
                    away_ms = since.elapsed().as_millis() as u64,
                    "the indexer is back: delivering again"
                );
            }
            match result {
                Ok(_) => {
                    self.stats.rpc(Code::Ok);
                    return Ok(true);
                }
                Err(status) => {
                    let status = kv_indexer_client::client::transport_is_unavailable(status);
                    self.stats.rpc(status.code());
                    if status.code() == Code::Aborted {
                        // The Indexer lost acknowledged batches of this worker and cleared it; it
                        // took this batch's number. Re-sync instead of retrying.
                        warn!(
                            message = status.message(),
                            "the indexer lost batches it had acknowledged: re-syncing the worker"
                        );
                        self.resync.notify_one();
                        return Ok(true);
                    }
                    if status.code() == Code::Unauthenticated {
                        return Err(BridgeError::Unauthenticated {
                            message: status.message().to_string(),
                        });
                    }
                    if is_permanent(status.code()) {
                        return Err(BridgeError::Permanent {
                            code: status.code(),
                            message: status.message().to_string(),
                        });
                    }
                    away_since.get_or_insert_with(Instant::now);
                    let wait = backoff.next_wait();
                    let failed = self.current;
                    // A fleet: the next attempt goes to the next replica.
                    self.current = (self.current + 1) % self.clients.len();
                    if let Some(total) = self.stats.retry() {
                        let endpoint = &self.endpoints[failed];
                        warn!(total, %endpoint, replica = failed, code = ?status.code(), message = status.message(), retry_in_ms = wait.as_millis() as u64, next_replica = self.current, "indexer unavailable; retrying");
                    }
                    tokio::select! {
                        () = stop.cancelled() => return Ok(false),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sender_gets_a_larger_incarnation() {
        let first = incarnation();
        assert!(incarnation() > first);
    }

    #[test]
    fn classifies_the_contracts_permanent_codes() {
        let permanent = [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::NotFound,
            Code::AlreadyExists,
            Code::OutOfRange,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::Unimplemented,
            Code::DataLoss,
        ];
        let transient = [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Cancelled,
            Code::ResourceExhausted,
            Code::Internal,
            Code::Unknown,
            Code::Aborted,
        ];
        for code in permanent {
            assert!(is_permanent(code), "{code:?} must be permanent");
        }
        for code in transient {
            assert!(!is_permanent(code), "{code:?} must be retried");
        }
    }
}
