//! `KV_INDEXER_EVENT_LOG_MIN_REPLICAS`: an append is answered only once that many Redis
//! replicas hold it; with fewer it is refused (UNAVAILABLE to the bridge, which retries, and
//! the retry is no second apply: the sequence gate takes it as a duplicate).

use crate::common::{State, apply_retrying, numbered, replica_settings, report};
use kv_state::config::StateConfig;
use kv_state::error::ChangeError;
use kv_state::stream::StreamConfig;
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;

fn settings(primary: &RedisServer, min_replicas: u32) -> StateConfig {
    let stream = StreamConfig::new(&primary.url(), "test:replicas", None).unwrap();
    replica_settings(stream.with_min_replicas(min_replicas), None)
}

/// Entries in the stream as `server` has it.
fn entries(server: &RedisServer) -> i64 {
    match server.command(&["XLEN", "test:replicas"]) {
        redis::Value::Int(n) => n,
        other => panic!("XLEN answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_is_answered_once_the_replicas_hold_it_and_refused_without_them() {
    let Some(primary) = RedisServer::start(false) else {
        return;
    };
    let mut replica = RedisServer::start_replica_of(&primary).unwrap();
    let state = State::open(settings(&primary, 1)).await.unwrap();
    wait::until_ok("the replica serves", || async { state.check() }).await;

    // Answered only once the Redis replica holds it (retried while it still syncs).
    apply_retrying(&state, numbered(report("w", &[1, 2]), 1))
        .await
        .unwrap();
    assert!(entries(&replica) >= 1, "the Redis replica holds the entry");
    assert_eq!(state.held(&[1, 2]), 2);

    // Without its replica an append is refused; the bridge's retry, once the replica is back,
    // is acknowledged and applied once.
    replica.kill();
    let refused = state.apply(numbered(report("w", &[3]), 2)).await;
    assert!(
        matches!(refused, Err(ChangeError::SharedLog(_))),
        "{refused:?}"
    );
    replica.restart();
    apply_retrying(&state, numbered(report("w", &[3]), 2))
        .await
        .unwrap();
    assert_eq!(state.held(&[1, 2, 3]), 3);
    state.stop().await;

    // Asking for more replicas than there are refuses every append.
    let state = State::open(settings(&primary, 2)).await.unwrap();
    wait::until_ok("the replica serves", || async { state.check() }).await;
    let refused = state.apply(numbered(report("w", &[4]), 3)).await;
    assert!(
        matches!(refused, Err(ChangeError::SharedLog(_))),
        "{refused:?}"
    );
    state.stop().await;
}
