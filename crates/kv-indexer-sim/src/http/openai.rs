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
use crate::engine::{GenerateRequest, Usage};

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
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
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
    let include_usage = body.stream_options.is_some_and(|o| o.include_usage);
    let chunks = Chunks::new(&state, Api::Completion, body.model, include_usage, &request);
    answer(&state, request, chunks, body.stream).await
}

/// Runs `request` and answers in one piece or, with `stream`, as SSE chunks.
pub(super) async fn answer(
    state: &AppState,
    request: GenerateRequest,
    chunks: Chunks,
    stream: bool,
) -> Result<Response, HttpError> {
    let outputs = state.engine.generate(request);
    if stream {
        return Ok(super::sse(outputs, chunks));
    }
    let completion = super::complete(outputs).await?;
    let choice = chunks.whole(&completion.text);
    Ok(Json(chunks.envelope(choice, Some(&completion.usage), false)).into_response())
}

/// The two OpenAI answer shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    /// `/v1/completions`: `text` in each choice.
    Completion,
    /// `/v1/chat/completions`: a `message`, or in a stream a `delta` (the first with the
    /// assistant's role).
    Chat,
}

pub(super) struct Chunks {
    api: Api,
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
    pub(super) fn new(
        state: &AppState,
        api: Api,
        model: Option<String>,
        include_usage: bool,
        request: &GenerateRequest,
    ) -> Chunks {
        let prefix = match api {
            Api::Completion => "cmpl",
            Api::Chat => "chatcmpl",
        };
        Chunks {
            api,
            id: format!("{prefix}-{}", state.engine.next_request_id()),
            created: super::unix_seconds() as u64,
            model: model.unwrap_or_else(|| state.info.model_path.clone()),
            include_usage,
            max_tokens: request.max_new_tokens,
            sent: 0,
            last: None,
        }
    }

    /// The choice of a whole answer.
    fn whole(&self, text: &str) -> Value {
        match self.api {
            Api::Completion => self.streamed(text, Some("length")),
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": "length",
                "matched_stop": null,
            }),
        }
    }

    /// The choice of one stream chunk carrying `text`.
    fn streamed(&self, text: &str, finish_reason: Option<&str>) -> Value {
        match self.api {
            Api::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason,
                "matched_stop": null,
            }),
            Api::Chat => {
                let delta = if self.sent == 1 {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
            }
        }
    }

    /// One answer (`chunk` false) or one stream chunk around `choice` (none when null).
    fn envelope(&self, choice: Value, usage: Option<&Usage>, chunk: bool) -> Value {
        let choices = if choice.is_null() {
            json!([])
        } else {
            json!([choice])
        };
        let object = match (self.api, chunk) {
            (Api::Completion, _) => "text_completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
        };
        json!({
            "id": self.id,
            "object": object,
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
        Some(self.envelope(self.streamed(text, None), None, true))
    }

    fn finished(&mut self, usage: &Usage) -> Vec<Value> {
        let last = self.last.take().unwrap_or_default();
        let mut chunks = vec![self.envelope(self.streamed(&last, Some("length")), None, true)];
        if self.include_usage {
            chunks.push(self.envelope(Value::Null, Some(usage), true));
        }
        chunks
    }
}
