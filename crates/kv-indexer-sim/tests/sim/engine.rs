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

async fn load(app: &Router) -> Value {
    let request = Request::get("/get_load").body(Body::empty()).unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let ranks: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(ranks.as_array().map(Vec::len), Some(1), "{ranks}");
    ranks[0].clone()
}

#[tokio::test(start_paused = true)]
async fn get_load_reports_requests_waiting_slots_and_queued_prefill_tokens() {
    let worker = worker(1).await;
    let app = worker.router();
    let idle = json!({"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                      "num_waiting_uncached_tokens": 0});
    assert_eq!(load(&app).await, idle);
    let first = tokio::spawn(generate_owned(app.clone(), 0..64));
    let second = tokio::spawn(generate_owned(app.clone(), 1000..1032));
    tokio::time::sleep(Duration::from_millis(10)).await;
    // One runs its 64-token prefill (10 of 64 ms done: still queued work), one waits for the slot.
    assert_eq!(
        load(&app).await,
        json!({"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1, "num_tokens": 96,
               "num_waiting_uncached_tokens": 64})
    );
    tokio::time::sleep(Duration::from_millis(60)).await;
    // The first is decoding or done, the second runs its 32-token prefill.
    let during = load(&app).await;
    assert_eq!(during["num_waiting_reqs"], 0, "{during}");
    assert_eq!(during["num_waiting_uncached_tokens"], 32, "{during}");
    first.await.unwrap();
    second.await.unwrap();
    assert_eq!(load(&app).await, idle);
}

async fn generate_owned(app: Router, prompt: std::ops::Range<u64>) {
    generate(&app, prompt).await;
}
