//! One simulated worker assembled: the tokenizer, the cache and publisher under the
//! scheduler, the replay server, the engine and the HTTP API, on listeners bound beforehand.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::serve::ListenerExt;
use kv_prompt::chat::{ChatError, ChatTemplate};
use kv_prompt::tokenizer::{Tokenizer, TokenizerError};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::Cache;
use crate::config::Config;
use crate::engine::{Engine, EngineConfig};
use crate::http::{self, AppState, WorkerInfo};
use crate::publisher::{Publisher, PublisherError, PublisherStats, ReplayServer};
use crate::scheduler::{Scheduler, SchedulerHandle};

/// How errors name the tokenizer setting: the flag and the variable `kv-indexer-sim` reads.
pub const TOKENIZER_SETTING: &str = "--tokenizer-path (KV_INDEXER_SIM_TOKENIZER_PATH)";

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot bind the {what} listener on {addr}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatError),
    #[error("cannot start the {what} socket")]
    Socket {
        what: &'static str,
        #[source]
        source: PublisherError,
    },
    #[error("the HTTP server failed")]
    Serve(#[source] std::io::Error),
}

/// The worker's sockets, bound before it starts (tests bind port 0 and read the ports back).
#[derive(Debug)]
pub struct Listeners {
    pub http: TcpListener,
    pub kv_events: std::net::TcpListener,
    pub replay: Option<std::net::TcpListener>,
}

impl Listeners {
    pub async fn bind(config: &Config) -> Result<Listeners, WorkerError> {
        let bind_std = |what, addr| {
            std::net::TcpListener::bind(addr).map_err(|source| WorkerError::Bind {
                what,
                addr,
                source,
            })
        };
        let http = TcpListener::bind(config.http_addr)
            .await
            .map_err(|source| WorkerError::Bind {
                what: "HTTP",
                addr: config.http_addr,
                source,
            })?;
        let kv_events = bind_std("KV events", config.kv_events_addr)?;
        let replay = config
            .replay_addr
            .map(|addr| bind_std("replay", addr))
            .transpose()?;
        Ok(Listeners {
            http,
            kv_events,
            replay,
        })
    }
}

/// Where the worker listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoints {
    pub http: SocketAddr,
    pub kv_events: SocketAddr,
    pub replay: Option<SocketAddr>,
}

impl Endpoints {
    /// The addresses `listeners` were bound to.
    fn of(config: &Config, listeners: &Listeners) -> Result<Endpoints, WorkerError> {
        let local = |listener: &std::net::TcpListener, what| {
            listener.local_addr().map_err(|source| WorkerError::Bind {
                what,
                addr: config.kv_events_addr,
                source,
            })
        };
        Ok(Endpoints {
            http: listeners
                .http
                .local_addr()
                .map_err(|source| WorkerError::Bind {
                    what: "HTTP",
                    addr: config.http_addr,
                    source,
                })?,
            kv_events: local(&listeners.kv_events, "KV events")?,
            replay: listeners
                .replay
                .as_ref()
                .map(|listener| local(listener, "replay"))
                .transpose()?,
        })
    }

    pub fn http_url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The PUB endpoint as a subscriber dials it.
    pub fn kv_events_url(&self) -> String {
        format!("tcp://{}", self.kv_events)
    }

    pub fn replay_url(&self) -> Option<String> {
        self.replay.map(|addr| format!("tcp://{addr}"))
    }
}

pub struct Worker {
    app: Router,
    http: TcpListener,
    endpoints: Endpoints,
    scheduler: SchedulerHandle,
    publisher_stats: Arc<PublisherStats>,
    /// Request tasks.
    requests: TaskTracker,
    /// The scheduler loop and the replay server, stopped by `stop`.
    background: JoinSet<()>,
    stop: CancellationToken,
}

impl Worker {
    /// Starts the scheduler and the sockets; HTTP is served by [`Worker::serve`] (or by calling
    /// [`Worker::router`] directly).
    pub async fn start(config: &Config, listeners: Listeners) -> Result<Worker, WorkerError> {
        let tokenizer = Tokenizer::load(TOKENIZER_SETTING, config.tokenizer_path.as_deref())?;
        let chat = match &config.tokenizer_path {
            Some(path) => ChatTemplate::load(TOKENIZER_SETTING, path)?,
            None => None,
        };
        let endpoints = Endpoints::of(config, &listeners)?;
        let socket_error = |what| move |source| WorkerError::Socket { what, source };
        let publisher = Publisher::bind(listeners.kv_events, config.publisher.clone())
            .await
            .map_err(socket_error("KV events PUB"))?;
        let publisher_stats = publisher.stats();
        let stop = CancellationToken::new();
        let mut background = JoinSet::new();
        if let Some(listener) = listeners.replay {
            let server = ReplayServer::bind(listener, publisher.replay_buffer(), publisher.topic())
                .await
                .map_err(socket_error("replay ROUTER"))?;
            background.spawn(server.run(stop.clone()));
        }
        let (scheduler, handle) = Scheduler::new(Cache::new(config.cache), publisher);
        background.spawn(scheduler.run(stop.clone()));

        let requests = TaskTracker::new();
        let engine = Engine::new(
            EngineConfig {
                hash: config.hash(),
                timing: config.timing,
                max_running: config.max_running,
            },
            handle.clone(),
            requests.clone(),
        );
        let app = http::router(AppState {
            engine,
            tokenizer: Arc::new(tokenizer),
            chat: chat.map(Arc::new),
            info: Arc::new(worker_info(config, endpoints)),
        });
        Ok(Worker {
            app,
            http: listeners.http,
            endpoints,
            scheduler: handle,
            publisher_stats,
            requests,
            background,
            stop,
        })
    }

    pub fn endpoints(&self) -> Endpoints {
        self.endpoints
    }

    /// The scheduler, to read the cache's own view ([`SchedulerHandle::snapshot`]).
    pub fn scheduler(&self) -> SchedulerHandle {
        self.scheduler.clone()
    }

    /// The HTTP API, to call without a socket.
    pub fn router(&self) -> Router {
        self.app.clone()
    }

    pub fn publisher_stats(&self) -> Arc<PublisherStats> {
        self.publisher_stats.clone()
    }

    /// Serves HTTP until `shutdown`, then drains: open connections finish, running requests
    /// finish, then the scheduler and the replay server stop.
    pub async fn serve(
        mut self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), WorkerError> {
        // Streamed chunks are small writes: without TCP_NODELAY, Nagle and the client's delayed
        // ACK hold one for up to 40 ms, which a real worker does not.
        let listener = self.http.tap_io(|tcp| {
            if let Err(error) = tcp.set_nodelay(true) {
                tracing::debug!(%error, "TCP_NODELAY on an accepted connection");
            }
        });
        let served = axum::serve(listener, self.app)
            .with_graceful_shutdown(shutdown)
            .await;
        self.requests.close();
        self.requests.wait().await;
        self.stop.cancel();
        while self.background.join_next().await.is_some() {}
        served.map_err(WorkerError::Serve)
    }
}

/// What `/server_info` and `/get_model_info` say about a worker listening on `endpoints`.
fn worker_info(config: &Config, endpoints: Endpoints) -> WorkerInfo {
    // Subscribers cannot dial a wildcard address: advertise loopback instead.
    let kv_events_ip = match endpoints.kv_events.ip() {
        ip if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        ip => ip,
    };
    WorkerInfo {
        engine: config.engine(),
        model_path: config.model_path.clone(),
        tokenizer_path: config
            .tokenizer_path
            .as_ref()
            .map(|path| path.display().to_string()),
        page_size: config.cache.page_size,
        kv_events_host: kv_events_ip.to_string(),
        kv_events_port: endpoints.kv_events.port(),
        replay_port: endpoints.replay.map(|addr| addr.port()),
        topic: config.publisher.topic.clone(),
        speculative_algorithm: config
            .speculative_algorithm
            .map(|algorithm| algorithm.as_str().to_string()),
        max_running: config.max_running,
        capacity_tokens: config.cache.capacity_tokens,
        host_capacity_tokens: config.cache.host_capacity_tokens,
        context_length: config.context_length,
        stream_interval: config.stream_interval,
    }
}

/// Starts a worker on `listeners` and serves until `shutdown`.
pub async fn run(
    config: &Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), WorkerError> {
    Worker::start(config, listeners)
        .await?
        .serve(shutdown)
        .await
}
