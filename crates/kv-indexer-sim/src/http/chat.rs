//! `POST /v1/chat/completions`, the OpenAI chat API as SGLang serves it: `messages` rendered by
//! the model's chat template (the `tokenizer_config.json` beside `--tokenizer-path`, with the
//! assistant's turn opened) and encoded without special tokens, `tools`, `max_tokens` or
//! `max_completion_tokens` (default 128 here: the filler needs an end), `stream` and
//! `stream_options.include_usage`. A stream starts with the assistant's role, then one content
//! delta per token.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde::Deserialize;
use serde_json::Value;

use super::openai::{Api, Chunks, StreamOptions, answer};
use super::{AppState, HttpError, Prompt};

/// Output tokens when the request sets no limit.
const DEFAULT_MAX_TOKENS: u64 = 128;

#[derive(Debug, Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    messages: Value,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

pub async fn chat_completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, HttpError> {
    let body: ChatBody = super::parse_body(&body)?;
    let template = state.chat.as_ref().ok_or_else(|| {
        HttpError::BadRequest(
            "this worker has no chat template: start it with --tokenizer-path pointing at a \
             directory whose tokenizer_config.json has a chat_template"
                .into(),
        )
    })?;
    let text = template.render(&body.messages, body.tools.as_ref(), true)?;
    let max_tokens = body
        .max_completion_tokens
        .or(body.max_tokens)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    let request = state.request(Prompt::Rendered(text), max_tokens)?;
    let include_usage = body.stream_options.is_some_and(|o| o.include_usage);
    let chunks = Chunks::new(&state, Api::Chat, body.model, include_usage, &request);
    answer(&state, request, chunks, body.stream).await
}
