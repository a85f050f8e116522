//! The router's start-up: its state built from the configuration (the worker registry, the
//! Indexer's client, the tokenizer and chat template, the policy), and its HTTP server.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use axum::serve::ListenerExt;
use kv_common::telemetry::Metrics;
use kv_indexer_client::chat::{ChatError, ChatTemplate};
use kv_indexer_client::tokenizer::{Tokenizer, TokenizerError};
use kv_indexer_client::{ClientConfig, ClientError, IndexerClient};
use parking_lot::{Mutex, RwLock};
use tokio::net::TcpListener;

use crate::app::AppState;
use crate::config::{Engine, PolicyName, PrefixProvider, RouterConfig, TOKENIZER_SETTING};
use crate::observe::{IndexerMetrics, RequestMetrics};
use crate::policy::{CacheAware, Policy, PrefixSource};
use crate::radix::RadixTree;
use crate::workers::{LoadSource, Recheck, Workers};
use crate::{app, observe, policy, workers};

/// Why the router cannot start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("--kv-indexer-endpoint (KV_INDEXER_ENDPOINT)")]
    Indexer(#[source] ClientError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatError),
    #[error("building the HTTP client")]
    HttpClient(#[source] reqwest::Error),
    #[error("serving HTTP")]
    Serve(#[source] std::io::Error),
}

/// Builds the router's state from a validated config. `metrics` serves `/metrics`; install it
/// before calling this, as the state describes the metrics and registers their handles (the
/// series known at start at 0: [`observe`]).
pub fn state(
    config: &RouterConfig,
    metrics: Option<Metrics>,
) -> Result<Arc<AppState>, RouterError> {
    observe::describe();
    let hashing = Arc::new(RwLock::new(config.hashing.fixed()));
    let http = reqwest::Client::builder()
        .build()
        .map_err(RouterError::HttpClient)?;
    let policy = match config.policy {
        PolicyName::CacheAware => {
            let source = match (config.provider, &config.indexer) {
                (PrefixProvider::Indexer, Some(endpoints)) => {
                    let mut client_config = ClientConfig::new(endpoints.clone());
                    client_config.query_timeout = config.query_timeout;
                    client_config.max_inflight = config.query_max_inflight;
                    client_config.security = config.indexer_security.clone();
                    let metrics = IndexerMetrics::default();
                    metrics.register(&policy::query_outcomes());
                    PrefixSource::Indexer {
                        client: Arc::new(
                            IndexerClient::new(client_config).map_err(RouterError::Indexer)?,
                        ),
                        metrics,
                        prediction_ttl: config.prediction_ttl,
                    }
                }
                (PrefixProvider::Oracle, _) => PrefixSource::Oracle { http: http.clone() },
                _ => PrefixSource::Radix,
            };
            let with_tree = matches!(source, PrefixSource::Radix) || config.conversation_affinity;
            Policy::CacheAware(Box::new(CacheAware {
                source,
                hashing: hashing.clone(),
                tree: with_tree.then(|| Mutex::new(RadixTree::new(config.radix_max_tokens))),
                selection: config.selection,
                min_load_choices: config.min_load_choices,
                load_tie_tokens: config.load_tie_tokens,
                logs: Default::default(),
            }))
        }
        PolicyName::RoundRobin => Policy::RoundRobin(AtomicUsize::new(0)),
        PolicyName::Random => Policy::Random,
        PolicyName::PowerOfTwo => Policy::PowerOfTwo,
    };
    if config.tokenizer_path.is_none() {
        tracing::warn!(
            "no {TOKENIZER_SETTING}: text prompts are split into words as the simulated worker (kv-indexer-sim) does; in front of real SGLang or vLLM workers their block hashes never match the Indexer's, so no prompt is routed to its cache: give the model's tokenizer.json"
        );
    }
    let tokenizer = Tokenizer::load(TOKENIZER_SETTING, config.tokenizer_path.as_deref())?;
    let chat = match &config.tokenizer_path {
        Some(path) => ChatTemplate::load(TOKENIZER_SETTING, path)?,
        None => None,
    };
    let observe = RequestMetrics::default();
    observe.register(
        &app::proxied_routes().collect::<Vec<_>>(),
        &policy.reasons(),
    );
    Ok(Arc::new(AppState {
        workers: Arc::new(Workers::new(&config.worker_urls)),
        policy,
        http,
        tokenizer,
        chat,
        hashing,
        metrics,
        observe,
        model_id: config.model_id.clone(),
    }))
}

/// Serves the router on `listener` until `shutdown`, with health checks and hashing discovery
/// in the background: each checks again soon after a failure ([`Recheck`]), so workers that
/// start listening after the router are routed to at once.
pub async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    config: &RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let stop = tokio_util::sync::CancellationToken::new();
    let mut background = tokio::task::JoinSet::new();
    {
        let (state, every, stop) = (state.clone(), config.health_interval, stop.clone());
        background.spawn(async move {
            let mut recheck = Recheck::new(every);
            loop {
                let passed = state.workers.check_health(&state.http, every).await;
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(recheck.after(passed)) => {}
                }
            }
        });
    }
    // Learned from the workers, unless the flags gave all of it.
    if config.hashing.fixed().is_none() {
        let (state, every, stop) = (state.clone(), config.health_interval, stop.clone());
        let source = config.hashing.clone();
        background.spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = app::learn_hashing(state, every, source) => {}
            }
        });
    }
    if let Some(every) = config.worker_load_interval {
        let (workers, http, stop) = (state.workers.clone(), state.http.clone(), stop.clone());
        let source = match config.engine {
            Engine::Vllm => LoadSource::VllmMetrics,
            Engine::Sglang => LoadSource::SglangGetLoad,
        };
        background.spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = workers::poll_loads(workers, http, every, source) => {}
            }
        });
    }
    // Streamed answers are small writes: without TCP_NODELAY, Nagle holds each one until the
    // client acknowledges the last, and a client's delayed ACK adds up to 40 ms to the time to
    // first token.
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY on an accepted connection");
        }
    });
    let result = axum::serve(listener, app::router(state))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(RouterError::Serve);
    stop.cancel();
    while background.join_next().await.is_some() {}
    result
}
