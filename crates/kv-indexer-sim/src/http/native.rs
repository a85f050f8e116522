//! `POST /generate`, SGLang's native API: `text` or `input_ids`,
//! `sampling_params.max_new_tokens` (default 128), `stream`, `rid`. The answer is
//! `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
//! "completion_tokens", "cached_tokens", "e2e_latency", ...}}`; a stream sends that shape with
//! the text so far, one chunk per `--stream-interval` tokens (and one for the first),
//! `finish_reason` null until the last chunk.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{AppState, HttpError, Prompt, StreamFormat, batch_unsupported, token_ids};
use crate::engine::Usage;

/// SGLang's default `max_new_tokens`.
const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

#[derive(Debug, Deserialize)]
struct GenerateBody {
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    input_ids: Option<Value>,
    #[serde(default)]
    sampling_params: Option<SamplingParams>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    rid: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct SamplingParams {
    #[serde(default)]
    max_new_tokens: Option<u64>,
}

pub async fn generate(State(state): State<AppState>, body: Bytes) -> Result<Response, HttpError> {
    let body: GenerateBody = super::parse_body(&body)?;
    let prompt = match (&body.text, &body.input_ids) {
        (Some(Value::String(text)), None) => Prompt::Text(text.clone()),
        (Some(Value::Array(_)), None) => return Err(batch_unsupported()),
        (Some(_), None) => return Err(HttpError::BadRequest("text must be a string".into())),
        (None, Some(ids)) => Prompt::Ids(token_ids(ids, "input_ids")?),
        _ => {
            return Err(HttpError::BadRequest(
                "either text or input_ids should be provided".into(),
            ));
        }
    };
    let max_new_tokens = body
        .sampling_params
        .and_then(|params| params.max_new_tokens)
        .unwrap_or(DEFAULT_MAX_NEW_TOKENS);
    let request = state.request(prompt, max_new_tokens)?;
    let rid = match body.rid {
        Some(Value::String(rid)) => rid,
        _ => state.engine.next_request_id(),
    };
    let mut chunks = Chunks {
        rid,
        max_new_tokens: request.max_new_tokens,
        stream_interval: state.info.stream_interval.max(1),
        prompt_tokens: request.input_ids.len(),
        cached_tokens: 0,
        text: String::new(),
        output_ids: Vec::new(),
    };
    let outputs = state.engine.generate(request);
    if body.stream {
        return Ok(super::sse(outputs, chunks));
    }
    let completion = super::complete(outputs).await?;
    chunks.text = completion.text;
    chunks.output_ids = completion.output_ids;
    chunks.cached_tokens = completion.usage.cached_tokens;
    Ok(Json(chunks.body(Some(&completion.usage))).into_response())
}

/// The answer so far.
struct Chunks {
    rid: String,
    max_new_tokens: usize,
    stream_interval: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    text: String,
    output_ids: Vec<u64>,
}

impl Chunks {
    fn body(&self, finished: Option<&Usage>) -> Value {
        let finish_reason =
            finished.map(|usage| json!({"type": "length", "length": usage.completion_tokens}));
        let mut meta_info = json!({
            "id": self.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": "default",
            "completion_tokens": self.output_ids.len(),
            "cached_tokens": self.cached_tokens,
        });
        if let Some(usage) = finished {
            meta_info["e2e_latency"] = json!(usage.e2e_latency.as_secs_f64());
            meta_info["queue_time"] = json!(usage.queue_time.as_secs_f64());
        }
        json!({"text": self.text, "output_ids": self.output_ids, "meta_info": meta_info})
    }
}

impl StreamFormat for Chunks {
    fn prefilled(&mut self, cached_tokens: usize) {
        self.cached_tokens = cached_tokens;
    }

    /// The first token and every `stream_interval`-th are sent at once (each chunk carries
    /// the text so far); the last one goes with `finish_reason`, as SGLang's last chunk does.
    fn token(&mut self, id: u64, text: &str) -> Option<Value> {
        self.text.push_str(text);
        self.output_ids.push(id);
        let sent = self.output_ids.len();
        let due = sent == 1 || sent.is_multiple_of(self.stream_interval);
        (due && sent < self.max_new_tokens).then(|| self.body(None))
    }

    fn finished(&mut self, usage: &Usage) -> Vec<Value> {
        vec![self.body(Some(usage))]
    }
}
