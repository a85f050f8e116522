//! Predicted placements over real gRPC (`PredictExternalKv`, and `predicted` in prefix answers):
//! asked for only, kept apart from confirmed matches, never longer-lived than their TTL,
//! replaced by the worker's own events, and refused with a named field when malformed.

use std::time::Duration;

use kv_indexer_client::endpoint::Endpoint;
use kv_indexer_client::{ClientConfig, IndexerClient, PrefixOutcome};
use kv_indexer_proto::v1 as pb;
use kv_server::config::Config;
use kv_state::clock::Clock;
use kv_testkit::TestIndexer;
use kv_testkit::indexer::{HBM, REPORT, REVOKE, action, apply_request, prefix_request};
use tonic::Code;

/// An apply of one action of `kind` at HBM by `worker` (at [`address`]).
fn apply(worker: &str, kind: i32, hashes: &[i64]) -> pb::ApplyExternalKvBatchRequest {
    apply_request(worker, vec![action(kind, HBM, hashes)])
}

/// The address `apply_request` gives `worker`.
fn address(worker: &str) -> String {
    format!("http://{worker}:30000")
}

fn predict(worker: &str, hashes: Vec<i64>, ttl_ms: u32) -> pb::PredictExternalKvRequest {
    pb::PredictExternalKvRequest {
        worker_address: address(worker),
        hashes,
        ttl_ms,
    }
}

fn with_predictions(hashes: Vec<i64>) -> pb::MatchExternalKvPrefixRequest {
    pb::MatchExternalKvPrefixRequest {
        include_predictions: Some(true),
        ..prefix_request(hashes)
    }
}

/// The server's answer to a prefix query.
async fn answer(
    server: &TestIndexer,
    request: pb::MatchExternalKvPrefixRequest,
) -> pb::MatchExternalKvPrefixResponse {
    server
        .client()
        .match_external_kv_prefix(request)
        .await
        .unwrap()
        .into_inner()
}

/// `(address, blocks)` of a list of matches.
fn listed(matches: &[pb::ExternalKvPrefixMatch]) -> Vec<(String, u32)> {
    matches
        .iter()
        .map(|m| (m.worker_address.clone(), m.matched_prefix_blocks))
        .collect()
}

#[tokio::test]
async fn predictions_are_answered_apart_only_when_asked_and_never_outrank_a_confirmed_prefix() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    client
        .apply_external_kv_batch(apply("a", REPORT, &[1, 2]))
        .await
        .unwrap();
    // b is predicted for the whole prompt, a for one block past its confirmed two.
    let recorded = client
        .predict_external_kv(predict("b", vec![1, 2, 3, 4], 60_000))
        .await
        .unwrap()
        .into_inner()
        .recorded;
    assert_eq!(recorded, 4);
    client
        .predict_external_kv(predict("a", vec![1, 2, 3], 60_000))
        .await
        .unwrap();

    // An upstream client's query: the answer is exactly the confirmed one.
    let plain = answer(&server, prefix_request(vec![1, 2, 3, 4])).await;
    assert_eq!(listed(&plain.matches), [(address("a"), 2)]);
    assert_eq!(plain.best_prefix_blocks, 2);
    assert!(plain.predicted.is_empty());

    let asked = answer(&server, with_predictions(vec![1, 2, 3, 4])).await;
    // Confirmed matches and the best prefix are unchanged by predictions.
    assert_eq!(listed(&asked.matches), [(address("a"), 2)]);
    assert_eq!(asked.best_prefix_blocks, 2);
    assert_eq!(
        listed(&asked.predicted),
        [(address("b"), 4), (address("a"), 3)]
    );

    // The Rust client returns them apart from the outcome.
    let endpoint = Endpoint::parse(&server.url()).unwrap();
    let indexer = IndexerClient::new(ClientConfig::new(vec![endpoint])).unwrap();
    let (outcome, predicted) = indexer.longest_prefix_with_predictions(&[1, 2, 3, 4]).await;
    let PrefixOutcome::Matched { matches, .. } = outcome else {
        panic!("expected a confirmed match, got {outcome:?}");
    };
    assert_eq!(matches.len(), 1);
    assert_eq!(
        predicted
            .iter()
            .map(|m| (m.worker_address.clone(), m.matched_prefix_blocks))
            .collect::<Vec<_>>(),
        [(address("b"), 4), (address("a"), 3)]
    );
    assert_eq!(
        indexer
            .predict(&address("c"), &[7], Duration::from_secs(1))
            .await
            .unwrap(),
        1
    );
}

#[tokio::test]
async fn a_prediction_never_outlives_its_ttl() {
    let clock = Clock::default();
    let mut config = Config::default();
    config.state.clock = clock.clone();
    let server = TestIndexer::with_config(config).await;
    let mut client = server.client();
    client
        .predict_external_kv(predict("a", vec![1, 2], 150))
        .await
        .unwrap();
    let before = answer(&server, with_predictions(vec![1, 2])).await;
    assert_eq!(listed(&before.predicted), [(address("a"), 2)]);
    assert!(
        before.matches.is_empty(),
        "a prediction is never a placement"
    );
    clock.advance(Duration::from_millis(160));
    let after = answer(&server, with_predictions(vec![1, 2])).await;
    assert!(after.predicted.is_empty());
}

#[tokio::test]
async fn the_workers_own_events_replace_its_predictions() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    client
        .predict_external_kv(predict("a", vec![1, 2, 3], 60_000))
        .await
        .unwrap();
    // The worker stored blocks 1 and 2, then evicted 2: the prediction of 2 must not bring
    // it back.
    client
        .apply_external_kv_batch(apply("a", REPORT, &[1, 2]))
        .await
        .unwrap();
    client
        .apply_external_kv_batch(apply("a", REVOKE, &[2]))
        .await
        .unwrap();
    let after = answer(&server, with_predictions(vec![1, 2, 3])).await;
    assert_eq!(listed(&after.matches), [(address("a"), 1)]);
    assert!(after.predicted.is_empty(), "{:?}", after.predicted);
}

#[tokio::test]
async fn a_malformed_prediction_is_refused_naming_its_field_and_records_nothing() {
    let server = TestIndexer::start().await;
    let mut client = server.client();
    let cases = [
        (predict("a", vec![1], 0), "ttl_ms"),
        (
            pb::PredictExternalKvRequest {
                worker_address: String::new(),
                ..predict("a", vec![1], 100)
            },
            "worker_address",
        ),
        (predict("a", vec![], 100), "hash"),
    ];
    for (request, field) in cases {
        let status = client.predict_external_kv(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains(field), "{}", status.message());
    }
    let after = answer(&server, with_predictions(vec![1])).await;
    assert!(after.predicted.is_empty());
}
