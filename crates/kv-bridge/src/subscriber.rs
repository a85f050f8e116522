//! The SUB socket to the publisher, connected for as long as it takes: a worker may be away
//! for seconds (a restart) or hours, and a bridge that gave up would leave its worker's blocks
//! unfollowed. Each attempt gets a fresh socket and at most [`CONNECT_ATTEMPT`] (zeromq polls a
//! refused port within it); failed attempts, a timeout or a publisher that accepts and then
//! fails the handshake (a worker dying as it starts), are spaced by a jittered backoff.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use zeromq::{Socket, SocketEvent, SocketOptions, SubSocket, ZmqError};

use crate::backoff::Backoff;
use crate::config::BridgeConfig;
use crate::stats::Stats;

/// How long one attempt to reach the publisher may take.
pub const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// The wait after the first failed attempt (at most; see [`Backoff`]), doubling to
/// [`RECONNECT_MAX`].
pub const RECONNECT_START: Duration = Duration::from_millis(100);
pub const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// The socket's connection events.
pub type Monitor = BoxStream<'static, SocketEvent>;

/// A connected SUB and its monitor (`None` once the monitor has closed).
pub struct Subscription {
    pub socket: SubSocket,
    pub monitor: Option<Monitor>,
}

/// Subscribes to the publisher, retrying every failure until connected; `None` when `stop`
/// comes first. `away_since`: when the publisher went away (its disconnect), if it did. Once
/// subscribed after an absence (that or failed attempts), logs how long the publisher was away.
pub async fn connect(
    config: &BridgeConfig,
    stats: &Stats,
    mut away_since: Option<Instant>,
    stop: &CancellationToken,
) -> Option<Subscription> {
    let mut backoff = Backoff::new(RECONNECT_START, RECONNECT_MAX);
    info!(endpoint = %config.event_endpoint, topic = %config.event_topic, "connecting to the publisher");
    loop {
        let error = tokio::select! {
            () = stop.cancelled() => return None,
            attempt = attempt(config) => match attempt {
                Ok(subscription) => {
                    match away_since {
                        Some(since) => info!(
                            endpoint = %config.event_endpoint,
                            away_ms = since.elapsed().as_millis() as u64,
                            "the publisher is back: subscribed"
                        ),
                        None => info!(endpoint = %config.event_endpoint, "subscribed"),
                    }
                    return Some(subscription);
                }
                Err(error) => error,
            },
        };
        away_since.get_or_insert_with(Instant::now);
        let wait = backoff.next_wait();
        if let Some(total) = stats.connect_failed() {
            warn!(
                %error,
                total,
                endpoint = %config.event_endpoint,
                retry_in_ms = wait.as_millis() as u64,
                "cannot reach the publisher; retrying"
            );
        }
        tokio::select! {
            () = stop.cancelled() => return None,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

async fn attempt(config: &BridgeConfig) -> Result<Subscription, ZmqError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_ATTEMPT);
    let mut socket = SubSocket::with_options(options);
    let monitor = socket.monitor().boxed();
    socket.subscribe(&config.event_topic).await?;
    socket.connect(&config.event_endpoint).await?;
    Ok(Subscription {
        socket,
        monitor: Some(monitor),
    })
}
