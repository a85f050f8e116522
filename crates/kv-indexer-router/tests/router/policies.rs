//! The router over real sockets: fake SGLang workers (axum), the real Indexer server in-process,
//! and the router in front; every policy, the Indexer's failure classes, and streaming.

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use kv_indexer_client::hashing::{HashConfig, block_hashes};
use kv_testkit::indexer::HBM;
use kv_testkit::{Port, TestIndexer, wait};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::common::TestRouter;

const BLOCK: usize = 16;

/// A fake SGLang worker answering `/generate` with its own name, in one piece or as SSE.
async fn fake_worker(name: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    serve_fake_worker(listener, name);
    format!("http://{addr}")
}

/// [`fake_worker`] on `listener`.
fn serve_fake_worker(listener: TcpListener, name: &'static str) {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/server_info",
            get(|| async {
                axum::Json(
                    json!({"kv_events": {"block_size": BLOCK}, "speculative_algorithm": null}),
                )
            }),
        )
        .route(
            "/generate",
            post(move |body: axum::Json<Value>| async move {
                if body.get("stream").and_then(Value::as_bool) == Some(true) {
                    let chunks = [
                        "data: {\"text\":\"a\"}\n\n",
                        "data: {\"text\":\"ab\"}\n\n",
                        "data: [DONE]\n\n",
                    ];
                    let stream =
                        tokio_stream::iter(chunks.map(|c| Ok::<_, std::io::Error>(c.to_string())));
                    axum::response::Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap()
                } else {
                    axum::Json(json!({"text": name, "meta_info": {"cached_tokens": 0}}))
                        .into_response_json()
                }
            }),
        )
        .route(
            "/v1/completions",
            post(move || async move { axum::Json(json!({"worker": name})) }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
}

/// A fake SGLang worker that takes every `/generate` and never answers: its requests stay
/// queued for prefill.
async fn stuck_worker() -> String {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/server_info",
            get(|| async { axum::Json(json!({"kv_events": {"block_size": BLOCK}})) }),
        )
        .route("/generate", post(std::future::pending::<String>));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

trait IntoResponseJson {
    fn into_response_json(self) -> axum::response::Response;
}

impl IntoResponseJson for axum::Json<Value> {
    fn into_response_json(self) -> axum::response::Response {
        axum::response::IntoResponse::into_response(self)
    }
}

/// The router of `argv` (after the program name) on top of a test's defaults: cache affinity
/// from one block, health checks every second.
async fn start_router(argv: &[&str]) -> TestRouter {
    let defaults = [
        "kv-indexer-router",
        "--cache-affinity-min-matched-tokens",
        "16",
        "--health-interval-secs",
        "1",
    ];
    crate::common::start(defaults.iter().chain(argv), CancellationToken::new()).await
}

impl TestRouter {
    /// Sends a `/generate` and returns the worker that answered and the body.
    async fn generate(&self, body: Value) -> (u16, String, String) {
        let response = self.send_generate(body).await.unwrap();
        let status = response.status().as_u16();
        let worker = response
            .headers()
            .get("x-routed-worker")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, worker, response.text().await.unwrap())
    }

    /// `POST /generate`, as a future that owns what it needs (so it can be spawned and left
    /// pending).
    fn send_generate(
        &self,
        body: Value,
    ) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
        self.http
            .post(format!("{}/generate", self.url))
            .body(body.to_string())
            .send()
    }

    /// `POST /generate` of `tokens`.
    fn send_tokens(
        &self,
        tokens: Vec<u64>,
    ) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
        self.send_generate(json!({ "input_ids": tokens }))
    }
}

fn prompt(seed: u64, tokens: usize) -> Vec<u64> {
    (0..tokens as u64).map(|i| seed * 1_000_000 + i).collect()
}

async fn report(indexer: &TestIndexer, worker_url: &str, tokens: &[u64]) {
    let hashes = block_hashes(
        tokens,
        HashConfig {
            block_size: BLOCK,
            bigram: false,
        },
        None,
    );
    indexer.report(worker_url, worker_url, HBM, &hashes).await;
}

/// The Indexer, two fake workers `a` and `b`, and a router using the Indexer with `extra`
/// flags.
async fn two_workers_and_the_indexer(extra: &[&str]) -> (TestIndexer, String, String, TestRouter) {
    let indexer = TestIndexer::start().await;
    let a = fake_worker("a").await;
    let b = fake_worker("b").await;
    let router = indexer_router(&format!("{a},{b}"), &indexer.url(), extra).await;
    (indexer, a, b, router)
}

/// The Indexer, a fake worker `idle` that answers at once and one that never answers (its
/// requests stay queued).
async fn indexer_idle_and_stuck() -> (TestIndexer, String, String) {
    (
        TestIndexer::start().await,
        fake_worker("idle").await,
        stuck_worker().await,
    )
}

/// A router over the workers `urls` that asks the Indexer at `endpoint`, with `extra` flags.
async fn indexer_router(urls: &str, endpoint: &str, extra: &[&str]) -> TestRouter {
    let mut argv = vec!["--worker-urls", urls, "--kv-indexer-endpoint", endpoint];
    argv.extend_from_slice(extra);
    start_router(&argv).await
}

#[tokio::test]
async fn routes_to_the_worker_the_indexer_says_holds_the_prefix() {
    let (indexer, a, b, router) = two_workers_and_the_indexer(&[]).await;
    let cached = prompt(1, 256);
    report(&indexer, &b, &cached).await;
    for _ in 0..3 {
        let (status, worker, body) = router
            .generate(json!({"input_ids": cached, "sampling_params": {"max_new_tokens": 4}}))
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(worker, b, "the prompt must go where its cache is");
    }
    // A prompt nobody holds goes to the least loaded worker (the first, all idle).
    let (status, worker, _) = router.generate(json!({"input_ids": prompt(2, 256)})).await;
    assert_eq!((status, worker.as_str()), (200, a.as_str()));
}

#[tokio::test]
async fn a_match_below_the_affinity_threshold_routes_by_load() {
    let (indexer, a, b, router) =
        two_workers_and_the_indexer(&["--cache-affinity-min-matched-tokens", "1024"]).await;
    let cached = prompt(3, 256);
    report(&indexer, &b, &cached[..32]).await; // 2 blocks = 32 of 256 tokens
    let (_, worker, _) = router.generate(json!({"input_ids": cached})).await;
    assert_eq!(worker, a);
}

#[tokio::test]
async fn falls_back_to_load_when_the_indexer_is_unreachable() {
    // A reserved port that nothing listens on: every connection is refused.
    let dead = Port::reserve();
    let a = fake_worker("a").await;
    let b = fake_worker("b").await;
    let router = indexer_router(&format!("{a},{b}"), &dead.url(), &[]).await;
    let (status, worker, _) = router.generate(json!({"text": "hello world"})).await;
    assert_eq!((status, worker.as_str()), (200, a.as_str()));
}

#[tokio::test]
async fn a_rejected_indexer_query_fails_the_request_with_503() {
    // A gRPC server without KVIndexer answers UNIMPLEMENTED: the two sides disagree.
    let port = kv_testkit::indexer::without_kv_indexer();
    let a = fake_worker("a").await;
    let router = indexer_router(&a, &port.url(), &[]).await;
    let (status, _, body) = router.generate(json!({"input_ids": prompt(4, 64)})).await;
    assert_eq!(status, 503, "{body}");
}

#[tokio::test]
async fn round_robin_alternates_and_radix_tree_keeps_affinity() {
    let a = fake_worker("a").await;
    let b = fake_worker("b").await;
    let urls = format!("{a},{b}");
    let rr = start_router(&["--worker-urls", &urls, "--policy", "round_robin"]).await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(rr.generate(json!({"text": "x"})).await.1);
    }
    assert_eq!(seen, [a.clone(), b.clone(), a.clone(), b.clone()]);

    let radix = start_router(&["--worker-urls", &urls, "--policy", "cache_aware"]).await;
    let first = radix.generate(json!({"input_ids": prompt(5, 64)})).await.1;
    for _ in 0..3 {
        let mut longer = prompt(5, 64);
        longer.extend([7, 8, 9]);
        assert_eq!(radix.generate(json!({"input_ids": longer})).await.1, first);
    }
    assert_eq!(radix.state.workers.list.len(), 2);
}

#[tokio::test]
async fn passes_a_stream_through_and_rejects_bad_requests() {
    let a = fake_worker("a").await;
    let router = start_router(&["--worker-urls", &a, "--policy", "random"]).await;
    let (status, _, body) = router.generate(json!({"text": "hi", "stream": true})).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        "data: {\"text\":\"a\"}\n\ndata: {\"text\":\"ab\"}\n\ndata: [DONE]\n\n"
    );
    let (status, _, _) = router.generate(json!({"sampling_params": {}})).await;
    assert_eq!(status, 400);
    let response = router
        .http
        .post(format!("{}/v1/completions", router.url))
        .body(json!({"prompt": "hi"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
}

#[tokio::test]
async fn takes_unhealthy_workers_out_of_rotation() {
    // A reserved port that nothing listens on: every health check is refused.
    let port = Port::reserve();
    let dead = port.url();
    let live = fake_worker("a").await;
    let router = start_router(&[
        "--worker-urls",
        &format!("{dead},{live}"),
        "--policy",
        "round_robin",
    ])
    .await;
    // After a health round the dead worker is out of rotation.
    wait::until("the dead worker to leave the rotation", || async {
        (router.state.workers.routable() == [1]).then_some(())
    })
    .await;
    for _ in 0..3 {
        assert_eq!(router.generate(json!({"text": "x"})).await.1, live);
    }
}

/// `GET /health`: status and body.
async fn health(router: &TestRouter) -> (u16, Value) {
    let response = router
        .http
        .get(format!("{}/health", router.url))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    (status, serde_json::from_str(&body).unwrap())
}

#[tokio::test]
async fn health_says_whether_the_router_can_route_and_a_late_worker_joins_at_once() {
    // The only worker listens only after the router's first health check failed. With a
    // health interval of 10 minutes, only checking again soon after a failure brings it in.
    let port = Port::reserve();
    let router = crate::common::spawn(
        [
            "kv-indexer-router",
            "--worker-urls",
            &port.url(),
            "--health-interval-secs",
            "600",
        ],
        CancellationToken::new(),
        None,
    )
    .await;
    let body = wait::until_ok("/health to say no worker is healthy", || async {
        match health(&router).await {
            (503, body) => Ok(body),
            other => Err(other),
        }
    })
    .await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("no healthy worker"), "{message}");
    let (status, _, body) = router.generate(json!({"text": "hi"})).await;
    assert_eq!(status, 503, "{body}");

    serve_fake_worker(port.listen(), "late");
    let body = wait::until_ok("the late worker and its block size to be known", || async {
        match health(&router).await {
            (200, body) if body["block_size"] == BLOCK => Ok(body),
            other => Err(other),
        }
    })
    .await;
    assert_eq!(body["routable_workers"], 1, "{body}");
    let (status, worker, _) = router.generate(json!({"text": "hi"})).await;
    assert_eq!((status, worker), (200, port.url()));
}

#[tokio::test]
async fn matched_tokens_are_the_matched_blocks_times_the_block_size() {
    let (indexer, _a, b, router) = two_workers_and_the_indexer(&[]).await;
    // 402 tokens hash to 26 blocks, the last one partial; b holds the first 25 (400 tokens).
    let tokens = prompt(9, 402);
    report(&indexer, &b, &tokens[..400]).await;
    let response = router.send_tokens(tokens).await.unwrap();
    let headers = response.headers();
    assert_eq!(headers["x-routed-worker"], b.as_str());
    assert_eq!(headers["x-matched-blocks"], "25");
    assert_eq!(headers["x-query-blocks"], "26");
    assert_eq!(
        headers["x-matched-tokens"], "400",
        "25 blocks of 16 tokens, not 402 × 25 ÷ 26 = 386"
    );
    // A whole prompt matched, its partial last block included: at most the prompt.
    let whole = prompt(10, 402);
    report(&indexer, &b, &whole).await;
    let response = router.send_tokens(whole).await.unwrap();
    assert_eq!(response.headers()["x-matched-tokens"], "402");
}

/// A text the tokenizer cannot encode is an error answer, never a fallback to another
/// tokenizer: a WordLevel vocabulary without its unknown token fails on a word it lacks.
#[tokio::test]
async fn a_prompt_the_tokenizer_cannot_encode_is_refused_with_400() {
    let tokenizer = kv_testkit::tokenizer::BosTokenizer::write("router-no-unk", 8);
    let mut json = kv_testkit::tokenizer::bos_tokenizer_json(8);
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    vocab.remove("[UNK]");
    // The words of the load-time probe, so that the tokenizer passes it.
    for (id, word) in (20..).zip(["The", "quick", "brown", "fox"]) {
        vocab.insert(word.into(), json!(id));
    }
    std::fs::write(&tokenizer.path, json.to_string()).unwrap();
    let a = fake_worker("a").await;
    let router = start_router(&[
        "--worker-urls",
        &a,
        "--policy",
        "round_robin",
        "--tokenizer-path",
        tokenizer.path.to_str().unwrap(),
    ])
    .await;
    let (status, worker, _) = router.generate(json!({"text": "w1 w2"})).await;
    assert_eq!((status, worker.as_str()), (200, a.as_str()));
    let (status, worker, body) = router.generate(json!({"text": "w1 zebra"})).await;
    assert_eq!(status, 400, "{body}");
    assert!(worker.is_empty(), "no worker is asked: {worker}");
    assert!(body.contains("cannot tokenize the prompt"), "{body}");
}

#[tokio::test]
async fn with_no_usable_match_a_conversation_stays_where_it_went_before() {
    // The Indexer knows nothing (no worker published, and the router's own predictions off):
    // only the radix tree remembers.
    const NO_PREDICTIONS: [&str; 2] = ["--kv-indexer-prediction-ttl-ms", "0"];
    let (_indexer, a, b, router) = two_workers_and_the_indexer(&[
        "--conversation-affinity",
        "true",
        NO_PREDICTIONS[0],
        NO_PREDICTIONS[1],
    ])
    .await;
    let turn = |n: usize| {
        let mut tokens = prompt(6, 64);
        tokens.extend((0..n as u64 * 16).map(|i| 900_000 + i));
        json!({"input_ids": tokens})
    };
    let first = router.generate(turn(0)).await.1;
    for n in 1..4 {
        let response = router
            .http
            .post(format!("{}/generate", router.url))
            .body(turn(n).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.headers()["x-routed-worker"], first.as_str());
        assert_eq!(response.headers()["x-routing-reason"], "affinity");
    }
    // Another conversation goes by load: to the worker sent fewer requests.
    let other = router.generate(json!({"input_ids": prompt(7, 64)})).await.1;
    assert_ne!(other, first);
    assert!([&a, &b].contains(&&other));

    // Without affinity (the default) the turns go by load.
    let (_indexer, _, _, router) = two_workers_and_the_indexer(&NO_PREDICTIONS).await;
    let first = router.generate(turn(0)).await.1;
    assert_ne!(router.generate(turn(1)).await.1, first);
}

#[tokio::test]
async fn the_pressure_guard_moves_a_hot_prefix_off_a_worker_with_queued_prefill() {
    let (indexer, idle, stuck) = indexer_idle_and_stuck().await;
    let (urls, endpoint) = (format!("{idle},{stuck}"), indexer.url());
    // Predictions off: the guard's figures below count confirmed matches only.
    let router = indexer_router(
        &urls,
        &endpoint,
        &[
            "--pressure-abs-threshold-tokens",
            "100",
            "--pressure-rel-threshold",
            "1.5",
            "--kv-indexer-prediction-ttl-ms",
            "0",
        ],
    )
    .await;
    // The stuck worker holds the first 128 of each 256-token prompt: 128 to prefill, 128 saved.
    let hot = prompt(8, 256);
    report(&indexer, &stuck, &hot[..128]).await;
    let send = |tokens| router.send_tokens(tokens);
    // Each request goes to its cache and stays queued there, 128 tokens of pressure each,
    // until the excess over the idle worker beats the 128 tokens the cache saves plus 100.
    let first = tokio::spawn(send(hot.clone()));
    wait::until(
        "the first request to be queued on the stuck worker",
        || async { (router.state.workers.list[1].pressure() == 128).then_some(()) },
    )
    .await;
    let second = tokio::spawn(send(hot.clone()));
    wait::until(
        "the second request to be queued on the stuck worker",
        || async { (router.state.workers.list[1].pressure() == 256).then_some(()) },
    )
    .await;
    // 256 queued > 100 + 128 saved, and > 1.5 × 0: the next one gives way to the idle worker.
    let response = tokio::time::timeout(std::time::Duration::from_secs(30), send(hot.clone()))
        .await
        .expect("the guard must send the request to the idle worker, which answers")
        .unwrap();
    assert_eq!(response.headers()["x-routed-worker"], idle.as_str());
    assert_eq!(response.headers()["x-routing-reason"], "pressure_guard");
    first.abort();
    second.abort();

    // Under the threshold the cache wins.
    let router = indexer_router(
        &urls,
        &endpoint,
        &[
            "--pressure-abs-threshold-tokens",
            "200",
            "--kv-indexer-prediction-ttl-ms",
            "0",
        ],
    )
    .await;
    let pending = tokio::spawn(router.send_tokens(hot.clone()));
    wait::until("the request to be queued on the stuck worker", || async {
        (router.state.workers.list[1].pressure() == 128).then_some(())
    })
    .await;
    let second = tokio::spawn(router.send_tokens(hot));
    wait::until("the second request to queue behind the first", || async {
        (router.state.workers.list[1].pressure() == 256).then_some(())
    })
    .await;
    pending.abort();
    second.abort();
}

#[tokio::test]
async fn a_chat_request_without_a_chat_template_is_refused_with_400() {
    let a = fake_worker("a").await;
    let router = start_router(&["--worker-urls", &a, "--policy", "round_robin"]).await;
    let response = router
        .http
        .post(format!("{}/v1/chat/completions", router.url))
        .body(json!({"messages": [{"role": "user", "content": "hi"}]}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body = response.text().await.unwrap();
    assert!(body.contains("no chat template"), "{body}");
}

/// A client of `indexer`, as the router's.
fn indexer_client(indexer: &TestIndexer) -> kv_indexer_client::IndexerClient {
    let endpoint = kv_indexer_client::endpoint::Endpoint::parse(&indexer.url()).unwrap();
    kv_indexer_client::IndexerClient::new(kv_indexer_client::ClientConfig::new(vec![endpoint]))
        .unwrap()
}

/// Whether the Indexer predicts that `worker` holds the whole of `tokens`.
async fn predicted_on(indexer: &TestIndexer, worker: &str, tokens: &[u64]) -> bool {
    let hashes = block_hashes(
        tokens,
        HashConfig {
            block_size: BLOCK,
            bigram: false,
        },
        None,
    );
    let client = indexer_client(indexer);
    let (_, predicted) = client.longest_prefix_with_predictions(&hashes).await;
    predicted
        .iter()
        .any(|m| m.worker_address == worker && m.matched_prefix_blocks as usize == hashes.len())
}

#[tokio::test]
async fn a_sibling_sent_to_another_router_follows_the_prediction_of_the_first() {
    for predictions in [true, false] {
        let indexer = TestIndexer::start().await;
        let a = fake_worker("a").await;
        let b = fake_worker("b").await;
        let urls = format!("{a},{b}");
        let ttl = if predictions { "10000" } else { "0" };
        let extra = ["--kv-indexer-prediction-ttl-ms", ttl];
        let first = indexer_router(&urls, &indexer.url(), &extra).await;
        let second = indexer_router(&urls, &indexer.url(), &extra).await;
        // The second router has sent something to a: by its own count b is the idle one.
        let (_, warm, _) = second.generate(json!({"input_ids": prompt(20, 64)})).await;
        assert_eq!(warm, a);
        // The workers never report anything: only a prediction can tell where the first went.
        let leader = prompt(21, 256);
        let (_, chosen, _) = first.generate(json!({"input_ids": leader})).await;
        assert_eq!(chosen, a);
        if predictions {
            wait::until("the prediction", || async {
                predicted_on(&indexer, &a, &leader).await.then_some(())
            })
            .await;
        }
        let mut sibling = leader.clone();
        sibling.extend([1, 2, 3]);
        let response = second
            .send_tokens(sibling)
            .await
            .unwrap()
            .error_for_status()
            .unwrap();
        let header = |name: &str| response.headers()[name].to_str().unwrap().to_string();
        let (worker, reason) = (header("x-routed-worker"), header("x-routing-reason"));
        if predictions {
            assert_eq!(worker, a, "the sibling follows the prediction");
            assert_eq!(reason, "predicted_hit");
        } else {
            assert_eq!(
                worker, b,
                "without predictions the second router balances by load"
            );
            assert!(
                !predicted_on(&indexer, &a, &leader).await,
                "nothing was predicted"
            );
        }
    }
}

#[tokio::test]
async fn the_balance_guard_gives_a_hot_prefix_a_second_home() {
    let (indexer, idle, stuck) = indexer_idle_and_stuck().await;
    let (urls, endpoint) = (format!("{idle},{stuck}"), indexer.url());
    let router = indexer_router(
        &urls,
        &endpoint,
        &[
            "--balance-abs-threshold",
            "1",
            "--balance-rel-threshold",
            "1",
        ],
    )
    .await;
    let hot = prompt(30, 256);
    report(&indexer, &stuck, &hot).await;
    // Each goes to the cache and stays active there while the stuck worker's count before it is
    // at most the mean (half that count, the idle worker being at 0) plus 1: 0, 1 and 2 are.
    let mut pending = Vec::new();
    for active in 1..=3 {
        pending.push(tokio::spawn(router.send_tokens(hot.clone())));
        wait::until("the request to be active on the stuck worker", || async {
            (router.state.workers.list[1].active() == active).then_some(())
        })
        .await;
    }
    // 3 active against a mean of 1.5: more than 1 over, so the next gives way to the idle one.
    let response = router.send_tokens(hot).await.unwrap();
    assert_eq!(response.headers()["x-routed-worker"], idle.as_str());
    assert_eq!(response.headers()["x-routing-reason"], "balance");
    for request in pending {
        request.abort();
    }
}

#[tokio::test]
async fn a_prediction_never_outranks_a_confirmed_placement_of_the_same_prefix() {
    let (indexer, a, b, router) = two_workers_and_the_indexer(&[]).await;
    let tokens = prompt(40, 256);
    // b holds the prompt for sure; a is only predicted to, for the whole of it.
    report(&indexer, &b, &tokens).await;
    let hashes = block_hashes(
        &tokens,
        HashConfig {
            block_size: BLOCK,
            bigram: false,
        },
        None,
    );
    let client = indexer_client(&indexer);
    client
        .predict(&a, &hashes, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    assert!(predicted_on(&indexer, &a, &tokens).await);
    let response = router.send_tokens(tokens).await.unwrap();
    assert_eq!(response.headers()["x-routed-worker"], b.as_str());
    assert_eq!(response.headers()["x-routing-reason"], "cache_hit");
}
