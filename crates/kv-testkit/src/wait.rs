//! Waiting for a condition that a background task will make true, with a deadline: a test
//! that waits on what it needs never depends on how long a sleep happened to be.

use std::time::Duration;

/// How long a test waits for a condition before it fails.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Polls `condition` every 10 ms until it yields `Some`, and returns that; panics naming
/// `what` after [`PATIENCE`].
pub async fn until<T, F, Fut>(what: &str, mut condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(value) = condition().await {
            return value;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {PATIENCE:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
