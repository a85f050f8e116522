//! The HTTP side: SGLang's `/generate` and OpenAI-style `/v1/completions` proxied to the chosen
//! worker (streams passed through as they arrive), health, and metrics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use kv_indexer_client::hashing::HashConfig;
use metrics_exporter_prometheus::PrometheusHandle;
use parking_lot::RwLock;
use serde_json::Value;
use tracing::{info, warn};

use crate::policy::Policy;
use crate::tokenizer::Tokenizer;
use crate::workers::Workers;

pub struct AppState {
    pub workers: Arc<Workers>,
    pub policy: Policy,
    pub http: reqwest::Client,
    pub tokenizer: Tokenizer,
    pub hashing: Arc<RwLock<Option<HashConfig>>>,
    pub metrics: Option<PrometheusHandle>,
    pub model_id: String,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/metrics", get(render_metrics))
        .with_state(state)
}

/// An answer the router gives itself, as JSON `{"error": ...}`.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body =
        serde_json::json!({ "error": { "message": message.into(), "code": status.as_u16() } });
    (status, axum::Json(body)).into_response()
}

fn token_list(value: &Value) -> Option<Vec<u64>> {
    value.as_array()?.iter().map(Value::as_u64).collect()
}

async fn generate(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not JSON");
    };
    let tokens = match (
        request.get("input_ids"),
        request.get("text").and_then(Value::as_str),
    ) {
        (Some(ids), _) => match token_list(ids) {
            Some(tokens) => tokens,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "input_ids must be a list of token ids",
                );
            }
        },
        (None, Some(text)) => state.tokenizer.encode(text),
        (None, None) => return error(StatusCode::BAD_REQUEST, "text or input_ids is required"),
    };
    forward(&state, "/generate", body, &tokens).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not JSON");
    };
    let tokens = match request.get("prompt") {
        Some(Value::String(text)) => state.tokenizer.encode(text),
        Some(ids @ Value::Array(_)) => match token_list(ids) {
            Some(tokens) => tokens,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "prompt must be a string or a list of token ids",
                );
            }
        },
        _ => return error(StatusCode::BAD_REQUEST, "prompt is required"),
    };
    forward(&state, "/v1/completions", body, &tokens).await
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(
        serde_json::json!({"object": "list", "data": [{"id": state.model_id, "object": "model"}]}),
    )
    .into_response()
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    match &state.metrics {
        Some(handle) => handle.render().into_response(),
        None => error(StatusCode::NOT_FOUND, "metrics are off"),
    }
}

/// Chooses a worker and proxies the request to it unchanged.
async fn forward(state: &AppState, route: &'static str, body: Bytes, tokens: &[u64]) -> Response {
    let decision = match state.policy.choose(&state.workers, tokens).await {
        Ok(Some(decision)) => decision,
        Ok(None) => {
            metrics::counter!("kv_router_requests_total", "route" => route, "status" => "503", "worker" => "none").increment(1);
            return error(StatusCode::SERVICE_UNAVAILABLE, "no healthy worker");
        }
        Err(rejected) => {
            warn!(%rejected, "indexer rejected the query: failing the request");
            metrics::counter!("kv_router_requests_total", "route" => route, "status" => "503", "worker" => "none").increment(1);
            return error(StatusCode::SERVICE_UNAVAILABLE, rejected.to_string());
        }
    };
    let worker = &state.workers.list[decision.worker];
    metrics::counter!("kv_router_decisions_total", "reason" => decision.reason.label())
        .increment(1);
    info!(
        worker = %worker.url,
        reason = decision.reason.label(),
        matched_blocks = decision.matched_blocks,
        query_blocks = decision.query_blocks,
        matched_tokens = decision.matched_tokens,
        prompt_tokens = tokens.len(),
        "routed"
    );
    let guard = state.workers.start(decision.worker);
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
        Err(err) => {
            warn!(worker = %worker.url, error = %err, "worker request failed");
            metrics::counter!("kv_router_requests_total", "route" => route, "status" => "502", "worker" => worker.url.clone()).increment(1);
            return error(
                StatusCode::BAD_GATEWAY,
                format!("worker {} failed: {err}", worker.url),
            );
        }
    };
    let status = response.status();
    metrics::counter!("kv_router_requests_total", "route" => route, "status" => status.as_str().to_string(), "worker" => worker.url.clone()).increment(1);
    metrics::histogram!("kv_router_worker_response_start_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    // The load guard lives as long as the body stream: a streamed request stays active until
    // its last chunk.
    let stream = response.bytes_stream().map(move |chunk| {
        let _active = &guard;
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
    reply
}

/// Learns the block size and bigram mode from the first worker whose `/server_info` answers,
/// then refuses workers whose block size differs. Retries until it has learned.
pub async fn learn_hashing(state: Arc<AppState>, every: Duration) {
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
            let config = HashConfig {
                block_size: block_size as usize,
                bigram,
            };
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
        tokio::time::sleep(every).await;
    }
}
