//! The router under test, shared by the test files: started in-process on a loopback port from
//! a command line, and ready once it has learned the workers' block size; and the fleet it
//! routes to (the Indexer, simulated workers and their bridges).

use std::sync::Arc;

use clap::Parser;
use kv_bridge::stats::Stats;
use kv_common::telemetry::Metrics;
use kv_indexer_router::app::AppState;
use kv_indexer_router::config::{Args, RouterConfig};
use kv_indexer_sim::{Config as SimConfig, Listeners, Worker};
use kv_testkit::{BridgeFlags, TestIndexer, wait};
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
    let router = spawn(argv, stop, None).await;
    wait::until("the router to learn the block size", || async {
        router.state.hashing.read().is_some().then_some(())
    })
    .await;
    router
}

/// As [`start`], returning as soon as the router listens; its metrics recorded into `metrics`
/// when given.
#[allow(dead_code)] // Not every test file starts a router before its workers.
pub async fn spawn<I, T>(argv: I, stop: CancellationToken, metrics: Option<Metrics>) -> TestRouter
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let config = RouterConfig::from_args(&Args::try_parse_from(argv).unwrap()).unwrap();
    let state = kv_indexer_router::state(&config, metrics).unwrap();
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

/// The Indexer, simulated workers and their bridges, stopped together.
#[allow(dead_code)] // Not every test file starts a fleet.
pub struct Fleet {
    pub indexer: TestIndexer,
    pub workers: Vec<String>,
    pub stop: CancellationToken,
}

/// The Indexer, `n` simulated workers and a bridge for each; bridges announce `address(url)`.
#[allow(dead_code)] // Not every test file starts a fleet.
pub async fn fleet(n: usize, address: impl Fn(&str) -> String) -> Fleet {
    fleet_of(n, address, &SimConfig::default()).await
}

/// As [`fleet`], every worker started with `sim`.
#[allow(dead_code)]
pub async fn fleet_of(n: usize, address: impl Fn(&str) -> String, sim: &SimConfig) -> Fleet {
    let indexer = TestIndexer::start().await;
    let stop = CancellationToken::new();
    let workers = start_workers(&indexer, &stop, "sim", n, address, sim).await;
    Fleet {
        indexer,
        workers,
        stop,
    }
}

/// `n` workers started with `sim`, named `{name}-{i}`, and a bridge for each into `indexer`
/// (told the worker's engine); returns their URLs once the index knows them all.
#[allow(dead_code)]
pub async fn start_workers(
    indexer: &TestIndexer,
    stop: &CancellationToken,
    name: &str,
    n: usize,
    address: impl Fn(&str) -> String,
    sim: &SimConfig,
) -> Vec<String> {
    let known = indexer.shared.index_stats().workers;
    let mut workers = Vec::new();
    for i in 0..n {
        let config = sim.clone();
        let worker = Worker::start(&config, Listeners::bind(&config).await.unwrap())
            .await
            .unwrap();
        let endpoints = worker.endpoints();
        tokio::spawn(worker.serve(stop.clone().cancelled_owned()));
        let flags = BridgeFlags::new(
            &format!("{name}-{i}"),
            &address(&endpoints.http_url()),
            &indexer.url(),
            &endpoints.kv_events_url(),
        )
        .flag("--engine", config.engine());
        tokio::spawn(kv_bridge::run(
            flags.config(),
            Arc::new(Stats::default()),
            stop.clone(),
        ));
        workers.push(endpoints.http_url());
    }
    // Every bridge has registered its worker (its start-up clear reached the index).
    indexer.wait_for_workers(known + n).await;
    workers
}
