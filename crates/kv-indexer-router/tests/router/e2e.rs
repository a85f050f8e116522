//! The whole path on loopback, in one process: simulated SGLang workers → their bridges → the
//! Indexer server ← the router. What a user of the router relies on: affinity to the worker
//! holding a prompt's prefix, serving by load when the Indexer is gone, and a warning (and no
//! affinity) when worker URLs and bridge addresses differ.

use clap::Parser;
use kv_indexer_client::vllm_hashing::{VllmHashAlgo, VllmHasher};
use kv_indexer_router::config::{Args, RouterConfig};
use kv_indexer_router::policy::Policy;
use kv_indexer_sim::Config as SimConfig;
use kv_testkit::indexer::prefix_request;
use kv_testkit::wait;
use serde_json::{Value, json};

use crate::common::{Fleet, TestRouter, fleet, fleet_of, start_workers};

async fn router(fleet: &Fleet) -> TestRouter {
    router_with(fleet, &[]).await
}

/// As [`router`], with `extra` flags.
async fn router_with(fleet: &Fleet, extra: &[&str]) -> TestRouter {
    let mut argv = vec![
        "kv-indexer-router".to_string(),
        "--worker-urls".into(),
        fleet.workers.join(","),
        "--kv-indexer-endpoint".into(),
        fleet.indexer.url(),
        "--cache-affinity-min-matched-tokens".into(),
        "64".into(),
    ];
    argv.extend(extra.iter().map(|flag| flag.to_string()));
    crate::common::start(argv, fleet.stop.child_token()).await
}

/// What the router said about one request, and the worker's answer.
#[derive(Debug)]
struct Routed {
    worker: String,
    reason: String,
    matched_blocks: u64,
    answer: Value,
}

impl Routed {
    /// A count of a `/generate` answer's `meta_info`.
    fn meta(&self, name: &str) -> u64 {
        self.answer["meta_info"][name].as_u64().unwrap()
    }
}

impl TestRouter {
    /// `/generate` of `tokens`: the worker that served it and its `cached_tokens`.
    async fn generate_tokens(&self, tokens: &[u64]) -> (String, u64) {
        let routed = self.post(json!({"input_ids": tokens})).await;
        let cached = routed.meta("cached_tokens");
        (routed.worker, cached)
    }

    /// `/generate` of `body` (two new tokens).
    async fn post(&self, mut body: Value) -> Routed {
        body["sampling_params"] = json!({"max_new_tokens": 2});
        self.send("/generate", body).await
    }

    /// `body` to `path`, which must answer 200.
    async fn send(&self, path: &str, body: Value) -> Routed {
        let response = self
            .http
            .post(format!("{}{path}", self.url))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let header = |name| response.headers()[name].to_str().unwrap().to_string();
        let (worker, reason) = (header("x-routed-worker"), header("x-routing-reason"));
        let matched_blocks = header("x-matched-blocks").parse().unwrap();
        let answer = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
        Routed {
            worker,
            reason,
            matched_blocks,
            answer,
        }
    }

    fn logs(&self) -> &kv_indexer_router::throttle::DoublingLogs {
        match &self.state.policy {
            Policy::CacheAware(policy) => &policy.logs,
            _ => panic!("not the cache-aware policy"),
        }
    }
}

fn document(seed: u64) -> Vec<u64> {
    (0..320).map(|i| seed * 100_000 + i).collect()
}

fn with_suffix(document: &[u64], suffix: u64) -> Vec<u64> {
    let mut tokens = document.to_vec();
    tokens.extend([suffix, suffix + 1, suffix + 2]);
    tokens
}

/// Sends `tokens` again until the router routes it by the Indexer (events take a moment to
/// arrive); returns the worker and its cached tokens.
async fn until_cached(router: &TestRouter, tokens: &[u64]) -> (String, u64) {
    wait::until(
        "the prompt to reach a worker holding its prefix",
        || async {
            let (worker, cached) = router.generate_tokens(tokens).await;
            (cached > 0).then_some((worker, cached))
        },
    )
    .await
}

#[tokio::test]
async fn a_prompt_with_a_new_suffix_goes_to_the_worker_holding_its_prefix() {
    let fleet = fleet(3, |url| url.to_string()).await;
    let router = router(&fleet).await;
    let mut homes = Vec::new();
    for seed in 1..=3 {
        let (worker, cached) = router
            .generate_tokens(&with_suffix(&document(seed), 1))
            .await;
        assert_eq!(cached, 0);
        homes.push(worker);
    }
    // Least load spreads the three cold documents over the three workers.
    let mut distinct = homes.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "{homes:?}");
    for (seed, home) in (1..=3).zip(&homes) {
        let (worker, cached) = until_cached(&router, &with_suffix(&document(seed), 50)).await;
        assert_eq!(
            &worker, home,
            "document {seed} must go back where its cache is"
        );
        assert!(
            cached >= 256,
            "the worker reused the document's pages: {cached}"
        );
    }
    fleet.stop.cancel();
}

#[tokio::test]
async fn with_the_indexer_stopped_requests_are_served_by_load_and_the_fallback_is_logged() {
    let mut fleet = fleet(2, |url| url.to_string()).await;
    let router = router(&fleet).await;
    router.generate_tokens(&document(7)).await;
    fleet.indexer.shut_down().await;
    for _ in 0..4 {
        let (worker, _) = router.generate_tokens(&with_suffix(&document(7), 9)).await;
        assert!(fleet.workers.contains(&worker));
    }
    assert!(
        router.logs().fallback.total() >= 4,
        "every unreachable query falls back to load and is counted"
    );
    fleet.stop.cancel();
}

#[tokio::test]
async fn a_worker_url_that_differs_by_a_trailing_slash_gets_no_affinity_and_a_warning() {
    // The bridges announce "http://host:port/", the router knows "http://host:port".
    let fleet = fleet(2, |url| format!("{url}/")).await;
    // Without the radix tree's second opinion or the router's own predictions, either of which
    // would keep the repeats together.
    let router = router_with(
        &fleet,
        &[
            "--conversation-affinity",
            "false",
            "--kv-indexer-prediction-ttl-ms",
            "0",
        ],
    )
    .await;
    let tokens = with_suffix(&document(11), 1);
    router.generate_tokens(&tokens).await;
    wait::until("a warning about the unmatched address", || async {
        if router.logs().unknown_address.total() > 0 {
            return Some(());
        }
        router.generate_tokens(&tokens).await;
        None
    })
    .await;
    // The Indexer knows the prefix, but under an address that matches no worker: no affinity.
    let response = router
        .http
        .post(format!("{}/generate", router.url))
        .body(json!({"input_ids": tokens}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-routing-reason"], "no_usable_match");
    fleet.stop.cancel();
}

/// With a tokenizer that adds a BOS token, the router encodes a text prompt as the worker does
/// (special tokens added, as SGLang does), so its block hashes are the ones the worker
/// published: a router that left BOS out would find no match and route by load.
#[tokio::test]
async fn with_a_tokenizer_that_adds_bos_a_text_prompt_goes_to_the_worker_holding_its_prefix() {
    let tokenizer = kv_testkit::tokenizer::BosTokenizer::write("router-e2e", 1_000);
    let sim = SimConfig {
        tokenizer_path: Some(tokenizer.path.clone()),
        ..SimConfig::default()
    };
    let fleet = fleet_of(2, |url| url.to_string(), &sim).await;
    let path = tokenizer.path.to_str().unwrap();
    let router = router_with(&fleet, &["--tokenizer-path", path]).await;
    let document: String = (0..320).map(|i| format!("w{i} ")).collect();

    let first = router
        .post(json!({"text": format!("{document}w900 w901")}))
        .await;
    assert_eq!(first.meta("cached_tokens"), 0, "{first:?}");
    assert_eq!(
        first.meta("prompt_tokens"),
        1 + 322,
        "the worker adds <s>: {first:?}"
    );
    // <s> and 322 words: 20 full pages of 16, all published and applied.
    kv_testkit::wait::until("the first prompt's pages in the index", || async {
        (fleet.indexer.shared.index_stats().blocks >= 20).then_some(())
    })
    .await;

    let second = router
        .post(json!({"text": format!("{document}w950 w951")}))
        .await;
    assert_eq!(second.reason, "cache_hit", "{second:?}");
    assert_eq!(second.worker, first.worker, "{second:?}");
    assert!(second.matched_blocks >= 20, "{second:?}");
    assert!(second.meta("cached_tokens") >= 320, "{second:?}");
    fleet.stop.cancel();
}

/// A tokenizer that cannot load stops the router at start, naming the setting it read.
#[tokio::test]
async fn a_tokenizer_that_cannot_load_stops_start_up_naming_the_setting() {
    let tokenizer = kv_testkit::tokenizer::BosTokenizer::write("router-broken", 8);
    std::fs::write(&tokenizer.path, "{not a tokenizer").unwrap();
    let argv = [
        "kv-indexer-router",
        "--worker-urls",
        "http://127.0.0.1:1",
        "--tokenizer-path",
        tokenizer.path.to_str().unwrap(),
    ];
    let config = RouterConfig::from_args(&Args::try_parse_from(argv).unwrap()).unwrap();
    let Err(error) = kv_indexer_router::state(&config, None) else {
        panic!("a broken tokenizer.json must stop start-up");
    };
    assert!(
        error.to_string().contains("KV_ROUTER_TOKENIZER_PATH"),
        "{error}"
    );
}

/// The oracle source reads the workers' own caches (`/cache_prefix`): a prompt goes back to the
/// worker holding its prefix at once, with no Indexer in the way, and the conversation
/// affinity signal is not needed for it.
#[tokio::test]
async fn the_oracle_routes_by_the_workers_own_cache_views() {
    let fleet = fleet(3, |url| url.to_string()).await;
    let router = router_with(
        &fleet,
        &[
            "--cache-prefix-provider",
            "oracle",
            "--conversation-affinity",
            "false",
        ],
    )
    .await;
    let mut homes = Vec::new();
    for seed in 21..=23 {
        let routed = router
            .post(json!({"input_ids": with_suffix(&document(seed), 1)}))
            .await;
        assert_eq!(routed.reason, "no_usable_match");
        homes.push(routed.worker);
    }
    for (seed, home) in (21..=23).zip(&homes) {
        let routed = router
            .post(json!({"input_ids": with_suffix(&document(seed), 50)}))
            .await;
        assert_eq!(
            (&routed.worker, routed.reason.as_str()),
            (home, "cache_hit")
        );
        // The whole pages of the shared document: 320 tokens.
        assert_eq!(routed.meta("cached_tokens"), 320);
    }
    fleet.stop.cancel();
}

/// A chat request is routed on its rendered chat template, encoded as the worker encodes it
/// (the template writes `<s>`; no second BOS): the next turn of a conversation goes back to
/// the worker holding the first turn, which reports the cached tokens.
#[tokio::test]
async fn a_chat_turn_goes_to_the_worker_holding_the_conversation_so_far() {
    let tokenizer = kv_testkit::tokenizer::BosTokenizer::write("router-chat", 1_000);
    let config = json!({
        "bos_token": {"content": "<s>", "special": true},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w999{% endif %}",
    });
    std::fs::write(
        tokenizer.dir.join("tokenizer_config.json"),
        config.to_string(),
    )
    .unwrap();
    let sim = SimConfig {
        tokenizer_path: Some(tokenizer.dir.clone()),
        ..SimConfig::default()
    };
    let fleet = fleet_of(2, |url| url.to_string(), &sim).await;
    let dir = tokenizer.dir.to_str().unwrap();
    let router = router_with(
        &fleet,
        &["--tokenizer-path", dir, "--conversation-affinity", "false"],
    )
    .await;
    let router = &router;
    let chat = |messages: Value| async move {
        let body = json!({"messages": messages, "max_tokens": 2});
        let routed = router.send("/v1/chat/completions", body).await;
        (routed.worker, routed.reason, routed.answer["usage"].clone())
    };
    let document: String = (0..320).map(|i| format!("w{i} ")).collect();
    let turn = json!([{"role": "user", "content": document}]);
    let (first, _, usage) = chat(turn.clone()).await;
    // <s>, 320 words, w999: the template's BOS only.
    assert_eq!(usage["prompt_tokens"], 322, "{usage}");
    kv_testkit::wait::until("the first turn's pages in the index", || async {
        (fleet.indexer.shared.index_stats().blocks >= 20).then_some(())
    })
    .await;
    let next = json!([
        {"role": "user", "content": document},
        {"role": "assistant", "content": "w500"},
        {"role": "user", "content": "w501"},
    ]);
    let (second, reason, usage) = chat(next).await;
    assert_eq!(
        (second.as_str(), reason.as_str()),
        (first.as_str(), "cache_hit")
    );
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 320,
        "{usage}"
    );

    // Messages the template cannot take are the client's error.
    let response = router
        .http
        .post(format!("{}/v1/chat/completions", router.url))
        .body(json!({"messages": [{"content": "no role"}]}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    fleet.stop.cancel();
}

impl TestRouter {
    /// vLLM's `/v1/completions` of `tokens`: the worker, the routing reason and the worker's
    /// `usage.prompt_tokens_details.cached_tokens`.
    async fn complete(&self, tokens: &[u64]) -> (String, String, u64) {
        let body = json!({"model": "kv-indexer-sim", "prompt": tokens, "max_tokens": 2});
        let routed = self.send("/v1/completions", body).await;
        let details = &routed.answer["usage"]["prompt_tokens_details"];
        (
            routed.worker,
            routed.reason,
            details["cached_tokens"].as_u64().unwrap(),
        )
    }
}

/// A simulated vLLM worker (sha256 block hashes, 16 tokens a block).
fn vllm_sim() -> SimConfig {
    SimConfig::default().vllm(VllmHasher::new(VllmHashAlgo::Sha256, 16, None).unwrap())
}

#[tokio::test]
async fn one_indexer_serves_an_sglang_fleet_and_a_vllm_fleet_each_router_its_own() {
    let fleet = fleet(2, |url| url.to_string()).await;
    let vllm_workers = start_workers(
        &fleet.indexer,
        &fleet.stop,
        "vllm",
        2,
        |url| url.to_string(),
        &vllm_sim(),
    )
    .await;
    let sglang = router(&fleet).await;
    let vllm = crate::common::start(
        [
            "kv-indexer-router",
            "--engine",
            "vllm",
            "--worker-urls",
            &vllm_workers.join(","),
            "--kv-indexer-endpoint",
            &fleet.indexer.url(),
            "--cache-affinity-min-matched-tokens",
            "64",
        ],
        fleet.stop.child_token(),
    )
    .await;
    // It learned vLLM's block size and hash algorithm from the workers' /metrics.
    let learned = *vllm.state.hashing.read();
    assert_eq!(learned, Some(vllm_sim().hash()));
    // One document through both routers: each fleet caches it in its own hash space.
    let document = document(7);
    let (sglang_home, cached) = sglang.generate_tokens(&with_suffix(&document, 1)).await;
    assert_eq!(cached, 0);
    let (vllm_home, _, cached) = vllm.complete(&with_suffix(&document, 1)).await;
    assert_eq!(cached, 0);
    assert!(vllm_workers.contains(&vllm_home) && fleet.workers.contains(&sglang_home));
    // A new suffix goes back to each fleet's own home, by the Indexer.
    let (worker, cached) = until_cached(&sglang, &with_suffix(&document, 50)).await;
    assert_eq!((worker, cached >= 256), (sglang_home.clone(), true));
    let (worker, reason, cached) = wait::until("the vLLM fleet's events to arrive", || async {
        let routed = vllm.complete(&with_suffix(&document, 60)).await;
        (routed.2 > 0).then_some(routed)
    })
    .await;
    assert_eq!(
        worker, vllm_home,
        "the vLLM router found its worker's cache"
    );
    assert_eq!(reason, "cache_hit");
    assert_eq!(cached, 320, "vLLM reuses the document's 20 full blocks");
    // The Indexer's answers stay apart: vLLM's hashes of the document name only the vLLM
    // worker, SGLang's only the SGLang one, though both hold the same tokens.
    let mut client = fleet.indexer.client();
    for (hashes, home) in [
        (vllm_sim().hash().block_hashes(&document, None), &vllm_home),
        (
            SimConfig::default().hash().block_hashes(&document, None),
            &sglang_home,
        ),
    ] {
        let answer = client
            .match_external_kv_prefix(prefix_request(hashes))
            .await
            .unwrap()
            .into_inner();
        let named: Vec<&str> = answer
            .matches
            .iter()
            .map(|m| m.worker_address.as_str())
            .collect();
        assert_eq!(named, [home.as_str()]);
        assert_eq!(answer.best_prefix_blocks, 20);
    }
    fleet.stop.cancel();
}

/// A worker whose block hashes differ from the router's (here a vLLM worker started with
/// another PYTHONHASHSEED, which vLLM does not publish) serves requests, yet the Indexer's
/// answers never name it while they name the other worker: its
/// `kv_router_worker_indexer_matches_total` stays 0 (what `KvRouterWorkerNeverMatched` fires on).
#[tokio::test]
async fn a_worker_hashing_with_another_seed_is_never_matched_and_its_counter_shows_it() {
    let stop = tokio_util::sync::CancellationToken::new();
    let exposition = kv_common::telemetry::Exposition::default();
    let metrics = kv_common::telemetry::Metrics::install(exposition, &stop).unwrap();
    let indexer = kv_testkit::TestIndexer::start().await;
    let seeded =
        SimConfig::default().vllm(VllmHasher::new(VllmHashAlgo::Sha256, 16, Some("42")).unwrap());
    let mut workers = start_workers(&indexer, &stop, "same", 1, |u| u.into(), &vllm_sim()).await;
    workers.extend(start_workers(&indexer, &stop, "seeded", 1, |u| u.into(), &seeded).await);
    let argv = [
        "kv-indexer-router",
        "--engine",
        "vllm",
        "--worker-urls",
        &workers.join(","),
        "--kv-indexer-endpoint",
        &indexer.url(),
        "--cache-affinity-min-matched-tokens",
        "64",
    ];
    let router = crate::common::spawn(argv, stop.child_token(), Some(metrics.clone())).await;
    wait::until("the router to learn vLLM's hashing", || async {
        router.state.hashing.read().is_some().then_some(())
    })
    .await;
    // Documents go by load to both workers, then come back with new suffixes.
    let mut served = std::collections::BTreeSet::new();
    for seed in 0..6 {
        let document = document(200 + seed);
        served.insert(router.complete(&with_suffix(&document, 1)).await.0);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        for suffix in [10, 20] {
            router.complete(&with_suffix(&document, suffix)).await;
        }
    }
    assert_eq!(served.len(), 2, "both workers served documents: {served:?}");
    let text = metrics.render();
    let matches = |worker: &str| {
        let series = format!("kv_router_worker_indexer_matches_total{{worker=\"{worker}\"}} ");
        let line = text.lines().find(|line| line.starts_with(&series));
        line.map(|line| line[series.len()..].parse::<f64>().unwrap())
    };
    assert!(matches(&workers[0]).unwrap() > 0.0, "{text}");
    assert_eq!(matches(&workers[1]), Some(0.0), "{text}");
    stop.cancel();
}
