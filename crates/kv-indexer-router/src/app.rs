//! The HTTP side: SGLang's `/generate` and OpenAI-style `/v1/completions` and
//! `/v1/chat/completions` proxied to the chosen worker (streams passed through as they
//! arrive), health, and metrics. A chat request is routed on the tokens of its rendered chat
//! template, encoded as the worker encodes them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use futures_util::StreamExt;
use kv_common::telemetry::Metrics;
use kv_indexer_client::BlockHasher;
use kv_indexer_client::chat::{ChatError, ChatTemplate};
use kv_indexer_client::hashing::HashConfig;
use kv_indexer_client::tokenizer::{Tokenizer, TokenizerError};
use parking_lot::RwLock;
use serde_json::Value;
use tracing::{info, warn};

use crate::observe::{Answer, RequestMetrics};
use crate::policy::{Decision, Policy, Rejected};
use crate::workers::{LoadGuard, Recheck, Worker, Workers};

pub struct AppState {
    pub workers: Arc<Workers>,
    pub policy: Policy,
    pub http: reqwest::Client,
    pub tokenizer: Tokenizer,
    /// The model's chat template (`tokenizer_config.json` beside the tokenizer), if any.
    pub chat: Option<ChatTemplate>,
    pub hashing: Arc<RwLock<Option<BlockHasher>>>,
    /// Renders `/metrics`; `None` answers 404.
    pub metrics: Option<Metrics>,
    pub observe: RequestMetrics,
    pub model_id: String,
}

/// The proxied routes, and how each finds the prompt's tokens in its JSON request.
const PROXIED: [(&str, PromptTokens); 3] = [
    ("/generate", generate_tokens),
    ("/v1/completions", completion_tokens),
    ("/v1/chat/completions", chat_tokens),
];

/// The routes proxied to a worker (a metrics label).
pub fn proxied_routes() -> impl Iterator<Item = &'static str> {
    PROXIED.iter().map(|&(route, _)| route)
}

pub fn router(state: Arc<AppState>) -> Router {
    PROXIED
        .into_iter()
        .fold(Router::new(), |app, (route, tokens)| {
            app.route(route, proxied(route, tokens))
        })
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(render_metrics))
        .with_state(state)
}

/// An answer the router gives itself, as JSON `{"error": {"message", "code"}}`: the one place
/// that chooses the router's own HTTP status codes.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("the body is not JSON")]
    NotJson,
    #[error("{0}")]
    BadRequest(&'static str),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error(
        "no healthy worker: none of the {workers} workers passes its health check (GET /health) with the first worker's block hashing"
    )]
    NoHealthyWorker { workers: usize },
    #[error(transparent)]
    Rejected(#[from] Rejected),
    #[error("worker {url} failed")]
    Worker {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("metrics are off")]
    MetricsOff,
}

impl AppError {
    pub fn status(&self) -> StatusCode {
        match self {
            AppError::NotJson
            | AppError::BadRequest(_)
            | AppError::Tokenizer(_)
            | AppError::Chat(_) => StatusCode::BAD_REQUEST,
            AppError::NoHealthyWorker { .. } | AppError::Rejected(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            AppError::Worker { .. } => StatusCode::BAD_GATEWAY,
            AppError::MetricsOff => StatusCode::NOT_FOUND,
        }
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status = self.status();
        let message = kv_common::error_chain(&self);
        let body = serde_json::json!({ "error": { "message": message, "code": status.as_u16() } });
        (status, axum::Json(body)).into_response()
    }
}

fn token_list(value: &Value) -> Option<Vec<u64>> {
    value.as_array()?.iter().map(Value::as_u64).collect()
}

/// How a route finds the prompt's tokens in its JSON request.
type PromptTokens = fn(&AppState, &Value) -> Result<Vec<u64>, AppError>;

/// A POST route proxied to the worker chosen for the prompt that `tokens` reads.
fn proxied(route: &'static str, tokens: PromptTokens) -> MethodRouter<Arc<AppState>> {
    post(
        move |State(state): State<Arc<AppState>>, body: Bytes| async move {
            let request = serde_json::from_slice::<Value>(&body).map_err(|_| AppError::NotJson)?;
            let tokens = tokens(&state, &request)?;
            forward(&state, route, body, &tokens).await
        },
    )
}

/// SGLang's `/generate`: `input_ids`, else `text`.
fn generate_tokens(state: &AppState, request: &Value) -> Result<Vec<u64>, AppError> {
    match (
        request.get("input_ids"),
        request.get("text").and_then(Value::as_str),
    ) {
        (Some(ids), _) => token_list(ids).ok_or(AppError::BadRequest(
            "input_ids must be a list of token ids",
        )),
        (None, Some(text)) => Ok(state.tokenizer.encode(text)?),
        (None, None) => Err(AppError::BadRequest("text or input_ids is required")),
    }
}

/// `/v1/completions`: the `prompt`, a text or token ids.
fn completion_tokens(state: &AppState, request: &Value) -> Result<Vec<u64>, AppError> {
    match request.get("prompt") {
        Some(Value::String(text)) => Ok(state.tokenizer.encode(text)?),
        Some(ids @ Value::Array(_)) => token_list(ids).ok_or(AppError::BadRequest(
            "prompt must be a string or a list of token ids",
        )),
        _ => Err(AppError::BadRequest("prompt is required")),
    }
}

/// `/v1/chat/completions`: the `messages` (and `tools`) rendered by the chat template.
fn chat_tokens(state: &AppState, request: &Value) -> Result<Vec<u64>, AppError> {
    let messages = request
        .get("messages")
        .ok_or(AppError::BadRequest("messages is required"))?;
    let template = state.chat.as_ref().ok_or(ChatError::Missing)?;
    let text = template.render(messages, request.get("tools"), true)?;
    Ok(state.tokenizer.encode_rendered(&text)?)
}

/// `GET /health`: 200 when the router can route a request now, that is when a worker passes
/// its health check; else 503 saying why. The Indexer is not part of it: unreachable, the
/// router routes by load, so failing its health would take every router out of service for the
/// loss of cache affinity only. The body says what the router knows: workers, routable
/// workers, and the block size once learned (`null` before; until then cache-aware routing
/// goes by load).
async fn health(State(state): State<Arc<AppState>>) -> Result<axum::Json<Value>, AppError> {
    let workers = state.workers.list.len();
    // Only workers a check has found healthy: at start they are assumed so, to route at once.
    let routable = state
        .workers
        .list
        .iter()
        .filter(|w| w.is_known_routable())
        .count();
    if routable == 0 {
        return Err(AppError::NoHealthyWorker { workers });
    }
    let block_size = state.hashing.read().map(|hashing| hashing.block_size());
    Ok(axum::Json(serde_json::json!({
        "status": "ok",
        "workers": workers,
        "routable_workers": routable,
        "block_size": block_size,
    })))
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(
        serde_json::json!({"object": "list", "data": [{"id": state.model_id, "object": "model"}]}),
    )
    .into_response()
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Result<String, AppError> {
    state
        .metrics
        .as_ref()
        .map(Metrics::render)
        .ok_or(AppError::MetricsOff)
}

/// Chooses a worker and proxies the request to it unchanged.
async fn forward(
    state: &AppState,
    route: &'static str,
    body: Bytes,
    tokens: &[u64],
) -> Result<Response, AppError> {
    let refused = |error: AppError| {
        let answer = Answer::Router {
            status: error.status().as_u16(),
        };
        state.observe.request(route, answer, &state.workers);
        error
    };
    let decision = match state.policy.choose(&state.workers, tokens).await {
        Ok(Some(decision)) => decision,
        Ok(None) => {
            return Err(refused(AppError::NoHealthyWorker {
                workers: state.workers.list.len(),
            }));
        }
        Err(rejected) => {
            warn!(%rejected, "indexer rejected the query: failing the request");
            return Err(refused(AppError::Rejected(rejected)));
        }
    };
    let worker = &state.workers.list[decision.worker];
    state.observe.decision(decision.reason.label());
    info!(
        worker = %worker.url,
        reason = decision.reason.label(),
        matched_blocks = decision.matched_blocks,
        query_blocks = decision.query_blocks,
        matched_tokens = decision.matched_tokens,
        prompt_tokens = tokens.len(),
        "routed"
    );
    let prefill_tokens = tokens.len().saturating_sub(decision.matched_tokens);
    let guard = state.workers.start(decision.worker, prefill_tokens);
    let started = Instant::now();
    let sent = state
        .http
        .post(format!("{}{route}", worker.url))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(source) => {
            warn!(worker = %worker.url, error = %source, "worker request failed");
            let error = AppError::Worker {
                url: worker.url.clone(),
                source,
            };
            let answer = Answer::Worker {
                worker: decision.worker,
                status: error.status().as_u16(),
            };
            state.observe.request(route, answer, &state.workers);
            return Err(error);
        }
    };
    let answer = Answer::Worker {
        worker: decision.worker,
        status: response.status().as_u16(),
    };
    state.observe.request(route, answer, &state.workers);
    state
        .observe
        .response_start(route, started.elapsed().as_secs_f64());
    Ok(relay(response, guard, worker, &decision))
}

/// The worker's answer passed through as it streams, with the decision in headers.
fn relay(
    response: reqwest::Response,
    guard: LoadGuard,
    worker: &Worker,
    decision: &Decision,
) -> Response {
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    // The load guard lives as long as the body stream: a streamed request stays active until
    // its last chunk, and its prefill is done when its first chunk comes.
    let mut guard = guard;
    let stream = response.bytes_stream().map(move |chunk| {
        guard.prefilled();
        chunk
    });
    let mut reply = Response::new(Body::from_stream(stream));
    *reply.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    reply.headers_mut().insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static("application/json")),
    );
    // The decision, for demos and debugging.
    let headers = reply.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&worker.url) {
        headers.insert("x-routed-worker", value);
    }
    headers.insert(
        "x-routing-reason",
        HeaderValue::from_static(decision.reason.label()),
    );
    headers.insert(
        "x-matched-blocks",
        HeaderValue::from(decision.matched_blocks),
    );
    headers.insert("x-query-blocks", HeaderValue::from(decision.query_blocks));
    headers.insert(
        "x-matched-tokens",
        HeaderValue::from(decision.matched_tokens),
    );
    reply
}

/// Learns the block size and bigram mode from the first worker whose `/server_info` answers,
/// then refuses workers whose block size differs. Retries until it has learned, soon at first
/// ([`Recheck`]), then every `every`.
pub async fn learn_hashing(state: Arc<AppState>, every: Duration) {
    let mut recheck = Recheck::new(every);
    loop {
        let mut learned = *state.hashing.read();
        for worker in &state.workers.list {
            let info = async {
                let response = state
                    .http
                    .get(format!("{}/server_info", worker.url))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .ok()?;
                serde_json::from_slice::<Value>(&response.bytes().await.ok()?).ok()
            }
            .await;
            let Some(info) = info else { continue };
            let Some(block_size) = info["kv_events"]["block_size"]
                .as_u64()
                .or_else(|| info["page_size"].as_u64())
            else {
                continue;
            };
            let bigram = matches!(
                info["speculative_algorithm"].as_str(),
                Some("EAGLE" | "EAGLE3" | "FROZEN_KV_MTP")
            );
            let config = BlockHasher::Sglang(HashConfig {
                block_size: block_size as usize,
                bigram,
            });
            match learned {
                None => {
                    info!(url = %worker.url, block_size, bigram, "learned block hashing from the first worker");
                    learned = Some(config);
                    *state.hashing.write() = learned;
                }
                Some(known) if known != config => {
                    warn!(url = %worker.url, ?config, ?known, "refusing a worker whose block hashing differs from the first worker's");
                    worker.refuse();
                }
                Some(_) => {}
            }
        }
        if learned.is_some() {
            return;
        }
        tokio::time::sleep(recheck.after(false)).await;
    }
}
