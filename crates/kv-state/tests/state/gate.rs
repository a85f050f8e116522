//! The sequence gate through the writer and a state directory: a duplicate is acknowledged and
//! not applied twice, and a server started on an older copy of its state directory (which lost
//! batches it had acknowledged) clears the worker at the bridge's next batch instead of
//! claiming what the worker has since dropped, and replays to the same state.

use crate::common::{State, assert_gap, numbered, report, revoke};

#[tokio::test]
async fn a_retried_batch_is_acknowledged_and_not_applied_twice() {
    let dir = kv_testkit::temp_dir("kv-gate", "duplicate");
    let state = State::open_dir(&dir).await;
    state
        .apply(numbered(report("w", &[1, 2]), 1))
        .await
        .unwrap();
    state.apply(numbered(revoke("w", &[1]), 2)).await.unwrap();
    // A retry of batch 1 (its answer was lost): acknowledged, and block 1 stays revoked.
    state
        .apply(numbered(report("w", &[1, 2]), 1))
        .await
        .unwrap();
    assert_eq!(state.held(&[1, 2]), 1);
    state.apply(numbered(report("w", &[3]), 3)).await.unwrap();
    assert_eq!(state.held(&[1, 2, 3]), 2);
    state.stop().await;
}

#[tokio::test]
async fn an_older_state_directory_clears_the_worker_at_its_next_batch_and_replays_alike() {
    let dir = kv_testkit::temp_dir("kv-gate", "rolled-back");
    let state = State::open_dir(&dir).await;
    state
        .apply(numbered(report("w", &[1, 2, 3, 4]), 1))
        .await
        .unwrap();
    state.stop().await;
    let older = kv_testkit::crash_image(&dir, "kv-gate", "rolled-back-copy");
    // Acknowledged after the copy: the older directory never learns of them.
    let state = State::open_dir(&dir).await;
    state
        .apply(numbered(revoke("w", &[1, 2]), 2))
        .await
        .unwrap();
    state
        .apply(numbered(report("w", &[5, 6]), 3))
        .await
        .unwrap();
    state.stop().await;

    // The server comes back on the older copy: it claims 1 and 2, which the worker dropped.
    let state = State::open_dir(&older).await;
    let all = [1, 2, 3, 4, 5, 6, 7];
    assert_eq!(state.held(&all), 4);
    let answer = state
        .apply(numbered(report("w", &[7]), 4))
        .await
        .map(|_| ());
    assert_gap(&answer, 2, 4);
    assert_eq!(state.held(&all), 0, "nothing over-claimed");
    // The bridge re-syncs: its next batches apply on the cleared worker.
    state
        .apply(numbered(report("w", &[3, 4, 5, 6]), 5))
        .await
        .unwrap();
    assert_eq!(state.held(&all), 4);
    let digest = state.digest();
    state.stop().await;

    // Replaying the log (the gap included) gives the same state.
    let state = State::open_dir(&older).await;
    assert_eq!(state.digest(), digest);
    state.stop().await;
}
