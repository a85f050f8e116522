//! The time model on a paused clock: cache hits shorten the prefill, prefills queue behind each
//! other, and requests beyond `max_running` wait for a slot. Virtual time only, so the durations are the model's, not the machine's.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use kv_indexer_sim::timing::TimeModel;
use kv_indexer_sim::{Config, Listeners, Worker};
use serde_json::{Value, json};
use tower::ServiceExt;

async fn worker(max_running: usize) -> Worker {
    let mut config = Config::default();
    config.cache.page_size = 16;
    config.max_running = max_running;
    config.timing = TimeModel {
        prefill_per_token: Duration::from_millis(1),
        decode_per_token: Duration::from_millis(1),
        ..TimeModel::default()
    };
    let listeners = Listeners::bind(&config).await.unwrap();
    Worker::start(&config, listeners).await.unwrap()
}

/// `(cached_tokens, queue_time, e2e_latency)` of one `/generate` of `prompt` with 4 tokens out.
async fn generate(app: &Router, prompt: std::ops::Range<u64>) -> (u64, Duration, Duration) {
    let body = json!({"input_ids": prompt.collect::<Vec<_>>(),
                      "sampling_params": {"max_new_tokens": 4}});
    let request = Request::post("/generate")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let meta = &answer["meta_info"];
    let seconds = |key: &str| Duration::from_secs_f64(meta[key].as_f64().unwrap());
    (
        meta["cached_tokens"].as_u64().unwrap(),
        seconds("queue_time"),
        seconds("e2e_latency"),
    )
}

/// `actual` is `expected` up to the timer's millisecond granularity.
fn about(actual: Duration, expected: Duration) {
    assert!(
        actual >= expected && actual < expected + Duration::from_millis(2),
        "{actual:?}, expected {expected:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn cache_hits_shorten_the_prefill() {
    let worker = worker(4).await;
    let app = worker.router();
    // 64 uncached tokens (64 ms), then 4 tokens 1 ms apart after the first.
    let (cached, queued, e2e) = generate(&app, 0..64).await;
    assert_eq!((cached, queued), (0, Duration::ZERO));
    about(e2e, Duration::from_millis(67));
    // Three pages hit (the last token is always computed): 16 tokens to prefill.
    let (cached, _, e2e) = generate(&app, 0..64).await;
    assert_eq!(cached, 48);
    about(e2e, Duration::from_millis(19));
}

#[tokio::test(start_paused = true)]
async fn requests_beyond_max_running_wait_for_a_slot() {
    let worker = worker(1).await;
    let app = worker.router();
    let (first, second) = tokio::join!(generate(&app, 0..64), generate(&app, 1000..1064));
    let mut queued = [first.1, second.1];
    queued.sort();
    assert_eq!(queued[0], Duration::ZERO);
    // The second waits for the whole first request.
    about(queued[1], Duration::from_millis(67));
    about(first.2.max(second.2), Duration::from_millis(134));
}

#[tokio::test(start_paused = true)]
async fn prefills_run_one_after_another() {
    let worker = worker(4).await;
    let app = worker.router();
    // Both get a running slot at once, but one prefill waits for the other's 64 ms.
    let (first, second) = tokio::join!(generate(&app, 0..64), generate(&app, 1000..1064));
    assert_eq!((first.1, second.1), (Duration::ZERO, Duration::ZERO));
    let mut e2e = [first.2, second.2];
    e2e.sort();
    about(e2e[0], Duration::from_millis(67));
    about(e2e[1], Duration::from_millis(131));
}
