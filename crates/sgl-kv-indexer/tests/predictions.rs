//! Predicted placements over real gRPC (`PredictExternalKv`, and `predicted` in prefix answers):
//! asked for only, kept apart from confirmed matches, never longer-lived than their TTL,
//! replaced by the worker's own events, and refused with a named field when malformed.

use std::time::Duration;

use kv_indexer_client::endpoint::Endpoint;
use kv_indexer_client::{ClientConfig, IndexerClient, PrefixOutcome};
use kv_indexer_proto::v1 as pb;
use kv_testkit::TestIndexer;
use kv_testkit::indexer::{HBM, REPORT, REVOKE, prefix_request};
use tonic::Code;

fn apply(worker: &str, kind: i32, hashes: Vec<i64>) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: worker.into(),
        seq: 1,
        actions: vec![pb::ExternalKvAction {
            r#type: kind,
            tier: HBM,
            hashes,
            ..Default::default()
        }],
        worker_address: address(worker),
        ..Default::default()
    }
}

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
        .apply_external_kv_batch(apply("a", REPORT, vec![1, 2]))
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
    let plain = client
        .match_external_kv_prefix(prefix_request(vec![1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed(&plain.matches), [(address("a"), 2)]);
    assert_eq!(plain.best_prefix_blocks, 2);
    assert!(plain.predicted.is_empty());

    let asked = client
        .match_external_kv_prefix(with_predictions(vec![1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
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
    let server = TestIndexer::start().await;
    let mut client = server.client();
    client
        .predict_external_kv(predict("a", vec![1, 2], 150))
        .await
        .unwrap();
    let answer = |client: &mut pb::kv_indexer_client::KvIndexerClient<_>| {
        let mut client = client.clone();
        async move {
            client
                .match_external_kv_prefix(with_predictions(vec![1, 2]))
                .await
                .unwrap()
                .into_inner()
        }
    };
    let before = answer(&mut client).await;
    assert_eq!(listed(&before.predicted), [(address("a"), 2)]);
    assert!(
        before.matches.is_empty(),
        "a prediction is never a placement"
    );
    tokio::time::sleep(Duration::from_millis(160)).await;
    assert!(answer(&mut client).await.predicted.is_empty());
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
        .apply_external_kv_batch(apply("a", REPORT, vec![1, 2]))
        .await
        .unwrap();
    client
        .apply_external_kv_batch(apply("a", REVOKE, vec![2]))
        .await
        .unwrap();
    let answer = client
        .match_external_kv_prefix(with_predictions(vec![1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed(&answer.matches), [(address("a"), 1)]);
    assert!(answer.predicted.is_empty(), "{:?}", answer.predicted);
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
    let answer = client
        .match_external_kv_prefix(with_predictions(vec![1]))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.predicted.is_empty());
}
