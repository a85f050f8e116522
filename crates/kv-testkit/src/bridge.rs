//! The real bridge (`kv_bridge::run`) in this process, configured through its own flags.

use std::sync::Arc;

use kv_bridge::config::{Args, BridgeConfig};
use kv_bridge::stats::Stats;
use kv_bridge::{self as bridge, BridgeError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::worker::TOPIC;

/// The bridge's flags: what every test sets, then whatever it adds.
pub struct BridgeFlags {
    argv: Vec<String>,
}

impl BridgeFlags {
    /// Follows `events` (a `tcp://` PUB on [`TOPIC`]) for `worker` and applies to `indexer`
    /// (an `http://` URL), announcing `address` as the worker's address.
    pub fn new(worker: &str, address: &str, indexer: &str, events: &str) -> BridgeFlags {
        let argv = [
            "kv-indexer-bridge",
            "--worker-id",
            worker,
            "--worker-address",
            address,
            "--endpoint",
            indexer,
            "--event-endpoint",
            events,
            "--event-topic",
            TOPIC,
        ];
        BridgeFlags {
            argv: argv.map(String::from).to_vec(),
        }
    }

    /// Adds `--replay-endpoint`.
    pub fn replay(self, endpoint: Option<String>) -> BridgeFlags {
        match endpoint {
            Some(endpoint) => self.flag("--replay-endpoint", &endpoint),
            None => self,
        }
    }

    /// Subscribes to `topic` instead of [`TOPIC`] ("" = every message).
    pub fn topic(mut self, topic: &str) -> BridgeFlags {
        let at = self
            .argv
            .iter()
            .position(|a| a == "--event-topic")
            .expect("set by new")
            + 1;
        self.argv[at] = topic.to_owned();
        self
    }

    /// Adds `name value`.
    pub fn flag(mut self, name: &str, value: &str) -> BridgeFlags {
        self.argv.extend([name.to_string(), value.to_string()]);
        self
    }

    /// The validated configuration (panics on a flag the bridge refuses).
    pub fn config(self) -> BridgeConfig {
        let args = <Args as clap::Parser>::try_parse_from(&self.argv)
            .unwrap_or_else(|error| panic!("{:?}: {error}", self.argv));
        BridgeConfig::from_args(args).unwrap_or_else(|error| panic!("{:?}: {error}", self.argv))
    }

    /// Starts a bridge with these flags.
    pub fn start(self) -> RunningBridge {
        RunningBridge::start(self.config())
    }
}

/// A bridge task with its counters; [`RunningBridge::stop`] ends it and checks it ended well.
pub struct RunningBridge {
    pub stats: Arc<Stats>,
    pub task: JoinHandle<Result<(), BridgeError>>,
    stop: CancellationToken,
}

impl RunningBridge {
    pub fn start(config: BridgeConfig) -> RunningBridge {
        let stats = Arc::new(Stats::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(bridge::run(config, stats.clone(), stop.clone()));
        RunningBridge { stats, task, stop }
    }

    /// Stops the bridge and waits until it has ended without an error.
    pub async fn stop(self) {
        self.stop.cancel();
        self.task
            .await
            .expect("the bridge task did not panic")
            .expect("the bridge stopped cleanly");
    }
}
