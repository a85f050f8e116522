//! The router under test, shared by the test files: started in-process on a loopback port from
//! a command line, and ready once it has learned the workers' block size.

use std::sync::Arc;

use clap::Parser;
use kv_indexer_router::app::AppState;
use kv_indexer_router::config::{Args, RouterConfig};
use kv_testkit::wait;
use tokio::net::TcpListener;
use tokio_util::sync::{CancellationToken, DropGuard};

pub struct TestRouter {
    pub url: String,
    pub state: Arc<AppState>,
    pub http: reqwest::Client,
    /// The router stops when this is dropped or `stop` is cancelled.
    _stop: DropGuard,
}

/// Starts the router of `argv` (the program name first), serving until `stop` is cancelled or
/// the `TestRouter` dropped; returns once the block size is learned (cache-aware routing needs
/// it).
pub async fn start<I, T>(argv: I, stop: CancellationToken) -> TestRouter
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let router = spawn(argv, stop).await;
    wait::until("the router to learn the block size", || async {
        router.state.hashing.read().is_some().then_some(())
    })
    .await;
    router
}

/// As [`start`], returning as soon as the router listens.
#[allow(dead_code)] // Not every test file starts a router before its workers.
pub async fn spawn<I, T>(argv: I, stop: CancellationToken) -> TestRouter
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let config = RouterConfig::from_args(&Args::try_parse_from(argv).unwrap()).unwrap();
    let state = kv_indexer_router::state(&config, None).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let run_state = state.clone();
    let stopped = stop.clone().cancelled_owned();
    tokio::spawn(
        async move { kv_indexer_router::run(listener, run_state, &config, stopped).await },
    );
    TestRouter {
        url,
        state,
        http: reqwest::Client::new(),
        _stop: stop.drop_guard(),
    }
}
