//! [`IndexerClient`]: the router's connection to the Indexer, with the router contract's
//! deadline, admission bound, replica fail-over and long-prompt truncation.
//!
//! Every query:
//! 1. takes a local admission permit or is answered `Overloaded` at once (never queued), so a
//!    slow Indexer cannot pile up router tasks;
//! 2. gets one deadline, `query_timeout` from now, enforced locally around the whole call
//!    (connecting and fail-over included) and sent to each replica as `grpc-timeout` (the
//!    remaining budget), so the server can shed work nobody waits for;
//! 3. goes first to the healthy replica with the fewest of this client's queries in flight
//!    (ties taken in turn, so replicas share the load evenly), then to the others in order while
//!    the answer is unreachable / timeout / overloaded and budget remains; any other answer is
//!    final. When every replica fails, the last failure is the outcome. A replica that was
//!    unreachable or timed out is tried after the others for a while (1 s, doubling to 30 s
//!    while it keeps failing; an answer ends it): a peer that stops answering without refusing
//!    (a killed container) would otherwise spend every query's budget before the next replica
//!    is tried.
//!
//! Channels are lazy: nothing is dialed at construction, and a replica that is down costs a
//! failed connect per query until it is back (tonic reconnects on the next call).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1 as pb;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::endpoint::{Endpoint, EndpointError};
use crate::outcome::{self, HitCount, NodeMatch, PrefixMatch, PrefixOutcome, QueryError};
use crate::security::{AdminClient, Authorize, ClientSecurity, Grpc, SecurityError};

/// The standard health service's client, with the token on every call.
type HealthClient = tonic_health::pb::health_client::HealthClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Authorize>,
>;
pub use tonic_health::pb::health_check_response::ServingStatus;

/// The router contract's default per-query deadline.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_millis(100);
/// The router contract's default local admission bound.
pub const DEFAULT_MAX_INFLIGHT: usize = 32;
/// How long one connection attempt may take; the query deadline still bounds each query.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The most hashes one prefix request carries: `(8 MiB − 16) / 8` = 1,048,574, so the
/// encoded message (tag, length, 8 bytes per hash) stays within the server's 8 MiB limit.
pub const MAX_PREFIX_HASHES: usize = (MAX_MESSAGE_BYTES - 16) / 8;

/// How to reach the Indexer and how patient to be.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Replicas, tried in order (see [`Endpoint::parse_list`]).
    pub endpoints: Vec<Endpoint>,
    /// The whole budget of one query, fail-over included.
    pub query_timeout: Duration,
    /// Queries in flight at once; one more is answered `Overloaded` at once.
    pub max_inflight: usize,
    /// The bound on one connection attempt.
    pub connect_timeout: Duration,
    /// TLS roots, client identity and token (none by default: plain `http://`).
    pub security: ClientSecurity,
}

impl ClientConfig {
    /// `endpoints` with the contract's defaults.
    pub fn new(endpoints: Vec<Endpoint>) -> ClientConfig {
        ClientConfig {
            endpoints,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            max_inflight: DEFAULT_MAX_INFLIGHT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            security: ClientSecurity::default(),
        }
    }
}

/// A configuration the client cannot run with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("max_inflight must be at least 1")]
    ZeroInflight,
    #[error("query_timeout must be more than zero")]
    ZeroTimeout,
    #[error(transparent)]
    Security(#[from] SecurityError),
}

#[derive(Debug)]
pub(crate) struct Replica {
    pub(crate) endpoint: Endpoint,
    client: Grpc,
    health: HealthClient,
    /// Our admin service (`kv-indexer-ctl state`, `workers`, `drop`).
    pub(crate) admin: AdminClient,
    ejection: Ejection,
    /// This client's calls to it now.
    outstanding: AtomicUsize,
}

/// A call counted in its replica's [`Replica::outstanding`] while it lives.
struct Outstanding<'a>(&'a AtomicUsize);

impl<'a> Outstanding<'a> {
    fn start(count: &'a AtomicUsize) -> Outstanding<'a> {
        count.fetch_add(1, Ordering::Relaxed);
        Outstanding(count)
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a failed replica is tried last: from [`FIRST_EJECTION`], doubling to
/// [`MAX_EJECTION`] while it fails again each time it is tried.
const FIRST_EJECTION: Duration = Duration::from_secs(1);
const MAX_EJECTION: Duration = Duration::from_secs(30);

/// A replica's ejection: until when it is tried after the others, and for how long the next
/// failure ejects it.
#[derive(Debug, Default)]
struct Ejection(std::sync::Mutex<Option<(Instant, Duration)>>);

impl Ejection {
    fn is_active(&self, now: Instant) -> bool {
        self.0
            .lock()
            .ok()
            .and_then(|e| *e)
            .is_some_and(|(until, _)| now < until)
    }

    fn failed(&self, endpoint: &Endpoint) {
        if let Ok(mut ejection) = self.0.lock() {
            let period = ejection.map_or(FIRST_EJECTION, |(_, last)| (last * 2).min(MAX_EJECTION));
            *ejection = Some((Instant::now() + period, period));
            debug!(%endpoint, ?period, "indexer replica tried after the others for a while");
        }
    }

    fn answered(&self) {
        if let Ok(mut ejection) = self.0.lock() {
            *ejection = None;
        }
    }
}

/// The router's client of the Indexer; cheap to share (`&self` everywhere), one lazily
/// connected HTTP/2 channel per replica.
#[derive(Debug)]
pub struct IndexerClient {
    pub(crate) replicas: Vec<Replica>,
    /// Turns: where the next query starts looking for the least busy replica.
    turn: AtomicUsize,
    admission: Semaphore,
    max_inflight: usize,
    pub(crate) query_timeout: Duration,
}

impl IndexerClient {
    /// Builds the channels without dialing. Must run inside a tokio runtime (tonic spawns
    /// each channel's worker task).
    pub fn new(config: ClientConfig) -> Result<IndexerClient, ClientError> {
        if config.endpoints.is_empty() {
            return Err(EndpointError::Empty.into());
        }
        if config.max_inflight == 0 {
            return Err(ClientError::ZeroInflight);
        }
        if config.query_timeout.is_zero() {
            return Err(ClientError::ZeroTimeout);
        }
        let credentials = config.security.load()?;
        let replicas = config
            .endpoints
            .into_iter()
            .map(|endpoint| {
                let channel = credentials
                    .endpoint(&endpoint.dial_string())?
                    .connect_timeout(config.connect_timeout)
                    .tcp_nodelay(true)
                    .connect_lazy();
                let client = credentials.client(channel.clone());
                let health = HealthClient::new(credentials.authorized(channel.clone()));
                let admin = AdminClient::new(credentials.authorized(channel));
                Ok(Replica {
                    endpoint,
                    client,
                    health,
                    admin,
                    ejection: Ejection::default(),
                    outstanding: AtomicUsize::new(0),
                })
            })
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(IndexerClient {
            replicas,
            turn: AtomicUsize::new(0),
            admission: Semaphore::new(config.max_inflight),
            max_inflight: config.max_inflight,
            query_timeout: config.query_timeout,
        })
    }

    /// The replicas, as listed.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.replicas.iter().map(|r| &r.endpoint)
    }

    /// Queries holding an admission permit now.
    pub fn queries_in_flight(&self) -> usize {
        self.max_inflight - self.admission.available_permits()
    }

    /// Every replica's answer to the standard health check of the whole server
    /// (`grpc.health.v1.Health/Check`, service ""), in order, each within the query timeout:
    /// `NotServing` while a server recovers its state or a replica lags its shared log.
    pub async fn health(&self) -> Vec<(&Endpoint, Result<ServingStatus, QueryError>)> {
        let mut answers = Vec::with_capacity(self.replicas.len());
        for replica in &self.replicas {
            let request = self.timed_request(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            });
            let mut health = replica.health.clone();
            let answer = self.within_timeout(health.check(request)).await;
            answers.push((
                &replica.endpoint,
                answer.map(|r| r.status()).map_err(Into::into),
            ));
        }
        answers
    }

    /// `message` as a request carrying the query timeout (an operator's call to one replica).
    pub(crate) fn timed_request<M>(&self, message: M) -> Request<M> {
        let mut request = Request::new(message);
        request.set_timeout(self.query_timeout);
        request
    }

    /// One call to one replica, bounded by the query timeout here too; a failed transport is
    /// UNAVAILABLE (see [`transport_is_unavailable`]).
    pub(crate) async fn within_timeout<T>(
        &self,
        call: impl Future<Output = Result<Response<T>, Status>>,
    ) -> Result<T, Status> {
        match tokio::time::timeout(self.query_timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(transport_is_unavailable(status)),
            Err(_) => Err(self.spent()),
        }
    }

    /// The workers holding the longest prefix of a prompt's block `hashes` (prompt order).
    ///
    /// A prompt longer than one message can carry sends only its first
    /// [`MAX_PREFIX_HASHES`] hashes; the outcome still reports the full `query_blocks`, so a
    /// ratio against it is a lower bound. An empty prompt is `NoMatch` without a query.
    pub async fn longest_prefix(&self, hashes: &[i64]) -> PrefixOutcome {
        self.longest_prefix_or_status(hashes)
            .await
            .unwrap_or_else(|status| PrefixOutcome::from_status(&status))
    }

    /// [`IndexerClient::longest_prefix`], with a failed query's status (its code and the
    /// server's reason, such as a replica still recovering its state) instead of its outcome.
    pub async fn longest_prefix_or_status(&self, hashes: &[i64]) -> Result<PrefixOutcome, Status> {
        self.prefix_query(hashes, false)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// [`IndexerClient::longest_prefix`] with the server's predictions (our extension): the
    /// outcome of the confirmed placements, and apart from it the workers whose predicted
    /// prefix is longer than their confirmed one, with that predicted length (longest first).
    /// A server that does not know the extension answers no predictions.
    pub async fn longest_prefix_with_predictions(
        &self,
        hashes: &[i64],
    ) -> (PrefixOutcome, Vec<PrefixMatch>) {
        self.prefix_query(hashes, true)
            .await
            .unwrap_or_else(|status| (PrefixOutcome::from_status(&status), Vec::new()))
    }

    async fn prefix_query(
        &self,
        hashes: &[i64],
        include_predictions: bool,
    ) -> Result<(PrefixOutcome, Vec<PrefixMatch>), Status> {
        if hashes.is_empty() {
            return Ok((PrefixOutcome::NoMatch, Vec::new()));
        }
        let sent = &hashes[..hashes.len().min(MAX_PREFIX_HASHES)];
        let message = pb::MatchExternalKvPrefixRequest {
            hashes: sent.to_vec(),
            max_blocks: 0,
            max_matches: None,
            include_predictions: include_predictions.then_some(true),
        };
        let mut response = self
            .query(message, |mut client, request| async move {
                client.match_external_kv_prefix(request).await
            })
            .await?;
        let predicted =
            outcome::prefix_matches(std::mem::take(&mut response.predicted), sent.len());
        let outcome = PrefixOutcome::from_response(response, hashes.len(), sent.len());
        Ok((outcome, predicted))
    }

    /// Tells the server that `worker_address` will soon hold the prompt's block `hashes` (our
    /// extension, `PredictExternalKv`): every router's prefix answers name it as a prediction
    /// for `ttl` (at most the server's maximum) or until the worker's own events arrive.
    /// Returns the hashes recorded. At most [`MAX_PREFIX_HASHES`] leading hashes are sent.
    pub async fn predict(
        &self,
        worker_address: &str,
        hashes: &[i64],
        ttl: Duration,
    ) -> Result<u32, QueryError> {
        let message = pb::PredictExternalKvRequest {
            worker_address: worker_address.to_string(),
            hashes: hashes[..hashes.len().min(MAX_PREFIX_HASHES)].to_vec(),
            ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX).max(1),
        };
        let response = self
            .query(message, |mut client, request| async move {
                client.predict_external_kv(request).await
            })
            .await?;
        Ok(response.recorded)
    }

    /// Every worker's placements of `hashes` (`MatchExternalKv`); `count_as_hit` adds one to
    /// each matched hash's hit count.
    pub async fn match_exact(
        &self,
        hashes: &[i64],
        count_as_hit: bool,
    ) -> Result<Vec<NodeMatch>, QueryError> {
        let message = pb::MatchExternalKvRequest {
            hashes: hashes.to_vec(),
            count_as_hit,
        };
        let response = self
            .query(message, |mut client, request| async move {
                client.match_external_kv(request).await
            })
            .await?;
        Ok(outcome::node_matches(response))
    }

    /// The hit counts of those `hashes` that have one (`GetExternalKvHitCounts`).
    pub async fn hit_counts(&self, hashes: &[i64]) -> Result<Vec<HitCount>, QueryError> {
        let message = pb::GetExternalKvHitCountsRequest {
            hashes: hashes.to_vec(),
        };
        let response = self
            .query(message, |mut client, request| async move {
                client.get_external_kv_hit_counts(request).await
            })
            .await?;
        Ok(outcome::hit_counts(response))
    }

    /// Admission, then `rpc` of `message` over the replicas within one deadline, each request
    /// carrying the time left as its gRPC timeout. Local failures come back as the status a
    /// server would have sent, so one classification covers both.
    async fn query<M, T, F, Fut>(&self, message: M, rpc: F) -> Result<T, Status>
    where
        M: Clone,
        F: FnMut(Grpc, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let Ok(_permit) = self.admission.try_acquire() else {
            return Err(Status::resource_exhausted(format!(
                "the client's bound of {} queries in flight is reached",
                self.max_inflight
            )));
        };
        let deadline = Instant::now() + self.query_timeout;
        // Each call is bounded by the deadline inside (so that the replica it spent is known).
        let answer = self.fail_over(deadline, message, rpc).await;
        // The timer has a millisecond's grain: an answer that beat it may still be late, and a
        // late answer is a timeout, whatever the timer says.
        if Instant::now() > deadline {
            return Err(self.spent());
        }
        answer
    }

    /// The order one query tries the replicas in: the healthy ones (not recently unreachable
    /// or slow), the one with the fewest calls in flight first (ties taken in turn), the rest
    /// in listed order from there; then the others.
    fn order(&self) -> Vec<&Replica> {
        let now = Instant::now();
        let n = self.replicas.len();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        let rotated = (0..n).map(|i| &self.replicas[(turn + i) % n]);
        let (mut order, ejected): (Vec<&Replica>, Vec<&Replica>) =
            rotated.partition(|replica| !replica.ejection.is_active(now));
        let least = order
            .iter()
            .enumerate()
            .min_by_key(|(_, replica)| replica.outstanding.load(Ordering::Relaxed))
            .map(|(i, _)| i);
        if let Some(least) = least {
            order[..=least].rotate_right(1);
        }
        order.extend(ejected);
        order
    }

    /// Tries the replicas in [`IndexerClient::order`] while a failure is one the next replica
    /// may not share.
    async fn fail_over<M, T, F, Fut>(
        &self,
        deadline: Instant,
        message: M,
        mut rpc: F,
    ) -> Result<T, Status>
    where
        M: Clone,
        F: FnMut(Grpc, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let order = self.order();
        let mut last = None;
        let mut message = Some(message);
        for (i, replica) in order.iter().enumerate() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(self.spent());
            }
            // The last replica takes the message itself, any other a copy.
            let body = if i + 1 == order.len() {
                message.take()
            } else {
                message.clone()
            };
            let mut request = Request::new(body.expect("a message for every replica"));
            request.set_timeout(remaining);
            let call = rpc(replica.client.clone(), request);
            let _outstanding = Outstanding::start(&replica.outstanding);
            let Ok(answer) = tokio::time::timeout_at(deadline, call).await else {
                replica.ejection.failed(&replica.endpoint);
                return Err(self.spent());
            };
            match answer.map_err(transport_is_unavailable) {
                Ok(response) => {
                    replica.ejection.answered();
                    return Ok(response.into_inner());
                }
                Err(status) if PrefixOutcome::from_status(&status).fails_over() => {
                    debug!(endpoint = %replica.endpoint, code = ?status.code(), message = status.message(), "indexer replica failed");
                    if status.code() != tonic::Code::ResourceExhausted {
                        replica.ejection.failed(&replica.endpoint);
                    }
                    last = Some(status);
                }
                Err(status) => {
                    replica.ejection.answered();
                    return Err(status);
                }
            }
        }
        Err(last.unwrap_or_else(|| Status::unavailable("no replica")))
    }

    pub(crate) fn spent(&self) -> Status {
        Status::deadline_exceeded(format!(
            "no answer within the query timeout of {:?}",
            self.query_timeout
        ))
    }
}

/// tonic reports a connection that failed under a call (a TLS peer that refuses our
/// certificate, a plain server that drops a TLS hello) as UNKNOWN "transport error", and one
/// closed before it answered (a server over its connection bound) as CANCELLED "operation was
/// canceled"; for the router either is an unreachable replica, not an answer, so it becomes
/// UNAVAILABLE with the cause in the message.
pub fn transport_is_unavailable(status: Status) -> Status {
    let transport_failed = matches!(
        status.code(),
        tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Unavailable
    );
    match std::error::Error::source(&status) {
        // tonic's own UNAVAILABLE for a failed connect says only "tcp connect error": the OS's
        // reason ("Connection refused") is the last of its sources.
        Some(source)
            if status.code() == tonic::Code::Unavailable
                && source.is::<tonic::transport::Error>() =>
        {
            let mut root: &dyn std::error::Error = source;
            while let Some(next) = root.source() {
                root = next;
            }
            Status::unavailable(format!("{}: {root}", status.message()))
        }
        Some(source) if transport_failed && source.is::<tonic::transport::Error>() => {
            Status::unavailable(format!("{}: {}", status.message(), error_chain(source)))
        }
        _ => status,
    }
}

pub use kv_common::error_chain;
