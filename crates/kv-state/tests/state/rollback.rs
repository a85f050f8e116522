//! A shared log rolled back under a fleet (Redis restarted from an older save, as a failover to a
//! lagging replica or a restore from backup does): the replicas find it, clear the workers whose
//! applied entries it lost, through the log, and hold nothing the worker has since dropped,
//! without waiting for the worker's bridge; its next numbered apply makes it re-sync.

use crate::common::{
    State, apply_retrying, assert_gap, numbered, replica_settings, report, revoke,
};
use kv_state::config::StateConfig;
use kv_state::stream::StreamConfig;
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;

fn settings(redis: &RedisServer) -> StateConfig {
    let stream = StreamConfig::new(&redis.url(), "test:rollback", None).unwrap();
    replica_settings(stream, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_log_leaves_no_over_claim_and_the_bridge_re_syncs() {
    let Some(mut redis) = RedisServer::start(false) else {
        return;
    };
    let (one, two) = (
        State::open(settings(&redis)).await.unwrap(),
        State::open(settings(&redis)).await.unwrap(),
    );
    wait::until_ok("the replica serves", || async { one.check() }).await;
    wait::until_ok("the replica serves", || async { two.check() }).await;
    let first: Vec<i64> = (1..=400).collect();
    one.apply(numbered(report("w", &first), 1)).await.unwrap();
    redis.command(&["SAVE"]);
    // Acknowledged after the save: the worker dropped 1-200 and stored 401-600.
    one.apply(numbered(revoke("w", &first[..200]), 2))
        .await
        .unwrap();
    let stored: Vec<i64> = (401..=600).collect();
    two.apply(numbered(report("w", &stored), 3)).await.unwrap();
    let all: Vec<i64> = (1..=600).collect();
    for state in [&one, &two] {
        wait::until_ok("both replicas hold the worker's 400 blocks", || async {
            let n = state.held(&all);
            (n == 400).then_some(()).ok_or(n)
        })
        .await;
    }

    // Redis comes back from the older save: its stream holds batch 1 only.
    redis.restart();
    for state in [&one, &two] {
        wait::until_ok(
            "the replica clears the worker it lost entries of",
            || async {
                let n = state.held(&all);
                match (state.check(), n) {
                    (Ok(()), 0) => Ok(()),
                    (fresh, n) => Err(format!("{fresh:?}, holding {n}")),
                }
            },
        )
        .await;
    }
    assert_eq!(one.digest(), two.digest());

    // The bridge's next batch is past the next the log knows: ABORTED, and it re-syncs.
    let answer = apply_retrying(&one, numbered(report("w", &[601]), 4)).await;
    assert_gap(&answer, 2, 4);
    let now: Vec<i64> = (201..=600).collect();
    apply_retrying(&two, numbered(report("w", &now), 5))
        .await
        .unwrap();
    for state in [&one, &two] {
        wait::until_ok("the re-synced worker is back on both replicas", || async {
            let n = state.held(&all);
            (n == 400).then_some(()).ok_or(n)
        })
        .await;
    }
    assert_eq!(one.digest(), two.digest());
    one.stop().await;
    two.stop().await;
}
