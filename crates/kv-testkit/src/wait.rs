//! Waiting for a condition that a background task will make true, with a deadline: a test
//! that waits on what it needs never depends on how long a sleep happened to be.

use std::fmt::Debug;
use std::time::Duration;

/// How long a test waits for a condition before it fails.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(10);

/// Polls `condition` every 10 ms until it yields `Some`, and returns that; panics naming
/// `what` after [`PATIENCE`].
pub async fn until<T, F, Fut>(what: &str, mut condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    until_ok(what, || {
        let attempt = condition();
        async move { attempt.await.ok_or("not yet") }
    })
    .await
}

/// Like [`until`], for a condition that says what it saw instead: the panic after
/// [`PATIENCE`] shows the last `Err`.
pub async fn until_ok<T, E, F, Fut>(what: &str, mut condition: F) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match condition().await {
            Ok(value) => return value,
            Err(last) if tokio::time::Instant::now() >= deadline => {
                panic!("timed out after {PATIENCE:?} waiting for {what}; last saw {last:?}")
            }
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}
