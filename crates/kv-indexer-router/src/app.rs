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
use kv_indexer_client::vllm_hashing::{VllmHashAlgo, VllmHasher};
use parking_lot::RwLock;
use serde_json::Value;
use tracing::{debug, info, warn};

use crate::config::HashingSource;
use crate::observe::{Answer, RequestMetrics};
use crate::policy::{Decision, Policy, Rejected};
use crate::workers::{LoadGuard, Recheck, Worker, Workers, prometheus_sample};

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
    // Per request: DEBUG (kv_router_decisions_total counts the same by reason).
    debug!(
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

/// Learns the workers' block hashing from the first worker that tells it (SGLang: block size
/// and bigram mode from `/server_info`; vLLM: block size and hash algorithm from `/metrics`),
/// then refuses workers whose hashing differs. Retries until it has learned, soon at first
/// ([`Recheck`]), then every `every`.
pub async fn learn_hashing(state: Arc<AppState>, every: Duration, source: HashingSource) {
    let mut recheck = Recheck::new(every);
    let mut unusable = std::collections::HashSet::new();
    loop {
        let mut learned = *state.hashing.read();
        for worker in &state.workers.list {
            let config = match worker_hashing(&state.http, &worker.url, &source).await {
                Ok(Some(config)) => config,
                Ok(None) => continue,
                Err(reason) => {
                    if unusable.insert(worker.url.clone()) {
                        warn!(url = %worker.url, %reason, "cannot follow the worker's block hashing");
                    }
                    continue;
                }
            };
            match learned {
                None => {
                    info!(url = %worker.url, ?config, "learned block hashing from the first worker");
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

/// One worker's block hashing: `Ok(None)` when it does not answer (yet), `Err` when it
/// answers with a hashing no router can follow.
async fn worker_hashing(
    http: &reqwest::Client,
    url: &str,
    source: &HashingSource,
) -> Result<Option<BlockHasher>, String> {
    let path = match source {
        HashingSource::SglangServerInfo => "/server_info",
        HashingSource::VllmMetrics { .. } => "/metrics",
    };
    let body = async {
        let response = http
            .get(format!("{url}{path}"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?;
        response.status().is_success().then_some(())?;
        response.bytes().await.ok()
    }
    .await;
    let Some(body) = body else { return Ok(None) };
    match source {
        HashingSource::SglangServerInfo => {
            let Ok(info) = serde_json::from_slice::<Value>(&body) else {
                return Ok(None);
            };
            let Some(block_size) = info["kv_events"]["block_size"]
                .as_u64()
                .or_else(|| info["page_size"].as_u64())
            else {
                return Ok(None);
            };
            let bigram = matches!(
                info["speculative_algorithm"].as_str(),
                Some("EAGLE" | "EAGLE3" | "FROZEN_KV_MTP")
            );
            Ok(Some(BlockHasher::Sglang(HashConfig {
                block_size: block_size as usize,
                bigram,
            })))
        }
        HashingSource::VllmMetrics {
            block_size,
            algo,
            seed,
        } => {
            let labels = vllm_cache_config(&String::from_utf8_lossy(&body));
            let block_size = match (block_size, labels.get("block_size")) {
                (Some(size), _) => *size,
                (None, Some(size)) => size
                    .parse()
                    .map_err(|_| format!("vllm:cache_config_info block_size {size:?}"))?,
                (None, None) => return Ok(None),
            };
            let algo = match (algo, labels.get("prefix_caching_hash_algo")) {
                (Some(algo), _) => *algo,
                (None, Some(name)) => name.parse::<VllmHashAlgo>()?,
                (None, None) => VllmHashAlgo::Sha256,
            };
            let hasher = VllmHasher::new(algo, block_size, seed.as_deref())
                .map_err(|error| error.to_string())?;
            Ok(Some(BlockHasher::Vllm(hasher)))
        }
    }
}

/// The labels of vLLM's `vllm:cache_config_info` gauge (its `CacheConfig`, one label per field),
/// from the first such series in a Prometheus text page; empty when there is none.
pub fn vllm_cache_config(text: &str) -> std::collections::HashMap<String, String> {
    let Some((_, labels, _)) = text
        .lines()
        .filter_map(prometheus_sample)
        .find(|(name, _, _)| *name == "vllm:cache_config_info")
    else {
        return Default::default();
    };
    let mut parsed = std::collections::HashMap::new();
    let mut rest = labels;
    while let Some((name, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, escaped)) = chars.next() {
                        value.push(if escaped == 'n' { '\n' } else { escaped });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        parsed.insert(name.trim_start_matches(',').trim().to_string(), value);
        rest = &after[end..];
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_cache_config_labels() {
        let page = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
            engine=\"0\",kv_offloading_backend=\"native\",note=\"a \\\"quoted\\\", comma\",\
            prefix_caching_hash_algo=\"sha256_cbor\"} 1.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n";
        let labels = vllm_cache_config(page);
        assert_eq!(labels["block_size"], "32");
        assert_eq!(labels["prefix_caching_hash_algo"], "sha256_cbor");
        assert_eq!(labels["engine"], "0");
        assert_eq!(labels["note"], "a \"quoted\", comma");
        assert!(vllm_cache_config("vllm:num_requests_running 1.0\n").is_empty());
    }
}
