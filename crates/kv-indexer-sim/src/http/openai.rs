//! `POST /v1/completions`, the OpenAI API as SGLang serves it: `prompt` (a string or a list of
//! token ids; a one-element list of either is accepted), `max_tokens` (default 16), `stream`
//! and `stream_options.include_usage`. The usage reports the cache hit as
//! `usage.prompt_tokens_details.cached_tokens`.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{AppState, HttpError, Prompt, StreamFormat, batch_unsupported, token_ids};
use crate::engine::Usage;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u64 = 16;

#[derive(Debug, Deserialize)]
struct CompletionBody {
    #[serde(default)]
    model: Option<String>,
    prompt: Value,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

fn prompt(value: &Value) -> Result<Prompt, HttpError> {
    match value {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) => match items.as_slice() {
            [Value::String(text)] => Ok(Prompt::Text(text.clone())),
            [Value::Array(_)] => Ok(Prompt::Ids(token_ids(&items[0], "prompt")?)),
            items if items.iter().all(Value::is_number) => {
                Ok(Prompt::Ids(token_ids(value, "prompt")?))
            }
            _ => Err(batch_unsupported()),
        },
        _ => Err(HttpError::BadRequest(
            "prompt must be a string or a list of token ids".into(),
        )),
    }
}

pub async fn completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, HttpError> {
    let body: CompletionBody = super::parse_body(&body)?;
    let prompt = prompt(&body.prompt)?;
    let request = state.request(prompt, body.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS))?;
    let chunks = Chunks {
        id: format!("cmpl-{}", state.engine.next_request_id()),
        created: super::unix_seconds() as u64,
        model: body.model.unwrap_or_else(|| state.info.model_path.clone()),
        include_usage: body.stream_options.is_some_and(|o| o.include_usage),
        max_tokens: request.max_new_tokens,
        sent: 0,
        last: None,
    };
    let outputs = state.engine.generate(request);
    if body.stream {
        return Ok(super::sse(outputs, chunks));
    }
    let completion = super::complete(outputs).await?;
    let choice = chunks.choice(&completion.text, Some("length"));
    Ok(Json(chunks.envelope(choice, Some(&completion.usage))).into_response())
}

struct Chunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    max_tokens: usize,
    /// Tokens seen.
    sent: usize,
    /// The last token, sent with `finish_reason`.
    last: Option<String>,
}

impl Chunks {
    fn choice(&self, text: &str, finish_reason: Option<&str>) -> Value {
        json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish_reason,
            "matched_stop": null,
        })
    }

    fn envelope(&self, choice: Value, usage: Option<&Usage>) -> Value {
        let choices = if choice.is_null() {
            json!([])
        } else {
            json!([choice])
        };
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage.map(usage_body),
        })
    }
}

fn usage_body(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

impl StreamFormat for Chunks {
    fn prefilled(&mut self, _cached_tokens: usize) {}

    /// Every token but the last is sent at once; the last one goes with `finish_reason`.
    fn token(&mut self, _id: u64, text: &str) -> Option<Value> {
        self.sent += 1;
        if self.sent == self.max_tokens {
            self.last = Some(text.to_string());
            return None;
        }
        Some(self.envelope(self.choice(text, None), None))
    }

    fn finished(&mut self, usage: &Usage) -> Vec<Value> {
        let last = self.last.take().unwrap_or_default();
        let mut chunks = vec![self.envelope(self.choice(&last, Some("length")), None)];
        if self.include_usage {
            chunks.push(self.envelope(Value::Null, Some(usage)));
        }
        chunks
    }
}
