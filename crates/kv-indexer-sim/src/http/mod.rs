//! SGLang's HTTP API, as much of it as routers and benchmarks use:
//!
//! - `POST /generate`: the native API ([`native`]);
//! - `POST /v1/completions`: the OpenAI API ([`openai`]);
//! - `POST /v1/chat/completions`: the OpenAI chat API, the prompt rendered by the model's chat
//!   template ([`chat`]);
//! - `GET /server_info` (and `/get_server_info`), `GET /get_model_info`, `GET /v1/models`,
//!   `GET /health` (and `/health_generate`), `GET|POST /flush_cache`;
//! - `GET /get_load`: SGLang's per-rank load list (`dp_rank`, `num_reqs`, `num_waiting_reqs`,
//!   `num_tokens`) with `num_waiting_uncached_tokens`, the queued prefill work, as SGLang's
//!   `LoadStat` event carries it; routers poll it to balance on the fleet's load, not only
//!   on what they sent themselves;
//! - `GET /cache_view`: not SGLang's; the cache's own view (block hashes held per tier, as
//!   published so far), for tests that compare an index with the worker;
//! - with `--engine vllm`, vLLM's API instead of SGLang's: the OpenAI routes, `GET /v1/models`
//!   (`owned_by: vllm`), `GET /health`, `POST /reset_prefix_cache`, and `GET /metrics` with
//!   vLLM's `vllm:num_requests_running` and `vllm:num_requests_waiting` gauges (what routers
//!   poll for load); none of SGLang's native routes;
//! - `POST /cache_prefix`: not SGLang's either; `{"hashes": [...]}` (a prompt's chained page
//!   hashes) answers how many leading pages the cache holds on the device and then on the host,
//!   the router's perfect-knowledge source in benchmarks (`--cache-prefix-provider oracle`).
//!
//! Both generation endpoints answer at once or stream server-sent events (`data: {...}`
//! chunks, then `data: [DONE]`). Every error is a JSON body built in one place,
//! [`HttpError`]'s `IntoResponse`.

pub mod chat;
pub mod native;
pub mod openai;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use kv_prompt::BlockHasher;
use kv_prompt::chat::{ChatError, ChatTemplate};
use kv_prompt::tokenizer::{Tokenizer, TokenizerError};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{Engine, GenerateRequest, Output, Usage};
use crate::events::Medium;
use crate::scheduler::FlushError;

/// What `/server_info` and `/get_model_info` describe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    /// `sglang` or `vllm`: whose API is served.
    pub engine: &'static str,
    pub model_path: String,
    pub tokenizer_path: Option<String>,
    pub page_size: usize,
    /// The KV event endpoint subscribers connect to.
    pub kv_events_host: String,
    pub kv_events_port: u16,
    pub replay_port: Option<u16>,
    pub topic: String,
    /// SGLang's `--speculative-algorithm` (bigram hashing), if any.
    pub speculative_algorithm: Option<String>,
    pub max_running: usize,
    pub capacity_tokens: usize,
    pub host_capacity_tokens: usize,
    /// Prompt plus output tokens allowed per request.
    pub context_length: usize,
    /// Output tokens per streamed `/generate` chunk (SGLang's `--stream-interval`).
    pub stream_interval: usize,
}

#[derive(Debug, Clone)]
pub struct AppState {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template of the tokenizer's `tokenizer_config.json`, if it has one.
    pub chat: Option<Arc<ChatTemplate>>,
    pub info: Arc<WorkerInfo>,
}

/// Request bodies up to this size: a long prompt of token ids takes ~10 bytes a token.
const MAX_BODY_BYTES: usize = 64 << 20;

pub fn router(state: AppState) -> Router {
    let common = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health));
    let engine = if state.info.engine == "vllm" {
        common
            .route("/metrics", get(vllm_metrics))
            .route("/reset_prefix_cache", post(reset_prefix_cache))
    } else {
        common
            .route("/generate", post(native::generate))
            .route("/server_info", get(server_info))
            .route("/get_server_info", get(server_info))
            .route("/get_model_info", get(model_info))
            .route("/health_generate", get(health))
            .route("/get_load", get(get_load))
            .route("/flush_cache", get(flush_cache).post(flush_cache))
    };
    engine
        .route("/cache_view", get(cache_view))
        .route("/cache_prefix", post(cache_prefix))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error("the worker is shutting down")]
    Stopped,
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self {
            HttpError::BadRequest(_) | HttpError::Tokenizer(_) | HttpError::Chat(_) => {
                (StatusCode::BAD_REQUEST, "BadRequestError")
            }
            HttpError::Stopped => (StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError"),
        };
        let mut message = self.to_string();
        let mut source = std::error::Error::source(&self);
        while let Some(error) = source {
            message = format!("{message}: {error}");
            source = error.source();
        }
        let body = json!({
            "object": "error",
            "message": message,
            "type": kind,
            "param": null,
            "code": status.as_u16(),
        });
        (status, Json(body)).into_response()
    }
}

/// A prompt as a request gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u64>),
    /// A rendered chat template: encoded without special tokens.
    Rendered(String),
}

impl AppState {
    /// The engine request for `prompt`, after the checks SGLang makes.
    fn request(&self, prompt: Prompt, max_new_tokens: u64) -> Result<GenerateRequest, HttpError> {
        let input_ids = match prompt {
            Prompt::Text(text) => self.tokenizer.encode(&text)?,
            Prompt::Rendered(text) => self.tokenizer.encode_rendered(&text)?,
            Prompt::Ids(ids) => ids,
        };
        if input_ids.is_empty() {
            return Err(HttpError::BadRequest("the input is empty".into()));
        }
        let total = (input_ids.len() as u64).saturating_add(max_new_tokens);
        if total > self.info.context_length as u64 {
            return Err(HttpError::BadRequest(format!(
                "requested {total} tokens ({} in the input, {max_new_tokens} to generate), \
                 more than the context length of {} tokens",
                input_ids.len(),
                self.info.context_length
            )));
        }
        Ok(GenerateRequest {
            input_ids,
            max_new_tokens: max_new_tokens as usize,
        })
    }
}

/// A token-id list from JSON: `[1, 2, 3]`; a list of lists is a batch.
fn token_ids(value: &Value, field: &str) -> Result<Vec<u64>, HttpError> {
    let Value::Array(items) = value else {
        return Err(HttpError::BadRequest(format!(
            "{field} must be a list of token ids"
        )));
    };
    if items.iter().any(Value::is_array) {
        return Err(batch_unsupported());
    }
    items
        .iter()
        .map(|item| {
            item.as_u64().ok_or_else(|| {
                HttpError::BadRequest(format!("{field} must hold non-negative integers"))
            })
        })
        .collect()
}

fn batch_unsupported() -> HttpError {
    HttpError::BadRequest("batch requests are not supported by the simulated worker".into())
}

fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, HttpError> {
    serde_json::from_slice(body)
        .map_err(|error| HttpError::BadRequest(format!("invalid request body: {error}")))
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A whole answer, read off the engine's output stream.
struct Completion {
    text: String,
    output_ids: Vec<u64>,
    usage: Usage,
}

async fn complete(mut outputs: mpsc::Receiver<Output>) -> Result<Completion, HttpError> {
    let mut text = String::new();
    let mut output_ids = Vec::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Prefilled { .. } => {}
            Output::Token { id, text: piece } => {
                text.push_str(piece);
                output_ids.push(id);
            }
            Output::Finished(usage) => {
                return Ok(Completion {
                    text,
                    output_ids,
                    usage,
                });
            }
        }
    }
    Err(HttpError::Stopped)
}

/// How one API turns engine outputs into stream chunks.
trait StreamFormat: Send + 'static {
    fn prefilled(&mut self, cached_tokens: usize);
    fn token(&mut self, id: u64, text: &str) -> Option<Value>;
    /// The last chunks (`data: [DONE]` follows them).
    fn finished(&mut self, usage: &Usage) -> Vec<Value>;
}

/// Server-sent events of a request's outputs; a worker that stops mid-stream ends it without
/// `[DONE]`. Dropping the stream (the client went away) cancels the request.
fn sse(outputs: mpsc::Receiver<Output>, format: impl StreamFormat) -> Response {
    struct Cursor<F> {
        outputs: mpsc::Receiver<Output>,
        format: F,
        pending: VecDeque<String>,
        ended: bool,
    }
    let cursor = Cursor {
        outputs,
        format,
        pending: VecDeque::new(),
        ended: false,
    };
    let stream = futures_util::stream::unfold(cursor, |mut cursor| async move {
        loop {
            if let Some(data) = cursor.pending.pop_front() {
                let event = Ok::<_, Infallible>(SseEvent::default().data(data));
                return Some((event, cursor));
            }
            if cursor.ended {
                return None;
            }
            match cursor.outputs.recv().await? {
                Output::Prefilled { cached_tokens } => cursor.format.prefilled(cached_tokens),
                Output::Token { id, text } => {
                    if let Some(chunk) = cursor.format.token(id, text) {
                        cursor.pending.push_back(chunk.to_string());
                    }
                }
                Output::Finished(usage) => {
                    let last = cursor.format.finished(&usage);
                    cursor.pending.extend(last.iter().map(Value::to_string));
                    cursor.pending.push_back("[DONE]".into());
                    cursor.ended = true;
                }
            }
        }
    });
    Sse::new(stream).into_response()
}

async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let info = &state.info;
    let mut kv_events = json!({
        "endpoint_host": info.kv_events_host,
        "endpoint_port_base": info.kv_events_port,
        "topic": info.topic,
        "block_size": info.page_size,
        "dp_size": 1,
    });
    let mut kv_events_config = json!({
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{}", info.kv_events_port),
        "topic": info.topic,
    });
    if let Some(port) = info.replay_port {
        kv_events["replay_endpoint_port_base"] = json!(port);
        kv_events_config["replay_endpoint"] = json!(format!("tcp://*:{port}"));
    }
    Json(json!({
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "served_model_name": info.model_path,
        "page_size": info.page_size,
        "speculative_algorithm": info.speculative_algorithm,
        "dp_size": 1,
        "tp_size": 1,
        "dcp_size": 1,
        "max_running_requests": info.max_running,
        "max_total_num_tokens": info.capacity_tokens,
        "context_length": info.context_length,
        "stream_interval": info.stream_interval,
        "enable_hierarchical_cache": info.host_capacity_tokens > 0,
        "hicache_size_tokens": info.host_capacity_tokens,
        "kv_events_config": kv_events_config.to_string(),
        "kv_events": kv_events,
        "running_requests": state.engine.running(),
        "version": concat!("kv-indexer-sim ", env!("CARGO_PKG_VERSION")),
    }))
}

async fn model_info(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "model_path": state.info.model_path,
        "tokenizer_path": state.info.tokenizer_path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": null,
        "architectures": null,
    }))
}

async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.info.model_path,
            "object": "model",
            "created": unix_seconds() as u64,
            "owned_by": state.info.engine,
            "root": state.info.model_path,
            "max_model_len": state.info.context_length,
        }],
    }))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// One rank (the simulated worker has no data parallelism).
async fn get_load(State(state): State<AppState>) -> Json<Value> {
    let load = state.engine.load();
    Json(json!([{
        "dp_rank": 0,
        "num_reqs": load.requests,
        "num_waiting_reqs": load.waiting,
        "num_tokens": load.tokens,
        "num_waiting_uncached_tokens": load.waiting_uncached_tokens,
    }]))
}

/// vLLM's scheduler gauges and its `vllm:cache_config_info` (the block size and hash algorithm
/// routers learn), in Prometheus text as its `/metrics` writes them (the rest of its metrics are
/// not simulated).
async fn vllm_metrics(State(state): State<AppState>) -> String {
    let load = state.engine.load();
    let hash = state.engine.config().hash;
    let algo = match hash {
        BlockHasher::Vllm(hasher) => hasher.algo().name(),
        BlockHasher::Sglang(_) => "sha256",
    };
    let engine = format!("engine=\"0\",model_name=\"{}\"", state.info.model_path);
    let cache_config = format!(
        "block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",prefix_caching_hash_algo=\"{algo}\"",
        hash.block_size()
    );
    let gauge = |name: &str, help: &str, labels: &str, value: usize| {
        format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value}.0\n")
    };
    [
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &engine,
            load.requests - load.waiting,
        ),
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &engine,
            load.waiting,
        ),
        gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            &cache_config,
            1,
        ),
    ]
    .concat()
}

/// vLLM's `POST /reset_prefix_cache`: 200 when reset, 400 while requests run (the simulated
/// cache, like SGLang's, will not drop pinned pages).
async fn reset_prefix_cache(State(state): State<AppState>) -> Result<StatusCode, HttpError> {
    match state.engine.scheduler().flush().await {
        Ok(()) => Ok(StatusCode::OK),
        Err(FlushError::Busy(_)) => Ok(StatusCode::BAD_REQUEST),
        Err(FlushError::Stopped(_)) => Err(HttpError::Stopped),
    }
}

/// SGLang's text, and its codes: 200 when flushed, 400 when requests are running.
async fn flush_cache(
    State(state): State<AppState>,
) -> Result<(StatusCode, &'static str), HttpError> {
    const TEXT: &str = "Cache flushed.\nPlease check backend logs for more details. (When there \
                        are running or waiting requests, the operation will not be performed.)\n";
    match state.engine.scheduler().flush().await {
        Ok(()) => Ok((StatusCode::OK, TEXT)),
        Err(FlushError::Busy(_)) => Ok((StatusCode::BAD_REQUEST, TEXT)),
        Err(FlushError::Stopped(_)) => Err(HttpError::Stopped),
    }
}

/// The block hashes the cache holds per tier (`"GPU"`, `"CPU_PINNED"`; every tier listed, sorted
/// ascending), read after a scheduler step, so every change it shows is already published.
async fn cache_view(State(state): State<AppState>) -> Result<Json<Value>, HttpError> {
    let snapshot = state
        .engine
        .scheduler()
        .snapshot()
        .await
        .map_err(|_| HttpError::Stopped)?;
    let mut tiers = serde_json::Map::new();
    for medium in [Medium::Gpu, Medium::CpuPinned] {
        let hashes: Vec<i64> = snapshot
            .held
            .get(&medium)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        tiers.insert(medium.as_str().to_string(), json!(hashes));
    }
    let stats = snapshot.stats;
    Ok(Json(json!({
        "page_size": state.info.page_size,
        "tiers": tiers,
        "stats": {
            "device_pages": stats.device_pages,
            "host_pages": stats.host_pages,
            "pinned_pages": stats.pinned_pages,
            "stored": stats.stored,
            "device_evictions": stats.device_evictions,
            "host_evictions": stats.host_evictions,
        },
    })))
}

#[derive(Debug, serde::Deserialize)]
struct PrefixBody {
    hashes: Vec<i64>,
}

/// The cached prefix of a prompt's page hashes, per tier, as the next admission would find it.
async fn cache_prefix(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, HttpError> {
    let body: PrefixBody = parse_body(&body)?;
    let prefix = state
        .engine
        .scheduler()
        .prefix(body.hashes)
        .await
        .map_err(|_| HttpError::Stopped)?;
    Ok(Json(json!({
        "page_size": state.info.page_size,
        "device_pages": prefix.device_pages,
        "host_pages": prefix.host_pages,
    })))
}
