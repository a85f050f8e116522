//! SGLang's HTTP API on the simulated worker, called through the axum router (no socket), and
//! the events it publishes for the prompts it serves (read back from its replay ROUTER).

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, header};
use futures_util::StreamExt;
use kv_events::frames::{ReplayFrame, parse_replay, replay_request};
use kv_indexer_sim::config::SpeculativeAlgorithm;
use kv_indexer_sim::timing::TimeModel;
use kv_indexer_sim::{Config, Listeners, Worker};
use kv_prompt::hashing::{HashConfig, block_hashes};
use kv_prompt::tokenize::simple_tokenize;
use serde_json::{Value, json};
use tower::ServiceExt;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const PAGE: usize = 4;

fn config() -> Config {
    let mut config = Config::default();
    config.cache.page_size = PAGE;
    config.cache.capacity_tokens = 64 * PAGE;
    config
}

async fn worker(config: Config) -> Worker {
    let listeners = Listeners::bind(&config).await.unwrap();
    Worker::start(&config, listeners).await.unwrap()
}

async fn call(app: &Router, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Bytes) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, bytes)
}

/// Starts a streamed `/generate` of `input_ids`.
async fn generate_stream(
    app: &Router,
    input_ids: Vec<u64>,
    max_new_tokens: u32,
) -> axum::response::Response {
    let body = json!({
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens},
        "stream": true,
    });
    let request = Request::post("/generate")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

async fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, bytes) = call(app, "POST", path, Some(body)).await;
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{path}: {e}: {}", String::from_utf8_lossy(&bytes)));
    (status, value)
}

async fn get(app: &Router, path: &str) -> (StatusCode, Value) {
    let (status, bytes) = call(app, "GET", path, None).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// The `data:` payloads of an SSE body, which must end with `[DONE]`, each before it as JSON.
fn sse_chunks(body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).unwrap();
    let data: Vec<&str> = text
        .split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"))
        })
        .collect();
    let (done, chunks) = data.split_last().expect("an event");
    assert_eq!(*done, "[DONE]", "{data:?}");
    chunks
        .iter()
        .map(|chunk| serde_json::from_str(chunk).unwrap())
        .collect()
}

fn ids(range: std::ops::Range<u64>) -> Vec<u64> {
    range.collect()
}

/// A worker with room for 2 pages on the device and 8 on the host.
async fn two_page_worker() -> Worker {
    let mut config = config();
    config.cache.capacity_tokens = 2 * PAGE;
    config.cache.host_capacity_tokens = 8 * PAGE;
    worker(config).await
}

/// How the simulated worker hashes its pages (no bigrams).
const HASH: HashConfig = HashConfig {
    block_size: PAGE,
    bigram: false,
};

#[tokio::test]
async fn generate_answers_in_sglang_shape_and_reports_cached_tokens() {
    let worker = worker(config()).await;
    let app = worker.router();
    let request = json!({"input_ids": ids(0..10), "sampling_params": {"max_new_tokens": 5}});
    let (status, first) = post(&app, "/generate", request.clone()).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["text"], " lorem ipsum dolor sit amet");
    assert_eq!(first["output_ids"].as_array().unwrap().len(), 5);
    let meta = &first["meta_info"];
    assert_eq!(meta["prompt_tokens"], 10);
    assert_eq!(meta["completion_tokens"], 5);
    assert_eq!(meta["cached_tokens"], 0);
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "length", "length": 5})
    );
    assert!(
        meta["id"].is_string() && meta["e2e_latency"].is_number(),
        "{meta}"
    );

    // The two whole pages are cached now.
    let (_, again) = post(&app, "/generate", request).await;
    assert_eq!(again["meta_info"]["cached_tokens"], 8);
    assert_eq!(again["text"], first["text"], "the filler is deterministic");
    // A prompt of exactly two pages: its last token is always computed, so one page is a hit.
    let (_, exact) = post(
        &app,
        "/generate",
        json!({"input_ids": ids(0..8), "rid": "r-1"}),
    )
    .await;
    assert_eq!(exact["meta_info"]["cached_tokens"], 4);
    assert_eq!(exact["meta_info"]["id"], "r-1");
    assert_eq!(
        exact["meta_info"]["completion_tokens"], 128,
        "SGLang's default"
    );
}

#[tokio::test]
async fn text_and_token_prompts_share_the_cache() {
    let worker = worker(config()).await;
    let app = worker.router();
    let text = "one two three four five six seven eight nine";
    let (_, first) = post(
        &app,
        "/generate",
        json!({"text": text, "sampling_params": {"max_new_tokens": 1}}),
    )
    .await;
    assert_eq!(first["meta_info"]["prompt_tokens"], 9);
    let (_, again) = post(
        &app,
        "/generate",
        json!({"input_ids": simple_tokenize(text), "sampling_params": {"max_new_tokens": 1}}),
    )
    .await;
    assert_eq!(again["meta_info"]["cached_tokens"], 8);
}

#[tokio::test]
async fn generate_streams_cumulative_chunks_then_done() {
    let worker = worker(config()).await;
    let app = worker.router();
    let response = generate_stream(&app, ids(0..6), 3).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let chunks = sse_chunks(&body);
    assert_eq!(chunks.len(), 3, "{chunks:?}");
    assert_eq!(chunks[0]["text"], " lorem");
    assert_eq!(chunks[1]["text"], " lorem ipsum");
    assert_eq!(chunks[2]["text"], " lorem ipsum dolor");
    assert!(chunks[0]["meta_info"]["finish_reason"].is_null());
    assert_eq!(
        chunks[2]["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 3})
    );
    assert_eq!(chunks[2]["meta_info"]["completion_tokens"], 3);
}

#[tokio::test]
async fn completions_answer_in_openai_shape_with_cached_tokens() {
    let worker = worker(config()).await;
    let app = worker.router();
    let (status, first) = post(
        &app,
        "/v1/completions",
        json!({"model": "m", "prompt": ids(0..9), "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["model"], "m");
    assert_eq!(first["choices"][0]["text"], " lorem ipsum");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(
        first["usage"],
        json!({"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let (_, again) = post(
        &app,
        "/v1/completions",
        json!({"prompt": [ids(0..9)], "max_tokens": 2}),
    )
    .await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    assert_eq!(again["model"], "kv-indexer-sim");
    let (_, text) = post(&app, "/v1/completions", json!({"prompt": "a b c"})).await;
    assert_eq!(text["usage"]["completion_tokens"], 16, "OpenAI's default");
}

#[tokio::test]
async fn completions_stream_deltas_usage_then_done() {
    let worker = worker(config()).await;
    let app = worker.router();
    let body = json!({"prompt": "a b c d e", "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, bytes) = call(&app, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_chunks(&bytes);
    let (usage, deltas) = chunks.split_last().unwrap();
    let text: String = deltas
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, " lorem ipsum dolor");
    assert!(
        deltas[..deltas.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
    assert_eq!(
        deltas.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(usage["usage"]["prompt_tokens"], 5);
}

#[tokio::test]
async fn rejects_bad_requests_with_a_json_error() {
    let mut config = config();
    config.context_length = 100;
    let worker = worker(config).await;
    let app = worker.router();
    for (path, body) in [
        ("/generate", json!({})),
        ("/generate", json!({"text": "a", "input_ids": [1]})),
        ("/generate", json!({"text": ["a", "b"]})),
        ("/generate", json!({"input_ids": [[1, 2], [3]]})),
        ("/generate", json!({"input_ids": [1, -2]})),
        ("/generate", json!({"input_ids": []})),
        ("/generate", json!({"text": "   "})),
        (
            "/generate",
            json!({"input_ids": ids(0..90), "sampling_params": {"max_new_tokens": 11}}),
        ),
        ("/v1/completions", json!({"prompt": {"a": 1}})),
        ("/v1/completions", json!({"prompt": ["a", "b"]})),
        ("/v1/completions", json!({"max_tokens": 3})),
    ] {
        let (status, error) = post(&app, path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {error}");
        assert_eq!(error["object"], "error");
        assert_eq!(error["code"], 400);
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (status, _) = call(&app, "POST", "/generate", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "an empty body");
}

#[tokio::test]
async fn server_info_describes_the_kv_event_stream() {
    let mut config = config();
    config.replay_addr = Some("127.0.0.1:0".parse().unwrap());
    config.speculative_algorithm = Some(SpeculativeAlgorithm::Eagle);
    let worker = worker(config).await;
    let endpoints = worker.endpoints();
    let (status, info) = get(&worker.router(), "/server_info").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        info["kv_events"],
        json!({
            "endpoint_host": "127.0.0.1",
            "endpoint_port_base": endpoints.kv_events.port(),
            "topic": "kv-events",
            "block_size": PAGE,
            "dp_size": 1,
            "replay_endpoint_port_base": endpoints.replay.unwrap().port(),
        })
    );
    assert_eq!(info["speculative_algorithm"], "EAGLE");
    assert_eq!(info["page_size"], PAGE);
    let (_, alias) = get(&worker.router(), "/get_server_info").await;
    assert_eq!(alias["kv_events"], info["kv_events"]);

    let plain = self::worker(self::config()).await;
    let (_, info) = get(&plain.router(), "/server_info").await;
    assert!(info["speculative_algorithm"].is_null());
    assert!(info["kv_events"].get("replay_endpoint_port_base").is_none());
}

#[tokio::test]
async fn health_and_model_info_answer() {
    let worker = worker(config()).await;
    let app = worker.router();
    let (status, body) = call(&app, "GET", "/health", None).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 0));
    let (status, info) = get(&app, "/get_model_info").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info["model_path"], "kv-indexer-sim");
    assert_eq!(info["is_generation"], true);
    let (_, models) = get(&app, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], "kv-indexer-sim");
}

#[tokio::test]
async fn flush_cache_is_refused_while_a_request_runs() {
    let mut config = config();
    // The second token would come an hour later: the request stays running.
    config.timing = TimeModel {
        prefill_per_token: Duration::ZERO,
        decode_per_token: Duration::from_secs(3600),
        ..TimeModel::default()
    };
    let worker = worker(config).await;
    let app = worker.router();
    let response = generate_stream(&app, ids(0..8), 2).await;
    let mut stream = response.into_body().into_data_stream();
    // The first token comes at once (the second one an hour later).
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"), "{first:?}");

    let (status, text) = call(&app, "POST", "/flush_cache", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.starts_with(b"Cache flushed."));
    assert!(!worker.scheduler().snapshot().await.unwrap().held.is_empty());

    // The client goes away: the request ends and releases its pages.
    drop(stream);
    let start = Instant::now();
    loop {
        let (status, _) = call(&app, "POST", "/flush_cache", None).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(worker.scheduler().snapshot().await.unwrap().held.is_empty());
}

/// The hashes of every `BlockStored` the worker published, read from its replay buffer.
async fn published_stores(replay: std::net::SocketAddr) -> Vec<Vec<i64>> {
    let mut dealer = DealerSocket::new();
    dealer.connect(&format!("tcp://{replay}")).await.unwrap();
    let frames: Vec<Bytes> = replay_request(0).into_iter().map(Bytes::from).collect();
    dealer
        .send(ZmqMessage::try_from(frames).unwrap())
        .await
        .unwrap();
    let mut stores = Vec::new();
    loop {
        let frames = dealer.recv().await.unwrap().into_vec();
        match parse_replay(&frames).unwrap() {
            ReplayFrame::End => return stores,
            ReplayFrame::Batch { payload, .. } => {
                for event in kv_events::decode_batch(payload).unwrap().events {
                    if let kv_events::Event::BlockStored(stored) = event {
                        assert_eq!(stored.block_size as usize, PAGE);
                        stores.push(stored.block_hashes);
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn publishes_the_prompt_pages_with_sglang_block_hashes() {
    for speculative in [None, Some(SpeculativeAlgorithm::Eagle3)] {
        let mut config = config();
        config.replay_addr = Some("127.0.0.1:0".parse().unwrap());
        config.speculative_algorithm = speculative;
        let worker = worker(config).await;
        let prompt = ids(100..111);
        let (status, _) = post(
            &worker.router(),
            "/generate",
            json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let bigram = speculative.is_some();
        let hash = HashConfig {
            block_size: PAGE,
            bigram,
        };
        // 11 tokens: two whole pages (of tokens, or of the 10 bigrams).
        let covered = if bigram { 9 } else { 8 };
        let want = block_hashes(&prompt[..covered], hash, None);
        assert_eq!(want.len(), 2);
        let stores = published_stores(worker.endpoints().replay.unwrap()).await;
        assert_eq!(stores, [want], "speculative {speculative:?}");
    }
}

#[tokio::test]
async fn cache_view_lists_the_held_block_hashes_per_tier() {
    let worker = two_page_worker().await;
    let app = worker.router();

    let (status, empty) = get(&app, "/cache_view").await;
    assert_eq!(status, StatusCode::OK, "{empty}");
    assert_eq!(empty["page_size"], PAGE);
    assert_eq!(empty["tiers"], json!({"GPU": [], "CPU_PINNED": []}));

    let first = ids(0..9);
    let (status, _) = post(
        &app,
        "/generate",
        json!({"input_ids": first, "sampling_params": {"max_new_tokens": 1}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let mut first_hashes = block_hashes(&first[..8], HASH, None);
    first_hashes.sort_unstable();
    let (_, view) = get(&app, "/cache_view").await;
    assert_eq!(view["tiers"]["GPU"], json!(first_hashes));
    assert_eq!(view["tiers"]["CPU_PINNED"], json!([]));

    // A second prompt needs the device's two pages: the first prompt's move to the host.
    let second = ids(50..59);
    post(
        &app,
        "/generate",
        json!({"input_ids": second, "sampling_params": {"max_new_tokens": 1}}),
    )
    .await;
    let mut second_hashes = block_hashes(&second[..8], HASH, None);
    second_hashes.sort_unstable();
    let (_, view) = get(&app, "/cache_view").await;
    assert_eq!(view["tiers"]["GPU"], json!(second_hashes));
    assert_eq!(view["tiers"]["CPU_PINNED"], json!(first_hashes));
    assert_eq!(view["stats"]["device_evictions"], 2);
    // The same view as the scheduler's.
    let held = worker.scheduler().snapshot().await.unwrap().held;
    assert_eq!(held.values().map(|set| set.len()).sum::<usize>(), 4);
}

#[tokio::test]
async fn cache_prefix_counts_the_held_leading_pages_per_tier() {
    let worker = two_page_worker().await;
    let app = worker.router();
    let prefix = |hashes: Vec<i64>| {
        let app = app.clone();
        async move {
            let (status, answer) = post(&app, "/cache_prefix", json!({ "hashes": hashes })).await;
            assert_eq!(status, StatusCode::OK, "{answer}");
            (answer["device_pages"].clone(), answer["host_pages"].clone())
        }
    };
    let first = block_hashes(&ids(0..8), HASH, None);
    assert_eq!(prefix(first.clone()).await, (json!(0), json!(0)));
    for prompt in [ids(0..9), ids(50..59)] {
        let body = json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}});
        assert_eq!(post(&app, "/generate", body).await.0, StatusCode::OK);
    }
    // The second prompt took the device: the first one's two pages are on the host.
    assert_eq!(prefix(first.clone()).await, (json!(0), json!(2)));
    let second = block_hashes(&ids(50..58), HASH, None);
    assert_eq!(prefix(second.clone()).await, (json!(2), json!(0)));
    // A prompt continuing the second one: its leading pages only.
    let longer = block_hashes(&ids(50..62), HASH, None);
    assert_eq!(prefix(longer).await, (json!(2), json!(0)));
    // Asking changed nothing.
    assert_eq!(prefix(first).await, (json!(0), json!(2)));
    let (status, error) = post(&app, "/cache_prefix", json!({"hashes": "x"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
}

#[tokio::test]
async fn generate_streams_one_chunk_per_stream_interval() {
    let mut config = config();
    config.stream_interval = 4;
    let worker = worker(config).await;
    let app = worker.router();
    let response = generate_stream(&app, ids(0..6), 10).await;
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let counts: Vec<u64> = sse_chunks(&body)
        .iter()
        .map(|chunk| chunk["meta_info"]["completion_tokens"].as_u64().unwrap())
        .collect();
    // The first token at once, then every 4th, then the last with finish_reason.
    assert_eq!(counts, [1, 4, 8, 10]);
}

/// A model directory: the test's BOS tokenizer and a tokenizer_config.json whose chat template
/// writes `<s>` itself, then `role content` per message.
fn chat_model(name: &str) -> kv_testkit::tokenizer::BosTokenizer {
    let tokenizer = kv_testkit::tokenizer::BosTokenizer::write(name, 100);
    let config = json!({
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}",
    });
    std::fs::write(
        tokenizer.dir.join("tokenizer_config.json"),
        config.to_string(),
    )
    .unwrap();
    tokenizer
}

/// A worker serving the chat model `chat_model(name)`, and that model (kept for the worker's
/// life).
async fn chat_worker(name: &str) -> (kv_testkit::tokenizer::BosTokenizer, Worker) {
    let model = chat_model(name);
    let mut config = config();
    config.tokenizer_path = Some(model.dir.clone());
    let worker = worker(config).await;
    (model, worker)
}

#[tokio::test]
async fn chat_completions_render_the_chat_template_and_share_the_cache() {
    let (_model, worker) = chat_worker("sim-chat").await;
    let app = worker.router();
    let words =
        |range: std::ops::Range<u32>| range.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let first = json!([{"role": "user", "content": words(0..20)}]);
    let (status, answer) = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": first, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        " lorem ipsum dolor"
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    // "<s> user w0 … w19 assistant": one BOS (the template's; none added on encoding).
    assert_eq!(answer["usage"]["prompt_tokens"], 23);
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // The next turn extends the rendered prompt: its leading pages are cached.
    let second = json!([
        {"role": "user", "content": words(0..20)},
        {"role": "assistant", "content": "w50"},
        {"role": "user", "content": "w51"},
    ]);
    let (_, answer) = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": second, "max_completion_tokens": 1}),
    )
    .await;
    assert_eq!(answer["usage"]["prompt_tokens"], 27);
    // 22 tokens ("<s> user w0 … w19 w" … up to "assistant") shared: 5 whole pages of 4.
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        20
    );
}

#[tokio::test]
async fn chat_completions_stream_role_then_deltas_usage_and_done() {
    let (_model, worker) = chat_worker("sim-chat-stream").await;
    let app = worker.router();
    let body = json!({"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (status, bytes) = call(&app, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_chunks(&bytes);
    assert_eq!(chunks.len(), 4, "{chunks:?}");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": " lorem"})
    );
    assert_eq!(
        chunks[1]["choices"][0]["delta"],
        json!({"content": " ipsum"})
    );
    assert_eq!(
        chunks[2]["choices"][0]["delta"],
        json!({"content": " dolor"})
    );
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(chunks[3]["usage"]["prompt_tokens"], 4);
}

#[tokio::test]
async fn chat_completions_without_a_template_or_with_bad_messages_are_refused() {
    let worker = worker(config()).await;
    let app = worker.router();
    let (status, error) = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("no chat template"),
        "{error}"
    );

    let (_model, worker) = chat_worker("sim-chat-bad").await;
    let app = worker.router();
    let (status, error) = post(&app, "/v1/chat/completions", json!({"messages": "hi"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("messages must be a list"),
        "{error}"
    );
}
